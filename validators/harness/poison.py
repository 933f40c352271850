"""Block ownership, pool invariants and poisoning hooks for the release-link checks.

Poisoning fills every block no live request owns (free blocks, and the null block whose
contents the device leaves undefined) with NaN, or with a sentinel for integer caches.
Any read of such a block then shows up in the output. Works on the harness managers and
on a real checkout's managers (only ``single_type_managers``, ``manager_key``/``attn_type``,
``block_pool`` and ``req_to_blocks`` are used).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch


def manager_key(manager) -> str:
    return getattr(manager, "manager_key", None) or manager.attn_type


def null_block_of(manager) -> int:
    return manager.block_pool.get_null_block()


def owned_blocks(manager) -> dict[int, list[int]]:
    """Real (non-null) blocks per request of one group."""
    null = null_block_of(manager)
    return {rid: [b for b in blocks if b != null] for rid, blocks in manager.req_to_blocks.items()}


def free_blocks(manager) -> list[int]:
    """Blocks of a group that no request owns, excluding the null block."""
    null = null_block_of(manager)
    taken = {b for blocks in owned_blocks(manager).values() for b in blocks}
    return [b for b in range(manager.block_pool.num_blocks) if b != null and b not in taken]


def block_ownership(kv_cache_manager) -> dict[str, dict[int, list[int]]]:
    """``{group_key: {request_id: [real blocks]}}`` for every group."""
    return {manager_key(m): owned_blocks(m) for m in kv_cache_manager.single_type_managers}


def sentinel_for(dtype: torch.dtype, value: float = float("nan")):
    """The poison value for a dtype: ``value`` for floats, the dtype's max for integers."""
    if dtype.is_floating_point:
        return value
    if dtype == torch.bool:
        return True
    return torch.iinfo(dtype).max


def poison_blocks(tensor: torch.Tensor, block_ids: Iterable[int], value: float = float("nan")) -> None:
    """Fill whole blocks (dim 0) of a cache tensor in place."""
    ids = list(block_ids)
    if ids:
        index = torch.tensor(ids, dtype=torch.long, device=tensor.device)
        tensor.index_fill_(0, index, sentinel_for(tensor.dtype, value))


def _tensors_by_key(cache_tensors) -> Mapping[str, list[torch.Tensor]]:
    return {key: list(tensors) for key, tensors in cache_tensors.items()}


def poison_free_blocks(
    kv_cache_manager,
    cache_tensors: Mapping[str, Iterable[torch.Tensor]],
    value: float = float("nan"),
    *,
    include_null: bool = True,
) -> dict[str, list[int]]:
    """Poison every block of every group that no request owns; returns the poisoned ids per group.

    ``cache_tensors`` maps group key -> that group's cache tensors (what
    ``allocate_cache_tensors`` returns). The null block is included unless told otherwise.
    """
    tensors = _tensors_by_key(cache_tensors)
    poisoned = {}
    for manager in kv_cache_manager.single_type_managers:
        key = manager_key(manager)
        ids = free_blocks(manager)
        if include_null:
            ids = [null_block_of(manager), *ids]
        for tensor in tensors.get(key, []):
            poison_blocks(tensor, ids, value)
        poisoned[key] = ids
    return poisoned


def poison_null_blocks(kv_cache_manager, cache_tensors, value: float = float("nan")) -> dict[str, int]:
    """Poison only each group's null block; returns the null id per group."""
    tensors = _tensors_by_key(cache_tensors)
    nulls = {}
    for manager in kv_cache_manager.single_type_managers:
        key = manager_key(manager)
        for tensor in tensors.get(key, []):
            poison_blocks(tensor, [null_block_of(manager)], value)
        nulls[key] = null_block_of(manager)
    return nulls


def block_is_poisoned(tensor: torch.Tensor, block_id: int, value: float = float("nan")) -> bool:
    """True when every element of the block holds the poison value."""
    block = tensor[block_id]
    sentinel = sentinel_for(tensor.dtype, value)
    if isinstance(sentinel, float) and sentinel != sentinel:  # NaN
        return bool(torch.isnan(block).all())
    return bool((block == sentinel).all())


@dataclass
class PoolReport:
    """Accounting of one group's pool."""

    key: str
    total: int
    null_block: int
    owned: int
    free: int
    problems: list[str]


def check_pool_invariants(kv_cache_manager) -> list[PoolReport]:
    """Check, per group: no block owned twice, null never owned, owned + free + null = total,
    the pool's free list equals the complement of what is owned (when the pool exposes it).
    """
    reports = []
    for manager in kv_cache_manager.single_type_managers:
        key = manager_key(manager)
        pool = manager.block_pool
        null = null_block_of(manager)
        problems: list[str] = []
        seen: dict[int, int] = {}
        for rid, blocks in manager.req_to_blocks.items():
            for b in blocks:
                if b == null:
                    continue
                if b in seen:
                    problems.append(f"block {b} owned by requests {seen[b]} and {rid}")
                seen[b] = rid
        pool_free = _pool_free_ids(pool)
        expected_free = set(free_blocks(manager))
        if pool_free is not None:
            if null in pool_free:
                problems.append(f"null block {null} is in the free list")
            if set(pool_free) != expected_free:
                extra = sorted(set(pool_free) - expected_free)
                missing = sorted(expected_free - set(pool_free))
                problems.append(f"free list differs from unowned blocks: owned-but-free={extra}, lost={missing}")
            if len(pool_free) != len(set(pool_free)):
                problems.append("free list holds duplicates")
            free_count = len(pool_free)
        else:
            free_count = pool.get_num_free_blocks()
        if len(seen) + free_count + 1 != pool.num_blocks:
            problems.append(f"owned {len(seen)} + free {free_count} + null 1 != total {pool.num_blocks}")
        reports.append(PoolReport(key, pool.num_blocks, null, len(seen), free_count, problems))
    return reports


def _pool_free_ids(pool) -> list[int] | None:
    if hasattr(pool, "free_block_ids"):
        return pool.free_block_ids()
    queue = getattr(pool, "_free_block_queue", None)
    return list(queue) if queue is not None else None


def assert_pool_invariants(kv_cache_manager) -> None:
    problems = [f"{r.key}: {p}" for r in check_pool_invariants(kv_cache_manager) for p in r.problems]
    if problems:
        raise AssertionError("; ".join(problems))


__all__ = [
    "PoolReport",
    "assert_pool_invariants",
    "block_is_poisoned",
    "block_ownership",
    "check_pool_invariants",
    "free_blocks",
    "null_block_of",
    "owned_blocks",
    "poison_blocks",
    "poison_free_blocks",
    "poison_null_blocks",
    "sentinel_for",
]
