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
from dataclasses import replace

import torch
from model_infer_kvcache.analyzer.kv_cache_spec import (
    FIXED_BLOCK_ATTN_TYPES,
    MAMBA,
    SPEC_BY_ATTN_TYPE,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
    Spec,
    fixed_bytes,
    holds_state,
    is_windowed,
    max_tokens_in,
    pool_bytes,
    token_bytes,
)

from .entries import (
    compress_ratio_of,
    dtype_itemsize,
    entry_block_size,
    entry_dims,
    group_key_of,
    iter_entries,
    storage_block_size,
    uses_model_block_size,
)
from .errors import CacheInfoError
from .managers import ATTN_TYPE_MANAGER_MAP

# Physical cache tensor layouts G3 knows; any other value is refused (earlier generations have
# no cache_layout field and always allocate "BnBsND").
SUPPORTED_CACHE_LAYOUTS = frozenset({"BnBsND", "BnNBsD"})


# --------------------------------------------------------------------------- validation


def _where(layer_idx, entry) -> str:
    return f"layer {layer_idx}, entry '{getattr(entry, 'cache_name', '?')}'"


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_hbm(entry) -> bool:
    allocator = getattr(entry, "allocator", None)
    return allocator is None or getattr(allocator, "value", allocator) == "hbm"


def validate_cache_info(cache_info, manager_map=None) -> None:
    """Reject descriptions the framework would fail on, naming the layer and entry.

    Checks: layer count, non-empty layers, supported attn_type, positive heads/dims,
    a torch dtype, a positive block size (model-level in G0/G1, per entry in G2),
    ``sliding_window`` on SlidingWindow entries, a known ``cache_layout`` (G3), Mamba
    entries being MambaCacheEntry (G3), and per group: one attn_type, one block size, one
    sliding window. ``manager_map``: the generation's attn types (default G0-G2's).
    """
    manager_map = ATTN_TYPE_MANAGER_MAP if manager_map is None else manager_map
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
            if entry.attn_type not in manager_map:
                raise CacheInfoError(
                    f"{where}: unsupported attn_type {entry.attn_type!r}; supported: {sorted(manager_map)}"
                )
            layout = getattr(entry, "cache_layout", "BnBsND")
            if layout not in SUPPORTED_CACHE_LAYOUTS:
                raise CacheInfoError(
                    f"{where}: unsupported cache_layout {layout!r}; supported: {sorted(SUPPORTED_CACHE_LAYOUTS)}"
                )
            if holds_state(entry.attn_type):
                if not hasattr(entry, "shape"):
                    raise CacheInfoError(f"{where}: attn_type 'Mamba' needs a MambaCacheEntry, got {type(entry).__name__}")
                continue  # the entry validated its own shape on construction
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
            if is_windowed(entry.attn_type) and not _positive_int(window):
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
            if is_windowed(entry.attn_type) and window != first_window:
                raise CacheInfoError(
                    f"{where}: sliding_window {window} differs from {first_window} ({first_where}) inside group '{key}'"
                )


# --------------------------------------------------------------------------- block math


def _entry_unit_bytes(entry) -> int:
    """Bytes of one token of a paged entry (floored after compression), or of one Mamba state block."""
    if holds_state(entry.attn_type):
        return math.prod(entry.shape) * dtype_itemsize(entry.dtype)
    ratio = 1 if entry.attn_type in FIXED_BLOCK_ATTN_TYPES else compress_ratio_of(entry)  # fixed: uncompressed
    return token_bytes(math.prod(entry_dims(entry)), entry.num_head, dtype_itemsize(entry.dtype), ratio)


def entry_spec(entry, cache_info, next_n: int = 0) -> Spec:
    """The spec of one entry's kind of group, sized by this entry alone (its HBM bytes; 0 off HBM).

    ``next_n``: the model's speculative tokens, which size SlidingWindow reservations (a Mamba
    entry carries its own ``next_n``).
    """
    key = group_key_of(entry)
    unit = _entry_unit_bytes(entry) if _is_hbm(entry) else 0
    if holds_state(entry.attn_type):
        return MambaSpec(key, unit, int(entry.next_n or 0))
    block_size = entry_block_size(entry, cache_info)
    if is_windowed(entry.attn_type):
        return SlidingWindowSpec(key, 1, unit, block_size, window=entry.sliding_window, next_n=next_n)
    return FullAttentionSpec(key, 1, unit, block_size)


