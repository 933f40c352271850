"""Lint precision on real, working code: the public cann-recipes-infer snapshot in the shared folder.

The modeling files of the pinned HEAD (qwen, qwen3_moe, gpt_oss, deepseek_r1, pangu_7b) run on
NPUs upstream; a finding there is a false alarm unless it is a real defect, which is then listed
here with its reason. Skips (with the path) when the shared folder is absent.
"""

from __future__ import annotations

import pytest
from shared_dirs import upstream_head

from validators.lint import lint_paths

MODELS = ["qwen", "qwen3_moe", "gpt_oss", "deepseek_r1", "pangu_7b"]

# Real defects the rules find in the snapshot, with the reason each is right (path suffix, rule).
KNOWN_DEFECTS = {
    # MXFP8 attention passes `out_dtype=`, which the pinned torch_npu 2.9.0 schema of
    # npu_fused_infer_attention_score_v2 does not have (the code itself says it needs CANN 9.1.0+):
    # against 2.9.0 the call fails, so KV103 is right to name it.
    ("module/fa_quant/fa_quant.py", "KV103"),
}


@pytest.mark.parametrize("model", MODELS)
def test_snapshot_model_is_clean(model):
    folder = upstream_head() / "models" / model
    if not folder.is_dir():
        pytest.skip(f"{folder} does not exist")
    report = lint_paths([folder])
    assert not report.errors, report.errors
    assert len(report.files) >= 2, report.files  # the modeling code was really read
    assert report.findings == [], [f"{f.path}:{f.line} {f.rule}" for f in report.findings]


def test_gpt_oss_last_token_and_decode_views_are_not_reported():
    """The two views once misreported as KV701: selected last tokens (prefill) and decode rows."""
    path = upstream_head() / "models" / "gpt_oss" / "models" / "modeling_gpt_oss.py"
    lines = path.read_text(encoding="utf-8").splitlines()
    views = [n for n, line in enumerate(lines, start=1) if "hidden_states.view(bs, 1, hidden_size)" in line]
    assert len(views) == 2, "the snapshot no longer has the two views this test is about"
    assert "index_select" in lines[views[0] - 2]  # the prefill view follows the row selection
    report = lint_paths([path])
    assert [f for f in report.findings if f.line in views] == []


def test_whole_snapshot_reports_only_known_defects():
    root = upstream_head()
    report = lint_paths([root / "models", root / "module", root / "executor"])
    assert not report.errors, report.errors
    found = {(next((s for s, _ in KNOWN_DEFECTS if f.path.endswith(s)), f.path), f.rule) for f in report.findings}
    assert found == KNOWN_DEFECTS, sorted(found)
