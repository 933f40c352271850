"""CPU harness of the cann-recipes-infer KV-cache framework contract (API generations G0, G1, G2, G3).

Entry points:

* ``install_framework(generation="G2", framework_root=None)``: context manager that makes
  ``executor.core.kv_cache`` (and its submodules), ``executor.utils.forward_metadata`` and
  ``executor.utils.common_utils`` resolve to the harness (or a real checkout);
* ``get_generation(name)``: the CacheEntry / LayerCacheInfo / ModelCacheInfo classes of one generation;
* ``BlockPool``, ``FullAttentionManager``, ``SlidingWindowManager``, ``MambaManager`` (G3), ``KVCacheManager``;
* ``validate_cache_info``, ``calculate_block_num``, ``allocate_cache_tensors``,
  ``prepare_block_tables``, ``prepare_slot_mapping``, ``get_init_attn_mask``;
* ``Scheduler`` / ``Step``: request life cycle producing the packed inputs and metadata;
* ``poison_free_blocks`` / ``poison_null_blocks`` / ``check_pool_invariants``.
"""

from .api import FrameworkAPI
from .block_pool import BlockPool
from .cache_utils import (
    FIXED_BLOCK_ATTN_TYPES,
    allocate_cache_tensors,
    build_block_tables,
    cache_tensor_shape,
    calculate_block_num,
    entry_spec,
    group_specs,
    kv_cache_bytes,
    set_emulated_mem_info,
    slot_mapping_for,
    validate_cache_info,
)
from .cache_utils import prepare_block_tables_g2 as prepare_block_tables
from .cache_utils import prepare_slot_mapping_g2 as prepare_slot_mapping
from .common_utils import MASK_SIZE, get_decode_mask, get_init_attn_mask
from .entries import dtype_itemsize, entry_block_size, group_key_of, iter_entries
from .errors import CacheInfoError, FrameworkImportError, HarnessError, SchedulerStall
from .forward_metadata import ForwardMetaData
from .generations import (
    GENERATIONS,
    detect_generation_from_classes,
    detect_generation_from_source,
    get_generation,
    read_fields_from_source,
)
from .install import FrameworkHandle, build_harness_modules, install_framework
from .kv_cache_manager import KVCacheManager
from .managers import (
    ATTN_TYPE_MANAGER_MAP,
    FullAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    create_single_type_managers,
    window_keys,
)
from .paged import read_positions, slots_of, write_slots
from .poison import (
    assert_pool_invariants,
    block_is_poisoned,
    block_ownership,
    check_pool_invariants,
    poison_blocks,
    poison_free_blocks,
    poison_null_blocks,
)
from .scheduler import Request, Scheduler, Step, argmax_sampler

__all__ = [
    "ATTN_TYPE_MANAGER_MAP",
    "FIXED_BLOCK_ATTN_TYPES",
    "GENERATIONS",
    "MASK_SIZE",
    "BlockPool",
    "CacheInfoError",
    "ForwardMetaData",
    "FrameworkAPI",
    "FrameworkHandle",
    "FrameworkImportError",
    "FullAttentionManager",
    "HarnessError",
    "KVCacheManager",
    "MambaManager",
    "Request",
    "Scheduler",
    "SchedulerStall",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "Step",
    "allocate_cache_tensors",
    "argmax_sampler",
    "assert_pool_invariants",
    "block_is_poisoned",
    "block_ownership",
    "build_block_tables",
    "build_harness_modules",
    "cache_tensor_shape",
    "calculate_block_num",
    "check_pool_invariants",
    "create_single_type_managers",
    "detect_generation_from_classes",
    "detect_generation_from_source",
    "dtype_itemsize",
    "entry_block_size",
    "entry_spec",
    "get_decode_mask",
    "get_generation",
    "get_init_attn_mask",
    "group_key_of",
    "group_specs",
    "install_framework",
    "iter_entries",
    "kv_cache_bytes",
    "poison_blocks",
    "poison_free_blocks",
    "poison_null_blocks",
    "prepare_block_tables",
    "prepare_slot_mapping",
    "read_fields_from_source",
    "read_positions",
    "set_emulated_mem_info",
    "slot_mapping_for",
    "slots_of",
    "validate_cache_info",
    "window_keys",
    "write_slots",
]
