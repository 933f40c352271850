"""Families the family sweep refused that transformers' own code shows kvcache can plan (issue 40).

Learnable sinks: gpt-oss, and the three transformers ships without a config field saying so (Flint, Granite-SWA,
GraniteMoE-SWA: their modeling code holds ``self.sinks``; Granite's ``sigmoid(logsumexp - sink)`` scaling is the same
extra softmax logit). They were refused by the cross-check ("attention sinks: analyzer none"); now planned with FA
v2's learnable_sink and validated. Gemma-4 Unified: Gemma-4's attention under another model_type."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from validators_support import check, mistaken_report, mutate, run_validate

FAMILIES = ("flint", "granite_swa", "granitemoe_swa")


def _config(tmp: Path, model_type: str) -> Path:
    from transformers import CONFIG_MAPPING

    path = tmp / f"{model_type}.json"
    path.write_text(json.dumps(CONFIG_MAPPING[model_type]().to_dict()), encoding="utf-8")
    return path


BERT_SMALL = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=512,
                  is_decoder=True)


def _small_case(tmp_path: Path, model_type: str, small: dict, mode: str):
    """A family's class config with ``small`` over it, analyzed in ``mode`` and rendered: (manifest path, rendered
    dir, config path, manifest)."""
    from model_infer_kvcache.implementer.render import render_manifest, write_rendered

    config = _config(tmp_path, model_type)
    config.write_text(json.dumps(json.loads(config.read_text()) | small), encoding="utf-8")
    manifest = analyze(AnalyzeRequest(config=str(config), deploy_mode=mode))
    (tmp_path / "m.json").write_text(manifest.to_json(), encoding="utf-8")
    write_rendered(render_manifest(manifest), tmp_path / "r")
    return tmp_path / "m.json", tmp_path / "r", config, manifest


def _passes(case):
    report = run_validate(*case[:3])
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    return report


def _looped_case(tmp_path: Path, m, config: Path, own: int, later: int):
    """A plan whose layers are called several times (Dory's loops, HRM's cycles): cut to its ``own`` first calls, the
    manifest invariant refuses it naming the ``later`` calls; as planned, rendered and validated it passes with every
    call's module registered. Returns the (manifest, render, config) case."""
    from model_infer_kvcache.analyzer.manifest import SelectionManifest
    from model_infer_kvcache.implementer.render import render_manifest, write_rendered

    data = json.loads(m.to_json())
    data["layers"] = data["layers"][:own]
    with pytest.raises(ValueError, match=rf"layers: {own} entries .* \+ {later} for the layers' later calls = "
                                         rf"{own + later}"):
        SelectionManifest.model_validate(data)
    (tmp_path / "m.json").write_text(m.to_json(), encoding="utf-8")
    write_rendered(render_manifest(m), tmp_path / "r")
    case = (tmp_path / "m.json", tmp_path / "r", config)
    assert check(_passes(case), "get_cache_info layer count").passed
    return case


@pytest.mark.parametrize("model_type", FAMILIES)
def test_sink_families_are_planned_with_their_sinks(tmp_path, model_type):
    m = analyze(AnalyzeRequest(config=str(_config(tmp_path, model_type))))
    assert m.model.has_sinks and m.fa.version == "v2" and not m.blockers
    assert "sinks" in m.model.sources["has_sinks"]


@pytest.mark.slow
def test_granite_swa_validates_with_its_sinks_and_fails_without_them(tmp_path):
    from model_infer_kvcache.implementer.render import render_manifest, write_rendered

    config = _config(tmp_path, "granite_swa")
    manifest = analyze(AnalyzeRequest(config=str(config), deploy_mode="framework"))
    (tmp_path / "m.json").write_text(manifest.to_json(), encoding="utf-8")
    for name, drop in (("clean", False), ("no_sink", True)):
        rendered = tmp_path / name
        write_rendered(render_manifest(manifest), rendered)
        if drop:  # the port that forgets the sinks: FA without learnable_sink
            mutate(rendered, r"\n\s+learnable_sink=self\.sinks,", "")
        report = run_validate(tmp_path / "m.json", rendered, config)
        numeric = check(report, "logits vs transformers")
        assert numeric.passed == (not drop), (name, [(c.name, c.detail) for c in report.failed()])


def test_gemma4_unified_is_planned_as_the_gemma4_family(tmp_path):
    """Gemma-4 Unified runs Gemma4's attention (q/k RMS-normed, scores unscaled: its module's scaling is 1, the
    per-layer global head_dim): planned as the gemma4 family, which the cross-check against transformers' own
    modules confirms (it refused the head_dim^-0.5 plan before); its per-layer shapes are recorded and rendered
    per layer as Gemma-4's (tests/test_per_layer_render.py)."""
    from model_infer_kvcache.implementer.render import render_manifest

    for model_type in ("gemma4_unified", "gemma4_unified_text"):
        m = analyze(AnalyzeRequest(config=str(_config(tmp_path, model_type))))
        assert m.fa.softmax_scale == 1.0 and m.model.family == "gemma4"
        shaped = [layer for layer in m.layers if layer.head_dim]  # the global layers' own head_dim
        assert shaped
        text = render_manifest(m).files["kvcache_attention.py"]
        assert f"{shaped[0].index}: ({shaped[0].head_dim}, " in text.split("LAYER_SHAPES = ", 1)[1].split("\n")[0]


@pytest.mark.slow
def test_opt_queries_prescaled_by_the_module_attend_at_scale_one(tmp_path):
    """OPT scales its queries itself (``q_proj(x) * self.scaling``) and calls attention with ``scaling=1.0``: the
    attention call over its queries scales by 1. Planned at head_dim^-0.5 it was scaled twice (V207 and the numeric
    link failed in ``kvcache run``); now planned at 1, confirmed by the cross-check, and validated. Negative control:
    the cross-check refuses a plan at head_dim^-0.5, naming the module's scaling=1.0 call."""
    from model_infer_kvcache.analyzer import arch_check
    from model_infer_kvcache.analyzer.config_loader import normalize_config
    from model_infer_kvcache.implementer.render import render_manifest, write_rendered

    config = _config(tmp_path, "opt")
    manifest = analyze(AnalyzeRequest(config=str(config), deploy_mode="framework"))
    assert manifest.fa.softmax_scale == 1.0 and "pre-scaled" in manifest.fa.scale_derivation
    (tmp_path / "m.json").write_text(manifest.to_json(), encoding="utf-8")
    write_rendered(render_manifest(manifest), tmp_path / "rendered")
    report = run_validate(tmp_path / "m.json", tmp_path / "rendered", config)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]

    raw = json.loads(config.read_text(encoding="utf-8"))
    facts = normalize_config(raw, str(config))
    errors = arch_check.cross_check(raw, facts, manifest.layers, 64 ** -0.5, "head_dim^-0.5 = 64^-0.5").errors
    assert len(errors) == 1 and "softmax scale: analyzer 0.125" in errors[0] and "vs transformers 1 " in errors[0] \
        and "scaling=1.0" in errors[0], errors


def test_per_layer_lists_named_without_layer_follow_the_tiny_prefix(tmp_path):
    """Ling-3.0 (transformers' bailing_hybrid) at its defaults crashed `kvcache run` (exit 3): its saved config holds
    one swiglu limit per decoder layer under names without "layer" (expert_swiglu_limit_list), which the tiny model
    kept at the real layer count and transformers refused. They follow the prefix now; the tiny config builds."""
    import transformers
    from model_infer_kvcache.validators.pipeline.tiny_model import tiny_config_dict

    path = _config(tmp_path, "bailing_hybrid")
    real = json.loads(path.read_text(encoding="utf-8"))
    assert len(real["expert_swiglu_limit_list"]) == real["num_hidden_layers"]
    d, plan = tiny_config_dict(real, analyze(AnalyzeRequest(config=str(path))))
    assert len(d["expert_swiglu_limit_list"]) == len(d["share_expert_swiglu_limit_list"]) == plan.num_layers \
        < real["num_hidden_layers"]
    transformers.AutoConfig.for_model(**d)  # what raised "`swiglu_limits` must contain one limit per decoder layer"


def test_families_spelling_heads_and_layers_their_own_way_are_read_and_mpt_refused_by_its_alibi(tmp_path):
    """MPT (``n_heads`` / ``n_layers``, ALiBi in its nested ``attn_config``) and XGLM (``attention_heads`` /
    ``num_layers``) were refused for a field kvcache did not read; now MPT is planned Legacy with the device-side
    blocker (the paged FA path takes no ALiBi bias), XGLM planned paged. The decoder of an encoder-decoder family
    (BART's ForCausalLM) reads its own ``decoder_layers`` / ``decoder_attention_heads``, never the encoder's."""
    mpt = analyze(AnalyzeRequest(config=str(_config(tmp_path, "mpt"))))
    assert mpt.kv_mode.value == "legacy" and any("ALiBi" in b.message for b in mpt.blockers)
    assert (mpt.model.num_layers, mpt.model.num_attention_heads) == (24, 16)
    assert mpt.model.sources["num_attention_heads"] == "n_heads"
    xglm = analyze(AnalyzeRequest(config=str(_config(tmp_path, "xglm"))))
    assert xglm.kv_mode.value == "paged" and (xglm.model.num_layers, xglm.model.num_attention_heads) == (24, 16)
    from model_infer_kvcache.analyzer.config_loader import normalize_config
    from transformers import BartConfig

    bart = BartConfig(encoder_layers=3, encoder_attention_heads=4, decoder_layers=5, decoder_attention_heads=8).to_dict()
    facts = normalize_config(bart, "<bart>")
    assert (facts.num_layers.value, facts.num_attention_heads.value) == (5, 8)
    assert (facts.num_layers.source, facts.num_attention_heads.source) == ("decoder_layers", "decoder_attention_heads")


def test_a_config_transformers_itself_cannot_build_is_refused_naming_transformers_not_kvcache(tmp_path):
    """DBRX's class defaults: transformers' own DbrxAttention reads attn_config.rope_theta, which DbrxAttentionConfig
    does not default. `kvcache run` says transformers fails on the config as written, in one line, exit 2 (it
    blamed kvcache's shrinking before)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "model_infer_kvcache", "run", "--config",
                           str(_config(tmp_path, "dbrx")), "--out", str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-500:]
    assert "'s dbrx does not build from this config as written (AttributeError" in proc.stderr
    assert "raised at models/dbrx/modeling_dbrx.py:" in proc.stderr  # the line of transformers that failed
    assert "kvcache does not shrink" not in proc.stderr


# num_key_value_heads None: the published config.json has no top-level field (DbrxConfig.to_dict() writes one)
DBRX_SMALL = dict(d_model=256, n_heads=4, n_layers=2, max_seq_len=2048, num_key_value_heads=None,
                  attn_config={"clip_qkv": 8, "kv_n_heads": 2, "rope_theta": 500000},
                  ffn_config={"ffn_hidden_size": 10752, "moe_num_experts": 16, "moe_top_k": 4})


def test_dbrx_reads_its_kv_heads_from_attn_config_and_validates(tmp_path):
    """DBRX keeps its KV heads in the nested attn_config (kv_n_heads) and its expert sizes in ffn_config: it was
    planned MHA (one KV head per query head, 6x the cache of the published GQA-8 model) and its tiny model was built
    at the published 10752-wide experts (the run was killed for memory). Now 2 KV heads from attn_config, the nested
    widths shrunk, and the render validates against transformers."""
    case = _small_case(tmp_path, "dbrx", DBRX_SMALL, "standalone")
    manifest = case[3]
    assert (manifest.model.num_key_value_heads, manifest.model.sources["num_key_value_heads"]) == (
        2, "attn_config.kv_n_heads")
    _passes(case)


def test_a_fused_qkv_module_planned_with_the_wrong_kv_heads_is_refused_by_the_cross_check(tmp_path):
    """Negative control for the cross-check of fused-QKV modules (DBRX's Wqkv): without kv_n_heads the analyzer's
    MHA default meets transformers' DbrxAttentionConfig default of 1 KV head, and the plan is refused by name."""
    from model_infer_kvcache.analyzer.errors import InputError

    small = {**DBRX_SMALL, "attn_config": {"clip_qkv": 8, "rope_theta": 500000}}
    with pytest.raises(InputError, match=r"KV cache per rank \(key dim, KV heads, value dim\): analyzer \(64, 4, 64\) "
                                         r"vs transformers \(64, 1, 64\) \(DbrxAttention"):
        _small_case(tmp_path, "dbrx", small, "standalone")


def test_minicpm5_moe_attention_is_found_by_its_fused_query_gate(tmp_path):
    """MiniCPM5-MoE projects the query and its output gate in one ``q_gate_proj`` (no q_proj): the structural finder
    knows that projection set, so the cross-check compares transformers' modules with the plan (it refused the
    family as holding no attention module). Without the entry the same config is refused again."""
    from model_infer_kvcache.analyzer import arch_check, hf_layout
    from model_infer_kvcache.analyzer.errors import InputError

    config = _config(tmp_path, "minicpm5_moe")
    m = analyze(AnalyzeRequest(config=str(config)))
    assert not m.blockers and m.kv_mode.value == "paged"
    assert {layer.attn_type for layer in m.layers} == {"FullAttention"}
    kept = tuple(p for p in hf_layout.QKV_PROJECTIONS if "q_gate_proj" not in p)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_layout, "QKV_PROJECTIONS", kept)
        mp.setenv("KVCACHE_CACHE_DIR", "")  # no cached cross-check entry: transformers' modules are read again
        arch_check._hf_attentions.cache_clear()  # nor the in-process memo of the first analyze
        with pytest.raises(InputError, match="no decoder block holding an attention module"):
            analyze(AnalyzeRequest(config=str(config)))


