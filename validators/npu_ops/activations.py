"""Gated activations over the two halves of ``self`` along ``dim``.

* ``npu_swiglu``: ``swish(A) * B = A * sigmoid(A) * B`` with ``A, B`` the halves (torch-npu 2.9.0 doc
  ``npu_swiglu``; self 1-8-D, fp32/fp16/bf16; output halves ``dim``, meta).
* ``npu_geglu(self, dim=-1, approximate=1, activate_left=False) -> (out, out_gelu)``: the doc names GeGlu, its
  two outputs (``out``, ``outGelu``, each half of ``self`` along ``dim``) and ``approximate`` (0: exact gelu,
  1: tanh); the schema adds ``activate_left``: the gelu goes on the left half when True, else on the right
  half (the name's meaning; upstream gemma_4 says the same), the other half multiplies it. ``out_gelu`` is the
  activated half after gelu.
"""

from __future__ import annotations

import torch
from model_infer_kvcache.validators.npu_ops import op_checks as chk
from model_infer_kvcache.validators.npu_ops.errors import NpuOpError


def npu_swiglu(self, dim=-1):
    op = "npu_swiglu"
    chk.tensor(op, "self", self, dims=tuple(range(1, 9)), dtypes=chk.FLOAT_DTYPES)
    chk.integer(op, "dim", dim, low=-self.dim(), high=self.dim() - 1)
    if self.shape[dim] % 2:
        raise NpuOpError(op, "dim", f"size {self.shape[dim]} of dim {dim} must be even (split into A and B)")
    a, b = self.to(chk.compute_dtype(self.dtype)).chunk(2, dim=dim)
    return (a * torch.sigmoid(a) * b).to(self.dtype)


def npu_geglu(self, dim=-1, approximate=1, activate_left=False):
    op = "npu_geglu"
    chk.tensor(op, "self", self, dtypes=chk.FLOAT_DTYPES)
    rank = max(self.dim(), 1)
    chk.integer(op, "dim", dim, low=-rank, high=rank - 1)
    chk.choice(op, "approximate", approximate, (0, 1))
    if self.dim() == 0 or self.shape[dim] % 2:
        raise NpuOpError(op, "dim", f"size of dim {dim} must be even (split into two halves), shape {tuple(self.shape)}")
    left, right = self.to(chk.compute_dtype(self.dtype)).chunk(2, dim=dim)
    gate, other = (left, right) if activate_left else (right, left)
    gelu = torch.nn.functional.gelu(gate, approximate="tanh" if approximate == 1 else "none")
    return (gelu * other).to(self.dtype), gelu.to(self.dtype)


OPS = {"npu_swiglu": npu_swiglu, "npu_geglu": npu_geglu}
