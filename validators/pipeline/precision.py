"""Precision of a validation run: the logit tolerance per compute dtype, and float64 kept float64.

A patch of torch for the duration of a run (``float64_upcasts``), not a check: it lives apart from the
checks so that what they compare is stated in one place.
"""

from __future__ import annotations

import contextlib

# Logit tolerance per compute dtype of the model under test (the reference runs in float64 for
# float64, else float32). float64 is the CPU default: honest code then differs by rounding only
# (measured max 3e-13 over the validation matrix, see references/validation.md), so a limit
# thousands of times above that still sits orders of magnitude below any real defect.
# float32/bfloat16/float16 are the device's dtypes (NPU runs, or emulating them on CPU).
TOLERANCE = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 5e-2, "float16": 5e-2}


@contextlib.contextmanager
def float64_upcasts():
    """Keep float64 tensors float64 where transformers upcasts "to at least float32".

    Its eager attention asks softmax for ``dtype=torch.float32``, its RMSNorms compute in
    ``.to(torch.float32)``, DeepSeek-V2's RoPE in ``.float()``, the DeepSeek MoE router in
    ``.type(torch.float32)`` and ``.softmax(dtype=torch.float32)``: upcasts meant for half
    precision, downcasts on float64 inputs. They put float32 rounding (~1e-6) into the float64
    comparison wherever the rendered path computes the same thing in the operator's precision
    (the fused MLA writer's RMSNorm, the FA softmax) or a 1e-14 difference crosses a float32
    rounding boundary (router scores), and rounding could no longer be told from a defect.
    Inside this context float64 stays float64; tensors of other dtypes are untouched.
    """
    import torch  # here, not at module level: `kvcache validate --help` reads TOLERANCE without torch

    softmax, to, to_float = torch.nn.functional.softmax, torch.Tensor.to, torch.Tensor.float
    tensor_softmax, to_type = torch.Tensor.softmax, torch.Tensor.type

    def softmax64(input, dim=None, _stacklevel=3, dtype=None):
        if dtype is not None and isinstance(input, torch.Tensor) and input.dtype == torch.float64:
            dtype = torch.float64
        return softmax(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)

    def to64(self, *args, **kwargs):
        if self.dtype == torch.float64:
            if args and args[0] is torch.float32:
                args = (torch.float64, *args[1:])
            elif kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
        return to(self, *args, **kwargs)

    def float64(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else to_float(self, *args, **kwargs)

    def tensor_softmax64(self, dim, dtype=None):
        return tensor_softmax(self, dim, dtype=torch.float64 if dtype is not None and self.dtype == torch.float64
                              else dtype)

    def type64(self, dtype=None, *args, **kwargs):
        if dtype is torch.float32 and self.dtype == torch.float64:
            return self
        return to_type(self, dtype, *args, **kwargs) if dtype is not None else to_type(self)

    patched = {"softmax": tensor_softmax64, "to": to64, "float": float64, "type": type64}
    saved = {name: getattr(torch.Tensor, name) for name in patched}
    torch.nn.functional.softmax = softmax64
    for name, fn in patched.items():
        setattr(torch.Tensor, name, fn)
    try:
        yield
    finally:
        torch.nn.functional.softmax = softmax
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
