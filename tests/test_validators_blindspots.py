"""The blind spots validate had: code patched before it ran, a prefix of the layers, streams that
never crossed the window, a tolerance that could not tell rounding from a bug. Each case of the
issue reproduced; each is now judged correctly."""

from __future__ import annotations

import json

import pytest
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.implementer.render import render_manifest, write_rendered
from model_infer_kvcache.validators.pipeline.validate import ValidateRequest, validate
from validators_support import CONFIGS, QUICK, check, mutate, run_validate

pytestmark = pytest.mark.slow


def _render(tmp, config_path, **kw):
    manifest = analyze(AnalyzeRequest(config=str(config_path), **kw))
    path = tmp / "manifest.json"
    path.write_text(manifest.to_json(), encoding="utf-8")
    rendered = tmp / "rendered"
    write_rendered(render_manifest(manifest, allow_blocked=True), rendered)
    return path, rendered, config_path


def _short_window_mistral(tmp, window=128):
    """Mistral's architecture with a window a CPU stream crosses as written (no tiny-window render)."""
    data = json.loads((CONFIGS / "mistral_7b_v01.json").read_text())
    data["sliding_window"] = window
    path = tmp / "config.json"
    path.write_text(json.dumps(data))
    return path


def _failed(report):
    return [(c.name, c.detail or c.measured) for c in report.failed()]


def test_wrong_window_constant_fails_the_init_link(tmp_path):
    """4096 where the model has 128: it used to run with the validator's window and pass."""
    manifest, rendered, cfg = _render(tmp_path, CONFIGS / "gpt_oss_20b.json", framework_api="G2")
    mutate(rendered, r"SLIDING_WINDOW = 128", "SLIDING_WINDOW = 4096")
    report = run_validate(manifest, rendered, cfg)
    assert not report.passed
    constants = check(report, "rendered constants match the manifest")
    assert not constants.passed and "SLIDING_WINDOW = 4096 (manifest 128)" in constants.detail
    every = check(report, "every layer's attn_type, window and cache entries")
    assert not every.passed and "4096" in every.detail
    assert not check(report, "cache entries match the manifest").passed


def test_wrong_attn_type_on_the_last_layer_fails(tmp_path):
    """Layer 23 of 24 made sliding: outside the tiny prefix, caught by the every-layer init check."""
    manifest, rendered, cfg = _render(tmp_path, CONFIGS / "gpt_oss_20b.json", framework_api="G2")
    mutate(rendered, r'if layer_idx in SLIDING_LAYERS else', 'if layer_idx in SLIDING_LAYERS or layer_idx == 23 else')
    report = run_validate(manifest, rendered, cfg)
    every = check(report, "every layer's attn_type, window and cache entries")
    assert not every.passed and every.measured["mismatches"] == 1 and "layer 23" in every.detail
    assert every.measured["layers"] == 24
    assert check(report, "rendered constants match the manifest").passed


@pytest.mark.parametrize(("literal", "passes"), [(4095, True), (4096, False)])
def test_literal_pre_tokens_is_judged_as_written(tmp_path, literal, passes):
    """Mistral (window 4096, too long for CPU): the device-correct literal 4095 used to fail because the
    validator shrank the cache but not the literal; now the render runs as written and passes, and a
    wrong literal fails on the FA arguments."""
    manifest, rendered, cfg = _render(tmp_path, CONFIGS / "mistral_7b_v01.json", framework_api="G2")
    mutate(rendered, r"pre_tokens = self\.window_pre_tokens", f"pre_tokens = {literal}")
    report = run_validate(manifest, rendered, cfg)
    assert report.passed is passes, _failed(report)
    assert any("also ran as written at window 4096" in n for n in report.notes)
    written = check(report, "as written: FA call arguments match the manifest")
    assert written.passed is passes
    if not passes:
        assert "pre_tokens=4096 (manifest 4095)" in written.detail


@pytest.mark.parametrize("deploy", ["standalone", "framework"])
def test_legacy_kv_length_clamped_to_the_window_fails(tmp_path, deploy):
    """The Legacy stream (3 x 150 + 9) never crossed the window: a clamp of the KV length to it passed."""
    cfg = _short_window_mistral(tmp_path)
    manifest, rendered, cfg = _render(tmp_path, cfg, kv_mode="legacy", deploy_mode=deploy,
                                      **({"framework_api": "G2"} if deploy == "framework" else {}))
    mutate(rendered, r"=kv_lens,", "=kv_lens.clamp(max=SLIDING_WINDOW),")
    report = run_validate(manifest, rendered, cfg)
    numeric = check(report, "logits vs transformers")
    assert not numeric.passed
    assert numeric.measured["longest_prefill"] >= 128 + 2 * 128
    assert check(report, "request stream crosses the window by >= 2 blocks").passed