def _merged(previous: Spec, added: Spec, new_layer: bool) -> Spec:
    if isinstance(previous, MambaSpec):
        return replace(previous, state_bytes=previous.state_bytes + added.state_bytes)
    return replace(previous, per_token_bytes=previous.per_token_bytes + added.per_token_bytes,
                   num_layers=previous.num_layers + int(new_layer))


def group_specs(cache_info, *, include_unpaged: bool = False, next_n: int = 0) -> dict[str, Spec]:
    """One spec per group (table key): block size, window and the bytes of its HBM entries together.

    ``include_unpaged``: also count ``needs_block=False`` entries, as the framework's block
    math does for growing groups (it iterates every entry there).
    """
    specs: dict[str, Spec] = {}
    last_layer: dict[str, int] = {}
    for layer_idx, entry in iter_entries(cache_info, paged_only=not include_unpaged):
        spec = entry_spec(entry, cache_info, next_n)
        key = spec.group_key
        previous = specs.get(key)
        if previous is None:
            specs[key] = spec
        elif getattr(previous, "block_size", None) != getattr(spec, "block_size", None):
            raise CacheInfoError(
                f"cache {entry.cache_name!r}: block_size {spec.block_size} differs from {previous.block_size} "
                f"inside group '{key}'"
            )
        else:
            specs[key] = _merged(previous, spec, last_layer[key] != layer_idx)
        last_layer[key] = layer_idx
    return specs


def _fixed_groups(cache_info, max_concurrency: int, next_n: int, needs_block_only: bool):
    """(blocks per fixed group, bytes they take), the framework's reservation made first."""
    counts: dict[str, int] = {}
    total_bytes = 0
    for layer_idx, entry in iter_entries(cache_info, paged_only=needs_block_only):
        if entry.attn_type not in FIXED_BLOCK_ATTN_TYPES:
            continue
        spec = entry_spec(entry, cache_info, next_n)
        count = spec.fixed_blocks(max_concurrency)
        key = spec.group_key
        if key in counts and counts[key] != count:
            raise CacheInfoError(
                f"{_where(layer_idx, entry)}: fixed-block caches sharing group '{key}' need different block "
                f"counts ({counts[key]} vs {count})"
            )
        counts[key] = count
        total_bytes += fixed_bytes([spec], max_concurrency)
    return counts, total_bytes


def calculate_block_num(
    cache_info,
    *,
    max_concurrency: int,
    offline_max_len: int | None = None,
    available_kv_memory: float | None = None,
    kv_cache_mem_ratio: float = 1.0,
    next_n: int = 0,
    max_prefill_tokens: int | None = None,
    extra_reserved_memory_bytes: int = 0,
    free_memory: int | None = None,
    fixed_needs_block_only: bool = True,
) -> dict[str, int]:
    """Blocks per group (keys as the generation keys its tables); block 0 of each pool is the null block.

    The arithmetic is the group specs' (``analyzer.kv_cache_spec``, shared with the analyzer's
    memory plan). Fixed-block groups: SlidingWindow ``max_concurrency * (ceil((W + 2 next_n) / bs)
    + 1) + 1``, Mamba ``max_concurrency * (1 + next_n) + 1``; their HBM bytes are reserved first.
    Growing groups, offline (``offline_max_len``): ``ceil(max_len / block_size) * max_concurrency + 1``;
    with ``free_memory`` the total (plus ``extra_reserved_memory_bytes``) must fit in it.
    Growing groups, budget (``available_kv_memory`` bytes): ``max_tokens = floor((available * ratio
    - fixed - extra) / per_token_bytes)`` with ``per_token_bytes`` summed over every growing
    entry (``needs_block=False`` ones too, as the framework counts them), and each group gets
    ``floor(max_tokens / block_size)`` blocks (the null block is inside that count).
    With ``max_prefill_tokens`` the budget result must hold one prefill, as the framework checks.
    ``fixed_needs_block_only=False`` reproduces G0/G1, whose fixed-block reservation also
    counted ``needs_block=False`` entries.
    """
    if max_concurrency <= 0:
        raise ValueError("max_concurrency must be positive")
    result, reserved = _fixed_groups(cache_info, max_concurrency, next_n, fixed_needs_block_only)

    paged = [s for s in group_specs(cache_info, include_unpaged=True, next_n=next_n).values() if not s.fixed]
    if not paged:
        return result

    if offline_max_len:
        for spec in paged:
            result[spec.group_key] = spec.blocks_offline(offline_max_len, max_concurrency)
        if free_memory is not None:
            required = pool_bytes(paged, result) + reserved + extra_reserved_memory_bytes
            if required > free_memory:
                raise MemoryError(
                    f"offline cache allocation needs {required:.0f} bytes, more than the free {free_memory} "
                    f"(extra_reserved={extra_reserved_memory_bytes})"
                )
        return result

    if available_kv_memory is None:
        raise ValueError("give offline_max_len (offline sizing) or available_kv_memory (budget sizing)")
    per_token = sum(s.per_token_bytes for s in paged)
    budget = available_kv_memory * kv_cache_mem_ratio - reserved - extra_reserved_memory_bytes
    if budget <= 0:
        raise MemoryError(
            f"no memory left for paged groups after fixed-block reservation: "
            f"available={available_kv_memory}, ratio={kv_cache_mem_ratio}, fixed={reserved:.0f}, "
            f"extra_reserved={extra_reserved_memory_bytes}"
        )
    if per_token <= 0:
        raise MemoryError("no HBM-backed paged cache entry remains for budget sizing")
    max_tokens = max_tokens_in(budget, per_token)
    for spec in paged:
        result[spec.group_key] = spec.blocks_for_tokens(max_tokens)
    if max_prefill_tokens is not None:
        supported = min(s.usable_tokens(result[s.group_key]) for s in paged)
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
        total += math.prod(cache_tensor_shape(entry, cache_info, blocks)) * dtype_itemsize(entry.dtype)
    return total