@pytest.mark.parametrize("model_type", ["roberta", "rembert", "big_bird"])
def test_bert_era_class_defaults_are_encoders_and_refused_by_is_decoder(tmp_path, model_type):
    """RobertaForCausalLM & co. attend causally only with is_decoder true (their own __init__ warns "add
    `is_decoder=True`"); at the class defaults they are bidirectional encoders, which no KV cache can serve. The
    paged plan kvcache gave them failed validation (roberta: FAILED in both modes, measured). Refused naming
    is_decoder; the same config with is_decoder true is the causal LM and is planned."""
    from model_infer_kvcache.analyzer.errors import InputError

    config = _config(tmp_path, model_type)
    with pytest.raises(InputError) as err:
        analyze(AnalyzeRequest(config=str(config)))
    assert err.value.field == "is_decoder" and "bidirectional encoder" in err.value.message
    config.write_text(json.dumps(json.loads(config.read_text()) | {"is_decoder": True}), encoding="utf-8")
    m = analyze(AnalyzeRequest(config=str(config)))
    assert not m.blockers and m.kv_mode.value == "paged"


def test_is_decoder_false_is_no_encoder_where_the_class_does_not_read_it(tmp_path):
    """Decoder-only classes never read is_decoder (PretrainedConfig's default false): Llama stays planned."""
    config = _config(tmp_path, "llama")
    config.write_text(json.dumps(json.loads(config.read_text()) | {"is_decoder": False}), encoding="utf-8")
    assert not analyze(AnalyzeRequest(config=str(config))).blockers


def test_reformer_that_will_not_build_without_is_decoder_is_refused_by_it(tmp_path):
    from model_infer_kvcache.analyzer.errors import InputError

    with pytest.raises(InputError) as err:
        analyze(AnalyzeRequest(config=str(_config(tmp_path, "reformer"))))
    assert err.value.field == "is_decoder" and "refuses to build" in err.value.message


@pytest.mark.slow
def test_roberta_decoder_validates_with_its_position_offset_and_fails_without(tmp_path, monkeypatch):
    """RobertaEmbeddings number positions from padding_idx + 1 when they derive them from the ids (how transformers
    runs the reference); the engine hands 0-based positions, so the host adds the model's offset as a port must.
    Measured before the offset: roberta (is_decoder true) FAILED V301 from step 0, layer 0. Negative control: the
    host without the offset fails the logits check again."""
    from model_infer_kvcache.validators.pipeline import host_model

    case = _small_case(tmp_path, "roberta", BERT_SMALL, "framework")
    _passes(case)
    monkeypatch.setattr(host_model, "position_offset", lambda _model: 0)
    assert not check(run_validate(*case[:3]), "logits vs transformers").passed


@pytest.mark.slow
def test_big_bird_decoder_routes_its_own_score_code_and_fails_with_the_wrong_scale(tmp_path, monkeypatch):
    """BigBird's causal LM (is_decoder true; original_full, as transformers switches a decoder with a cache) computes
    its scores inside BigBirdSelfAttention (query / key / value, then torch.matmul over sqrt(head size)), like RemBert
    and MegatronBert: the host routes the module's own projections through the rendered attention. Measured before
    the route: `kvcache run` refused it ('not understood by the validation host'). Negative control: the route's
    scale taken as 1 / head size instead of 1 / sqrt(head size) fails the logits check."""
    from model_infer_kvcache.validators.pipeline import host_model

    case = _small_case(tmp_path, "big_bird", BERT_SMALL | {"attention_type": "original_full"}, "framework")
    assert host_model._ROUTED_FORWARD["bert_qkv"] is host_model._bert_qkv_forward
    _passes(case)
    routed = host_model._gqa_attention
    monkeypatch.setattr(host_model, "_gqa_attention",
                        lambda module, q, k, v, mask, scaling=None, **kw: routed(module, q * scaling, k, v, mask,
                                                                                  scaling=scaling, **kw))
    assert not check(run_validate(*case[:3]), "logits vs transformers").passed


@pytest.mark.slow
def test_roformer_decoder_rotates_each_token_at_its_own_position(tmp_path, monkeypatch):
    """RoFormer (is_decoder true) rotates q / k inside its self-attention by sinusoidal angles its encoder computes for
    positions 0..S-1 of the batch it is given: right for a whole request, wrong for the engine's packed step. The
    host looks each token's angles up at its own position (host_model.sinusoidal_table), as a port must. Negative
    control: the angles of the packed step's row numbers (what the encoder hands a packed batch) fail the logits."""
    import torch
    from model_infer_kvcache.validators.pipeline import host_model

    case = _small_case(tmp_path, "roformer", BERT_SMALL | {"embedding_size": 64}, "standalone")
    _passes(case)
    own = host_model._positions
    monkeypatch.setattr(host_model, "_positions", lambda: torch.arange(own().numel()))
    assert not check(run_validate(*case[:3]), "logits vs transformers").passed


@pytest.mark.slow
def test_ctrl_is_planned_and_its_stream_stays_within_its_256_positions(tmp_path, monkeypatch):
    """CTRL names its projections Wq / Wk / Wv (analyzer/hf_layout.QKV_PROJECTIONS) and learns 256 positions
    (n_positions): the validation stream's 300-token prompts are cut to fit them (Scenario.within_positions).
    Before: refused at the cross-check ('no decoder block holding an attention module'), then, recognised, FAILED
    V201 (IndexError: index 256 is out of bounds). Negative control: the uncut stream indexes past the table."""
    from model_infer_kvcache.validators.pipeline.request_stream import Scenario

    case = _small_case(tmp_path, "ctrl", dict(n_layer=2, n_embd=64, n_head=4, dff=128, vocab_size=512), "framework")
    assert case[3].model.max_position_embeddings == 256 and not case[3].blockers
    report = _passes(case)
    assert check(report, "logits vs transformers").measured["longest_prefill"] <= 256
    assert any(n.startswith("request stream cut to the model's 256 positions") for n in report.notes), report.notes
    monkeypatch.setattr(Scenario, "within_positions", lambda self, _max: self)
    assert "index 256 is out of bounds" in check(run_validate(*case[:3]), "rendered code runs").detail


# GQA (two query heads per KV head), so the query halves' grouping is exercised; not CPU-shrunk (hidden 64)
DIFFLLAMA_SMALL = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                       intermediate_size=128, vocab_size=512)
DIFF_ATTN = "kvcache_attention.py"


def test_diffllama_plans_its_differential_layout_at_no_extra_memory(tmp_path):
    """DiffLlama's attention calls transformers' attention interface twice over one K, with V's KV-head halves
    broadcast after the cache update: query head i (KV head j) reads value heads j mod k/2 and j mod k/2 + k/2, which
    one paged FA call (key head j with value head j) cannot pair. Before: refused at analyze ("differential
    attention"). Now planned (analyzer/kinds/diff.py): K and V each as two half-head caches in the layer's blocks,
    four FA calls of half the query heads; the four hold K/V once (the memory plan counts what plain GQA's K/V
    cost)."""
    m = _small_case(tmp_path, "diffllama", DIFFLLAMA_SMALL, "framework")[3]
    assert m.differential is not None and not m.blockers
    assert m.differential.half_kv_heads == 2 and m.differential.half_q_heads == 4
    for layer in m.attention_layers:
        assert [(c.name, c.num_head, c.dim) for c in layer.caches] == [
            ("k_cache", 2, 16), ("v_cache", 2, 16), ("k_cache_hi", 2, 16), ("v_cache_hi", 2, 16)]
    # bfloat16: 2 layers x (K + V) x 4 KV heads x 16 dims x 2 bytes
    assert m.memory.per_token_bytes == 2 * 2 * 4 * 16 * 2
    assert "npu_fused_infer_attention_score" in m.differential.source and ":8285" in m.differential.source


def test_diffllama_refusal_stays_for_a_module_calling_the_interface_twice_otherwise(tmp_path, monkeypatch):
    """Negative control of the cross-check: a module calling the interface twice that is not DiffLlama's pattern
    (here: DiffLlama's forward with its lambdas and group norm unseen, so planned as plain GQA, as another model_type
    would be) is still refused by name."""
    from model_infer_kvcache.analyzer import arch_check
    from model_infer_kvcache.analyzer.errors import NotSupportedByKvcache
    from model_infer_kvcache.analyzer.kinds import diff

    monkeypatch.setenv("KVCACHE_CACHE_DIR", "")
    monkeypatch.setattr(diff, "HF_PARTS", (*diff.HF_PARTS, "no_such_part"))
    monkeypatch.setattr(diff, "read_facts", lambda *args, **kwargs: None)
    arch_check._hf_attentions.cache_clear()
    try:
        with pytest.raises(NotSupportedByKvcache) as err:
            _small_case(tmp_path, "diffllama", DIFFLLAMA_SMALL, "framework")
    finally:
        arch_check._hf_attentions.cache_clear()
    assert "differential attention: transformers' DiffLlamaAttention.forward calls the attention interface 2 times" \
        in err.value.message and "npu_fused_infer_attention_score" in err.value.message
    # one call per forward (Llama) or two in branches of an if / else (a vision tower's backends): not counted
    assert arch_check._attention_calls(type("M", (), {"forward": _one_of_two_backends})()) == {}


def test_diffllama_refuses_what_its_layout_does_not_plan_by_name(tmp_path):
    """Attention TP whose ranks cannot hold the same slice of both KV-head halves (4 KV heads over 4 ranks: one head a
    rank) and a Legacy cache (the four half-head caches render paged only) are refused at analyze naming the option;
    an odd KV head count by its field (DiffLlamaAttention.__init__ refuses it too). TP 2 is planned."""
    from model_infer_kvcache.analyzer.errors import InputError

    config = _config(tmp_path, "diffllama")
    config.write_text(json.dumps(json.loads(config.read_text()) | DIFFLLAMA_SMALL), encoding="utf-8")
    assert analyze(AnalyzeRequest(config=str(config), attn_tp_size=2)).differential.half_kv_heads == 1
    for kw, field, words in (({"attn_tp_size": 4}, "--attn-tp-size", "multiple of 2 x attn_tp_size = 8"),
                             ({"kv_mode": "legacy"}, "--kv-mode", "rendered paged only")):
        with pytest.raises(InputError) as err:
            analyze(AnalyzeRequest(config=str(config), **kw))
        assert err.value.where == field and words in err.value.message, (kw, str(err.value))
    config.write_text(json.dumps(json.loads(config.read_text()) | {"num_key_value_heads": 1, "num_attention_heads": 3}),
                      encoding="utf-8")
    with pytest.raises(InputError) as err:
        analyze(AnalyzeRequest(config=str(config)))
    assert err.value.field == "num_key_value_heads" and "needs an even count" in err.value.message


def test_a_diffllama_manifest_without_a_value_half_is_refused_by_path(tmp_path):
    """A hand edit dropping the high value half (or leaving the halves at the full head count) would leave half the
    value heads unwritten: the manifest's invariant refuses it naming the layer's caches."""
    from model_infer_kvcache.analyzer.manifest import SelectionManifest

    data = json.loads(_small_case(tmp_path, "diffllama", DIFFLLAMA_SMALL, "framework")[3].to_json())
    SelectionManifest.model_validate(data)
    dropped = json.loads(json.dumps(data))
    dropped["layers"][1]["caches"] = [c for c in dropped["layers"][1]["caches"] if c["name"] != "v_cache_hi"]
    with pytest.raises(ValueError, match=r"layers\[1\]\.caches: decoder layer 1 holds .*differential attention plans"):
        SelectionManifest.model_validate(dropped)
    whole = json.loads(json.dumps(data))
    whole["layers"][0]["caches"][3]["num_head"] = 4
    with pytest.raises(ValueError, match=r"layers\[0\]\.caches\[3\]\.num_head: 4 is not 2"):
        SelectionManifest.model_validate(whole)


def test_the_cross_check_compares_a_differential_plan_with_the_module(tmp_path):
    """analyzer/arch_check.py: DiffLlama's module (its lambdas and group norm) against the plan's four half-head
    caches; a plain K/V plan of such a module is off (GQA names another format's parts), the diff plan of a module
    without them too. The checkout run refuses the format by name (it routes no differential attention yet)."""
    import types

    from model_infer_kvcache.analyzer.errors import NotSupportedByKvcache
    from model_infer_kvcache.analyzer.kinds import diff, gqa
    from model_infer_kvcache.analyzer.manifest import CacheSpec
    from model_infer_kvcache.validators.checkout_run.support import preflight

    module = types.SimpleNamespace(**dict.fromkeys(diff.HF_PARTS, 0))
    assert diff.FORMAT.hf_facts(module) == {diff.HF_FACT: 1}
    assert diff.FORMAT.hf_facts(types.SimpleNamespace(lambda_q1=0)) == {}
    halves = types.SimpleNamespace(caches=[CacheSpec(name=n, dim=16, num_head=2, dtype="bfloat16")
                                           for n in diff.DIFF_CACHES])
    plain = types.SimpleNamespace(caches=halves.caches[:2])
    assert diff.FORMAT.hf_off(halves, {diff.HF_FACT: 1}, "DiffLlamaAttention") is None
    assert "analyzer plans plain K/V vs transformers DiffLlamaAttention with its lambdas" in \
        diff.FORMAT.hf_off(plain, {diff.HF_FACT: 1}, "DiffLlamaAttention")
    assert "without its lambdas" in diff.FORMAT.hf_off(halves, {}, "M")
    assert "another format's parts" in gqa.FORMAT.hf_off(plain, {diff.HF_FACT: 1}, "DiffLlamaAttention")
    m = _small_case(tmp_path, "diffllama", DIFFLLAMA_SMALL, "framework")[3]
    with pytest.raises(NotSupportedByKvcache, match="routes no differential attention yet"):
        preflight("config.json", m)


