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
# A reference that amplifies its own rounding past the float64 bound (Gemma-3n at its class defaults: 25 layers of
# q/k-normed attention at scale 1; transformers' eager and SDPA forwards of it differ by 5.4e-9, a one-ulp change of
# its embeddings moves its logits by 2.8e-8) cannot be judged at 1e-9: any two exact float64 orders of the same
# arithmetic differ by more. There the bound is CONDITIONING_FACTOR x the reference's own one-ulp sensitivity
# (measured on the worst request, reported), and never above CONDITIONED_CEILING: a model more sensitive than that
# keeps the fixed bound and fails, saying why.
CONDITIONING_FACTOR = 10.0
CONDITIONED_CEILING = 1e-6
# The same in a device dtype (bfloat16): transformers' own model run in that dtype lands DRIFT_FACTOR x its
# distance from the float32 reference away at most (DeepSeek-V4's HCA fixture: 0.29 in bfloat16 against a fixed
# 5e-2), never above DRIFT_CEILING (logits of rms ~1: beyond that the comparison says nothing).
DRIFT_FACTOR = 2.0
DRIFT_CEILING = 1.0


def conditioned_bound(tolerance: float, sensitivity: float | None, dtype: str = "float64") -> float:
    """The logit bound given the reference's own error measure (None: not measured): its one-ulp sensitivity in a
    float64 run, its drift when run in ``dtype`` otherwise."""
    if sensitivity is None or tolerance != TOLERANCE.get(dtype):
        return tolerance
    factor, ceiling = (CONDITIONING_FACTOR, CONDITIONED_CEILING) if dtype == "float64" else (DRIFT_FACTOR,
                                                                                             DRIFT_CEILING)
    raised = factor * sensitivity
    return raised if tolerance < raised <= ceiling else tolerance


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
    methods, traces the unpatched ones (``traceable_upcasts``) and takes the same rule as a pass
    over the captured graph (``upcast_graph``).
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
    """The same rule for a traced region (a captured decode step): the unpatched functions while Dynamo traces and
    replays, the rule applied to the captured graph by its backend (``upcast_graph``). Outside ``float64_upcasts``
    there is nothing to keep and nothing changes. (A torch function mode would carry the rule too, but Dynamo traces
    its ``__torch_function__`` afresh for every torch call of the step: a sixth of the capture's time.)"""
    import torch

    if not _ACTIVE:
        yield
        return
    patched = _originals(torch)
    _install(torch, _ACTIVE[-1])
    try:
        yield
    finally:
        _install(torch, patched)


_ACTIVE: list[dict] = []  # the unpatched functions of each active float64_upcasts


def upcast_graph(gm) -> None:
    """``_upcast`` applied to a captured graph inside ``float64_upcasts`` (the graph traced with the unpatched
    functions): a float64 tensor's cast to float32 keeps float64 (``.float()`` / ``.type(float32)`` of it become the
    tensor itself), softmax's float32 dtype becomes float64. The graph is rerun on the trace's fake tensors, each
    node on its inputs as the rule leaves them: a tensor the trace saw float32 only because an earlier cast rounded
    it is float64 under the rule, and its own cast keeps it so."""
    if not _ACTIVE or not any(_kind(n) for n in gm.graph.nodes):
        return
    placeholders = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    run = _upcaster()(gm, placeholders)
    with run.mode:
        run.run(*placeholders)
    for node in run.dropped:  # the tensor itself: its users take its input
        node.replace_all_uses_with(node.args[0] if node.args else node.kwargs["input"])
        gm.graph.erase_node(node)
    if run.changed or run.dropped:
        gm.recompile()


def _kind(node) -> str | None:
    """The kind of ``_upcast`` a graph node is: Dynamo records the tensor methods as call_method by name and the
    functional softmax as a call_function of its Python function."""
    if node.op == "call_method" and node.target in ("to", "float", "type", "softmax"):
        return node.target
    return "F.softmax" if node.op == "call_function" and node.target is _ACTIVE[-1]["F.softmax"] else None


@functools.cache
def _upcaster():
    import torch

    class Upcaster(torch.fx.Interpreter):
        """The captured graph run on its trace's fake tensors (their own fake mode, not the fresh one Dynamo gives
        its backend), rewriting each upcast node by ``_upcast`` on the values it gets."""

        def __init__(self, gm, placeholders: list):
            super().__init__(gm)
            self.mode = next((v.fake_mode for v in placeholders if hasattr(v, "fake_mode")), None) or \
                torch._subclasses.fake_tensor.FakeTensorMode()
            self.changed, self.dropped = False, []

        def get_attr(self, target, args, kwargs):
            value = super().get_attr(target, args, kwargs)
            return self.mode.from_tensor(value) if isinstance(value, torch.Tensor) else value

        def run_node(self, n):
            kind = _kind(n)
            if kind is not None:
                args, kwargs = self.fetch_args_kwargs_from_env(n)
                new_args, new_kwargs, result = _upcast(kind, args, kwargs)
                if result is not None:
                    self.dropped.append(n)
                    return result
                if new_args is not args or new_kwargs is not kwargs:  # a dtype argument replaced
                    n.args = tuple(new if new is not old else arg
                                   for arg, old, new in zip(n.args, args, new_args, strict=True))
                    n.kwargs = {**n.kwargs, **{k: v for k, v in new_kwargs.items() if v is not kwargs.get(k)}}
                    self.changed = True
            return super().run_node(n)

    return Upcaster


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
