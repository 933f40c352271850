"""LiquidAI's LFM2 / LFM2-MoE / LFM3: gated short-conv layers (transformers ``Lfm2ShortConv`` ...) planned as a conv-only
recurrent-state family (``short_conv``: the last conv_L_cache - 1 inputs of hidden_size channels per request, no
recurrent state), rendered and validated against transformers' own layers in both modes, and the realistic mistakes
of a short-conv port, each failing by name."""

from __future__ import annotations

import dataclasses
import json

import pytest
from model_infer_kvcache.analyzer.arch_check import cross_check
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.config_loader import load_model_facts
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.linear_config import MAMBA2, SHORT_CONV, LinearFacts, mixer_off
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from test_hybrid_render import LAYERS, NUMERIC, SHORT, mistake_fails_by_name
from validators_support import CONFIGS, check, render_case, run_validate

# LFM2-1.2B's published layout (tests/fixtures/configs/SOURCES.md): attention at 2, 5, 8, 10, 12, 14, conv elsewhere
LFM2_CONV_LAYERS = [0, 1, 3, 4, 6, 7, 9, 11, 13, 15]


def _plan(config: str, **over):
    return analyze(AnalyzeRequest(config=str(CONFIGS / f"{config}.json"), **over))


@pytest.mark.parametrize("config, layers, kernel, dtype_bytes", [
    ("lfm3", [i for i in range(24) if i % 4 not in (0, 2)] + [0], 7, 2),  # Lfm3Config: conv where i % 4 is 1 or 3, and 0
    ("lfm2_1_2b", LFM2_CONV_LAYERS, 3, 2),
    ("lfm2_moe", [i for i in range(24) if i not in (2, 6, 10, 14, 18, 21)], 3, 2),
])
def test_short_conv_layers_keep_a_conv_state_only(config, layers, kernel, dtype_bytes):
    """Each conv layer keeps [hidden_size, conv_L_cache - 1] (its last inputs), nothing else: no heads, no recurrent
    state, none of their fields in the manifest; the attention layers are paged as usual."""
    m = _plan(config)
    lin = m.linear_attention
    assert lin.family == SHORT_CONV and lin.layers == sorted(layers) and lin.conv_kernel == kernel
    assert [(s.name, s.shape) for s in lin.states] == [("conv_state", [2048, kernel - 1])]
    assert lin.state_bytes_per_layer == 2048 * (kernel - 1) * dtype_bytes
    assert lin.num_k_heads is None and lin.num_v_heads_per_rank is None
    data = json.loads(m.to_json())["linear_attention"]
    assert not {"num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"} & set(data)
    assert "recurrent_state" not in m.to_json() and "(no recurrent state)" in lin.reason
    assert all(layer.is_state == (layer.decoder_layer in layers) for layer in m.layers)


