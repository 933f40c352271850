"""Mamba hybrids (Jamba's Mamba-1 mixers; Granite-4.0-H's and Bamba's Mamba-2 mixers) planned as recurrent-state
layers beside paged full attention, rendered and validated against transformers' own mixers in both deployment
modes, and the realistic mistakes of a Mamba state port, each failing by name."""

from __future__ import annotations

import dataclasses
import json

import pytest
from model_infer_kvcache.analyzer.arch_check import cross_check
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.config_loader import load_model_facts
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.linear_config import MAMBA, MAMBA2, LinearFacts, mixer_off
from test_hybrid_render import LAYERS, NUMERIC, SHORT, mistake_fails_by_name
from validators_support import CONFIGS, check, render_case, run_validate


def _plan(config: str, **over):
    path = CONFIGS / f"{config}.json"
    return analyze(AnalyzeRequest(config=str(path), **over))


def test_jamba_mamba1_layers_and_states_follow_the_attention_period():
    """JambaConfig.layers_block_type: attention where i % attn_layer_period == attn_layer_offset (4, 12, 20, 28); the
    other layers keep a conv state over the I = expand x hidden inner channels and a [I, d_state] state."""
    m = _plan("jamba")
    lin = m.linear_attention
    assert lin.family == MAMBA
    assert [layer.index for layer in m.layers if not layer.is_state] == [4, 12, 20, 28]
    assert lin.layers == [i for i in range(32) if i % 8 != 4]
    states = {s.name: s.shape for s in lin.states}
    assert states == {"conv_state": [8192, 3], "recurrent_state": [8192, 16]}
    assert "selective-scan" in lin.operators["prefill"]


def test_granite_4_0_h_mamba2_states_are_heads_by_head_dim_by_state():
    """Mamba-2: the conv runs over x|B|C (H x P + 2 x G x N channels), the state is [H, P, N]; the hub spelling of
    layer_types ("mamba" / "attention") maps onto the kinds."""
    m = _plan("granite_4_0_h")
    lin = m.linear_attention
    assert lin.family == MAMBA2
    assert [layer.index for layer in m.layers if not layer.is_state] == [9, 19, 29]
    states = {s.name: s.shape for s in lin.states}
    assert states == {"conv_state": [128 * 64 + 2 * 1 * 256, 3], "recurrent_state": [128, 64, 256]}
    assert lin.state_bytes_per_layer == (128 * 64 * 256 * 4) + (8704 * 3 * 2)  # float32 state, bfloat16 conv


def test_bamba_attention_indices_place_the_attention_layers():
    m = _plan("bamba")
    assert [layer.index for layer in m.layers if not layer.is_state] == [9, 18, 27]
    assert m.linear_attention.family == MAMBA2


def test_a_mamba2_inner_width_that_is_not_heads_by_head_dim_is_refused(tmp_path):
    """transformers would build a mixer whose scan cannot view its input as [heads, head_dim]."""
    data = json.loads((CONFIGS / "granite_4_0_h.json").read_text(encoding="utf-8"))
    data["mamba_expand"] = 3
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(InputError) as err:
        analyze(AnalyzeRequest(config=str(bad)))
    assert err.value.field == "mamba_expand" and "heads x head_dim" in str(err.value)


@pytest.mark.parametrize("config", ["granite_4_0_h", "jamba"])
def test_the_cross_check_compares_the_planned_state_with_the_mixer(config):
    """The architecture cross-check reads each transformers mixer's sizes on the meta device; a reader that swapped
    the state's dims (head_dim read as d_state: the easy slip of a [H, P, N] state) is refused by name."""
    facts = load_model_facts(str(CONFIGS / f"{config}.json"))
    m = _plan(config)
    lin = facts.linear.value
    ok = cross_check(json.loads((CONFIGS / f"{config}.json").read_text()), facts, m.layers, m.fa.softmax_scale, "")
    assert ok.errors == [] and ok.ships
    swapped = LinearFacts(lin.family, lin.num_k_heads, lin.num_v_heads, lin.head_v_dim, lin.head_k_dim,
                          lin.conv_kernel, lin.conv_channels, lin.source, lin.reference)
    facts = dataclasses.replace(facts, linear=dataclasses.replace(facts.linear, value=swapped))
    bad = cross_check(json.loads((CONFIGS / f"{config}.json").read_text()), facts, m.layers, m.fa.softmax_scale, "")
    assert any(e.startswith("recurrent state (planned vs transformers'")
               and f"head_dim {lin.head_k_dim} vs {lin.head_v_dim}, state {lin.head_v_dim} vs {lin.head_k_dim}" in e
               for e in bad.errors), bad.errors


