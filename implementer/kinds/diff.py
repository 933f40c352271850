"""DiffLlama's differential attention: K and V each kept as two half-head caches, four FA calls of half the query
heads (templates/kinds/diff_attention.py.j2, in place of the GQA partial's writes and FA call)."""

from __future__ import annotations

from model_infer_kvcache.analyzer.kinds.invariants import DIFF_CACHES
from model_infer_kvcache.implementer.kinds import gqa
from model_infer_kvcache.implementer.kinds.common import bad

NAME = "differential"
CACHE_NAMES = DIFF_CACHES
# each cache's rendered (width constant, per-token heads): half the rank's KV heads each
CACHE_CONSTANTS = dict.fromkeys(DIFF_CACHES, ("HEAD_DIM", "HALF_KV_HEADS"))
LAYOUTS = {"paged": gqa.LAYOUTS["paged"]}


def check_layers(m) -> None:
    gqa.check_layers(m)


def check(m) -> None:
    gqa.check(m)
    gqa.check_one_kv_shape(m, "differential attention")
    if m.model.has_sinks or any(layer.is_sliding or layer.is_chunked for layer in m.attention_layers):
        raise bad("layers", "not supported by kvcache: differential attention beside sinks or windowed layers (its "
                            "partial renders full causal layers)")
    if m.parallel.num_kv_heads_per_rank % 2 or m.differential.half_kv_heads * 2 != m.parallel.num_kv_heads_per_rank:
        raise bad("differential.half_kv_heads", "must be half the rank's KV heads (an even count)")


def fields(m) -> dict:
    d = m.differential
    return {**gqa.fields(m), "is_diff": True, "half_kv_heads": int(d.half_kv_heads),
            "half_q_heads": int(d.half_q_heads)}
