"""RMSNorm operators: ``npu_rms_norm`` and ``npu_add_rms_norm``.

Doc (torch-npu 2.9.0 ``_op_plugin_docs.py``, ``npu_rms_norm``): ``y = x / sqrt(mean(x^2) + eps) * gamma``
over the trailing ``gamma.dim()`` axes; gamma has self's dtype; outputs ``(y, rstd)`` with
``rstd`` float32 of shape ``self.shape[:-gamma.dim()] + [1] * gamma.dim()`` (meta registration).
``npu_add_rms_norm`` has no doc entry in 2.9.0: its outputs ``(y, rstd, x)`` follow the meta
registration and the documented fused variant ``npu_add_rms_norm_cast`` (``x = x1 + x2``, ``y`` the
RMSNorm of ``x``; x1/x2/gamma one dtype, x1 and x2 one shape).
"""

from __future__ import annotations

import torch
from model_infer_kvcache.validators.npu_ops import op_checks as chk
from model_infer_kvcache.validators.npu_ops.errors import NpuOpError


def _check_gamma(op: str, x: torch.Tensor, gamma: torch.Tensor) -> int:
    chk.tensor(op, "gamma", gamma, dtypes=chk.FLOAT_DTYPES)
    chk.same_dtype(op, "gamma", gamma, "x", x)
    g = gamma.dim()
    if not 1 <= g <= x.dim() or tuple(x.shape[x.dim() - g:]) != tuple(gamma.shape):
        raise NpuOpError(op, "gamma", f"shape {tuple(gamma.shape)} must equal the trailing axes of x "
                                      f"{tuple(x.shape)}")
    return g


def _epsilon(op: str, epsilon) -> float:
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or epsilon < 0:
        raise NpuOpError(op, "epsilon", f"must be a non-negative float, got {epsilon!r}")
    return float(epsilon)


def _rms(x: torch.Tensor, gamma: torch.Tensor, g: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(normalized * gamma, rstd) in the compute dtype of ``x``."""
    axes = tuple(range(x.dim() - g, x.dim()))
    rstd = torch.rsqrt(x.pow(2).mean(dim=axes, keepdim=True) + eps)
    return x * rstd * gamma.to(x.dtype), rstd


def rms_norm(op: str, x: torch.Tensor, gamma: torch.Tensor, epsilon) -> tuple[torch.Tensor, torch.Tensor]:
    chk.tensor(op, "self", x, dims=tuple(range(1, 9)), dtypes=chk.FLOAT_DTYPES)
    g = _check_gamma(op, x, gamma)
    eps = _epsilon(op, epsilon)
    y, rstd = _rms(x.to(chk.compute_dtype(x.dtype)), gamma, g, eps)
    return y.to(x.dtype), rstd.to(torch.float32)


def add_rms_norm(op: str, x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor,
                 epsilon) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    chk.tensor(op, "x1", x1, dims=tuple(range(1, 9)), dtypes=chk.FLOAT_DTYPES)
    chk.tensor(op, "x2", x2, dtypes=chk.FLOAT_DTYPES)
    chk.same_dtype(op, "x2", x2, "x1", x1)
    if x2.shape != x1.shape:
        raise NpuOpError(op, "x2", f"shape {tuple(x2.shape)} must equal x1's {tuple(x1.shape)}")
    g = _check_gamma(op, x1, gamma)
    eps = _epsilon(op, epsilon)
    cdt = chk.compute_dtype(x1.dtype)
    total = x1.to(cdt) + x2.to(cdt)
    y, rstd = _rms(total, gamma, g, eps)
    return y.to(x1.dtype), rstd.to(torch.float32), total.to(x1.dtype)


def npu_rms_norm(self, gamma, epsilon=1e-06):
    """``(y, rstd)``: RMSNorm of ``self`` over gamma's axes."""
    return rms_norm("npu_rms_norm", self, gamma, epsilon)


def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-06):
    """``(y, rstd, x)``: ``x = x1 + x2`` and its RMSNorm ``y``."""
    return add_rms_norm("npu_add_rms_norm", x1, x2, gamma, epsilon)


OPS = {"npu_rms_norm": npu_rms_norm, "npu_add_rms_norm": npu_add_rms_norm}
