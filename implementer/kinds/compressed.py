"""DeepSeek-V4 compressed attention, render side (templates/kinds/compressed_attention.py.j2): every layer's window
branch (``win_kv``, one shared K=V row per token) and the HCA layers' compressed branch (``custom.compressor`` with a
per-request state slot, entries written once their group completes), attended by ``custom.npu_sparse_attn_sharedkv``
in one call. Planned by the analyzer (analyzer/kinds/compressed.py).

Rendered: window-only, CSA and HCA layers, both deployment modes (framework mode: the entries of upstream's
managers, a prefill attending over a temporary K=V cache of its own rows). A CSA layer also compresses the
lightning indexer's keys (``li_cmp_kv``) and selects its top-k entries per query with torch_npu's float
``npu_lightning_indexer``. MTP: verify steps of 1 + next_n tokens per request go through the same code (positions,
the compressor's start_pos and each row's visible entries are per token; rejected drafts are rewritten by position);
the standalone runner's state ring grows by next_n - 1 (``state_ring_tokens``). Refused by name: shapes the fused
kernels do not take."""

from __future__ import annotations

from model_infer_kvcache.analyzer.kinds.compressed import COFF, CSA, HCA, state_ring_tokens
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

# CSA layers' lightning indexer (issue 38): torch_npu's float ``npu_lightning_indexer`` over the indexer's own compressed
# keys (li_cmp_kv), one query per batch row of the call so that each query sees only its visible entries; upstream
# calls the int8 ``custom.npu_quant_lightning_indexer`` instead (references/compressed.md: why, and what differs).
# custom-npu_sparse_attn_sharedkv.md: 'cmp_sparse_indices ... K2仅支持512' (a narrower top-k is padded with -1)
SPARSE_WIDTH = 512


def check_layers(m) -> None:
    """Nothing beyond ``check`` (the window entry's name comes from CACHE_NAMES)."""


def check(m) -> None:
    c = m.compressed
    if c is None:
        return
    unmet = [x for x in c.device_constraints if not x.startswith("met: ")]
    if unmet:
        raise bad("compressed.device_constraints",
                  f"not supported by kvcache: the render calls the fused kernels, and {len(unmet)} of their fixed "
                  f"shapes are not met (first: {unmet[0]})")


def fields(m) -> dict:
    c = m.compressed
    next_n = m.mtp.speculative_tokens if m.mtp is not None else 0
    rates = {kind: int(c.compress_rates[kind]) for kind in (CSA, HCA)}
    return {"is_compressed": True, "hca_layers": tuple(c.hca_layers), "hca_ratio": int(c.compress_rates["hca"]),
            "csa_layers": tuple(c.csa_layers), "csa_ratio": int(c.compress_rates["csa"]),
            "index_topk": int(c.index_topk), "index_n_heads": int(c.index_n_heads),
            "index_head_dim": int(c.index_head_dim), "sparse_width": SPARSE_WIDTH,
            "rope_head_dim": ROPE_HEAD_DIM, "rms_norm_eps": float(m.model.rms_norm_eps),
            "cmp_state_dtype": STATE_DTYPE,
            # the standalone runner's state slot per row: a ring of this many tokens (verify steps' drafts included)
            "state_ring": {kind: state_ring_tokens(COFF[kind] * rates[kind], next_n) for kind in (CSA, HCA)}}
