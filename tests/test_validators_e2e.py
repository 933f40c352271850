"""End to end: every covered family x deployment mode renders, runs and matches transformers.

Each case builds a tiny transformers model from a real config, drives the rendered code through
the emulated torch_npu operators and the framework harness (or the rendered runner), and compares
per-step logits with transformers. G2 cases run the full request stream (>= 16 decode steps, early
finishes, late admits into freed blocks); G1 and standalone cases a shorter one.
"""

from __future__ import annotations

import pytest
from validators_support import DEFAULT, QUICK, check, render_case, run_validate

FAMILIES = {
    "qwen3": ("qwen3_8b", {}),
    "llama": ("llama31_8b", {}),
    "gpt_oss": ("gpt_oss_20b", {}),
    "mistral": ("mistral_7b_v01", {}),
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v2_lite": ("deepseek_v2_lite", {}),
    "legacy": ("qwen3_8b", {"kv_mode": "legacy"}),
}
MODES = {
    "framework_G1": {"framework_api": "G1"},
    "framework_G2": {"framework_api": "G2"},
    "standalone": {"deploy_mode": "standalone"},
}


# DeepSeek-V3 (128 heads of MLA in float64: the costliest family) skips G1 here: its G1 render runs against the
# real G1 checkout (tests/test_harness_framework_root.py, 2c2336a) and MLA under the G1 stand-ins runs here as
# DeepSeek-V2-Lite. Its G2 (full stream, MTP verify) and standalone cases run 16 query heads (a sixth of the time or
# less: MLA's latent cache, the runner and the absorb do not depend on the head count); the published 128 run in
# the same G2 render against the real HEAD checkout (tests/test_harness_framework_root.py) and in DeepSeek-V3.2's
# full-stream DSA render with its MTP layer (tests/test_dsa_render.py).
CASES = [(family, mode) for family in sorted(FAMILIES) for mode in sorted(MODES)
         if (family, mode) != ("deepseek_v3", "framework_G1")]
NARROW = {"num_attention_heads": 16, "num_key_value_heads": 16}
NARROWED = {("deepseek_v3", "standalone"): NARROW, ("deepseek_v3", "framework_G2"): NARROW}


@pytest.mark.slow
@pytest.mark.parametrize("family, mode", CASES, ids=[f"{f}-{m}" for f, m in CASES])
def test_family_mode_matches_transformers(tmp_path, family, mode, record_property):
    config, extra = FAMILIES[family]
    manifest, rendered, cfg = render_case(tmp_path, config, NARROWED.get((family, mode)), **extra, **MODES[mode])
    scenario = DEFAULT if mode == "framework_G2" else QUICK
    report = run_validate(manifest, rendered, cfg, scenario=scenario)
    failed = [(c.name, c.detail or c.measured) for c in report.failed()]
    assert report.passed, failed
    links = {c.link for c in report.checks}
    assert {"init", "runtime", "numeric", "release"} <= links
    numeric = check(report, "logits vs transformers")
    # float64 by default: honest code differs by rounding only (the measured figures are recorded
    # as properties; see references/validation.md for the matrix).
    assert report.dtype == "float64" and numeric.measured["max_abs_diff"] <= report.tolerance == 1e-9
    record_property("max_abs_diff", numeric.measured["max_abs_diff"])
    record_property("logit_max_abs", numeric.measured["logit_max_abs"])
    assert numeric.measured["steps"] >= (17 if scenario is DEFAULT and family != "legacy" else 9)
    assert check(report, "FA call arguments match the manifest").measured["calls"] > 0
    if family == "deepseek_v3":  # one MTP layer: verify steps (q_len 2) with accepted and rejected drafts
        spec = check(report, "speculative decode").measured
        assert spec["accepted"] > 0 and spec["rejected"] > 0 and spec["max_abs_diff"] <= 1e-4


@pytest.mark.slow
def test_sliding_model_reports_the_device_readings_it_depends_on(tmp_path):
    manifest, rendered, cfg = render_case(tmp_path, "gpt_oss_20b", framework_api="G2")
    report = run_validate(manifest, rendered, cfg, sweep=True)
    assert report.passed
    sweep = [n for n in report.notes if n.startswith("under ")]
    assert any("band_at_single_query=ignored" in n for n in sweep)
    assert any("window_pre_tokens=inclusive" in n and "fails" in n for n in sweep)


@pytest.mark.slow
def test_kimi_k2_mla_with_fa_v1(tmp_path):
    """Kimi-K2 follows DeepSeek-V3's MLA (64 heads, YaRN factor 32) and runs FA v1 upstream; here with 16 of its
    64 query heads (what is judged, the v1 call over the latent cache and YaRN's scale, does not depend on them)."""
    manifest, rendered, cfg = render_case(tmp_path, "kimi_k2", NARROW, framework_api="G2", fa_version="v1")
    report = run_validate(manifest, rendered, cfg)
    assert report.passed, [(c.name, c.detail or c.measured) for c in report.failed()]
    assert check(report, "FA call arguments match the manifest").measured["calls"] > 0
