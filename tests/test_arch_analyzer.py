"""Unknown and unusual architectures in the analyzer: unknown families, windows as long as the
context, per-family softmax-scale rules, and the meta-device cross-check against transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from model_infer_kvcache.analyzer import arch_check, rules
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze, assemble
from model_infer_kvcache.analyzer.config_loader import normalize_config
from model_infer_kvcache.analyzer.deploy_context import ProgressFacts, parse_dispatch
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.operators.fa_facts import INT32_MAX

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "tests" / "fixtures" / "configs"

# ibm-granite/granite-3.0-2b-instruct (attention keys as published): Granite replaces
# head_dim^-0.5 by `attention_multiplier` (modeling_granite: self.scaling = config.attention_multiplier).
GRANITE_3_2B = {
    "architectures": ["GraniteForCausalLM"], "attention_bias": False, "attention_dropout": 0.1,
    "attention_multiplier": 0.015625, "bos_token_id": 0, "embedding_multiplier": 12.0, "eos_token_id": 0,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "logits_scaling": 8.0, "max_position_embeddings": 4096, "mlp_bias": False, "model_type": "granite",
    "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8, "pad_token_id": 0,
    "residual_multiplier": 0.22, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 49155,
}


def _config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text(encoding="utf-8"))


def _analyze(name: str, **kw):
    return analyze(AnalyzeRequest(config=str(CONFIGS / f"{name}.json"), **kw))


def _assemble_dict(config: dict, where: str = "config.json"):
    facts = normalize_config(config, where)
    return facts, assemble(facts, ProgressFacts(), parse_dispatch(None), None,
                           AnalyzeRequest(config=where), config=config)


def _check(config: dict, facts, m, layers=None, scale=None, scale_txt=None):
    """arch_check.cross_check of a manifest's plan, at its attention TP and cache layout."""
    return arch_check.cross_check(config, facts, m.layers if layers is None else layers,
                                  m.fa.softmax_scale if scale is None else scale,
                                  m.fa.scale_derivation if scale_txt is None else scale_txt,
                                  m.parallel.attn_tp_size, legacy=m.kv_mode.value == "legacy")


# ---------------------------------------------------------------- unknown families


def test_baichuan_unknown_family_warns_about_alibi_and_is_not_called_blocker_free():
    m = _analyze("baichuan2_13b")
    unknown = [w.message for w in m.warnings if "unknown model family 'baichuan'" in w.message]
    assert len(unknown) == 1
    assert "ALiBi" in unknown[0] and "transformers does not ship it" in unknown[0]
    assert m.kv_mode.value == "paged" and not m.blockers
    assert "family 'baichuan' is unknown" in m.kv_mode.reason


def test_known_family_has_no_unknown_family_warning():
    for name in ("qwen3_8b", "falcon_7b", "glm4_9b_0414", "gemma3_4b"):
        m = _analyze(name)
        assert not [w for w in m.warnings if "unknown model family" in w.message], name
        assert "unknown" not in m.kv_mode.reason


def test_unknown_family_with_an_explicit_alibi_field_does_not_claim_alibi_is_unverified():
    config = {**_config("baichuan2_13b"), "alibi": False}
    facts = normalize_config(config)
    finding = rules.unknown_family(facts, False)
    assert finding is not None and "ALiBi" not in finding.message and "custom softmax scale" in finding.message


