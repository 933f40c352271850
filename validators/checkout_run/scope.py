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
import subprocess
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from analyzer.errors import InputError

# Top-level packages of a cann-recipes-infer checkout.
CHECKOUT_PACKAGES = ("executor", "models", "module")
# Third-party modules the checkout imports at module level for paths a validation run never takes.
# transformers modules the checkout's models import (loaded before torch_npu is emulated).
_TRANSFORMERS_FOR_CHECKOUT = ("transformers.activations", "transformers.modeling_utils")
_OPTIONAL_THIRD_PARTY = {"datasets": "LongBench prompt building (executor/utils/data_utils.py)"}


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


def checkout_commit(root: Path) -> str | None:
    """HEAD commit when ``root`` is inside a git work tree, else None."""
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def _raising_module(name: str, why: str) -> types.ModuleType:
    mod = types.ModuleType(name, f"validation stand-in: {name} is not installed ({why})")

    def __getattr__(attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)

        def unavailable(*args, **kwargs):  # importable by name, refuses when called
            raise RuntimeError(f"{name}.{attr} is not available in this validation run ({name} is not "
                               f"installed; it serves {why})")

        return unavailable

    mod.__getattr__ = __getattr__
    return mod


@contextlib.contextmanager
def checkout_scope(root: Path) -> Iterator[CheckoutScope]:
    """Import context for the checkout at ``root`` (see the module docstring); restores everything on exit."""
    from validators.pipeline.validate import _TRANSFORMERS_EAGER
    from validators.standins import device_standins

    # transformers probes for torch_npu when these load; the emulation has no import spec.
    for name in (*_TRANSFORMERS_EAGER, *_TRANSFORMERS_FOR_CHECKOUT):
        importlib.import_module(name)
    saved_modules = {n: m for n, m in sys.modules.items() if _is_checkout_module(n)}
    saved_path = list(sys.path)
    saved_bytecode = sys.dont_write_bytecode
    added_third_party = []
    for name in saved_modules:
        del sys.modules[name]
    scope = CheckoutScope(root)
    try:
        with device_standins() as handle:
            scope.handle = handle
            scope.standins += ["torch_npu: validators.npu_ops emulation (also torch.ops.npu)",
                               "torchair, torch.npu, Tensor.npu: validators.standins"]
            for name, why in _OPTIONAL_THIRD_PARTY.items():
                if name not in sys.modules and importlib.util.find_spec(name) is None:
                    sys.modules[name] = _raising_module(name, why)
                    added_third_party.append(name)
                    scope.standins.append(f"{name}: not installed; a module whose attributes raise when called ({why})")
            sys.dont_write_bytecode = True
            sys.path.insert(0, str(root))
            importlib.invalidate_caches()
            yield scope
    finally:
        for name in [n for n in sys.modules if _is_checkout_module(n)]:
            del sys.modules[name]
        sys.modules.update(saved_modules)
        for name in added_third_party:
            sys.modules.pop(name, None)
        sys.path[:] = saved_path
        sys.dont_write_bytecode = saved_bytecode
        importlib.invalidate_caches()