def test_diffllama_ranks_hold_the_same_slice_of_both_head_halves():
    """Attention TP 2 (the multi-rank run, validators/kinds/diff.shard_attention): each rank keeps the same slice of
    the low and the high halves of its query and KV heads (value heads k/2 apart must meet on one rank); the ranks'
    o_proj outputs, summed, are transformers' module output. Negative control: GQA's contiguous share (rank 0 all
    low heads) does not sum to it. `kvcache run --attn-tp-size 2` on this config PASSED (9.2e-15, both ranks)."""
    import copy
    import types

    import torch
    from model_infer_kvcache.validators.kinds import diff as diff_checks
    from model_infer_kvcache.validators.kinds import gqa as gqa_checks
    from transformers import DiffLlamaConfig
    from transformers.models.diffllama.modeling_diffllama import DiffLlamaAttention, DiffLlamaRotaryEmbedding

    config = DiffLlamaConfig(**DIFFLLAMA_SMALL)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = DiffLlamaAttention(config, layer_idx=1).double()
    x = torch.randn(1, 6, 64, dtype=torch.float64)
    rope = DiffLlamaRotaryEmbedding(config)(x, torch.arange(6)[None])
    want = attn(x, rope, None)[0]
    model = types.SimpleNamespace(head_dim=16, num_attention_heads=8, num_key_value_heads=4)

    def summed(shard):
        out = torch.zeros_like(want)
        for rank in range(2):
            part, heads = copy.deepcopy(attn), slice(rank * 4, (rank + 1) * 4)
            d = shard(part, model, heads, rank, 2)
            part.o_proj.weight = torch.nn.Parameter(part.o_proj.weight.data[:, heads.start * d:heads.stop * d])
            out += part(x, rope, None)[0]
        return out

    assert (summed(diff_checks.shard_attention) - want).abs().max() < 1e-12
    assert (summed(gqa_checks.shard_attention) - want).abs().max() > 1e-3


def _one_of_two_backends(self, x):
    if x is None:
        out = attention_interface(self, x)  # noqa: F821 - read as source only
    else:
        out = attention_interface(self, x, x)  # noqa: F821
    return out


@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_diffllama_renders_four_fa_calls_and_matches_transformers(tmp_path, mode):
    """The render writes the four half-head caches and makes four FA calls a layer and step (V209: num_heads and
    num_key_value_heads halved); the host route runs the module's lambda, group norm and o_proj around it."""
    case = _small_case(tmp_path, "diffllama", DIFFLLAMA_SMALL, mode)
    text = (case[1] / DIFF_ATTN).read_text(encoding="utf-8")
    assert text.count("self.paged_attention(query, k_cache, self.v_cache") == 2
    report = _passes(case)
    assert check(report, "logits vs transformers").measured["max_abs_diff"] <= 1e-9
    calls = check(report, "FA call arguments match the manifest").measured["calls"]
    prefill = check(report, "logits vs transformers").measured["steps"]
    assert calls > 0 and calls % (4 * 2) == 0, (calls, prefill)  # four calls per layer (2 layers) and step


def test_diffllama_graph_mode_decode_captures_its_four_fa_calls(tmp_path):
    """ge_graph decode (torchair.ops' FA with tensor lengths) of the differential render: the step captures as one
    graph and replays eager's logits (V228 / V307), like GQA's; before, graph modes were refused for the kind."""
    from validators_support import render_case

    config = _config(tmp_path, "diffllama")
    config.write_text(json.dumps(json.loads(config.read_text()) | DIFFLLAMA_SMALL), encoding="utf-8")
    case = render_case(tmp_path, "diffllama", config_path=str(config), deploy_mode="framework", exe_mode="ge_graph")
    assert (case[1] / DIFF_ATTN).read_text(encoding="utf-8").count("fa_ops(forward_metadata).") == 1
    report = run_validate(*case)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert check(report, "graph mode: replayed decode logits vs eager").measured["replays"] > 0


# (id, pattern, replacement, the check that names it): realistic mistakes of a differential port
DIFF_MISTAKES = [
    # value1 and value2 outputs concatenated the other way round (the two value halves swapped)
    ("value-halves-swapped", r"torch\.cat\(\[value1, value2\], dim=-1\)", "torch.cat([value2, value1], dim=-1)",
     "logits vs transformers"),
    # the high value cache written with the low KV heads (the second value layout at the wrong heads)
    ("high-values-at-low-heads", r"\(self\.v_cache_hi, value_states\[:, HALF_KV_HEADS:\]\)",
     "(self.v_cache_hi, value_states[:, :HALF_KV_HEADS])", "logits vs transformers"),
    # the high query half attending over the low key cache (query / key halves mispaired)
    ("high-queries-low-keys", r"\(query_states\[:, HALF_Q_HEADS:\], self\.k_cache_hi\)",
     "(query_states[:, HALF_Q_HEADS:], self.k_cache)", "logits vs transformers"),
    # each FA call given the rank's whole head counts, as GQA's single call (V209 names it; the operator refuses it)
    ("full-head-counts", r"num_heads=HALF_Q_HEADS,\n            num_key_value_heads=HALF_KV_HEADS,",
     "num_heads=NUM_HEADS_PER_RANK,\n            num_key_value_heads=NUM_KV_HEADS_PER_RANK,",
     "FA call arguments match the manifest"),
]


@pytest.mark.parametrize("case_id, pattern, replacement, failing", DIFF_MISTAKES, ids=[m[0] for m in DIFF_MISTAKES])
def test_a_diffllama_render_mistake_fails_by_name(tmp_path, case_id, pattern, replacement, failing):
    report = mistaken_report(_small_case(tmp_path, "diffllama", DIFFLLAMA_SMALL, "framework")[:3], pattern,
                             replacement)
    assert not check(report, failing).passed, [(c.name, c.detail) for c in report.failed()]


def test_diffllama_planned_as_plain_gqa_fails_the_logits(tmp_path, monkeypatch):
    """Negative control: a plan that ignores the differential layout (plain GQA K/V, the host's interface route
    caching each call's V, the second overwriting the first) fails V301, as the family sweep measured before the
    kind (rel 0.99)."""
    from model_infer_kvcache.analyzer import arch_check
    from model_infer_kvcache.analyzer.kinds import diff
    from model_infer_kvcache.validators.pipeline import host_model

    monkeypatch.setattr(diff, "read_facts", lambda *args, **kwargs: None)
    monkeypatch.setattr(diff.FORMAT, "hf_facts", lambda module: {})
    monkeypatch.setattr(arch_check, "_attention_calls", lambda module: {})
    monkeypatch.setattr(host_model, "DIFF_PARTS", ("no_such_part",))
    monkeypatch.setenv("KVCACHE_CACHE_DIR", "")
    arch_check._hf_attentions.cache_clear()
    try:
        case = _small_case(tmp_path, "diffllama", DIFFLLAMA_SMALL, "framework")
        assert case[3].differential is None and [c.name for c in case[3].layers[0].caches] == ["k_cache", "v_cache"]
        assert not check(run_validate(*case[:3]), "logits vs transformers").passed
    finally:
        arch_check._hf_attentions.cache_clear()


GPT_NEOX_JAPANESE_SMALL = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=512,
                               rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                                "rope_type": "default"})


@pytest.mark.slow
def test_gpt_neox_japanese_routes_its_headwise_fused_qkv(tmp_path, monkeypatch):
    """GPT-NeoX-Japanese scores inside its attention: one query_key_value laid out head by head ([heads, q | k | v]),
    RoPE on the first rotary_ndims lanes, the last layer's dense_bias returned to its decoder layer. It has a
    ``_split_heads`` of another signature than Falcon's, so the host took the fused_qkv route: `kvcache run` FAILED
    V201 (TypeError: _split_heads() missing 2 required positional arguments) in both modes. The headwise_qkv route
    serves it (partial RoPE here: factor 0.5). Negative control: the fused projection read as three contiguous
    blocks (q, k, v of hidden each, Falcon's way) fails the logits check."""
    import torch
    from model_infer_kvcache.validators.pipeline import host_model

    case = _small_case(tmp_path, "gpt_neox_japanese", GPT_NEOX_JAPANESE_SMALL, "standalone")
    _passes(case)

    def blockwise(self, hidden_states, position_embeddings=None, **kwargs):
        b, s = hidden_states.shape[:2]
        q, k, v = (x.view(b, s, self.num_attention_heads, self.head_size).transpose(1, 2)
                   for x in self.query_key_value(hidden_states).chunk(3, dim=-1))
        r = self.rotary_ndims
        q_rot, k_rot = sys.modules[type(self).__module__].apply_rotary_pos_emb(q[..., :r], k[..., :r],
                                                                                *position_embeddings)
        q, k = torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)
        out, _ = host_model._gqa_attention(self, q, k, v, None, scaling=1.0 / self.norm_factor)
        return self.dense(out.reshape(b, s, -1)), None, self.dense_bias

    monkeypatch.setitem(host_model._ROUTED_FORWARD, "headwise_qkv", blockwise)
    assert not check(run_validate(*case[:3]), "logits vs transformers").passed


def test_phi4_multimodal_towers_are_cut_to_one_layer_in_the_tiny_model():
    """Phi-4-multimodal's causal LM builds its SigLIP vision and conformer audio towers (908M parameters at their
    defaults), which a text stream never runs: the tiny model held 961M parameters, its float64 model under test and
    reference ~19 GB (`kvcache run` framework mode killed, exit -9). Cut to one layer each (shrink_towers), measured
    on the meta device. Negative control: the towers as the class builds them are the bulk of the model."""
    import torch
    from model_infer_kvcache.analyzer.hf_models import causal_lm_from_config
    from model_infer_kvcache.validators.pipeline.tiny_model import shrink_towers
    from transformers import CONFIG_MAPPING, AutoConfig

    defaults = CONFIG_MAPPING["phi4_multimodal"]().to_dict()
    small = dict(num_hidden_layers=2, vocab_size=512, intermediate_size=128, pad_token_id=0, bos_token_id=1)

    def params(d):
        with torch.device("meta"):
            model = causal_lm_from_config(AutoConfig.for_model("phi4_multimodal", **d))
        return sum(p.numel() for p in model.parameters())

    d = {k: v for k, v in defaults.items() if k not in ("vision_config", "model_type")} | small
    whole = params(d)  # the negative control: the towers at the class's depth
    cut = shrink_towers(d, defaults)
    assert cut == ["audio_config.num_blocks 24 -> 1", "vision_config.num_hidden_layers 27 -> 1"]
    assert whole > 900_000_000 and whole - params(d) > 800_000_000, (whole, params(d))
    # the text stream's own sub-models are no towers: BLT's encoder / decoder configs stay whole
    blt = CONFIG_MAPPING["blt"]().to_dict()
    assert shrink_towers(dict(blt), blt) == []


@pytest.mark.slow
def test_a_big_tiny_model_shares_its_weights_with_the_reference_and_may_not_write_them(tmp_path, monkeypatch):
    """Ergo's tiny model keeps 64 heads x 128 at a tied hidden size (its head_dim is hidden / heads): 634M
    parameters, two float64 copies (model under test, reference) beside the float32 original ~12.5 GB a run, and
    `kvcache run` was killed (exit -9). Above SHARED_WEIGHTS_ABOVE the reference shares the model's weights
    (validate.sharing_weights), fingerprinted around the stream. Forced on a small Llama here: it passes sharing.
    Negative control: code that writes the model's weights in place (a scale folded into o_proj on each call)
    fails V201 by name, where a shared reference would otherwise follow it."""
    from model_infer_kvcache.validators.pipeline import host_model, validate

    monkeypatch.setattr(validate, "SHARED_WEIGHTS_ABOVE", 0)
    case = _small_case(tmp_path, "llama", dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                               num_key_value_heads=2, head_dim=16, intermediate_size=128,
                                               vocab_size=512), "framework")
    report = _passes(case)
    assert check(report, "rendered code runs").measured.get("shared_weights") is True
    routed = host_model._gqa_attention

    def folding(module, *args, **kwargs):
        module.o_proj.weight.data.mul_(1.001)
        return routed(module, *args, **kwargs)

    monkeypatch.setattr(host_model, "_gqa_attention", folding)
    runs = check(run_validate(*case[:3]), "rendered code runs")
    assert not runs.passed and "the model's weights changed during the stream" in runs.detail


@pytest.mark.slow
def test_openai_gpt_routes_its_conv1d_qkv(tmp_path, monkeypatch):
    """GPT-1 (openai-gpt) scores inside its ``Attention``: one Conv1D ``c_attn`` of q | k | v, scores over sqrt(head
    size) (its ``scale`` flag), ``c_proj``. Before: `kvcache run` refused it ('not understood by the validation
    host'). The conv1d_qkv route serves it. Negative control: the fused output read head by head (GPT-NeoX's
    [heads, q | k | v] layout) fails the logits check."""
    from model_infer_kvcache.validators.pipeline import host_model

    case = _small_case(tmp_path, "openai-gpt", dict(n_layer=2, n_embd=64, n_head=4, vocab_size=512), "framework")
    assert not case[3].blockers and case[3].fa.softmax_scale == 16 ** -0.5
    _passes(case)

    def headwise(self, x, *args, **kwargs):
        b, s = x.shape[:2]
        q, k, v = (t.transpose(1, 2) for t in self.c_attn(x).view(b, s, self.n_head, -1).chunk(3, dim=-1))
        out, _ = host_model._gqa_attention(self, q, k, v, None, scaling=q.shape[-1] ** -0.5)
        return [self.c_proj(out.reshape(b, s, -1))]

    monkeypatch.setitem(host_model._ROUTED_FORWARD, "conv1d_qkv", headwise)
    assert not check(run_validate(*case[:3]), "logits vs transformers").passed


GPT_NEO_SMALL = dict(num_layers=2, hidden_size=64, num_heads=4, vocab_size=512, window_size=64,
                     attention_types=[[["global", "local"], 1]])