def _sweep_config(tmp_path: Path, model_type: str) -> Path:
    """A family's config as the family sweep writes it (benchmarks/sweep_families.py: the class defaults and, where
    the sweep keeps them, the published fields)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sweep_families_under_test",
                                                  ROOT / "benchmarks" / "sweep_families.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    return sweep._configs(tmp_path, [model_type])[model_type]


@pytest.mark.parametrize("model_type", ["qwen4_exp_text", "zaya", "lfm2_moe", "mllama", "olmo2"])
def test_a_planned_family_whose_every_attention_call_the_cross_check_read_is_known(tmp_path, model_type):
    """Families the sweep plans and validates, none in FAMILY_SCALE_RULE: transformers' modules were compared layer by
    layer (scale, window, KV shape, sinks) and each one's attention call adds no other score term (Qwen4-Exp's mask
    carries its QSA selection, which its format plans), so their code was read: no unknown-family warning."""
    m = analyze(AnalyzeRequest(config=str(_sweep_config(tmp_path, model_type))))
    assert m.model.model_type not in rules.FAMILY_SCALE_RULE and not m.blockers
    assert not [w.message for w in m.warnings if "unknown model family" in w.message]
    assert "unknown" not in m.kv_mode.reason


def test_score_terms_read_from_the_attention_call():
    """What arch_check.score_terms reads from a module's forward: extra arguments of the attention call, a mask
    rewritten before it, or no call at all (a module scoring by itself)."""
    from torch import nn

    class Plain(nn.Module):
        def forward(self, q, k, v, attention_mask, **kwargs):
            return attention_interface(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling,  # noqa: F821
                                       sliding_window=self.sliding_window, s_aux=self.sinks, **kwargs)

    class SoftCapped(nn.Module):
        def forward(self, q, k, v, attention_mask, **kwargs):
            return attention_interface(self, q, k, v, attention_mask, scaling=self.scaling,  # noqa: F821
                                       softcap=self.softcap, **kwargs)

    class Biased(nn.Module):
        def forward(self, q, k, v, attention_mask, **kwargs):
            attention_mask = attention_mask + self.alibi
            return attention_interface(self, q, k, v, attention_mask, scaling=self.scaling)  # noqa: F821

    class OwnScores(nn.Module):
        def forward(self, q, k, v, attention_mask):
            return (q @ k.transpose(-1, -2) + attention_mask).softmax(-1) @ v

    assert arch_check.score_terms(Plain()) == ()
    assert arch_check.score_terms(SoftCapped()) == ("softcap",)
    assert arch_check.score_terms(Biased()) == (arch_check.MASK_REWRITTEN,)
    assert arch_check.score_terms(OwnScores()) is None


def test_a_family_whose_attention_call_adds_a_score_term_stays_unknown_naming_it(tmp_path, monkeypatch):
    """Negative control: OLMo-2's attention forward with a soft-cap handed to the attention interface (the plausible
    variant the config alone does not show, Gemma-2's way) is no longer read whole: the warning stays, naming the
    module and the term. No cached report may answer for the patched code."""
    import inspect
    import linecache
    import textwrap

    import transformers.models.olmo2.modeling_olmo2 as olmo2

    source = inspect.getsource(olmo2.Olmo2Attention.forward)
    assert "scaling=self.scaling," in source
    patched = textwrap.dedent(source).replace("scaling=self.scaling,",
                                                             "scaling=self.scaling, softcap=50.0,", 1)
    scope, fake = dict(vars(olmo2)), "<olmo2 attention with a soft-cap>"
    monkeypatch.setitem(linecache.cache, fake, (len(patched), None, patched.splitlines(True), fake))  # its source
    exec(compile(patched, fake, "exec"), scope)
    monkeypatch.setattr(olmo2.Olmo2Attention, "forward", scope["forward"])
    monkeypatch.setenv(arch_check.CACHE_ENV, "")
    arch_check._hf_attentions.cache_clear()
    try:
        m = analyze(AnalyzeRequest(config=str(_sweep_config(tmp_path, "olmo2"))))
    finally:
        arch_check._hf_attentions.cache_clear()
    unknown = [w.message for w in m.warnings if "unknown model family 'olmo2'" in w.message]
    assert len(unknown) == 1 and "Olmo2Attention at model.layers.0.self_attn: its attention call adds softcap" in \
        unknown[0], unknown


def test_analyze_works_without_transformers(monkeypatch):
    """transformers is optional for the analyzer: an import failure skips the cross-check only."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    assert arch_check.transformers_ships("qwen3") is None
    m = _analyze("baichuan2_13b")
    assert any("transformers is not installed" in w.message for w in m.warnings)
    assert _analyze("qwen3_8b").fa.softmax_scale == pytest.approx(128 ** -0.5)


# ---------------------------------------------------------------- windows as long as the context


def test_full_context_window_rule_boundary():
    assert rules.full_context_window(4096, 4096) is not None
    assert rules.full_context_window(5000, 4096) is not None
    assert rules.full_context_window(4095, 4096) is None  # the query at 4095 no longer sees key 0
    assert rules.full_context_window(None, 4096) is None
    assert rules.full_context_window(4096, None) is None


