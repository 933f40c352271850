"""The two open device readings (references/device_questions.md) change results exactly as documented."""

from __future__ import annotations

import math

import pytest
import torch
from model_infer_kvcache.validators.npu_ops import (
    DEFAULT_READINGS,
    DeviceReadings,
    active_readings,
    device_readings,
    emulated,
)
from test_npu_ops_reference import (  # tests/ is on sys.path (not a package)
    MASK_2048,
    build_paged,
    make_case,
    ref_attention,
)

EXCLUSIVE_HONOURED = DeviceReadings()
INCLUSIVE = DeviceReadings(window_pre_tokens="inclusive")
IGNORED = DeviceReadings(band_at_single_query="ignored")


def uniform_window(q_len: int, kv_len: int, pre: int, nxt: int = 0, version: int = 2) -> torch.Tensor:
    """TND call with zero queries (uniform weights) and value[j] = j: each output is the mean
    of the visible key positions, so the visible set can be read off exactly."""
    q = torch.zeros(q_len, 1, 16)
    k = torch.randn(kv_len, 1, 16)
    v = torch.arange(kv_len, dtype=torch.float32).view(kv_len, 1, 1).expand(kv_len, 1, 16).contiguous()
    kw = dict(atten_mask=MASK_2048, pre_tokens=pre, next_tokens=nxt, input_layout="TND", sparse_mode=4)
    if version == 1:
        out, _ = emulated.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths=[q_len],
                                                          actual_seq_lengths_kv=[kv_len], num_heads=1, **kw)
    else:
        out, _ = emulated.npu_fused_infer_attention_score_v2(q, k, v, actual_seq_qlen=[q_len],
                                                             actual_seq_kvlen=[kv_len], num_query_heads=1, **kw)
    return out[:, 0, 0]


def test_defaults_are_the_documented_readings():
    assert active_readings() == DEFAULT_READINGS == EXCLUSIVE_HONOURED
    assert EXCLUSIVE_HONOURED.band_at_single_query == "honoured"
    assert EXCLUSIVE_HONOURED.window_pre_tokens == "exclusive"
    assert EXCLUSIVE_HONOURED.repeated_slots == "last_wins"
    assert EXCLUSIVE_HONOURED.finalize_skip1_alone == "added"  # what upstream DeepSeek relies on
    assert EXCLUSIVE_HONOURED.mla_decode_sparse_mode3 == "same_as_mode0"  # what upstream Kimi-K2 relies on
    assert EXCLUSIVE_HONOURED.gdr_state_writes == "every_token"  # the doc's per-token slots, vLLM's kernel
    assert EXCLUSIVE_HONOURED.gdr_accepted_start == "accepted_slot"  # vLLM's kernel
    assert EXCLUSIVE_HONOURED.gdr_head_grouping == "consecutive"  # transformers, FLA, upstream qwen3_5
    assert EXCLUSIVE_HONOURED.value_head_dim == "documented_pairs"  # the op docs' TND pairs (MiMo-V2-Flash)
    combos = DeviceReadings.all()
    assert combos[0] == DEFAULT_READINGS and len(set(combos)) == 2 * 2 * 3 * 3 * 3 * 2 * 2 * 2 * 2


def test_invalid_reading_rejected_and_context_restores():
    with pytest.raises(ValueError):
        DeviceReadings(window_pre_tokens="W")
    with pytest.raises(RuntimeError):
        with device_readings(IGNORED):
            assert active_readings() is IGNORED
            raise RuntimeError("boom")
    assert active_readings() == DEFAULT_READINGS


@pytest.mark.parametrize("version", [1, 2])
def test_window_pre_tokens_exclusive_admits_w_plus_one_keys(version):
    # decode at position 9 with W=3: exclusive sees keys 6..9 (4 keys), inclusive 7..9 (3 keys)
    with device_readings(EXCLUSIVE_HONOURED):
        assert uniform_window(1, 10, 3, version=version).tolist() == [7.5]
    with device_readings(INCLUSIVE):
        assert uniform_window(1, 10, 3, version=version).tolist() == [8.0]


def test_window_pre_tokens_on_prefill_rows_and_with_next_tokens():
    with device_readings(EXCLUSIVE_HONOURED):
        # rows at positions 6..9 (right-down origin) each see [i'-3, i'+1] clipped to the 10 keys
        assert uniform_window(4, 10, 3, nxt=1).tolist() == [5.0, 6.0, 7.0, 7.5]
    with device_readings(INCLUSIVE):  # [i'-2, i'+1]
        assert uniform_window(4, 10, 3, nxt=1).tolist() == [5.5, 6.5, 7.5, 8.0]


def test_window_reading_applies_to_mode0_mask_band_left_up():
    q = torch.zeros(1, 4, 1, 16)
    k = torch.randn(1, 4, 1, 16)
    v = torch.arange(4, dtype=torch.float32).view(1, 4, 1, 1).expand(1, 4, 1, 16).contiguous()
    mask = torch.zeros(4, 4, dtype=torch.bool)

    def run():
        out, _ = emulated.npu_fused_infer_attention_score(q, k, v, atten_mask=mask, pre_tokens=1, next_tokens=0,
                                                          num_heads=1, input_layout="BSND", sparse_mode=0)
        return out[0, :, 0, 0].tolist()

    with device_readings(EXCLUSIVE_HONOURED):
        assert run() == [0.0, 0.5, 1.5, 2.5]  # row i sees i-1..i
    with device_readings(INCLUSIVE):
        assert run() == [0.0, 1.0, 2.0, 3.0]  # row i sees only itself


