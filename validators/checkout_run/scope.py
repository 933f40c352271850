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
whose every attribute raises when called (``validators.standins.third_party``).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.validators.harness.install import isolated_modules

# Top-level packages of a cann-recipes-infer checkout.
CHECKOUT_PACKAGES = ("executor", "models", "module")
# transformers modules the checkout's models import (loaded before torch_npu is emulated).
_TRANSFORMERS_FOR_CHECKOUT = ("transformers.activations", "transformers.modeling_utils")


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


@contextlib.contextmanager
def checkout_scope(root: Path) -> Iterator[CheckoutScope]:
    """Import context for the checkout at ``root`` (see the module docstring); restores everything on exit."""
    from model_infer_kvcache.validators.pipeline.runtime_deps import preload_transformers
    from model_infer_kvcache.validators.standins import device_standins
    from model_infer_kvcache.validators.standins.third_party import absent_third_party

    # transformers probes for torch_npu when these load; the emulation has no import spec.
    preload_transformers(_TRANSFORMERS_FOR_CHECKOUT)
    scope = CheckoutScope(root)
    with isolated_modules(_is_checkout_module), device_standins() as handle, absent_third_party() as third_party:
        scope.handle = handle
        scope.standins += ["torch_npu: validators.npu_ops emulation (also torch.ops.npu)",
                           "torchair, torch.npu, Tensor.npu: validators.standins",
                           "a device= naming the NPU (torch.npu.current_device(), 'npu:N'): the CPU",
                           "index_copy(_) with an int32 index (torch_npu's aclnnIndexCopy takes INT32 and INT64; "
                           "CPU torch int64 only): the index widened to int64", *third_party]
        sys.dont_write_bytecode = True
        sys.path.insert(0, str(root))
        importlib.invalidate_caches()
        yield scope
