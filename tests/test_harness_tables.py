"""Block tables and slot mappings: G0/G1 (keys = attn_type, model block size) and G2
(keys = manager_key or attn_type, per-entry block sizes). Expected values derived by hand."""

import inspect

import pytest
import torch
from model_infer_kvcache.validators.harness import (
    Scheduler,
    get_generation,
    install_framework,
    slot_mapping_for,
)


def _entries(gen, attn, *, window=None, **g2):
    return [gen.CacheEntry(cache_name=n, attn_type=attn, dim=4, num_head=1, dtype=torch.float32, needs_block=True,
                           tensor_setter=lambda t: None, sliding_window=window, **g2)
            for n in ("k_cache", "v_cache")]


def _g01_info(name):
    g = get_generation(name)
    layers = [g.LayerCacheInfo(0, _entries(g, "FullAttention")),
              g.LayerCacheInfo(1, _entries(g, "SlidingWindow", window=2))]
    return g.ModelCacheInfo(2, 4, layers)


def _rows(table):
    return table.tolist()


@pytest.mark.parametrize("gen", ["G0", "G1"])
def test_g0_g1_tables_keyed_by_attn_type(gen):
    sched = Scheduler(_g01_info(gen), max_model_len=16, max_concurrency=2, generation=gen)
    a = sched.add_request(list(range(9)), max_new_tokens=4)
    b = sched.add_request([5, 6], max_new_tokens=4)
    step = sched.next_step()
    fm = step.forward_metadata
    assert step.is_prefill and step.request_ids == [a, b]
    assert set(fm.block_table) == {"FullAttention", "SlidingWindow"}
    # Block size 4, width ceil(16/4) = 4 for both groups.
    # Full: request a (9 tokens) -> 3 blocks [1,2,3]; b -> [4].
    assert _rows(fm.block_table["FullAttention"]) == [[1, 2, 3, 0], [4, 0, 0, 0]]
    # Sliding W=2: a's first needed token 9-2 = 7 -> logical block 1; 3 logical blocks -> [null,1,2].
    assert _rows(fm.block_table["SlidingWindow"]) == [[0, 1, 2, 0], [3, 0, 0, 0]]
    assert fm.block_table["FullAttention"].dtype == torch.int32
    # Slots = table[pos // 4] * 4 + pos % 4 over packed positions [0..8, 0..1].
    assert fm.slot_mapping["FullAttention"].tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 12, 16, 17]
    # Sliding: positions 0..3 map into the null block (0..3), 4..7 -> block 1, 8 -> block 2.
    assert fm.slot_mapping["SlidingWindow"].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 13]
    assert fm.actual_seq_lengths_q.tolist() == [9, 2] and fm.actual_seq_lengths_cu_q.tolist() == [9, 11]
    assert fm.actual_seq_lengths_kv.tolist() == [9, 2] and fm.actual_seq_lengths_cu_kv.tolist() == [9, 11]
    assert fm.prompt_tokens == 11
    sched.complete_step(step, [1, 2])

    step = sched.next_step()
    fm = step.forward_metadata
    assert not step.is_prefill
    # Decode writes position 9 for a and 2 for b; kv lengths 10 and 3 (first decode reads L + 1).
    assert step.position_ids.tolist() == [9, 2] and fm.kv_len.tolist() == [9, 2]
    assert fm.actual_seq_lengths_kv.tolist() == [10, 3] and fm.actual_seq_lengths_cu_q.tolist() == [1, 2]
    # Sliding a: computed 9 -> skipped 9 - 2 + 1 = 8 tokens -> logical block 1 returned (block 0 was null).
    assert _rows(fm.block_table["SlidingWindow"]) == [[0, 0, 2, 0], [3, 0, 0, 0]]
    assert fm.slot_mapping["FullAttention"].tolist() == [3 * 4 + 1, 4 * 4 + 2]
    assert fm.slot_mapping["SlidingWindow"].tolist() == [2 * 4 + 1, 3 * 4 + 2]


