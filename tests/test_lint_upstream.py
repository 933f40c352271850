"""Lint precision on real, working code: the public cann-recipes-infer snapshot in the shared folder.

The modeling files of the pinned HEAD run on NPUs upstream; a finding there is a false alarm unless
it is a real defect, which is then listed here with its reason. Every model folder of the snapshot
is linted (the thirteen of the pinned commit, deepseek_v4 with its compressed attention included). Skips (with the path) when the shared folder is absent.
"""

from __future__ import annotations

import pytest
from model_infer_kvcache.validators.lint import lint_paths
from shared_dirs import upstream_head

MODELS = ["qwen", "qwen3_moe", "gpt_oss", "deepseek_r1", "pangu_7b", "kimi_k2_thinking", "deepseek_v3_2_exp",
          "bailing_2_5", "qwen3_5", "gemma_4", "hy3", "longcat_flash", "deepseek_v4"]

# Real defects the rules find in the snapshot, with the reason each is right (path suffix, rule).
KNOWN_DEFECTS = {
    # hy3's float8-KV attention passes `quant_scale_p=` and `out_dtype=` to FA v2. The folder's README
    # names one torch_npu release, the 2.8.0.post4 wheel; the 2.9.0 schema (nearest committed, newer
    # than the target) has neither keyword, only 2.14.0's has. The branch runs with the A5 float8 config,
    # whose docker image the README gives without its torch_npu release: no release the folder names
    # accepts the call, so the folder's stated requirement is wrong for that path, and KV103 says which
    # release has the keywords.
    ("models/hy3/models/modeling_hy_v3.py", "KV103"),
}
# Files whose folders name no torch_npu release are judged against the newest committed schemas:
# module/fa_quant/fa_quant.py passes `out_dtype=` (2.14.0 has it; its comment asks for CANN 9.1.0+).


@pytest.mark.parametrize("model", MODELS)
def test_snapshot_model_is_clean(model):
    folder = upstream_head() / "models" / model
    if not folder.is_dir():
        pytest.skip(f"{folder} does not exist")
    report = lint_paths([folder])
    assert not report.errors, report.errors
    assert len(report.files) >= 2, report.files  # the modeling code was really read
    unexplained = [f for f in report.findings if not any(f.path.endswith(s) and f.rule == r for s, r in KNOWN_DEFECTS)]
    assert unexplained == [], [f"{f.path}:{f.line} {f.rule}" for f in unexplained]


def test_gpt_oss_last_token_and_decode_views_are_not_reported():
    """The two views once misreported as KV701: selected last tokens (prefill) and decode rows."""
    path = upstream_head() / "models" / "gpt_oss" / "models" / "modeling_gpt_oss.py"
    lines = path.read_text(encoding="utf-8").splitlines()
    views = [n for n, line in enumerate(lines, start=1) if "hidden_states.view(bs, 1, hidden_size)" in line]
    assert len(views) == 2, "the snapshot no longer has the two views this test is about"
    assert "index_select" in lines[views[0] - 2]  # the prefill view follows the row selection
    report = lint_paths([path])
    assert [f for f in report.findings if f.line in views] == []


def test_every_model_folder_of_the_snapshot_is_listed():
    folders = {p.name for p in (upstream_head() / "models").iterdir() if p.is_dir()}
    assert folders == set(MODELS), sorted(folders ^ set(MODELS))


def test_whole_snapshot_reports_only_known_defects():
    root = upstream_head()
    report = lint_paths([root / "models", root / "module", root / "executor"])
    assert not report.errors, report.errors
    found = {(next((s for s, _ in KNOWN_DEFECTS if f.path.endswith(s)), f.path), f.rule) for f in report.findings}
    assert found == KNOWN_DEFECTS, sorted(found)
