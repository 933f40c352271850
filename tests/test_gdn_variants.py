"""Gated delta nets beyond Qwen3-Next / Qwen3.5 (issue 40): LaraMini (``LaraMiniGatedDeltaNet``, Qwen3.5's mixer
unchanged), OLMo-Hybrid (``OlmoHybridGatedDeltaNet``: separate projections, a g_proj gate, beta doubled under
``linear_allow_neg_eigval``, Dk 96 / Dv 192 that npu_chunk_gated_delta_rule does not take) planned through the one
family table (analyzer/linear_config.py GDN_VARIANTS), rendered and validated against transformers' own mixers; and
Qwen4-Exp, whose mixer is Qwen3.5's beside attention layers that always run a QSA indexer (analyzer/kinds/qsa.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.errors import InputError, NotSupportedByKvcache
from model_infer_kvcache.analyzer.linear_config import GATED_DELTA_NET
from test_hybrid_render import LAYERS, NUMERIC, SHORT, mistake_fails_by_name
from validators_support import check, run_validate


def _class_config(tmp: Path, model_type: str, **over) -> Path:
    from transformers import CONFIG_MAPPING

    path = tmp / f"{model_type}.json"
    path.write_text(json.dumps({**CONFIG_MAPPING[model_type]().to_dict(), **over}, default=str), encoding="utf-8")
    return path


def test_olmo_hybrid_is_a_gated_delta_net_with_doubled_beta_and_a_windowed_prefill(tmp_path):
    """OlmoHybridConfig's defaults: 30 key and value heads, Dk = int(0.75 x 3840 / 30) = 96, Dv 192, conv 4 over
    q|k|v; beta = 2 sigmoid(b); the chunk operator takes Dk = Dv = 128 only, so prefill runs the recurrent
    operator 8 tokens a call."""
    m = analyze(AnalyzeRequest(config=str(_class_config(tmp_path, "olmo_hybrid"))))
    lin = m.linear_attention
    assert (lin.family, lin.num_k_heads, lin.num_v_heads, lin.head_k_dim, lin.head_v_dim, lin.conv_kernel) == \
        (GATED_DELTA_NET, 30, 30, 96, 192, 4)
    assert lin.layers == [i for i in range(32) if i % 4 != 3] and not m.blockers
    assert lin.conv_channels_per_rank == 2 * 30 * 96 + 30 * 192 and lin.beta_scale == 2.0
    assert "npu_recurrent_gated_delta_rule in windows of 8" in lin.operators["prefill"]
    assert "Dk 96 (must be 128)" in lin.operators["prefill"]
    assert "linear_allow_neg_eigval" in lin.source


def test_olmo_hybrid_derives_its_linear_sizes_as_its_config_class_does(tmp_path):
    """A config without the linear sizes: OlmoHybridConfig.__post_init__'s (heads = num_attention_heads, Dk =
    int(0.75 hidden / Nk), Dv = 2 Dk); linear_allow_neg_eigval false keeps beta = sigmoid(b) (no field written)."""
    from transformers import OlmoHybridConfig

    data = OlmoHybridConfig(hidden_size=1024, num_attention_heads=8).to_dict()
    for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"):
        del data[name]
    data["linear_allow_neg_eigval"] = False
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data, default=str), encoding="utf-8")
    lin = analyze(AnalyzeRequest(config=str(path))).linear_attention
    assert (lin.num_k_heads, lin.num_v_heads, lin.head_k_dim, lin.head_v_dim) == (8, 8, 96, 192)
    assert lin.beta_scale is None and "beta_scale" not in json.loads(lin.model_dump_json(exclude_none=True))
    assert "OlmoHybridConfig.__post_init__" in lin.source


def test_lara_mini_is_qwen35s_gated_delta_net_beside_sliding_and_full_layers(tmp_path):
    """LaraMiniConfig's defaults: 8 key / 16 value heads of 128 (the chunk operator's sizes), period-5 layers
    linear, sliding (window 512), linear, full, sliding."""
    m = analyze(AnalyzeRequest(config=str(_class_config(tmp_path, "lara_mini"))))
    lin = m.linear_attention
    assert (lin.num_k_heads, lin.num_v_heads, lin.head_k_dim, lin.head_v_dim) == (8, 16, 128, 128)
    assert lin.beta_scale is None and lin.operators["prefill"].startswith("torch_npu.npu_chunk_gated_delta_rule")
    assert lin.layers == [i for i in range(34) if i % 5 in (0, 2)]
    assert {layer.sliding_window for layer in m.layers if layer.decoder_layer % 5 in (1, 4)} == {512}


def test_qwen4_exp_plans_its_qsa_indexer_beside_qwen35s_gated_delta_net(tmp_path):
    """Qwen4ExpTextAttention builds its QSA indexer whatever the config says: without the indexer fields transformers
    cannot build the model (an input error naming the field); with the released ones, its 30 linear layers are
    Qwen3.5's gated delta net and its 10 attention layers GQA plus QSA's raw and pooled indexer key entries
    (analyzer/kinds/qsa.py); PLE layers are refused by name (two per-request states no kind plans)."""
    with pytest.raises(InputError, match="transformers cannot build the model without them") as err:
        analyze(AnalyzeRequest(config=str(_class_config(tmp_path, "qwen4_exp_text"))))
    assert err.value.field == "indexer_n_heads"
    with pytest.raises(InputError) as err:
        analyze(AnalyzeRequest(config=str(_class_config(tmp_path, "qwen4_exp"))))
    assert err.value.field == "text_config.indexer_n_heads"
    # the released QSA fields and rope (benchmarks/sweep_families.py _PUBLISHED_FIELDS)
    qsa = dict(indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048,
               indexer_compress_ratio=4, rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                                          "partial_rotary_factor": 0.25})
    m = analyze(AnalyzeRequest(config=str(_class_config(tmp_path, "qwen4_exp_text", **qsa))))
    assert m.linear_attention.family == GATED_DELTA_NET and len(m.linear_attention.layers) == 30
    assert (m.qsa.ratio, m.qsa.block_topk, m.qsa.rope_dim, m.qsa.head_dim) == (4, 512, 64, 128)
    assert {tuple((c.name, c.dim, c.num_head) for c in layer.caches) for layer in m.attention_layers} == {(
        ("k_cache", 256, 2), ("v_cache", 256, 2), ("indexer_raw_key_cache", 128, 1),
        ("indexer_block_key_cache", 128, 1))}
    with pytest.raises(NotSupportedByKvcache, match="PLE layers \\[4\\]: each keeps two per-request states") as ple:
        analyze(AnalyzeRequest(config=str(_class_config(tmp_path, "qwen4_exp_text", **qsa, ple_layer_ids=[4]))))
    assert ple.value.field == "ple_layer_ids"
    with pytest.raises(NotSupportedByKvcache, match="indexer_kv_heads 2") as heads:
        analyze(AnalyzeRequest(config=str(_class_config(tmp_path, "qwen4_exp_text", **{**qsa, "indexer_kv_heads": 2}))))
    assert heads.value.field == "indexer_kv_heads"
    from transformers import CONFIG_MAPPING

    text = {**CONFIG_MAPPING["qwen4_exp"]().to_dict()["text_config"], **qsa}
    assert analyze(AnalyzeRequest(config=str(_class_config(tmp_path, "qwen4_exp", text_config=text)))).qsa is not None


# OLMo-Hybrid at 4 layers (3 linear, 1 full), hidden 512 (4 attention heads of 128), 2 linear heads of Dk 32 / Dv 64:
# still no chunk-operator size, so the windowed prefill runs; the doubled beta as published
SMALL_OLMO = {"num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"], "hidden_size": 512,
              "num_attention_heads": 4, "num_key_value_heads": 4, "linear_num_key_heads": 2,
              "linear_num_value_heads": 2, "linear_key_head_dim": 32, "linear_value_head_dim": 64}


def _render(tmp: Path, config: Path, mode: str) -> tuple[Path, Path, Path]:
    """(manifest, rendered dir, config) of ``config`` analyzed in ``mode`` and rendered."""
    from model_infer_kvcache.implementer.render import render_manifest, write_rendered

    manifest = analyze(AnalyzeRequest(config=str(config), deploy_mode=mode))
    (tmp / "manifest.json").write_text(manifest.to_json(), encoding="utf-8")
    write_rendered(render_manifest(manifest), tmp / "rendered")
    return tmp / "manifest.json", tmp / "rendered", config


def _olmo_case(tmp: Path, mode: str):
    from transformers import OlmoHybridConfig

    path = tmp / "olmo_hybrid.json"
    path.write_text(json.dumps({**OlmoHybridConfig().to_dict(), **SMALL_OLMO}, default=str), encoding="utf-8")
    return _render(tmp, path, mode)


@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_olmo_hybrid_validates_against_transformers_mixer(tmp_path, mode):
    manifest, rendered, cfg = _olmo_case(tmp_path, mode)
    text = (rendered / "kvcache_attention.py").read_text(encoding="utf-8")
    assert "BETA_SCALE = 2.0" in text and "PREFILL_WINDOW = 8" in text
    assert "npu_chunk_gated_delta_rule(" not in text
    report = run_validate(manifest, rendered, cfg, scenario=SHORT)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert check(report, NUMERIC).measured["max_abs_diff"] <= 1e-9


OLMO_MISTAKES = [
    # the port keeps Qwen's beta = sigmoid(b): OLMo's doubled beta dropped
    ("beta-not-doubled", r"\n\s+beta = beta \* BETA_SCALE", "", NUMERIC),
    # the windowed prefill continues from the block (a reused one holds a finished request's state)
    ("prefill-block-not-zeroed", r"\n\s+self\.recurrent_state\[first\.long\(\)\] = 0", "", NUMERIC),
    # each window restarts the request's prompt from token 0 of the window's offset - 8: a window overlap
    ("windows-overlap", r"starts\[row\] \+ offset, starts\[row\] \+ offset \+ n",
     "starts[row] + max(offset - 1, 0), starts[row] + max(offset - 1, 0) + n", NUMERIC),
]


@pytest.mark.parametrize("case, pattern, replacement, failing", OLMO_MISTAKES, ids=[m[0] for m in OLMO_MISTAKES])
def test_an_olmo_hybrid_port_mistake_fails_by_name(tmp_path, case, pattern, replacement, failing):
    report = mistake_fails_by_name(_olmo_case(tmp_path, "framework"), pattern, replacement, failing)
    assert check(report, LAYERS).passed


def test_lara_mini_validates_with_qwen35s_mixer(tmp_path):
    """LaraMini at 4 layers (linear, sliding, linear, full: the published period cut short), its full layer without
    RoPE (the model's own q/k path around the render)."""
    from transformers import LaraMiniConfig

    path = tmp_path / "lara_mini.json"
    data = LaraMiniConfig(num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
                          num_experts=4, num_experts_per_tok=2).to_dict()
    path.write_text(json.dumps(data, default=str), encoding="utf-8")
    manifest, rendered, cfg = _render(tmp_path, path, "standalone")
    text = (rendered / "kvcache_attention.py").read_text(encoding="utf-8")
    assert "npu_chunk_gated_delta_rule(" in text and "BETA_SCALE" not in text
    report = run_validate(manifest, rendered, cfg, scenario=SHORT)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert check(report, NUMERIC).measured["max_abs_diff"] <= 1e-9


def test_a_misread_gdn_size_or_beta_is_refused_by_the_cross_check(tmp_path, monkeypatch):
    """The meta-device cross-check reads each gated delta net's heads, dims, conv and beta scale: an analyzer that
    missed OLMo-Hybrid's doubled beta is refused naming it and the module; sizes transformers builds alike pass."""
    import dataclasses

    from model_infer_kvcache.analyzer import linear_config

    config = _class_config(tmp_path, "olmo_hybrid")
    olmo = linear_config.GDN_VARIANTS["olmo_hybrid"]
    monkeypatch.setitem(linear_config.GDN_VARIANTS, "olmo_hybrid", dataclasses.replace(olmo, beta_scale=None))
    with pytest.raises(InputError, match=r"gdn_beta_scale 1 vs 2 on 24 layer\(s\).*OlmoHybridGatedDeltaNet|"
                                         r"OlmoHybridGatedDeltaNet.*gdn_beta_scale 1 vs 2 on 24 layer\(s\)"):
        analyze(AnalyzeRequest(config=str(config)))
    monkeypatch.setitem(linear_config.GDN_VARIANTS, "olmo_hybrid", olmo)
    data = json.loads(config.read_text())
    data["linear_key_head_dim"] = 128  # the config says 128, and transformers builds 128: they agree
    config.write_text(json.dumps(data))
    assert analyze(AnalyzeRequest(config=str(config))).linear_attention.head_k_dim == 128


@pytest.mark.parametrize("model_type", ["lara_mini", "olmo_hybrid"])
def test_layer_types_left_out_are_derived_by_the_config_class(tmp_path, model_type):
    """LaraMiniConfig / OlmoHybridConfig fill layer_types in __post_init__: a config without it plans the same layers
    (read from the class, not guessed; before, every layer was planned full and the cross-check refused it)."""
    listed = analyze(AnalyzeRequest(config=str(_class_config(tmp_path, model_type))))
    data = json.loads((tmp_path / f"{model_type}.json").read_text())
    del data["layer_types"]
    path = tmp_path / "no_layer_types.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    derived = analyze(AnalyzeRequest(config=str(path)))
    assert [layer.attn_type for layer in derived.layers] == [layer.attn_type for layer in listed.layers]
    assert derived.linear_attention.layers == listed.linear_attention.layers
    assert "derived by transformers" in derived.model.sources["layer_kinds"]


def test_olmo_hybrid_multi_rank_validation_is_refused_by_name(tmp_path):
    """Attention TP 2 plans OLMo-Hybrid's states per rank, but the multi-rank validation shards only the fused
    Qwen3-Next / Qwen3.5 projections: a refusal naming the module, not an AttributeError from a rank."""
    from model_infer_kvcache.implementer.render import render_manifest, write_rendered
    from model_infer_kvcache.validators.pipeline.validate import ValidateRequest, validate
    from transformers import OlmoHybridConfig

    path = tmp_path / "olmo_hybrid.json"
    path.write_text(json.dumps({**OlmoHybridConfig().to_dict(), **SMALL_OLMO}, default=str), encoding="utf-8")
    manifest = analyze(AnalyzeRequest(config=str(path), deploy_mode="framework", attn_tp_size=2))
    assert manifest.linear_attention.num_k_heads_per_rank == 1
    (tmp_path / "m.json").write_text(manifest.to_json(), encoding="utf-8")
    write_rendered(render_manifest(manifest), tmp_path / "r")
    # the rank's refusal comes back through the launcher as an input error carrying its words
    with pytest.raises(InputError, match="not supported by kvcache: multi-rank validation of OlmoHybridGatedDeltaNet") \
            as err:
        validate(ValidateRequest(manifest=str(tmp_path / "m.json"), rendered=str(tmp_path / "r"), config=str(path),
                                 backend="emulated", scenario=SHORT, sweep_readings=False, attn_tp_size=2))
    assert err.value.field == "attn_tp_size"


def test_olmo_hybrid_integration_steps_say_who_doubles_beta(tmp_path):
    """The porter's INTEGRATION.md: pass sigmoid(b), the render doubles it (doubling in the model too is 4x), and
    prefill runs the recurrent operator in windows; Qwen-sized renders say neither."""
    _, rendered, _ = _olmo_case(tmp_path, "framework")
    steps = (rendered / "INTEGRATION.md").read_text(encoding="utf-8")
    assert "Pass `beta = sigmoid(b)` even though the model doubles it" in steps and "BETA_SCALE = 2.0" in steps
    assert "Prefill runs `npu_recurrent_gated_delta_rule` 8 tokens per request a call" in steps
    (tmp_path / "lara").mkdir()
    _, lara, _ = _render(tmp_path / "lara", _class_config(tmp_path, "lara_mini"), "framework")
    assert "BETA_SCALE" not in (lara / "INTEGRATION.md").read_text(encoding="utf-8")
    assert "Prefill runs" not in (lara / "INTEGRATION.md").read_text(encoding="utf-8")
