"""Choosing between the real torch_npu operators and the CPU emulation, and exposing the emulation.

``load()`` picks a backend. ``install_emulation()`` makes generated code that does
``import torch_npu; torch_npu.npu_fused_infer_attention_score(...)`` or
``torch.ops.npu.npu_fused_infer_attention_score(...)`` run the emulation, inside a
validation process only, and undoes everything on exit.

Importing torch_npu is always guarded: on a machine without CANN it may be installed and
still fail to import with any exception type.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from model_infer_kvcache.analyzer.device_questions import BACKEND_CHOICES
from model_infer_kvcache.analyzer.operators.fa_facts import FA_OP_NAMES, keywords_of
from model_infer_kvcache.analyzer.operators.schemas import load_schemas, schema_release
from model_infer_kvcache.validators.npu_ops import emulated
from model_infer_kvcache.validators.npu_ops.errors import UnemulatedOperatorError, caller_location
from model_infer_kvcache.validators.npu_ops.fake_shapes import FAKE_SHAPES, checked

BACKENDS = BACKEND_CHOICES
EMULATION_MARKER = "__npu_ops_emulation__"


@dataclass
class OpSet:
    """The operators of one backend as attributes (``ops.npu_fused_infer_attention_score(...)``)."""

    backend: str
    ops: dict[str, Any] = field(repr=False)

    def __getattr__(self, name: str) -> Any:
        ops = self.__dict__.get("ops", {})
        if name in ops:
            return ops[name]
        raise AttributeError(f"{self.__dict__.get('backend')} backend has no operator {name!r}")

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self.ops))


def _import_real_torch_npu() -> tuple[types.ModuleType | None, str]:
    """(module, reason). Never raises: any import failure means "no real torch_npu"."""
    current = sys.modules.get("torch_npu")
    if current is not None and getattr(current, EMULATION_MARKER, False):
        return None, "torch_npu is currently the installed emulation"
    try:
        module = importlib.import_module("torch_npu")
    except BaseException as exc:  # noqa: BLE001 - CANN-less hosts raise anything, even SystemExit
        if isinstance(exc, KeyboardInterrupt):
            raise
        return None, f"import torch_npu failed: {type(exc).__name__}: {exc}"
    return module, "imported"


def npu_available() -> tuple[bool, str]:
    """(True, reason) when torch_npu imports and reports at least one NPU."""
    module, reason = _import_real_torch_npu()
    if module is None:
        return False, reason
    try:
        count = int(module.npu.device_count()) if module.npu.is_available() else 0
    except BaseException as exc:  # noqa: BLE001
        if isinstance(exc, KeyboardInterrupt):
            raise
        return False, f"torch_npu imported but the device query failed: {type(exc).__name__}: {exc}"
    return (count > 0, f"{count} NPU(s) visible" if count else "torch_npu imported but no NPU is visible")


def load(backend: str = "auto") -> OpSet:
    """The operator set for ``backend``.

    ``"auto"``: real torch_npu ops when torch_npu imports and an NPU is present, else the
    emulation. ``"npu"``: the real ops or a ``RuntimeError`` saying why not. ``"emulated"``:
    always the emulation.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "emulated":
        return OpSet("emulated", dict(emulated.OPS))
    ok, reason = npu_available()
    if ok:
        module = sys.modules["torch_npu"]
        return OpSet("npu", {name: getattr(module, name) for name in emulated.OPS if hasattr(module, name)})
    if backend == "npu":
        raise RuntimeError(f"backend='npu' requested but no NPU backend is usable: {reason}")
    return OpSet("emulated", dict(emulated.OPS))


# --------------------------------------------------------------------------- install_emulation
_installed = False


def emulation_installed() -> bool:
    return _installed


def _capturable(name: str, fn):
    """``torch_npu.<name>`` of the emulation: the emulation itself, and inside a graph capture (``torch.compile``,
    as the framework's graph modes run decode) the ``torch.ops.npu`` operator, one node whose shape rule is in
    fake_shapes.py and whose kernel is the emulation again when the graph replays."""
    import torch

    def op(*args, **kwargs):
        if torch.compiler.is_compiling():
            if name not in FAKE_SHAPES:
                raise NotImplementedError(f"not supported by kvcache: capturing torch_npu.{name} in a graph (no shape "
                                          "rule in validators/npu_ops/fake_shapes.py)")
            return getattr(torch.ops.npu, name)(*args, **kwargs)
        return fn(*args, **kwargs)

    op.__name__ = op.__qualname__ = name
    op.__doc__ = fn.__doc__
    op.__wrapped__ = fn  # the emulation's signature (inspect.signature follows it)
    return op


def _fake_torch_npu() -> types.ModuleType:
    module = types.ModuleType("torch_npu", "CPU emulation of torch_npu operators (validators.npu_ops)")
    for name, fn in emulated.OPS.items():
        setattr(module, name, _capturable(name, fn))
    module.__version__ = "2.9.0+cpu.emulated"
    setattr(module, EMULATION_MARKER, True)

    def __getattr__(name: str):
        # An operator the model calls that is not emulated: one line naming it and the model line.
        if name.startswith("npu_"):
            raise UnemulatedOperatorError(f"torch_npu.{name}", caller_location(2))
        raise AttributeError(f"module 'torch_npu' (CPU emulation) has no attribute {name!r}")

    module.__getattr__ = __getattr__
    return module