def test_gpt_neo_plans_its_local_layers_sliding_and_its_scores_unscaled(tmp_path):
    """GPT-Neo alternates global and local layers (``attention_layers`` / ``attention_types``; the local ones mask keys
    ``window_size`` or more back) and scores q k^T unscaled in its own ``_attn``. kvcache planned every layer full at
    head_dim^-0.5 (the host then refused the module, 'not understood by the validation host'); now the local layers
    slide over window_size and the scale is 1, both confirmed by the cross-check against GPTNeoSelfAttention.
    Negative controls: the old plan's scale and its full local layers are each refused by the cross-check by name."""
    from model_infer_kvcache.analyzer import arch_check
    from model_infer_kvcache.analyzer.config_loader import normalize_config

    config = _config(tmp_path, "gpt_neo")
    m = analyze(AnalyzeRequest(config=str(config)))
    assert m.fa.softmax_scale == 1.0 and not m.blockers
    assert [(layer.attn_type, layer.sliding_window) for layer in m.layers[:2]] == [("FullAttention", None),
                                                                                   ("SlidingWindow", 256)]
    raw = json.loads(config.read_text(encoding="utf-8"))
    facts = normalize_config(raw, str(config))
    errors = arch_check.cross_check(raw, facts, m.layers, 128 ** -0.5, "head_dim^-0.5 = 128^-0.5").errors
    assert len(errors) == 1 and "softmax scale" in errors[0] and "vs transformers 1 (GPTNeoSelfAttention._attn" \
        in errors[0], errors
    full = [layer.model_copy(update={"sliding_window": None}) for layer in m.layers]
    errors = arch_check.cross_check(raw, facts, full, 1.0, "1").errors
    assert len(errors) == 1 and "sliding window: analyzer None" in errors[0] and "vs transformers 256" in errors[0]


@pytest.mark.slow
def test_gpt_neo_validates_through_its_split_qkv_route(tmp_path):
    """The host's split_qkv route (GPT-Neo's own q / k / v projections and _split_heads around the rendered attention,
    windowed on its local layer) passes `kvcache run`'s checks on a small GPT-Neo. Negative control: the same render
    with its local layer's window removed (served full, what the old plan did) fails the logits check."""
    case = _small_case(tmp_path, "gpt_neo", GPT_NEO_SMALL, "framework")
    assert [layer.sliding_window for layer in case[3].layers] == [None, 64]
    _passes(case)
    # the local layer's FA band as wide as any sequence: served full, as the old plan did
    mutate(case[1], r"self\.window_pre_tokens = self\.sliding_window - WINDOW_PRE_TOKENS_OFFSET",
           "self.window_pre_tokens = 2147483647")
    assert not check(run_validate(*case[:3]), "logits vs transformers").passed


def test_a_big_tiny_model_gets_a_step_allowance_grown_with_its_size():
    """Ergo's tiny model (634M parameters: 64 heads x 128 at a tied hidden size) took over 120 s for its first
    step (780 prompt tokens, float64, a shared core) and the watchdog failed V203 'the step never returns'. The
    default allowance grows by STEP_SECONDS per STEP_PARAMETERS parameters; small models and a caller's own
    allowance (--step-timeout) keep theirs. Negative control: the unsized stream keeps the 120 s that stopped it."""
    from dataclasses import replace

    from model_infer_kvcache.validators.pipeline.request_stream import DEFAULT, STEP_SECONDS

    assert DEFAULT.step_seconds == STEP_SECONDS == 120.0  # what stopped Ergo's first step
    assert DEFAULT.sized_for(633_766_912).step_seconds == 7 * STEP_SECONDS
    assert DEFAULT.sized_for(40_000_000).step_seconds == STEP_SECONDS
    assert replace(DEFAULT, step_seconds=5.0).sized_for(633_766_912).step_seconds == 5.0


def test_text_causal_lm_classes_the_auto_mappings_leave_out_are_built_and_validated(tmp_path):
    """Emu3 / Mllama: transformers ships Emu3ForCausalLM on Emu3TextConfig, but neither auto mapping holds that
    config class, so the tiny reference did not build (`kvcache run` refused a planned family). The config's own
    modeling module supplies it now, and the render validates."""
    from model_infer_kvcache.analyzer.hf_models import causal_lm_from_config
    from transformers import Emu3TextConfig

    small = Emu3TextConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=128, vocab_size=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    assert type(causal_lm_from_config(small)).__name__ == "Emu3ForCausalLM"
    config = _config(tmp_path, "emu3")
    data = json.loads(config.read_text())
    data["text_config"] |= dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=128, vocab_size=512)
    config.write_text(json.dumps(data), encoding="utf-8")
    from model_infer_kvcache.implementer.render import render_manifest, write_rendered

    manifest = analyze(AnalyzeRequest(config=str(config), deploy_mode="standalone"))
    (tmp_path / "m.json").write_text(manifest.to_json(), encoding="utf-8")
    write_rendered(render_manifest(manifest), tmp_path / "r")
    _passes((tmp_path / "m.json", tmp_path / "r", config))


def test_mllama_cross_attention_only_layers_are_planned_as_cross_slots_not_self_attention(tmp_path):
    """Mllama's text decoder interleaves blocks that attend only over the vision encoder's states
    (cross_attention_layers). The analyzer once planned a self-attention KV cache on all 40 layers (a quarter of the
    memory plan for tokens those blocks never cache), then refused them; they are now the cross kind's slots (no
    self-attention cache there), the other 32 blocks on the paged cache (tests/test_cross_only_layers.py)."""
    m = analyze(AnalyzeRequest(config=str(_config(tmp_path, "mllama"))))
    assert m.cross_attention.layers == [3, 8, 13, 18, 23, 28, 33, 38] and not m.cross_attention.self_attention
    assert len(m.layers) == 32 and not {layer.decoder_layer for layer in m.layers} & set(m.cross_attention.layers)


def _fresh_cross_check(mp):
    """No cached transformers report (the user cache and the in-process memo): what transformers builds is read
    again, under whatever the test patched."""
    from model_infer_kvcache.analyzer import arch_check

    mp.setenv("KVCACHE_CACHE_DIR", "")
    arch_check._hf_attentions.cache_clear()


def test_git_text_decoder_is_found_beside_its_longer_vision_tower(tmp_path):
    """GIT builds a 12-block vision encoder (GitVisionAttention, is_causal False) beside its 6-block text decoder: the
    longest stack was the vision tower, and the cross-check refused ('analyzer plans 6, transformers builds 12'). A
    stack whose every attention says it is not causal is now taken only when no other is there. Negative control:
    without that rule the same config is refused again."""
    from model_infer_kvcache.analyzer import hf_layout
    from model_infer_kvcache.analyzer.errors import InputError

    config = _config(tmp_path, "git")
    m = analyze(AnalyzeRequest(config=str(config)))
    assert not m.blockers and m.kv_mode.value == "paged" and len(m.layers) == 6
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_layout, "noncausal_tower", lambda attentions: False)
        _fresh_cross_check(mp)
        with pytest.raises(InputError, match="attention layers: analyzer plans 6, transformers builds 12"):
            analyze(AnalyzeRequest(config=str(config)))
    with pytest.MonkeyPatch.context() as mp:  # the BERT-era encoder (every stack non-causal) is still found
        _fresh_cross_check(mp)
        roberta = _config(tmp_path, "roberta")
        with pytest.raises(InputError) as err:
            analyze(AnalyzeRequest(config=str(roberta)))
        assert err.value.field == "is_decoder"


@pytest.mark.slow
def test_git_text_decoder_validates_through_the_bert_route(tmp_path):
    """GIT's text decoder (GitSelfAttention: query / key / value, scores over sqrt(head size)) runs through the host's
    BERT-era route and matches transformers in standalone mode (framework mode: the family sweep's kvcache run)."""
    small = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=512)
    case = _small_case(tmp_path, "git", small, "standalone")
    assert len(case[3].layers) == 2
    _passes(case)


def test_config_class_aliases_are_read_and_xlm_refused_as_a_bidirectional_masked_lm(tmp_path, monkeypatch):
    """XLM keeps hidden_size / heads / layers as emb_dim / n_heads / n_layers, which transformers' XLMConfig.attribute_map
    aliases: read through any config class's attribute_map (not a per-model key). At its defaults (causal false) XLM is
    a bidirectional masked LM: refused saying so, naming causal (the refusal's field, which the family sweep retries
    true) and what makes it plannable. Negative control: without the aliases the field is missing again."""
    from model_infer_kvcache.analyzer import config_loader
    from model_infer_kvcache.analyzer.config_loader import normalize_config
    from model_infer_kvcache.analyzer.errors import InputError

    data = json.loads(_config(tmp_path, "xlm").read_text())
    facts = normalize_config(data, "<xlm>")
    assert (facts.hidden_size.value, facts.num_layers.value) == (data["emb_dim"], data["n_layers"])
    assert facts.hidden_size.source == "emb_dim (transformers XLMConfig.attribute_map 'hidden_size')"
    with pytest.raises(InputError) as err:
        analyze(AnalyzeRequest(config=str(_config(tmp_path, "xlm"))))
    assert err.value.field == "causal", err.value.render()
    assert all(w in err.value.message for w in ("config causal is false", "bidirectional masked LM",
                                                "transformers/models/xlm/modeling_xlm.py", "sets causal: true")), \
        err.value.render()
    monkeypatch.setattr(config_loader._Reader, "aliases", {})
    with pytest.raises(InputError, match=r"missing \(looked for hidden_size"):
        normalize_config(data, "<xlm>")


XLM_SMALL = dict(n_layers=2, emb_dim=64, n_heads=4, vocab_size=512, causal=True, n_langs=2, lang_id=1)


def test_xlm_causal_lm_validates_with_its_language_embedding_and_fails_without(tmp_path, monkeypatch):
    """XLM's CLM checkpoints (xlm-clm-enfr-1024: causal true, two languages) are causal LMs: its MultiHeadAttention
    (q_lin / k_lin / v_lin, q / sqrt(head_dim), no block class: parallel ModuleLists) is found, its scale read from
    its forward and cross-checked, and the host routes its projections through the rendered attention (lin_qkv). The
    model adds a language embedding per token, which transformers' generation feeds as config.lang_id
    (prepare_inputs_for_generation): the reference and the host get the same (host_model.model_inputs), and each row's
    length (else XLM takes it from the row's count of non-pad ids and zeroes the hidden states past it: a random
    prompt holding the pad id loses its last tokens). Negative controls, each failing V301 (measured max |diff| 1.35,
    4.16, 1.50): the host dropping the language embedding, no lengths given, and the host handing the positions a
    packed step's row numbers (what XLMModel's own position_ids[:, :slen] gives a step without them)."""
    import torch
    from model_infer_kvcache.analyzer import arch_check
    from model_infer_kvcache.analyzer.config_loader import normalize_config
    from model_infer_kvcache.validators.pipeline import host_model

    case = _small_case(tmp_path, "xlm", XLM_SMALL, "framework")
    manifest = case[3]
    assert not manifest.blockers and manifest.fa.softmax_scale == 16 ** -0.5 and len(manifest.layers) == 2
    assert not any("unknown model family" in w.message for w in manifest.warnings)
    report = _passes(case)
    assert check(report, "logits vs transformers").measured["max_abs_diff"] < 1e-9
    # the cross-check reads the module's own scale: a plan at 1 / head_dim is refused naming it
    raw = json.loads(case[2].read_text(encoding="utf-8"))
    errors = arch_check.cross_check(raw, normalize_config(raw, "<xlm>"), manifest.layers, 1 / 16, "1 / 16").errors
    assert len(errors) == 1 and "q / math.sqrt(self.head_dim)" in errors[0], errors

    own = host_model.model_inputs

    def hosted(model):  # the model under test (its attention routed), not transformers' reference
        return any(hasattr(m, "_kvcache_host") for m in model.modules())

    monkeypatch.setattr(host_model, "model_inputs", lambda model, ids: {
        k: v for k, v in own(model, ids).items() if k != "langs" or not hosted(model)})
    assert not check(run_validate(*case[:3]), "logits vs transformers").passed
    monkeypatch.setattr(host_model, "model_inputs", lambda model, ids: {
        k: v for k, v in own(model, ids).items() if k != "lengths"})
    assert not check(run_validate(*case[:3]), "logits vs transformers").passed
    monkeypatch.setattr(host_model, "model_inputs", own)
    forward = host_model.HostModel.forward_batch
    monkeypatch.setattr(host_model.HostModel, "forward_batch", lambda self, ids, pos, fm: forward(
        self, ids, torch.arange(ids.shape[1])[None].expand_as(ids), fm))
    assert not check(run_validate(*case[:3]), "logits vs transformers").passed


@pytest.mark.parametrize("model_type, words", [
    # (RWKV and xLSTM, once refused as recurrences whose modeling files call no softmax, are planned as state
    # families: tests/test_state_stacks.py)
    # Transformer-XL relative attention caching hidden states
    ("xlnet", ["XLNetRelativeAttention", "Transformer-XL relative attention", "mems",
               "the op docs list TND without pse", "_op_plugin_docs.py:8113"]),
])
def test_families_without_a_kv_cache_kvcache_reads_are_refused_with_the_reason_from_transformers_code(
        tmp_path, model_type, words):
    """The generic 'no decoder block holding an attention module kvcache recognises' refusal now says why, from
    transformers' own objects (analyzer/arch_check.why_no_kv_cache): Transformer-XL relative-position biases (XLNet), an attention module whose projections kvcache does not
    read (named with them)."""
    from model_infer_kvcache.analyzer.errors import InputError

    with pytest.raises(InputError) as err:
        analyze(AnalyzeRequest(config=str(_config(tmp_path, model_type))))
    assert all(w in err.value.message for w in words), err.value.render()