def test_phi35_moe_window_equal_to_context_is_full_attention_with_reason():
    m = _analyze("phi35_moe")
    assert len(m.layers) == 32
    for layer in m.layers:
        assert layer.attn_type == "FullAttention" and layer.layer_kind == "full" and layer.sliding_window is None
        assert "131072 >= max_position_embeddings 131072" in layer.window_derivation
        assert layer.sparse_mode.decode == 3 and layer.pre_tokens == INT32_MAX
    # no open window readings (null-block and padded-row questions concern every paged design)
    assert {d.question for d in m.device_dependencies} == {"null_block_contents", "repeated_slots"}
    assert any("32 layer(s) planned as FullAttention" in w.message for w in m.warnings)


def test_phi3_mini_window_shorter_than_context_stays_sliding():
    m = _analyze("phi3_mini")
    assert {layer.attn_type for layer in m.layers} == {"SlidingWindow"}
    assert all(layer.sliding_window == 2047 for layer in m.layers)


# ---------------------------------------------------------------- softmax scale per family


@pytest.mark.parametrize("name, expected, derivation", [
    ("qwen3_8b", 128 ** -0.5, "head_dim^-0.5"),
    ("falcon_7b", 64 ** -0.5, "head_dim^-0.5"),
    ("glm4_9b_0414", 128 ** -0.5, "head_dim^-0.5"),
    ("gemma2_9b", 256 ** -0.5, "query_pre_attn_scalar^-0.5"),
    ("gemma3_4b", 256 ** -0.5, "query_pre_attn_scalar^-0.5"),
])
def test_scale_rule_of_fixture_families(name, expected, derivation):
    m = _analyze(name)
    assert m.fa.softmax_scale == pytest.approx(expected, rel=1e-12)
    assert m.fa.scale_derivation.startswith(derivation)


def test_granite_scale_is_the_attention_multiplier_and_matches_transformers():
    facts, m = _assemble_dict(GRANITE_3_2B)
    assert m.fa.softmax_scale == 0.015625 and "attention_multiplier" in m.fa.scale_derivation
    result = _check(GRANITE_3_2B, facts, m)
    assert result.ships and not result.errors and result.checked_layers == 40


def test_granite_default_multiplier_comes_from_the_class_default():
    config = {k: v for k, v in GRANITE_3_2B.items() if k != "attention_multiplier"}
    facts, m = _assemble_dict(config)
    assert m.fa.softmax_scale == 1.0
    assert "GraniteConfig.attention_multiplier" in m.fa.scale_derivation


def test_family_rule_wins_over_a_stray_field():
    """A family whose code uses head_dim^-0.5 ignores an attention_multiplier it does not read."""
    facts = normalize_config({**_config("qwen3_8b"), "attention_multiplier": 0.5})
    assert rules.decide_scale(facts)[0] == pytest.approx(128 ** -0.5)


# ---------------------------------------------------------------- meta-device cross-check

CHECKED = ["qwen3_8b", "qwen3_30b_a3b", "qwen2_7b", "llama31_8b", "mistral_7b_v01", "gemma2_9b", "gemma3_4b",
           "gpt_oss_20b", "deepseek_v3", "deepseek_v2_lite", "kimi_k2", "longcat_flash", "glm4_moe", "phi3_mini",
           "falcon_7b", "falcon2_11b", "glm4_9b_0414", "qwen3_next", "llama4_scout"]


@pytest.mark.parametrize("name", CHECKED)
def test_cross_check_agrees_on_every_fixture(name):
    config = _config(name)
    facts, m = _assemble_dict(config)
    result = _check(config, facts, m)
    assert result.ships and not result.errors and not result.notes, (result.errors, result.notes)
    assert result.checked_layers == sum(1 for layer in m.layers if layer.layer_kind != "linear") > 0


def _class_defaults(cls_name: str, **overrides) -> dict:
    import transformers

    return json.loads(json.dumps({**getattr(transformers, cls_name)(**overrides).to_dict()}, default=str))


