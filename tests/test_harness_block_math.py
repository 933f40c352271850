"""Block-count worked examples (offline and budget, with and without sliding groups).

Every expected number is derived by hand in the comments.
"""

import types

import pytest
import torch
from model_infer_kvcache.analyzer.kv_cache_spec import sliding_blocks_per_request
from model_infer_kvcache.validators.harness import (
    calculate_block_num,
    get_generation,
    kv_cache_bytes,
    set_emulated_mem_info,
)
from model_infer_kvcache.validators.harness.cache_utils import framework_calculate_block_num

MiB = 1024 * 1024


def _kv_entries(gen, attn_type, *, dim=128, heads=2, dtype=torch.bfloat16, window=None, **g2):
    return [
        gen.CacheEntry(cache_name=name, attn_type=attn_type, dim=dim, num_head=heads, dtype=dtype,
                       needs_block=True, tensor_setter=lambda t: None, sliding_window=window, **g2)
        for name in ("k_cache", "v_cache")
    ]


def _g1_info(layer_types, window=128, block_size=128):
    g = get_generation("G1")
    layers = [
        g.LayerCacheInfo(i, _kv_entries(g, t, window=window if t == "SlidingWindow" else None))
        for i, t in enumerate(layer_types)
    ]
    return g.ModelCacheInfo(len(layers), block_size, layers)


def test_offline_full_only():
    # ceil(1000 / 128) = 8 blocks per request; 8 * 4 requests + 1 null block = 33.
    info = _g1_info(["FullAttention", "FullAttention"])
    assert calculate_block_num(info, max_concurrency=4, offline_max_len=1000) == {"FullAttention": 33}


def test_offline_with_sliding_group():
    # Sliding W=128, block 128: ceil(128/128) + 1 = 2 blocks per request; 2 * 4 + 1 = 9.
    # With next_n=1 (MTP): ceil((128 + 2) / 128) + 1 = 3; 3 * 4 + 1 = 13. Full stays 33.
    info = _g1_info(["SlidingWindow", "FullAttention"])
    assert calculate_block_num(info, max_concurrency=4, offline_max_len=1000) == {
        "SlidingWindow": 9, "FullAttention": 33}
    assert calculate_block_num(info, max_concurrency=4, offline_max_len=1000, next_n=1) == {
        "SlidingWindow": 13, "FullAttention": 33}
    # W=100 < block 128: still ceil(100/128) + 1 = 2 -> 9.
    assert calculate_block_num(_g1_info(["SlidingWindow"], window=100), max_concurrency=4,
                               offline_max_len=1000) == {"SlidingWindow": 9}


def test_the_scheduler_reserves_the_speculative_tokens_the_engine_runs_at():
    """The validation's pools are sized at the manifest's next_n, as the engine's calculate_block_num reads
    model_config.next_n: the sliding group of a model served with MTP keeps 2 * next_n more tokens per request."""
    from model_infer_kvcache.validators.harness import Scheduler

    info = _g1_info(["SlidingWindow", "FullAttention"])
    plain = Scheduler(info, max_model_len=1000, max_concurrency=4, generation="G1", allocate_tensors=False)
    mtp = Scheduler(info, max_model_len=1000, max_concurrency=4, generation="G1", allocate_tensors=False, next_n=1)
    assert plain.block_num_by_key["SlidingWindow"] == 9 and mtp.block_num_by_key["SlidingWindow"] == 13
    assert plain.block_num_by_key["FullAttention"] == mtp.block_num_by_key["FullAttention"] == 33


def test_fixed_blocks_per_request_formula():
    assert sliding_blocks_per_request(128, 128) == 2
    assert sliding_blocks_per_request(129, 128) == 3  # 129 tokens span 2 blocks, +1 boundary
    assert sliding_blocks_per_request(4096, 128, next_n=2) == 34  # ceil(4100/128)=33, +1


def test_budget_full_only():
    # Per token: 2 layers x 2 caches x 128 dim x 2 heads x 2 bytes = 2048 B.
    # Budget 10 MiB x 0.9 = 9_437_184 B -> 4608 tokens -> 4608 // 128 = 36 blocks (null included).
    info = _g1_info(["FullAttention", "FullAttention"])
    got = calculate_block_num(info, max_concurrency=4, available_kv_memory=10 * MiB, kv_cache_mem_ratio=0.9)
    assert got == {"FullAttention": 36}


def test_budget_with_sliding_group_reserves_fixed_bytes_first():
    # Sliding group: 9 blocks (see offline test) x 128 tokens x 1024 B/token (one layer's k+v)
    #   = 1_179_648 B reserved first.
    # Paged per token: one full layer = 1024 B. (9_437_184 - 1_179_648) // 1024 = 8064 tokens
    #   -> 8064 // 128 = 63 blocks.
    info = _g1_info(["SlidingWindow", "FullAttention"])
    got = calculate_block_num(info, max_concurrency=4, available_kv_memory=10 * MiB, kv_cache_mem_ratio=0.9)
    assert got == {"SlidingWindow": 9, "FullAttention": 63}