# --------------------------------------------------------------------------- tensors


def cache_tensor_shape(entry, cache_info, num_blocks: int) -> tuple[int, ...]:
    """``[num_blocks, block_size, num_head, *dim]`` (rows divided by compress_ratio).

    G3: ``cache_layout="BnNBsD"`` puts heads before rows (``[num_blocks, num_head, rows, *dim]``);
    a Mamba entry is ``[num_blocks, *shape]``.
    """
    if holds_state(entry.attn_type):
        return (num_blocks, *entry.shape)
    rows = storage_block_size(entry, entry_block_size(entry, cache_info))
    layout = getattr(entry, "cache_layout", "BnBsND")
    if layout == "BnNBsD":
        return (num_blocks, entry.num_head, rows, *entry_dims(entry))
    if layout != "BnBsND":
        raise CacheInfoError(f"cache {entry.cache_name!r}: unsupported cache_layout {layout!r}")
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
        if entry.attn_type not in SPEC_BY_ATTN_TYPE:
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
    skip_attn_types: Sequence[str] = (),
) -> dict[str, torch.Tensor]:
    """``[batch, max_blocks]`` int32 per group, padded with the group's null block.

    Rows past ``len(requests)`` (decode padding) stay zero, as in the framework.
    ``key_attr`` picks the dict key: ``attn_type`` (G0/G1) or ``manager_key`` (G2).
    """
    tables: dict[str, torch.Tensor] = {}
    rows = len(requests) if requests is not None else 0
    batch = max(batch_size, rows)
    for manager in kv_cache_manager.single_type_managers:
        if manager.attn_type in skip_attn_types:
            continue
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


def prepare_block_tables_g0(requests, kv_cache_manager, max_block_num: int, device, batch_size: int = 0):
    """G0 ``prepare_block_tables``: as G1, but a batch with requests must have exactly their rows.

    G0 viewed the request rows as ``[batch_size, -1]``, so a padded decode batch (fewer requests
    than ``batch_size``) failed there; the harness refuses it the same way.
    """
    if requests is not None and len(requests) != batch_size:
        raise ValueError(
            f"G0 prepare_block_tables builds exactly one row per request: {len(requests)} requests, "
            f"batch_size={batch_size} (G0 cannot pad a decode batch)"
        )
    return prepare_block_tables_g01(requests, kv_cache_manager, max_block_num, device, batch_size)


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


def _mamba_block_table(requests, manager, device, batch_size: int, is_prefill: bool) -> torch.Tensor:
    # One state block at prefill, 1 + next_n once decoding; padding rows (request_id < 0) and
    # rows past the batch hold the null block; a real request missing blocks is an error.
    width = 1 if is_prefill else 1 + manager.next_n
    null_block = manager.block_pool.get_null_block()
    table = torch.full((batch_size, width), null_block, dtype=torch.int32, device=device)
    for row, request in enumerate(requests or []):
        blocks = list(manager.req_to_blocks.get(request.request_id, []))[:width]
        if len(blocks) < width:
            if request.request_id >= 0:
                raise ValueError(
                    f"Mamba block table needs {width} blocks for request {request.request_id}, got {blocks}"
                )
            blocks += [null_block] * (width - len(blocks))
        table[row] = torch.tensor(blocks, dtype=torch.int32, device=device)
    return table