def test_mixer_off_names_each_size_that_differs():
    lin = LinearFacts(MAMBA2, 1, 128, 256, 64, 4, 8704, "", None)
    sizes = {"mixer_heads": 128, "mixer_head_dim": 64, "mixer_state": 256, "mixer_groups": 1,
             "mixer_conv_kernel": 4, "mixer_conv_channels": 8704}
    assert mixer_off(lin, sizes) is None
    assert mixer_off(lin, {**sizes, "mixer_groups": 8, "mixer_conv_channels": 12288}) == \
        "groups 1 vs 8, conv_channels 8704 vs 12288"
    assert mixer_off(lin, {}) is None  # not a Mamba mixer


@pytest.mark.slow
@pytest.mark.parametrize("config, mode", [("granite_4_0_h", "framework"), ("jamba", "standalone"),
                                          ("bamba", "standalone"), ("jamba", "framework")])
def test_mamba_hybrids_render_and_validate(tmp_path, config, mode):
    """The render's conv and scan, by each request's state block (framework) or slot (standalone), against
    transformers' own mixers (their mamba(2)_scan_forward over the whole prefix) through a stream that reuses freed
    state blocks and pads decode rows."""
    manifest, rendered, cfg = render_case(tmp_path, config, OVERRIDES.get(config), deploy_mode=mode)
    text = (rendered / "kvcache_attention.py").read_text(encoding="utf-8")
    assert ("MambaCacheEntry(" in text) == (mode == "framework")
    assert ("def ssd_chunk(" in text) == (config != "jamba") and ("def selective_recurrence(" in text) == \
        (config == "jamba")
    report = run_validate(manifest, rendered, cfg, scenario=SHORT)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert check(report, NUMERIC).measured["max_abs_diff"] <= 1e-9


ATTN = "kvcache_attention.py"
# Mamba-2 at 16 heads of 16 with d_state 64 (128 x 64 x 256 published) and 8 query heads at hidden 128: the published
# [128, 64, 256] state takes the float64 reference's chunk scan minutes per stream on two cores, and no check below
# depends on the width (the analyzer tests above keep the published sizes). Bamba also runs 8 B/C groups
# (Nemotron-H's count), so each group serves 2 heads.
SMALL_MAMBA2 = {"hidden_size": 128, "mamba_expand": 2, "mamba_n_heads": 16, "mamba_d_head": 16, "mamba_d_state": 64,
                "num_attention_heads": 8, "num_key_value_heads": 4}
OVERRIDES = {"granite_4_0_h": SMALL_MAMBA2, "bamba": {**SMALL_MAMBA2, "mamba_n_groups": 8}}
MAMBA_MISTAKES = [
    # the state not reset on a reused slot: prefill continues from what the block holds (a finished request's state)
    ("prefill-reads-the-ssm-state", "granite_4_0_h", "framework",
     r"if forward_metadata\.is_prefill \\\n\s+else self\.recurrent_state\[slots\[row\]\]\.to\(dtype\)",
     "if False else self.recurrent_state[slots[row]].to(dtype)", NUMERIC),
    ("prefill-reads-the-ssm-state", "jamba", "standalone",
     r"if forward_metadata\.is_prefill \\\n\s+else self\.recurrent_state\[slots\[row\]\]\.to\(dtype\)",
     "if False else self.recurrent_state[slots[row]].to(dtype)", NUMERIC),
    # the conv history read on prefill too: the row's previous request's last inputs leak into the new one
    ("prefill-reads-the-conv-state", "jamba", "framework",
     r"            if is_prefill:\n                history = x\.new_zeros\(CONV_KERNEL - 1, CONV_CHANNELS_PER_RANK\)\n"
     r"            else:\n                history", "            history", NUMERIC),
    # the conv state keeps the oldest inputs of the window instead of the newest (x|B|C history of the wrong tokens)
    ("conv-state-shifted-the-wrong-way", "granite_4_0_h", "framework", r"window\[-\(CONV_KERNEL - 1\):\]",
     "window[:CONV_KERNEL - 1]", NUMERIC),
    # B/C groups tiled over the heads (head h reads group h % G) instead of head h reading group h // (H / G)
    ("b-c-groups-tiled", "bamba", "standalone",
     r"B = B\.to\(dtype\)\.repeat_interleave\(group, dim=1\)\n(\s+)C = C\.to\(dtype\)\.repeat_interleave\(group, dim=1\)",
     r"B = B.to(dtype).repeat(1, group, 1)\n\1C = C.to(dtype).repeat(1, group, 1)", NUMERIC),
    # get_cache_info looking the mixer up as Qwen3-Next's linear_attn: a Jamba layer keeps it as `mamba`, so the
    # render falls back to self_attn, which a Mamba layer does not have
    ("mixer-looked-up-as-linear-attn", "jamba", "framework", r'getattr\(decoder_layer, "mamba", None\)',
     'getattr(decoder_layer, "linear_attn", None)', "rendered code runs"),
    # a Mamba layer given a KV cache: its mixin registered as a full-attention layer
    ("mamba-layer-as-full-attention", "jamba", "framework", r'        self\.attn_type = "Mamba"',
     '        self.attn_type = "FullAttention"', LAYERS),
]


