"""DeepSeek-V4 compressed attention, render side (templates/kinds/compressed_attention.py.j2): every layer's window
branch (``win_kv``, one shared K=V row per token) and the HCA layers' compressed branch (``custom.compressor`` with a
per-request state slot, entries written once their group completes), attended by ``custom.npu_sparse_attn_sharedkv``
in one call. Planned by the analyzer (analyzer/kinds/compressed.py).

Rendered: window-only and HCA layers, both deployment modes (framework mode: the entries of upstream's three
managers, a prefill attending over a temporary K=V cache of its own rows). Refused by name: CSA layers (their
indexer), MTP layers, and shapes the fused kernels do not take."""

from __future__ import annotations

from model_infer_kvcache.implementer.kinds.common import bad

NAME = "compressed (DeepSeek-V4)"
WINDOW_ENTRY = "win_kv"
GROUP_KEY = WINDOW_ENTRY  # upstream keys the window branch's manager by its entry, not by attn_type
CACHE_NAMES = (WINDOW_ENTRY,)  # the window branch; the compressed entries ride on the HCA layers (fields below)
# each cache's rendered (width constant, per-token heads): one shared K=V head
CACHE_CONSTANTS = {WINDOW_ENTRY: ("HEAD_DIM", "1")}
LAYOUTS = {"paged": ("TND",)}
# custom-npu_compressor.md: 'rope_head_dim 仅支持64' (the RoPE tail of each 512-lane row)
ROPE_HEAD_DIM = 64
STATE_DTYPE = "torch.float32"  # upstream sfa_kv_state: float32 (the pooled kv and its gate score per token)

# Why a CSA layer is not rendered (issue 38): its top-k comes from an int8 indexer on the device and a float one in
# transformers; the selections of the two can differ near a tie, and no validation design for that exists yet.
CSA_GAP = ("its lightning indexer: the device's custom.npu_quant_lightning_indexer takes int8 query and key only "
           "(cann-recipes-infer ops/ascendc/docs/custom-npu_quant_lightning_indexer.md: query / key int8), "
           "transformers' DeepseekV4Indexer scores in floating point, so a top-k near a tie can select other entries "
           "than the oracle and no validation design compares the two yet")


def check_layers(m) -> None:
    """Nothing beyond ``check`` (the window entry's name comes from CACHE_NAMES)."""


def check(m) -> None:
    c = m.compressed
    if c is None:
        return
    if c.csa_layers:
        raise bad(f"layers[{c.csa_layers[0]}].compressed",
                  f"not supported by kvcache: rendering DeepSeek-V4 CSA layers ({len(c.csa_layers)} of them, first "
                  f"{c.csa_layers[0]}): {CSA_GAP}; window-only and HCA layers render")
    if m.model.num_mtp_layers:
        raise bad("model.num_mtp_layers", f"not supported by kvcache: DeepSeek-V4 with {m.model.num_mtp_layers} MTP "
                                          "layer(s): the render has no speculative-decode verify step for the "
                                          "compressed branch; analyze with --next-n 0 to serve it without one")
    unmet = [x for x in c.device_constraints if not x.startswith("met: ")]
    if unmet:
        raise bad("compressed.device_constraints",
                  f"not supported by kvcache: the render calls the fused kernels, and {len(unmet)} of their fixed "
                  f"shapes are not met (first: {unmet[0]})")


def fields(m) -> dict:
    c = m.compressed
    return {"is_compressed": True, "hca_layers": tuple(c.hca_layers), "hca_ratio": int(c.compress_rates["hca"]),
            "rope_head_dim": ROPE_HEAD_DIM, "rms_norm_eps": float(m.model.rms_norm_eps),
            "cmp_state_dtype": STATE_DTYPE}
