"""Negative controls: deliberately broken renders must fail validation with the right check named."""

from __future__ import annotations

import json

import pytest
from validators_support import check, mutate, render_case, run_validate

pytestmark = pytest.mark.slow


def test_v1_scale_name_on_a_v2_call(tmp_path):
    manifest, rendered, cfg = render_case(tmp_path, "gpt_oss_20b", framework_api="G2")
    mutate(rendered, r"softmax_scale=SOFTMAX_SCALE", "scale=SOFTMAX_SCALE")
    report = run_validate(manifest, rendered, cfg)
    assert not report.passed
    failed = check(report, "rendered code runs without operator errors")
    assert not failed.passed and "scale" in failed.detail
    # The refused call is judged too: v2 reads its scale from softmax_scale, so it got the default 1.0.
    args = check(report, "FA call arguments match the manifest")
    assert not args.passed and "scale=1.0 (manifest" in args.detail


def test_prefill_without_causal_mask(tmp_path):
    manifest, rendered, cfg = render_case(tmp_path, "qwen3_8b", framework_api="G2")
    mutate(rendered, r"sparse_mode = 3", "sparse_mode = 0")
    mutate(rendered, r"atten_mask = forward_metadata.attention_mask", "atten_mask = None")
    report = run_validate(manifest, rendered, cfg)
    numeric = check(report, "logits vs transformers")
    assert not numeric.passed and "step 0 request" in numeric.detail and "first diverging layer 0" in numeric.detail
    args = check(report, "FA call arguments match the manifest")
    assert not args.passed and "sparse_mode=0 (manifest 3)" in args.detail and "(prefill)" in args.detail


def test_kv_len_incremented_inside_a_layer(tmp_path):
    manifest, rendered, cfg = render_case(tmp_path, "qwen3_8b", kv_mode="legacy", deploy_mode="standalone")
    mutate(rendered, r"(\n        self\.update_cache\(key_states, value_states, forward_metadata\.kv_len\)\n)",
           r"\1        forward_metadata.kv_len += 1\n")
    report = run_validate(manifest, rendered, cfg)
    assert not check(report, "logits vs transformers").passed
    assert not check(report, "greedy tokens identical").passed


def test_mla_decode_with_causal_sparse_mode(tmp_path):
    manifest, rendered, cfg = render_case(tmp_path, "deepseek_v2_lite", framework_api="G2")
    mutate(rendered, r"sparse_mode = 0\n            atten_mask = None",
           "sparse_mode = 3\n            atten_mask = forward_metadata.attention_mask")
    report = run_validate(manifest, rendered, cfg, sweep=True)
    # the op docs support only mode 0 (no mask) or 4 with rope at Q_S 1; what the device does with mode 3 is
    # the question mla_decode_sparse_mode3: the render's own argument check names the deviation from the
    # manifest under every reading, and the sweep shows the operator refusing it under 'rejected'
    args = check(report, "FA call arguments match the manifest")
    assert not args.passed and "(decode): sparse_mode=3 (manifest 0)" in args.detail
    assert "mla_decode_sparse_mode3" in report.consulted
    rejected = next(n for n in report.notes if n.startswith("under mla_decode_sparse_mode3=rejected"))
    assert "argument 'sparse_mode'" in rejected and "Q_S 1" in rejected


def test_missing_yarn_mscale_squared(tmp_path):
    manifest, rendered, cfg = render_case(tmp_path, "deepseek_v2_lite", framework_api="G2")
    data = json.loads(manifest.read_text())
    base = data["model"]["qk_head_dim"] ** -0.5
    assert data["fa"]["softmax_scale"] > base * 1.1  # the manifest carries mscale^2
    mutate(rendered, r"SOFTMAX_SCALE = [0-9.e-]+", f"SOFTMAX_SCALE = {base!r}", count=1)
    report = run_validate(manifest, rendered, cfg)
    # Caught on the render as written, before anything runs (the init link stops the later links).
    constants = check(report, "rendered constants match the manifest")
    assert not constants.passed and f"SOFTMAX_SCALE = {base!r}" in constants.detail
    assert "init link failed" in " ".join(report.notes)


def test_window_pre_tokens_off_by_one_is_caught(tmp_path):
    """pre_tokens = W (the other reading's value) lets one key too many in: the measurement rejects it."""
    manifest, rendered, cfg = render_case(tmp_path, "gpt_oss_20b", framework_api="G2", window_reading="inclusive")
    assert json.loads(manifest.read_text())["layers"][0]["pre_tokens"] == 128
    report = run_validate(manifest, rendered, cfg)
    assert not check(report, "logits vs transformers").passed


def test_sliding_prefill_through_the_shared_null_block(tmp_path):
    """Reading a sliding layer's prefill back through block_table mixes two long prompts' early keys."""
    from validators_support import DEFAULT

    manifest, rendered, cfg = render_case(tmp_path, "gpt_oss_20b", framework_api="G2")
    mutate(rendered, r'if forward_metadata\.is_prefill and self\.attn_type == "SlidingWindow":', "if False:")
    report = run_validate(manifest, rendered, cfg, scenario=DEFAULT)
    assert not check(report, "logits vs transformers").passed
