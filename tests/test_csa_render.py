"""DeepSeek-V4 CSA layers rendered and validated against transformers (issue 38): the fixture mixes window-only, CSA
and HCA layers (tests/fixtures/configs/deepseek_v4.json). A CSA layer compresses every 4 tokens into one entry (two
overlapping series, coff 2) and its lightning indexer's keys likewise; torch_npu's float npu_lightning_indexer picks
each query's top index_topk entries among those it may see, over its own request's keys only, and the selection
(padded with -1 to the kernel's 512) goes into npu_sparse_attn_sharedkv with the window branch. The CPU run narrows
index_topk 512 -> 16 so the selection drops entries; the stream's prompts (262, 126, 125 tokens) are not multiples of
4, two requests finish early and a late one is admitted into a freed (poisoned) row. Negative controls: the
realistic mistakes of a CSA port, each failing by name."""

from __future__ import annotations

import json

import pytest
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.implementer.render import render_manifest
from model_infer_kvcache.validators.pipeline.request_stream import Scenario
from validators_support import CONFIGS, check, mistaken_report, mutate, render_case, run_validate

CONFIG = "deepseek_v4"
ATTN = "kvcache_attention.py"
AS_WRITTEN = "as written: "
NUMERIC, SHAREDKV, CONSTANTS = "logits vs transformers", "shared-KV attention:", "rendered constants match"
# two prompts over the window, neither a multiple of 4 (their last group unfinished at prefill, completed while
# decoding); a late admit into the first finished request's row (its entries and state slots poisoned)
STREAM = Scenario(first=((262, 3), (126, 4)), late=((125, 5),), max_concurrency=2, release_requests=1)


def _case(tmp_path, mode: str = "standalone"):
    return render_case(tmp_path, CONFIG, None, deploy_mode=mode)


@pytest.mark.parametrize("mode", ["standalone", "framework"])
def test_csa_hca_and_window_layers_render_and_match_transformers(tmp_path, mode):
    manifest, rendered, cfg = _case(tmp_path, mode)
    text = (rendered / ATTN).read_text(encoding="utf-8")
    assert "torch_npu.npu_lightning_indexer(" in text and "cmp_sparse_indices=selected" in text
    report = run_validate(manifest, rendered, cfg, scenario=STREAM)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert check(report, NUMERIC).measured["max_abs_diff"] <= 1e-9
    # the indexer's top-16 left out most of what the queries could see: the selection is exercised
    assert check(report, SHAREDKV).measured["entries_dropped"] > 0.5
    assert any("index_topk 512 -> 16" in n for n in report.notes), report.notes
    if mode == "framework":  # upstream deepseek_v4's managers: the CSA branch's indexer keys ride on c4a's
        assert set(check(report, "all blocks back in the pool").measured["usage"]) == {
            "win_kv", "c4a_cmp_kv", "c4a_cmp_state", "c128a_cmp_kv", "c128a_cmp_state"}


# (id, file, pattern, replacement, the check that names the mistake)
MISTAKES = [
    # every query's top-k taken over the first request's indexer keys (the block table row of the wrong request)
    ("top-k-over-another-requests-entries", ATTN, r"block_table=cmp_table\[rows\]",
     "block_table=cmp_table[torch.zeros_like(rows)]", NUMERIC),
    # CSA's unfinished group (m = 4) pooled as an entry: the op's pad row written where the group's entry goes
    ("csa-partial-group-written-as-an-entry", ATTN, r"first, last = starts // ratio, ends // ratio",
     "first, last = starts // ratio, (ends + (ratio - 1) * (coff == 2)) // ratio", NUMERIC),
    # the selection computed but not passed: every visible entry attended, as on an HCA layer
    ("selection-not-passed", ATTN, r"selected = self\.select_entries\(", "self.select_entries(", SHAREDKV),
]


@pytest.mark.parametrize("case, name, pattern, replacement, failing", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_csa_render_mistake_fails_by_name(tmp_path, case, name, pattern, replacement, failing):
    report = mistaken_report(_case(tmp_path), pattern, replacement, STREAM, name=name)
    # the manifest's index_topk (512) is wider than CPU prompts: the given render runs as written with only its
    # INDEX_TOPK narrowed, its runtime checks named "as written: ..." (the implementer's own render passes: the test
    # above)
    assert not check(report, AS_WRITTEN + failing).passed, [(c.name, c.detail) for c in report.failed()]


def test_csa_entries_under_the_hca_managers_fail_by_name(tmp_path, monkeypatch):
    """Framework mode: a CSA layer's entries registered under the HCA branch's managers (c128a_*: the HCA code
    copied for CSA): their block span and window are the HCA's, against the manifest's c4a entries (V101)."""
    from model_infer_kvcache.validators.pipeline import validate

    monkeypatch.setattr(validate, "_localise", lambda *args, **kwargs: None)
    manifest, rendered, cfg = _case(tmp_path, "framework")
    mutate(rendered, r"CMP_MANAGERS\[ratio\], STATE_MANAGERS\[ratio\]",
           "CMP_MANAGERS[HCA_RATIO], STATE_MANAGERS[HCA_RATIO]", name=ATTN)
    report = run_validate(manifest, rendered, cfg, scenario=STREAM)
    assert not report.passed
    entries = check(report, AS_WRITTEN + "cache entries match the manifest")  # the given render's run
    assert not entries.passed and "c128a_cmp_kv" in entries.detail, entries.detail


def test_swapped_csa_and_hca_ratios_fail_by_name(tmp_path, monkeypatch):
    """The two rates swapped in a render (CSA 128, HCA 4): the rendered constants against the manifest's (V108)."""
    from model_infer_kvcache.validators.pipeline import validate

    monkeypatch.setattr(validate, "_localise", lambda *args, **kwargs: None)
    manifest, rendered, cfg = _case(tmp_path)
    mutate(rendered, r"(?m)^HCA_RATIO = 128$", "HCA_RATIO = 4", name=ATTN)
    mutate(rendered, r"(?m)^CSA_RATIO = 4$", "CSA_RATIO = 128", name=ATTN)
    report = run_validate(manifest, rendered, cfg, scenario=STREAM)
    assert not report.passed
    assert not check(report, CONSTANTS).passed and "CSA_RATIO" in check(report, CONSTANTS).detail


def test_swapped_rates_in_the_config_are_refused_by_name(tmp_path):
    """The rates swapped in the config (CSA 128, HCA 4): the kernels take CSA 4 / HCA 128 only; the render refuses
    the plan naming the device constraint (the analyzer's cross-check with transformers agrees with such a config:
    transformers builds what it says)."""
    config = tmp_path / "v4.json"
    data = json.loads((CONFIGS / f"{CONFIG}.json").read_text(encoding="utf-8"))
    data["compress_rates"] = {"compressed_sparse_attention": 128, "heavily_compressed_attention": 4}
    config.write_text(json.dumps(data), encoding="utf-8")
    m = analyze(AnalyzeRequest(config=str(config), deploy_mode="standalone"))
    with pytest.raises(InputError) as info:
        render_manifest(m, allow_blocked=True)
    assert info.value.field == "compressed.device_constraints" and "compress rates CSA 128" in str(info.value)