def test_kolibri1_full_layers_keep_the_window_attribute_but_apply_none():
    """Kolibri1Attention stores config.sliding_window on every layer and passes it only where ``is_sliding``: the
    cross-check reads the window the call applies, so the analyzer's full layers (every fifth) agree."""
    config = _class_defaults("Kolibri1Config", num_hidden_layers=10)
    facts, m = _assemble_dict(config)
    hf = arch_check.hf_attentions(config, "kolibri1")
    assert [a.window for a in hf] == [513, 513, 513, 513, None] * 2
    result = _check(config, facts, m)
    assert not result.errors and result.checked_layers == 10
    # the mistake this guards against: a full layer planned with the window fails by name
    layers = [layer.model_copy(update={"sliding_window": 513}) for layer in m.layers]
    wrong = _check(config, facts, m, layers)
    assert "analyzer 513 (FullAttention) vs transformers None" in wrong.errors[0] and "2 layer(s)" in wrong.errors[0]


@pytest.mark.parametrize("overrides, sliding", [
    ({"num_hidden_layers": 4}, []),  # the class writes sliding_window 0 beside use_sliding_window false
    ({"num_hidden_layers": 4, "use_sliding_window": True, "max_window_layers": 4}, [0, 2]),
])
def test_qwen2_moe_window_off_as_zero_and_set_on_sliding_layers_only(overrides, sliding):
    """Qwen2MoeConfig writes sliding_window 0 when the window is off, and Qwen2MoeAttention sets sliding_window on
    its sliding layers only: both read as transformers applies them (no window elsewhere)."""
    config = _class_defaults("Qwen2MoeConfig", **overrides)
    facts, m = _assemble_dict(config)
    assert [layer.index for layer in m.layers if layer.sliding_window] == sliding
    result = _check(config, facts, m)
    assert not result.errors and result.checked_layers == 4


def test_ministral3_yarn_fields_do_not_scale_its_softmax():
    """Ministral3Config publishes yarn with mscale_all_dim on GQA attention: transformers keeps head_dim^-0.5."""
    config = _class_defaults("Ministral3Config", num_hidden_layers=4)
    facts, m = _assemble_dict(config)
    assert m.fa.softmax_scale == config["head_dim"] ** -0.5 and "mscale" not in m.fa.scale_derivation
    result = _check(config, facts, m)
    assert not result.errors and result.checked_layers == 4


def test_kv_cache_shape_per_rank_is_checked_against_the_projections():
    """The planned k_cache / v_cache (key dim, KV heads per rank, value dim) against k_proj / v_proj / head_dim: a value
    cache sized like the keys, or the KV heads left unsplit at TP 4, fails by name."""
    config = _config("qwen3_8b")
    facts = normalize_config(config, "config.json")
    m = _analyze("qwen3_8b", attn_tp_size=4)
    assert not _check(config, facts, m).errors

    def resized(**update):
        return [layer.model_copy(update={"caches": [c.model_copy(update=update) for c in layer.caches]})
                for layer in m.layers]

    (error,) = _check(config, facts, m, resized(num_head=8)).errors  # 8 KV heads not split over 4 ranks
    assert "analyzer (128, 8, 128) vs transformers (128, 2, 128)" in error and "at attn TP 4" in error
    assert "on 36 layer(s)" in error


