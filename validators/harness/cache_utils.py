"""Validation, block math, tensor allocation and index tables of the framework contract.

Generation differences handled here:

* G0/G1 key every dict by ``attn_type`` and use ``ModelCacheInfo.block_size``;
* G2 keys by ``group_key`` (manager_key or attn_type) and uses each entry's ``block_size``.

The functions are duck-typed over the entry classes, so they also accept the
dataclasses of a real checkout. Framework-signature wrappers (what the installed
``executor.core.kv_cache.cache_utils`` exposes) are at the end of the module.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .entries import (
    dtype_itemsize,
    entry_block_size,
    entry_dims,
    group_key_of,
    iter_entries,
    storage_block_size,
    token_bytes,
    uses_model_block_size,
)
from .errors import CacheInfoError
from .managers import ATTN_TYPE_MANAGER_MAP

# Attention types whose block count does not grow with the sequence.
FIXED_BLOCK_ATTN_TYPES = frozenset({"SlidingWindow"})


# --------------------------------------------------------------------------- validation


def _where(layer_idx, entry) -> str:
    return f"layer {layer_idx}, entry '{getattr(entry, 'cache_name', '?')}'"


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def validate_cache_info(cache_info) -> None:
    """Reject descriptions the framework would fail on, naming the layer and entry.

    Checks: layer count, non-empty layers, supported attn_type, positive heads/dims,
    a torch dtype, a positive block size (model-level in G0/G1, per entry in G2),
    ``sliding_window`` on SlidingWindow entries, and per group: one attn_type, one
    block size, one sliding window.
    """
    if cache_info.num_layers != len(cache_info.layer_infos):
        raise CacheInfoError(
            f"ModelCacheInfo.num_layers mismatch: num_layers={cache_info.num_layers}, "
            f"len(layer_infos)={len(cache_info.layer_infos)}"
        )
    model_level = uses_model_block_size(cache_info)
    if model_level and not _positive_int(cache_info.block_size):
        raise CacheInfoError(f"ModelCacheInfo.block_size must be a positive int, got {cache_info.block_size!r}")

    groups: dict[str, tuple[int, object, int, int | None]] = {}
    for layer_info in cache_info.layer_infos:
        if not layer_info.caches:
            raise CacheInfoError(f"layer {layer_info.layer_idx} must define at least one cache entry")
        for entry in layer_info.caches:
            if not entry.needs_block:
                continue
            where = _where(layer_info.layer_idx, entry)
            if entry.attn_type not in ATTN_TYPE_MANAGER_MAP:
                raise CacheInfoError(
                    f"{where}: unsupported attn_type {entry.attn_type!r}; supported: {sorted(ATTN_TYPE_MANAGER_MAP)}"
                )
            if not _positive_int(entry.num_head):
                raise CacheInfoError(f"{where}: num_head must be a positive int, got {entry.num_head!r}")
            dims = entry_dims(entry)
            if not dims or not all(_positive_int(d) for d in dims):
                raise CacheInfoError(f"{where}: dim must be positive, got {entry.dim!r}")
            if not isinstance(entry.dtype, torch.dtype):
                raise CacheInfoError(f"{where}: dtype must be a torch.dtype, got {entry.dtype!r}")
            block_size = entry_block_size(entry, cache_info)
            if not _positive_int(block_size):
                raise CacheInfoError(f"{where}: block_size must be a positive int, got {block_size!r}")
            try:
                storage_block_size(entry, block_size)
            except ValueError as exc:
                raise CacheInfoError(f"{where}: {exc}") from None
            window = entry.sliding_window
            if entry.attn_type == "SlidingWindow" and not _positive_int(window):
                raise CacheInfoError(f"{where}: SlidingWindow entry needs a positive sliding_window, got {window!r}")
            key = group_key_of(entry)
            if key not in groups:
                groups[key] = (layer_info.layer_idx, entry, block_size, window)
                continue
            first_layer, first, first_bs, first_window = groups[key]
            first_where = _where(first_layer, first)
            if entry.attn_type != first.attn_type:
                raise CacheInfoError(
                    f"{where}: group '{key}' mixes attn_type {entry.attn_type!r} with {first.attn_type!r} ({first_where})"
                )
            if block_size != first_bs:
                raise CacheInfoError(
                    f"{where}: block_size {block_size} differs from {first_bs} ({first_where}) inside group '{key}'"
                )
            if entry.attn_type == "SlidingWindow" and window != first_window:
                raise CacheInfoError(
                    f"{where}: sliding_window {window} differs from {first_window} ({first_where}) inside group '{key}'"
                )


# --------------------------------------------------------------------------- block math


@dataclass(frozen=True)
class GroupSpec:
    """Sizing facts of one group (one manager)."""

    key: str
    attn_type: str
    block_size: int
    sliding_window: int | None
    token_bytes: float  # all entries of the group together


def group_specs(cache_info) -> dict[str, GroupSpec]:
    """Per-group block size, window and bytes per token (paged entries only)."""
    specs: dict[str, GroupSpec] = {}
    for _, entry in iter_entries(cache_info, paged_only=True):
        key = group_key_of(entry)
        block_size = entry_block_size(entry, cache_info)
        previous = specs.get(key)
        added = token_bytes(entry)
        specs[key] = GroupSpec(
            key=key,
            attn_type=entry.attn_type,
            block_size=block_size,
            sliding_window=entry.sliding_window if entry.attn_type == "SlidingWindow" else None,
            token_bytes=added + (previous.token_bytes if previous else 0.0),
        )
    return specs


def fixed_blocks_per_request(sliding_window: int, block_size: int, next_n: int = 0) -> int:
    """Sliding-window blocks one request can hold at once.

    ``ceil((W + 2*next_n) / block_size)`` for the window (plus MTP draft tokens), plus one
    because a window generally straddles a block boundary.
    """
    return math.ceil((sliding_window + 2 * next_n) / block_size) + 1


def calculate_block_num(
    cache_info,
    *,
    max_concurrency: int,
    offline_max_len: int | None = None,
    available_kv_memory: float | None = None,
    kv_cache_mem_ratio: float = 1.0,
    next_n: int = 0,
    max_prefill_tokens: int | None = None,
) -> dict[str, int]:
    """Blocks per group (keys as the generation keys its tables); block 0 of each pool is the null block.

    Fixed-block groups (SlidingWindow): ``max_concurrency * fixed_blocks_per_request + 1``.
    Paged groups, offline (``offline_max_len``): ``ceil(max_len / block_size) * max_concurrency + 1``.
    Paged groups, budget (``available_kv_memory`` bytes): the fixed groups' bytes are
    reserved first, then ``max_tokens = floor((available * ratio - fixed) / per_token_bytes)``
    with ``per_token_bytes`` summed over every paged group, and each paged group gets
    ``floor(max_tokens / block_size)`` blocks (the null block is inside that count).
    With ``max_prefill_tokens`` the budget result must hold one prefill, as the framework checks.
    """
    if max_concurrency <= 0:
        raise ValueError("max_concurrency must be positive")
    specs = group_specs(cache_info)
    result: dict[str, int] = {}
    fixed_bytes = 0.0
    for spec in specs.values():
        if spec.attn_type not in FIXED_BLOCK_ATTN_TYPES:
            continue
        count = max_concurrency * fixed_blocks_per_request(spec.sliding_window, spec.block_size, next_n) + 1
        result[spec.key] = count
        fixed_bytes += count * spec.block_size * spec.token_bytes

    paged = [s for s in specs.values() if s.attn_type not in FIXED_BLOCK_ATTN_TYPES]
    if not paged:
        return result

    if offline_max_len:
        for spec in paged:
            result[spec.key] = math.ceil(offline_max_len / spec.block_size) * max_concurrency + 1
        return result

    if available_kv_memory is None:
        raise ValueError("give offline_max_len (offline sizing) or available_kv_memory (budget sizing)")
    per_token = sum(s.token_bytes for s in paged)
    budget = available_kv_memory * kv_cache_mem_ratio - fixed_bytes
    if budget <= 0:
        raise MemoryError(
            f"no memory left for paged groups after fixed-block reservation: "
            f"available={available_kv_memory}, ratio={kv_cache_mem_ratio}, fixed={fixed_bytes:.0f}"
        )
    max_tokens = int(budget // per_token)
    for spec in paged:
        result[spec.key] = max_tokens // spec.block_size
    if max_prefill_tokens is not None:
        # The null block holds no data, hence the -1 block.
        supported = min((result[s.key] - 1) * s.block_size for s in paged)
        if supported - 1 < max_prefill_tokens:
            raise MemoryError(
                f"budget supports {supported} tokens, which cannot hold a prefill of {max_prefill_tokens} tokens"
            )
    return result


def kv_cache_bytes(cache_info, block_num_by_key: Mapping[str, int]) -> int:
    """Bytes the cache tensors of ``block_num_by_key`` blocks occupy."""
    total = 0
    for _, entry in iter_entries(cache_info, paged_only=True):
        blocks = block_num_by_key[group_key_of(entry)]
        rows = storage_block_size(entry, entry_block_size(entry, cache_info))
        total += blocks * rows * entry.num_head * math.prod(entry_dims(entry)) * dtype_itemsize(entry.dtype)
    return total


# --------------------------------------------------------------------------- tensors


def cache_tensor_shape(entry, cache_info, num_blocks: int) -> tuple[int, ...]:
    """``[num_blocks, block_size, num_head, *dim]`` (block rows divided by compress_ratio)."""
    rows = storage_block_size(entry, entry_block_size(entry, cache_info))
    return (num_blocks, rows, entry.num_head, *entry_dims(entry))


def allocate_cache_tensors(
    device,
    cache_info,
    block_num_by_type: Mapping[str, int],
    *,
    fill_value: float | None = None,
) -> dict[str, list[torch.Tensor]]:
    """Create every paged entry's tensor and hand it to the entry's ``tensor_setter``.

    Also sets ``entry.tensor`` when the entry class has that field (G1/G2). Returns the
    tensors grouped by table key (the harness uses this for poisoning). ``fill_value``
    None gives ``torch.empty`` contents, as on the device.
    """
    by_key: dict[str, list[torch.Tensor]] = {}
    for layer_idx, entry in iter_entries(cache_info, paged_only=True):
        where = _where(layer_idx, entry)
        if entry.tensor_setter is None:
            raise CacheInfoError(f"{where}: CacheEntry has no tensor_setter")
        key = group_key_of(entry)
        if key not in block_num_by_type:
            raise KeyError(f"{where}: missing block count for group '{key}'")
        if entry.attn_type not in ATTN_TYPE_MANAGER_MAP:
            raise CacheInfoError(f"{where}: cannot create a cache tensor for attn_type {entry.attn_type!r}")
        shape = cache_tensor_shape(entry, cache_info, block_num_by_type[key])
        if fill_value is None:
            tensor = torch.empty(shape, dtype=entry.dtype, device=device)
        else:
            tensor = torch.full(shape, fill_value, dtype=entry.dtype, device=device)
        entry.tensor_setter(tensor)
        if hasattr(entry, "tensor"):
            entry.tensor = tensor
        by_key.setdefault(key, []).append(tensor)
    return by_key


# --------------------------------------------------------------------------- tables


def _width_for(manager, max_block_num) -> int:
    if isinstance(max_block_num, Mapping):
        width = max_block_num.get(manager.manager_key)
        if width is None:
            raise ValueError(f"max_block_num is required for manager_key={manager.manager_key}")
        return int(width)
    return int(max_block_num)


def build_block_tables(
    requests: Sequence | None,
    kv_cache_manager,
    max_block_num,
    device=None,
    batch_size: int = 0,
    *,
    key_attr: str = "manager_key",
) -> dict[str, torch.Tensor]:
    """``[batch, max_blocks]`` int32 per group, padded with the group's null block.

    Rows past ``len(requests)`` (decode padding) stay zero, as in the framework.
    ``key_attr`` picks the dict key: ``attn_type`` (G0/G1) or ``manager_key`` (G2).
    """
    tables: dict[str, torch.Tensor] = {}
    rows = len(requests) if requests is not None else 0
    batch = max(batch_size, rows)
    for manager in kv_cache_manager.single_type_managers:
        width = _width_for(manager, max_block_num)
        null_block = manager.block_pool.get_null_block()
        table = torch.zeros((batch, width), dtype=torch.int32, device=device)
        for row, request in enumerate(requests or []):
            blocks = list(manager.req_to_blocks.get(request.request_id, []))
            if len(blocks) > width:
                raise ValueError(
                    f"block table of request {request.request_id} in group {manager.manager_key} has "
                    f"{len(blocks)} blocks, more than max_block_num={width}"
                )
            blocks.extend([null_block] * (width - len(blocks)))
            table[row] = torch.tensor(blocks, dtype=torch.int32, device=device)
        tables[getattr(manager, key_attr)] = table
    return tables


def slot_mapping_for(
    position_ids: torch.Tensor,
    actual_seq_lengths_cu_q: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    *,
    key: str = "?",
) -> torch.Tensor:
    """Slots of the packed tokens: ``block_table[b, pos // bs] * bs + pos % bs`` per request ``b``."""
    if block_table.shape[1] == 0:
        raise ValueError(f"block_table for {key} must have non-zero width")
    ends = [int(v) for v in actual_seq_lengths_cu_q.tolist()]
    if ends and ends[-1] != position_ids.numel():
        raise ValueError(
            f"cumulative q lengths end at {ends[-1]} but there are {position_ids.numel()} packed positions"
        )
    pieces = []
    start = 0
    for row, end in enumerate(ends):
        positions = position_ids[start:end].long()
        start = end
        block_idx = positions // block_size
        if block_idx.numel() and int(block_idx.max()) >= block_table.shape[1]:
            raise ValueError(
                f"block index {int(block_idx.max())} out of range for {key}: table width {block_table.shape[1]}"
            )
        block_ids = block_table[row].long().gather(0, block_idx)
        pieces.append(block_ids * block_size + positions % block_size)
    if not pieces:
        return torch.empty(0, dtype=torch.long, device=position_ids.device)
    return torch.cat(pieces)


def build_slot_mappings(
    position_ids: torch.Tensor,
    actual_seq_lengths_cu_q: torch.Tensor,
    block_tables: Mapping[str, torch.Tensor],
    block_sizes: Mapping[str, int],
) -> dict[str, torch.Tensor]:
    """One slot mapping per block table (same keys)."""
    return {
        key: slot_mapping_for(position_ids, actual_seq_lengths_cu_q, table, block_sizes[key], key=key)
        for key, table in block_tables.items()
    }


# --------------------------------------------------------------------------- framework-signature wrappers


def prepare_block_tables_g01(requests, kv_cache_manager, max_block_num: int, device, batch_size: int = 0):
    """G0/G1 ``prepare_block_tables``: keys = attn_type, one width for all groups."""
    return build_block_tables(requests, kv_cache_manager, max_block_num, device, batch_size, key_attr="attn_type")


def prepare_slot_mapping_g01(position_ids, actual_seq_lengths_cu_q, block_tables, block_size: int):
    """G0/G1 ``prepare_slot_mapping``: one model-level block size."""
    return {
        key: slot_mapping_for(position_ids, actual_seq_lengths_cu_q, table, block_size, key=key)
        for key, table in block_tables.items()
    }


def prepare_block_tables_g2(requests, kv_cache_manager, max_block_num, device, batch_size: int = 0):
    """G2 ``prepare_block_tables``: keys = manager_key, width per key (dict) or shared (int)."""
    return build_block_tables(requests, kv_cache_manager, max_block_num, device, batch_size, key_attr="manager_key")


def prepare_slot_mapping_g2(position_ids, actual_seq_lengths_cu_q, kv_cache_manager, block_tables):
    """G2 ``prepare_slot_mapping``: each group's own block size."""
    result = {}
    for manager in kv_cache_manager.single_type_managers:
        key = manager.manager_key
        table = block_tables.get(key)
        if table is None:
            raise ValueError(f"block_table is required for manager_key={key}")
        result[key] = slot_mapping_for(position_ids, actual_seq_lengths_cu_q, table, manager.block_size, key=key)
    return result


# Device memory the framework-signature ``calculate_block_num`` sees in budget mode,
# in place of ``torch.npu.mem_get_info()``: (free_bytes, total_bytes).
_EMULATED_MEM_INFO: list[tuple[int, int] | None] = [None]


def set_emulated_mem_info(free_bytes: int | None, total_bytes: int | None = None) -> None:
    """Set (or clear with None) the memory figures used by budget-mode block math."""
    _EMULATED_MEM_INFO[0] = None if free_bytes is None else (int(free_bytes), int(total_bytes or free_bytes))


def framework_calculate_block_num(infer_config, cache_info, offline_max_len=None, tp_group=None) -> dict[str, int]:
    """``calculate_block_num`` with the framework's signature, for installed modules.

    Reads ``infer_config.scheduler_config.batch_size_per_dp_rank``, ``.max_prefill_tokens``,
    ``.mem_fraction_static`` and ``infer_config.model_config.next_n``. Budget mode uses
    ``total * mem_fraction_static - used`` from ``set_emulated_mem_info``.
    """
    scheduler_config = infer_config.scheduler_config
    model_config = getattr(infer_config, "model_config", None)
    next_n = int(getattr(model_config, "next_n", 0) or 0)
    concurrency = int(scheduler_config.batch_size_per_dp_rank)
    if offline_max_len:
        return calculate_block_num(
            cache_info, max_concurrency=concurrency, offline_max_len=offline_max_len, next_n=next_n
        )
    mem = _EMULATED_MEM_INFO[0]
    if mem is None:
        raise RuntimeError("budget-mode block math needs set_emulated_mem_info(free_bytes, total_bytes) first")
    free, total = mem
    available = total * float(scheduler_config.mem_fraction_static) - (total - free)
    return calculate_block_num(
        cache_info,
        max_concurrency=concurrency,
        available_kv_memory=available,
        next_n=next_n,
        max_prefill_tokens=getattr(scheduler_config, "max_prefill_tokens", None),
    )


def framework_allocate_cache_tensors(device, cache_info, block_num_by_type) -> None:
    """``allocate_cache_tensors`` with the framework's signature and return value (None)."""
    allocate_cache_tensors(device, cache_info, block_num_by_type)


__all__ = [
    "FIXED_BLOCK_ATTN_TYPES",
    "GroupSpec",
    "allocate_cache_tensors",
    "build_block_tables",
    "build_slot_mappings",
    "cache_tensor_shape",
    "calculate_block_num",
    "dtype_itemsize",
    "fixed_blocks_per_request",
    "framework_allocate_cache_tensors",
    "framework_calculate_block_num",
    "group_specs",
    "kv_cache_bytes",
    "prepare_block_tables_g01",
    "prepare_block_tables_g2",
    "prepare_slot_mapping_g01",
    "prepare_slot_mapping_g2",
    "set_emulated_mem_info",
    "slot_mapping_for",
    "validate_cache_info",
]
