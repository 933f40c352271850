"""Make framework-mode code import the harness (or a real checkout) under ``executor.*``.

Rendered model code imports, as the repository's models do::

    from executor.core.kv_cache.cache_info import CacheEntry, LayerCacheInfo, ModelCacheInfo
    from executor.utils.forward_metadata import ForwardMetaData, get_forward_metadata

Inside ``install_framework(...)`` those names resolve to the harness classes of one API
generation, or, with ``framework_root``, to the real checkout's modules. Only the
validation process sees them; on exit ``sys.modules`` and ``sys.path`` are restored.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from . import block_pool as _block_pool
from . import cache_utils as _cache_utils
from . import common_utils as _common_utils
from . import forward_metadata as _forward_metadata
from . import kv_cache_manager as _kv_cache_manager
from . import managers as _managers
from .errors import FrameworkImportError
from .generations import detect_generation_from_classes, get_generation

# Modules the harness provides (and that a real checkout must provide).
REQUIRED_MODULES = (
    "executor.core.kv_cache",
    "executor.core.kv_cache.cache_info",
    "executor.utils.forward_metadata",
    "executor.utils.common_utils",
)


def _module(name: str, attrs: dict, *, package: bool = False, doc: str = "") -> types.ModuleType:
    mod = types.ModuleType(name, doc or f"cann-recipes-infer contract harness: {name}")
    mod.__dict__.update(attrs)
    mod.__file__ = f"<harness:{name}>"
    if package:
        mod.__path__ = []  # a package with no search path: only registered children import
        mod.__package__ = name
    else:
        mod.__package__ = name.rpartition(".")[0]
    mod.__all__ = sorted(k for k in attrs if not k.startswith("_"))
    return mod


def build_harness_modules(
    generation: str = "G2",
    *,
    extra_window_keys: int = 0,
    recycle_skipped_on_failure: bool = False,
) -> dict[str, types.ModuleType]:
    """Module objects that mirror the repository layout for one generation (not registered)."""
    gen = get_generation(generation)
    per_entry = gen.name in ("G2", "G3")
    g3 = gen.name == "G3"
    manager_map = _managers.ATTN_TYPE_MANAGER_MAP_G3 if g3 else _managers.ATTN_TYPE_MANAGER_MAP

    cache_info = {"CacheEntry": gen.CacheEntry, "LayerCacheInfo": gen.LayerCacheInfo,
                  "ModelCacheInfo": gen.ModelCacheInfo}
    if per_entry:
        cache_info["CacheAllocator"] = gen.CacheAllocator
    if g3:
        cache_info.update(MambaCacheEntry=gen.MambaCacheEntry, MemoryBudgetItem=gen.MemoryBudgetItem,
                          OffloadWorkspaceMemoryInfo=gen.OffloadWorkspaceMemoryInfo)

    create_managers = functools.partial(
        _managers.create_single_type_managers, extra_window_keys=extra_window_keys,
        prefill_extra_tokens=gen.sliding_prefill_extra_tokens, manager_map=manager_map,
    )
    manager_cls = type(
        "KVCacheManager",
        (_kv_cache_manager.KVCacheManager,),
        {"__init__": _with_recycle_default(recycle_skipped_on_failure), "__module__": "executor.core.kv_cache"},
    )
    single_type = {
        "ATTN_TYPE_MANAGER_MAP": manager_map,
        "SingleTypeKVCacheManager": _managers.SingleTypeKVCacheManager,
        "FullAttentionManager": _managers.FullAttentionManager,
        "SlidingWindowManager": _managers.SlidingWindowManager,
        "create_single_type_managers": create_managers,
        "window_keys": _managers.window_keys,
    }
    if g3:
        single_type["MambaManager"] = _managers.MambaManager
    if per_entry:
        prepare_tables = _cache_utils.prepare_block_tables_g3 if g3 else _cache_utils.prepare_block_tables_g2
        prepare_slots = _cache_utils.prepare_slot_mapping_g3 if g3 else _cache_utils.prepare_slot_mapping_g2
    else:
        prepare_tables = (_cache_utils.prepare_block_tables_g0 if gen.name == "G0"
                          else _cache_utils.prepare_block_tables_g01)
        prepare_slots = _cache_utils.prepare_slot_mapping_g01
    utils = {
        "FIXED_BLOCK_ATTN_TYPES": _cache_utils.FIXED_BLOCK_ATTN_TYPES,
        "dtype_itemsize": _cache_utils.dtype_itemsize,
        "validate_cache_info": functools.partial(_cache_utils.validate_cache_info, manager_map=manager_map),
        # G0 had no offline free-memory check; G0/G1 reserved fixed blocks for every entry.
        "calculate_block_num": functools.partial(
            _cache_utils.framework_calculate_block_num, offline_memory_check=gen.name != "G0",
            fixed_needs_block_only=per_entry),
        "allocate_cache_tensors": _cache_utils.framework_allocate_cache_tensors,
        "prepare_block_tables": prepare_tables,
        "prepare_slot_mapping": prepare_slots,
        "set_emulated_mem_info": _cache_utils.set_emulated_mem_info,
    }
    package = {"BlockPool": _block_pool.BlockPool, "KVCacheManager": manager_cls,
               **cache_info, **single_type, **{k: v for k, v in utils.items() if k != "set_emulated_mem_info"}}
    package["HARNESS_GENERATION"] = gen.name

    masks = {"get_init_attn_mask": _common_utils.get_init_attn_mask,
             "get_decode_mask": _common_utils.get_decode_mask}
    return {
        "executor": _module("executor", {}, package=True),
        "executor.core": _module("executor.core", {}, package=True),
        "executor.core.kv_cache": _module("executor.core.kv_cache", package, package=True),
        "executor.core.kv_cache.cache_info": _module("executor.core.kv_cache.cache_info", cache_info),
        "executor.core.kv_cache.block_pool": _module(
            "executor.core.kv_cache.block_pool", {"BlockPool": _block_pool.BlockPool}),
        "executor.core.kv_cache.single_type_kv_cache_manager": _module(
            "executor.core.kv_cache.single_type_kv_cache_manager", single_type),
        "executor.core.kv_cache.kv_cache_manager": _module(
            "executor.core.kv_cache.kv_cache_manager", {"KVCacheManager": manager_cls}),
        "executor.core.kv_cache.cache_utils": _module("executor.core.kv_cache.cache_utils", utils),
        "executor.utils": _module("executor.utils", masks, package=True),
        "executor.utils.forward_metadata": _forward_metadata,
        "executor.utils.common_utils": _module("executor.utils.common_utils", masks),
    }


def _with_recycle_default(recycle: bool):
    base_init = _kv_cache_manager.KVCacheManager.__init__

    def __init__(self, max_model_len, single_type_managers, cache_info, *, recycle_skipped_on_failure=recycle):
        base_init(self, max_model_len, single_type_managers, cache_info,
                  recycle_skipped_on_failure=recycle_skipped_on_failure)

    return __init__


@dataclass
class FrameworkHandle:
    """What ``install_framework`` installed."""

    generation: str
    real: bool
    root: Path | None
    modules: dict[str, types.ModuleType]
    fallbacks: list[str] = field(default_factory=list)
    extra_window_keys: int = 0

    @property
    def kv_cache(self) -> types.ModuleType:
        return self.modules["executor.core.kv_cache"]

    @property
    def cache_info(self) -> types.ModuleType:
        return self.modules["executor.core.kv_cache.cache_info"]

    @property
    def forward_metadata(self) -> types.ModuleType:
        return self.modules["executor.utils.forward_metadata"]

    @property
    def common_utils(self) -> types.ModuleType:
        return self.modules["executor.utils.common_utils"]


def _is_executor_module(name: str) -> bool:
    return name == "executor" or name.startswith("executor.")


def _parent_stub(name: str, directory: Path, reexports: str | None = None) -> types.ModuleType:
    # A package whose __init__ is not run: the real executor/core/__init__.py imports the
    # engine (and torch_npu); the stub only lets the kv_cache / utils subpackages load.
    mod = types.ModuleType(name, f"harness stub over {directory}")
    mod.__path__ = [str(directory)]
    mod.__package__ = name
    mod.__file__ = str(directory / "__init__.py")
    if reexports:
        # The real executor/utils/__init__.py re-exports common_utils' helpers; G2+'s
        # allocate_cache_tensors imports align_memory that way. Resolved on first use only.
        def __getattr__(attr: str):
            if attr.startswith("__"):
                raise AttributeError(attr)
            try:
                return getattr(importlib.import_module(reexports), attr)
            except ImportError as exc:
                raise AttributeError(f"{name}.{attr} ({reexports} does not import here: {exc})") from None

        mod.__getattr__ = __getattr__
    return mod


def _load_real_modules(root: Path, fallback: Iterable[str]) -> tuple[dict[str, types.ModuleType], list[str], str]:
    package_dir = root / "executor"
    if not (package_dir / "core" / "kv_cache").is_dir():
        raise FrameworkImportError(
            f"{root} is not a cann-recipes-infer checkout: executor/core/kv_cache/ is missing"
        )
    for name, directory, reexports in (
        ("executor", package_dir, None),
        ("executor.core", package_dir / "core", None),
        ("executor.utils", package_dir / "utils", "executor.utils.common_utils"),
    ):
        sys.modules[name] = _parent_stub(name, directory, reexports)

    fallback = set(fallback)
    modules: dict[str, types.ModuleType] = {}
    failed: dict[str, BaseException] = {}
    for name in REQUIRED_MODULES:
        try:
            modules[name] = importlib.import_module(name)
        except Exception as exc:  # any import failure is reported with its module
            failed[name] = exc
    hard = {name: exc for name, exc in failed.items() if name not in fallback}
    if hard:
        name, exc = next(iter(hard.items()))
        raise FrameworkImportError(
            f"cannot import {name} from the checkout at {root}: {type(exc).__name__}: {exc}. "
            "The harness needs it importable without an NPU (no torch_npu at import time)."
        ) from exc

    cache_info = modules["executor.core.kv_cache.cache_info"]
    try:
        generation = detect_generation_from_classes(cache_info.CacheEntry, cache_info.ModelCacheInfo, cache_info)
    except ValueError as exc:
        raise FrameworkImportError(f"{root}: {exc}") from None
    if failed:
        harness = build_harness_modules(generation)
        for name in failed:
            modules[name] = harness[name]
            sys.modules[name] = harness[name]
    return modules, sorted(failed), generation


@contextlib.contextmanager
def install_framework(
    generation: str = "G2",
    framework_root: str | Path | None = None,
    *,
    extra_window_keys: int = 0,
    recycle_skipped_on_failure: bool = False,
    fallback_to_harness: Iterable[str] = (),
) -> Iterator[FrameworkHandle]:
    """Context manager that serves ``executor.core.kv_cache`` & co. for one validation run.

    Without ``framework_root``: the harness of ``generation`` ("G0", "G1", "G2").
    With it: the checkout's own modules (its root goes on ``sys.path``; the parent
    packages' ``__init__`` files are not run, so importing needs no NPU). A module that
    fails to import raises ``FrameworkImportError`` naming it, unless listed in
    ``fallback_to_harness``, in which case the harness module of the detected generation
    stands in (recorded in ``handle.fallbacks``). The handle's ``generation`` is the one
    detected from the checkout's dataclasses in that case.
    """
    with isolated_modules(_is_executor_module):
        try:
            yield _install(generation, framework_root, fallback_to_harness, extra_window_keys,
                           recycle_skipped_on_failure)
        finally:
            _forward_metadata.reset_forward_metadata()


def _install(generation, framework_root, fallback_to_harness, extra_window_keys,
             recycle_skipped_on_failure) -> FrameworkHandle:
    """The harness modules of ``generation``, or the checkout's own, registered under ``executor.*``."""
    if framework_root is None:
        modules = build_harness_modules(
            generation, extra_window_keys=extra_window_keys,
            recycle_skipped_on_failure=recycle_skipped_on_failure,
        )
        sys.modules.update(modules)
        handle = FrameworkHandle(get_generation(generation).name, False, None, modules,
                                 extra_window_keys=extra_window_keys)
    else:
        if extra_window_keys:
            raise ValueError("extra_window_keys only applies to the harness managers, not a real checkout")
        root = Path(framework_root).resolve()
        sys.dont_write_bytecode = True  # nothing (not even __pycache__) is written into the checkout
        sys.path.insert(0, str(root))
        importlib.invalidate_caches()
        modules, fallbacks, detected = _load_real_modules(root, fallback_to_harness)
        handle = FrameworkHandle(detected, True, root, modules, fallbacks)
    _forward_metadata.reset_forward_metadata()
    return handle


@contextlib.contextmanager
def isolated_modules(is_owned: Callable[[str], bool]) -> Iterator[None]:
    """Import isolation for one validation scope: the modules ``is_owned`` names are taken out of
    ``sys.modules`` (the process's own come back on exit, the scope's are dropped), and ``sys.path``
    and ``sys.dont_write_bytecode`` are restored, so a checkout imported inside leaves no trace."""
    saved_modules = {name: mod for name, mod in sys.modules.items() if is_owned(name)}
    saved_path = list(sys.path)
    saved_bytecode = sys.dont_write_bytecode
    for name in saved_modules:
        del sys.modules[name]
    try:
        yield
    finally:
        for name in [n for n in sys.modules if is_owned(n)]:
            del sys.modules[name]
        sys.modules.update(saved_modules)
        sys.path[:] = saved_path
        sys.dont_write_bytecode = saved_bytecode
        importlib.invalidate_caches()


__all__ = ["REQUIRED_MODULES", "FrameworkHandle", "build_harness_modules", "install_framework"]