def prepare_block_tables_g3(requests, kv_cache_manager, max_block_num, device, batch_size: int = 0,
                            is_prefill: bool = False):
    """G3 ``prepare_block_tables``: G2's tables plus Mamba state tables (width depends on ``is_prefill``)."""
    paged = build_block_tables(requests, kv_cache_manager, max_block_num, device, batch_size,
                               key_attr="manager_key", skip_attn_types=(MAMBA,))
    tables = {}
    for manager in kv_cache_manager.single_type_managers:
        key = manager.manager_key
        if holds_state(manager.attn_type):
            tables[key] = _mamba_block_table(requests, manager, device, batch_size, is_prefill)
        else:
            tables[key] = paged[key]
    return tables


def prepare_slot_mapping_g3(position_ids, actual_seq_lengths_cu_q, kv_cache_manager, block_tables):
    """G3 ``prepare_slot_mapping``: no entry for Mamba groups nor for compressed (ratio > 1) groups."""
    result = {}
    for manager in kv_cache_manager.single_type_managers:
        key = manager.manager_key
        if holds_state(manager.attn_type):
            continue
        table = block_tables.get(key)
        if table is None:
            raise ValueError(f"block_table is required for manager_key={key}")
        if table.shape[1] == 0:
            raise ValueError(f"block_table for {key} must have non-zero width")
        if getattr(manager, "compress_ratio", 1) > 1:
            continue  # the model computes slots of compressed rows itself
        result[key] = slot_mapping_for(position_ids, actual_seq_lengths_cu_q, table, manager.block_size, key=key)
    return result


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


def framework_calculate_block_num(infer_config, cache_info, offline_max_len=None, tp_group=None,
                                  extra_reserved_memory_bytes: int = 0, *, offline_memory_check: bool = True,
                                  fixed_needs_block_only: bool = True) -> dict[str, int]:
    """``calculate_block_num`` with the framework's signature, for installed modules.

    Reads ``infer_config.scheduler_config.batch_size_per_dp_rank``, ``.max_prefill_tokens``,
    ``.mem_fraction_static`` and ``infer_config.model_config.next_n``. Budget mode uses
    ``total * mem_fraction_static - used`` from ``set_emulated_mem_info``; offline mode checks
    the total against the free figure when one is set (G1 on; ``offline_memory_check``).
    ``extra_reserved_memory_bytes`` (G3) is taken off the budget first.
    """
    scheduler_config = infer_config.scheduler_config
    model_config = getattr(infer_config, "model_config", None)
    next_n = int(getattr(model_config, "next_n", 0) or 0)
    concurrency = int(scheduler_config.batch_size_per_dp_rank)
    mem = _EMULATED_MEM_INFO[0]
    common = {"max_concurrency": concurrency, "next_n": next_n,
              "extra_reserved_memory_bytes": extra_reserved_memory_bytes,
              "fixed_needs_block_only": fixed_needs_block_only}
    if offline_max_len:
        free = mem[0] if (mem is not None and offline_memory_check) else None
        return calculate_block_num(cache_info, offline_max_len=offline_max_len, free_memory=free, **common)
    if mem is None:
        raise RuntimeError("budget-mode block math needs set_emulated_mem_info(free_bytes, total_bytes) first")
    free, total = mem
    available = total * float(scheduler_config.mem_fraction_static) - (total - free)
    return calculate_block_num(
        cache_info,
        available_kv_memory=available,
        max_prefill_tokens=getattr(scheduler_config, "max_prefill_tokens", None),
        **common,
    )


def framework_allocate_cache_tensors(device, cache_info, block_num_by_type) -> None:
    """``allocate_cache_tensors`` with the framework's signature and return value (None)."""
    allocate_cache_tensors(device, cache_info, block_num_by_type)


__all__ = [
    "FIXED_BLOCK_ATTN_TYPES",
    "SUPPORTED_CACHE_LAYOUTS",
    "allocate_cache_tensors",
    "build_block_tables",
    "build_slot_mappings",
    "cache_tensor_shape",
    "calculate_block_num",
    "dtype_itemsize",
    "entry_spec",
    "framework_allocate_cache_tensors",
    "framework_calculate_block_num",
    "group_specs",
    "kv_cache_bytes",
    "prepare_block_tables_g0",
    "prepare_block_tables_g01",
    "prepare_block_tables_g2",
    "prepare_block_tables_g3",
    "prepare_slot_mapping_g01",
    "prepare_slot_mapping_g2",
    "prepare_slot_mapping_g3",
    "set_emulated_mem_info",
    "slot_mapping_for",
    "validate_cache_info",
]