@pytest.mark.slow
@pytest.mark.parametrize("case, config, mode, pattern, replacement, failing", MAMBA_MISTAKES,
                         ids=[f"{m[0]}-{m[1]}" for m in MAMBA_MISTAKES])
def test_a_mamba_state_mistake_fails_by_name(tmp_path, case, config, mode, pattern, replacement, failing):
    mistake_fails_by_name(render_case(tmp_path, config, OVERRIDES.get(config), deploy_mode=mode), pattern,
                          replacement, failing)


@pytest.mark.parametrize("config, k_per_rank, conv, state", [
    ("granite_4_0_h", 1, 64 * 64 + 2 * 256, [64, 64, 256]),  # one group, replicated: each rank's heads read it
    ("jamba", 1, 4096, [4096, 16]),  # Mamba-1's single B/C stays whole; the inner channels split
])
def test_attention_tp_splits_the_mamba_heads_and_replicates_a_single_group(config, k_per_rank, conv, state):
    lin = _plan(config, attn_tp_size=2).linear_attention
    assert lin.num_k_heads_per_rank == k_per_rank
    assert lin.conv_channels_per_rank == conv
    assert next(s.shape for s in lin.states if s.name == "recurrent_state") == state


def test_k_heads_per_rank_replicates_only_what_the_family_allows():
    from model_infer_kvcache.analyzer.linear_config import GATED_DELTA_NET, k_heads_per_rank

    assert k_heads_per_rank(MAMBA2, 8, 2) == 4 and k_heads_per_rank(MAMBA2, 2, 8) == 1
    assert k_heads_per_rank(MAMBA2, 6, 4) is None  # neither divides: a rank's heads would read two groups
    assert k_heads_per_rank(GATED_DELTA_NET, 2, 4) is None  # key heads are split, never replicated
    assert k_heads_per_rank(MAMBA, 1, 8) == 1


def test_multi_rank_validation_of_a_mamba_mixer_is_refused_by_name(tmp_path):
    """Validation shards gated delta nets only: a Mamba layer at attention TP 2 is a gap of kvcache's, said so."""
    manifest, rendered, cfg = render_case(tmp_path, "jamba", deploy_mode="standalone", attn_tp_size=2)
    # the ranks' error comes back as the InputError it is (exit 2), its text kept
    with pytest.raises(InputError, match="not supported by kvcache: multi-rank validation of JambaMambaMixer"):
        run_validate(manifest, rendered, cfg, scenario=SHORT)



def test_falcon_h1_plans_attention_and_its_mixer_state_as_two_sublayers():
    """Falcon-H1 runs attention and a Mamba-2 mixer side by side in every decoder layer: each decoder layer plans its
    KV cache (sublayer 0) and its state (sublayer 1); the cross-check compares each mixer beside its attention."""
    m = _plan("falcon_h1")
    assert m.model.sublayers_per_layer == 2 and len(m.layers) == 64
    assert [(layer.decoder_layer, layer.sublayer, layer.attn_type) for layer in m.layers[:4]] == [
        (0, 0, "FullAttention"), (0, 1, "Mamba"), (1, 0, "FullAttention"), (1, 1, "Mamba")]
    lin = m.linear_attention
    assert lin.family == MAMBA2 and lin.layers == list(range(32))
    assert {s.name: s.shape for s in lin.states} == {"conv_state": [1024 + 2 * 256, 3], "recurrent_state": [128, 8, 256]}
    assert m.plan_of_module(5) is m.layers[10]  # an attention module's FA calls name its decoder layer


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_falcon_h1_renders_and_validates(tmp_path, mode):
    manifest, rendered, cfg = render_case(tmp_path, "falcon_h1", deploy_mode=mode)
    text = (rendered / ATTN).read_text(encoding="utf-8")
    assert ("return [decoder_layer.self_attn, decoder_layer.mamba]" in text) == (mode == "framework")
    report = run_validate(manifest, rendered, cfg, scenario=SHORT)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert check(report, NUMERIC).measured["max_abs_diff"] <= 1e-9


FALCON_H1_MISTAKES = [
    # the mixer's state reused across requests: prefill continues from the block
    ("prefill-reads-the-ssm-state", "standalone",
     r"if forward_metadata\.is_prefill \\\n\s+else self\.recurrent_state\[slots\[row\]\]\.to\(dtype\)",
     "if False else self.recurrent_state[slots[row]].to(dtype)", NUMERIC),
    # get_cache_info registering the attention only: the mixer's states never get blocks
    ("mixer-states-not-registered", "framework",
     r"return \[decoder_layer\.self_attn, decoder_layer\.mamba\]", "return [decoder_layer.self_attn]",
     "get_cache_info layer count"),
]


