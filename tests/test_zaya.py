"""ZAYA (issue 40): transformers' ZayaDecoderLayer attends through ZayaAttention, whose ZayaCCAProjection keeps two
per-request states beside the layer's KV cache: the last t0 + t1 - 2 q|k inputs of its two convs (conv_state) and the
previous token's v_proj_delayed output (recurrent_state). Planned as parallel layers (the attention's paged KV cache
and FA, then the projection's states in the Mamba group), rendered in both modes, validated against transformers'
ZayaForCausalLM. Each mistake fails by name: the states not reset on slot reuse, the conv state shifted by one, the
delayed value dropped at decode, a conv width read off transformers' module."""

from __future__ import annotations

import json

import pytest
from model_infer_kvcache.analyzer.arch_check import cross_check
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.config_loader import normalize_config
from model_infer_kvcache.implementer.render import render_manifest, write_rendered
from test_hybrid_render import NUMERIC, SHORT, mistake_fails_by_name
from validators_support import check, run_validate

ATTN = "kvcache_attention.py"
# CPU-sized: 4 query / 2 KV heads of 32, 4 experts; the CCA widths stay the class defaults (t0 = t1 = 2)
SMALL = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "num_hidden_layers": 2, "vocab_size": 512, "num_experts": 4, "moe_intermediate_size": 64,
         "router_hidden_size": 32}


def _config(tmp_path, **over):
    from transformers import ZayaConfig

    data = ZayaConfig().to_dict() | over
    if "num_hidden_layers" in over and "layer_types" not in over:
        data["layer_types"] = data["layer_types"][:over["num_hidden_layers"]]
    path = tmp_path / "zaya.json"
    path.write_text(json.dumps(data, default=str), encoding="utf-8")
    return path


# a full layer, then a sliding one (ZayaConfig's "hybrid_sliding": a window beside the same CCA states)
SLIDING = {"layer_types": ["hybrid", "hybrid_sliding"], "sliding_window": 64}


def _case(tmp_path, mode: str, **over):
    manifest = analyze(AnalyzeRequest(config=str(_config(tmp_path, **SMALL, **over)), deploy_mode=mode))
    (tmp_path / "m.json").write_text(manifest.to_json(), encoding="utf-8")
    write_rendered(render_manifest(manifest), tmp_path / "r")
    return tmp_path / "m.json", tmp_path / "r", tmp_path / "zaya.json"


def test_zaya_plans_each_attention_beside_its_cca_states(tmp_path):
    """ZayaConfig() (40 hybrid layers, 8 / 2 heads of 128, cca_time0 = cca_time1 = 2): each decoder layer an
    attention sublayer (paged K/V of 2 heads) then a state sublayer holding conv_state [(8 + 2) x 128, 2] and
    recurrent_state [2, 64] in bfloat16; the memory plan counts both groups."""
    m = analyze(AnalyzeRequest(config=str(_config(tmp_path))))
    assert not m.blockers and m.parallel_hybrid()
    assert [(layer.decoder_layer, layer.attn_type) for layer in m.layers[:2]] == [(0, "FullAttention"), (0, "Mamba")]
    assert len(m.layers) == 80 and len(m.attention_layers) == 40
    lin = m.linear_attention
    assert lin.family == "cca" and lin.layers == list(range(40)) and lin.conv_kernel == 3
    assert [(s.name, s.shape, s.dtype) for s in lin.states] == [("conv_state", [1280, 2], "bfloat16"),
                                                                ("recurrent_state", [2, 64], "bfloat16")]
    groups = {g.attn_type: g for g in m.memory.groups}
    assert groups["Mamba"].state_bytes == 40 * (1280 * 2 + 2 * 64) * 2 and groups["FullAttention"].num_layers == 40
    assert "cca_time0 + cca_time1 - 1 = 3" in lin.source


def test_zaya_cca_plan_off_transformers_projection_fails_the_cross_check_by_name(monkeypatch):
    """Negative control: a reader taking the conv width as cca_time0 + cca_time1 (the two kernels' sum, one input
    more than their receptive field) plans a conv state transformers' ZayaCCAProjection does not keep."""
    from model_infer_kvcache.analyzer import linear_config
    from model_infer_kvcache.analyzer.build import _layers
    from model_infer_kvcache.analyzer.linear_config import CCA, LinearFacts
    from model_infer_kvcache.analyzer.rules import decide_parallel
    from transformers import ZayaConfig

    data = ZayaConfig(num_hidden_layers=2).to_dict()
    monkeypatch.setattr(linear_config, "_read_cca", lambda r, why, heads, head_dim, limits: LinearFacts(
        CCA, 8, 2, 128, 64, 4, 1280, why, None))
    facts = normalize_config(data)
    layers = _layers(facts, decide_parallel(facts, 1, "test"), "paged", "exclusive")
    result = cross_check(data, facts, layers, 128 ** -0.5, "head_dim^-0.5 = 128^-0.5")
    assert any("conv_kernel 4 vs 3" in e for e in result.errors), result.errors


