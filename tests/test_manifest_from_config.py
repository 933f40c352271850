"""One definition of "this manifest was decided from this config" (analyze, then validate's input check).

validate re-derives the analyzer's per-layer plan from the config (``rules.planned_layer_kind``) before
comparing it with a manifest, so every rule that legitimately changes what the config says (a window
covering the whole context planned as full attention, MLA absorb, per-rank heads) is accepted, and a
config of another model is still refused. Property over every fixture config and generated windows.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.validators.pipeline.provenance import config_mismatches

CONFIGS = Path(__file__).parent / "fixtures" / "configs"
ALL = sorted(p.stem for p in CONFIGS.glob("*.json"))


@cache
def _config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text(encoding="utf-8"))


def _manifest(tmp: Path, config: dict, **request):
    return _manifest_or_refusal(tmp, config, **request)[0]


def _manifest_or_refusal(tmp: Path, config: dict, **request):
    """(manifest, None), or (None, the refusal) for a request the analyzer refuses (e.g. TP not dividing the heads)."""
    path = tmp / "config.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    try:
        return analyze(AnalyzeRequest(config=str(path), **request)), None
    except InputError as err:
        return None, err


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("request_", [{}, {"attn_tp_size": 2}, {"kv_mode": "legacy"}, {"kv_mode": "paged"}],
                         ids=["default", "tp2", "legacy", "paged"])
def test_fixture_config_accepts_its_own_manifest(tmp_path, name, request_):
    config = _config(name)
    manifest, refusal = _manifest_or_refusal(tmp_path, config, **request_)
    if manifest is None:  # only what the request asks can be refused, naming its option (falcon_7b's one KV head at
        # --attn-tp-size 2, DeepSeek-V4's paged-only compressed branches at --kv-mode legacy); no manifest, no check
        assert any(str(refusal).startswith(f"--{key.replace('_', '-')}:") for key in request_), (name, str(refusal))
        return
    assert config_mismatches(manifest, config, name) == []


_SLIDING = ["mistral_7b_v01", "gemma2_9b", "gemma3_4b", "gpt_oss_20b"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(_SLIDING), offset=st.integers(-3, 3), tp=st.sampled_from([None, 2]),
       scale=st.sampled_from([1, 8, 64]))
def test_windows_below_at_and_above_the_context(tmp_path, name, offset, tp, scale):
    config = json.loads(json.dumps(_config(name)))
    text = config.get("text_config", config)  # multimodal configs keep the language model's fields nested
    context = 512 * scale
    text["max_position_embeddings"] = context
    text["sliding_window"] = context + offset
    manifest = _manifest(tmp_path, config, attn_tp_size=tp)
    if manifest is None:
        return
    assert config_mismatches(manifest, config, name) == []
    kinds = {layer.layer_kind for layer in manifest.layers}
    assert ("sliding" in kinds) == (offset < 0)  # the window covers the context from offset 0 on


def test_a_window_change_is_still_a_mismatch(tmp_path):
    config = dict(_config("mistral_7b_v01"))
    manifest = _manifest(tmp_path, config)
    assert config_mismatches(manifest, {**config, "sliding_window": 1024}, "edited")


@pytest.mark.parametrize("this, other", [("qwen3_8b", "llama31_8b"), ("mistral_7b_v01", "qwen2_7b"),
                                         ("deepseek_v3", "kimi_k2"), ("gemma2_9b", "gemma3_4b")])
def test_config_of_another_model_is_refused(tmp_path, this, other):
    manifest = _manifest(tmp_path, _config(this))
    assert config_mismatches(manifest, _config(other), other)


def test_kvcache_run_passes_when_the_window_covers_the_context(tmp_path):
    """The reported case: a Mistral-architecture config with sliding_window == max_position_embeddings."""
    import subprocess
    import sys

    config = {**_config("mistral_7b_v01"), "sliding_window": 32768, "max_position_embeddings": 32768}
    path = tmp_path / "ministral.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    run = subprocess.run([sys.executable, "-m", "model_infer_kvcache", "run", "--config", str(path), "--out",
                          str(tmp_path / "out")], capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).resolve().parent.parent)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "planned as FullAttention" in run.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text(encoding="utf-8"))
    assert report["passed"] is True