@pytest.mark.slow
@pytest.mark.parametrize("case, mode, pattern, replacement, failing", FALCON_H1_MISTAKES,
                         ids=[m[0] for m in FALCON_H1_MISTAKES])
def test_a_falcon_h1_mistake_fails_by_name(tmp_path, case, mode, pattern, replacement, failing):
    mistake_fails_by_name(render_case(tmp_path, "falcon_h1", deploy_mode=mode), pattern, replacement, failing)


# Zamba2: a hybrid layer runs a shared transformer block (attention + MLP whose weights every num_mem_blocks-th hybrid
# layer shares, with per-layer LoRA adapters and RoPE here), a linear, then its own Mamba-2 mixer; the other layers are
# Mamba-2 only. Small: 4 heads of 2 x 64 / 4 = 32 over concat(hidden, embeddings) (kv heads = heads: transformers'
# adapters add attention_hidden_size columns to k/v, so it builds no GQA with them), 7 layers whose hybrid layers 1, 3,
# 5 run blocks 0, 1, 0.
SMALL_ZAMBA2 = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4, "n_mamba_heads": 8,
                "mamba_d_state": 16, "mamba_ngroups": 2, "num_mem_blocks": 2, "use_shared_attention_adapter": True,
                "adapter_rank": 8, "use_mem_rope": True, "intermediate_size": 128, "num_hidden_layers": 7,
                "layers_block_type": ["linear_attention", "hybrid"] * 3 + ["linear_attention"]}


# what Zamba2Config.__post_init__ derives and to_dict saves (a saved one wins over the derivation)
ZAMBA2_DERIVED = ("attention_hidden_size", "attention_head_dim", "mamba_headdim", "kv_channels", "num_query_groups",
                  "hybrid_layer_ids")


def _zamba2(tmp_path, small: dict | None = None, drop: tuple[str, ...] = ()):
    """Zamba2Config's class defaults (with ``small`` over them, the fields it derives left out) as a config file."""
    from transformers import Zamba2Config

    data = {k: v for k, v in Zamba2Config().to_dict().items() if k not in (ZAMBA2_DERIVED if small else drop)}
    path = tmp_path / "zamba2.json"
    path.write_text(json.dumps({**data, **(small or {})}), encoding="utf-8")
    return path


def test_zamba2_plans_each_hybrid_layer_a_kv_cache_beside_its_mamba_state(tmp_path):
    """Class defaults: 54 layers, hybrid at 6, 12, ... 51 (9): each hybrid layer plans its own KV cache (sublayer 0:
    the cache is indexed by the decoder layer, Zamba2Attention.forward's cache.update(..., layer_idx), not by the
    shared module) and its Mamba-2 state (sublayer 1); a Mamba layer its state only. head_dim 2 x 2560 / 32 = 160,
    scale (160 / 2)^-0.5 (Zamba2Attention.scaling); the cross-check against transformers' modules passed."""
    m = analyze(AnalyzeRequest(config=str(_zamba2(tmp_path, drop=ZAMBA2_DERIVED))))
    assert not m.blockers and m.model.sublayers_per_layer == 2 and len(m.layers) == 54 + 9
    assert [(layer.decoder_layer, layer.sublayer, layer.attn_type) for layer in m.layers[5:9]] == [
        (5, 0, "Mamba"), (6, 0, "FullAttention"), (6, 1, "Mamba"), (7, 0, "Mamba")]
    hybrid = [layer.decoder_layer for layer in m.attention_layers]
    assert hybrid == [6, 12, 18, 24, 30, 36, 42, 47, 51]
    assert m.model.head_dim == 160 and m.fa.softmax_scale == pytest.approx(80 ** -0.5)
    # the attention of decoder layer 47 is cache layer 47 + the 7 hybrid layers before it (each a second sublayer)
    assert m.plan_of_module(47).index == 47 + 7 and m.plan_of_module(47).attn_type == "FullAttention"
    lin = m.linear_attention
    assert lin.family == MAMBA2 and lin.layers == list(range(54))
    # mamba_headdim = 2 x 2560 / 8 heads = 640, derived as Zamba2Config.__post_init__ does
    assert {s.name: s.shape for s in lin.states} == {"conv_state": [5120 + 2 * 64, 3], "recurrent_state": [8, 640, 64]}
    assert "Zamba2Config.__post_init__" in m.model.sources["head_dim"] and "Zamba2Config" in lin.source


def test_zamba2_without_layers_block_type_plans_its_class_pattern(tmp_path):
    """Zamba2Config.__post_init__ fills layers_block_type with its 54-layer pattern when the config has none: read from
    the class built over the config (read as attention layers, the cross-check refused 108 sublayers against 54
    blocks)."""
    m = analyze(AnalyzeRequest(config=str(_zamba2(tmp_path, drop=(*ZAMBA2_DERIVED, "layers_block_type")))))
    assert len(m.layers) == 63 and [layer.decoder_layer for layer in m.attention_layers][:2] == [6, 12]
    assert "derived by transformers Zamba2Config" in m.model.sources["layer_kinds"]


