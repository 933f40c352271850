"""Rotary position embedding operators: ``npu_rotary_mul``, ``npu_apply_rotary_pos_emb`` and ``npu_interleave_rope``.

Formulas: the ``npu_rotary_mul`` doc of torch-npu 2.9.0 (same kernel family):

* ``half``: ``x1, x2 = chunk(x, 2, -1); out = cos * x + sin * cat(-x2, x1)``
  (transformers' ``rotate_half``, Llama/Qwen/GPT-OSS);
* ``interleave``: ``out = cos * x + sin * stack(-x[..., 1::2], x[..., ::2]).flatten(-2)``.

``npu_rotary_mul(input, r1, r2, rotary_mode)`` is that doc's own operator: 4-D input (BNSD, BSND or SBND),
``r1``/``r2`` 4-D tables that broadcast over it (half mode: the head axis and/or the batch axis may be 1;
interleave mode: only the S and D axes are full), D even and below 896, float16/bfloat16/float32.

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


ROTARY_MUL_MAX_D = 896  # the doc: D < 896


def npu_rotary_mul(self, r1, r2, rotary_mode="half"):
    """``r1 * self + r2 * rotate(self)``; the doc's formula for each mode (2.14.0's ``rotate`` is not emulated)."""
    op, input = "npu_rotary_mul", self  # noqa: A001 - the doc calls it input
    chk.choice(op, "rotary_mode", rotary_mode, ROTARY_MODES)
    chk.tensor(op, "input", input, dims=(4,), dtypes=chk.FLOAT_DTYPES)
    d = input.shape[-1]
    if d % 2 or d >= ROTARY_MUL_MAX_D:
        raise NpuOpError(op, "input", f"D {d} must be even and below {ROTARY_MUL_MAX_D}")
    for name, t in (("r1", r1), ("r2", r2)):
        chk.tensor(op, name, t, dims=(4,))
        chk.same_dtype(op, name, t, "input", input)
        if t.shape[-1] != d:
            raise NpuOpError(op, name, f"last dim {t.shape[-1]} must equal the input's D {d}")
        for got, full in zip(t.shape[:3], input.shape[:3], strict=True):
            if got not in (1, full):
                raise NpuOpError(op, name, f"shape {tuple(t.shape)} does not broadcast over {tuple(input.shape)}")
        if rotary_mode == "interleave" and sum(1 for g in t.shape[:3] if g != 1) > 1:
            raise NpuOpError(op, name, f"interleave mode takes 11SD / 1S1D / S11D tables, got {tuple(t.shape)}")
    if r2.shape != r1.shape:
        raise NpuOpError(op, "r2", f"shape {tuple(r2.shape)} must equal r1 {tuple(r1.shape)}")
    rotate = rotate_half if rotary_mode == "half" else rotate_interleave
    cdt = chk.compute_dtype(input.dtype)
    x = input.to(cdt)
    return (r1.to(cdt) * x + r2.to(cdt) * rotate(x)).to(input.dtype)


def npu_apply_rotary_pos_emb(query, key, cos, sin, layout="BSH", rotary_mode="half"):
    """``(query_out, key_out)``: rotary applied to both; the inputs are left unchanged."""
    return apply_rotary_pos_emb("npu_apply_rotary_pos_emb", query, key, cos, sin, layout, rotary_mode)


def npu_interleave_rope(x, cos, sin):
    """DeepSeek interleaved rotary of ``x [B, N, S, D]``."""
    return interleave_rope("npu_interleave_rope", x, cos, sin)


OPS = {"npu_rotary_mul": npu_rotary_mul, "npu_apply_rotary_pos_emb": npu_apply_rotary_pos_emb,
       "npu_interleave_rope": npu_interleave_rope}
