"""Generation-neutral accessors for cache entries.

The helpers are duck-typed so they work on the harness dataclasses of every generation
and on the classes of a real cann-recipes-infer checkout.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def group_key_of(entry) -> str:
    """Manager / table key of an entry: ``group_key`` (G2) or ``attn_type`` (G0/G1)."""
    key = getattr(entry, "group_key", None)
    return key if key is not None else entry.attn_type


def uses_model_block_size(cache_info) -> bool:
    """True for G0/G1 descriptions (one block size on ModelCacheInfo)."""
    return hasattr(cache_info, "block_size")


def entry_block_size(entry, cache_info) -> int | None:
    """Tokens per logical block of an entry's manager."""
    if uses_model_block_size(cache_info):
        return cache_info.block_size
    return getattr(entry, "block_size", None)


def entry_dims(entry) -> list[int]:
    return list(entry.dim) if isinstance(entry.dim, (list, tuple)) else [entry.dim]


def compress_ratio_of(entry) -> int:
    return int(getattr(entry, "compress_ratio", 1) or 1)


def storage_block_size(entry, block_size: int) -> int:
    """Rows per physical block (late G2 compresses ``compress_ratio`` tokens into one row)."""
    ratio = compress_ratio_of(entry)
    if block_size % ratio:
        raise ValueError(
            f"block_size {block_size} of cache {entry.cache_name!r} is not divisible by compress_ratio {ratio}"
        )
    return block_size // ratio


def dtype_itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def iter_entries(cache_info, *, paged_only: bool = False) -> Iterator[tuple[int, object]]:
    """Yield ``(layer_idx, entry)`` in declaration order."""
    for layer_info in cache_info.layer_infos:
        for entry in layer_info.caches:
            if paged_only and not entry.needs_block:
                continue
            yield layer_info.layer_idx, entry
