"""What a manifest's kind sections and its layers must agree on (the manifest's own invariant calls these).

Read duck-typed from the manifest (this module imports nothing of ``analyzer/manifest.py``, which imports it): a
hand edit that desynchronises a kind's section from the layers it plans is refused naming the field.
"""

from __future__ import annotations

from model_infer_kvcache.analyzer.kinds import drafter
from model_infer_kvcache.analyzer.linear_config import CONV_ONLY, k_heads_per_rank

# manifest.RECURRENT_SIZES (this module cannot import the manifest, which imports it)
RECURRENT_SIZES = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "num_k_heads_per_rank",
                   "num_v_heads_per_rank")

INDEXER_KEY_CACHE = "indexer_key_cache"  # the DSA indexer's key cache entry (upstream deepseek_v3_2_exp)
# QSA's two indexer entries (analyzer/kinds/qsa.py, which imports the manifest: spelled here too, checked equal there)
QSA_CACHES = ("indexer_raw_key_cache", "indexer_block_key_cache")
# DiffLlama's K/V as two half-head caches each (analyzer/kinds/diff.py): K low, V low, K high, V high
DIFF_CACHES = ("k_cache", "v_cache", "k_cache_hi", "v_cache_hi")


def kind_problems(m) -> list[tuple[str, str]]:
    return [*dsa_problems(m), *qsa_problems(m), *diff_problems(m), *state_problems(m), *compressed_problems(m),
            *drafter.problems(m), *byte_patch_problems(m)]


def byte_patch_problems(m) -> list[tuple[str, str]]:
    """BLT's layers are its byte_patches section's stacks (a hand edit of one of the two): every cache layer once,
    each with its stack's query heads, KV heads, head_dim, scale, window, band and manager. The section's own rules
    (scale from head_dim, band from window: byte_patch_section.problems, which reads the rules and so the manifest)
    are checked where a manifest is loaded (manifest_io) and rendered."""
    section = getattr(m, "byte_patches", None)
    if section is None:
        return []
    by_index = {layer.index: layer for layer in m.attention_layers}
    planned = sorted(i for s in section.stacks for i in s.cache_layers)
    if planned != sorted(by_index) or len(by_index) != len(m.layers):
        return [("layers", f"{len(m.layers)} layer(s) {sorted(by_index)[:4]}... for the stacks' cache layers "
                           f"{planned[:4]}... (byte_patches.stacks)")]
    for s in section.stacks:
        want = dict(num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                    softmax_scale=s.softmax_scale, sliding_window=s.sliding_window, pre_tokens=s.pre_tokens,
                    sparse_mode=s.sparse_mode, group_key=s.section)
        for i in s.cache_layers:
            layer = by_index[i]
            got = dict(num_heads=layer.num_q_heads_per_rank or m.parallel.num_q_heads_per_rank,
                       num_kv_heads=layer.num_kv_heads_per_rank or m.parallel.num_kv_heads_per_rank,
                       head_dim=layer.head_dim or m.model.head_dim,
                       softmax_scale=layer.softmax_scale or m.fa.softmax_scale, sliding_window=layer.sliding_window,
                       pre_tokens=layer.pre_tokens, sparse_mode=layer.sparse_mode.decode, group_key=layer.group_key)
            off = next((k for k in want if got[k] != want[k]), None)
            if off:
                return [(f"layers[{i}]", f"{off} {got[off]!r} is not its stack {s.section}'s {want[off]!r} "
                                         "(byte_patches.stacks)")]
    return []


def dsa_problems(m) -> list[tuple[str, str]]:
    """The indexer key cache sits on exactly the layers that run their indexer (a hand edit that drops it
    leaves the indexer reading keys nobody wrote)."""
    own = set(m.dsa.indexer_layers) if m.dsa else set()
    for i, layer in enumerate(m.layers):
        names = [c.name for c in layer.caches]
        has = INDEXER_KEY_CACHE in names
        if has != (layer.decoder_layer in own):
            why = ("runs its indexer but has no indexer_key_cache entry" if not has
                   else "has an indexer_key_cache entry but runs no indexer" + ("" if m.dsa else " (no dsa section)"))
            return [(f"layers[{i}].caches", f"decoder layer {layer.decoder_layer} {why}")]
        if has and m.dsa and layer.caches[names.index(INDEXER_KEY_CACHE)] != m.dsa.indexer_cache:
            return [(f"layers[{i}].caches", "the indexer_key_cache entry differs from dsa.indexer_cache")]
    return []


def qsa_problems(m) -> list[tuple[str, str]]:
    """Every attention layer holds QSA's raw and pooled indexer key entries exactly when the manifest plans QSA, each
    one head of qsa.head_dim (a hand edit dropping one leaves the indexer reading keys nobody wrote)."""
    qsa = getattr(m, "qsa", None)
    for i, layer in enumerate(m.layers):
        if layer.is_state:
            continue
        held = {c.name: c for c in layer.caches if c.name in QSA_CACHES}
        if bool(qsa) != (len(held) == len(QSA_CACHES)) or (not qsa and held):
            why = "lacks" if qsa else "holds"
            return [(f"layers[{i}].caches", f"decoder layer {layer.decoder_layer} {why} QSA's "
                                            f"{' / '.join(QSA_CACHES)} entries" + ("" if qsa else " (no qsa section)"))]
        if qsa and any(c.dim != qsa.head_dim or c.num_head != 1 for c in held.values()):
            return [(f"layers[{i}].caches", f"QSA's indexer entries must be 1 head x qsa.head_dim {qsa.head_dim}")]
    if qsa and qsa.block_topk != qsa.budget // qsa.ratio:
        return [("qsa.block_topk", f"must be budget // ratio = {qsa.budget // qsa.ratio}")]
    return []