def _g2_info():
    g = get_generation("G2")
    layers = [
        g.LayerCacheInfo(0, _entries(g, "FullAttention", block_size=4)),
        g.LayerCacheInfo(1, _entries(g, "FullAttention", block_size=8, manager_key="latent")),
        g.LayerCacheInfo(2, _entries(g, "SlidingWindow", window=3, block_size=2)),
    ]
    return g.ModelCacheInfo(3, layers)


def test_g2_tables_per_group_key_and_block_size():
    sched = Scheduler(_g2_info(), max_model_len=16, max_concurrency=2, generation="G2")
    sched.add_request(list(range(9)), max_new_tokens=3)
    sched.add_request([5, 6], max_new_tokens=3)
    fm = sched.next_step().forward_metadata
    assert set(fm.block_table) == {"FullAttention", "latent", "SlidingWindow"}
    # Widths: ceil(16/4) = 4, ceil(16/8) = 2, ceil(16/2) = 8.
    assert _rows(fm.block_table["FullAttention"]) == [[1, 2, 3, 0], [4, 0, 0, 0]]
    assert _rows(fm.block_table["latent"]) == [[1, 2], [3, 0]]
    # Sliding W=3, block 2: first needed token 6 -> logical block 3 of 5.
    assert _rows(fm.block_table["SlidingWindow"]) == [[0, 0, 0, 1, 2, 0, 0, 0], [3, 0, 0, 0, 0, 0, 0, 0]]
    assert fm.slot_mapping["FullAttention"].tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 12, 16, 17]
    # Block 8: positions 0..7 -> block 1 (8..15), 8 -> block 2 (16); b -> block 3 (24, 25).
    assert fm.slot_mapping["latent"].tolist() == [8, 9, 10, 11, 12, 13, 14, 15, 16, 24, 25]
    # Block 2: positions 0..5 sit in null logical blocks (slots 0/1), 6,7 -> block 1, 8 -> block 2.
    assert fm.slot_mapping["SlidingWindow"].tolist() == [0, 1, 0, 1, 0, 1, 2, 3, 4, 6, 7]


def test_slot_mapping_rejects_positions_beyond_table():
    table = torch.tensor([[1, 2]], dtype=torch.int32)
    assert slot_mapping_for(torch.tensor([0, 7]), torch.tensor([2]), table, 4).tolist() == [4, 11]
    with pytest.raises(ValueError, match="out of range"):
        slot_mapping_for(torch.tensor([8]), torch.tensor([1]), table, 4)
    with pytest.raises(ValueError, match="cumulative"):
        slot_mapping_for(torch.tensor([0, 1, 2]), torch.tensor([2]), table, 4)


def test_installed_signatures_follow_each_generation():
    with install_framework("G1") as handle:
        from executor.core.kv_cache import prepare_block_tables, prepare_slot_mapping

        assert list(inspect.signature(prepare_slot_mapping).parameters) == [
            "position_ids", "actual_seq_lengths_cu_q", "block_tables", "block_size"]
        assert "max_block_num" in inspect.signature(prepare_block_tables).parameters
        assert handle.generation == "G1"
    with install_framework("G2"):
        from executor.core.kv_cache.cache_utils import prepare_slot_mapping

        assert list(inspect.signature(prepare_slot_mapping).parameters) == [
            "position_ids", "actual_seq_lengths_cu_q", "kv_cache_manager", "block_tables"]


def test_decode_padding_rows_point_at_the_null_block():
    sched = Scheduler(_g2_info(), max_model_len=16, max_concurrency=4, pad_decode_to=3)
    sched.add_request([1, 2, 3], max_new_tokens=3)
    sched.complete_step(sched.next_step(), [4])
    step = sched.next_step()
    fm = step.forward_metadata
    assert step.padded_rows == 2 and step.input_ids.tolist() == [4, 0, 0]
    assert fm.kv_len.tolist() == [3, 0, 0] and fm.actual_seq_lengths_kv.tolist() == [4, 1, 1]
    # Padding rows are zero rows: they write slot 0, i.e. into the null block.
    assert fm.block_table["FullAttention"][1:].eq(0).all()
    assert fm.slot_mapping["FullAttention"].tolist() == [1 * 4 + 3, 0, 0]
