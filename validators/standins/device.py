"""Install CPU stand-ins for ``torch_npu``, ``torchair``, ``torch.npu`` and ``Tensor.npu()``.

Scope: one ``with device_standins():`` block. On entry the npu_ops emulation becomes
``torch_npu`` (and ``torch.ops.npu.<op>``, see ``validators.npu_ops.install_emulation``),
plus the few non-operator attributes the framework touches at import or cache-sizing time;
``torchair`` and ``torch.npu`` are small modules; ``Tensor.npu()`` returns the tensor (CPU), a
``device=`` naming the NPU (an int from ``torch.npu.current_device()``, ``"npu:N"``) is the CPU, and an int32
index of ``index_copy(_)`` (which torch_npu takes) is widened to int64 for the CPU kernel.
On exit ``sys.modules``, the ``torch.npu`` attribute and ``Tensor.npu`` are restored
exactly (absent ones removed).

Anything a stand-in does not provide fails with ``NotStoodInError`` naming the attribute
and the ``file:line`` of the caller, never with a bare ``AttributeError`` deep inside.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from model_infer_kvcache.analyzer.operators.fa_facts import FA_OP_NAMES
from model_infer_kvcache.validators.npu_ops import emulation_installed, install_emulation
from model_infer_kvcache.validators.npu_ops.custom_ops import CUSTOM_OPS
from model_infer_kvcache.validators.npu_ops.errors import (
    NotStoodInError,
    UnemulatedOperatorError,
    caller_location,
)

# Figures ``torch.npu.mem_get_info()`` returns unless the caller sets others: a 64 GiB
# device with everything free (large enough that offline-mode checks never bind).
DEFAULT_TOTAL_BYTES = 64 * 1024**3

_MODULE_NAMES = ("torch_npu", "torch_npu.npu", "torchair", "torchair.ops", "torchair.scope",
                 "torchair.configs", "torchair.configs.compiler_config", "torch.npu")
_ACTIVE: list[StandinHandle] = []


def _caller() -> str:
    # First frame outside this module and the import machinery: the code that asked.
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename == __file__
                                 or frame.f_code.co_filename.startswith("<frozen")):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"


def _strict_getattr(module_name: str):
    def __getattr__(name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # keep introspection (copy, pickle, inspect) working
        if name.startswith("npu_") and module_name in ("torch_npu", "torchair.ops"):
            raise UnemulatedOperatorError(f"{module_name}.{name}", caller_location(2))
        raise NotStoodInError(f"{module_name}.{name} has no CPU stand-in (called from {_caller()})")

    return __getattr__


def _module(name: str, attrs: dict) -> types.ModuleType:
    mod = types.ModuleType(name, f"CPU stand-in for {name} (validators.standins)")
    mod.__dict__.update(attrs)
    mod.__getattr__ = _strict_getattr(name)
    return mod


@dataclass
class StandinHandle:
    """What ``device_standins`` installed; ``mem_info`` is mutable (free, total) bytes."""

    torch_npu: types.ModuleType
    torchair: types.ModuleType
    npu: types.ModuleType
    mem_info: list[int] = field(default_factory=lambda: [DEFAULT_TOTAL_BYTES, DEFAULT_TOTAL_BYTES])
    calls: list[str] = field(default_factory=list)

    def set_mem_info(self, free_bytes: int, total_bytes: int | None = None) -> None:
        self.mem_info[:] = [int(free_bytes), int(total_bytes if total_bytes is not None else free_bytes)]


class _Stream:
    """Stream stand-in: CPU work is synchronous, so waiting and recording do nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _Event()

    def synchronize(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


def _build_torch_npu_namespace(handle_ref: list) -> types.ModuleType:
    def mem_get_info(device=None):
        free, total = handle_ref[0].mem_info
        handle_ref[0].calls.append("torch.npu.mem_get_info")
        return free, total

    default_stream = _Stream()
    attrs = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "manual_seed": lambda seed: torch.manual_seed(seed),
        "manual_seed_all": lambda seed: torch.manual_seed(seed),
        "get_device_name": lambda device=None: "CPU stand-in",
        "mem_get_info": mem_get_info,
        "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: 0,
        "reset_peak_memory_stats": lambda device=None: None,
        "Stream": _Stream,
        "Event": _Event,
        "current_stream": lambda device=None: default_stream,
        "default_stream": lambda device=None: default_stream,
        "stream": lambda stream=None: contextlib.nullcontext(stream),
        # Module-level switches the framework sets at import (internal NZ formats); nothing reads them here.
        "config": types.SimpleNamespace(allow_internal_format=False),
    }
    return _module("torch.npu", attrs)


