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
# Value heads narrower than key heads (manifest model.v_head_dim, MiMo-V2-Flash): the V cache's width constant, read by
# its cache entry, its write, its allocation and the FA calls' value tensors instead of HEAD_DIM.
VALUE_DIM_CONSTANT = "V_HEAD_DIM"


def cache_constants(m) -> dict[str, tuple[str, str]]:
    """CACHE_CONSTANTS of this manifest: the V cache's width is V_HEAD_DIM where the model sets a v_head_dim."""
    if m.model.v_head_dim is None:
        return CACHE_CONSTANTS
    return {**CACHE_CONSTANTS, "v_cache": (VALUE_DIM_CONSTANT, CACHE_CONSTANTS["v_cache"][1])}


def check_layers(m) -> None:
    """Nothing beyond the shared layer checks (the cache names come from CACHE_NAMES)."""


def layer_shapes(m) -> tuple[tuple[int, int, int], ...]:
    """(layer, head_dim, KV heads per rank) of each layer whose shape differs from the model's, in layer order."""
    return tuple((layer.index, layer.head_dim or m.model.head_dim,
                  layer.num_kv_heads_per_rank or m.parallel.num_kv_heads_per_rank)
                 for layer in m.layers if layer.head_dim is not None or layer.num_kv_heads_per_rank is not None)


def check_one_kv_shape(m, kind: str) -> None:
    """Refuse a manifest a kind's partial cannot take: it renders the model's one K/V shape (``kind`` names the partial
    in the message), so a value-only head dim or per-layer head shapes are not supported by kvcache."""
    if m.model.v_head_dim is not None or layer_shapes(m):
        raise bad("model.v_head_dim" if m.model.v_head_dim is not None else "layers",
                  f"not supported by kvcache: {kind} beside per-layer or value-only head shapes (its partial takes "
                  "the model's one K/V shape)")


def check(m) -> None:
    if m.parallel.num_q_heads_per_rank % m.parallel.num_kv_heads_per_rank:
        raise bad("parallel.num_kv_heads_per_rank", f"{m.parallel.num_kv_heads_per_rank} KV heads do not divide "
                                                    f"{m.parallel.num_q_heads_per_rank} query heads per rank")
    if m.model.v_head_dim is not None and m.kv_mode.value != "paged":
        raise bad("model.v_head_dim", f"not supported by kvcache: value heads of {m.model.v_head_dim} beside "
                                      f"{m.model.head_dim}-dim keys on the {m.kv_mode.value} path (the Legacy render "
                                      "takes one head dim for K and V)")
    if m.model.v_head_dim is not None and any(dim != m.model.head_dim for _, dim, _ in layer_shapes(m)):
        raise bad("model.v_head_dim", "not supported by kvcache: a value head dim beside per-layer key head dims")
    for index, _, kv in layer_shapes(m):
        if m.parallel.num_q_heads_per_rank % kv:
            raise bad(f"layers[{index}].num_kv_heads_per_rank", f"{kv} KV heads do not divide "
                                                               f"{m.parallel.num_q_heads_per_rank} query heads per rank")


def fields(m) -> dict:
    sinks = m.model.sink_layers
    return {"layer_shapes": layer_shapes(m), "v_head_dim": m.model.v_head_dim or 0,
            "sink_layers": tuple(sinks) if m.model.has_sinks and sinks is not None else None}
