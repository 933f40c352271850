"""GQA/MHA: a key and a value cache per layer (templates/kinds/gqa_constants.py.j2, gqa_attention.py.j2)."""

from __future__ import annotations

from model_infer_kvcache.implementer.kinds.common import bad

NAME = "GQA/MHA"
CACHE_NAMES = ("k_cache", "v_cache")  # attribute names in generated code
# each cache's rendered (width constant, per-token heads)
CACHE_CONSTANTS = {"k_cache": ("HEAD_DIM", "NUM_KV_HEADS_PER_RANK"), "v_cache": ("HEAD_DIM", "NUM_KV_HEADS_PER_RANK")}
LAYOUTS = {"paged": ("TND",), "legacy": ("BSH",)}  # the FA output shape depends on it
# Per-layer attention shapes (manifest layers[i].head_dim / num_kv_heads_per_rank, Gemma-4's full layers): each
# constant a layer may differ in -> the attribute ``init_kv_cache`` sets from LAYER_SHAPES, read by the layer's cache
# entries, writes and FA calls and by the standalone runner's allocation instead of the constant.
LAYER_SHAPE_ATTRS = {"HEAD_DIM": "kv_head_dim", "NUM_KV_HEADS_PER_RANK": "kv_heads_per_rank"}


def check_layers(m) -> None:
    """Nothing beyond the shared layer checks (the cache names come from CACHE_NAMES)."""


def layer_shapes(m) -> tuple[tuple[int, int, int], ...]:
    """(layer, head_dim, KV heads per rank) of each layer whose shape differs from the model's, in layer order."""
    return tuple((layer.index, layer.head_dim or m.model.head_dim,
                  layer.num_kv_heads_per_rank or m.parallel.num_kv_heads_per_rank)
                 for layer in m.layers if layer.head_dim is not None or layer.num_kv_heads_per_rank is not None)


def check(m) -> None:
    if m.parallel.num_q_heads_per_rank % m.parallel.num_kv_heads_per_rank:
        raise bad("parallel.num_kv_heads_per_rank", f"{m.parallel.num_kv_heads_per_rank} KV heads do not divide "
                                                    f"{m.parallel.num_q_heads_per_rank} query heads per rank")
    for index, _, kv in layer_shapes(m):
        if m.parallel.num_q_heads_per_rank % kv:
            raise bad(f"layers[{index}].num_kv_heads_per_rank", f"{kv} KV heads do not divide "
                                                               f"{m.parallel.num_q_heads_per_rank} query heads per rank")


def fields(m) -> dict:
    return {"layer_shapes": layer_shapes(m)}