def _names_the_npu(device) -> bool:
    """An NPU device as model code spells it: ``torch.npu.current_device()`` (an int, which CPU torch reads as
    CUDA) or ``"npu"`` / ``"npu:N"``."""
    return (isinstance(device, int) and not isinstance(device, bool)) or (
        isinstance(device, str) and (device == "npu" or device.startswith("npu:")))


# torch_npu's index_copy / index_copy_ (op-plugin IndexCopyKernelNpuOpApi.cpp) go straight to aclnnIndexCopy /
# aclnnInplaceIndexCopy, whose index may be INT32 or INT64 (CANN's aclnnIndexCopy page); CPU torch's kernel takes
# int64 only ("Expected a long tensor for index"). Upstream bailing_2_5 writes its states back with int32 block ids.
_INDEX_COPY = (torch.Tensor.index_copy_, torch.Tensor.index_copy, torch.index_copy)


class _NpuDeviceIsCpu(torch.overrides.TorchFunctionMode):
    """Within the stand-ins the NPU is the CPU for tensors too: a ``device=`` argument naming the NPU (upstream
    qwen3_5 builds its decode buffers with ``device=torch.npu.current_device()``), or ``Tensor.to`` given one,
    becomes ``"cpu"``; an int32 index of ``index_copy(_)``, which the NPU takes, is widened to the int64 the CPU
    kernel requires. Every other call passes through unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _names_the_npu(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        elif func is torch.Tensor.to and len(args) > 1 and _names_the_npu(args[1]):
            args = (args[0], "cpu", *args[2:])
        elif func in _INDEX_COPY:
            if len(args) > 2 and isinstance(args[2], torch.Tensor) and args[2].dtype == torch.int32:
                args = (*args[:2], args[2].long(), *args[3:])
            elif isinstance(kwargs.get("index"), torch.Tensor) and kwargs["index"].dtype == torch.int32:
                kwargs = {**kwargs, "index": kwargs["index"].long()}
        return func(*args, **kwargs)


def _identity(tensor, *args, **kwargs):
    return tensor


# The ge_graph compile backend of a checkout run in graph mode: graph_capture's recorder, registered by
# checkout_run.engine_run.graph_backend (innermost last).
GRAPH_BACKENDS: list = []


def _npu_backend(compiler_config=None):
    """``torchair.get_npu_backend``: the GE backend the engine compiles a ge_graph decode with
    (executor/utils/graph_utils.py); here kvcache's capture recorder."""
    if not GRAPH_BACKENDS:
        raise NotStoodInError(f"torchair.get_npu_backend has no CPU stand-in outside a graph-mode checkout run "
                              f"(--exe-mode ge_graph) (called from {_caller()})")
    return GRAPH_BACKENDS[-1]


# Rendered validation only: the eager twin of a captured ge_graph decode step (the V307 comparison, kvcache's own
# run) computes torchair.ops' attention as the replayed graph does, instead of refusing.
_EAGER_TWIN: list[bool] = []


def _torchair_attention(name: str):
    """``torchair.ops.<name>``: inside a graph, ``torch.ops.air.<name>`` (the emulated operator with tensor lengths,
    npu_ops/backend.py); eagerly it refuses, as torchair's own CPU and NPU kernels do (a model's eager path calling
    it fails on the device too)."""

    def op(*args, **kwargs):
        if not torch.compiler.is_compiling() and not _EAGER_TWIN:
            raise NotImplementedError(f"torchair.ops.{name} does not support eager mode (torchair registers it for "
                                      f"graph mode only; eager code calls torch_npu.{name})")
        return getattr(torch.ops.air, name)(*args, **kwargs)

    op.__name__ = op.__qualname__ = name
    return op


