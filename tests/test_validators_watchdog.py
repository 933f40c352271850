"""The watchdog: a validation never hangs. A stream past its step budget, or a step past its time, fails one
check naming the step and the requests (exit 1), quickly; the budgets come from the request stream."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace

import pytest
from model_infer_kvcache.validators.pipeline.request_stream import (
    QUICK,
    STREAM_BUDGET_CHECK,
    StreamStalled,
    Watchdog,
)
from validators_support import ROOT, check, mutate, render_case, run_validate

# A realistic runner mistake: kv_len advanced through a copy (advanced indexing copies), so the catch-up
# loop never ends and the first request never finishes its prefill.
STUCK_ADVANCE = '''    def _advance_kv_len(self, rows, forward_metadata):
        index = torch.as_tensor(rows, device=self.kv_len.device)
        current = self.kv_len[index]  # a copy
        while bool((current < forward_metadata.actual_seq_lengths_kv).any()):
            self.kv_len[index] += 1  # the copy never moves
'''


def _stuck(rendered):
    mutate(rendered, r"    def _advance_kv_len\(self, rows, forward_metadata\):\n(?:        .*\n)+?"
                     r"        self\.kv_len\[index\] = forward_metadata\.actual_seq_lengths_kv\n",
           STUCK_ADVANCE, count=1, name="kvcache_runner.py")


def test_budget_counts_steps_of_the_stream():
    dog = Watchdog(max_steps=2, step_seconds=0)
    for i in range(2):
        with dog.step(i, [0]):
            pass
    with pytest.raises(StreamStalled, match=r"step 2 \(requests 0, 1\) is past the stream's budget of 2"):
        with dog.step(2, [0, 1]):
            pass
    assert QUICK.max_steps() >= len(QUICK.first + QUICK.late) + sum(n for _, n in QUICK.first + QUICK.late)


def test_a_step_that_never_returns_is_stopped():
    dog = Watchdog(max_steps=10, step_seconds=0.2, what="test stream")
    started = time.perf_counter()
    with pytest.raises(StreamStalled, match=r"test stream: step 3 \(requests 7\) still running after 0.2 s"):
        with dog.step(3, [7]):
            while True:
                pass
    assert time.perf_counter() - started < 5


def test_render_that_never_finishes_a_request_fails_by_name(tmp_path):
    manifest, rendered, config = render_case(tmp_path, "qwen3_8b", deploy_mode="standalone")
    _stuck(rendered)
    started = time.perf_counter()
    report = run_validate(manifest, rendered, config, scenario=replace(QUICK, step_seconds=2.0))
    took = time.perf_counter() - started
    stalled = check(report, STREAM_BUDGET_CHECK)
    assert not stalled.passed and not report.passed
    assert "step 0 (requests 0, 1, 2)" in stalled.detail and "still running after 2 s" in stalled.detail
    assert took < 60, took  # a bound against hanging, not a performance figure


def test_cli_flag_sets_the_allowance_and_exits_1(tmp_path):
    manifest, rendered, config = render_case(tmp_path, "qwen3_8b", deploy_mode="standalone")
    _stuck(rendered)
    out = tmp_path / "report.json"
    run = subprocess.run([sys.executable, "-m", "model_infer_kvcache", "validate", "--manifest", str(manifest),
                          "--rendered", str(rendered), "--config", str(config), "--backend", "emulated",
                          "--no-sweep", "--step-timeout", "1.5", "--report", str(out)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 1, run.stderr[-2000:]
    report = json.loads(out.read_text(encoding="utf-8"))
    failed = [c for c in report["checks"] if not c["passed"]]
    assert [c["name"] for c in failed] == [STREAM_BUDGET_CHECK]
    assert "still running after 1.5 s" in failed[0]["detail"]


@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf", "soon"])
def test_cli_refuses_a_bad_allowance(tmp_path, value):
    run = subprocess.run([sys.executable, "-m", "model_infer_kvcache", "validate", "--manifest", "m.json", "--rendered", "r",
                          "--config", "c.json", "--step-timeout", value], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert run.returncode == 2 and "--step-timeout" in run.stderr and len(run.stderr.strip().splitlines()) == 1
