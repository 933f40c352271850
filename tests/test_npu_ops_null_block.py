"""Padded decode rows and the null block: repeats are legal only inside the declared null block,
which is poisoned (NaN) after every write into it (issue 15 point 4)."""

from __future__ import annotations

import pytest
import torch
from model_infer_kvcache.validators.npu_ops import DeviceReadings, NpuOpError, device_readings, emulated
from model_infer_kvcache.validators.npu_ops.null_block import NULL_BLOCK_ID, declared, paged_caches
from model_infer_kvcache.validators.npu_ops.readings import _ALLOWED

BN, BS, N, D = 4, 4, 2, 8


def cache():
    return torch.zeros(BN, BS, N, D)


def write(kv_cache, slots):
    """The qwen/gpt-oss path: a flat [slots, N, D] view and one [slot] index row per token."""
    rows = torch.arange(1, len(slots) + 1, dtype=torch.float32).view(-1, 1, 1).expand(-1, N, D).contiguous()
    idx = torch.tensor(slots, dtype=torch.int64).view(-1, 1)
    emulated.npu_scatter_nd_update_(kv_cache.view(-1, N, D), idx, rows)
    return rows


def test_framework_null_block_is_block_zero_of_the_block_pool():
    from shared_dirs import upstream_head

    source = (upstream_head() / "executor" / "core" / "kv_cache" / "block_pool.py").read_text("utf-8")
    # The first id popped from deque(range(num_blocks)) becomes the null block: block 0.
    assert "deque(range(num_blocks))" in source and "self._null_block = self._free_block_queue.popleft()" in source
    assert NULL_BLOCK_ID == 0


def test_the_rule_is_recorded_with_the_device_readings():
    import dataclasses

    rules = DeviceReadings.fixed_rules()
    assert rules == {"null_block_id": NULL_BLOCK_ID, "null_block_after_write": "poisoned",
                     "repeats_outside_null_block": "error"}
    # recorded, not swept: the switches (and the probe questions they mirror) are unchanged
    assert "null_block_id" not in {f.name for f in dataclasses.fields(DeviceReadings)}


def test_padded_rows_repeat_slot_zero_and_poison_the_null_block():
    kv = cache()
    with paged_caches([kv]):
        rows = write(kv, [0, 0, 0, BS + 1])  # three padded rows + one live token in block 1
    assert torch.isnan(kv[NULL_BLOCK_ID]).all()
    assert torch.equal(kv[1, 1], rows[3])
    untouched = torch.ones(BN, BS, dtype=torch.bool)
    untouched[0] = False
    untouched[1, 1] = False
    assert (kv[untouched] == 0).all()


def test_a_single_write_into_the_null_block_also_poisons_it():
    kv = cache()
    with paged_caches([kv]):
        write(kv, [2, 5])  # a sliding-window prefill token sent to null-block offset 2
    assert torch.isnan(kv[0]).all() and not torch.isnan(kv[1:]).any()


@pytest.mark.parametrize("reading", _ALLOWED["repeated_slots"])
def test_repeats_outside_the_declared_null_block_race_under_every_reading(reading):
    kv = cache()
    with device_readings(DeviceReadings(repeated_slots=reading)), paged_caches([kv]):
        with pytest.raises(NpuOpError, match="outside the null block") as info:
            write(kv, [0, BS + 2, BS + 2])
    assert info.value.argument == "indices"
    assert (kv == 0).all()  # refused before anything is written


def test_repeated_slots_error_refuses_even_padding():
    kv = cache()
    with device_readings(DeviceReadings(repeated_slots="error")), paged_caches([kv]):
        with pytest.raises(NpuOpError, match="repeated_slots='error'"):
            write(kv, [0, 0])
        write(kv, [0, 5])  # a single padded row is no repeat


@pytest.mark.parametrize("reading, row", [("last_wins", 2), ("first_wins", 0)])
def test_unpoisoned_declaration_keeps_the_reading_visible(reading, row):
    kv = cache()
    with device_readings(DeviceReadings(repeated_slots=reading)), paged_caches([kv], poison=False):
        rows = write(kv, [0, 0, 0])
    assert torch.equal(kv[0, 0], rows[row])


def test_the_declared_null_block_is_a_parameter_not_a_guess():
    kv = cache()
    with paged_caches([kv], null_block=2):
        write(kv, [2 * BS, 2 * BS, 1])  # repeats in block 2 are padding for this pool
        assert torch.isnan(kv[2]).all()
        with pytest.raises(NpuOpError, match="outside the null block"):
            write(kv, [0, 0])  # block 0 is a live block of this pool
    assert not declared(kv)


def test_undeclared_flat_caches_keep_the_operator_rule():
    kv = cache()
    rows = write(kv, [5, 5])  # no block size visible: the repeat follows the reading (last wins)
    assert torch.equal(kv[1, 1], rows[1]) and not torch.isnan(kv).any()


def test_mla_writer_poisons_a_declared_null_block():
    bs, dv, dk = 16, 32, 16
    k_cache, ckv_cache = torch.zeros(3, bs, 1, dk), torch.zeros(3, bs, 1, dv)
    kv = torch.randn(3, 1, 1, dv + dk)
    cos, sin = torch.ones(3, 1, 1, dk), torch.zeros(3, 1, 1, dk)
    with paged_caches([k_cache, ckv_cache]):
        emulated.npu_kv_rmsnorm_rope_cache_v2(kv, torch.ones(dv), cos, sin, torch.tensor([0, 0, bs + 3]),
                                              k_cache, ckv_cache, cache_mode="PA")
        with pytest.raises(NpuOpError, match="outside the null block"):
            emulated.npu_kv_rmsnorm_rope_cache_v2(kv, torch.ones(dv), cos, sin, torch.tensor([bs, bs, 1]),
                                                  k_cache, ckv_cache, cache_mode="PA")
    assert torch.isnan(k_cache[0]).all() and torch.isnan(ckv_cache[0]).all()
    assert not torch.isnan(k_cache[1:]).any() and not torch.isnan(ckv_cache[1:]).any()
    assert ckv_cache[1, 3].abs().sum() > 0  # the live token landed in block 1, offset 3


def test_declaration_checks_its_arguments():
    with pytest.raises(ValueError, match="outside"):
        with paged_caches([cache()], null_block=BN):
            pass
    with pytest.raises(ValueError, match="block_num, block_size"):
        with paged_caches([torch.zeros(5)]):
            pass
