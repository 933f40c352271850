"""Which cache rows belong to the framework's null block, declared explicitly by the caller.

The framework reserves one block per pool as the null block: ``BlockPool.__init__`` pops the
first id of ``deque(range(num_blocks))`` (``executor/core/kv_cache/block_pool.py``), so it is
block :data:`NULL_BLOCK_ID` of every cache tensor ``[block_num, block_size, ...]``.
``prepare_block_tables`` pads block-table rows with it, and the engine pads every decode batch
with rows whose table is all null block, so each padded row writes the null block's slot 0.

A writer cannot see the block size of a flat ``cache.view(-1, N, D)``. The caller that owns the
caches (the validation driver) declares them with :func:`paged_caches`; for a declared cache the
writers then apply the padded-row rule exactly:

* several rows may write the same place only inside the null block (padding, sliding-window
  prefill positions outside the window); a repeat anywhere else is two live tokens racing for
  one slot and is refused, under every device reading;
* inside the null block repeats follow the ``repeated_slots`` device reading (``error`` refuses
  them), and after every write that touched the null block the whole block is filled with NaN
  (``poison=True``): the device leaves its content undefined (racing padded rows) and a correct
  model never reads it, so any read shows up as NaN.

Caches nobody declared keep the operator-level rule: the fused MLA writer sees the block size in
its ``[block_num, block_size, 1, D]`` caches and uses block :data:`NULL_BLOCK_ID`; the flat
``npu_scatter_nd_update(_)`` cannot tell blocks apart and lets every repeat follow the reading.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

NULL_BLOCK_ID = 0


@dataclass(frozen=True)
class NullRegion:
    """The null block of one declared cache: elements ``[start, stop)`` of its storage."""

    storage: int
    start: int
    stop: int
    block: torch.Tensor  # a view of the null block, filled with NaN after a write into it
    poison: bool


_REGIONS: dict[int, list[NullRegion]] = {}


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _region(cache: torch.Tensor, null_block: int, poison: bool) -> NullRegion:
    if not isinstance(cache, torch.Tensor) or cache.dim() < 2:
        raise ValueError(f"a paged cache is a [block_num, block_size, ...] tensor, got "
                         f"{type(cache).__name__ if not isinstance(cache, torch.Tensor) else tuple(cache.shape)}")
    if not 0 <= null_block < cache.shape[0]:
        raise ValueError(f"null block {null_block} is outside the cache's {cache.shape[0]} blocks")
    block = cache[null_block]
    if not block.is_contiguous():
        raise ValueError("the null block of a declared cache must be contiguous in memory")
    start = block.storage_offset()
    return NullRegion(_storage_key(cache), start, start + block.numel(), block, poison)


@contextmanager
def paged_caches(caches: Iterable[torch.Tensor], *, null_block: int = NULL_BLOCK_ID,
                 poison: bool = True) -> Iterator[list[NullRegion]]:
    """Declare ``caches`` (each ``[block_num, block_size, ...]``) and their null block for the block.

    ``poison=False`` keeps what the writers put into the null block (the probe's emulated dry
    run reads it back to classify the ``repeated_slots`` reading).
    """
    regions = [_region(cache, null_block, poison) for cache in caches]
    for region in regions:
        _REGIONS.setdefault(region.storage, []).append(region)
    try:
        yield regions
    finally:
        for region in regions:
            entries = _REGIONS.get(region.storage, [])
            if region in entries:
                entries.remove(region)
            if not entries:
                _REGIONS.pop(region.storage, None)


def declared(tensor: torch.Tensor) -> list[NullRegion]:
    """The declared null-block regions of ``tensor``'s storage (empty when nobody declared it)."""
    return list(_REGIONS.get(_storage_key(tensor), ()))


def in_null(regions: list[NullRegion], element_offsets: torch.Tensor) -> torch.Tensor:
    """Per written row (its first element's storage offset): does it land in a declared null block?"""
    hit = torch.zeros(element_offsets.shape, dtype=torch.bool)
    for region in regions:
        hit |= (element_offsets >= region.start) & (element_offsets < region.stop)
    return hit


def poison_touched(regions: list[NullRegion], element_offsets: torch.Tensor) -> None:
    """Fill every declared null block that one of the written rows landed in with NaN."""
    for region in regions:
        if region.poison and bool(((element_offsets >= region.start) & (element_offsets < region.stop)).any()):
            region.block.fill_(float("nan"))