@pytest.mark.parametrize("model_type, words", [
    # CPM-Ant: score + position_bias (bucketed relative positions and segments)
    ("cpmant", ["CpmAntAttention adds the position_bias it is handed (computed by CpmAntSegmentPositionEmbedding)"]),
    # ProphetNet: logits per distance bucket from each query's hidden state (relative_pos_embeddings)
    ("prophetnet", ["ProphetNetNgramSelfAttention adds relative-position logits to every query-key score "
                    "(relative_pos_embeddings: computed from each query's hidden state by a Linear)"]),
])
def test_position_biased_attention_is_refused_for_the_paged_fa_call_naming_the_op_doc_lines(
        tmp_path, monkeypatch, model_type, words):
    """CPM-Ant and ProphetNet add a position bias to every query-key score, which the paged TND FA call cannot take
    (the op docs list TND without pse; a paged pse_shift spans every block-table slot): refused by kvcache
    (NotSupportedByKvcache) with those lines, not as projections it does not read. Negative control: without reading
    the bias from transformers' code, the refusal is back to 'projecting through ...', a bad input with no device
    reason."""
    from model_infer_kvcache.analyzer import arch_check
    from model_infer_kvcache.analyzer.errors import InputError, NotSupportedByKvcache

    monkeypatch.setenv("KVCACHE_CACHE_DIR", "")
    config = _config(tmp_path, model_type)
    with pytest.raises(NotSupportedByKvcache) as err:
        analyze(AnalyzeRequest(config=str(config)))
    assert all(w in err.value.message for w in words), err.value.render()
    assert "2.14.0 _op_plugin_docs.py:8113" in err.value.message and "2.14.0:8293" in err.value.message
    monkeypatch.setattr(arch_check, "position_biased_attention", lambda model: None)
    arch_check._hf_attentions.cache_clear()
    with pytest.raises(InputError) as err:
        analyze(AnalyzeRequest(config=str(config)))
    assert not isinstance(err.value, NotSupportedByKvcache) and " projecting through " in err.value.message
    assert "pse" not in err.value.message


def test_why_no_kv_cache_gives_no_reason_for_an_attention_model():
    """The diagnosis reads facts, never a family list: Llama (softmax in its file, recognised q/k/v projections) has no
    reason to refuse."""
    import torch
    from model_infer_kvcache.analyzer.arch_check import why_no_kv_cache
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, intermediate_size=64)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert why_no_kv_cache(model, config) is None


def test_reformer_names_its_lsh_attention_where_the_plan_finds_none(tmp_path, monkeypatch):
    """Reformer (is_decoder true) alternates LocalSelfAttention (query / key / value) and LSHSelfAttention (one shared
    query_key projection, attention within hash buckets): the cross-check's 'no attention module' names the latter
    and why no paged KV cache serves it: each query reads its hash bucket's keys only, the cache keeps hidden states
    and buckets, and the paged FA call selects keys by length and sparse_mode or by a mask spanning every block-table
    slot (op doc line cited): refused by kvcache. Negative control: without reading the hashing, the block is named by
    its projections only, a bad input with no device reason."""
    from model_infer_kvcache.analyzer import arch_check
    from model_infer_kvcache.analyzer.errors import InputError, NotSupportedByKvcache

    monkeypatch.setenv("KVCACHE_CACHE_DIR", "")
    config = _config(tmp_path, "reformer")
    config.write_text(json.dumps(json.loads(config.read_text()) | {"is_decoder": True}), encoding="utf-8")
    with pytest.raises(NotSupportedByKvcache) as err:
        analyze(AnalyzeRequest(config=str(config)))
    assert "a block holding LSHSelfAttention attends each query to the keys of its own hash bucket(s) only" in \
        err.value.message
    assert "states_cache / buckets_cache" in err.value.message and "_op_plugin_docs.py:8292" in err.value.message
    monkeypatch.setattr(arch_check, "lsh_attention", lambda module: None)
    arch_check._hf_attentions.cache_clear()
    with pytest.raises(InputError) as err:
        analyze(AnalyzeRequest(config=str(config)))
    assert not isinstance(err.value, NotSupportedByKvcache)
    assert "a block holding LSHSelfAttention projecting through query_key, value" in err.value.message


@pytest.mark.parametrize("model_type, words", [
    ("inkling_text", ["layer type 'hybrid_sliding'", "InklingAttention with per-request state beside its KV cache",
                      "InklingShortConvolution", "InklingRelativeLogits adds a position bias",
                      # the device-side reason: planning the states would leave the bias without a paged FA call
                      "the op docs list TND without pse", "_op_plugin_docs.py:8113"]),
])
def test_layer_types_kvcache_has_no_kind_for_name_what_transformers_block_holds(tmp_path, monkeypatch, model_type,
                                                                               words):
    """'hybrid' / 'hybrid_sliding' mean different things in Inkling (attention with four short-conv states and a
    per-query relative bias), ZAYA (compressed convolutional attention: a q/k conv state and a delayed-value state,
    planned beside its attention: tests/test_zaya.py) and Zamba (a shared attention beside a Mamba mixer, planned as a
    shared-block hybrid): the refusal says what transformers' block there holds.
    Negative control: without the diagnosis the bare 'unknown layer type' bad-input line is back."""
    from model_infer_kvcache.analyzer import arch_check
    from model_infer_kvcache.analyzer.errors import InputError, NotSupportedByKvcache

    config = _config(tmp_path, model_type)
    with pytest.raises(NotSupportedByKvcache) as err:
        analyze(AnalyzeRequest(config=str(config)))
    assert all(w in err.value.message for w in words), err.value.render()
    monkeypatch.setattr(arch_check, "why_layer_type", lambda *args: None)
    with pytest.raises(InputError) as err:
        analyze(AnalyzeRequest(config=str(config)))
    assert not isinstance(err.value, NotSupportedByKvcache) and "unknown layer type" in err.value.message


@pytest.mark.parametrize("model_type, words", [
    ("musicgen", ["sub-model sections text_encoder, lm each hold their own stack's config"]),
])
def test_composite_configs_are_refused_naming_their_sub_model_sections(tmp_path, model_type, words):
    """A composite config keeps no layer count of its own: its sub-models each hold a stack's config. Refused naming
    the sections, not 'num_hidden_layers missing'. MusicGen's with its decoder section renamed (its causal LM is read
    from ``decoder``: the test below; BLT's four stacks are planned: tests/test_blt_layout.py, tests/test_blt_route.py)."""
    from model_infer_kvcache.analyzer.errors import NotSupportedByKvcache

    path = _config(tmp_path, model_type)
    data = json.loads(path.read_text(encoding="utf-8"))
    data["lm"] = data.pop("decoder")  # no section transformers' get_text_config(decoder=True) reads
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(NotSupportedByKvcache) as err:
        analyze(AnalyzeRequest(config=str(path)))
    assert err.value.field == "num_hidden_layers" and all(w in err.value.message for w in words), err.value.render()


def _first_call_host(module, cache_offset):
    """A port whose later calls all write the layer's first call's cache (the offset ignored): the negative control
    of a looped layer's routing (host_model.loop_host)."""
    return module._kvcache_loop_hosts[min(module._kvcache_loop_hosts)]


def test_hrm_plans_a_cache_layer_per_cycle_call_validates_and_fails_its_mistakes(tmp_path, monkeypatch):
    """HRM-text (issue 40): its L and H stacks (num_layers_per_stack layers each) run H_cycles x (L_cycles + 1) times
    per forward, each call writing cache slot (h x (L_cycles + 1) + l) x num_layers_per_stack + layer_idx
    (HrmTextModel.forward's cycle_offset; num_hidden_layers counts the slots). Planned as one cache layer per call in
    that order, counted in the memory plan, the render registering each call's module, the host routing each call by
    its cycle_offset, get_cache_info walking both stacks. Negative controls: every cycle writing the layer's first
    cache layer fails the logits (V301); a manifest planned without the cycles' cache layers fails its invariant by
    name; a render walking the L stack only fails at init (V201); a num_hidden_layers that is not the slot count is
    bad input."""
    from model_infer_kvcache.validators.pipeline import host_model
    from model_infer_kvcache.validators.pipeline import validate as pipeline
    from transformers import HrmTextConfig

    real = analyze(AnalyzeRequest(config=str(_config(tmp_path, "hrm_text"))))  # the class defaults: 2 x 16 layers
    assert real.model.num_layers == 32 and len(real.layers) == 128 and not real.blockers
    slot = [(h * 4 + l) * 16 + i for h in range(2) for l in range(4) for i in range(16)]  # noqa: E741
    assert real.recurrent_loops.calls == [i + 16 * (l == 3) for h in range(2) for l in range(4) for i in range(16)]  # noqa: E741
    assert slot == list(range(128)) and real.recurrent_loops.offset_kwarg == "cycle_offset"
    assert len(real.recurrent_loops.cache_layers) == 96 and real.layers[48].decoder_layer == 16
    assert [w.fields for w in real.warnings if w.message.startswith("prefix_lm true")] == [["prefix_lm"]]

    config = tmp_path / "hrm.json"  # small enough that the given render runs as written
    config.write_text(json.dumps(HrmTextConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=2,
                                               head_dim=64, intermediate_size=128, vocab_size=512,
                                               H_cycles=2, L_cycles=2).to_dict()), encoding="utf-8")
    m = analyze(AnalyzeRequest(config=str(config), deploy_mode="framework"))
    assert m.recurrent_loops.calls == [0, 1, 0, 1, 2, 3, 0, 1, 0, 1, 2, 3] and not m.blockers
    from model_infer_kvcache.analyzer.errors import InputError
    with pytest.raises(InputError, match=r"num_hidden_layers: 12 is not num_layers_per_stack 2 x H_cycles 1 x "
                                         r"\(L_cycles 1 \+ 1\) = 4"):  # the slot count HrmTextConfig keeps
        analyze(AnalyzeRequest(config=str(_config_with(tmp_path, config, H_cycles=1, L_cycles=1))))
    once = analyze(AnalyzeRequest(config=str(_config_with(tmp_path, config, H_cycles=1, L_cycles=1,
                                                          num_hidden_layers=4)), deploy_mode="framework"))
    assert len(once.layers) == 4 and m.memory.per_token_bytes == once.memory.per_token_bytes * 12 // 4
    case = _looped_case(tmp_path, m, config, 4, 8)  # planned without the cycles: one cache per module
    bad = tmp_path / "one_stack"  # a port walking the L stack only: the H stack's calls are registered nowhere
    shutil.copytree(case[1], bad)
    report = mistaken_report((case[0], bad, case[2]),
                             r"\*self\.model\.L_module\.layers, \*self\.model\.H_module\.layers",
                             "*self.model.L_module.layers")
    failed = check(report, "rendered code runs without operator errors")  # V201 at init: the runs overrun the list
    assert not failed.passed and "step -1, layer ?: IndexError" in failed.detail, \
        [(c.name, c.detail) for c in report.failed()]

    # every cycle writing the same cache layer (the layer's first call's): the later cycles overwrite it
    monkeypatch.setattr(host_model, "loop_host", _first_call_host)
    monkeypatch.setattr(pipeline, "_localise", lambda *args, **kwargs: None)  # the failing check is the point
    report = run_validate(*case)
    assert not check(report, "logits vs transformers").passed, [(c.name, c.detail) for c in report.failed()]


def test_layer_types_a_config_class_derives_are_read_from_it(tmp_path, monkeypatch):
    """RecurrentGemma stores block_types (recurrent, recurrent, attention) and derives its layer types by cycling them
    (RecurrentGemmaConfig.layers_block_type, a property its attribute_map names for layer_types): read from the class,
    its recurrent layers are state layers (the rg_lru family, tests/test_recurrent_gemma.py; once a Legacy plan with an
    unknown-family blocker) and its attention layers slide over attention_window_size. It was refused: every layer
    planned as attention. Negative control: without the derived types the cross-check refuses again."""
    from model_infer_kvcache.analyzer import config_loader
    from model_infer_kvcache.analyzer.errors import InputError

    config = _config(tmp_path, "recurrent_gemma")
    m = analyze(AnalyzeRequest(config=str(config)))
    assert m.kv_mode.value == "paged" and not m.blockers
    assert [layer.index for layer in m.layers if layer.is_state] == [i for i in range(26) if i % 3 != 2]
    assert [layer.index for layer in m.layers if layer.sliding_window == 2048] == list(range(2, 26, 3))
    monkeypatch.setattr(config_loader._Reader, "derived", lambda self, name, in_post_init=False: None)
    with pytest.raises(InputError, match="where transformers' decoder block has no attention module"):
        analyze(AnalyzeRequest(config=str(config)))


def test_a_drafter_whose_every_layer_reads_its_targets_kv_is_planned_as_one(tmp_path):
    """Gemma-4 Unified's assistant shares K/V on all its layers (Gemma4UnifiedAssistantConfig sets num_kv_shared_layers
    to num_hidden_layers; its forward takes the target model's shared_kv_states): a drafter with no cache of its own,
    planned as one (manifest drafter, no blocks; was refused, and before that 'leave no layer to compute K/V', as if
    the config were mistyped; rendered and validated in tests/test_drafter.py). More shared layers than layers is
    still bad input."""
    from model_infer_kvcache.analyzer.errors import InputError, NotSupportedByKvcache

    config = _config(tmp_path, "gemma4_unified_assistant")
    m = analyze(AnalyzeRequest(config=str(config)))
    assert m.drafter is not None and all(layer.reads_target and not layer.caches for layer in m.layers)
    data = json.loads(config.read_text())
    data["text_config"]["num_kv_shared_layers"] = data["text_config"]["num_hidden_layers"] + 1
    config.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(InputError) as err:
        analyze(AnalyzeRequest(config=str(config)))
    assert not isinstance(err.value, NotSupportedByKvcache) and "leave no layer" in err.value.message


