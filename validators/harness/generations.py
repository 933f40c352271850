"""Cache metadata dataclasses for each API generation of ``executor/core/kv_cache/cache_info.py``.

Field names, order and defaults follow the public cann-recipes-infer history:

* G0 (commit f0b0fdec..., 2026-04-26): CacheEntry without ``tensor``; ModelCacheInfo with a
  model-level ``block_size``; tables keyed by ``attn_type``.
* G1 (commit 2c2336ab..., 2026-04-30): G0 plus ``CacheEntry.tensor`` (filled by
  ``allocate_cache_tensors``) and ``ModelCacheInfo.is_mla_backend``.
* G2 (commit 48a59dc0..., 2026-06-11 on): per-entry ``block_size`` and ``manager_key``
  (``group_key`` = manager_key or attn_type), ModelCacheInfo without ``block_size``.
  Later G2 commits append ``allocator``, ``compress_ratio`` and ``cache_layout``; this
  harness carries those too (a superset), so code written for either G2 variant loads.

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

GENERATIONS = ("G0", "G1", "G2")


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


@dataclass
class CacheEntryG2:
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
    allocator: CacheAllocator = CacheAllocator.HBM
    compress_ratio: int = 1
    tensor: torch.Tensor | None = None
    cache_layout: str = "BnBsND"

    @property
    def group_key(self) -> str:
        """Key of the manager (and of block_table / slot_mapping) this entry belongs to."""
        return self.manager_key if self.manager_key is not None else self.attn_type

    def cache_dim_numel(self) -> int:
        return _dims_numel(self.dim)

    @property
    def storage_block_size(self) -> int:
        if self.block_size % self.compress_ratio:
            raise ValueError(
                f"block_size must be divisible by compress_ratio: cache_name={self.cache_name}, "
                f"block_size={self.block_size}, compress_ratio={self.compress_ratio}."
            )
        return self.block_size // self.compress_ratio


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
}

# Public names used by the framework module, so `from ... import CacheEntry` works on the namespace.
for _gen, (_entry, _layer, _model) in _CLASSES.items():
    for _cls, _public in ((_entry, "CacheEntry"), (_layer, "LayerCacheInfo"), (_model, "ModelCacheInfo")):
        _cls.__qualname__ = f"{_public}[{_gen}]"


def get_generation(name: str) -> types.SimpleNamespace:
    """Return the harness classes and facts of one API generation.

    Attributes: ``name``, ``CacheEntry``, ``LayerCacheInfo``, ``ModelCacheInfo``,
    ``table_key`` ("attn_type" or "group_key"), ``model_level_block_size`` (bool),
    ``has_is_mla_backend`` (bool), ``CacheAllocator`` (G2 only, else None).
    """
    key = name.upper()
    if key not in _CLASSES:
        raise ValueError(f"unknown framework API generation {name!r}; expected one of {GENERATIONS}")
    entry, layer, model = _CLASSES[key]
    return types.SimpleNamespace(
        name=key,
        CacheEntry=entry,
        LayerCacheInfo=layer,
        ModelCacheInfo=model,
        table_key="group_key" if key == "G2" else "attn_type",
        model_level_block_size=key != "G2",
        has_is_mla_backend=key != "G0",
        CacheAllocator=CacheAllocator if key == "G2" else None,
    )


def field_names(cls) -> list[str]:
    """Dataclass field names in declaration order."""
    return [f.name for f in dataclasses.fields(cls)]


def classify_fields(entry_fields, model_fields) -> str:
    """Generation implied by the field names of CacheEntry and ModelCacheInfo."""
    entry_fields, model_fields = set(entry_fields), set(model_fields)
    if "block_size" in entry_fields and "block_size" not in model_fields:
        return "G2"
    if "is_mla_backend" in model_fields:
        return "G1"
    return "G0"


def detect_generation_from_classes(cache_entry_cls, model_cache_info_cls) -> str:
    """Generation of already-imported CacheEntry / ModelCacheInfo classes."""
    return classify_fields(field_names(cache_entry_cls), field_names(model_cache_info_cls))


def _annotated_fields(class_node: ast.ClassDef) -> list[str]:
    return [
        stmt.target.id
        for stmt in class_node.body
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
    ]


def read_fields_from_source(source: str) -> dict[str, list[str]]:
    """Field names of every class in a cache_info.py source text (parsed, never imported)."""
    tree = ast.parse(source)
    return {node.name: _annotated_fields(node) for node in tree.body if isinstance(node, ast.ClassDef)}


def detect_generation_from_source(source: str) -> str:
    """Generation of a checkout's ``executor/core/kv_cache/cache_info.py`` text."""
    fields = read_fields_from_source(source)
    if "CacheEntry" not in fields or "ModelCacheInfo" not in fields:
        raise ValueError("cache_info.py source defines no CacheEntry/ModelCacheInfo classes")
    return classify_fields(fields["CacheEntry"], fields["ModelCacheInfo"])


__all__ = [
    "GENERATIONS",
    "CacheAllocator",
    "CacheEntryG0",
    "CacheEntryG1",
    "CacheEntryG2",
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