def test_mimo_v2_flash_value_dim_sinks_and_kv_heads_are_planned_per_layer(tmp_path, monkeypatch):
    """MiMo-V2-Flash: value heads of 128 (v_head_dim) beside 192-dim keys, twice the KV heads and learnable sinks on its
    sliding layers (transformers' MiMoV2FlashAttention.__init__; no config field says the last two). Planned: K caches
    of 192 and V caches of 128 per head, 8 KV heads and sinks on the sliding layers only, FA v2 TND (the pair the op
    docs list), the device question value_head_dim listed. Negative controls: an analyzer that ignores v_head_dim, or
    the sliding-layer rule, is caught by the cross-check against transformers' modules, by name."""
    import transformers
    from model_infer_kvcache.analyzer import config_loader

    path = tmp_path / "config.json"
    path.write_text(json.dumps(transformers.MiMoV2FlashConfig(num_hidden_layers=6).to_dict(), default=str))
    m = analyze(AnalyzeRequest(config=str(path)))
    assert not m.blockers and m.fa.version == "v2" and m.fa.input_layout == "TND"
    assert m.model.v_head_dim == 128 and m.model.sink_layers == [1, 2, 3, 4]
    shapes = [[(c.name, c.dim, c.num_head) for c in layer.caches] for layer in m.layers]
    assert shapes[0] == shapes[5] == [("k_cache", 192, 4), ("v_cache", 128, 4)]
    assert shapes[1] == [("k_cache", 192, 8), ("v_cache", 128, 8)]
    assert m.memory.per_layer_token_bytes == [2 * 4 * 320, *[2 * 8 * 320] * 4, 2 * 4 * 320]
    assert "value_head_dim" in {d.question for d in m.device_dependencies}
    with monkeypatch.context() as patch:
        patch.setattr(config_loader, "_value_head_dim",
                      lambda r, head_dim: config_loader.Sourced(None, "ignored"))
        with pytest.raises(InputError) as err:
            analyze(AnalyzeRequest(config=str(path)))
    assert "analyzer (192, 4, 192) vs transformers (192, 4, 128)" in err.value.render()
    monkeypatch.setattr(config_loader, "SLIDING_LAYER_RULES", {})
    with pytest.raises(InputError) as err:
        analyze(AnalyzeRequest(config=str(path)))
    text = err.value.render()
    assert "analyzer (192, 4, 128) vs transformers (192, 8, 128)" in text
    assert "attention sinks: analyzer none" in text and "MiMoV2FlashAttention.sinks" in text


@pytest.mark.parametrize("cls_name, overrides, words", [
    # Zamba: Mamba layers, and hybrid layers with a shared attention block beside their mixer. kvcache plans them
    # (a shared-block hybrid, tests/test_mamba_hybrids.py); an analyzer without that kind reads its layers_block_type
    # (ZambaConfig.attribute_map's layer_types) 'hybrid' as no layer kind it plans, and names what transformers' block
    # there holds
    ("ZambaConfig", {"num_hidden_layers": 8}, ["layer type 'hybrid'", "ZambaHybridLayer",
                                               "holds ZambaAttention with per-request state beside its KV cache",
                                               "ZambaMambaMixer"]),
])
def test_hybrids_whose_recurrent_state_kvcache_does_not_plan_are_refused_by_name(tmp_path, monkeypatch, cls_name,
                                                                                 overrides, words):
    """Planned as attention only, their recurrent states would be dropped: the cross-check reads the decoder blocks
    (of mixed classes too) and names the mixer."""
    from model_infer_kvcache.analyzer import config_loader

    path = tmp_path / "config.json"
    path.write_text(json.dumps(_class_defaults(cls_name, **overrides)))
    assert not analyze(AnalyzeRequest(config=str(path))).blockers  # planned with its shared-block kind
    monkeypatch.setattr(config_loader, "SHARED_BLOCK_HYBRIDS", frozenset())
    with pytest.raises(InputError) as err:
        analyze(AnalyzeRequest(config=str(path)))
    assert all(w in err.value.render() for w in words), err.value.render()


def test_a_parallel_mixer_the_plan_misses_is_refused_by_name(tmp_path):
    """Falcon-H1 is planned as attention plus its mixer's state per decoder layer; an analyzer that read its layers as
    attention only (the mistake before the parallel kind) is caught by the cross-check naming the mixer."""
    import dataclasses

    from model_infer_kvcache.analyzer.arch_check import cross_check
    from model_infer_kvcache.analyzer.config_loader import Sourced, load_model_facts

    config = _class_defaults("FalconH1Config", num_hidden_layers=2)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    m = analyze(AnalyzeRequest(config=str(path)))
    facts = load_model_facts(str(path))
    assert cross_check(config, facts, m.layers, m.fa.softmax_scale, "").errors == []
    attention_only = dataclasses.replace(facts, layer_kinds=Sourced(("full", "full"), "misread"),
                                         sublayers_per_layer=Sourced(1, "misread"))
    bad = cross_check(config, attention_only, [layer for layer in m.layers if not layer.is_state],
                      m.fa.softmax_scale, "")
    assert any("recurrent mixer (FalconH1Mixer) beside its attention" in e and "on 2 layer(s)" in e
               for e in bad.errors), bad.errors