def _strict_npu_namespace():
    """A ``torch.ops.npu`` whose missing operators raise :class:`UnemulatedOperatorError`."""
    from torch._ops import _OpNamespace

    class StrictNpuNamespace(_OpNamespace):
        def __getattr__(self, op_name: str):
            try:
                return super().__getattr__(op_name)
            except AttributeError:
                if op_name.startswith("__") or op_name in ("__origin__", "__self__"):
                    raise
                raise UnemulatedOperatorError(f"torch.ops.npu.{op_name}", caller_location(2)) from None

    return StrictNpuNamespace("npu")


def _dispatching_kernel(name: str):
    fn = emulated.OPS[name]

    def kernel(*args, **kwargs):
        # A registration that outlives its context (older torch cannot unregister) must not
        # quietly keep emulating: refuse outside install_emulation().
        if not _installed:
            raise RuntimeError(f"torch.ops.npu.{name} is the npu_ops emulation, which is only active inside "
                               f"validators.npu_ops.install_emulation()")
        return fn(*args, **kwargs)

    kernel.__name__ = f"emulated_{name}"
    return kernel


def air_schema(name: str) -> str:
    """``torchair.ops.<name>``'s schema: torch_npu's with the FA lengths taken as tensors (torchair
    ``ops/_npu_fused_infer_attention_score_v2.py`` defines ``torch.ops.air.<name>`` with ``Tensor? actual_seq_qlen``,
    ``Tensor? actual_seq_kvlen``: a ge_graph decode reads them on the device, no host list)."""
    kw = keywords_of(name)
    func = load_schemas(schema_release(name))["ops"][name]["func"]
    for length in (kw.q_lens, kw.kv_lens):
        func = func.replace(f"SymInt[]? {length}=", f"Tensor? {length}=")
    return func


def _register_torch_ops() -> list:
    """Define the pinned schemas under ``torch.ops.npu`` (and torchair's fused attention under ``torch.ops.air``)
    with emulated kernels; returns the Libraries."""
    import torch

    lib = torch.library.Library("npu", "FRAGMENT")  # noqa: TOR901 - deliberate, undone on exit
    for name in emulated.OPS:
        if hasattr(torch.ops.npu, name):
            continue  # already defined (an earlier registration that could not be destroyed)
        # an operator newer than the pinned release (npu_chunk_gated_delta_rule) takes that release's schema
        lib.define(load_schemas(schema_release(name))["ops"][name]["func"])
        lib.impl(name, _dispatching_kernel(name), "CompositeExplicitAutograd")
        if name in FAKE_SHAPES:  # what a graph capture traces instead of the emulation (fake_shapes.py)
            torch.library.register_fake(f"npu::{name}", checked(name, FAKE_SHAPES[name]), lib=lib)
    air = torch.library.Library("air", "FRAGMENT")  # noqa: TOR901 - deliberate, undone on exit
    for name in FA_OP_NAMES:
        if hasattr(torch.ops.air, name):
            continue
        air.define(air_schema(name))
        # the kernel a replayed ge graph runs: the emulation, which reads tensor lengths as the device does
        air.impl(name, _dispatching_kernel(name), "CompositeExplicitAutograd")
        torch.library.register_fake(f"air::{name}", FAKE_SHAPES[name], lib=air)
    return [lib, air]


@contextmanager
def install_emulation() -> Iterator[types.ModuleType]:
    """Inside the block, ``import torch_npu`` and ``torch.ops.npu.<op>`` reach the emulation.

    On exit ``sys.modules['torch_npu']`` is restored (or removed) and the ``torch.ops.npu``
    definitions are destroyed, so the ops no longer resolve. If this torch cannot destroy a
    library fragment, the leftover kernels raise outside the context instead of emulating.
    Refuses to run when a real torch_npu is already imported: shadowing it would mix real
    and emulated operators in one process (use ``load('npu')`` there).
    """
    global _installed
    current = sys.modules.get("torch_npu")
    if current is not None and not getattr(current, EMULATION_MARKER, False):
        raise RuntimeError("a real torch_npu is already imported in this process; run the NPU backend "
                           "(load('npu')) instead of installing the emulation")
    if _installed:
        raise RuntimeError("install_emulation() is already active (it does not nest)")
    fake = _fake_torch_npu()
    had_entry = "torch_npu" in sys.modules
    sys.modules["torch_npu"] = fake
    _installed = True
    libs = []
    import torch

    had_namespace = "npu" in torch.ops.__dict__
    saved_namespace = torch.ops.__dict__.get("npu")
    try:
        libs = _register_torch_ops()
        torch.ops.__dict__["npu"] = _strict_npu_namespace()
        yield fake
    finally:
        _installed = False
        if had_namespace:
            torch.ops.__dict__["npu"] = saved_namespace
        else:
            torch.ops.__dict__.pop("npu", None)
        for library in libs:
            if hasattr(library, "_destroy"):
                library._destroy()
        if had_entry:
            sys.modules["torch_npu"] = current
        else:
            sys.modules.pop("torch_npu", None)
