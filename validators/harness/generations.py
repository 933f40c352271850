"""Cache metadata dataclasses for each API generation of ``executor/core/kv_cache/cache_info.py``.

Field names, order and defaults follow the public cann-recipes-infer history:

* G0 (commit f0b0fdec..., 2026-04-26): CacheEntry without ``tensor``; ModelCacheInfo with a
  model-level ``block_size``; tables keyed by ``attn_type``.
* G1 (commit 2c2336ab..., 2026-04-30): G0 plus ``CacheEntry.tensor`` (filled by
  ``allocate_cache_tensors``) and ``ModelCacheInfo.is_mla_backend``.
* G2 (commit 48a59dc0..., 2026-06-11): per-entry ``block_size`` and ``manager_key``
  (``group_key`` = manager_key or attn_type), ModelCacheInfo without ``block_size``.
* G3 (HEAD era): G2 plus ``allocator``, ``compress_ratio``, ``cache_layout``,
  ``MambaCacheEntry`` / Mamba manager, ``MemoryBudgetItem``, and the sliding-window prefill
  layout that keeps ``max(0, L - 1 - W)`` onwards (a9adc55). The model-side contract (what a
  rendered ``get_cache_info`` writes) is G2's, so renders for G3 are G2 renders; only the
  framework behaviour differs. The harness G2 entry class carries the G3 fields too (a
  superset), so code written for either loads.

The classes are written from the documented behaviour; ``get_generation`` returns a
namespace holding one generation's classes plus a few facts about it.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import math
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from model_infer_kvcache.analyzer.framework_checkout import (
    GENERATIONS,
    classify_generation,
    dataclass_fields,
    detect_generation,
)
from model_infer_kvcache.analyzer.kv_cache_spec import MAMBA, holds_state


def _dims_numel(dim) -> int:
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    return math.prod(int(d) for d in dims)


def _merge_layers(first, second) -> list:
    # Same renumbering rule as the framework: the second description's layers follow the first.
    merged = list(first.layer_infos)
    offset = len(merged)
    for info in second.layer_infos:
        info.layer_idx += offset
    merged.extend(second.layer_infos)
    return merged


# --------------------------------------------------------------------------- G0


@dataclass
class CacheEntryG0:
    """One cache tensor of one layer (G0)."""

    cache_name: str
    attn_type: str
    dim: int | list[int]
    num_head: int
    dtype: torch.dtype
    needs_block: bool
    tensor_setter: Callable[[torch.Tensor], None] | None = None
    sliding_window: int | None = None


@dataclass
class LayerCacheInfoG0:
    layer_idx: int
    caches: list


@dataclass
class ModelCacheInfoG0:
    num_layers: int
    block_size: int
    layer_infos: list

    def merge(self, other: ModelCacheInfoG0) -> ModelCacheInfoG0:
        if self.block_size != other.block_size:
            raise ValueError(f"block_size mismatch: {self.block_size} != {other.block_size}")
        layers = _merge_layers(self, other)
        return type(self)(num_layers=len(layers), block_size=self.block_size, layer_infos=layers)


# --------------------------------------------------------------------------- G1


@dataclass
class CacheEntryG1:
    """One cache tensor of one layer (G1: G0 plus the allocated ``tensor``)."""

    cache_name: str
    attn_type: str
    dim: int | list[int]
    num_head: int
    dtype: torch.dtype
    needs_block: bool
    tensor_setter: Callable[[torch.Tensor], None] | None = None
    sliding_window: int | None = None
    tensor: torch.Tensor | None = None


@dataclass
class LayerCacheInfoG1:
    layer_idx: int
    caches: list


@dataclass
class ModelCacheInfoG1:
    num_layers: int
    block_size: int
    layer_infos: list
    # Must be set by MLA models (latent cache replicated over attention TP ranks).
    is_mla_backend: bool = False

    def merge(self, other: ModelCacheInfoG1) -> ModelCacheInfoG1:
        if self.block_size != other.block_size:
            raise ValueError(f"block_size mismatch: {self.block_size} != {other.block_size}")
        if self.is_mla_backend != other.is_mla_backend:
            raise ValueError(
                f"is_mla_backend mismatch across merged cache infos: {self.is_mla_backend} vs {other.is_mla_backend}"
            )
        layers = _merge_layers(self, other)
        return type(self)(
            num_layers=len(layers), block_size=self.block_size, layer_infos=layers,
            is_mla_backend=self.is_mla_backend,
        )


# --------------------------------------------------------------------------- G2


class CacheAllocator(str, enum.Enum):
    """Physical allocator of a cache entry (late G2)."""

    HBM = "hbm"
    SWAPPED_MEMORY = "swapped_memory"


class _Grouped:
    """What G2 and G3 entries share beyond their fields (each generation keeps the checkout's field order,
    which positional construction relies on, so G3 does not extend G2)."""

    @property
    def group_key(self) -> str:
        """Key of the manager (and of block_table / slot_mapping) this entry belongs to."""
        return self.manager_key if self.manager_key is not None else self.attn_type

    def cache_dim_numel(self) -> int:
        return _dims_numel(self.dim)


@dataclass
class CacheEntryG2(_Grouped):
    """One cache tensor of one layer (G2: per-entry block size and manager grouping)."""

    cache_name: str
    attn_type: str
    dim: int | list[int]
    num_head: int
    dtype: torch.dtype
    needs_block: bool
    block_size: int | None = None
    manager_key: str | None = None
    tensor_setter: Callable[[torch.Tensor], None] | None = None
    sliding_window: int | None = None
    tensor: torch.Tensor | None = None


@dataclass
class CacheEntryG3(_Grouped):
    """One cache tensor of one layer (G3: G2 plus allocator, compressed rows and tensor layout)."""

    cache_name: str
    attn_type: str
    dim: int | list[int]
    num_head: int
    dtype: torch.dtype
    needs_block: bool
    block_size: int | None = None
    manager_key: str | None = None
    tensor_setter: Callable[[torch.Tensor], None] | None = None
    sliding_window: int | None = None
    allocator: CacheAllocator = CacheAllocator.HBM
    compress_ratio: int = 1
    tensor: torch.Tensor | None = None
    # "BnBsND" = [blocks, block_size, heads, dim]; "BnNBsD" = [blocks, heads, block_size, dim].
    cache_layout: str = "BnBsND"

    @property
    def storage_block_size(self) -> int:
        if self.block_size % self.compress_ratio:
            raise ValueError(
                f"block_size must be divisible by compress_ratio: cache_name={self.cache_name}, "
                f"block_size={self.block_size}, compress_ratio={self.compress_ratio}."
            )
        return self.block_size // self.compress_ratio


@dataclass
class MambaCacheEntry(CacheEntryG3):
    """A fixed-size recurrent state per request (G3): ``shape`` is the whole trailing shape.

    ``dim``/``num_head`` are unused; the block size is always 1 (one state block per
    request, plus ``next_n`` for speculative steps). Keyword construction only.
    """

    attn_type: str = dataclasses.field(default=MAMBA, kw_only=True)
    dim: int | list[int] | None = dataclasses.field(default=None, kw_only=True)
    num_head: int | None = dataclasses.field(default=None, kw_only=True)
    block_size: int = dataclasses.field(default=1, kw_only=True)
    shape: list[int] = dataclasses.field(default_factory=list, kw_only=True)
    next_n: int = dataclasses.field(default=0, kw_only=True)

    def __post_init__(self) -> None:
        where = f"Mamba cache '{self.cache_name}'"
        if not holds_state(self.attn_type):
            raise ValueError(f"{where} must keep attn_type='Mamba', but got '{self.attn_type}'.")
        if self.block_size != 1:
            raise ValueError(f"{where} block_size must be 1, but got {self.block_size}.")
        if not isinstance(self.shape, list) or not self.shape:
            raise ValueError(f"{where} must define a non-empty shape list, but got {self.shape}.")
        if any(not isinstance(d, int) or isinstance(d, bool) or d <= 0 for d in self.shape):
            raise ValueError(f"{where} shape dimensions must all be positive integers, but got {self.shape}.")
        if self.next_n < 0:
            raise ValueError(f"{where} next_n must be non-negative, but got {self.next_n}.")

    def cache_dim_numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class MemoryBudgetItem:
    """A memory item a model reports for cache/workspace budgeting (G3)."""

    name: str
    bytes: int
    location: str = "npu"


@dataclass
class OffloadWorkspaceMemoryInfo:
    """Offload workspace report (G3): the NPU-resident part counts against the KV budget."""

    items: list

    @property
    def npu_bytes(self) -> int:
        return sum(item.bytes for item in self.items if item.location == "npu")


@dataclass
class LayerCacheInfoG2:
    layer_idx: int
    caches: list


@dataclass
class ModelCacheInfoG2:
    num_layers: int
    layer_infos: list
    is_mla_backend: bool = False

    def merge(self, other: ModelCacheInfoG2) -> ModelCacheInfoG2:
        if self.is_mla_backend != other.is_mla_backend:
            raise ValueError(
                f"is_mla_backend mismatch across merged cache infos: {self.is_mla_backend} vs {other.is_mla_backend}"
            )
        layers = _merge_layers(self, other)
        return type(self)(num_layers=len(layers), layer_infos=layers, is_mla_backend=self.is_mla_backend)


# --------------------------------------------------------------------------- lookup

_CLASSES = {
    "G0": (CacheEntryG0, LayerCacheInfoG0, ModelCacheInfoG0),
    "G1": (CacheEntryG1, LayerCacheInfoG1, ModelCacheInfoG1),
    "G2": (CacheEntryG2, LayerCacheInfoG2, ModelCacheInfoG2),
    "G3": (CacheEntryG3, LayerCacheInfoG2, ModelCacheInfoG2),
}
# Facts that change the framework's behaviour between generations (read from the real code):
# tokens before the last one that a sliding-window prefill keeps (G0-G2: W - 1, i.e. the
# first kept token is L - W; G3: W, i.e. max(0, L - 1 - W)) and what the scheduler does
# when a running request cannot grow (G0 stops the decode batch there; G1+ skips it).
SLIDING_PREFILL_EXTRA_TOKENS = {"G0": 0, "G1": 0, "G2": 0, "G3": 1}
DECODE_ADMISSION = {"G0": "stop", "G1": "skip", "G2": "skip", "G3": "skip"}

# Public names used by the framework module, so `from ... import CacheEntry` works on the namespace.
for _gen, (_entry, _layer, _model) in _CLASSES.items():
    for _cls, _public in ((_entry, "CacheEntry"), (_layer, "LayerCacheInfo"), (_model, "ModelCacheInfo")):
        if _gen == "G3" and _cls is not _entry:
            continue  # G3 shares G2's layer/model classes
        _cls.__qualname__ = f"{_public}[{_gen}]"


def get_generation(name: str) -> types.SimpleNamespace:
    """Return the harness classes and facts of one API generation.

    Attributes: ``name``, ``CacheEntry``, ``LayerCacheInfo``, ``ModelCacheInfo``,
    ``table_key`` ("attn_type" or "group_key"), ``model_level_block_size`` (bool),
    ``has_is_mla_backend`` (bool), ``CacheAllocator`` (G2/G3, else None), ``MambaCacheEntry``,
    ``MemoryBudgetItem``, ``OffloadWorkspaceMemoryInfo`` (G3, else None),
    ``sliding_prefill_extra_tokens``, ``decode_admission`` ("stop" | "skip") and
    ``render_api`` (the model-side contract renders use: G3 renders are G2 renders).
    """
    key = name.upper()
    if key not in _CLASSES:
        raise ValueError(f"unknown framework API generation {name!r}; expected one of {GENERATIONS}")
    entry, layer, model = _CLASSES[key]
    per_entry = key in ("G2", "G3")
    g3 = key == "G3"
    return types.SimpleNamespace(
        name=key,
        CacheEntry=entry,
        LayerCacheInfo=layer,
        ModelCacheInfo=model,
        table_key="group_key" if per_entry else "attn_type",
        model_level_block_size=not per_entry,
        has_is_mla_backend=key != "G0",
        CacheAllocator=CacheAllocator if per_entry else None,
        MambaCacheEntry=MambaCacheEntry if g3 else None,
        MemoryBudgetItem=MemoryBudgetItem if g3 else None,
        OffloadWorkspaceMemoryInfo=OffloadWorkspaceMemoryInfo if g3 else None,
        sliding_prefill_extra_tokens=SLIDING_PREFILL_EXTRA_TOKENS[key],
        decode_admission=DECODE_ADMISSION[key],
        render_api="G2" if g3 else key,
    )


def field_names(cls) -> list[str]:
    """Dataclass field names in declaration order."""
    return [f.name for f in dataclasses.fields(cls)]


def classify_fields(entry_fields, model_fields, class_names=()) -> str:
    """Generation implied by the field names (the analyzer's rule); ValueError when none fits."""
    generation, evidence = classify_generation(entry_fields, model_fields, class_names)
    if generation is None:
        raise ValueError(f"no framework API generation fits: {evidence}")
    return generation


def detect_generation_from_classes(cache_entry_cls, model_cache_info_cls, module=None) -> str:
    """Generation of already-imported CacheEntry / ModelCacheInfo classes (inherited fields included)."""
    names = [n for n, v in vars(module).items() if isinstance(v, type)] if module is not None else ()
    return classify_fields(field_names(cache_entry_cls), field_names(model_cache_info_cls), names)


def read_fields_from_source(source: str) -> dict[str, list[str]]:
    """Field names of every class in a cache_info.py source text (parsed, never imported; bases included)."""
    tree = ast.parse(source)
    return {node.name: dataclass_fields(source, node.name) for node in tree.body if isinstance(node, ast.ClassDef)}


def detect_generation_from_source(source: str) -> str:
    """Generation of a checkout's ``executor/core/kv_cache/cache_info.py`` text."""
    generation, evidence = detect_generation(source)
    if generation is None:
        raise ValueError(evidence)
    return generation


__all__ = [
    "GENERATIONS",
    "CacheAllocator",
    "CacheEntryG0",
    "CacheEntryG1",
    "CacheEntryG2",
    "CacheEntryG3",
    "MambaCacheEntry",
    "MemoryBudgetItem",
    "OffloadWorkspaceMemoryInfo",
    "LayerCacheInfoG0",
    "LayerCacheInfoG1",
    "LayerCacheInfoG2",
    "ModelCacheInfoG0",
    "ModelCacheInfoG1",
    "ModelCacheInfoG2",
    "classify_fields",
    "detect_generation_from_classes",
    "detect_generation_from_source",
    "field_names",
    "get_generation",
    "read_fields_from_source",
]
