"""The checkout as importable code, for one validation process and nothing beyond it.

``checkout_scope(root)`` puts the checkout's root on ``sys.path`` (its ``executor``, ``models``
and ``module`` packages import as the checkout's launch scripts import them), installs the CPU
stand-ins of the device stack (``validators.standins``: torch_npu backed by ``validators.npu_ops``,
torchair, torch.npu, Tensor.npu), and on exit removes every module it imported and restores
``sys.path``. Nothing is written into the checkout (no ``__pycache__`` either).

What does not exist on a CPU is stood in minimally, and every stand-in is listed in the scope's
``standins`` (provenance): HCCL process groups become gloo groups over the same ranks; the
``npu:N`` device becomes the CPU; a third-party module the checkout imports only for features a
validation run does not reach (``datasets``, used by the LongBench prompt builder) gets a module
whose every attribute raises.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from analyzer.errors import InputError
from validators.harness.install import isolated_modules

# Top-level packages of a cann-recipes-infer checkout.
CHECKOUT_PACKAGES = ("executor", "models", "module")
# Third-party modules the checkout imports at module level for paths a validation run never takes.
# transformers modules the checkout's models import (loaded before torch_npu is emulated).
_TRANSFORMERS_FOR_CHECKOUT = ("transformers.activations", "transformers.modeling_utils")
_OPTIONAL_THIRD_PARTY = {
    "datasets": "LongBench prompt building (executor/utils/data_utils.py)",
    "compressed_tensors": "compressed-tensors quantized checkpoints (module/quantization/compressed_tensors)",
    # cache_utils imports executor.online.kv_transfer for one alignment constant; its package imports requests
    "requests": "the disaggregated KV-transfer bootstrap client (executor/online/kv_transfer/transfer_manager.py)",
}
# transformers modules of the 4.x line that 5.x removed, with the names the checkout imports from them
# (DeepSeek's modules.py imports a mask helper its eager paged path never calls).
_REMOVED_TRANSFORMERS = {"transformers.modeling_attn_mask_utils": ("_prepare_4d_causal_attention_mask",)}
# Submodules the checkout imports from them.
_OPTIONAL_SUBMODULES = {"compressed_tensors": ("quantization",)}


@dataclass
class CheckoutScope:
    root: Path
    standins: list[str] = field(default_factory=list)  # what stands in for what, one line each
    handle: object = None  # validators.standins.StandinHandle

    def modules_from_checkout(self) -> list[str]:
        """Names of the loaded modules whose file lies inside the checkout."""
        root = str(self.root)
        return sorted(name for name, mod in sys.modules.items()
                      if _is_checkout_module(name) and str(getattr(mod, "__file__", "") or "").startswith(root))


def _is_checkout_module(name: str) -> bool:
    return name.split(".", 1)[0] in CHECKOUT_PACKAGES


def require_checkout(root: str | Path) -> Path:
    """The resolved root, or bad input naming --framework-root."""
    path = Path(root).resolve()
    if not (path / "executor" / "core" / "support_models.py").is_file():
        raise InputError(str(root), "is not a cann-recipes-infer checkout (no executor/core/support_models.py)",
                         field="--framework-root")
    return path


class _Unavailable:
    """A name of a module that is not installed: importable, its attributes too (enum members read at
    class definition), refusing only when used (called)."""

    def __init__(self, path: str, why: str):
        self._path, self._why = path, why

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self._path}.{attr}", self._why)

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._path} is not available in this validation run (not installed; it serves "
                           f"{self._why})")

    def __mro_entries__(self, bases):  # subclassed at import: an empty base
        return (object,)


def _refusing_function(path: str, why: str):
    name = path.rpartition(".")[2]

    def refuse(*args, **kwargs):
        raise RuntimeError(f"{path} is not available in this validation run ({why})")

    refuse.__name__ = refuse.__qualname__ = name
    return refuse


def _raising_module(name: str, why: str) -> types.ModuleType:
    mod = types.ModuleType(name, f"validation stand-in: {name} is not installed ({why})")

    def __getattr__(attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{name}.{attr}", why)

    mod.__getattr__ = __getattr__
    mod.__path__ = []  # a package: its listed submodules are registered beside it
    return mod


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


@contextlib.contextmanager
def checkout_scope(root: Path) -> Iterator[CheckoutScope]:
    """Import context for the checkout at ``root`` (see the module docstring); restores everything on exit."""
    from validators.pipeline.validate import _TRANSFORMERS_EAGER
    from validators.standins import device_standins

    # transformers probes for torch_npu when these load; the emulation has no import spec.
    for name in (*_TRANSFORMERS_EAGER, *_TRANSFORMERS_FOR_CHECKOUT):
        importlib.import_module(name)
    added_third_party = []
    scope = CheckoutScope(root)
    try:
        with isolated_modules(_is_checkout_module), device_standins() as handle:
            scope.handle = handle
            scope.standins += ["torch_npu: validators.npu_ops emulation (also torch.ops.npu)",
                               "torchair, torch.npu, Tensor.npu: validators.standins"]
            for name, why in _OPTIONAL_THIRD_PARTY.items():
                if name not in sys.modules and importlib.util.find_spec(name) is None:
                    sys.modules[name] = _raising_module(name, why)
                    added_third_party.append(name)
                    for sub in _OPTIONAL_SUBMODULES.get(name, ()):
                        sys.modules[f"{name}.{sub}"] = _raising_module(f"{name}.{sub}", why)
                        added_third_party.append(f"{name}.{sub}")
                    scope.standins.append(f"{name}: not installed; a module whose attributes raise when called ({why})")
            for name, names in _REMOVED_TRANSFORMERS.items():
                if name not in sys.modules and importlib.util.find_spec(name) is None:
                    why = f"removed in transformers {_transformers_version()}"
                    mod = types.ModuleType(name, f"validation stand-in: {name} ({why})")
                    for attr in names:
                        setattr(mod, attr, _refusing_function(f"{name}.{attr}", why))
                    sys.modules[name] = mod
                    added_third_party.append(name)
                    scope.standins.append(f"{name}: {why}; {', '.join(names)} refuse when called")
            sys.dont_write_bytecode = True
            sys.path.insert(0, str(root))
            importlib.invalidate_caches()
            yield scope
    finally:
        for name in added_third_party:
            sys.modules.pop(name, None)
