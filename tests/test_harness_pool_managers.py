"""BlockPool, FullAttention / SlidingWindow managers and the two-phase allocate_slots."""

import copy

import pytest
import torch
from model_infer_kvcache.validators.harness import (
    BlockPool,
    FullAttentionManager,
    KVCacheManager,
    SlidingWindowManager,
    check_pool_invariants,
    get_generation,
    window_keys,
)

# ---------------------------------------------------------------------- BlockPool


def test_pool_reserves_block_zero_as_null_and_is_fifo():
    pool = BlockPool(5, 4)
    assert pool.get_null_block() == 0
    assert pool.get_num_free_blocks() == 4
    assert pool.get_new_blocks(2) == [1, 2]
    pool.free_blocks([2, 1])
    # Freed blocks go to the tail, in the order freed.
    assert pool.free_block_ids() == [3, 4, 2, 1]
    assert pool.get_new_blocks(3) == [3, 4, 2]


def test_pool_rejects_double_free_atomically_and_ignores_null():
    pool = BlockPool(4, 2)
    a, b = pool.get_new_blocks(2)
    pool.free_blocks([a])
    before = pool.free_block_ids()
    with pytest.raises(ValueError, match="already free"):
        pool.free_blocks([b, a])  # b is valid, a is a double free: nothing may change
    assert pool.free_block_ids() == before
    with pytest.raises(ValueError, match="already free"):
        pool.free_blocks([b, b])
    pool.free_blocks([0])  # null block: no-op
    assert 0 not in pool.free_block_ids()
    with pytest.raises(IndexError):
        pool.free_blocks([9])
    with pytest.raises(ValueError):
        pool.get_new_blocks(5)


# ---------------------------------------------------------------------- managers


def test_full_attention_appends_blocks():
    m = FullAttentionManager("FullAttention", block_num=10, block_size=4)
    assert m.get_num_blocks_to_allocate(7, 9) == 3  # ceil(9/4)
    m.allocate_new_blocks(7, 3, num_tokens=9)
    assert m.get_blocks(7) == [1, 2, 3]
    assert m.get_num_blocks_to_allocate(7, 12) == 0
    assert m.get_num_blocks_to_allocate(7, 13) == 1
    assert m.remove_skipped_blocks(7, 100) == []  # full attention never skips


def test_sliding_prefill_layout_pads_with_null_block():
    # W=5, block 4, prompt 13: first needed token 13-5 = 8 -> block 2; ceil(13/4) = 4 logical blocks,
    # storage for blocks 2 and 3 only.
    m = SlidingWindowManager("SlidingWindow", block_num=10, block_size=4, sliding_window=5)
    assert m.logical_block_layout(13) == (4, 2, 2)
    assert m.get_num_blocks_to_allocate(1, 13) == 2
    m.allocate_new_blocks(1, 2, num_tokens=13)
    assert m.get_blocks(1) == [0, 0, 1, 2]
    assert m.owned_blocks(1) == [1, 2]


def test_sliding_decode_recycles_slid_out_blocks():
    # W=5, block 4, prompt 8: first needed token 3 -> block 0: both blocks real.
    m = SlidingWindowManager("SlidingWindow", block_num=10, block_size=4, sliding_window=5)
    m.allocate_new_blocks(1, m.get_num_blocks_to_allocate(1, 8), num_tokens=8)
    assert m.get_blocks(1) == [1, 2]
    # computed 8: skipped = 8 - 5 + 1 = 4 tokens -> block 0 slides out.
    assert m.get_num_skipped_tokens(8) == 4
    assert m.plan_skipped_blocks(1, 8) == [0]
    assert m.remove_skipped_blocks(1, 8) == [1]
    assert m.get_blocks(1) == [0, 2]
    assert m.block_pool.free_block_ids()[-1] == 1
    # Nothing more until 4 more tokens slide out (computed 12 -> skipped 8 -> 2 blocks).
    assert m.remove_skipped_blocks(1, 11) == []
    m.allocate_new_blocks(1, m.get_num_blocks_to_allocate(1, 12), num_tokens=12)
    assert m.remove_skipped_blocks(1, 12) == [2]
    assert m.get_blocks(1)[:2] == [0, 0]


def test_window_keys_alternative_keeps_one_more_key():
    assert window_keys(5) == 5 and window_keys(5, 1) == 6
    framework = SlidingWindowManager("SlidingWindow", 10, 4, sliding_window=5)
    wide = SlidingWindowManager("SlidingWindow", 10, 4, sliding_window=5, extra_window_keys=1)
    assert framework.get_num_skipped_tokens(8) == 4
    assert wide.get_num_skipped_tokens(8) == 3  # one more key kept -> block 0 still needed
    # Prompt 13: framework first needed token 8 (block 2), wide 7 (block 1).
    assert framework.logical_block_layout(13)[1] == 2
    assert wide.logical_block_layout(13)[1] == 1
    with pytest.raises(ValueError):
        window_keys(0)


def test_sliding_validate_kwargs():
    g = get_generation("G2")
    e = g.CacheEntry("k", "SlidingWindow", 4, 1, torch.float32, True, block_size=4, sliding_window=3)
    assert SlidingWindowManager.validate_and_build_kwargs([e]) == {"sliding_window": 3}
    no_window = g.CacheEntry("v", "SlidingWindow", 4, 1, torch.float32, True, block_size=4)
    other_window = g.CacheEntry("v", "SlidingWindow", 4, 1, torch.float32, True, block_size=4, sliding_window=5)
    with pytest.raises(ValueError, match="must define sliding_window"):
        SlidingWindowManager.validate_and_build_kwargs([e, no_window])
    with pytest.raises(ValueError, match="same sliding_window"):
        SlidingWindowManager.validate_and_build_kwargs([e, other_window])


