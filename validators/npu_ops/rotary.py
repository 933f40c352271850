"""Rotary position embedding operators: ``npu_apply_rotary_pos_emb`` and ``npu_interleave_rope``.

Formulas: the ``npu_rotary_mul`` doc of torch-npu 2.9.0 (same kernel family):

* ``half``: ``x1, x2 = chunk(x, 2, -1); out = cos * x + sin * cat(-x2, x1)``
  (transformers' ``rotate_half``, Llama/Qwen/GPT-OSS);
* ``interleave``: ``out = cos * x + sin * stack(-x[..., 1::2], x[..., ::2]).flatten(-2)``.

``npu_apply_rotary_pos_emb`` has no doc entry in 2.9.0; its arguments come from the schema and
the meta registration (outputs shaped like query and key). ``layout`` names how query/key are laid
out so that cos/sin broadcast over the head axis: ``TND`` ``[T, N, D]`` with cos ``[T, 1, D]``;
``BSND`` (``BSH`` is its string default) ``[B, S, N, D]`` with cos ``[B|1, S, 1, D]``; ``SBND``
and ``BNSD`` likewise. ``npu_interleave_rope`` (no doc entry either; DeepSeek MLA) takes
``x [B, N, S, D]`` and ``cos``/``sin`` ``[B|1, 1, S, D]`` and applies the de-interleaving rotary of
DeepSeek-V3 in transformers: lanes ``(x0, x1, x2, x3, ...)`` are read as ``(even..., odd...)`` and
rotated with ``rotate_half``; the output keeps that de-interleaved order.
"""

from __future__ import annotations

import torch
from model_infer_kvcache.validators.npu_ops import op_checks as chk
from model_infer_kvcache.validators.npu_ops.errors import NpuOpError

# layout -> (rank, head axis): cos/sin have size 1 on the head axis.
LAYOUTS = {"TND": (3, 1), "BSH": (4, 2), "BSND": (4, 2), "SBND": (4, 2), "BNSD": (4, 1)}
ROTARY_MODES = ("half", "interleave")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_interleave(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def deinterleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved rotary: even lanes then odd lanes, then ``rotate_half``."""
    x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    return x * cos + rotate_half(x) * sin


def _broadcasts(op: str, name: str, table: torch.Tensor, x: torch.Tensor, head_axis: int) -> None:
    if table.dim() != x.dim():
        raise NpuOpError(op, name, f"must have the rank of the query ({x.dim()}), got shape {tuple(table.shape)}")
    for axis, (got, full) in enumerate(zip(table.shape, x.shape, strict=True)):
        want = (1,) if axis == head_axis else (full,) if axis == x.dim() - 1 else (1, full)
        if got not in want:
            raise NpuOpError(op, name, f"shape {tuple(table.shape)} does not broadcast over {tuple(x.shape)} "
                                       f"(axis {axis} must be {' or '.join(map(str, want))})")


def apply_rotary_pos_emb(op, query, key, cos, sin, layout, rotary_mode):
    chk.choice(op, "layout", layout, tuple(LAYOUTS))
    chk.choice(op, "rotary_mode", rotary_mode, ROTARY_MODES, documented=("quarter",))
    rank, head_axis = LAYOUTS[layout]
    chk.tensor(op, "query", query, dims=(rank,), dtypes=chk.FLOAT_DTYPES)
    chk.tensor(op, "key", key, dims=(rank,))
    for name, t in (("key", key), ("cos", cos), ("sin", sin)):
        chk.tensor(op, name, t)
        chk.same_dtype(op, name, t, "query", query)
    for axis in range(rank):
        if axis != head_axis and key.shape[axis] != query.shape[axis]:
            raise NpuOpError(op, "key", f"shape {tuple(key.shape)} differs from query {tuple(query.shape)} "
                                        f"outside the head axis {head_axis} of {layout}")
    if query.shape[-1] % 2:
        raise NpuOpError(op, "query", f"head dim {query.shape[-1]} must be even")
    _broadcasts(op, "cos", cos, query, head_axis)
    if sin.shape != cos.shape:
        raise NpuOpError(op, "sin", f"shape {tuple(sin.shape)} must equal cos {tuple(cos.shape)}")
    rotate = rotate_half if rotary_mode == "half" else rotate_interleave
    cdt = chk.compute_dtype(query.dtype)
    c, s = cos.to(cdt), sin.to(cdt)
    outs = []
    for t in (query, key):
        x = t.to(cdt)
        outs.append((x * c + rotate(x) * s).to(t.dtype))
    return outs[0], outs[1]


def interleave_rope(op, x, cos, sin):
    chk.tensor(op, "x", x, dims=(4,), dtypes=chk.FLOAT_DTYPES)
    for name, t in (("cos", cos), ("sin", sin)):
        chk.tensor(op, name, t, dims=(4,))
        chk.same_dtype(op, name, t, "x", x)
    if x.shape[-1] % 2:
        raise NpuOpError(op, "x", f"last dim {x.shape[-1]} must be even")
    _broadcasts(op, "cos", cos, x, 1)
    if sin.shape != cos.shape:
        raise NpuOpError(op, "sin", f"shape {tuple(sin.shape)} must equal cos {tuple(cos.shape)}")
    cdt = chk.compute_dtype(x.dtype)
    return deinterleaved_rope(x.to(cdt), cos.to(cdt), sin.to(cdt)).to(x.dtype)


def npu_apply_rotary_pos_emb(query, key, cos, sin, layout="BSH", rotary_mode="half"):
    """``(query_out, key_out)``: rotary applied to both; the inputs are left unchanged."""
    return apply_rotary_pos_emb("npu_apply_rotary_pos_emb", query, key, cos, sin, layout, rotary_mode)


def npu_interleave_rope(x, cos, sin):
    """DeepSeek interleaved rotary of ``x [B, N, S, D]``."""
    return interleave_rope("npu_interleave_rope", x, cos, sin)


OPS = {"npu_apply_rotary_pos_emb": npu_apply_rotary_pos_emb, "npu_interleave_rope": npu_interleave_rope}
