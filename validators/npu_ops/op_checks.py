"""Argument checks shared by the emulated operators: each failure names the op and the argument."""

from __future__ import annotations

import torch
from model_infer_kvcache.validators.npu_ops.errors import NpuOpError, UnemulatedFeatureError

# Device dtypes of the float operators, plus float64: a CPU validation mode, not a device dtype.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic dtype of the emulation: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def tensor(op: str, name: str, value, *, dims: tuple[int, ...] | None = None,
           dtypes: tuple[torch.dtype, ...] | None = None) -> torch.Tensor:
    """``value`` is a tensor of one of ``dims`` ranks and ``dtypes``; returns it."""
    if not isinstance(value, torch.Tensor):
        raise NpuOpError(op, name, f"must be a Tensor, got {type(value).__name__}")
    if dims is not None and value.dim() not in dims:
        raise NpuOpError(op, name, f"must be {'/'.join(map(str, dims))}-D, got shape {tuple(value.shape)}")
    if dtypes is not None and value.dtype not in dtypes:
        raise NpuOpError(op, name, f"dtype {value.dtype} is not supported (supported: "
                                   f"{', '.join(str(d).removeprefix('torch.') for d in dtypes)})")
    return value


def same_dtype(op: str, name: str, value: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if value.dtype != ref.dtype:
        raise NpuOpError(op, name, f"dtype {value.dtype} must equal {ref_name}'s {ref.dtype}")


def integer(op: str, name: str, value, *, low: int | None = None, high: int | None = None) -> int:
    """A Python int (bool refused) in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise NpuOpError(op, name, f"must be an int, got {type(value).__name__}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise NpuOpError(op, name, f"{value} is outside [{low if low is not None else '-inf'}, "
                                   f"{high if high is not None else 'inf'}]")
    return value


def choice(op: str, name: str, value, supported: tuple, *, documented: tuple = ()) -> object:
    """``value`` must be one of ``supported``; a documented but unsupported value is NotEmulated."""
    if value in supported:
        return value
    if value in documented:
        raise UnemulatedFeatureError(op, name, f"{value!r} is documented but not emulated (emulated: {list(supported)})")
    raise NpuOpError(op, name, f"{value!r} is not one of {list(supported) + list(documented)}")


def absent(op: str, **values) -> None:
    """Quantization / unsupported-feature arguments must be None (or an empty list)."""
    for name, value in values.items():
        if value is not None and not (isinstance(value, (list, tuple)) and len(value) == 0):
            raise UnemulatedFeatureError(op, name, "this feature (quantization / activation / tuning) is not emulated; "
                                             "validate it on an NPU")
