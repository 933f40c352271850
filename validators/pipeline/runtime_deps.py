"""The third-party modules validation needs, checked before anything runs or is written.

`pip install -e .` installs them (they are runtime dependencies in pyproject.toml); a machine
that lacks one (or has a transformers too old for the calls validation makes) gets one line
naming what to install instead of a traceback halfway through a run.
"""

from __future__ import annotations

import importlib
import re

from model_infer_kvcache.analyzer.errors import InputError

# The reference implementations validation compares against must be right: 5.15 is the first
# release whose DeepSeek-V2 attention applies the YaRN mscale^2 to its softmax scale (with 4.56,
# the first with `from_config(..., dtype=)`, correct DeepSeek-V2 renders fail the scale check).
# Keep equal to pyproject.toml's lower bound.
MIN_TRANSFORMERS = "5.15"
REQUIRED = (("numpy", None), ("transformers", MIN_TRANSFORMERS))


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def missing_dependency(name: str, minimum: str | None) -> str | None:
    """Why ``name`` cannot serve validation (not importable, or older than ``minimum``), or None."""
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        return f"not installed ({' '.join(str(exc).split())})"
    if minimum:
        have = getattr(module, "__version__", "0")
        if _version_tuple(have) < _version_tuple(minimum):
            return f"version {have} is older than the {minimum} validation needs"
    return None


def require_validation_deps() -> None:
    """InputError naming the first missing module and the pip command that installs it."""
    for name, minimum in REQUIRED:
        why = missing_dependency(name, minimum)
        if why:
            spec = f"{name}>={minimum}" if minimum else name
            raise InputError(name, f"{why}: validation needs it; install it with pip install '{spec}' "
                                   "(pip install -e . installs every runtime dependency)")


# transformers imports these lazily; import them before torch_npu is emulated, because
# transformers probes for torch_npu and the emulation module has no import spec.
TRANSFORMERS_EAGER = ("transformers.integrations.flash_attention", "transformers.masking_utils")


def preload_transformers(extra: tuple[str, ...] = ()) -> None:
    """Import the transformers modules that probe for torch_npu, while the real import system is in place."""
    import importlib

    for name in (*TRANSFORMERS_EAGER, *extra):
        importlib.import_module(name)