def test_config_class_declarations_are_read_without_importing_transformers(tmp_path):
    """The aliases and derived-field properties come from the config class's source file (analyzer/hf_config_source,
    ast): a warm `kvcache analyze` (cross-check report cached) still never imports transformers. The first version
    imported transformers for every config without layer_types (measured: warm analyze of the bundled example 0.15 s
    -> 5.6 s on a loaded machine)."""
    import os
    import subprocess
    import sys

    from model_infer_kvcache.analyzer.hf_config_source import config_class_facts

    facts = config_class_facts("recurrent_gemma")
    assert facts.name == "RecurrentGemmaConfig" and facts.attribute_map["layer_types"] == "layers_block_type"
    assert "layers_block_type" in facts.properties
    assert config_class_facts("inkling_text").name == "InklingTextConfig"  # found in models/inkling/
    assert config_class_facts("no_such_type").name == ""
    example = Path(__file__).resolve().parent.parent / "examples" / "tiny_qwen3" / "config.json"
    env = {**os.environ, "KVCACHE_CACHE_DIR": str(tmp_path / "cache")}
    code = ("import sys; from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze; "
            f"analyze(AnalyzeRequest(config={str(example)!r})); print('transformers' in sys.modules)")
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    assert [r.stdout.strip() for r in runs] == ["True", "False"], [r.stderr[-300:] for r in runs]


@pytest.mark.slow
def test_mimo_v2_flash_validates_its_narrow_values_and_sliding_sinks_and_fails_their_mistakes(tmp_path):
    """MiMo-V2-Flash (issue 40): V caches of v_head_dim 128 beside 192-dim keys, learnable sinks on the sliding layers
    only (SINK_LAYERS), twice the KV heads there (LAYER_SHAPES). The render passes against transformers; two
    realistic ports fail by name: the V cache entry copied from the K one (HEAD_DIM wide), and the sinks forgotten
    (they live on the sliding layers alone, where no config field names them)."""
    case = _small_case(tmp_path, "mimo_v2_flash", {}, "framework")
    report = _passes(case)
    assert check(report, "logits vs transformers").passed
    for name, pattern, replacement, failing in (
            ("v_as_k", r"dim=V_HEAD_DIM,", "dim=HEAD_DIM,", "placeholders replaced"),
            ("no_sinks", r"\n\s+learnable_sink=self\.sinks if self\.layer_has_sinks else None,", "",
             "logits vs transformers")):
        bad = tmp_path / name
        shutil.copytree(case[1], bad)
        report = mistaken_report((case[0], bad, case[2]), pattern, replacement)
        assert not check(report, failing).passed, (name, [(c.name, c.detail) for c in report.failed()])


JETMOE_SMALL = dict(num_hidden_layers=2, hidden_size=64, num_key_value_heads=2, num_attention_heads=4, kv_channels=16,
                    intermediate_size=64, vocab_size=512, num_local_experts=4)


def test_jetmoe_plans_its_query_experts_over_one_shared_kv_cache(tmp_path, monkeypatch):
    """JetMoE's mixture of attention: each token's top-k query experts (JetMoeMoA.map) over one shared kv_proj, so its
    KV cache is plain GQA: num_key_value_heads heads of kv_channels (JetMoeConfig.attribute_map head_dim), queries
    num_key_value_heads x num_experts_per_tok, which JetMoeConfig.__post_init__ computes when the file leaves
    num_attention_heads out (published JetMoE configs do). It was refused by the cross-check ('projecting through
    experts, kv_proj'). Its K/V are tiled to the query heads (query head e x 16 + h reads KV head h), not grouped as
    FA pairs them: a warning says so. A file whose num_attention_heads disagrees (JetMoeConfig keeps it, the forward
    never reads it: its heads are the tiled K/V's) is refused by the cross-check naming both counts.
    Negative controls: not computed, the file without the field is refused as missing it; without the query-head
    comparison the stale file plans 16 query heads; without reading the tiling, no warning."""
    from model_infer_kvcache.analyzer import arch_check
    from model_infer_kvcache.analyzer.errors import InputError
    from model_infer_kvcache.analyzer.hf_config_source import ConfigClassFacts

    monkeypatch.setenv("KVCACHE_CACHE_DIR", "")
    config = _config(tmp_path, "jetmoe")
    defaults = json.loads(config.read_text())
    missing = {k: v for k, v in defaults.items() if k != "num_attention_heads"}
    for name, data in (("missing", missing), ("four", missing | {"num_experts_per_tok": 4}),
                       ("stale", defaults | {"num_attention_heads": 16})):
        (tmp_path / f"{name}.json").write_text(json.dumps(data), encoding="utf-8")
    m = analyze(AnalyzeRequest(config=str(tmp_path / "missing.json")))
    assert not m.blockers and (m.model.num_attention_heads, m.model.num_key_value_heads, m.model.head_dim) == (
        32, 16, 128)
    assert m.model.sources["num_attention_heads"] == ("num_key_value_heads * num_experts_per_tok (computed by "
                                                      "transformers JetMoeConfig.__post_init__)")
    assert m.model.sources["head_dim"] == "kv_channels (transformers JetMoeConfig.attribute_map 'head_dim')"
    tiling = "transformers' JetMoeAttention tiles its K/V 2 times to its query heads"
    assert any(tiling in w.message and "pairs query head j with KV head j // 2" in w.message for w in m.warnings)
    assert analyze(AnalyzeRequest(config=str(tmp_path / "four.json"))).model.num_attention_heads == 64
    assert analyze(AnalyzeRequest(config=str(config))).model.num_attention_heads == 32  # the class's to_dict
    with pytest.raises(InputError) as err:
        analyze(AnalyzeRequest(config=str(tmp_path / "stale.json")))
    assert "query heads: analyzer 16 (num_attention_heads) vs transformers 32 (JetMoeAttention: K/V tiled 2 x 16 KV " \
           "heads)" in err.value.message, err.value.render()
    (tmp_path / "bad.json").write_text(json.dumps(missing | {"num_experts_per_tok": "2"}), encoding="utf-8")
    with pytest.raises(InputError) as err:  # an operand that is no integer: one line naming it
        analyze(AnalyzeRequest(config=str(tmp_path / "bad.json")))
    assert err.value.field == "num_experts_per_tok" and "got '2'" in err.value.message, err.value.render()
    with monkeypatch.context() as patch:
        patch.setattr(ConfigClassFacts, "compute", lambda self, name, read: None)
        with pytest.raises(InputError, match=r"missing \(looked for num_attention_heads"):
            analyze(AnalyzeRequest(config=str(tmp_path / "missing.json")))
    try:
        monkeypatch.setattr(arch_check, "_query_heads", lambda module: {})
        arch_check._hf_attentions.cache_clear()
        assert analyze(AnalyzeRequest(config=str(tmp_path / "stale.json"))).model.num_attention_heads == 16
        monkeypatch.setattr(arch_check, "_kv_tiled", lambda module: {})
        arch_check._hf_attentions.cache_clear()
        assert not any(tiling in w.message for w in analyze(AnalyzeRequest(config=str(config))).warnings)
    finally:
        arch_check._hf_attentions.cache_clear()


@pytest.mark.slow
def test_jetmoe_routes_its_mixture_of_attention_in_gqa_order(tmp_path, monkeypatch):
    """transformers tiles JetMoE's K/V to every query head (``.repeat(1, top_k, 1, 1)``: query head e x H + h reads KV
    head h), where FA groups query heads by KV head (head j reads KV head j // top_k): the moa route hands the render
    its queries KV-head-major and turns the output back before the output experts. Both modes pass. Negative control:
    the queries in transformers' expert-major order (K/V heads paired with the wrong query-head group) fail the
    logits check."""
    from model_infer_kvcache.validators.pipeline import host_model

    case = _small_case(tmp_path, "jetmoe", JETMOE_SMALL, "framework")
    _passes(case)
    (tmp_path / "standalone").mkdir()
    _passes(_small_case(tmp_path / "standalone", "jetmoe", JETMOE_SMALL, "standalone"))

    def expert_major(self, hidden_states, attention_mask=None, position_embeddings=None, **kwargs):
        b, s = hidden_states.shape[:2]
        q, router_logits, topo = self.experts.map(hidden_states)
        k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in self.kv_proj(hidden_states).chunk(2, -1))
        q = q.view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = sys.modules[type(self).__module__].apply_rotary_pos_emb(q, k, *position_embeddings)
        out, _ = host_model._gqa_attention(self, q, k, v, None, scaling=self.scaling)
        return self.experts.reduce(out.reshape(b, s, self.top_k, -1), topo), None, router_logits

    monkeypatch.setitem(host_model._ROUTED_FORWARD, "moa", expert_major)
    assert not check(run_validate(*case[:3]), "logits vs transformers").passed


def test_xmod_decoder_runs_with_its_first_language_as_default(tmp_path, monkeypatch):
    """X-MOD routes every layer through a per-language adapter, and its model refuses token ids without lang_ids
    unless the config names a ``default_language`` (modeling_xmod.py: "Input language unknown"); its class defaults
    name none, so the sweep refused it at the tiny config. The tiny config names the first of its ``languages`` (a
    note says so): the decoder validates. Negative control: without it the reference refuses to run, named."""
    from model_infer_kvcache.analyzer.errors import NotSupportedByKvcache
    from model_infer_kvcache.validators.pipeline import tiny_model

    case = _small_case(tmp_path, "xmod", BERT_SMALL, "standalone")
    report = _passes(case)
    assert any(n.startswith("default_language 'en_XX' (the first of its languages)") for n in report.notes)
    assert tiny_model._default_language({"default_language": "de_DE"}, {"languages": ["en_XX"]}) is None
    assert tiny_model._default_language({}, {"vocab_size": 8}) is None  # a family without languages: unchanged

    monkeypatch.setattr(tiny_model, "_default_language", lambda d, defaults: None)
    with pytest.raises(NotSupportedByKvcache, match="Input language unknown"):
        run_validate(*case[:3])


def test_xglm_reference_runs_float64_with_its_own_default_dtype(tmp_path, monkeypatch):
    """transformers' XGLM floors its attention scores with torch.full((), finfo(float64).min) in torch's default
    dtype: a float64 forward raised "value cannot be converted to type float without overflow" (modeling_xglm.py,
    XGLMAttention.forward) and the run FAILED V201 in both modes. A float64 reference that raises in the default
    float32 runs with float64 as the default dtype (host_model.reference_logits; a note says so), and the logits agree
    to rounding. Negative control: without that retry the reference's overflow fails the run again."""
    import contextlib

    from model_infer_kvcache.validators.pipeline import host_model

    case = _small_case(tmp_path, "xglm", dict(num_layers=2, d_model=64, attention_heads=4, ffn_dim=128,
                                              vocab_size=512), "standalone")
    report = _passes(case)
    assert any("it ran with torch.float64 as the default dtype" in n for n in report.notes), report.notes
    assert check(report, "logits vs transformers").measured["max_abs_diff"] < 1e-12

    monkeypatch.setattr(host_model, "default_dtype", lambda dtype: contextlib.nullcontext())
    runs = check(run_validate(*case[:3]), "rendered code runs without operator errors")
    assert not runs.passed and "without overflow" in runs.detail


def test_ernie45_moe_top_k_shrinks_with_its_experts(tmp_path, monkeypatch):
    """Ernie-4.5-MoE spells its top-k ``moe_k`` (6 at its class defaults) beside ``moe_num_experts``: the tiny config
    shrank the experts to 4 and kept 6, and transformers' own router failed ("selected index k out of range"), so the
    run was refused. The top-k shrinks with them. Negative control: without it the reference refuses again."""
    from model_infer_kvcache.analyzer.config_loader import read_config_file
    from model_infer_kvcache.analyzer.errors import NotSupportedByKvcache
    from model_infer_kvcache.validators.pipeline import tiny_model

    config = _config(tmp_path, "ernie4_5_moe")
    manifest = analyze(AnalyzeRequest(config=str(config), deploy_mode="standalone"))
    real = read_config_file(str(config))[1]
    model, plan = tiny_model.build_tiny_model(real, manifest)
    assert (plan.config["moe_num_experts"], plan.config["moe_k"]) == (4, 2)

    monkeypatch.setattr(tiny_model, "_MOE_SIZES", tuple(x for x in tiny_model._MOE_SIZES if x[0] != "moe_k"))
    monkeypatch.setattr(tiny_model, "_REFERENCE_RUNS", set())
    with pytest.raises(NotSupportedByKvcache, match="selected index k out of range"):
        tiny_model.build_tiny_model(real, manifest)


LONGCAT_SMALL = dict(num_layers=1, hidden_size=256, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=64,
                     qk_nope_head_dim=32, qk_head_dim=96, v_head_dim=32, n_routed_experts=4, moe_topk=2, zero_expert_num=2,
                     ffn_hidden_size=128, expert_ffn_hidden_size=64, vocab_size=512)


@pytest.mark.slow
def test_longcat_flash_routes_two_attention_sublayers_and_its_latent_scale_and_fails_their_mistakes(tmp_path):
    """LongCat-Flash (issue 40): each decoder layer holds two MLA modules in one ModuleList (transformers indexes their
    caches 2 x layer + i), and its attention scales the normalised latent by mla_scale_kv_lora (and the query by
    mla_scale_q_lora). Planned as two cache layers per decoder layer with mla.latent_scale, rendered, validated.
    Negative controls: the writer's gamma without the scale fails the logits; a get_cache_info that registers only
    the ModuleList's first module (one cache layer per decoder layer) fails the layer count."""
    case = _small_case(tmp_path, "longcat_flash", LONGCAT_SMALL, "framework")
    assert case[3].mla.latent_scale == "mla_scale_kv_lora"
    assert [layer.decoder_layer for layer in case[3].layers] == [0, 0]
    report = _passes(case)
    assert check(report, "logits vs transformers").passed
    for name, pattern, replacement, failing in (
            ("unscaled", r"self\.kv_a_layernorm\.weight \* self\.mla_scale_kv_lora,", "self.kv_a_layernorm.weight,",
             "logits vs transformers"),
            ("first_only", r"return list\(attn\)", "return [attn[0]]", "get_cache_info layer count")):
        bad = tmp_path / name
        shutil.copytree(case[1], bad)
        if name == "unscaled":  # with the localisation's replay: the ModuleList's layer is judged as a whole
            mutate(bad, pattern, replacement)
            report = run_validate(case[0], bad, case[2])
            assert (report.localisation["layer"], report.localisation["submodule"]) == (0, "layer output"), \
                report.localisation
            assert any("update_cache" in where for where in report.localisation["where"]), report.localisation
        else:
            report = mistaken_report((case[0], bad, case[2]), pattern, replacement)
        assert not check(report, failing).passed, (name, [(c.name, c.detail) for c in report.failed()])


