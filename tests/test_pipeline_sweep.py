"""The device-reading sweep both modes share (validators.pipeline.sweep), with a rerun of our making.

The rerun stands in for a validation run: it passes or fails as a function of the readings it is
handed, so every note the sweep writes can be predicted exactly.
"""

from __future__ import annotations

from dataclasses import replace

from model_infer_kvcache.analyzer.device_questions import QUESTIONS
from model_infer_kvcache.validators.npu_ops import DeviceReadings
from model_infer_kvcache.validators.pipeline.report import Report
from model_infer_kvcache.validators.pipeline.sweep import sweep_readings


def _report(passed: bool) -> Report:
    report = Report(backend="emulated", deploy_mode="framework", model_type="m", manifest_hash="h")
    report.add("logits vs transformers max |diff| <= 1e-09", "numeric", passed, detail="" if passed else "diff 3.3")
    return report


def _rerun_passing_when(question: str, good: set[str], calls: list):
    def rerun(readings: DeviceReadings) -> Report:
        calls.append(readings)
        return _report(getattr(readings, question) in good)
    return rerun


def test_every_other_reading_is_rerun_and_the_dependency_is_stated():
    calls: list = []
    report = _report(True)  # the full run, under the default finalize_skip1_alone=added
    sweep_readings(report, ["finalize_skip1_alone"], DeviceReadings(),
                   _rerun_passing_when("finalize_skip1_alone", {"added"}, calls), settled={}, subject="the model")
    assert [r.finalize_skip1_alone for r in calls] == ["ignored", "rejected"]
    assert all(replace(r, finalize_skip1_alone="added") == DeviceReadings() for r in calls)  # one switch moved
    assert report.notes == [
        "under finalize_skip1_alone=ignored the model fails: logits vs transformers max |diff| <= 1e-09 (diff 3.3)",
        "under finalize_skip1_alone=rejected the model fails: logits vs transformers max |diff| <= 1e-09 (diff 3.3)",
        "the model depends on the device reading finalize_skip1_alone: it passes under added and fails under "
        "ignored, rejected (references/device_questions.md)",
    ]


def test_a_failing_default_that_another_reading_fixes_is_named_the_other_way_round():
    report = _report(False)  # e.g. upstream gpt-oss under the documented (exclusive) window reading
    sweep_readings(report, ["window_pre_tokens"], DeviceReadings(),
                   _rerun_passing_when("window_pre_tokens", {"inclusive"}, []), settled={})
    assert report.notes == [
        "under window_pre_tokens=inclusive the render survives",
        "the render depends on the device reading window_pre_tokens: it passes under inclusive and fails under "
        "exclusive (references/device_questions.md)",
    ]


def test_no_dependency_line_when_every_reading_agrees():
    report = _report(True)
    sweep_readings(report, ["band_at_single_query"], DeviceReadings(),
                   _rerun_passing_when("band_at_single_query", {"honoured", "ignored"}, []), settled={})
    assert report.notes == ["under band_at_single_query=ignored the render survives"]


def test_settled_caller_set_unswept_and_repeated_questions():
    calls: list = []
    report = _report(True)
    sweep_readings(report, ["window_pre_tokens", "finalize_skip1_alone", "repeated_slots", "null_block_contents",
                            "finalize_skip1_alone"], DeviceReadings(),
                   _rerun_passing_when("finalize_skip1_alone", {"added"}, calls),
                   settled={"window_pre_tokens": "inclusive"}, caller=["finalize_skip1_alone"])
    assert calls == []  # repeated_slots / null_block_contents are not swept questions
    assert report.notes == ["window_pre_tokens settled by measurement (inclusive): sweep skipped",
                            "finalize_skip1_alone set by the caller: sweep skipped",
                            f"repeated_slots not swept: {QUESTIONS['repeated_slots'].unswept}",
                            f"null_block_contents not swept: {QUESTIONS['null_block_contents'].unswept}"]


def test_every_dependency_question_is_swept_or_says_why_not():
    """A design's listed dependency never passes the sweep in silence (issue 26: repeated_slots did)."""
    deps = [q for q in QUESTIONS.values() if q.dependency]
    assert {q.name for q in deps} >= {"band_at_single_query", "window_pre_tokens", "null_block_contents",
                                      "repeated_slots"}
    for q in deps:
        assert q.swept or len(q.unswept) > 40, q.name
        report = _report(True)
        sweep_readings(report, [q.name], DeviceReadings(), _rerun_passing_when(q.name, set(q.readings), []),
                       settled={})
        assert report.notes, q.name  # a verdict per other reading, or why there is none


def test_a_rerun_that_raises_is_a_failing_reading_not_a_crash():
    def rerun(readings):
        raise RuntimeError("npu_moe_finalize_routing: argument 'skip2': refused")

    report = _report(True)
    sweep_readings(report, ["finalize_skip1_alone"], DeviceReadings(), rerun, settled={})
    assert report.notes[0] == ("under finalize_skip1_alone=ignored the render fails: RuntimeError: "
                               "npu_moe_finalize_routing: argument 'skip2': refused")
    assert report.notes[-1].startswith("the render depends on the device reading finalize_skip1_alone: it passes "
                                       "under added and fails under ignored, rejected")


def test_a_fresh_report_is_the_same_run_without_its_findings():
    report = _report(False)
    report.dtype, report.tolerance = "float64", 1e-9
    report.notes.append("n")
    report.consulted = ["finalize_skip1_alone"]
    fresh = report.fresh(backend="npu")
    assert (fresh.deploy_mode, fresh.model_type, fresh.manifest_hash, fresh.dtype, fresh.tolerance) == \
        ("framework", "m", "h", "float64", 1e-9)
    assert fresh.backend == "npu" and not fresh.checks and not fresh.notes and not fresh.consulted
