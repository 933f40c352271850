"""Request-level coordinator over all group managers (two-phase ``allocate_slots``)."""

from __future__ import annotations

from collections.abc import Sequence

from model_infer_kvcache.analyzer.kv_cache_spec import holds_state

from .managers import SingleTypeKVCacheManager, create_single_type_managers


class KVCacheManager:
    """Allocates, reports and releases the blocks of every group for one worker.

    Constructor arguments match the framework (``max_model_len, single_type_managers,
    cache_info``). ``from_cache_info`` builds the managers from a ModelCacheInfo.

    ``recycle_skipped_on_failure``: the framework releases slid-out sliding-window
    blocks during the check phase, so a failed ``allocate_slots`` still recycles them.
    The harness default (False) makes a failure leave every table and pool unchanged;
    set True to reproduce the framework's order exactly.
    """

    def __init__(
        self,
        max_model_len: int,
        single_type_managers: Sequence[SingleTypeKVCacheManager],
        cache_info,
        *,
        recycle_skipped_on_failure: bool = False,
    ):
        self.max_model_len = max_model_len
        self.single_type_managers = tuple(single_type_managers)
        keys = [m.manager_key for m in self.single_type_managers]
        if len(set(keys)) != len(keys):
            raise ValueError(f"duplicate manager keys: {keys}")
        self.num_attn_types = len({m.attn_type for m in self.single_type_managers})
        self.num_managers = len(self.single_type_managers)
        self.cache_info = cache_info
        self.is_mla_backend = bool(getattr(cache_info, "is_mla_backend", False))
        self.recycle_skipped_on_failure = recycle_skipped_on_failure

    @classmethod
    def from_cache_info(
        cls,
        cache_info,
        block_num_by_key: dict[str, int],
        max_model_len: int,
        *,
        extra_window_keys: int = 0,
        recycle_skipped_on_failure: bool = False,
    ) -> KVCacheManager:
        """Build managers for every group of ``cache_info`` (block sizes come from the description)."""
        managers = create_single_type_managers(
            cache_info, block_num_by_key, max_model_len, extra_window_keys=extra_window_keys
        )
        return cls(max_model_len, managers, cache_info, recycle_skipped_on_failure=recycle_skipped_on_failure)

    # ---------------------------------------------------------------- allocation
    def allocate_slots(
        self,
        request_id: int,
        computed_tokens: int,
        num_new_tokens: int,
        lookahead_tokens: int = 0,
        reserved_tokens: int = 0,
        manager_keys=None,
    ) -> bool:
        """Make every group's table cover ``computed_tokens + num_new_tokens + lookahead_tokens``.

        Phase 1 checks every group (counting blocks that slid out of a window as free);
        phase 2 runs only when all groups can allocate. Returns False on failure.
        ``manager_keys`` (G3): only those groups take part (non-owner ranks keep Mamba state only).
        """
        if num_new_tokens < 0:
            raise ValueError("num_new_tokens must be non-negative")
        total_computed = min(computed_tokens, self.max_model_len)
        tokens_needed = min(computed_tokens + num_new_tokens + lookahead_tokens, self.max_model_len)

        selected = [m for m in self.single_type_managers if manager_keys is None or m.manager_key in manager_keys]
        plans = []
        for manager in selected:
            skip_indices = manager.plan_skipped_blocks(request_id, total_computed)
            need = manager.get_num_blocks_to_allocate(request_id, tokens_needed)
            available = manager.get_num_free_blocks() + len(skip_indices)
            reserve = self._reserved_blocks(manager, reserved_tokens)
            plans.append((manager, need))
            if need > available - reserve:
                if self.recycle_skipped_on_failure:
                    for done, _ in plans:
                        done.remove_skipped_blocks(request_id, total_computed)
                return False

        for manager, need in plans:
            manager.remove_skipped_blocks(request_id, total_computed)
            manager.allocate_new_blocks(request_id, need, num_tokens=tokens_needed)
        return True

    @staticmethod
    def _reserved_blocks(manager, reserved_tokens: int) -> int:
        # G2 growth reservation; sliding and Mamba groups are bounded and reserve nothing.
        if reserved_tokens <= 0 or getattr(manager, "sliding_window", None) is not None or holds_state(manager.attn_type):
            return 0
        per_request = -(-reserved_tokens // manager.block_size)
        return per_request * len(manager.req_to_blocks)

    def get_request_owner_manager_keys(self, is_owner: bool) -> set[str]:
        """Every group on the rank that owns the request; only Mamba state elsewhere (G3)."""
        return {m.manager_key for m in self.single_type_managers if is_owner or holds_state(m.attn_type)}

    def free(self, request_id: int) -> None:
        for manager in self.single_type_managers:
            manager.free(request_id)

    # ---------------------------------------------------------------- queries
    @property
    def keys(self) -> list[str]:
        return [m.manager_key for m in self.single_type_managers]

    def manager(self, key: str) -> SingleTypeKVCacheManager:
        for m in self.single_type_managers:
            if m.manager_key == key:
                return m
        raise KeyError(f"no manager for key {key!r}; keys: {self.keys}")

    def get_block_ids(self, request_id: int) -> dict[str, list[int]]:
        return {m.manager_key: m.get_blocks(request_id) for m in self.single_type_managers}

    def get_block_sizes(self) -> dict[str, int]:
        return {m.manager_key: m.block_size for m in self.single_type_managers}

    def get_block_table_max_lens(self, max_model_len: int) -> dict[str, int]:
        return {m.manager_key: -(-max_model_len // m.block_size) for m in self.single_type_managers}

    def usage(self) -> dict[str, dict[str, int]]:
        """Per group: total blocks, used (handed out), free, and the reserved null block."""
        return {
            m.manager_key: {
                "total": m.block_pool.num_blocks,
                "used": m.num_used_blocks(),
                "free": m.get_num_free_blocks(),
                "null": 1,
            }
            for m in self.single_type_managers
        }

    # ---------------------------------------------------------------- poisoning
    def poison_free_blocks(self, cache_tensors, value: float = float("nan"), *, include_null: bool = True):
        """Fill every unowned block (and the null block) of ``cache_tensors`` ({key: [tensors]})."""
        from .poison import poison_free_blocks

        return poison_free_blocks(self, cache_tensors, value, include_null=include_null)

    def poison_null_blocks(self, cache_tensors, value: float = float("nan")):
        from .poison import poison_null_blocks

        return poison_null_blocks(self, cache_tensors, value)

    def format_usage(self) -> str:
        """``key:used/total`` per group, like the framework's scheduler log."""
        if not self.single_type_managers:
            return "0/0"
        return ",".join(
            f"{m.manager_key}:{m.block_pool.num_blocks - m.get_num_free_blocks()}/{m.block_pool.num_blocks}"
            for m in self.single_type_managers
        )


__all__ = ["KVCacheManager"]
