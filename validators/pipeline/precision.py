"""Precision of a validation run: the logit tolerance per compute dtype, and float64 kept float64.

A patch of torch for the duration of a run (``float64_upcasts``), not a check: it lives apart from the
checks so that what they compare is stated in one place.
"""

from __future__ import annotations

import contextlib
import functools

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

    Eager runs patch the five functions (cheap); a graph capture, which refuses patched tensor
    methods, takes the same rule as a torch function mode (``traceable_upcasts``).
    """
    import torch  # here, not at module level: `kvcache validate --help` reads TOLERANCE without torch

    originals = _originals(torch)
    _ACTIVE.append(originals)
    _install(torch, {kind: _patched(fn or getattr(torch.Tensor, kind), kind) for kind, fn in originals.items()})
    try:
        yield
    finally:
        _ACTIVE.pop()
        _install(torch, originals)


@contextlib.contextmanager
def traceable_upcasts():
    """The same rule for a traced region (a captured decode step): the unpatched functions under a torch function
    mode that applies ``_upcast``. Outside ``float64_upcasts`` there is nothing to keep and nothing changes."""
    import torch

    if not _ACTIVE:
        yield
        return
    originals = _ACTIVE[-1]
    patched = _originals(torch)
    _install(torch, originals)
    kinds = {(fn or getattr(torch.Tensor, kind)): kind for kind, fn in originals.items()}
    try:
        with _mode_class()(kinds):
            yield
    finally:
        _install(torch, patched)


_ACTIVE: list[dict] = []  # the unpatched functions of each active float64_upcasts


@functools.cache
def _mode_class():
    """One class for every capture: a captured graph guards on the mode stack's types."""
    import torch

    class Float64Upcasts(torch.overrides.TorchFunctionMode):
        def __init__(self, kinds: dict):
            super().__init__()
            self.kinds = kinds  # function -> its kind in _upcast

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kind = self.kinds.get(func)
            if kind is not None:
                args, kwargs, result = _upcast(kind, args, kwargs or {})
                if result is not None:
                    return result
            return func(*args, **(kwargs or {}))

    return Float64Upcasts


def _originals(torch) -> dict:
    # A method torch.Tensor inherits (from the C TensorBase) is kept as None: restoring means deleting the patch,
    # since a copy set on torch.Tensor would no longer be the builtin method a graph capture knows.
    own = torch.Tensor.__dict__
    return {"to": own.get("to"), "float": own.get("float"), "type": own.get("type"), "softmax": own.get("softmax"),
            "F.softmax": torch.nn.functional.softmax}


def _install(torch, fns: dict) -> None:
    torch.nn.functional.softmax = fns["F.softmax"]
    for kind in ("to", "float", "type", "softmax"):
        if fns[kind] is not None:
            setattr(torch.Tensor, kind, fns[kind])
        elif kind in torch.Tensor.__dict__:
            delattr(torch.Tensor, kind)


def _upcast(kind: str, args: tuple, kwargs: dict):
    """The rule for one call: (args, kwargs, result); result is not None when the call is answered without running
    (``.float()`` / ``.type(torch.float32)`` of a float64 tensor is the tensor itself)."""
    import torch

    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float64:
        return args, kwargs, None
    if kind == "to":
        if len(args) > 1 and args[1] is torch.float32:
            args = (x, torch.float64, *args[2:])
        elif kwargs.get("dtype") is torch.float32:
            kwargs = {**kwargs, "dtype": torch.float64}
    elif kind == "float" or (kind == "type" and (args[1] if len(args) > 1 else kwargs.get("dtype")) is torch.float32):
        return args, kwargs, x
    elif kind in ("softmax", "F.softmax"):
        if kwargs.get("dtype") is not None:
            kwargs = {**kwargs, "dtype": torch.float64}
        elif kind == "softmax" and len(args) > 2 and args[2] is not None:  # x.softmax(dim, dtype)
            args = (x, args[1], torch.float64)
    return args, kwargs, None


def _patched(fn, kind: str):
    def patched(*args, **kwargs):
        args, kwargs, result = _upcast(kind, args, kwargs)
        return fn(*args, **kwargs) if result is None else result

    patched.__name__ = fn.__name__
    return patched