def test_legacy_sliding_decode_that_ignores_the_window_fails(tmp_path):
    """The decode neither slices the window nor passes the band: it reads every cached key."""
    cfg = _short_window_mistral(tmp_path)
    manifest, rendered, cfg = _render(tmp_path, cfg, kv_mode="legacy", deploy_mode="standalone")
    mutate(rendered, r"pre_tokens = self\.window_pre_tokens",
           "pre_tokens = self.window_pre_tokens if forward_metadata.is_prefill else 2147483647")
    mutate(rendered, r"k_cache, v_cache, kv_lens = k_cache\[:, start:\], v_cache\[:, start:\], kv_lens - start",
           "pass")
    report = run_validate(manifest, rendered, cfg)
    assert not check(report, "logits vs transformers").passed
    assert "(decode)" in check(report, "FA call arguments match the manifest").detail


def test_legacy_sliding_decode_bounds_its_keys_without_the_band(tmp_path):
    """The rendered Legacy decode slices the last W keys itself (whether FA honours the band at q_len 1 is
    open): the band dropped at decode is named by the FA-argument check, but the logits stay right."""
    cfg = _short_window_mistral(tmp_path)
    manifest, rendered, cfg = _render(tmp_path, cfg, kv_mode="legacy", deploy_mode="standalone")
    mutate(rendered, r"pre_tokens = self\.window_pre_tokens",
           "pre_tokens = self.window_pre_tokens if forward_metadata.is_prefill else 2147483647")
    report = run_validate(manifest, rendered, cfg)
    assert check(report, "logits vs transformers").passed, _failed(report)
    assert "(decode)" in check(report, "FA call arguments match the manifest").detail


def test_legacy_with_a_short_window_passes_and_states_its_longest_sequence(tmp_path):
    """The unmutated control of the two Legacy cases above."""
    cfg = _short_window_mistral(tmp_path)
    manifest, rendered, cfg = _render(tmp_path, cfg, kv_mode="legacy", deploy_mode="standalone")
    report = run_validate(manifest, rendered, cfg)
    assert report.passed, _failed(report)
    # the Legacy driver takes the crossing stream's longest prompt (392 >= 128 + 2 x 128), decoded 8 more
    assert any(n.startswith("longest sequence: prefill 392, decode 400") for n in report.notes), report.notes


def test_gemma3_27b_passes_in_float64(tmp_path):
    """Failed 14/15 in float32 (max diff 1.27e-4 vs 1e-4, greedy identical): float32 rounding, not a
    defect. In float64 the same render differs by rounding only (measured 2.8e-13)."""
    manifest, rendered, cfg = _render(tmp_path, CONFIGS / "gemma3_27b.json", framework_api="G2")
    report = run_validate(manifest, rendered, cfg, scenario=QUICK)
    assert report.passed, _failed(report)
    assert report.dtype == "float64" and report.tolerance == 1e-9
    numeric = check(report, "logits vs transformers max |diff| <= 1e-09")
    assert numeric.measured["max_abs_diff"] < 1e-11
    assert numeric.measured["logit_max_abs"] > 1.0 and numeric.measured["logit_rms"] > 0.0
    assert "计算精度: float64" in report.to_markdown()
    assert report.to_dict()["tolerance"] == 1e-9


def test_float32_mode_keeps_its_own_tolerance(tmp_path):
    manifest, rendered, cfg = _render(tmp_path, CONFIGS / "qwen3_8b.json", framework_api="G2")
    report = validate(ValidateRequest(manifest=str(manifest), rendered=str(rendered), config=str(cfg),
                                      backend="emulated", scenario=QUICK, sweep_readings=False, dtype="float32"))
    assert report.passed, _failed(report)
    numeric = check(report, "logits vs transformers max |diff| <= 0.0001")
    # float32 rounding is visible (far above float64's), yet far below the float32 limit.
    assert 1e-9 < numeric.measured["max_abs_diff"] < 1e-4
