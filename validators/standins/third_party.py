"""Stand-ins for third-party modules a cann-recipes-infer checkout imports but a validation run never uses.

The checkout's serving stack imports some packages at module level only for paths a CPU validation
never takes (LongBench prompts, quantized checkpoints, the disaggregated KV-transfer client), and
its DeepSeek helpers import a transformers 4.x module that 5.x removed. When such a module is not
installed, ``absent_third_party()`` registers a module whose every attribute imports (a class may
even subclass it) but refuses when called, and removes it on exit. Each stand-in is described in
one line for the report's provenance. Installed modules are never replaced.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from collections.abc import Iterator

OPTIONAL_THIRD_PARTY = {
    "datasets": "LongBench prompt building (executor/utils/data_utils.py)",
    "compressed_tensors": "compressed-tensors quantized checkpoints (module/quantization/compressed_tensors)",
    # cache_utils imports executor.online.kv_transfer for one alignment constant; its package imports requests
    "requests": "the disaggregated KV-transfer bootstrap client (executor/online/kv_transfer/transfer_manager.py)",
    # LongCat-Flash imports it at module level; only exe_mode "npugraph_ex" (graph capture) uses it
    "npugraph_ex": "the npugraph_ex graph-capture mode (exe_mode: npugraph_ex; the validation runs eager)",
}
# Submodules the checkout imports from them.
OPTIONAL_SUBMODULES = {"compressed_tensors": ("quantization",)}
# transformers modules of the 4.x line that 5.x removed, with the names the checkout imports from them
# (the DeepSeek-family modules.py files import the 4.x mask helpers; their eager paged paths never call them).
REMOVED_TRANSFORMERS = {"transformers.modeling_attn_mask_utils": (
    "_prepare_4d_causal_attention_mask", "_prepare_4d_attention_mask", "AttentionMaskConverter")}


class Unavailable:
    """A name of a module that is not installed: importable, its attributes too (enum members read at
    class definition), refusing only when used (called)."""

    def __init__(self, path: str, why: str):
        self._path, self._why = path, why

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return Unavailable(f"{self._path}.{attr}", self._why)

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


def raising_module(name: str, why: str) -> types.ModuleType:
    mod = types.ModuleType(name, f"validation stand-in: {name} is not installed ({why})")

    def __getattr__(attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return Unavailable(f"{name}.{attr}", why)

    mod.__getattr__ = __getattr__
    mod.__path__ = []  # a package: its listed submodules are registered beside it
    return mod


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


@contextlib.contextmanager
def absent_third_party() -> Iterator[list[str]]:
    """Register the stand-ins of the modules above that are not installed; yields their descriptions."""
    added: list[str] = []
    described: list[str] = []
    try:
        for name, why in OPTIONAL_THIRD_PARTY.items():
            if name not in sys.modules and importlib.util.find_spec(name) is None:
                sys.modules[name] = raising_module(name, why)
                added.append(name)
                for sub in OPTIONAL_SUBMODULES.get(name, ()):
                    sys.modules[f"{name}.{sub}"] = raising_module(f"{name}.{sub}", why)
                    added.append(f"{name}.{sub}")
                described.append(f"{name}: not installed; a module whose attributes raise when called ({why})")
        for name, names in REMOVED_TRANSFORMERS.items():
            if name not in sys.modules and importlib.util.find_spec(name) is None:
                why = f"removed in transformers {_transformers_version()}"
                mod = types.ModuleType(name, f"validation stand-in: {name} ({why})")
                for attr in names:
                    # a class (AttentionMaskConverter): importable, subclassable, refusing when used
                    stand_in = Unavailable(f"{name}.{attr}", why) if attr[:1].isupper() else \
                        _refusing_function(f"{name}.{attr}", why)
                    setattr(mod, attr, stand_in)
                sys.modules[name] = mod
                added.append(name)
                described.append(f"{name}: {why}; {', '.join(names)} refuse when called")
        yield described
    finally:
        for name in added:
            sys.modules.pop(name, None)