def test_zamba2_hybrid_layers_read_as_attention_only_are_refused_by_the_cross_check(tmp_path):
    """An analyzer that plans a hybrid layer's attention without its mixer's state (the shared block taken for the
    whole layer) is caught by the cross-check naming the mixer beside it."""
    from model_infer_kvcache.analyzer.config_loader import Sourced

    path = _zamba2(tmp_path, drop=ZAMBA2_DERIVED)
    config = json.loads(path.read_text(encoding="utf-8"))
    m = analyze(AnalyzeRequest(config=str(path)))
    facts = load_model_facts(str(path))
    assert cross_check(config, facts, m.layers, m.fa.softmax_scale, "").errors == []
    misread = tuple("full" if kind != "linear" else kind for kind in facts.layer_kinds.value)
    no_mixer = [layer for layer in m.layers if not (layer.is_state and layer.sublayer)]
    bad = cross_check(config, dataclasses.replace(facts, layer_kinds=Sourced(misread, "misread")), no_mixer,
                      m.fa.softmax_scale, "")
    assert any("recurrent mixer (Zamba2MambaMixer) beside its attention" in e and "on 9 layer(s)" in e
               for e in bad.errors), bad.errors


def test_zamba2_adapters_on_grouped_kv_heads_are_refused_naming_the_field(tmp_path):
    """transformers' Zamba2Attention adds its k/v adapters' 2 x hidden_size outputs to KV heads x head_dim
    projections: with 2 KV heads of 32 beside 4 query heads at hidden 64 its model does not run (checked here), so
    the config is refused at analyze, naming num_key_value_heads; without the adapters it is planned."""
    import torch
    from transformers import Zamba2Config, Zamba2ForCausalLM

    grouped = {**SMALL_ZAMBA2, "num_key_value_heads": 2}
    built = Zamba2ForCausalLM(Zamba2Config(**{k: v for k, v in grouped.items()}))
    with pytest.raises(RuntimeError):
        built(torch.tensor([[1, 2, 3]]))
    with pytest.raises(InputError, match="num_key_value_heads: 2 heads x head_dim 32 = 64 is not attention_hidden_size"):
        analyze(AnalyzeRequest(config=str(_zamba2(tmp_path, grouped))))
    m = analyze(AnalyzeRequest(config=str(_zamba2(tmp_path, {**grouped, "use_shared_attention_adapter": False}))))
    assert m.parallel.num_kv_heads_per_rank == 2


def test_zamba2_saved_head_dims_win_over_the_derivation_as_in_transformers(tmp_path):
    """A saved attention_head_dim / mamba_headdim is set after Zamba2Config.__post_init__ derives them, so transformers
    builds the saved widths (the cross-check, comparing with its modules, passes only so); a Mamba head dim whose
    heads do not span the inner width is refused by name."""
    m = analyze(AnalyzeRequest(config=str(_zamba2(tmp_path, {"attention_head_dim": 128}))))
    assert m.model.head_dim == 128 and m.fa.softmax_scale == pytest.approx(64 ** -0.5)
    with pytest.raises(InputError, match="inner width 5120 .* is not heads x head_dim = 8 x 320"):
        analyze(AnalyzeRequest(config=str(_zamba2(tmp_path, {"mamba_headdim": 320}))))


def test_zamba2_manifest_counts_a_state_only_layer_once_and_a_hybrid_twice(tmp_path):
    """The manifest's layer count: 54 decoder layers x 2 sublayers less one for each of the 45 Mamba layers; a hybrid
    layer that lost its mixer's state (or its attention) is refused by the invariant."""
    from model_infer_kvcache.analyzer.manifest import manifest_problems

    m = analyze(AnalyzeRequest(config=str(_zamba2(tmp_path))))
    assert manifest_problems(m) == []
    dropped = m.model_copy(update={"layers": [layer.model_copy(update={"index": i}) for i, layer in enumerate(
        [layer for layer in m.layers if not (layer.decoder_layer == 6 and layer.sublayer == 1)])]})
    assert any(field == "layers" and "= 63" in why for field, why in manifest_problems(dropped))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_zamba2_renders_and_validates_with_a_reused_shared_block(tmp_path, mode):
    """Both modes against transformers' Zamba2 (its shared blocks' weights tied across hybrid layers 1 and 5, per-layer
    adapters, RoPE): the tiny model runs to the first hybrid layer that reuses a block, each hybrid layer's attention
    registered as its own cache layer beside its mixer."""
    manifest, rendered, cfg = _zamba2_case(tmp_path, mode)
    text = (rendered / ATTN).read_text(encoding="utf-8")
    assert ("return [shared.self_attn, decoder_layer.mamba_decoder.mamba]" in text) == (mode == "framework")
    report = run_validate(manifest, rendered, cfg, scenario=SHORT)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert check(report, NUMERIC).measured["max_abs_diff"] <= 1e-9
    assert any("first to reuse a shared block" in note for note in report.notes)
    if mode == "framework":  # 6 layers kept: Mamba 0, 2, 4 and hybrid 1, 3, 5 (two sublayers each)
        assert check(report, "get_cache_info layer count").measured == {"expected": 9, "got": 9}


