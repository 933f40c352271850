"""`kvcache probe` on the emulated backend: it measures exactly the readings the emulator is set to.

The emulator's reading switches play the device: for every combination the probe must report
the configured reading of every switch question. Outputs that match no reading (a device that
behaves in a way nobody predicted) must come out as "unknown" with the evidence.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from model_infer_kvcache.analyzer.device_questions import QUESTIONS, UNKNOWN
from model_infer_kvcache.analyzer.operators.fa_facts import INT32_MAX
from model_infer_kvcache.validators.npu_ops import (
    DeviceReadings,
    NpuOpError,
    OpSet,
    device_readings,
    emulated,
)
from model_infer_kvcache.validators.npu_ops.readings import _ALLOWED
from model_infer_kvcache.validators.probe import experiments
from model_infer_kvcache.validators.probe.device import ProbeDevice, open_device
from model_infer_kvcache.validators.probe.run import markdown, probe, table_text


def test_question_registry_matches_the_emulator_switches():
    switches = {f.name for f in dataclasses.fields(DeviceReadings)}
    assert switches == {q for q, spec in QUESTIONS.items() if spec.switch}
    for name in switches:
        assert set(QUESTIONS[name].readings) == set(_ALLOWED[name]), name


def _each_reading() -> list[DeviceReadings]:
    """The defaults, each other reading of each switch alone (the experiments are independent), and every
    switch at its last reading at once: 2 + the alternatives, not the whole product."""
    alone = [DeviceReadings(**{q: r}) for q in _ALLOWED for r in QUESTIONS[q].alternatives(QUESTIONS[q].default)]
    return [DeviceReadings(), *alone, DeviceReadings(**{q: readings[-1] for q, readings in _ALLOWED.items()})]


@pytest.mark.slow
@pytest.mark.parametrize("configured", _each_reading(), ids=lambda r: r.label().replace(", ", "|"))
def test_probe_reports_every_configured_reading(configured):
    with device_readings(configured):
        data = probe(open_device("emulated", None))
    switches = {f.name: getattr(configured, f.name) for f in dataclasses.fields(DeviceReadings)}
    measured = {q: a.reading for q, a in data.questions.items()}
    assert {q: measured[q] for q in switches} == switches, {q: data.questions[q].evidence for q in switches}
    assert data.emulated_readings == switches
    # Not switches: fixed properties of the emulated device.
    assert measured["null_block_contents"] == "poisoned"  # never-written emulated memory is NaN
    assert list(data.questions) == list(QUESTIONS)


# --------------------------------------------------------------------------- unknown outputs
def _device_with(**replaced) -> ProbeDevice:
    ops = dict(emulated.OPS)
    ops.update(replaced)
    return ProbeDevice("emulated", OpSet("emulated", ops), torch.device("cpu"))


def test_a_window_no_reading_predicts_is_unknown_with_the_evidence():
    def wider_v2(*args, pre_tokens=INT32_MAX, **kw):  # a device that admits one key more than either reading
        return emulated.npu_fused_infer_attention_score_v2(*args, pre_tokens=pre_tokens + 1, **kw)

    data = probe(_device_with(npu_fused_infer_attention_score_v2=wider_v2))
    window = data.questions["window_pre_tokens"]
    assert window.reading == UNKNOWN
    rows = window.evidence["variants"]["v2 TND"]["visible_per_row"]
    assert rows[-1] == [4, 5, 6, 7]  # 4 keys visible: neither W+1 = 3 nor W = 2
    assert window.evidence["variants"]["v1 TND"]["visible_per_row"][-1] == [5, 6, 7]
    # the band question cannot be matched either: its v2 suffix has 4 keys
    assert data.questions["band_at_single_query"].reading == UNKNOWN
    assert "window_pre_tokens" in markdown(data) and "unknown" in table_text(data)


def test_variants_that_disagree_are_unknown():
    def ignoring_v1(*args, **kw):  # v1 ignores the band at q_len 1, v2 honours it
        kw["sparse_mode"], kw["atten_mask"] = 0, None
        return emulated.npu_fused_infer_attention_score(*args, **kw)

    data = probe(_device_with(npu_fused_infer_attention_score=ignoring_v1))
    band = data.questions["band_at_single_query"]
    assert band.reading == UNKNOWN
    assert band.evidence["variants"]["v1 TND paged"]["visible"] == list(range(experiments.BAND_KV))
    assert band.evidence["variants"]["v2 TND paged"]["visible"] == [21, 22, 23]


def test_a_writer_that_accumulates_repeats_is_unknown():
    def accumulating(cache, indices, updates):
        cache.index_put_(tuple(indices.to(torch.int64).unbind(1)), updates, accumulate=True)
        return cache

    data = probe(_device_with(npu_scatter_nd_update_=accumulating))
    slots = data.questions["repeated_slots"]
    assert slots.reading == UNKNOWN
    # slot 0 started at -7 and received rows 1, 2 and 3
    assert slots.evidence["variants"]["npu_scatter_nd_update_"]["slot0_row_value"] == -7 + 1 + 2 + 3


@pytest.mark.parametrize(("fill", "reading"), [(0.0, "zeros"), (experiments.NULL_SENTINEL, "stale"),
                                               (0.5, UNKNOWN)])
def test_null_block_contents_are_read_off_the_never_written_block(fill, reading, monkeypatch):
    dev = open_device("emulated", None)
    monkeypatch.setattr(dev, "never_written", lambda shape, dtype, sentinel: torch.full(shape, fill, dtype=dtype))
    outcome = experiments.null_block_experiment(dev)
    assert outcome.reading == reading
    assert outcome.evidence["block0"]["total"] == experiments.BLOCK * 16


def test_mla_mode3_deviation_and_rejection_are_told_apart():
    def mode3(behaviour):
        def fa(*args, sparse_mode=0, **kw):
            if sparse_mode != 3:
                return emulated.npu_fused_infer_attention_score_v2(*args, sparse_mode=sparse_mode, **kw)
            # a device of our own making: the emulator refuses mode 3 here, so start from mode 0's output
            kw.pop("atten_mask", None)
            out = emulated.npu_fused_infer_attention_score_v2(*args, sparse_mode=0, **kw)
            if behaviour == "reject":
                raise RuntimeError("EZ1001: sparse_mode 3 is not supported when Q_S is 1")
            return out[0] * 0.5, out[1]
        return fa

    rejected = experiments.mla_experiment(_device_with(npu_fused_infer_attention_score_v2=mode3("reject")))
    assert rejected.reading == "rejected" and "EZ1001" in rejected.evidence["sparse_mode 3"]["error"]
    deviates = experiments.mla_experiment(_device_with(npu_fused_infer_attention_score_v2=mode3("halve")))
    assert deviates.reading == "deviates"
    assert deviates.evidence["random_inputs"]["max_abs_diff"] > 0


def test_finalize_skip1_alone_off_every_reading_is_unknown_and_a_bad_control_blames_the_probe():
    real = emulated.OPS["npu_moe_finalize_routing"]

    def doubling(rows, skip1, skip2, *args, **kw):  # a device that adds skip1 twice when skip2 is None
        if skip1 is not None and skip2 is None:
            return real(rows, None, None, *args, **kw) + 2 * skip1
        return real(rows, skip1, skip2, *args, **kw)

    odd = experiments.finalize_experiment(_device_with(npu_moe_finalize_routing=doubling))
    assert odd.reading == UNKNOWN and odd.evidence == {"alone_minus_base": [32.0]}  # skip1 is 16

    def no_skips(rows, skip1, skip2, *args, **kw):  # ignores both skips: the documented control fails
        return real(rows, None, None, *args, **kw)

    control = experiments.finalize_experiment(_device_with(npu_moe_finalize_routing=no_skips))
    assert control.reading == UNKNOWN and "probe's call is wrong" in control.summary


def test_a_failing_control_call_blames_the_probe_not_the_device():
    def broken(*args, **kw):
        raise RuntimeError("wrong probe call")

    outcome = experiments.repeated_slots_experiment(_device_with(npu_scatter_nd_update_=broken))
    assert outcome.reading == "last_wins"  # from the writer whose control call passed
    assert outcome.evidence["variants"]["npu_scatter_nd_update_"] == {
        "error": "control call failed: RuntimeError: wrong probe call"}
    assert "rejected by the device: npu_scatter_nd_update_" in outcome.summary

    def refusing(*args, **kw):
        raise RuntimeError("writer broken")

    both = experiments.repeated_slots_experiment(_device_with(npu_scatter_nd_update_=broken,
                                                              npu_kv_rmsnorm_rope_cache_v2=refusing))
    assert both.reading == UNKNOWN and both.summary.endswith(
        "every variant was rejected; rejected by the device: npu_scatter_nd_update_, npu_kv_rmsnorm_rope_cache_v2 PA")


def test_a_variant_the_device_rejects_is_left_out_of_the_verdict():
    def no_v1(*args, **kw):
        raise RuntimeError("EZ9999: TND with sparse_mode 4 is not supported by v1")

    data = probe(_device_with(npu_fused_infer_attention_score=no_v1))
    for q in ("window_pre_tokens", "band_at_single_query"):
        assert data.questions[q].reading == ("exclusive" if q == "window_pre_tokens" else "honoured")
        assert "rejected by the device: v1 TND" in data.questions[q].summary
        assert any("EZ9999" in ev.get("error", "") for ev in data.questions[q].evidence["variants"].values())


def test_visible_keys_reads_uniform_mixtures_only():
    row = torch.zeros(16)
    row[[3, 5, 9]] = 1 / 3
    assert experiments.visible_keys(row) == [3, 5, 9]
    row[3] = 0.5  # not a uniform mixture: no key set to read
    assert experiments.visible_keys(row) is None
    assert experiments.visible_keys(torch.zeros(4)) == []


@pytest.mark.parametrize("reading", _ALLOWED["repeated_slots"])
def test_mla_writer_repeats_outside_the_null_block_are_a_race_under_every_reading(reading):
    with device_readings(DeviceReadings(repeated_slots=reading)):
        kv, gamma = torch.randn(2, 1, 1, 48), torch.ones(32)
        cos, sin = torch.ones(2, 1, 1, 16), torch.zeros(2, 1, 1, 16)
        with pytest.raises(NpuOpError, match="outside the null block"):
            emulated.npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, torch.tensor([19, 19]), torch.zeros(2, 16, 1, 16),
                                               torch.zeros(2, 16, 1, 32), cache_mode="PA")
