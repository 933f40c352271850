"""The gated delta rule operators' documented shape limits (torch-npu 2.14.0 ``_op_plugin_docs.py``): one home for
the emulator (validators/npu_ops/gated_delta.py), the plan's operator choice (analyzer/rules.py) and the render
(implementer/kinds/recurrent.py). Stdlib only."""

from __future__ import annotations

# npu_recurrent_gated_delta_rule (:6754, the 2.9.0 entry identical): L_i <= 8, Nk, Nv, Dk, Dv <= 256
RECURRENT_MAX_LEN = 8
RECURRENT_MAX_SIZE = 256
# npu_chunk_gated_delta_rule (:12110, 2.14.0 only): Nk, Nv <= 64, Dk = Dv = 128, Nv a multiple of Nk
CHUNK_MAX_HEADS = 64
CHUNK_HEAD_DIM = 128
CHUNK_DOC = "torch-npu 2.14.0 _op_plugin_docs.py:12110"
RECURRENT_DOC = "torch-npu 2.14.0 _op_plugin_docs.py:6754"


def chunk_misfit(num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int) -> str | None:
    """Why ``npu_chunk_gated_delta_rule`` cannot take these per-rank sizes (None: it can)."""
    off = [f"{name} {size} (must be {CHUNK_HEAD_DIM})" for name, size in (("Dk", head_k_dim), ("Dv", head_v_dim))
           if size != CHUNK_HEAD_DIM]
    off += [f"{name} {size} (at most {CHUNK_MAX_HEADS})" for name, size in (("Nk", num_k_heads), ("Nv", num_v_heads))
            if size > CHUNK_MAX_HEADS]
    return f"npu_chunk_gated_delta_rule takes {', '.join(off)} ({CHUNK_DOC})" if off else None


def recurrent_misfit(num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int) -> str | None:
    """Why ``npu_recurrent_gated_delta_rule`` cannot take these per-rank sizes (None: it can)."""
    off = [f"{name} {size}" for name, size in (("Nk", num_k_heads), ("Nv", num_v_heads), ("Dk", head_k_dim),
                                                ("Dv", head_v_dim)) if size > RECURRENT_MAX_SIZE]
    return (f"npu_recurrent_gated_delta_rule takes {', '.join(off)} (at most {RECURRENT_MAX_SIZE}: "
            f"{RECURRENT_DOC})") if off else None
