"""Qwen4-Exp's QSA: GQA's K/V caches plus each attention layer's raw and pooled indexer keys; the lightning indexer
selects blocks, the sparse FA reads their tokens and the tail block (templates/kinds/qsa_attention.py.j2, inside the
GQA partial)."""

from __future__ import annotations

from model_infer_kvcache.analyzer.kinds.qsa import BLOCK_KEY_CACHE, RAW_KEY_CACHE
from model_infer_kvcache.implementer.kinds import gqa
from model_infer_kvcache.implementer.kinds.common import bad

NAME = "QSA"
CACHE_NAMES = (*gqa.CACHE_NAMES, RAW_KEY_CACHE, BLOCK_KEY_CACHE)
# each cache's rendered (width constant, per-token heads)
CACHE_CONSTANTS = {**gqa.CACHE_CONSTANTS, RAW_KEY_CACHE: ("INDEX_HEAD_DIM", "1"),
                   BLOCK_KEY_CACHE: ("INDEX_HEAD_DIM", "1")}
LAYOUTS = {"paged": gqa.LAYOUTS["paged"]}


def check_layers(m) -> None:
    gqa.check_layers(m)


def check(m) -> None:
    gqa.check(m)
    gqa.check_one_kv_shape(m, "QSA")
    if m.model.has_sinks:
        raise bad("model.has_sinks", "not supported by kvcache: learnable sinks beside QSA's sparse FA")


def fields(m) -> dict:
    q = m.qsa
    return {**gqa.fields(m), "is_qsa": True, "index_n_heads": int(q.n_heads), "index_head_dim": int(q.head_dim),
            "qsa_ratio": int(q.ratio), "index_rope_dim": int(q.rope_dim), "qsa_block_topk": int(q.block_topk)}
