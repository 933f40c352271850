"""The checkout's own AscendC operators (cann-recipes-infer ``ops/ascendc``, called as ``torch.ops.custom.<op>``),
emulated from their docs (``ops/ascendc/docs/custom-<op>.md``), strict about every documented argument rule.

Emulated so far (DeepSeek-V4's cache writers and its partial RoPE; issue 38 names the rest):

* ``scatter_nd_update_asc(var, indices, update)``: ``var [b, s]`` rows replaced in place, ``var[indices[i, 0]] =
  update[i]``; ``s`` in {1, 128, 512}, ``u <= b`` updates, indices int32 / int64 ``[u, 1]``; "索引不支持越界,负值会被直接
  跳过": an index at or past ``b`` is refused, a negative one writes nothing. Two updates of one row: the doc does
  not say which lands, so the emulation refuses the call instead of picking one.
* ``inplace_partial_rotary_mul(x, r1, r2, *, rotary_mode, partial_slice)``: ``x [b, s, n, d]`` rotated in place on
  its last axis between ``partial_slice[0]`` and ``partial_slice[1]`` with ``npu_rotary_mul``'s interleave formula
  (``validators/npu_ops/rotary.py``: ``cos * x + sin * stack(-x[1::2], x[0::2])``), ``r1`` / ``r2`` (cos / sin)
  ``[b, 1, 1, slice]`` or ``[b, s, 1, slice]``; only ``"interleave"``; ``d <= 1024`` and even, the slice even;
  ``x`` and the tables may differ in dtype ("支持混合精度").

Every operand must be contiguous ("不支持非连续"). The rest (``compressor``, ``npu_sparse_attn_sharedkv``,
``npu_quant_lightning_indexer``, ``indexer_compress_epilog``...) stay unemulated: used, they raise the one-line
``UnemulatedOperatorError`` naming them (``validators/standins/device.py``).
"""

from __future__ import annotations

import torch
from model_infer_kvcache.validators.npu_ops import op_checks as chk
from model_infer_kvcache.validators.npu_ops.errors import NpuOpError, UnemulatedFeatureError
from model_infer_kvcache.validators.npu_ops.rotary import rotate_interleave

SCATTER_ROW_WIDTHS = (1, 128, 512)  # custom-npu_scatter_nd_update_asc.md: "s 取值固定为:1或者128或者512"
SCATTER_DTYPES = (torch.bfloat16, torch.float16, torch.int8, torch.float64)  # float64: the CPU validation mode
INDEX_DTYPES = (torch.int32, torch.int64)
ROTARY_MAX_DIM = 1024  # custom-inplace_partial_rotary_mul.md: "d轴必须小于等1024,且关于2对齐"


def _contiguous(op: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise NpuOpError(op, name, f"must be contiguous (the doc: 不支持非连续), got strides {t.stride()}")


def scatter_nd_update_asc(var: torch.Tensor, indices: torch.Tensor, update: torch.Tensor) -> None:
    op = "custom.scatter_nd_update_asc"
    chk.tensor(op, "var", var, dims=(2,), dtypes=SCATTER_DTYPES)
    chk.tensor(op, "indices", indices, dims=(2,), dtypes=INDEX_DTYPES)
    chk.tensor(op, "update", update, dims=(2,))
    chk.same_dtype(op, "update", update, "var", var)
    _contiguous(op, var=var, indices=indices, update=update)
    b, s = var.shape
    u = indices.shape[0]
    if s not in SCATTER_ROW_WIDTHS:
        raise NpuOpError(op, "var", f"row width s = {s} is not one of {SCATTER_ROW_WIDTHS}")
    if indices.shape[1] != 1:
        raise NpuOpError(op, "indices", f"shape {tuple(indices.shape)} must be [u, 1]")
    if tuple(update.shape) != (u, s):
        raise NpuOpError(op, "update", f"shape {tuple(update.shape)} must be [u, s] = [{u}, {s}]")
    if u > b:
        raise NpuOpError(op, "indices", f"{u} updates exceed var's {b} rows (u <= b)")
    rows = indices[:, 0].to(torch.int64)
    keep = rows >= 0  # a negative index writes nothing (the doc: 负值会被直接跳过)
    if bool((rows >= b).any()):
        raise NpuOpError(op, "indices", f"index {int(rows.max())} is out of var's {b} rows (the doc: 索引不支持越界)")
    kept = rows[keep]
    if kept.unique().numel() != kept.numel():
        raise UnemulatedFeatureError(op, "indices", "two updates of one row: the doc does not say which lands; "
                                                    "point the padded rows at a negative index")
    var[kept] = update[keep]


def inplace_partial_rotary_mul(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, *, rotary_mode: str,
                               partial_slice) -> None:
    op = "custom.inplace_partial_rotary_mul"
    chk.tensor(op, "x", x, dims=(4,), dtypes=chk.FLOAT_DTYPES)
    chk.tensor(op, "r1", r1, dims=(4,), dtypes=chk.FLOAT_DTYPES)
    chk.tensor(op, "r2", r2, dims=(4,), dtypes=chk.FLOAT_DTYPES)
    chk.same_dtype(op, "r2", r2, "r1", r1)
    _contiguous(op, x=x, r1=r1, r2=r2)
    if rotary_mode != "interleave":
        raise NpuOpError(op, "rotary_mode", f"{rotary_mode!r}: only 'interleave' is supported")
    if not (isinstance(partial_slice, (list, tuple)) and len(partial_slice) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in partial_slice)):
        raise NpuOpError(op, "partial_slice", f"{partial_slice!r} must be two ints [start, end]")
    b, s, _, d = x.shape
    start, end = partial_slice
    if d > ROTARY_MAX_DIM or d % 2:
        raise NpuOpError(op, "x", f"last axis d = {d} must be even and at most {ROTARY_MAX_DIM}")
    if not 0 <= start < end <= d or (end - start) % 2:
        raise NpuOpError(op, "partial_slice", f"[{start}, {end}] must lie in [0, {d}] with an even, non-empty slice")
    width = end - start
    if tuple(r1.shape) not in ((b, 1, 1, width), (b, s, 1, width)):
        raise NpuOpError(op, "r1", f"shape {tuple(r1.shape)} must be [b, 1, 1, slice] or [b, s, 1, slice] = "
                                   f"[{b}, 1 or {s}, 1, {width}]")
    if r2.shape != r1.shape:
        raise NpuOpError(op, "r2", f"shape {tuple(r2.shape)} must equal r1's {tuple(r1.shape)}")
    cdt = chk.compute_dtype(x.dtype if x.dtype == torch.float64 else r1.dtype)
    part = x[..., start:end].to(cdt)
    out = part * r1.to(cdt) + rotate_interleave(part) * r2.to(cdt)
    x[..., start:end] = out.to(x.dtype)


CUSTOM_OPS = {
    "scatter_nd_update_asc": scatter_nd_update_asc,
    "inplace_partial_rotary_mul": inplace_partial_rotary_mul,
}