def _zamba2_case(tmp_path, mode: str):
    from model_infer_kvcache.implementer.render import render_manifest, write_rendered

    cfg = _zamba2(tmp_path, SMALL_ZAMBA2)
    manifest = analyze(AnalyzeRequest(config=str(cfg), deploy_mode=mode))
    (tmp_path / "manifest.json").write_text(manifest.to_json(), encoding="utf-8")
    write_rendered(render_manifest(manifest, allow_blocked=True), tmp_path / "rendered")
    return tmp_path / "manifest.json", tmp_path / "rendered", cfg


def _one_module_per_block(monkeypatch, blocks: int) -> None:
    """The port's mistake of sharing the module with the weights: one attention module per shared block, serving every
    hybrid layer that runs the block (hybrid layer j: block j % num_mem_blocks), so its cache is keyed by the module,
    not the layer: two hybrid layers write one KV cache. The validation host, which gives each hybrid layer its own
    module's host (as transformers builds one module per layer), is bent after it is built to hand every later
    hybrid layer of a block its block's first host."""
    from model_infer_kvcache.validators.pipeline import host_model

    built = host_model.HostModel.__init__

    def init(self, hf_model, *args, **kwargs):
        built(self, hf_model, *args, **kwargs)
        _, layers = host_model.decoder_layers(hf_model)
        first: dict[int, object] = {}
        hybrid = [i for i, layer in enumerate(layers) if hasattr(layer, "shared_transformer")]
        for j, i in enumerate(hybrid):
            attn = layers[i].shared_transformer.self_attn
            owner = first.setdefault(j % blocks, attn._kvcache_host)
            if owner is attn._kvcache_host:
                continue
            self.attentions[self.attentions.index(attn._kvcache_host)] = owner
            attn._kvcache_host = owner
            mixer = self.model.layers[i].mamba_decoder.mamba
            self.model.layers[i] = host_model._ModulePaths({"shared_transformer.self_attn": owner,
                                                            "mamba_decoder.mamba": mixer})

    monkeypatch.setattr(host_model.HostModel, "__init__", init)


ZAMBA2_MISTAKES = [
    # one module per shared block: the render's get_cache_info refuses the module registered for two cache layers
    ("shared-module-one-cache", "framework", None, None, "rendered code runs"),
    # the same port with that refusal taken out: the framework sets the second layer's cache on the module, both
    # hybrid layers write and read it
    ("shared-module-one-cache-unguarded", "framework", r"if owners\.setdefault\(id\(attn\), len\(layer_infos\)\) != "
                                                       r"len\(layer_infos\):", "if False:", NUMERIC),
    # the standalone runner allocates the module's caches once per layer it serves: the last allocation wins
    ("shared-module-one-cache", "standalone", None, None, NUMERIC),
    # a hybrid layer's Mamba state not reset when its slot is reused: prefill continues a finished request's state
    ("prefill-reads-the-ssm-state", "framework",
     r"if forward_metadata\.is_prefill \\\n\s+else self\.recurrent_state\[slots\[row\]\]\.to\(dtype\)",
     "if False else self.recurrent_state[slots[row]].to(dtype)", NUMERIC),
    # get_cache_info registering a hybrid layer's attention only: its mixer's states get no block
    ("hybrid-mixer-not-registered", "framework", r"return \[shared\.self_attn, decoder_layer\.mamba_decoder\.mamba\]",
     "return [shared.self_attn]", "get_cache_info layer count"),
]


@pytest.mark.slow
@pytest.mark.parametrize("case, mode, pattern, replacement, failing", ZAMBA2_MISTAKES,
                         ids=[f"{m[0]}-{m[1]}" for m in ZAMBA2_MISTAKES])
def test_a_zamba2_mistake_fails_by_name(tmp_path, monkeypatch, case, mode, pattern, replacement, failing):
    from unittest import mock

    from model_infer_kvcache.validators.pipeline import validate
    from validators_support import mutate

    if case.startswith("shared-module"):
        _one_module_per_block(monkeypatch, SMALL_ZAMBA2["num_mem_blocks"])
    manifest, rendered, cfg = _zamba2_case(tmp_path, mode)
    if pattern:
        mutate(rendered, pattern, replacement, name=ATTN)
    with mock.patch.object(validate, "_localise", lambda *args, **kwargs: None):
        report = run_validate(manifest, rendered, cfg, scenario=SHORT)
    assert not check(report, failing).passed, [(c.name, c.detail) for c in report.failed()]
    if case == "shared-module-one-cache":
        failed = check(report, failing).detail if mode == "framework" else ""
        assert mode != "framework" or "already serves cache layer" in failed, failed