# ---------------------------------------------------------------------- KVCacheManager


def _mixed_manager(full_blocks=6, sliding_blocks=4, **kw):
    g = get_generation("G2")

    def entries(attn, bs, window=None):
        return [g.CacheEntry(n, attn, 4, 1, torch.float32, True, block_size=bs, sliding_window=window)
                for n in ("k_cache", "v_cache")]

    info = g.ModelCacheInfo(2, [g.LayerCacheInfo(0, entries("FullAttention", 4)),
                                g.LayerCacheInfo(1, entries("SlidingWindow", 2, window=3))])
    return KVCacheManager.from_cache_info(
        info, {"FullAttention": full_blocks, "SlidingWindow": sliding_blocks}, max_model_len=64, **kw)


def _state(manager):
    return [(m.manager_key, copy.deepcopy(m.req_to_blocks), m.block_pool.free_block_ids())
            for m in manager.single_type_managers]


def test_allocate_slots_failure_leaves_state_unchanged():
    kv = _mixed_manager(full_blocks=6, sliding_blocks=8)
    # Prompt 8: full needs ceil(8/4) = 2 of 5 blocks; sliding W=3, block 2: first needed
    # token 8-3 = 5 -> logical block 2, so blocks 2 and 3 get storage.
    assert kv.allocate_slots(1, 0, 8)
    assert kv.get_block_ids(1) == {"FullAttention": [1, 2], "SlidingWindow": [0, 0, 1, 2]}
    # A prompt of 13 tokens needs 4 full blocks, only 3 are free -> refused, nothing changes.
    before = _state(kv)
    assert not kv.allocate_slots(2, 0, 13)
    assert _state(kv) == before
    # Grow request 1 until the full pool is empty, then one more growth must fail cleanly.
    computed = 8
    while kv.allocate_slots(1, computed, 4):
        computed += 4
    assert kv.usage()["FullAttention"]["free"] == 0
    before = _state(kv)
    assert not kv.allocate_slots(1, computed, 4)
    assert _state(kv) == before
    assert all(not r.problems for r in check_pool_invariants(kv))


def test_recycle_on_failure_reproduces_framework_order():
    kv = _mixed_manager(full_blocks=3, sliding_blocks=6, recycle_skipped_on_failure=True)
    assert kv.allocate_slots(1, 0, 8)  # full [1,2] (pool now empty), sliding [0,0,1,2]
    assert kv.get_block_ids(1)["SlidingWindow"] == [0, 0, 1, 2]
    # Decode at computed 8 needs a 3rd full block (none free). The framework releases the
    # slid-out sliding blocks during the check: skipped 8 - 3 + 1 = 6 -> logical block 2.
    # Sliding is the second group, so the full group fails first and nothing is recycled.
    assert not kv.allocate_slots(1, 8, 1)
    assert kv.get_block_ids(1)["SlidingWindow"] == [0, 0, 1, 2]


def test_recycle_on_failure_when_sliding_checked_first():
    g = get_generation("G2")
    sl = [g.CacheEntry(n, "SlidingWindow", 4, 1, torch.float32, True, block_size=2, sliding_window=3)
          for n in ("k_cache", "v_cache")]
    fu = [g.CacheEntry(n, "FullAttention", 4, 1, torch.float32, True, block_size=4) for n in ("k_cache", "v_cache")]
    info = g.ModelCacheInfo(2, [g.LayerCacheInfo(0, sl), g.LayerCacheInfo(1, fu)])
    blocks = {"SlidingWindow": 6, "FullAttention": 3}
    for recycle, expected in ((True, [0, 0, 0, 2]), (False, [0, 0, 1, 2])):
        kv = KVCacheManager.from_cache_info(info, blocks, 64, recycle_skipped_on_failure=recycle)
        assert kv.allocate_slots(1, 0, 8)
        assert not kv.allocate_slots(1, 8, 1)  # full pool exhausted
        assert kv.get_block_ids(1)["SlidingWindow"] == expected


def test_usage_and_free_return_everything():
    kv = _mixed_manager(sliding_blocks=8)
    assert kv.allocate_slots(1, 0, 7)
    assert kv.allocate_slots(2, 0, 3)
    usage = kv.usage()
    assert usage["FullAttention"] == {"total": 6, "used": 3, "free": 2, "null": 1}
    # Framework log format counts the null block as used: (6 - 2) / 6 and (8 - 3) / 8.
    assert kv.format_usage() == "FullAttention:4/6,SlidingWindow:5/8"
    kv.free(1)
    kv.free(2)
    kv.free(2)  # freeing an unknown/finished request is a no-op
    assert kv.usage()["FullAttention"]["free"] == 5 and kv.usage()["SlidingWindow"]["free"] == 7
    assert kv.get_block_table_max_lens(64) == {"FullAttention": 16, "SlidingWindow": 32}


def test_max_model_len_clamps_the_allocation():
    kv = _mixed_manager(full_blocks=20)
    assert kv.allocate_slots(1, 0, 200)  # clamped to 64 tokens -> 16 full blocks
    assert len(kv.get_block_ids(1)["FullAttention"]) == 16