def test_band_at_single_query_honoured_vs_ignored():
    with device_readings(EXCLUSIVE_HONOURED):
        assert uniform_window(1, 10, 3).tolist() == [7.5]
    with device_readings(IGNORED):
        assert uniform_window(1, 10, 3).tolist() == [4.5]  # every key 0..9
        # a longer query keeps its band under either reading
        assert uniform_window(4, 10, 3, nxt=1).tolist() == [5.0, 6.0, 7.0, 7.5]


def test_band_ignored_reads_the_slid_out_null_block():
    # gpt-oss style sliding decode: out-of-window blocks point at the null block.
    case = make_case([1, 1], [100, 60], 4, 2, 32, seed=21)
    kw = dict(actual_seq_qlen=[1, 2], actual_seq_kvlen=case.kv_lens, num_query_heads=4, num_key_value_heads=2,
              softmax_scale=0.2, input_layout="TND", sparse_mode=4, atten_mask=MASK_2048, pre_tokens=40,
              next_tokens=0, block_size=16)
    q = torch.cat(case.q)

    poisoned = build_paged(case, 16, "3d", null_columns={0: {0, 1, 2}, 1: {0}})
    with device_readings(EXCLUSIVE_HONOURED):
        out, _ = emulated.npu_fused_infer_attention_score_v2(q, poisoned.k, poisoned.v,
                                                             block_table=poisoned.table, **kw)
    assert torch.isfinite(out).all()
    for b in range(2):
        ref, _ = ref_attention(case.q[b], case.k[b], case.v[b], scale=0.2, mode=4, pre=40, nxt=0)
        assert (out[b].double() - ref[0]).abs().max() <= 1e-5
    with device_readings(IGNORED):
        out, _ = emulated.npu_fused_infer_attention_score_v2(q, poisoned.k, poisoned.v,
                                                             block_table=poisoned.table, **kw)
    assert torch.isnan(out).all()  # the null block's contents reached every output

    # With finite null-block contents the ignored reading equals attention over all kv_len keys,
    # the null block's values standing in for the slid-out tokens.
    filler = 0.5
    cache = build_paged(case, 16, "3d", null_columns={0: {0, 1, 2}, 1: {0}}, poison=filler)
    with device_readings(IGNORED):
        out, _ = emulated.npu_fused_infer_attention_score_v2(q, cache.k, cache.v, block_table=cache.table, **kw)
    for b, nulls in ((0, 3), (1, 1)):
        k_seen, v_seen = case.k[b].clone(), case.v[b].clone()
        k_seen[:nulls * 16] = filler
        v_seen[:nulls * 16] = filler
        ref, _ = ref_attention(case.q[b], k_seen, v_seen, scale=0.2, mode=0)
        assert (out[b].double() - ref[0]).abs().max() <= 1e-5


def test_band_ignored_is_per_request_in_packed_layouts():
    # request 0 decodes (q 1), request 1 prefills (q 3) in the same TND call.
    q = torch.zeros(4, 1, 16)
    k = torch.randn(16, 1, 16)
    v = torch.cat([torch.arange(8.0), torch.arange(8.0)]).view(16, 1, 1).expand(16, 1, 16).contiguous()
    with device_readings(IGNORED):
        out, _ = emulated.npu_fused_infer_attention_score(
            q, k, v, atten_mask=MASK_2048, actual_seq_lengths=[1, 4], actual_seq_lengths_kv=[8, 16], num_heads=1,
            input_layout="TND", sparse_mode=4, pre_tokens=2, next_tokens=0)
    assert out[:, 0, 0].tolist() == [3.5, 4.0, 5.0, 6.0]


def test_band_ignored_uses_query_s_axis_for_batch_layouts():
    q = torch.zeros(2, 1, 1, 16)  # BSND with Q_S = 1
    k = torch.randn(2, 6, 1, 16)
    v = torch.arange(6.0).view(1, 6, 1, 1).expand(2, 6, 1, 16).contiguous()
    kw = dict(atten_mask=MASK_2048, num_heads=1, input_layout="BSND", sparse_mode=4, pre_tokens=1, next_tokens=0,
              actual_seq_lengths_kv=[6, 4])
    with device_readings(EXCLUSIVE_HONOURED):
        honoured, _ = emulated.npu_fused_infer_attention_score(q, k, v, **kw)
    with device_readings(IGNORED):
        ignored, _ = emulated.npu_fused_infer_attention_score(q, k, v, **kw)
    assert honoured[:, 0, 0, 0].tolist() == [4.5, 2.5]
    assert ignored[:, 0, 0, 0].tolist() == [2.5, 1.5]
    assert not math.isclose(float(honoured.sum()), float(ignored.sum()))


def test_the_questions_table_lists_every_question_with_its_readings_default_first():
    """references/device_questions.md's table is the reader's view of analyzer.device_questions."""
    import re
    from pathlib import Path

    from model_infer_kvcache.analyzer.device_questions import QUESTIONS

    doc = (Path(__file__).resolve().parent.parent / "references" / "device_questions.md").read_text("utf-8")
    rows = {m.group(1): [r.strip().strip("`") for r in m.group(2).split("/")]
            for m in re.finditer(r"^\| `([a-z0-9_]+)` \| ([^|]+) \|", doc, re.M)}
    for name, question in QUESTIONS.items():
        assert name in rows, f"{name} has no row in device_questions.md"
        readings = [r.split("(")[0].strip().strip("`") for r in rows[name]]
        assert readings[0] == question.default, (name, readings)
        assert set(readings) <= set(question.readings), (name, readings)
