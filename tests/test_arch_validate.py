"""End to end on architectures that used to crash validation: GLM-4 and Phi-3-mini (token ids
outside the tiny vocabulary), Falcon (layers at ``transformer.h``, fused query_key_value),
Baichuan2 (a model type transformers lacks) and a layout the host cannot route."""

from __future__ import annotations

import subprocess
import sys

import pytest
from model_infer_kvcache.analyzer.errors import InputError
from validators_support import ROOT, check, render_case, run_validate

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", ["glm4_9b_0414", "phi3_mini", "falcon2_11b"])
def test_validates_end_to_end(tmp_path, name):
    """falcon2_11b: new_decoder_architecture, 32 query / 8 KV heads broadcast by _split_heads; the
    host hands the rendered code the 8 distinct KV heads and Falcon's own rotary."""
    manifest, rendered, cfg = render_case(tmp_path, name, framework_api="G2")
    report = run_validate(manifest, rendered, cfg)
    assert report.passed, [(c.name, c.detail or c.measured) for c in report.failed()]
    numeric = check(report, "logits vs transformers")
    assert numeric.measured["steps"] >= 9
    assert check(report, "FA call arguments match the manifest").measured["calls"] > 0


def test_falcon_7b_keeps_its_own_attention_past_the_fa_head_ratio_limit(tmp_path):
    """Falcon-7B: 71 query heads on one KV head. FA takes a ratio of at most 64, which the analyzer
    reports as a blocker; the Legacy path then keeps the model's own attention over the contiguous
    cache (no FA call, V220) and matches transformers. The operator's own refusal of ratio 71 is
    test_npu_ops_strictness.test_gqa_ratio_above_64_is_refused. head_dim 8 instead of 64 (hidden 568): Falcon's tiny
    model ties its hidden size to heads x head_dim, and the ratio is the point (4544 wide: 17.6 s of a CPU run)."""
    manifest, rendered, cfg = render_case(tmp_path, "falcon_7b", {"hidden_size": 71 * 8}, framework_api="G2")
    from model_infer_kvcache.analyzer.manifest_io import load_manifest

    m = load_manifest(str(manifest))
    assert any("71 query heads per 1 KV head" in b.message for b in m.blockers)
    assert m.legacy_attention.kernel == "model"
    report = run_validate(manifest, rendered, cfg)
    assert report.passed, [(c.name, c.detail or c.measured) for c in report.failed()]
    assert check(report, "the Legacy render keeps the model's own attention (no FA call)").measured["fa_calls"] == 0


def test_baichuan_validate_is_one_line_exit_2(tmp_path):
    manifest, rendered, cfg = render_case(tmp_path, "baichuan2_13b", framework_api="G2")
    report_path = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "model_infer_kvcache", "validate", "--manifest", str(manifest),
                           "--rendered", str(rendered), "--config", str(cfg), "--backend", "emulated",
                           "--report", str(report_path)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "has no model type 'baichuan'" in lines[0] and "analyze and render do not need it" in lines[0]
    assert "Traceback" not in proc.stderr and not report_path.exists()


def test_unroutable_attention_is_refused_naming_the_module(tmp_path, monkeypatch):
    """A layout the host does not understand fails in one line naming the module (never a crash)."""
    import model_infer_kvcache.validators.pipeline.host_model as host
    manifest, rendered, cfg = render_case(tmp_path, "qwen3_8b", framework_api="G2")
    monkeypatch.setattr(host, "attention_route", lambda module, is_mla: None)
    with pytest.raises(InputError) as err:
        run_validate(manifest, rendered, cfg)
    text = err.value.render()
    assert "\n" not in text
    assert "attention module model.layers.0.self_attn (Qwen3Attention) is not understood" in text