def test_mla_families_without_a_latent_scale_keep_their_manifest_bytes(tmp_path):
    """mla.latent_scale is written only where a family scales its latent: DeepSeek-V3's manifest has no such key."""
    m = analyze(AnalyzeRequest(config=str(_config(tmp_path, "deepseek_v3"))))
    assert m.mla.enabled and m.mla.latent_scale is None and "latent_scale" not in m.to_json()


def test_mla_latent_128_is_blocked_for_the_paged_absorb_call_naming_the_op_doc_line(tmp_path):
    """The MLA FA call takes query D 512 or 128 with query_rope, and D 128 takes no page attention (the pinned op docs;
    the emulator refuses such a call by name): a kv_lora_rank 128 config keeps Legacy with a blocker saying so (it was
    planned paged and failed only at validation)."""
    config = _config(tmp_path, "deepseek_v3")
    data = json.loads(config.read_text())
    for rank, paged in ((512, True), (128, False)):
        config.write_text(json.dumps(data | {"kv_lora_rank": rank}), encoding="utf-8")
        m = analyze(AnalyzeRequest(config=str(config)))
        assert (m.kv_mode.value == "paged") == paged, m.kv_mode.reason
        assert any("D 128 with query_rope only without page attention" in b.message and "_op_plugin_docs.py:8715"
                   in b.message for b in m.blockers) == (not paged)


MUSICGEN_SMALL = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, ffn_dim=128)


def _musicgen_case(tmp_path: Path, model_type: str, small: dict, mode: str = "standalone", tp: int | None = None):
    """MusicGen's composite config (text_encoder, audio_encoder, decoder) with ``small`` over its decoder section,
    analyzed and rendered: (manifest path, rendered dir, config path, manifest)."""
    from model_infer_kvcache.implementer.render import render_manifest, write_rendered

    config = _config(tmp_path, model_type)
    data = json.loads(config.read_text())
    data["decoder"] |= small
    config.write_text(json.dumps(data), encoding="utf-8")
    manifest = analyze(AnalyzeRequest(config=str(config), deploy_mode=mode, attn_tp_size=tp))
    (tmp_path / "m.json").write_text(manifest.to_json(), encoding="utf-8")
    write_rendered(render_manifest(manifest), tmp_path / "r")
    return tmp_path / "m.json", tmp_path / "r", config, manifest


def test_musicgen_composite_is_read_from_its_decoder_section_and_blocked_without_an_encoder_length(tmp_path):
    """transformers maps musicgen / musicgen_melody to MusicgenForCausalLM / MusicgenMelodyForCausalLM over the
    config's ``decoder`` section (get_text_config(decoder=True)): the analyzer reads that section. MusicGen's decoder
    layers cross-attend over the text encoder's states (encoder_attn), whose length no field of the class defaults
    gives (T5 has no position table): blocked as TrOCR is, naming --encoder-length and max_source_positions; Melody (no cross-attention:
    its conditioning is a prefix of the self-attention) plans paged.
    Negative control: without the ``decoder`` section the composite is refused as several stacks."""
    from model_infer_kvcache.analyzer import config_loader
    from model_infer_kvcache.analyzer.errors import NotSupportedByKvcache

    m = analyze(AnalyzeRequest(config=str(_config(tmp_path, "musicgen"))))
    assert m.model.model_type == "musicgen_decoder" and m.model.num_layers == 24
    assert m.model.sources["num_layers"].startswith("decoder.num_hidden_layers")
    assert [b.fields for b in m.blockers] == [["--encoder-length", "max_source_positions"]], \
        [b.message for b in m.blockers]
    melody = analyze(AnalyzeRequest(config=str(_config(tmp_path, "musicgen_melody"))))
    assert not melody.blockers and melody.kv_mode.value == "paged" and melody.cross_attention is None
    sections = tuple(s for s in config_loader.NESTED_SECTIONS if s != "decoder")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(config_loader, "NESTED_SECTIONS", sections)
        with pytest.raises(NotSupportedByKvcache) as err:
            analyze(AnalyzeRequest(config=str(_config(tmp_path, "musicgen"))))
    assert "sub-model sections text_encoder, decoder each hold" in err.value.message


@pytest.mark.parametrize("model_type, framed", [("moshi", False), ("musicgen_melody", True)])
def test_codebook_frames_only_where_the_model_embeds_several_streams(tmp_path, model_type, framed):
    """Moshi's config names num_codebooks 8 (its audio's) while its causal LM embeds one text stream: its tiny model
    keeps the tiny vocabulary and one stream (framing it gave a code vocabulary of 3 and an IndexError in the text
    embedding, V201). MusicGen-Melody's decoder embeds one table per codebook: framed."""
    from model_infer_kvcache.validators.pipeline.codebooks import streams_of
    from model_infer_kvcache.validators.pipeline.tiny_model import TINY_VOCAB, build_tiny_model

    config = _config(tmp_path, model_type)
    real = json.loads(config.read_text(encoding="utf-8"))
    model, plan = build_tiny_model(real, analyze(AnalyzeRequest(config=str(config))))
    assert (streams_of(model) is not None) == framed
    assert any("num_codebooks" in note for note in plan.notes) == framed
    assert (model.config.vocab_size < TINY_VOCAB) == framed