def _build_torchair() -> dict[str, types.ModuleType]:
    # Eager CPU runs never compile a graph: scopes are no-ops, tagged events do nothing,
    # npu_wait_tensor returns its input.
    scope = _module("torchair.scope", {
        "npu_stream_switch": lambda *a, **k: contextlib.nullcontext(),
        "super_kernel": lambda *a, **k: contextlib.nullcontext(),
        "limit_core_num": lambda *a, **k: contextlib.nullcontext(),
        "npu_wait_tensor": lambda out, wait_tensor: out,
    })
    ops = _module("torchair.ops", {
        "npu_tagged_event_record": lambda *a, **k: None,
        "npu_tagged_event_wait": lambda *a, **k: None,
        "npu_record_tagged_stream": lambda *a, **k: None,
        **{name: _torchair_attention(name) for name in sorted(FA_OP_NAMES)},
    })

    class CompilerConfig:  # graph-mode options; attributes accept anything
        def __getattr__(self, name):
            value = types.SimpleNamespace()
            object.__setattr__(self, name, value)
            return value

    compiler_config = _module("torchair.configs.compiler_config", {"CompilerConfig": CompilerConfig})
    # graph modes: executor/utils/graph_utils.py imports the hcom patch before compiling (a no-op on one CPU rank)
    patch = "torchair.ge_concrete_graph.ge_converter.experimental.patch_for_hcom_allreduce"
    packages = {name: _module(name, {}) for name in ("torchair.ge_concrete_graph", "torchair.ge_concrete_graph.ge_converter",
                                                     "torchair.ge_concrete_graph.ge_converter.experimental", patch)}
    configs = _module("torchair.configs", {"compiler_config": compiler_config})
    torchair = _module("torchair", {"scope": scope, "ops": ops, "configs": configs,
                                    "CompilerConfig": CompilerConfig, "patch_for_hcom": lambda: None,
                                    "get_npu_backend": _npu_backend})
    return {"torchair": torchair, "torchair.ops": ops, "torchair.scope": scope,
            "torchair.configs": configs, "torchair.configs.compiler_config": compiler_config, **packages}