# Zamba (v1): a hybrid layer runs the one shared transformer block (attention over concat(hidden, embeddings), no RoPE,
# then its MLP; every hybrid layer's copy tied to the first's weights), a linear, then its own multi-head Mamba-1
# mixer (ZambaMambaMixer: n_mamba_heads heads of I / H channels, each its own x_proj / dt_proj, so its own B / C); the
# other layers are that mixer only. Small: 4 query heads of 2 x 64 / 4 = 32, 4 Mamba heads of 2 x 64 / 4 = 32
# channels, 7 layers whose hybrid layers 1, 3, 5 all run the one block.
SMALL_ZAMBA = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4, "n_mamba_heads": 4,
               "mamba_d_state": 16, "intermediate_size": 128, "num_hidden_layers": 7,
               "layers_block_type": ["linear_attention", "hybrid"] * 3 + ["linear_attention"]}
# what ZambaConfig.__post_init__ derives from hidden_size (to_dict saves them; a saved one wins)
ZAMBA_DERIVED = ("attention_hidden_size", "attention_head_dim", "mamba_dt_rank")


def _zamba(tmp_path, small: dict | None = None, drop: tuple[str, ...] = ()):
    """ZambaConfig's class defaults (with ``small`` over them, the fields it derives left out) as a config file."""
    from transformers import ZambaConfig

    data = {k: v for k, v in ZambaConfig().to_dict().items() if k not in (ZAMBA_DERIVED if small else drop)}
    path = tmp_path / "zamba.json"
    path.write_text(json.dumps({**data, **(small or {})}), encoding="utf-8")
    return path


def test_zamba_plans_a_multi_head_mamba1_state_and_each_hybrid_layer_a_kv_cache(tmp_path):
    """Class defaults: 76 layers, hybrid at 2 and then where (i - 3) % 6 == 4 (ZambaConfig.__post_init__): 13, each
    its own KV cache (sublayer 0, the cache indexed by the decoder layer: ZambaAttention.forward's cache.update with
    the caller's layer_idx) beside its mixer's states (sublayer 1). head_dim 2 x 3712 / 16 = 464, scale (464 / 2)^-0.5
    (ZambaAttention.scaling). The mixer's 2 heads of 3712 channels: conv over the 7424 inner channels, state
    [2, 3712, 16] as transformers stacks the heads' states; the cross-check against transformers' modules passes."""
    path = _zamba(tmp_path, drop=ZAMBA_DERIVED)
    m = analyze(AnalyzeRequest(config=str(path)))
    assert not m.blockers and m.model.sublayers_per_layer == 2 and len(m.layers) == 76 + 13
    hybrid = [layer.decoder_layer for layer in m.attention_layers]
    assert hybrid == [2, *range(7, 76, 6)]
    assert [(layer.decoder_layer, layer.sublayer, layer.attn_type) for layer in m.layers[1:5]] == [
        (1, 0, "Mamba"), (2, 0, "FullAttention"), (2, 1, "Mamba"), (3, 0, "Mamba")]
    assert m.model.head_dim == 464 and m.fa.softmax_scale == pytest.approx(232 ** -0.5)
    assert "ZambaConfig.__post_init__" in m.model.sources["head_dim"]
    lin = m.linear_attention
    assert lin.family == MAMBA and lin.num_k_heads == 2 and lin.layers == list(range(76))
    assert {s.name: s.shape for s in lin.states} == {"conv_state": [7424, 3], "recurrent_state": [2, 3712, 16]}
    facts = load_model_facts(str(path))
    config = json.loads(path.read_text(encoding="utf-8"))
    assert cross_check(config, facts, m.layers, m.fa.softmax_scale, "").errors == []


def test_zamba_read_as_a_one_head_mamba1_is_refused_by_the_cross_check(tmp_path):
    """The multi-head state laid out as one head (Jamba's plan: one B/C for all 7424 channels, state [I, N]) is named
    by the cross-check against ZambaMambaMixer's heads."""
    path = _zamba(tmp_path, drop=ZAMBA_DERIVED)
    facts = load_model_facts(str(path))
    m = analyze(AnalyzeRequest(config=str(path)))
    one = dataclasses.replace(facts.linear.value, num_k_heads=1)
    bad = cross_check(json.loads(path.read_text(encoding="utf-8")),
                      dataclasses.replace(facts, linear=dataclasses.replace(facts.linear, value=one)), m.layers,
                      m.fa.softmax_scale, "")
    assert any(e.startswith("recurrent state (planned vs transformers'") and "groups 1 vs 2" in e
               for e in bad.errors), bad.errors