def test_codebook_frames_follow_transformers_row_layout_and_greedy_heads():
    """A frame id's codes are its base-V digits fed as transformers' (batch x num_codebooks, seq) rows (each batch's
    codebooks together: MusicgenDecoder's input_ids.reshape(-1, num_codebooks, seq)); the frame's joint logits peak
    at the frame of each LM head's own argmax code. Checked against a forward of transformers' class written here
    from its docstring's layout, not through codebooks.py's functions."""
    import torch
    from model_infer_kvcache.validators.pipeline import codebooks
    from transformers import AutoConfig
    from transformers.models.musicgen.modeling_musicgen import MusicgenForCausalLM

    streams, vocab = 4, codebooks.code_vocab(4, 512)
    assert vocab == 5 and vocab ** streams >= 512 > (vocab - 1) ** streams
    config = AutoConfig.for_model("musicgen_decoder", num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                  ffn_dim=32, vocab_size=vocab, num_codebooks=streams, pad_token_id=vocab,
                                  bos_token_id=vocab)
    torch.manual_seed(0)
    model = MusicgenForCausalLM(config).eval()
    frames = torch.tensor([[7, 511, 0, 333], [42, 1, 600, 5]])
    rows = torch.stack([(frames[b] // vocab ** k) % vocab for b in range(2) for k in range(streams)])
    with torch.no_grad():
        heads = MusicgenForCausalLM.forward(model, input_ids=rows, use_cache=False).logits.reshape(2, streams, 4, -1)
        joint = codebooks.bind_frames(model)(input_ids=frames, use_cache=False).logits
    greedy = sum(heads[:, k].argmax(-1) * vocab ** k for k in range(streams))
    assert joint.shape == (2, 4, vocab ** streams) and torch.equal(joint.argmax(-1), greedy)
    want = sum(torch.log_softmax(heads[:, k].double(), -1)[..., 0] for k in range(streams))
    assert torch.allclose(joint[..., 0], want, atol=1e-12)  # frame 0: code 0 in every codebook


def _host_mistake(monkeypatch, mistake: str) -> None:
    """A port's mistake in the model under test only (the host's forward; the reference stays transformers'):
    ``folded``: each frame's codes laid frame-major ([batch, seq, codebooks]) and reshaped to the rows without the
    transpose, so the codebook streams fold across frames; ``offset``: frame positions offset by the codebook count
    (positions counted over code rows)."""
    from model_infer_kvcache.validators.pipeline import codebooks, host_model

    original = host_model.HostModel.forward_batch

    def forward_batch(self, input_ids, position_ids, forward_metadata):
        streams = codebooks.streams_of(self.hf_model)
        if mistake == "offset":
            return original(self, input_ids, position_ids + streams, forward_metadata)
        right = codebooks.codebook_rows
        codebooks.codebook_rows = lambda codes: codes.transpose(1, 2).reshape(-1, codes.shape[-1])
        try:
            return original(self, input_ids, position_ids, forward_metadata)
        finally:
            codebooks.codebook_rows = right

    monkeypatch.setattr(host_model.HostModel, "forward_batch", forward_batch)


@pytest.mark.parametrize("model_type, cross", [("musicgen", True), ("musicgen_melody", False)])
def test_musicgen_decoder_validates_over_frames_and_fails_folded_streams_and_offset_positions(
        tmp_path, monkeypatch, model_type, cross):
    """MusicGen's causal LM (its decoder section) validated with a paged cache: each position a frame of
    num_codebooks codes, fed to both sides as transformers' (batch x num_codebooks, seq) rows; the sinusoidal
    positions the host hands each frame (routed: the table numbers tokens from a cache length the host lacks); MusicGen
    with its cross-attention over per-request encoder states (V231), Melody without (no conditioning prefix fed).
    Negative controls, each failing V301 by name: the codebook streams folded across frames, the positions offset by
    the codebook count; Melody's positions not routed (no encoder: host_model.derives_positions)."""
    from model_infer_kvcache.validators.pipeline import host_model

    small = MUSICGEN_SMALL | ({"max_source_positions": 64} if cross else {})
    case = _musicgen_case(tmp_path, model_type, small)
    assert not case[3].blockers and (case[3].cross_attention is not None) == cross
    report = _passes(case)
    ids = {c.id for c in report.checks}
    assert ("V231" in ids) == cross and any("num_codebooks 4" in n for n in report.notes)
    for mistake in ("folded", "offset") + (() if cross else ("unrouted",)):
        with pytest.MonkeyPatch.context() as mp:
            if mistake == "unrouted":  # Melody's table left to number each step's tokens from 0 (no encoder to route by)
                mp.setattr(host_model, "derives_positions", lambda module: False)
            else:
                _host_mistake(mp, mistake)
            bad = run_validate(*case[:3])
        assert "V301" in {c.id for c in bad.failed()}, (mistake, [(c.id, c.detail) for c in bad.failed()])


@pytest.mark.slow
def test_musicgen_melody_decode_captures_as_one_graph_over_its_whole_position_table(tmp_path, monkeypatch):
    """Graph mode (npugraph_ex): the host's route of Melody's sinusoidal positions asks the table for its whole length
    inside a captured step, so the decode step captures once and every replay matches eager (V228, V307).
    Negative control: the eager length (the step's highest position + 1, a host value) inside the capture breaks it
    by name (V228: a data-dependent guard)."""
    from model_infer_kvcache.implementer.render import render_manifest, write_rendered
    from model_infer_kvcache.validators.pipeline import host_model

    config = _config(tmp_path, "musicgen_melody")
    data = json.loads(config.read_text())
    data["decoder"] |= MUSICGEN_SMALL
    config.write_text(json.dumps(data), encoding="utf-8")
    manifest = analyze(AnalyzeRequest(config=str(config), deploy_mode="framework", exe_mode="npugraph_ex"))
    (tmp_path / "m.json").write_text(manifest.to_json(), encoding="utf-8")
    write_rendered(render_manifest(manifest), tmp_path / "r")
    case = (tmp_path / "m.json", tmp_path / "r", config)
    report = _passes(case)
    assert {"V228", "V307"} <= {c.id for c in report.checks}
    monkeypatch.setattr(host_model, "_table_length", lambda module, pos: int(pos.max()) + 1)
    assert "V228" in {c.id for c in run_validate(*case).failed()}


@pytest.mark.slow
def test_musicgen_melody_validates_at_attention_tp_2_sharding_its_out_proj(tmp_path, monkeypatch):
    """The multi-rank run keeps each rank's heads and cuts the output projection's columns to them: MusicGen's
    attention names it out_proj (BART-era), not o_proj. Melody at attention TP 2 passes on both ranks (before the
    out_proj route both failed V204: AttributeError, no o_proj); rank 1 keeps exactly its heads' columns.
    Negative control: a shard that cuts rank 0's columns on rank 1 (the rank ignored) is told apart."""
    import torch
    from model_infer_kvcache.validators.pipeline import multi_rank
    from transformers import AutoConfig
    from transformers.models.musicgen_melody.modeling_musicgen_melody import MusicgenMelodyForCausalLM

    case = _musicgen_case(tmp_path, "musicgen_melody", MUSICGEN_SMALL, mode="framework", tp=2)
    report = _passes(case)
    assert {c.name for c in report.checks if c.id == "V301"} == {"rank 0: logits vs transformers max |diff| <= 1e-09",
                                                                  "rank 1: logits vs transformers max |diff| <= 1e-09"}
    config = AutoConfig.for_model("musicgen_melody_decoder", **MUSICGEN_SMALL)
    model = MusicgenMelodyForCausalLM(config)
    whole = [layer.self_attn.out_proj.weight.detach().clone() for layer in model.model.decoder.layers]
    multi_rank.shard_attention(model, case[3], rank=1, tp=2)
    got = [layer.self_attn.out_proj.weight for layer in model.model.decoder.layers]
    assert all(torch.equal(g, w[:, 32:]) for g, w in zip(got, whole, strict=True))
    assert not any(torch.equal(g, w[:, :32]) for g, w in zip(got, whole, strict=True))


@pytest.mark.slow
def test_stablelm_per_head_norms_and_head_counts_are_sharded_at_attention_tp_2(tmp_path):
    """StableLM reshapes by its module's own num_heads / num_key_value_heads and, with qk_layernorm, keeps one
    LayerNorm per head: a rank's module keeps its share of each (it failed at TP 2 with a reshape error, 'shape
    [1, 780, 4, 80] is invalid', in the model's own forward)."""
    from model_infer_kvcache.implementer.render import render_manifest, write_rendered

    config = _config(tmp_path, "stablelm")
    config.write_text(json.dumps(json.loads(config.read_text()) | dict(
        num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
        vocab_size=512, qk_layernorm=True)), encoding="utf-8")
    manifest = analyze(AnalyzeRequest(config=str(config), deploy_mode="framework", attn_tp_size=2))
    assert manifest.parallel.attn_tp_size == 2
    (tmp_path / "m.json").write_text(manifest.to_json(), encoding="utf-8")
    write_rendered(render_manifest(manifest), tmp_path / "r")
    _passes((tmp_path / "m.json", tmp_path / "r", config))


@pytest.mark.slow
def test_dory_plans_a_cache_layer_per_loop_validates_and_fails_its_mistakes(tmp_path, monkeypatch):
    """Dory (issue 40): its recurrent section runs n_recurrent_loops times per forward, each loop writing a cache of
    its own (per_loop: transformers' cache index layer_idx + cache_offset). Planned as extra cache layers after the
    model's, each with its layer's attention type, counted in the memory plan; rendered with each loop's own module
    and validated, the host routing each call by the cache_offset the forward receives. Negative controls: a port
    whose loops all write the layer's own cache (cache_offset ignored) fails the logits; a get_cache_info without
    the loops' modules fails the layer count; a manifest planned without the loops' layers fails its invariant."""
    from model_infer_kvcache.validators.pipeline import host_model
    from model_infer_kvcache.validators.pipeline import validate as pipeline
    from transformers import DoryConfig

    # the saved form (an "mlp" entry after every attention block, the counts doubled): 5 layers, 1 / 3 / 1, every one
    # kept by the tiny model, a window CPU prompts cross: the given render runs once, as written
    config = tmp_path / "dory.json"
    config.write_text(json.dumps(DoryConfig(num_hidden_layers=5, n_input_layers=1, n_output_layers=1,
                                            sliding_window=64).to_dict()), encoding="utf-8")
    m = analyze(AnalyzeRequest(config=str(config), deploy_mode="framework"))
    assert [(layer.decoder_layer, layer.attn_type) for layer in m.layers[5:]] == \
        [(1, "SlidingWindow"), (2, "SlidingWindow"), (3, "FullAttention")]
    assert m.recurrent_loops.cache_layers == [5, 6, 7] and not m.blockers
    once = analyze(AnalyzeRequest(config=str(_config_with(tmp_path, config, n_recurrent_loops=1)),
                                  deploy_mode="framework"))
    assert m.memory.per_token_bytes == once.memory.per_token_bytes * 8 // 5  # 8 cache layers, not 5
    case = _looped_case(tmp_path, m, config, 5, 3)  # planned without loop 1's layers

    bad = tmp_path / "no_loops"
    shutil.copytree(case[1], bad)
    report = mistaken_report((case[0], bad, case[2]), r"in \(\(0, 5\), \(1, 3\)\):", "in ((0, 5),):")
    assert not check(report, "get_cache_info layer count").passed, [(c.name, c.detail) for c in report.failed()]

    # every loop writing the layer's own cache: the port's loop modules all initialised at layer_idx
    monkeypatch.setattr(host_model, "loop_host", _first_call_host)
    monkeypatch.setattr(pipeline, "_localise", lambda *args, **kwargs: None)  # the failing check is the point
    report = run_validate(*case)
    assert not check(report, "logits vs transformers").passed, [(c.name, c.detail) for c in report.failed()]


def _config_with(tmp: Path, config: Path, **fields) -> Path:
    path = tmp / f"{config.stem}-{'-'.join(f'{k}{v}' for k, v in fields.items())}.json"
    path.write_text(json.dumps(json.loads(config.read_text()) | fields), encoding="utf-8")
    return path


def _dots3(tmp_path: Path, **kwargs) -> Path:
    """Dots3NoteTextConfig(**kwargs) as transformers saves it (its sliding layers' MLA shape in per_layer_config)."""
    from transformers import Dots3NoteTextConfig

    path = tmp_path / "dots3.json"
    path.write_text(json.dumps(Dots3NoteTextConfig(**kwargs).to_dict(), default=str), encoding="utf-8")
    return path


def test_dots3_note_plans_its_sliding_layers_mla_shape_per_layer(tmp_path):
    """Dots3-Note's sliding layers size their MLA from per_layer_config (Dots3NoteTextAttention: 64 heads,
    kv_lora_rank 1024, qk_nope_head_dim 192 at the class defaults): each layer's latent cache, query heads and scale
    are its own, and the memory plan counts each layer's latent width. The class default's latent 1024 is outside
    FA's MLA query D (512 / 128): a blocker naming the first such layer; the released shape at latent 512 plans."""
    m = analyze(AnalyzeRequest(config=str(_dots3(tmp_path))))
    by = {layer.decoder_layer: layer for layer in m.layers}
    indexed, sliding = by[0], by[2]
    assert indexed.mla_dims is None and indexed.num_q_heads_per_rank is None and indexed.softmax_scale is None
    assert (sliding.mla_dims.kv_lora_rank, sliding.mla_dims.qk_nope_head_dim, sliding.num_q_heads_per_rank) == (1024, 192, 64)
    assert sliding.softmax_scale == pytest.approx(256 ** -0.5) and m.fa.softmax_scale == pytest.approx(192 ** -0.5)
    assert [(c.name, c.dim) for c in sliding.caches] == [("nope_cache", 1024), ("rope_cache", 64)]
    assert m.memory.per_layer_token_bytes[:3] == [(512 + 64 + 128) * 2, (512 + 64 + 128) * 2, (1024 + 64) * 2]
    assert [b.message for b in m.blockers] == [
        "MLA latent dim 1024 not in (512, 128) (FA MLA query D) on layer 2 (and 32 more: 3, 4, 6...)"]
    m = analyze(AnalyzeRequest(config=str(_dots3(tmp_path, swa_kv_lora_rank=512)), attn_tp_size=4))
    assert not m.blockers and m.kv_mode.value == "paged"
    assert m.layers[2].mla_dims.kv_lora_rank == 512 and m.layers[2].num_q_heads_per_rank == 16
    assert m.parallel.num_q_heads_per_rank == 32
    assert m.mla.constraints[-1].startswith("layers 2, 3, 4, 6... (33, per_layer_config): their own latent 512")


def test_dots3_note_sliding_heads_outside_fas_mla_counts_block_naming_the_layer(tmp_path):
    """FA's MLA query-head counts hold on the dense (sliding) layers beside the indexed ones, per layer."""
    m = analyze(AnalyzeRequest(config=str(_dots3(tmp_path, swa_kv_lora_rank=512, swa_num_attention_heads=48,
                                                 swa_num_key_value_heads=48))))
    assert len(m.blockers) == 1 and "48 query heads per rank at attn_tp_size 1 on layer 2" in m.blockers[0].message


def test_an_analyzer_ignoring_dots3s_per_layer_mla_shape_is_refused_by_the_cross_check(tmp_path, monkeypatch):
    """Negative control: planned with the model's MLA shape on every layer, the cross-check against transformers'
    Dots3NoteTextAttention modules names both values of the latent width, the query heads and the scale."""
    from model_infer_kvcache.analyzer import config_loader
    from model_infer_kvcache.analyzer.errors import InputError

    monkeypatch.setattr(config_loader, "_layer_mla", lambda *a: config_loader.Sourced(None, "ignored"))
    with pytest.raises(InputError) as info:
        analyze(AnalyzeRequest(config=str(_dots3(tmp_path))))
    text = info.value.render()
    for words in ("MLA latent cache (kv_lora_rank + qk_rope_head_dim): analyzer 512 + 64 (nope_cache + rope_cache) "
                  "vs transformers 1024 + 64 (Dots3NoteTextAttention.kv_lora_rank",
                  "query heads: analyzer 128 (num_attention_heads) vs transformers 64",
                  "softmax scale: analyzer 0.0721687836", "vs transformers 0.0625"):
        assert words in text


def test_dots3_note_per_layer_mla_shape_bad_input_and_render_refusal_name_their_field(tmp_path):
    """A per-layer MLA dim of the wrong type is one line naming its per_layer_config field; a plan with per-layer MLA
    shapes is refused by the render naming the first such layer (the MLA partials render one shape)."""
    from model_infer_kvcache.analyzer.errors import InputError
    from model_infer_kvcache.implementer.kinds import mla as mla_render

    path = _dots3(tmp_path, swa_kv_lora_rank=512)
    data = json.loads(path.read_text())
    data["per_layer_config"]["02"]["qk_nope_head_dim"] = "192"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(InputError) as info:
        analyze(AnalyzeRequest(config=str(bad)))
    assert info.value.field == "per_layer_config.02.qk_nope_head_dim" and "\n" not in info.value.render()
    m = analyze(AnalyzeRequest(config=str(path)))
    with pytest.raises(InputError) as info:
        mla_render.check(m)
    assert info.value.field == "layers[2].mla_dims" and "33 MLA layer(s)" in info.value.render()


def test_dots3_note_without_dsa_plans_plain_mla_and_an_indexer_planned_anyway_is_refused(tmp_path, monkeypatch):
    """use_dsa false (Dots3NoteTextConfig's public switch) types no layer 'indexed_attention', and
    Dots3NoteTextAttention then builds no indexer: plain MLA is planned (its sliding layers' own heads / dims kept).
    Negative control: the family row without typed_layers plans an indexer on every layer, and the cross-check
    names the module's missing indexer."""
    from model_infer_kvcache.analyzer import config_loader
    from model_infer_kvcache.analyzer.errors import InputError

    path = _dots3(tmp_path, use_dsa=False, swa_kv_lora_rank=512)
    m = analyze(AnalyzeRequest(config=str(path)))
    assert m.dsa is None and m.mla.enabled and not m.blockers
    assert all("indexer_key_cache" not in [c.name for c in layer.caches] for layer in m.layers)
    assert m.layers[2].num_q_heads_per_rank == 64 and m.layers[2].mla_dims.qk_nope_head_dim == 192
    row = config_loader.INDEXER_FAMILIES["dots3_note_text"]
    monkeypatch.setitem(config_loader.INDEXER_FAMILIES, "dots3_note_text",
                        config_loader.IndexerFamily(row.rope, row.rope_dims, row.source))
    with pytest.raises(InputError, match=r"DSA indexer: analyzer plans an indexer key cache vs transformers "
                                         r"Dots3NoteTextAttention.indexer None on 46 layer\(s\), first layer 0"):
        analyze(AnalyzeRequest(config=str(path)))


@pytest.mark.slow
def test_dots3_note_dense_mla_validates_with_its_latent_rescaling_and_fails_without_it(tmp_path):
    """Dots3-Note all dense and alike (use_dsa / use_sliding_window false, Dots3NoteTextConfig's public switches:
    plain MLA, one shape): its module scales the normalized latent by kv_lora_scale and RMS-normalizes k_rot before
    its RoPE (mla.latent_scale / mla.rope_norm), which the render folds into the fused writer's gamma and applies
    before it. Negative controls: the writer without either (the plain MLA writer) fails the logits."""
    from model_infer_kvcache.implementer.render import render_manifest, write_rendered

    # CPU-sized: hidden 1024 keeps the latent scale off 1 ((1024 / 512)^0.5), 8 query heads an MLA count FA takes
    config = _dots3(tmp_path, use_dsa=False, use_sliding_window=False, num_hidden_layers=2, hidden_size=1024,
                    num_attention_heads=8, num_key_value_heads=8, q_lora_rank=64, intermediate_size=256,
                    moe_intermediate_size=64, shared_experts_intermediate_size=64, n_routed_experts=4,
                    num_experts_per_tok=2, vocab_size=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    m = analyze(AnalyzeRequest(config=str(config), deploy_mode="framework"))
    assert m.dsa is None and not m.blockers and m.mla.rope_norm
    assert m.mla.latent_scale == "kv_lora_scale"  # the module's (hidden_size / kv_lora_rank)^0.5
    assert any("kv_lora_scale" in w.message and "k_rope_only_layernorm" in w.message for w in m.warnings)
    (tmp_path / "m.json").write_text(m.to_json(), encoding="utf-8")
    for name, pattern, replacement in (("clean", None, None),
                                       ("no_latent_scale", r" \* self\.kv_lora_scale,", ","),
                                       ("no_rope_norm", r"self\.k_rope_only_layernorm\((compressed_kv\[[^]]+\])\)",
                                        r"\1")):
        rendered = tmp_path / name
        write_rendered(render_manifest(m), rendered)
        if pattern:
            mutate(rendered, pattern, replacement)
        report = run_validate(tmp_path / "m.json", rendered, config)
        numeric = check(report, "logits vs transformers")
        assert numeric.passed == (pattern is None), (name, [(c.name, c.detail) for c in report.failed()])


def test_attention_tp_keeps_a_ranks_rows_of_the_attentions_own_output_gate():
    """HRM-text, AfMoE, Dory gate each head's attention output by sigmoid(gate_proj(x)) (heads x head_dim rows): at
    attention TP 2 a rank keeps its heads' rows, as of q_proj (unsharded, the multi-rank run fails V201 on the shape:
    measured on HRM-text and AfMoE)."""
    import types

    import torch
    from model_infer_kvcache.validators.kinds import gqa
    from transformers import HrmTextConfig
    from transformers.models.hrm_text.modeling_hrm_text import HrmTextAttention

    attn = HrmTextAttention(HrmTextConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, head_dim=16), 0)
    gate, query = attn.gate_proj.weight.detach().clone(), attn.q_proj.weight.detach().clone()
    gqa.shard_attention(attn, types.SimpleNamespace(num_attention_heads=4, head_dim=16), slice(2, 4), 1, 2)
    assert torch.equal(attn.gate_proj.weight, gate[32:]) and torch.equal(attn.q_proj.weight, query[32:])