class _CustomOps(types.ModuleType):
    """The checkout's own AscendC operators (``ops/ascendc``: ``import custom_ops`` / ``torch.ops.custom.<op>``):
    the emulated ones (``validators/npu_ops/custom_ops.py``) answer with their emulation; every other answers like a
    missing one (``hasattr`` False; used, the one-line ``UnemulatedOperatorError`` naming it and the caller), so a
    model's fallback still runs."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if name in CUSTOM_OPS:
            return CUSTOM_OPS[name]
        raise UnemulatedOperatorError(f"{self.__name__}.{name}", caller_location(2))


@contextlib.contextmanager
def custom_ops_standin() -> Iterator[types.ModuleType]:
    """``custom_ops`` and ``torch.ops.custom`` for a rendered module that calls the checkout's own operators (a
    DeepSeek-V4 render) outside a checkout run: the emulations, as ``device_standins`` installs them; ones already
    present (a checkout run's stand-ins) kept."""
    had_module, had_namespace = "custom_ops" in sys.modules, "custom" in torch.ops.__dict__
    module = sys.modules.get("custom_ops") or _CustomOps("custom_ops", "CPU stand-in: the checkout's AscendC operators")
    sys.modules["custom_ops"] = module
    if not had_namespace:
        torch.ops.__dict__["custom"] = _CustomOps("torch.ops.custom", "CPU stand-in")
    try:
        yield module
    finally:
        if not had_module:
            sys.modules.pop("custom_ops", None)
        if not had_namespace:
            torch.ops.__dict__.pop("custom", None)


def standins_active() -> bool:
    return bool(_ACTIVE)


@contextlib.contextmanager
def torchair_standin() -> Iterator[types.ModuleType]:
    """The ``torchair`` stand-in for a rendered ge_graph validation (the render imports it; its fused attention is the
    emulation's ``torch.ops.air`` operator), a torchair already importable (a checkout run's stand-ins) kept. Inside
    the block the eager twin of each captured decode step, kvcache's own comparison run, may call torchair.ops'
    attention eagerly."""
    modules = {} if "torchair" in sys.modules else _build_torchair()
    sys.modules.update(modules)
    _EAGER_TWIN.append(True)
    try:
        yield sys.modules["torchair"]
    finally:
        _EAGER_TWIN.pop()
        for name in modules:
            sys.modules.pop(name, None)


@contextlib.contextmanager
def device_standins(*, free_bytes: int | None = None, total_bytes: int | None = None) -> Iterator[StandinHandle]:
    """Install the CPU stand-ins for the block; restore everything on exit (does not nest)."""
    if _ACTIVE:
        raise RuntimeError("device_standins() is already active (it does not nest)")
    saved_modules = {name: sys.modules[name] for name in _MODULE_NAMES if name in sys.modules}
    had_npu_attr = "npu" in torch.__dict__
    saved_npu_attr = torch.__dict__.get("npu")
    had_tensor_npu = "npu" in torch.Tensor.__dict__
    saved_tensor_npu = torch.Tensor.__dict__.get("npu")

    handle_ref: list = [None]
    # Inside a validation run the npu_ops emulation may already be torch_npu: extend it (and take
    # the extensions off again) instead of installing a second one.
    reuse = emulation_installed()
    emulation = contextlib.nullcontext(sys.modules.get("torch_npu")) if reuse else install_emulation()
    with emulation as fake_torch_npu:
        npu = _build_torch_npu_namespace(handle_ref)
        torchair_modules = _build_torchair()
        handle = StandinHandle(fake_torch_npu, torchair_modules["torchair"], npu)
        if free_bytes is not None or total_bytes is not None:
            handle.set_mem_info(free_bytes if free_bytes is not None else total_bytes, total_bytes)
        handle_ref[0] = handle
        # Non-operator torch_npu attributes reached at import / allocation time.
        fake_torch_npu.npu = npu
        fake_torch_npu.empty_with_swapped_memory = (
            lambda size, dtype=None, device=None: torch.empty(size, dtype=dtype))
        fake_torch_npu.__getattr__ = _strict_getattr("torch_npu")
        had_custom = "custom_ops" in sys.modules
        saved_custom = sys.modules.get("custom_ops")
        had_custom_ns = "custom" in torch.ops.__dict__
        saved_custom_ns = torch.ops.__dict__.get("custom")
        try:
            if not had_custom:
                sys.modules["custom_ops"] = _CustomOps("custom_ops", "CPU stand-in: the checkout's AscendC operators")
            if not had_custom_ns:
                torch.ops.__dict__["custom"] = _CustomOps("torch.ops.custom", "CPU stand-in")
            sys.modules["torch_npu.npu"] = npu
            sys.modules["torch.npu"] = npu
            sys.modules.update(torchair_modules)
            torch.npu = npu
            torch.Tensor.npu = _identity
            _ACTIVE.append(handle)
            with _NpuDeviceIsCpu():
                yield handle
        finally:
            _ACTIVE.clear()
            if not had_custom:
                sys.modules.pop("custom_ops", None)
            elif saved_custom is not None:
                sys.modules["custom_ops"] = saved_custom
            if not had_custom_ns:
                torch.ops.__dict__.pop("custom", None)
            else:
                torch.ops.__dict__["custom"] = saved_custom_ns
            if reuse:
                for attr in ("npu", "empty_with_swapped_memory", "__getattr__"):
                    fake_torch_npu.__dict__.pop(attr, None)
            for name in _MODULE_NAMES:
                if name == "torch_npu":
                    continue  # install_emulation restores it
                if name in saved_modules:
                    sys.modules[name] = saved_modules[name]
                else:
                    sys.modules.pop(name, None)
            if had_npu_attr:
                torch.npu = saved_npu_attr
            elif "npu" in torch.__dict__:
                del torch.npu
            if had_tensor_npu:
                torch.Tensor.npu = saved_tensor_npu
            elif "npu" in torch.Tensor.__dict__:
                del torch.Tensor.npu


__all__ = ["DEFAULT_TOTAL_BYTES", "NotStoodInError", "StandinHandle", "custom_ops_standin", "device_standins",
           "standins_active"]
