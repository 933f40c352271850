"""One interface over the harness modules or a real checkout's modules.

The scheduler talks to the framework only through ``FrameworkAPI`` so that the same
loop drives the harness managers or the real ``KVCacheManager`` of a checkout, with each
generation's own ``prepare_block_tables`` / ``prepare_slot_mapping`` signatures.
"""

from __future__ import annotations

import dataclasses
import math
import types
from dataclasses import dataclass

import torch

from .common_utils import MASK_SIZE


@dataclass
class FrameworkAPI:
    generation: str
    real: bool
    kv_cache: types.ModuleType
    forward_metadata: types.ModuleType
    common_utils: types.ModuleType
    extra_window_keys: int = 0
    # Set by build_manager: G0's KVCacheManager keeps no cache_info, but G0/G1 slot mappings need
    # the model-level block size.
    cache_info: object = None

    @classmethod
    def from_handle(cls, handle) -> FrameworkAPI:
        return cls(
            generation=handle.generation,
            real=handle.real,
            kv_cache=handle.kv_cache,
            forward_metadata=handle.forward_metadata,
            common_utils=handle.common_utils,
            extra_window_keys=handle.extra_window_keys,
        )

    @classmethod
    def harness(cls, generation: str = "G2", *, extra_window_keys: int = 0,
                recycle_skipped_on_failure: bool = False) -> FrameworkAPI:
        """Harness modules of one generation, without touching ``sys.modules``."""
        from .generations import get_generation
        from .install import build_harness_modules

        modules = build_harness_modules(
            generation, extra_window_keys=extra_window_keys, recycle_skipped_on_failure=recycle_skipped_on_failure
        )
        return cls(
            generation=get_generation(generation).name,
            real=False,
            kv_cache=modules["executor.core.kv_cache"],
            forward_metadata=modules["executor.utils.forward_metadata"],
            common_utils=modules["executor.utils.common_utils"],
            extra_window_keys=extra_window_keys,
        )

    @property
    def keyed_by_group_key(self) -> bool:
        return self.generation in ("G2", "G3")

    @property
    def decode_admission(self) -> str:
        """"stop" (G0: the decode batch ends at the first request that cannot grow) or "skip"."""
        from .generations import get_generation

        return get_generation(self.generation).decode_admission

    # ---------------------------------------------------------------- managers
    def build_manager(self, cache_info, block_num_by_key: dict[str, int], max_model_len: int):
        self.cache_info = cache_info
        managers = self.kv_cache.create_single_type_managers(
            cache_info=cache_info, block_num_by_type=block_num_by_key, max_model_len=max_model_len
        )
        if self.real and self.generation == "G0":  # G0's KVCacheManager(max_model_len, single_type_managers)
            return self.kv_cache.KVCacheManager(max_model_len=max_model_len, single_type_managers=managers)
        return self.kv_cache.KVCacheManager(
            max_model_len=max_model_len, single_type_managers=managers, cache_info=cache_info
        )

    @staticmethod
    def table_key(manager) -> str:
        return getattr(manager, "manager_key", None) or manager.attn_type

    def block_table_widths(self, kv_cache_manager, max_model_len: int) -> dict[str, int]:
        return {
            self.table_key(m): math.ceil(max_model_len / m.block_size) for m in kv_cache_manager.single_type_managers
        }

    # ---------------------------------------------------------------- tables
    def block_tables(self, requests, kv_cache_manager, max_model_len: int, device, batch_size: int,
                     is_prefill: bool = False):
        widths = self.block_table_widths(kv_cache_manager, max_model_len)
        if self.keyed_by_group_key:
            width = widths
        else:
            width = max(widths.values())  # G0/G1: one model-level block size, one width
        if self.generation == "G3":  # Mamba state tables are narrower at prefill
            return self.kv_cache.prepare_block_tables(requests, kv_cache_manager, width, device, batch_size,
                                                      is_prefill=is_prefill)
        return self.kv_cache.prepare_block_tables(requests, kv_cache_manager, width, device, batch_size)

    def slot_mappings(self, position_ids, cu_q, kv_cache_manager, block_tables):
        if self.keyed_by_group_key:
            return self.kv_cache.prepare_slot_mapping(position_ids, cu_q, kv_cache_manager, block_tables)
        info = getattr(kv_cache_manager, "cache_info", None) or self.cache_info
        return self.kv_cache.prepare_slot_mapping(position_ids, cu_q, block_tables, info.block_size)

    # ---------------------------------------------------------------- metadata
    def attention_mask(self, device=None) -> torch.Tensor:
        return self.common_utils.get_init_attn_mask(MASK_SIZE, device)

    def forward_metadata_fields(self) -> set[str]:
        return {f.name for f in dataclasses.fields(self.forward_metadata.ForwardMetaData)}

    def publish_forward_metadata(self, **values):
        """Set the module's global metadata (fields the checkout lacks are dropped) and return it."""
        known = self.forward_metadata_fields()
        values = {k: v for k, v in values.items() if k in known}
        module = self.forward_metadata
        if hasattr(module, "set_forward_metadata") and hasattr(module, "get_forward_metadata"):
            module.set_forward_metadata(**values)
            return module.get_forward_metadata()
        return module.ForwardMetaData(**values)


__all__ = ["FrameworkAPI"]
