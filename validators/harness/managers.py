"""Per-group block managers (FullAttention, SlidingWindow) and their factory.

Behaviour follows the framework's documented single-type managers:

* logical block list per request, one entry per ``block_size`` tokens; slots that hold
  no storage point at the pool's null block;
* FullAttention appends blocks as the sequence grows and never skips tokens;
* SlidingWindow gives a prefill only the blocks its window needs (leading logical
  blocks = null block) and, before each later allocation, returns the blocks whose
  tokens slid out of the window (replacing them by the null block).

How many recent keys a sliding window keeps is a single function, ``window_keys``.
The framework keeps ``W`` keys per query (skipped tokens = computed - W + 1); a
manager can be built with ``extra_window_keys=1`` to keep ``W + 1`` (the band reading
``pre_tokens = W``) so validators can compare the two readings by measurement.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from model_infer_kvcache.analyzer.kv_cache_spec import FULL_ATTENTION, MAMBA, SLIDING_WINDOW

from .block_pool import BlockPool
from .entries import entry_block_size, group_key_of, iter_entries
from .errors import CacheInfoError


def window_keys(sliding_window: int, extra_keys: int = 0) -> int:
    """Keys one query must still be able to read, counting its own key.

    ``extra_keys=0`` is the framework's rule (``W``); ``extra_keys=1`` keeps ``W + 1``.
    """
    if sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    if extra_keys < 0:
        raise ValueError(f"extra_keys must be non-negative, got {extra_keys}")
    return sliding_window + extra_keys


class SingleTypeKVCacheManager:
    """Block management for one group (one attn_type, or one manager_key in G2)."""

    def __init__(
        self,
        attn_type: str,
        block_num: int,
        block_size: int,
        manager_key: str | None = None,
        max_model_len: int | None = None,
        **kwargs,
    ):
        self.attn_type = attn_type
        self.manager_key = manager_key if manager_key is not None else attn_type
        self.block_pool = BlockPool(num_blocks=block_num, block_size=block_size)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self._null_block = self.block_pool.get_null_block()
        self.req_to_blocks: dict[int, list[int]] = {}

    # ---------------------------------------------------------------- sizing
    def get_num_blocks_to_allocate(self, request_id: int, num_tokens: int) -> int:
        """New blocks needed so the request's table covers ``num_tokens`` tokens."""
        if num_tokens < 0:
            raise ValueError("num_tokens must be non-negative")
        existing = len(self.req_to_blocks.get(request_id, []))
        return max(0, math.ceil(num_tokens / self.block_size) - existing)

    def pre_allocate_blocks(self, request_id: int, num_tokens: int, reserved_tokens: int = 0) -> tuple[int, bool]:
        """G2 admission check: blocks needed and whether the pool can give them.

        Every request already holding blocks reserves ``reserved_tokens`` of growth.
        """
        need = self.get_num_blocks_to_allocate(request_id, num_tokens)
        per_request = math.ceil(reserved_tokens / self.block_size) if reserved_tokens > 0 else 0
        reserved = per_request * len(self.req_to_blocks)
        return need, need <= self.get_num_free_blocks() - reserved

    # ---------------------------------------------------------------- allocation
    def allocate_new_blocks(self, request_id: int, block_num_to_allocate: int, num_tokens: int | None = None) -> None:
        new_blocks = self.block_pool.get_new_blocks(block_num_to_allocate)
        self.req_to_blocks.setdefault(request_id, []).extend(new_blocks)

    def free(self, request_id: int) -> None:
        blocks = self.req_to_blocks.pop(request_id, [])
        if blocks:
            self.block_pool.free_blocks(blocks)

    def get_blocks(self, request_id: int) -> list[int]:
        return self.req_to_blocks.get(request_id, [])

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    # ---------------------------------------------------------------- skipping
    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        raise NotImplementedError("subclasses define how many computed tokens can be skipped")

    def plan_skipped_blocks(self, request_id: int, total_computed_tokens: int) -> list[int]:
        """Logical indices ``remove_skipped_blocks`` would null out, without changing state.

        Walks back from the last fully skipped block and stops at the first null block,
        since everything before it was released by an earlier step.
        """
        skipped_tokens = self.get_num_skipped_tokens(total_computed_tokens)
        if skipped_tokens <= 0:
            return []
        blocks = self.req_to_blocks.get(request_id, [])
        count = min(skipped_tokens // self.block_size, len(blocks))
        indices = []
        for idx in range(count - 1, -1, -1):
            if blocks[idx] == self._null_block:
                break
            indices.append(idx)
        return indices

    def remove_skipped_blocks(self, request_id: int, total_computed_tokens: int) -> list[int]:
        """Return slid-out blocks to the pool, replacing them by the null block; returns the freed ids."""
        indices = self.plan_skipped_blocks(request_id, total_computed_tokens)
        if not indices:
            return []
        blocks = self.req_to_blocks[request_id]
        released = [blocks[idx] for idx in indices]
        for idx in indices:
            blocks[idx] = self._null_block
        self.block_pool.free_blocks(released)
        return released

    # ---------------------------------------------------------------- introspection
    def owned_blocks(self, request_id: int) -> list[int]:
        """Real (non-null) blocks a request holds, in logical order."""
        return [b for b in self.req_to_blocks.get(request_id, []) if b != self._null_block]

    def num_used_blocks(self) -> int:
        return self.block_pool.num_blocks - 1 - self.get_num_free_blocks()

    @staticmethod
    def validate_and_build_kwargs(group_entries: Sequence) -> dict[str, object]:
        raise NotImplementedError("subclasses validate their entries")


class FullAttentionManager(SingleTypeKVCacheManager):
    """Cache grows with the sequence; nothing is released before the request ends."""

    def __init__(self, attn_type: str, block_num: int, block_size: int, manager_key: str | None = None,
                 max_model_len: int | None = None, compress_ratio: int = 1, **kwargs):
        super().__init__(attn_type=attn_type, block_num=block_num, block_size=block_size,
                         manager_key=manager_key, max_model_len=max_model_len)
        # G3: rows hold compress_ratio tokens each; such groups get no per-token slot mapping.
        self.compress_ratio = compress_ratio

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return 0

    @staticmethod
    def validate_and_build_kwargs(group_entries: Sequence) -> dict[str, object]:
        ratios = {int(getattr(entry, "compress_ratio", 1) or 1) for entry in group_entries}
        if len(ratios) != 1:
            raise ValueError(
                "All FullAttention caches grouped into one manager must share the same compress_ratio, "
                f"but got {sorted(ratios)}."
            )
        return {"compress_ratio": next(iter(ratios))}


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Only the blocks inside the window hold storage; the rest of the table is null blocks."""

    def __init__(
        self,
        attn_type: str,
        block_num: int,
        block_size: int,
        sliding_window: int,
        manager_key: str | None = None,
        max_model_len: int | None = None,
        extra_window_keys: int = 0,
        prefill_extra_tokens: int = 0,
        **kwargs,
    ):
        super().__init__(
            attn_type=attn_type, block_num=block_num, block_size=block_size,
            manager_key=manager_key, max_model_len=max_model_len,
        )
        self.sliding_window = sliding_window
        self.extra_window_keys = extra_window_keys
        self.kept_keys = window_keys(sliding_window, extra_window_keys)
        # Tokens a prefill keeps beyond kept_keys: 0 up to G2 (first kept token L - W),
        # 1 in G3 (a9adc55: first kept token max(0, L - 1 - W)).
        self.prefill_extra_tokens = prefill_extra_tokens

    def first_needed_token(self, num_tokens: int) -> int:
        """First position a prefill of ``num_tokens`` tokens keeps storage for."""
        return max(0, num_tokens - self.kept_keys - self.prefill_extra_tokens)

    def logical_block_layout(self, num_tokens: int) -> tuple[int, int, int]:
        """(total logical blocks, first block with storage, blocks with storage) for a prefill."""
        total = math.ceil(num_tokens / self.block_size)
        last_block = (num_tokens - 1) // self.block_size
        first_valid = self.first_needed_token(num_tokens) // self.block_size
        return total, first_valid, last_block - first_valid + 1

    def get_num_blocks_to_allocate(self, request_id: int, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError("num_tokens must be non-negative")
        existing = len(self.req_to_blocks.get(request_id, []))
        if existing > 0:
            return max(0, math.ceil(num_tokens / self.block_size) - existing)
        # Prefill: only the window's blocks get storage.
        return max(0, self.logical_block_layout(num_tokens)[2])

    def pre_allocate_blocks(self, request_id: int, num_tokens: int, reserved_tokens: int = 0) -> tuple[int, bool]:
        # The framework applies no growth reservation to sliding groups (their size is bounded).
        need = self.get_num_blocks_to_allocate(request_id, num_tokens)
        return need, need <= self.get_num_free_blocks()

    def allocate_new_blocks(self, request_id: int, block_num_to_allocate: int, num_tokens: int | None = None) -> None:
        new_blocks = self.block_pool.get_new_blocks(block_num_to_allocate)
        blocks = self.req_to_blocks.setdefault(request_id, [])
        if blocks:
            blocks.extend(new_blocks)
            return
        if num_tokens is None:
            raise ValueError("a sliding-window prefill allocation needs num_tokens")
        total, first_valid, _ = self.logical_block_layout(num_tokens)
        # Leading logical blocks keep positions aligned with kv_len but hold no storage.
        blocks.extend([self._null_block] * first_valid)
        blocks.extend(new_blocks)
        if len(blocks) != total:
            raise ValueError(
                f"sliding-window block table length mismatch after prefill: got={len(blocks)}, expected={total}"
            )

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        # Framework rule with kept_keys = W: max(0, computed - W + 1).
        return max(0, num_computed_tokens - self.kept_keys + 1)

    @staticmethod
    def validate_and_build_kwargs(group_entries: Sequence) -> dict[str, object]:
        windows = {entry.sliding_window for entry in group_entries}
        if None in windows:
            raise ValueError("SlidingWindow cache must define sliding_window.")
        if len(windows) != 1:
            raise ValueError(
                f"All SlidingWindow caches grouped into one manager must share the same sliding_window, "
                f"but got {sorted(windows)}."
            )
        return {"sliding_window": next(iter(windows))}


class MambaManager(SingleTypeKVCacheManager):
    """G3 recurrent state: one block per request at prefill, ``1 + next_n`` once decoding."""

    def __init__(self, attn_type: str, block_num: int, block_size: int, manager_key: str | None = None,
                 next_n: int = 0, max_model_len: int | None = None, **kwargs):
        super().__init__(attn_type=attn_type, block_num=block_num, block_size=block_size,
                         manager_key=manager_key, max_model_len=max_model_len)
        self.next_n = next_n

    def get_num_blocks_to_allocate(self, request_id: int, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError("num_tokens must be non-negative")
        existing = len(self.req_to_blocks.get(request_id, []))
        total = 1 if existing == 0 else 1 + self.next_n
        return max(0, total - existing)

    def pre_allocate_blocks(self, request_id: int, num_tokens: int, reserved_tokens: int = 0) -> tuple[int, bool]:
        need = self.get_num_blocks_to_allocate(request_id, num_tokens)
        return need, need <= self.get_num_free_blocks()

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return 0

    @staticmethod
    def validate_and_build_kwargs(group_entries: Sequence) -> dict[str, object]:
        next_ns = {entry.next_n for entry in group_entries}
        if len(next_ns) != 1:
            raise ValueError(
                f"All Mamba caches grouped into one manager must share the same next_n, but got {sorted(next_ns)}."
            )
        return {"next_n": next(iter(next_ns))}


ATTN_TYPE_MANAGER_MAP: dict[str, type[SingleTypeKVCacheManager]] = {
    FULL_ATTENTION: FullAttentionManager,
    SLIDING_WINDOW: SlidingWindowManager,
}
# G3 adds the Mamba state manager.
ATTN_TYPE_MANAGER_MAP_G3: dict[str, type[SingleTypeKVCacheManager]] = {
    **ATTN_TYPE_MANAGER_MAP,
    MAMBA: MambaManager,
}


def group_entries_by_key(cache_info) -> dict[str, list[tuple[int, object]]]:
    """Paged entries grouped by table key, each as ``(layer_idx, entry)``, in first-seen order."""
    groups: dict[str, list[tuple[int, object]]] = {}
    for layer_idx, entry in iter_entries(cache_info, paged_only=True):
        groups.setdefault(group_key_of(entry), []).append((layer_idx, entry))
    return groups


def create_single_type_managers(
    cache_info,
    block_num_by_type: dict[str, int],
    max_model_len: int,
    *,
    extra_window_keys: int = 0,
    prefill_extra_tokens: int = 0,
    manager_map: dict[str, type[SingleTypeKVCacheManager]] | None = None,
) -> list[SingleTypeKVCacheManager]:
    """One manager per group key, in the order the groups first appear.

    ``manager_map``: the generation's attn_type -> manager classes (default: G0-G2's).
    """
    manager_map = ATTN_TYPE_MANAGER_MAP if manager_map is None else manager_map
    managers = []
    for key, members in group_entries_by_key(cache_info).items():
        layer_idx, first = members[0]
        if key not in block_num_by_type:
            raise CacheInfoError(
                f"no block count for group '{key}' (layer {layer_idx}, entry '{first.cache_name}', "
                f"attn_type={first.attn_type}); known groups: {sorted(block_num_by_type)}"
            )
        entries = [entry for _, entry in members]
        attn_types = {entry.attn_type for entry in entries}
        if len(attn_types) != 1:
            raise CacheInfoError(f"caches grouped under '{key}' must share one attn_type, got {sorted(attn_types)}")
        attn_type = first.attn_type
        manager_cls = manager_map.get(attn_type)
        if manager_cls is None:
            raise CacheInfoError(
                f"unknown attn_type '{attn_type}' in layer {layer_idx}, entry '{first.cache_name}'; "
                f"supported: {sorted(manager_map)}"
            )
        block_sizes = {entry_block_size(entry, cache_info) for entry in entries}
        if len(block_sizes) != 1:
            raise CacheInfoError(f"caches grouped under '{key}' must share one block_size, got {sorted(block_sizes)}")
        kwargs = {
            "block_num": block_num_by_type[key],
            "block_size": next(iter(block_sizes)),
            "manager_key": key,
            "max_model_len": max_model_len,
        }
        kwargs.update(manager_cls.validate_and_build_kwargs(entries))
        if manager_cls is SlidingWindowManager:
            kwargs["extra_window_keys"] = extra_window_keys
            kwargs["prefill_extra_tokens"] = prefill_extra_tokens
        managers.append(manager_cls(attn_type=attn_type, **kwargs))
    return managers


__all__ = [
    "ATTN_TYPE_MANAGER_MAP",
    "ATTN_TYPE_MANAGER_MAP_G3",
    "FullAttentionManager",
    "MambaManager",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "create_single_type_managers",
    "group_entries_by_key",
    "window_keys",
]