def test_budget_exhausted_by_fixed_groups():
    info = _g1_info(["SlidingWindow", "FullAttention"])
    with pytest.raises(MemoryError):
        calculate_block_num(info, max_concurrency=4, available_kv_memory=1_000_000)


def _g2_two_block_sizes():
    g = get_generation("G2")
    layers = [
        # group FullAttention, block 128, 1024 B/token
        g.LayerCacheInfo(0, _kv_entries(g, "FullAttention", block_size=128)),
        # group "latent", block 64, 2 caches x 64 dim x 2 heads x 2 B = 512 B/token
        g.LayerCacheInfo(1, _kv_entries(g, "FullAttention", dim=64, block_size=64, manager_key="latent")),
    ]
    return g.ModelCacheInfo(2, layers)


def test_g2_offline_per_group_block_size():
    # FullAttention: ceil(1000/128) = 8 -> 8 * 2 + 1 = 17; latent: ceil(1000/64) = 16 -> 33.
    got = calculate_block_num(_g2_two_block_sizes(), max_concurrency=2, offline_max_len=1000)
    assert got == {"FullAttention": 17, "latent": 33}


def test_g2_budget_shares_tokens_across_groups():
    # Per token 1024 + 512 = 1536 B; 3 MiB / 1536 = 2048 tokens;
    # FullAttention 2048 // 128 = 16 blocks, latent 2048 // 64 = 32 blocks.
    info = _g2_two_block_sizes()
    got = calculate_block_num(info, max_concurrency=2, available_kv_memory=3 * MiB)
    assert got == {"FullAttention": 16, "latent": 32}
    # Memory actually used: 16*128*1024 + 32*64*512 = 2 MiB + 1 MiB.
    assert kv_cache_bytes(info, got) == 3 * MiB
    # One prefill must fit: min((16-1)*128, (32-1)*64) = 1920 tokens, minus one -> 1919.
    calculate_block_num(info, max_concurrency=2, available_kv_memory=3 * MiB, max_prefill_tokens=1919)
    with pytest.raises(MemoryError):
        calculate_block_num(info, max_concurrency=2, available_kv_memory=3 * MiB, max_prefill_tokens=1920)


def test_needs_block_false_growing_entries_count_like_the_framework():
    # The framework's budget loop iterates every entry of a growing group, needs_block or not
    # (executor/core/kv_cache/cache_utils.py at all four pinned commits): the scratch entry's
    # bytes shrink the token budget although it gets no blocks of its own.
    g = get_generation("G2")
    entries = _kv_entries(g, "FullAttention", block_size=128)
    info = g.ModelCacheInfo(1, [g.LayerCacheInfo(0, list(entries))])
    # k/v: 2 caches x 128 dim x 2 heads x 2 B = 1024 B/token; 1 MiB -> 1024 tokens -> 8 blocks.
    assert calculate_block_num(info, max_concurrency=1, available_kv_memory=MiB) == {"FullAttention": 8}
    entries.append(g.CacheEntry("scratch", "FullAttention", 4096, 8, torch.float32, False, block_size=128))
    info = g.ModelCacheInfo(1, [g.LayerCacheInfo(0, entries)])
    # + 4096 x 8 x 4 B = 131072 B/token: 64 MiB / 132096 B -> 508 tokens -> 3 blocks.
    assert calculate_block_num(info, max_concurrency=1, available_kv_memory=64 * MiB) == {"FullAttention": 3}


def test_framework_signature_wrapper():
    info = _g1_info(["SlidingWindow", "FullAttention"])
    cfg = types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(batch_size_per_dp_rank=4, mem_fraction_static=0.9,
                                               max_prefill_tokens=1024),
        model_config=types.SimpleNamespace(next_n=0),
    )
    assert framework_calculate_block_num(cfg, info, offline_max_len=1000) == {"SlidingWindow": 9, "FullAttention": 33}
    # total 10 MiB, nothing used: available = 10 MiB * 0.9 -> same as the budget example (63).
    set_emulated_mem_info(10 * MiB, 10 * MiB)
    try:
        assert framework_calculate_block_num(cfg, info) == {"SlidingWindow": 9, "FullAttention": 63}
        # 2 MiB already used: 10 MiB * 0.9 - 2 MiB - 1_179_648 = 6_160_384 B -> 6016 tokens -> 47 blocks.
        set_emulated_mem_info(8 * MiB, 10 * MiB)
        assert framework_calculate_block_num(cfg, info) == {"SlidingWindow": 9, "FullAttention": 47}
    finally:
        set_emulated_mem_info(None)
    with pytest.raises(RuntimeError, match="set_emulated_mem_info"):
        framework_calculate_block_num(cfg, info)
