"""Cache kinds, analyzer side: each kind's config facts, cache entries, memory groups and decision in one module.

The render side of the same kinds lives in ``implementer/kinds/``; the group block math every kind sizes its pools
with stays in ``analyzer/kv_cache_spec.py``.
"""

from __future__ import annotations

from model_infer_kvcache.analyzer.kinds.invariants import (  # noqa: F401
    DIFF_CACHES,
    INDEXER_KEY_CACHE,
    QSA_CACHES,
    kind_problems,
)

# The attention formats a manifest's attention layers share, as every tool names them: DeepSeek sparse attention
# (MLA + an indexer), MLA (latent + rope part), GQA/MHA/MQA (K/V caches), DeepSeek-V4's compressed attention (a
# shared K=V window branch + CSA / HCA compressed branches).
# Qwen4-Exp's QSA (GQA + a block-selecting indexer). DiffLlama's differential attention (GQA K/V as two half-head
# caches each, four FA calls).
DSA, MLA, GQA, COMPRESSED, QSA, DIFF = "dsa", "mla", "gqa", "compressed", "qsa", "differential"


def attention_format(m) -> str:
    """The one place that reads which attention format a manifest plans (the implementer's and the validators'
    kind modules are looked up by it)."""
    if getattr(m, "compressed", None) is not None:
        return COMPRESSED
    if m.dsa is not None:
        return DSA
    if getattr(m, "qsa", None) is not None:
        return QSA
    if getattr(m, "differential", None) is not None:
        return DIFF
    return MLA if m.mla.enabled else GQA


def own_entries(m) -> tuple[str, ...]:
    """Cache entries of an attention layer that are not K/V rows of its heads (QSA's indexer keys: one head of the
    indexer's width, checked by analyzer/kinds/invariants.py)."""
    return QSA_CACHES if getattr(m, "qsa", None) is not None else ()


def fa_kv_heads(m, plan) -> int:
    """num_key_value_heads an FA call of ``plan``'s layer passes: 1 for MLA's latent (whole on every rank), else the
    layer's KV heads per rank."""
    if m.mla.enabled:
        return 1
    heads = plan.num_kv_heads_per_rank or m.parallel.num_kv_heads_per_rank
    return heads // 2 if getattr(m, "differential", None) is not None else heads  # a half-head cache per call


def fa_q_heads(m) -> int:
    """num_heads an FA call passes: the rank's query heads, half of them on differential attention (each call
    serves the query heads of one KV-head half)."""
    q = m.parallel.num_q_heads_per_rank
    return q // 2 if getattr(m, "differential", None) is not None else q


def holds_states(m) -> bool:
    """The manifest plans recurrent states (a hybrid's linear layers)."""
    return m.linear_attention is not None or any(layer.is_state for layer in m.layers)


def holds_cross(m) -> bool:
    """The manifest plans cross-attention slots (the decoder of an encoder-decoder model)."""
    return getattr(m, "cross_attention", None) is not None


def holds_chunks(m) -> bool:
    """The manifest plans chunked local attention layers (Llama-4's RoPE layers)."""
    return any(layer.is_chunked for layer in m.layers if not layer.is_state)


def kv_heads_per_rank(m, tp: int) -> tuple[int, str]:
    """KV heads a rank caches under the manifest's format, and why: MLA's latent is one head whole on every rank;
    K/V heads split by attention TP, replicated below one per rank."""
    model = m.model
    if m.mla.enabled:
        return 1, f"num_key_value_heads {model.num_key_value_heads}, attn_tp_size {tp}, MLA"
    if not m.attention_layers:
        return 0, "no layer attends (a pure state stack)"
    return (max(model.num_key_value_heads // max(tp, 1), 1),
            f"num_key_value_heads {model.num_key_value_heads}, attn_tp_size {tp}")


def cache_row_shape(m, layer_kv: int, layer_dim: int) -> tuple[int, int | None]:
    """(num_head, dim) of every cache entry of a layer with ``layer_kv`` KV heads per rank of ``layer_dim``: MLA's
    entries are one head of their own widths (dim None: latent and rope differ); Legacy K/V rows pack the heads
    into one BSH row; paged K/V entries are per head."""
    if m.mla.enabled:
        return 1, None
    if m.kv_mode.value == "legacy":
        return 1, layer_dim * layer_kv
    if getattr(m, "differential", None) is not None:
        return layer_kv // 2, layer_dim  # K/V each kept as two half-head caches
    return layer_kv, layer_dim
