"""Position-free MLA (issue 41, Kimi-Linear): transformers' KimiLinearAttention splits k_rot off the latent and
never rotates it (nor the query's rope part), so the MLA plan keeps its rope cache but the render writes and
attends that part unrotated: the fused writer gets cos 1 / sin 0 and the query's rope part goes through the query
half of the same operator pair (npu_interleave_rope) at cos 1 / sin 0, so both halves keep one lane order whatever
the device's is. Planned, rendered in both modes and validated beside the KDA layers against transformers; two
realistic mistakes of such a port fail by name.
"""

from __future__ import annotations

import json

import pytest
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.implementer.render import render_manifest, write_rendered
from shared_dirs import ROOT

CONFIGS = ROOT / "tests" / "fixtures" / "configs"
KIMI = CONFIGS / "kimi_linear.json"
DISPATCH = {"framework": "部署模式：框架部署", "standalone": "部署模式：独立部署"}
QUERY_REORDER = "        q_pe = torch_npu.npu_interleave_rope("


def test_kimi_linear_plans_position_free_mla_and_deepseek_keeps_its_rope():
    kimi = analyze(AnalyzeRequest(config=str(KIMI)))
    assert kimi.mla.enabled and kimi.mla.absorb and kimi.mla.rope is False
    assert "position-free" in kimi.mla.reason and any("cos 1 / sin 0" in c for c in kimi.mla.constraints)
    # the rope part is still cached: transformers' score is q_nope.k_nope + q_rot.k_rot, k_rot unrotated
    full = next(layer for layer in kimi.layers if not layer.is_state)
    assert [(c.name, c.dim) for c in full.caches] == [("nope_cache", 512), ("rope_cache", 64)]
    deepseek = analyze(AnalyzeRequest(config=str(CONFIGS / "deepseek_v3.json")))
    assert deepseek.mla.rope is True and "position-free" not in deepseek.mla.reason


@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_the_render_takes_no_cos_sin_and_says_so(mode):
    files = render_manifest(analyze(AnalyzeRequest(config=str(KIMI), dispatch=DISPATCH[mode]))).files
    code = files["kvcache_attention.py"]
    assert "def kv_cache_attention(self, q_nope, q_pe, compressed_kv, forward_metadata):" in code
    assert QUERY_REORDER in code and "compressed_kv.new_ones(num_tokens, QK_ROPE_HEAD_DIM)" in code
    assert "`q_pe` unrotated" in files["INTEGRATION.md"] or "leave `q_pe` unrotated" in files["INTEGRATION.md"]
    deepseek = render_manifest(analyze(AnalyzeRequest(config=str(CONFIGS / "deepseek_v3.json"),
                                                      dispatch=DISPATCH[mode]))).files["kvcache_attention.py"]
    assert "def kv_cache_attention(self, q_nope, q_pe, compressed_kv, cos, sin, forward_metadata):" in deepseek
    assert QUERY_REORDER not in deepseek


def _validate(tmp_path, mode: str, edit=None):
    from model_infer_kvcache.validators.pipeline.request_stream import Scenario
    from model_infer_kvcache.validators.pipeline.validate import ValidateRequest, validate

    # 8 MLA and 8 KDA heads of 64 instead of 32 of 128: the KDA layers' transformers reference (float64, torch
    # chunk loops) is what costs; the MLA dims the mistakes below are about stay as published
    config = tmp_path / "kimi_linear.json"
    config.write_text(json.dumps(json.loads(KIMI.read_text(encoding="utf-8")) | {
        "num_attention_heads": 8, "num_key_value_heads": 8, "linear_num_heads": 8, "linear_head_dim": 64}),
        encoding="utf-8")
    manifest = analyze(AnalyzeRequest(config=str(config), dispatch=DISPATCH[mode]))
    assert (manifest.linear_attention.num_v_heads, manifest.linear_attention.head_k_dim) == (8, 64)
    (tmp_path / "manifest.json").write_text(manifest.to_json(), encoding="utf-8")
    write_rendered(render_manifest(manifest), tmp_path / "rendered")
    if edit is not None:
        path = tmp_path / "rendered" / "kvcache_attention.py"
        old, new = edit
        text = path.read_text(encoding="utf-8")
        assert text.count(old) == 1, old
        path.write_text(text.replace(old, new), encoding="utf-8")
    # unequal prompts, a late admission, decode; a short stream for the same reason
    scenario = Scenario(first=((40, 3), (17, 3), (30, 3)), late=((20, 3),), max_concurrency=3, release_requests=4)
    return validate(ValidateRequest(str(tmp_path / "manifest.json"), str(tmp_path / "rendered"), str(config),
                                    backend="emulated", scenario=scenario, sweep_readings=False))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_kimi_linear_passes_beside_its_kda_layers(tmp_path, mode):
    report = _validate(tmp_path, mode)
    assert report.passed, [(c.id, c.detail) for c in report.failed()]
    v301 = next(c for c in report.checks if c.id == "V301")
    assert v301.measured["max_abs_diff"] <= report.tolerance


@pytest.mark.slow
@pytest.mark.parametrize(("edit", "what"), [
    # identity cos/sin handed to the writer, the query's rope part left as it is: the writer reorders k_pe's lanes
    # (the emulation's reading of the pair), so q_pe . k_pe pairs the wrong lanes
    ((QUERY_REORDER, "        _unused = torch_npu.npu_interleave_rope("), "query rope part not reordered like k_pe"),
    # "the latent alone": the rope part dropped from the score, as if the model had no k_rot
    (("            query_rope=q_pe,\n            key_rope=rope,\n", ""), "k_rot left out of the score"),
])
def test_position_free_mistakes_fail_the_numeric_link(tmp_path, edit, what):
    report = _validate(tmp_path, "framework", edit)
    failed = {c.id for c in report.failed()}
    assert "V301" in failed, (what, failed)
