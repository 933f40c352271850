"""`kvcache analyze --cache-dtype`: the cache planned in another dtype than the config's torch_dtype, recorded in
the manifest with its reason; without the flag the manifest (bytes and hash) is what it was."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.decisions_table import decisions_markdown
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from model_infer_kvcache.implementer.render import render_manifest, write_rendered
from model_infer_kvcache.validators.pipeline.request_stream import QUICK
from model_infer_kvcache.validators.pipeline.validate import ValidateRequest, validate
from pydantic import ValidationError

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "fixtures" / "configs"


@pytest.fixture
def float32_qwen3(tmp_path) -> Path:
    """Qwen3-8B's config as published, but with torch_dtype float32 (the case issue 26 hit)."""
    config = json.loads((CONFIGS / "qwen3_8b.json").read_text(encoding="utf-8"))
    config["torch_dtype"] = "float32"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    return path


def test_bf16_cache_for_a_float32_config(float32_qwen3):
    plain = analyze(AnalyzeRequest(config=str(float32_qwen3), hbm_gb=40, max_len=8192))
    m = analyze(AnalyzeRequest(config=str(float32_qwen3), hbm_gb=40, max_len=8192, cache_dtype="bfloat16"))
    assert plain.cache_dtype is None and {c.dtype for layer in plain.layers for c in layer.caches} == {"float32"}
    assert {c.dtype for layer in m.layers for c in layer.caches} == {"bfloat16"}
    assert m.model.dtype == "float32"  # the model keeps its dtype; only the cache is planned in bf16
    assert (m.cache_dtype.value, m.cache_dtype.config_dtype) == ("bfloat16", "float32")
    assert "--cache-dtype bfloat16" in m.cache_dtype.reason and "float32 (torch_dtype)" in m.cache_dtype.reason
    # the memory plan follows: half the bytes per token, twice the tokens in the same budget
    assert m.memory.per_token_bytes * 2 == plain.memory.per_token_bytes == 36 * 2 * 8 * 128 * 4
    assert m.memory.max_tokens >= 2 * plain.memory.max_tokens - 2 * m.block_size
    row = next(line for line in decisions_markdown(m).splitlines() if line.startswith("| cache dtype |"))
    assert "bfloat16(config: float32)" in row and "--cache-dtype bfloat16" in row
    assert "cache dtype" not in decisions_markdown(plain)
    assert SelectionManifest.model_validate_json(m.to_json()) == m


def test_without_the_flag_the_manifest_has_no_new_key(float32_qwen3):
    m = analyze(AnalyzeRequest(config=str(float32_qwen3)))
    same = analyze(AnalyzeRequest(config=str(float32_qwen3), cache_dtype="float32"))  # the config's own dtype
    assert "cache_dtype" not in json.loads(m.to_json())
    assert same.to_json() == m.to_json() and same.content_hash() == m.content_hash()


def test_a_hand_edit_that_contradicts_the_caches_is_refused(float32_qwen3):
    data = json.loads(analyze(AnalyzeRequest(config=str(float32_qwen3), cache_dtype="bfloat16")).to_json())
    data["layers"][3]["caches"][1]["dtype"] = "float32"
    with pytest.raises(ValidationError, match=r"layers\[3\]\.caches\[1\]\.dtype"):
        SelectionManifest.model_validate(data)


@pytest.mark.parametrize("flag, value", [("bf16", "bfloat16"), ("fp16", "float16"), ("float16", "float16")])
def test_cli_spellings(float32_qwen3, flag, value):
    proc = subprocess.run([sys.executable, "-m", "model_infer_kvcache", "analyze", "--config", str(float32_qwen3),
                           "--cache-dtype", flag], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["cache_dtype"]["value"] == value


def test_cli_refuses_an_unplanned_dtype_in_one_line(float32_qwen3):
    proc = subprocess.run([sys.executable, "-m", "model_infer_kvcache", "analyze", "--config", str(float32_qwen3),
                           "--cache-dtype", "int8"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "--cache-dtype" in proc.stderr


def test_render_of_a_bf16_cache_plan_validates(tmp_path):
    """The rendered code allocates the planned dtype (CACHE_DTYPE) and passes the checks (constants included)."""
    config = ROOT / "examples" / "tiny_qwen3" / "config.json"
    assert json.loads(config.read_text(encoding="utf-8"))["torch_dtype"] != "float16"
    m = analyze(AnalyzeRequest(config=str(config), deploy_mode="framework", framework_api="G2",
                               cache_dtype="float16"))
    rendered = render_manifest(m)
    assert "torch.float16" in rendered.files["kvcache_attention.py"]
    manifest_path = tmp_path / "manifest.json"
    manifest_path.write_text(m.to_json(), encoding="utf-8")
    write_rendered(rendered, tmp_path / "rendered")
    report = validate(ValidateRequest(manifest=str(manifest_path), rendered=str(tmp_path / "rendered"),
                                      config=str(config), backend="emulated", scenario=QUICK, sweep_readings=False))
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    constants = next(c for c in report.checks if c.name == "rendered constants match the manifest")
    assert constants.passed
