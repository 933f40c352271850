"""``npu_swiglu``: ``swish(A) * B = A * sigmoid(A) * B`` with ``A, B`` the halves of ``self`` along ``dim``
(torch-npu 2.9.0 doc ``npu_swiglu``; self 1-8-D, fp32/fp16/bf16; output halves ``dim``, meta)."""

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


OPS = {"npu_swiglu": npu_swiglu}