def test_zamba_heads_that_do_not_divide_the_inner_width_are_refused_naming_the_field(tmp_path):
    """ZambaConfig.validate_architecture refuses such a config; the analyzer names n_mamba_heads (bad input)."""
    with pytest.raises(InputError) as err:
        analyze(AnalyzeRequest(config=str(_zamba(tmp_path, {**SMALL_ZAMBA, "n_mamba_heads": 3}))))
    assert err.value.field == "n_mamba_heads" and "inner width 128" in str(err.value)


def test_zamba_attention_tp_splits_the_mamba_heads():
    """A multi-head Mamba-1 splits its B/C heads over the ranks as Mamba-2 its groups; one head stays replicated."""
    from model_infer_kvcache.analyzer.linear_config import k_heads_per_rank

    assert k_heads_per_rank(MAMBA, 2, 2) == 1 and k_heads_per_rank(MAMBA, 4, 2) == 2
    assert k_heads_per_rank(MAMBA, 3, 2) is None and k_heads_per_rank(MAMBA, 1, 2) == 1


def _zamba_case(tmp_path, mode: str, **over):
    from model_infer_kvcache.implementer.render import render_manifest, write_rendered

    cfg = _zamba(tmp_path, SMALL_ZAMBA)
    manifest = analyze(AnalyzeRequest(config=str(cfg), deploy_mode=mode, **over))
    (tmp_path / "manifest.json").write_text(manifest.to_json(), encoding="utf-8")
    write_rendered(render_manifest(manifest, allow_blocked=True), tmp_path / "rendered")
    return tmp_path / "manifest.json", tmp_path / "rendered", cfg


@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_zamba_renders_and_validates_its_heads_and_hybrid_layers(tmp_path, mode):
    """Both modes against transformers' Zamba (4 Mamba heads, the shared block tied across hybrid layers 1, 3, 5):
    the tiny model runs to hybrid layer 3, the first to reuse the block, each hybrid layer's attention its own cache
    layer beside its mixer; the render scans each head with its own B/C into a [4, 32, 16] state."""
    manifest, rendered, cfg = _zamba_case(tmp_path, mode)
    text = (rendered / ATTN).read_text(encoding="utf-8")
    assert ("return [shared.self_attn, decoder_layer.mamba_decoder.mamba]" in text) == (mode == "framework")
    assert "MAMBA_HEAD_CHANNELS = LINEAR_NUM_V_HEADS_PER_RANK // LINEAR_NUM_K_HEADS_PER_RANK" in text
    report = run_validate(manifest, rendered, cfg, scenario=SHORT)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert check(report, NUMERIC).measured["max_abs_diff"] <= 1e-9
    assert any("first to reuse a shared block" in note for note in report.notes)
    if mode == "framework":  # 4 layers kept: Mamba 0, 2 and hybrid 1, 3 (two sublayers each)
        assert check(report, "get_cache_info layer count").measured == {"expected": 6, "got": 6}


ZAMBA_MISTAKES = [
    # the multi-head state scanned as one head (Jamba's one-B/C layout): every channel reads the first head's B / C
    ("ssm-state-as-one-head", "standalone", r"B\[rows, head\], C\[rows, head\]", "B[rows, 0], C[rows, 0]", NUMERIC),
    # a hybrid layer's Mamba state not reset when its slot is reused (the Mamba layers' still are): its prefill
    # continues a finished request's state
    ("hybrid-state-not-reset", "framework", r"if forward_metadata\.is_prefill \\\n",
     "if forward_metadata.is_prefill and self.layer_idx not in (1, 3) \\\n", NUMERIC),
]


@pytest.mark.parametrize("case, mode, pattern, replacement, failing", ZAMBA_MISTAKES,
                         ids=[f"{m[0]}-{m[1]}" for m in ZAMBA_MISTAKES])
def test_a_zamba_mistake_fails_by_name(tmp_path, case, mode, pattern, replacement, failing):
    mistake_fails_by_name(_zamba_case(tmp_path, mode), pattern, replacement, failing)


def test_multi_rank_validation_of_a_multi_head_mamba1_mixer_is_refused_by_name(tmp_path):
    """Planned at attention TP 2 (2 of the 4 Mamba heads a rank, state [2, 32, 16]); validation shards gated delta nets
    only, and ZambaMambaMixer, which calls no scan function, is still named as the Mamba mixer it is."""
    manifest, rendered, cfg = _zamba_case(tmp_path, "standalone", attn_tp_size=2)
    lin = json.loads(manifest.read_text(encoding="utf-8"))["linear_attention"]
    assert [s["shape"] for s in lin["states"]] == [[64, 3], [2, 32, 16]]
    with pytest.raises(InputError, match="not supported by kvcache: multi-rank validation of ZambaMambaMixer"):
        run_validate(manifest, rendered, cfg, scenario=SHORT)
