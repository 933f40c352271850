"""MLA: the absorbed latent cache and its rope part, PA_NZ (templates/kinds/mla_constants.py.j2,
mla_attention.py.j2)."""

from __future__ import annotations

from model_infer_kvcache.implementer.kinds.common import bad

NAME = "MLA"
CACHE_NAMES = ("nope_cache", "rope_cache")
# each cache's rendered (width constant, per-token heads)
CACHE_CONSTANTS = {"nope_cache": ("KV_LORA_RANK", "1"), "rope_cache": ("QK_ROPE_HEAD_DIM", "1")}
LAYOUTS = {"paged": ("TND", "TND_NTD")}
NZ_C0 = 16  # NZ fractal width of 16-bit caches (the rendered KV_CACHE_NZ_DIM)


def check_layers(m) -> None:
    """Nothing beyond the shared layer checks (the cache names come from CACHE_NAMES)."""


def check(m) -> None:
    if m.model.mla is None:
        raise bad("model.mla", "mla.enabled but the model has no MLA dimensions")
    shaped = [layer for layer in m.attention_layers if layer.mla_dims or layer.num_q_heads_per_rank or layer.softmax_scale]
    if shaped:  # the partials render one KV_LORA_RANK / NUM_HEADS_PER_RANK / SOFTMAX_SCALE for every layer
        raise bad(f"layers[{shaped[0].index}].mla_dims", f"{len(shaped)} MLA layer(s) with their own dims, query heads or "
                                                    "softmax scale (per_layer_config) are planned, not rendered yet")
    if any(layer.is_sliding for layer in m.layers):  # linear (Mamba) layers beside MLA are rendered
        raise bad("layers", "MLA with sliding-window layers is not rendered")
    if not m.mla.absorb:
        raise bad("mla.absorb", "only the absorb form of MLA is rendered (latent cache, kv_b_proj absorbed)")
    if m.mla.cache_mode not in (None, "PA_NZ"):
        raise bad("mla.cache_mode", f"{m.mla.cache_mode!r}: the MLA template writes and reads PA_NZ")
    for field in ("kv_lora_rank", "qk_rope_head_dim"):
        value = getattr(m.model.mla, field)
        if value <= 0 or value % NZ_C0:
            raise bad(f"model.mla.{field}", f"{value} must be a positive multiple of {NZ_C0} (NZ tiles)")
    for field in ("qk_nope_head_dim", "v_head_dim"):
        if getattr(m.model.mla, field) <= 0:
            raise bad(f"model.mla.{field}", f"{getattr(m.model.mla, field)} must be > 0")


def fields(m) -> dict:
    dims = m.model.mla
    return {"is_mla": True, "paged_standalone_mode": 3, "mla_rope": m.mla.rope, "kv_lora_rank": dims.kv_lora_rank,
            "latent_scale": m.mla.latent_scale, "rope_norm": bool(m.mla.rope_norm),
            "qk_rope_head_dim": dims.qk_rope_head_dim, "qk_nope_head_dim": dims.qk_nope_head_dim,
            "v_head_dim": dims.v_head_dim}
