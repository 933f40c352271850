"""GQA/MHA: a key and a value cache per layer (templates/kinds/gqa_constants.py.j2, gqa_attention.py.j2)."""

from __future__ import annotations

from model_infer_kvcache.implementer.kinds.common import bad

NAME = "GQA/MHA"
CACHE_NAMES = ("k_cache", "v_cache")  # attribute names in generated code
# each cache's rendered (width constant, per-token heads)
CACHE_CONSTANTS = {"k_cache": ("HEAD_DIM", "NUM_KV_HEADS_PER_RANK"), "v_cache": ("HEAD_DIM", "NUM_KV_HEADS_PER_RANK")}
LAYOUTS = {"paged": ("TND",), "legacy": ("BSH",)}  # the FA output shape depends on it


def check_layers(m) -> None:
    """Nothing beyond the shared layer checks (the cache names come from CACHE_NAMES)."""


def check(m) -> None:
    if m.parallel.num_q_heads_per_rank % m.parallel.num_kv_heads_per_rank:
        raise bad("parallel.num_kv_heads_per_rank", f"{m.parallel.num_kv_heads_per_rank} KV heads do not divide "
                                                    f"{m.parallel.num_q_heads_per_rank} query heads per rank")


def fields(m) -> dict:
    return {}