def test_an_lfm2_config_with_full_attn_idxs_only_plans_the_same_layers(tmp_path):
    """Older LFM2 configs list the attention layers as full_attn_idxs without layer_types (Lfm2Config.__post_init__
    derives the conv layers from it)."""
    data = json.loads((CONFIGS / "lfm2_1_2b.json").read_text())
    del data["layer_types"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    m = analyze(AnalyzeRequest(config=str(path)))
    assert m.linear_attention.layers == LFM2_CONV_LAYERS
    data["full_attn_idxs"] = [2, 16]
    path.write_text(json.dumps(data))
    with pytest.raises(InputError, match="must be a layer index in 0..15, got 16") as err:
        analyze(AnalyzeRequest(config=str(path)))
    assert err.value.field == "full_attn_idxs[1]"


@pytest.mark.parametrize("config", ["lfm2_moe", "lfm3"])
def test_lfm2_moe_and_lfm3_without_layer_types_are_refused_naming_the_field(tmp_path, config):
    """Lfm2MoeConfig has no layer_types default (transformers cannot build the model without one); LFM3's default
    pattern is not rebuilt: both refused as bad input, not planned as all attention."""
    data = json.loads((CONFIGS / f"{config}.json").read_text())
    del data["layer_types"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InputError, match=f"model_type {config} names its conv and attention layers") as err:
        analyze(AnalyzeRequest(config=str(path)))
    assert err.value.field == "layer_types"


def test_attention_tp_splits_the_conv_channels():
    """A depthwise conv: each rank convolves its share of the hidden channels (in_proj's columns split with them)."""
    lin = _plan("lfm2_1_2b", attn_tp_size=2).linear_attention
    assert [s.shape for s in lin.states] == [[1024, 2]] and lin.conv_channels_per_rank == 1024


def test_a_hand_edited_manifest_giving_a_short_conv_recurrent_sizes_is_refused():
    """The recurrent-state sizes are all absent for a conv-only family (never placeholder dims)."""
    data = json.loads(_plan("lfm3").to_json())
    data["linear_attention"].update(num_k_heads=1, num_v_heads=1, head_k_dim=1, head_v_dim=1,
                                    num_k_heads_per_rank=1, num_v_heads_per_rank=1)
    with pytest.raises(ValueError, match=r"linear_attention: short_conv has recurrent-state sizes \['num_k_heads'"):
        SelectionManifest.model_validate(data)


def test_the_cross_check_compares_the_planned_conv_with_transformers_layer():
    """The cross-check reads each Lfm3ShortConv's conv on the meta device: a reader that took LFM2's width (3) for
    LFM3's (7) is refused naming both."""
    facts = load_model_facts(str(CONFIGS / "lfm3.json"))
    m = _plan("lfm3")
    config = json.loads((CONFIGS / "lfm3.json").read_text())
    ok = cross_check(config, facts, m.layers, m.fa.softmax_scale, "")
    assert ok.errors == [] and ok.ships
    lin = facts.linear.value
    wrong = dataclasses.replace(lin, conv_kernel=3)
    bad = cross_check(config, dataclasses.replace(facts, linear=dataclasses.replace(facts.linear, value=wrong)),
                      m.layers, m.fa.softmax_scale, "")
    assert any("conv_kernel 3 vs 7" in e for e in bad.errors), bad.errors


def test_mixer_off_tells_a_short_conv_from_a_mamba_mixer():
    lin = LinearFacts(SHORT_CONV, 0, 0, 0, 0, 3, 2048, "", None)
    conv = {"mixer_conv_kernel": 3, "mixer_conv_channels": 2048, "mixer_short_conv": 1}
    assert mixer_off(lin, conv) is None and mixer_off(lin, {}) is None
    assert mixer_off(lin, {**conv, "mixer_conv_channels": 1024}) == "conv_channels 2048 vs 1024"
    mamba = LinearFacts(MAMBA2, 1, 128, 256, 64, 4, 8704, "", None)
    assert mixer_off(mamba, conv) == "family mamba2 vs transformers' short conv"


# Reduced widths for the run tests (the analyzer tests above keep the published sizes): the render hard-codes the
# conv channels (hidden_size), and the float64 reference at hidden 2048 costs minutes on two shared cores.
SMALL = {"lfm3": {"hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1},
         "lfm2_1_2b": {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2},
         "lfm2_moe": {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}}


@pytest.mark.slow
@pytest.mark.parametrize("config, mode", [("lfm3", "framework"), ("lfm2_1_2b", "standalone"),
                                          ("lfm2_moe", "framework")])
def test_short_conv_hybrids_render_and_validate(tmp_path, config, mode):
    """The render's conv by each request's state block (framework) or slot (standalone), against transformers' own
    short-conv layers (their causal_conv1d_forward over the whole prefix), through a stream that reuses freed state
    blocks and pads decode rows."""
    manifest, rendered, cfg = render_case(tmp_path, config, SMALL[config], deploy_mode=mode)
    text = (rendered / "kvcache_attention.py").read_text(encoding="utf-8")
    assert ("MambaCacheEntry(" in text) == (mode == "framework") and "recurrent_state" not in text
    assert "def conv_step(" in text and "F.silu" not in text
    report = run_validate(manifest, rendered, cfg, scenario=SHORT)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert check(report, NUMERIC).measured["max_abs_diff"] <= 1e-9


SHORT_CONV_MISTAKES = [
    # the conv state not reset on a reused slot: prefill convolves over the previous request's last inputs
    ("prefill-reads-the-conv-state", "lfm3", "framework",
     r"            if is_prefill:\n                history = x\.new_zeros\(CONV_KERNEL - 1, CONV_CHANNELS_PER_RANK\)\n"
     r"            else:\n                history", "            history", NUMERIC),
    ("prefill-reads-the-conv-state", "lfm2_1_2b", "standalone",
     r"            if is_prefill:\n                history = x\.new_zeros\(CONV_KERNEL - 1, CONV_CHANNELS_PER_RANK\)\n"
     r"            else:\n                history", "            history", NUMERIC),
    # the conv state keeps the oldest inputs of the window instead of the newest
    ("conv-state-keeps-the-oldest-inputs", "lfm2_1_2b", "framework", r"window\[-\(CONV_KERNEL - 1\):\]",
     "window[:CONV_KERNEL - 1]", NUMERIC),
    # get_cache_info looking the layer up as Qwen3-Next's linear_attn: an LFM2 layer keeps it as `conv`, so the
    # render falls back to self_attn, which a conv layer does not have
    ("conv-looked-up-as-linear-attn", "lfm3", "framework", r'getattr\(decoder_layer, "conv", None\)',
     'getattr(decoder_layer, "linear_attn", None)', "rendered code runs"),
    # a conv layer given a KV cache: its mixin registered as a full-attention layer
    ("conv-layer-as-full-attention", "lfm2_1_2b", "framework", r'        self\.attn_type = "Mamba"',
     '        self.attn_type = "FullAttention"', LAYERS),
]


@pytest.mark.slow
@pytest.mark.parametrize("case, config, mode, pattern, replacement, failing", SHORT_CONV_MISTAKES,
                         ids=[f"{m[0]}-{m[1]}-{m[2]}" for m in SHORT_CONV_MISTAKES])
def test_a_short_conv_state_mistake_fails_by_name(tmp_path, case, config, mode, pattern, replacement, failing):
    mistake_fails_by_name(render_case(tmp_path, config, SMALL[config], deploy_mode=mode), pattern, replacement,
                          failing)


def test_multi_rank_validation_of_a_short_conv_is_refused_by_name(tmp_path):
    """Validation shards gated delta nets only: a short-conv layer at attention TP 2 is a gap of kvcache's, said so."""
    manifest, rendered, cfg = render_case(tmp_path, "lfm2_1_2b", SMALL["lfm2_1_2b"], deploy_mode="standalone",
                                          attn_tp_size=2)
    with pytest.raises(InputError, match="not supported by kvcache: multi-rank validation of Lfm2ShortConv"):
        run_validate(manifest, rendered, cfg, scenario=SHORT)
