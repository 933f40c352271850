"""A wrong render fails by the check that names it, on the same stream as a clean one (no long run).

The renders of a long-window model that differ from the implementer's also run as written at their real
window (4096 for Mistral-7B): that run takes the short stream (QUICK), as the paged drivers do, so the Legacy
driver no longer stretches its prompt past a 4096 window (an O(window^2) reference, over 300 s). The time
ratio to the clean run is measured in benchmarks/bench_failing_validate.py, not asserted here.
"""

from __future__ import annotations

import pytest
from model_infer_kvcache.validators.pipeline.legacy_run import prompt_length
from model_infer_kvcache.validators.pipeline.request_stream import QUICK
from validators_support import check, mutate, render_case, run_validate
from wrong_renders import CLEAN, CONFIG, MISTAKES


@pytest.mark.parametrize("case, flags, name, pattern, replacement, named_by", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_wrong_render_fails_by_name(tmp_path, case, flags, name, pattern, replacement, named_by):
    manifest, rendered, config = render_case(tmp_path, CONFIG, **flags)
    mutate(rendered, pattern, replacement, count=1, name=name)
    report = run_validate(manifest, rendered, config)
    assert not report.passed
    named = check(report, "as written: " + named_by)
    assert not named.passed, named
    assert any("as written" in note for note in report.notes)


@pytest.mark.parametrize("case", sorted(CLEAN))
def test_clean_render_passes(tmp_path, case):
    manifest, rendered, config = render_case(tmp_path, CONFIG, **CLEAN[case])
    report = run_validate(manifest, rendered, config)
    assert report.passed, [c for c in report.checks if not c.passed]


def test_legacy_stream_follows_the_scenario():
    assert prompt_length(QUICK) == max(n for n, _ in QUICK.first)  # as written at a long window: short
    crossing = QUICK.crossing(160, 128)
    assert prompt_length(crossing) >= 160 + 2 * 128  # the window crossing: past the window by two blocks