def test_cross_check_confirms_phi35_moe_full_attention():
    """transformers applies the 131072 window on every layer: equivalent to full over the context."""
    config = _config("phi35_moe")
    # The fixture omits the published 64-float longrope lists (see SOURCES.md); transformers needs them.
    config["rope_scaling"] = {**config["rope_scaling"], "short_factor": [1.0] * 64, "long_factor": [1.0] * 64}
    facts, m = _assemble_dict(config)
    hf = arch_check.hf_attentions(config, "phimoe")
    assert {a.window for a in hf} == {131072}
    result = _check(config, facts, m)
    assert not result.errors and result.checked_layers == 32


def test_phi35_moe_fixture_without_rope_lists_reports_the_check_skipped():
    m = _analyze("phi35_moe")
    assert any("cross-check skipped" in w.message and "phimoe" in w.message for w in m.warnings)


def test_wrong_scale_is_an_error_with_both_values():
    config = _config("qwen3_8b")
    facts, m = _assemble_dict(config)
    result = _check(config, facts, m, scale=1.0, scale_txt="deliberately wrong")
    assert len(result.errors) == 1
    error = result.errors[0]
    assert "analyzer 1 (deliberately wrong)" in error and "transformers 0.0883883476" in error
    assert "Qwen3Attention.scaling" in error and "36 layer(s)" in error


def test_wrong_window_is_an_error_with_both_values():
    config = _config("gpt_oss_20b")
    facts, m = _assemble_dict(config)
    layers = [layer.model_copy(update={"sliding_window": 64}) if layer.attn_type == "SlidingWindow" else layer
              for layer in m.layers]
    result = _check(config, facts, m, layers)
    assert len(result.errors) == 1
    assert "analyzer 64 (SlidingWindow) vs transformers 128" in result.errors[0]
    assert "12 layer(s)" in result.errors[0]


def test_analyze_refuses_a_scale_rule_that_disagrees_with_transformers(monkeypatch):
    """Without the Granite rule the analyzer would use head_dim^-0.5: the cross-check catches it."""
    monkeypatch.setitem(rules.FAMILY_SCALE_RULE, "granite", "head_dim")
    with pytest.raises(InputError) as err:
        _assemble_dict(GRANITE_3_2B, "granite/config.json")
    text = err.value.render()
    assert "\n" not in text and text.startswith("granite/config.json: model_type:")
    assert "analyzer 0.125 (head_dim^-0.5 = 64^-0.5)" in text
    assert "transformers 0.015625 (GraniteAttention.scaling)" in text


def test_cli_reports_a_cross_check_error_in_one_line_and_writes_nothing(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(GRANITE_3_2B), encoding="utf-8")
    out = tmp_path / "manifest.json"
    code = ("import sys; from model_infer_kvcache.analyzer import rules; rules.FAMILY_SCALE_RULE['granite'] = 'head_dim'; "
            "from model_infer_kvcache.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "analyze", "--config", str(config), "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "softmax scale" in lines[0] and "0.015625" in lines[0]
    assert not out.exists()


def test_a_skipped_cross_checks_reason_does_not_follow_the_hash_seed(tmp_path):
    """transformers' error for Phi-3.5-MoE's longrope prints a set of key names, in the order of the process's hash
    seed; the manifest carries the reason, so its bytes (and the rendered files' header hash) would change from one
    run to the next. Two seeds, no cache: the same manifest."""
    outs = []
    for seed in ("1", "2"):
        out = tmp_path / f"m{seed}.json"
        env = {**__import__("os").environ, "PYTHONHASHSEED": seed, "KVCACHE_CACHE_DIR": ""}
        proc = subprocess.run([sys.executable, "-m", "model_infer_kvcache", "analyze", "--config",
                               str(CONFIGS / "phi35_moe.json"), "--out", str(out)], capture_output=True, text=True,
                              env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr
        outs.append(out.read_text(encoding="utf-8"))
    assert "{'long_factor', 'short_factor'}" in outs[0]  # the reason is there, its set sorted
    assert outs[0] == outs[1]
    # negative control: the order Python prints depends on the seed; the text kvcache writes does not
    assert arch_check._stable_text("keys: {'short_factor', 'long_factor'}") == "keys: {'long_factor', 'short_factor'}"