def test_zaya_sliding_layers_are_planned_with_their_window_beside_the_states(tmp_path):
    """A "hybrid_sliding" layer: a SlidingWindow attention sublayer, then the same states; the render registers it
    by the index its attention module keeps (its decoder layer's), not by its place in the manifest's layers."""
    from model_infer_kvcache.implementer.render import render_manifest

    m = analyze(AnalyzeRequest(config=str(_config(tmp_path, **SMALL, **SLIDING))))
    assert [(layer.index, layer.decoder_layer, layer.attn_type, layer.sliding_window) for layer in m.layers] == [
        (0, 0, "FullAttention", None), (1, 0, "Mamba", None), (2, 1, "SlidingWindow", 64), (3, 1, "Mamba", None)]
    assert "SLIDING_LAYERS = frozenset({1})" in render_manifest(m).files[ATTN]


@pytest.mark.parametrize("mode, over", [("framework", {}), ("standalone", {}), ("framework", SLIDING)],
                         ids=["framework", "standalone", "framework-sliding"])
def test_zaya_renders_and_validates_against_transformers(tmp_path, mode, over):
    """Both modes match transformers' ZayaForCausalLM (float64) on a stream with early finishes and late admits into
    freed state slots: the convs and the delayed value in the render, the attention through paged FA (a sliding
    layer's through its window)."""
    manifest, rendered, cfg = _case(tmp_path, mode, **over)
    text = (rendered / ATTN).read_text(encoding="utf-8")
    assert "def cca_project(" in text and ("MambaCacheEntry(" in text) == (mode == "framework")
    report = run_validate(manifest, rendered, cfg, scenario=SHORT)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert check(report, NUMERIC).measured["max_abs_diff"] <= 1e-9


MISTAKES = [
    # the states not reset on slot reuse: a prefill continues from the finished request's q|k inputs and value
    ("prefill-reads-the-states", "framework", r"if forward_metadata\.is_prefill:\n(\s+)history = x\.new_zeros",
     r"if False:\n\1history = x.new_zeros"),
    # the conv state shifted by one: it keeps the inputs one token before the newest ones
    ("conv-state-shifted-by-one", "standalone", r"window\[-\(CONV_KERNEL - 1\):\]", "window[-CONV_KERNEL:-1]"),
    # the delayed value dropped at decode: every decode token's delayed half restarts from v_proj_delayed(0)
    ("delayed-value-dropped-at-decode", "framework",
     r"before = self\.recurrent_state\[slot\]\.reshape\(1, -1\)\.to\(d\.dtype\)",
     "before = v_init.reshape(1, -1).to(d.dtype)"),
]


@pytest.mark.parametrize("case, mode, pattern, replacement", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_zaya_state_mistake_fails_by_name(tmp_path, case, mode, pattern, replacement):
    mistake_fails_by_name(_case(tmp_path, mode), pattern, replacement, NUMERIC)


def test_zaya_sliding_layers_registered_by_manifest_index_fail_by_name(tmp_path):
    """Negative control: a render keying its sliding layers by the manifest's layer index (2: the sliding attention's
    place after layer 0's attention and states) where the module keeps its decoder layer's (1) registers that layer
    as full attention."""
    from test_hybrid_render import LAYERS

    manifest, rendered, cfg = _case(tmp_path, "framework", **SLIDING)
    report = mistake_fails_by_name((manifest, rendered, cfg), r"SLIDING_LAYERS = frozenset\(\{1\}\)",
                                   "SLIDING_LAYERS = frozenset({2})", LAYERS)
    assert "layer 2: (attn_type, window) ('FullAttention', None) != ('SlidingWindow', 64)" in check(report, LAYERS).detail
    assert not check(report, "rendered constants match the manifest").passed


def test_multi_rank_validation_of_a_cca_projection_is_refused_by_name(tmp_path):
    """Validation shards gated delta nets only: a ZAYA layer at attention TP 2 is a gap of kvcache's, said so (the
    plan itself splits the CCA channels by head: 2 query + 1 KV head of 32 per rank)."""
    from model_infer_kvcache.analyzer.errors import InputError

    manifest = analyze(AnalyzeRequest(config=str(_config(tmp_path, **SMALL)), deploy_mode="standalone",
                                      attn_tp_size=2))
    assert {s.name: s.shape for s in manifest.linear_attention.states} == {"conv_state": [96, 2],
                                                                          "recurrent_state": [1, 16]}
    (tmp_path / "m.json").write_text(manifest.to_json(), encoding="utf-8")
    write_rendered(render_manifest(manifest), tmp_path / "r")
    with pytest.raises(InputError, match="not supported by kvcache: multi-rank validation of ZayaCCAProjection"):
        run_validate(tmp_path / "m.json", tmp_path / "r", tmp_path / "zaya.json", scenario=SHORT)


@pytest.mark.parametrize("over, field, words", [
    ({"head_dim": 33, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 128}, "head_dim",
     "must be even"),
    ({"cca_time0": 1, "cca_time1": 1}, "cca_time0", "must be at least 2"),
    ({"cca_time1": 0}, "cca_time1", "positive"),
])
def test_a_bad_cca_field_is_refused_naming_it(tmp_path, over, field, words):
    """An odd head_dim (the value heads' halves), CCA widths keeping no previous input, a zero width: one line naming
    the field."""
    from model_infer_kvcache.analyzer.errors import InputError

    with pytest.raises(InputError) as err:
        analyze(AnalyzeRequest(config=str(_config(tmp_path, **over))))
    assert err.value.field.startswith(field) and words in err.value.message, err.value.render()
