"""Cache kinds, analyzer side: each kind's config facts, cache entries, memory groups and decision in one module.

The render side of the same kinds lives in ``implementer/kinds/``; the group block math every kind sizes its pools
with stays in ``analyzer/kv_cache_spec.py``.
"""

from __future__ import annotations

# The attention formats a manifest's attention layers share, as every tool names them: DeepSeek sparse attention
# (MLA + an indexer), MLA (latent + rope part), GQA/MHA/MQA (K/V caches).
DSA, MLA, GQA = "dsa", "mla", "gqa"


def attention_format(m) -> str:
    """The one place that reads which attention format a manifest plans (the implementer's and the validators'
    kind modules are looked up by it)."""
    if m.dsa is not None:
        return DSA
    return MLA if m.mla.enabled else GQA


def fa_kv_heads(m, plan) -> int:
    """num_key_value_heads an FA call of ``plan``'s layer passes: 1 for MLA's latent (whole on every rank), else the
    layer's KV heads per rank."""
    if m.mla.enabled:
        return 1
    return plan.num_kv_heads_per_rank or m.parallel.num_kv_heads_per_rank


def holds_states(m) -> bool:
    """The manifest plans recurrent states (a hybrid's linear layers)."""
    return m.linear_attention is not None or any(layer.is_state for layer in m.layers)