def diff_problems(m) -> list[tuple[str, str]]:
    """Every attention layer holds exactly the four half-head caches when the manifest plans differential attention
    (a hand edit dropping the high halves leaves half the value heads unwritten), none of the high ones otherwise."""
    diff = getattr(m, "differential", None)
    for i, layer in enumerate(m.layers):
        if layer.is_state:
            continue
        names = tuple(c.name for c in layer.caches)
        if diff is not None and names != DIFF_CACHES:
            return [(f"layers[{i}].caches", f"decoder layer {layer.decoder_layer} holds {list(names)}: differential "
                                            f"attention plans {list(DIFF_CACHES)}")]
        if diff is None and set(names) & set(DIFF_CACHES[2:]):
            return [(f"layers[{i}].caches", f"decoder layer {layer.decoder_layer} holds the high half-head caches "
                                            "(no differential section)")]
    if diff is not None and diff.half_kv_heads * 2 != m.parallel.num_kv_heads_per_rank:
        return [("differential.half_kv_heads", f"must be half of {m.parallel.num_kv_heads_per_rank} KV heads per rank")]
    return []


def state_problems(m) -> list[tuple[str, str]]:
    """Linear layers are exactly linear_attention's layers and hold its states. (A state layer with a KV cache or FA
    fields, or an attention layer with states, cannot be written since schema 2.0: the layer plan is tagged by its
    attn_type, and each kind's plan has only its own fields.)"""
    lin = m.linear_attention
    linear_layers = set(lin.layers) if lin else set()
    # a parallel hybrid (Falcon-H1) plans a linear decoder layer's attention as sublayer 0 and its state as sublayer 1
    with_state = {layer.decoder_layer for layer in m.layers if layer.is_state}
    for i, layer in enumerate(m.layers):
        where = f"layers[{i}]"
        beside = not layer.is_state and layer.decoder_layer in with_state  # a parallel layer's attention sublayer
        if not beside and layer.is_state != (layer.decoder_layer in linear_layers):
            why = "is attn_type Mamba but not in linear_attention.layers" if layer.is_state else \
                "is a linear_attention layer but not attn_type Mamba"
            return [(f"{where}.attn_type", f"decoder layer {layer.decoder_layer} {why}")]
        if layer.is_state and lin and layer.states != lin.states:
            return [(f"{where}.states", "differ from linear_attention.states")]
    if lin:
        p = m.parallel
        tp = p.attn_tp_size
        sizes = [name for name in RECURRENT_SIZES if getattr(lin, name) is not None]
        if (lin.family in CONV_ONLY and sizes) or (lin.family not in CONV_ONLY and len(sizes) != len(RECURRENT_SIZES)):
            want = "none (a conv-only family keeps no recurrent state)" if lin.family in CONV_ONLY else "all"
            return [("linear_attention", f"{lin.family} has recurrent-state sizes {sizes or 'none'}, wants {want}")]
        if lin.family in CONV_ONLY:
            return []
        k_want = k_heads_per_rank(lin.family, lin.num_k_heads, tp)
        if k_want is None or lin.num_k_heads_per_rank != k_want:
            return [("linear_attention.num_k_heads_per_rank", f"{lin.num_k_heads_per_rank} is not num_k_heads "
                                                              f"{lin.num_k_heads} on attn_tp_size {tp} ({k_want} for "
                                                              f"{lin.family})")]
        if lin.num_v_heads % tp or lin.num_v_heads_per_rank != lin.num_v_heads // tp:
            return [("linear_attention.num_v_heads_per_rank", f"{lin.num_v_heads_per_rank} is not num_v_heads "
                                                              f"{lin.num_v_heads} / attn_tp_size {tp}")]
    return []


def compressed_problems(m) -> list[tuple[str, str]]:
    """Each layer's compressed branch is the one the compressed section lists for it, at its rate (a hand edit
    that swaps a layer's branch or rate would size its blocks and its visibility for the other branch)."""
    c = m.compressed
    want = {i: "csa" for i in c.csa_layers} | {i: "hca" for i in c.hca_layers} if c else {}
    for i, layer in enumerate(m.layers):
        got = layer.compressed
        if (got.kind if got else None) != want.get(layer.decoder_layer):
            listed = want.get(layer.decoder_layer)
            return [(f"layers[{i}].compressed", f"decoder layer {layer.decoder_layer} plans "
                                                 f"{got.kind if got else 'no compressed branch'} but the compressed "
                                                 f"section lists {listed or 'none'}" + ("" if c else
                                                                                        " (no compressed section)"))]
        if got and got.compress_ratio != c.compress_rates.get(got.kind):
            return [(f"layers[{i}].compressed.compress_ratio", f"{got.compress_ratio} is not compressed.compress_rates"
                                                                f"[{got.kind}] {c.compress_rates.get(got.kind)}")]
    return []
