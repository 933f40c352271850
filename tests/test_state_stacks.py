"""Pure state stacks and blocks without a cache (issue 40): Mamba / FalconMamba / Mamba2 (every layer a mixer, no
attention: no attention field read, the state partial rendered alone), Nemotron-H (Mamba-2, attention, MLP-only and
MoE-only blocks: the last two hold no cache, so the cache layers skip them while keeping their block index) and Dory
(its saved layer_types' "mlp" entries are not layers; its recurrent loops are refused by name). Each mistake fails by
name: a state not reset on slot reuse, an MLP block given a KV cache, the block list shifted, the blocks without a
cache registered with the framework."""

from __future__ import annotations

import json
import re

import pytest
from model_infer_kvcache.analyzer import config_loader
from model_infer_kvcache.analyzer.arch_check import cross_check
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.config_loader import normalize_config
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.linear_config import MAMBA, MAMBA2, NO_CACHE
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from test_hybrid_render import NUMERIC, SHORT, mistake_fails_by_name
from validators_support import CONFIGS, check, render_case, run_validate

ATTN = "kvcache_attention.py"


def _data(config: str, **over) -> dict:
    return {**json.loads((CONFIGS / f"{config}.json").read_text(encoding="utf-8")), **over}


def _plan(tmp_path, config: str, **over):
    path = tmp_path / f"{config}.json"
    path.write_text(json.dumps(_data(config, **over)), encoding="utf-8")
    return analyze(AnalyzeRequest(config=str(path)))


@pytest.mark.parametrize("config, family, conv, state", [
    ("mamba", MAMBA, [1536, 3], [1536, 16]),  # I = expand x hidden = 2 x 768 inner channels, d_state 16
    ("falcon_mamba", MAMBA, [1536, 3], [1536, 16]),
    ("mamba2", MAMBA2, [128 * 64 + 2 * 8 * 128, 3], [128, 64, 128]),  # x|B|C channels; [H, P, N]
])
def test_a_pure_state_stack_is_planned_without_attention_fields(tmp_path, config, family, conv, state):
    """No layer attends: no attention field is read (MambaConfig has none; Mamba2Config's num_heads / head_dim are
    its mixer's), nothing blocks, every layer is a state layer and the memory plan holds the state group only."""
    m = _plan(tmp_path, config)
    assert not m.blockers and m.kv_mode.value == "paged"
    assert all(layer.is_state for layer in m.layers) and not m.attention_layers
    assert m.model.num_attention_heads == 0 and "not read: no layer attends" in m.model.sources["num_attention_heads"]
    lin = m.linear_attention
    assert lin.family == family and lin.layers == list(range(m.model.num_layers))
    assert {s.name: s.shape for s in lin.states} == {"conv_state": conv, "recurrent_state": state}
    assert not any("unknown model family" in w.message for w in m.warnings)  # no attention code to read


@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_a_pure_state_stack_render_names_no_attention_step(mode):
    """INTEGRATION.md of a pure state stack has no attention class or FA step to follow (a port of one would add a
    mixin nothing calls and shape tensors to [T, 0, 0]); the runner is handed the state modules, and the decisions
    table says no layer attends instead of quoting an FA version, a scale and zero heads. A hybrid (Bamba: attention
    beside its Mamba layers) keeps its attention steps: the negative control."""
    from model_infer_kvcache.analyzer.decisions_table import decisions_markdown
    from model_infer_kvcache.implementer.render import render_manifest

    m = analyze(AnalyzeRequest(config=str(CONFIGS / "mamba.json"), deploy_mode=mode))
    text = render_manifest(m).files["INTEGRATION.md"]
    assert "**Attention class**" not in text and "Attention forward" not in text and "FA **" not in text
    assert "no layer attends (a pure state stack)" in text
    if mode == "standalone":
        assert "_init_kvcache([layer.mixer for layer in model.model.layers]" in text
        assert "3. **State modules**" in text
    table = decisions_markdown(m)
    assert "| 注意力 | 无(纯状态栈) |" in table and "FA 版本" not in table and "每卡 heads" not in table.split("线性")[0]
    hybrid = analyze(AnalyzeRequest(config=str(CONFIGS / "bamba.json"), deploy_mode=mode))
    text = render_manifest(hybrid).files["INTEGRATION.md"]
    assert "**Attention class**" in text and "FA **" in text and "FA 版本" in decisions_markdown(hybrid)


def test_an_all_mamba_granite_4_0_h_renders_the_state_partial_alone(tmp_path):
    """GraniteMoeHybridConfig() lists every layer Mamba (was blocked: "a pure state stack"): planned and rendered
    without an attention mixin; get_cache_info registers each mixer's states only."""
    from model_infer_kvcache.implementer.render import render_manifest

    m = _plan(tmp_path, "granite_4_0_h", layer_types=["mamba"] * 32)
    assert not m.blockers and all(layer.is_state for layer in m.layers)
    text = render_manifest(m).files["kvcache_attention.py"]
    assert "def init_kv_cache" not in text and not re.search(r"(?<!Mamba)CacheEntry\(", text)
    assert "MambaCacheEntry(" in text
    assert "return [decoder_layer.mamba]" in text


def test_nemotron_h_blocks_without_a_cache_are_left_out_of_the_cache_layers(tmp_path):
    """NemotronHConfig's default blocks (Mamba-2, MoE, attention, MLP): the MoE and MLP blocks hold no cache, so the
    cache layers are the Mamba block (index 0, block 0) and the attention block (index 1, block 2); the memory plan
    counts those two only."""
    m = _plan(tmp_path, "nemotron_h")
    assert [(layer.index, layer.decoder_layer, layer.attn_type) for layer in m.layers] == [
        (0, 0, "Mamba"), (1, 2, "FullAttention")]
    assert [(b.decoder_layer, b.block) for b in m.no_cache_layers] == [(1, "moe"), (3, "mlp")]
    assert all("keeps no cache" in b.reason for b in m.no_cache_layers)
    assert m.plan_of_module(2) is m.layers[1]  # the attention module keeps its block index 2
    lin = m.linear_attention
    assert lin.family == MAMBA2 and lin.layers == [0]
    assert {s.name: s.shape for s in lin.states} == {"conv_state": [128 * 64 + 2 * 8 * 128, 3],
                                                     "recurrent_state": [128, 64, 128]}
    assert m.memory.derivation[0].startswith("per-token bytes (one rank) = 4096 ")  # one attention layer: 2 x 8 x 128 x 2
    assert "1 linear layers" in m.memory.derivation[1]


def test_nemotron_h_hybrid_override_pattern_reads_as_the_block_list(tmp_path):
    data = _data("nemotron_h")
    del data["layers_block_type"]
    facts = normalize_config({**data, "hybrid_override_pattern": "M-M*E"})
    assert facts.layer_kinds.value == ("linear", NO_CACHE, "linear", "full", NO_CACHE)
    assert facts.num_layers.value == 5 and facts.block_names == {1: "mlp", 4: "moe"}
    with pytest.raises(InputError, match=r"hybrid_override_pattern\[2\].*unknown block 'X'"):
        normalize_config({**data, "hybrid_override_pattern": "M-X*"})


def test_nemotron_h_block_list_shifted_fails_the_cross_check_by_name():
    """An analyzer reading the block list one place off plans a state on the MoE block and no cache on the
    attention block: the meta-device build of transformers' model names it."""
    data = _data("nemotron_h")
    shifted = normalize_config({**data, "layers_block_type": data["layers_block_type"][1:] + data["layers_block_type"][:1]})
    m = analyze(AnalyzeRequest(config=str(CONFIGS / "nemotron_h.json")))
    from model_infer_kvcache.analyzer.build import _layers
    from model_infer_kvcache.analyzer.rules import decide_parallel

    layers = _layers(shifted, decide_parallel(shifted, 1, "test"), "paged", "exclusive")
    result = cross_check(data, shifted, layers, m.fa.softmax_scale, m.fa.scale_derivation)
    assert any("analyzer plans no cache on 2 block(s) where transformers' block holds NemotronHMamba2Mixer, first block 0" in e
               for e in result.errors), result.errors


def test_an_mlp_block_given_a_kv_cache_fails_the_cross_check_by_name(monkeypatch):
    """Nemotron-H's MLP block read as attention: transformers' block there has no attention module."""
    monkeypatch.setitem(config_loader._LAYER_TYPE_KIND, "mlp", "full")
    data = _data("nemotron_h")
    facts = normalize_config(data)
    from model_infer_kvcache.analyzer.build import _layers
    from model_infer_kvcache.analyzer.rules import decide_parallel

    layers = _layers(facts, decide_parallel(facts, 1, "test"), "paged", "exclusive")
    result = cross_check(data, facts, layers, 128 ** -0.5, "head_dim^-0.5 = 128^-0.5")
    assert any("where transformers' decoder block has no attention module" in e for e in result.errors), result.errors


def test_a_hand_edit_giving_a_block_without_a_cache_a_layer_is_refused(tmp_path):
    m = _plan(tmp_path, "nemotron_h")
    data = json.loads(m.to_json())
    data["no_cache_layers"] = data["no_cache_layers"][:1]  # the MLP block dropped from the list
    with pytest.raises(ValueError, match="layers: 2 entries for 4 decoder layers"):
        SelectionManifest.model_validate(data)
    data = json.loads(m.to_json())
    data["no_cache_layers"][0]["decoder_layer"] = 2  # the attention block listed as cacheless too
    with pytest.raises(ValueError, match=r"no_cache_layers\[0\]\.decoder_layer"):
        SelectionManifest.model_validate(data)


def test_dory_reads_its_saved_layers_and_plans_a_cache_layer_per_loop(tmp_path):
    """DoryConfig.to_dict writes an "mlp" entry after every attention block and doubles the layer counts (they are
    not layers: __post_init__ halves them); its recurrent section runs n_recurrent_loops times, each loop with its own
    cache (per_loop): loop 1's layers are read as extra cache layers after the model's; last_loop is refused by name.
    One loop is a plain sliding / full stack."""
    from transformers import DoryConfig

    data = DoryConfig().to_dict()
    facts = normalize_config(data)
    loops = facts.loops.value
    assert loops.calls == tuple(range(36)) + tuple(range(8, 28)) and loops.offset_kwarg == "cache_offset"
    assert loops.extra_layers() == tuple(range(8, 28))
    with pytest.raises(InputError, match=r"recurrent_kv_cache_mode: 'last_loop': Dory's loops before the last read"):
        normalize_config({**data, "recurrent_kv_cache_mode": "last_loop"})
    with pytest.raises(InputError, match=r"recurrent_kv_cache_mode: 'every_loop' is not one of"):
        normalize_config({**data, "recurrent_kv_cache_mode": "every_loop"})
    with pytest.raises(InputError, match=r"n_recurrent_loops: must be at least 1, got 0"):
        normalize_config({**data, "n_recurrent_loops": 0})
    facts = normalize_config({**data, "n_recurrent_loops": 1})
    assert facts.loops.value is None
    assert facts.num_layers.value == 36 and NO_CACHE not in facts.layer_kinds.value
    assert facts.layer_kinds.value[:4] == ("sliding", "sliding", "sliding", "full")


# Reduced sizes (the analyzer tests above keep the published ones): the float64 reference's chunk scan over a
# [128, 64, 128] state takes minutes per stream on two cores, and no check below depends on the width.
SMALL = {
    "mamba": {"hidden_size": 64, "intermediate_size": 128},  # 128 inner channels (the saved width the mixer takes)
    "mamba2": {"hidden_size": 128, "num_heads": 16, "head_dim": 16, "state_size": 32, "n_groups": 2},
    # blocks Mamba, MLP, Mamba, attention, MoE: cache layers 0, 1, 2 sit on blocks 0, 2, 3
    "nemotron_h": {"hidden_size": 128, "mamba_num_heads": 16, "mamba_head_dim": 16, "ssm_state_size": 32,
                   "n_groups": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
                   "moe_shared_expert_intermediate_size": 64,
                   "layers_block_type": ["linear_attention", "mlp", "linear_attention", "full_attention", "moe"]},
}


@pytest.mark.slow
@pytest.mark.parametrize("config, mode", [("mamba", "framework"), ("mamba2", "standalone"),
                                          ("nemotron_h", "framework"), ("nemotron_h", "standalone")])
def test_state_stacks_render_and_validate(tmp_path, config, mode):
    manifest, rendered, cfg = render_case(tmp_path, config, SMALL[config], deploy_mode=mode)
    text = (rendered / ATTN).read_text(encoding="utf-8")
    assert ("def init_kv_cache" in text) == (config == "nemotron_h")
    if config == "nemotron_h" and mode == "framework":
        assert 'return [mixer] if hasattr(mixer, "cache_entries") else []' in text
    report = run_validate(manifest, rendered, cfg, scenario=SHORT)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert check(report, NUMERIC).measured["max_abs_diff"] <= 1e-9


STACK_MISTAKES = [
    # a pure Mamba-2 stack whose state is not reset on slot reuse: prefill continues from the reused block
    ("prefill-reads-the-ssm-state", "mamba2", "framework",
     r"if forward_metadata\.is_prefill \\\n\s+else self\.recurrent_state\[slots\[row\]\]\.to\(dtype\)",
     "if False else self.recurrent_state[slots[row]].to(dtype)", NUMERIC),
    ("prefill-reads-the-ssm-state", "mamba", "standalone",
     r"if forward_metadata\.is_prefill \\\n\s+else self\.recurrent_state\[slots\[row\]\]\.to\(dtype\)",
     "if False else self.recurrent_state[slots[row]].to(dtype)", NUMERIC),
    # Nemotron-H's blocks without a cache registered with the framework (layer indices by block): it refuses them
    ("cacheless-blocks-registered", "nemotron_h", "framework",
     r'return \[mixer\] if hasattr\(mixer, "cache_entries"\) else \[\]',
     'return [mixer] if hasattr(mixer, "cache_entries") else [type("Block", (), {"cache_entries": []})()]',
     "get_cache_info layer count"),
]


@pytest.mark.slow
@pytest.mark.parametrize("case, config, mode, pattern, replacement, failing", STACK_MISTAKES,
                         ids=[f"{m[0]}-{m[1]}" for m in STACK_MISTAKES])
def test_a_state_stack_mistake_fails_by_name(tmp_path, case, config, mode, pattern, replacement, failing):
    mistake_fails_by_name(render_case(tmp_path, config, SMALL[config], deploy_mode=mode), pattern, replacement,
                          failing)


# RWKV-4 (RwkvForCausalLM): every block a time-mix and a channel-mix, planned as a state family on the recurrent kind:
# the token shift of both mixes (conv_state [2 x hidden, 1]) and the wkv's num / den / max (recurrent_state [A, 3]).
RWKV_SMALL = {"hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 512}


def _rwkv_config(tmp_path, **over):
    from transformers import RwkvConfig

    path = tmp_path / "rwkv.json"
    path.write_text(json.dumps(RwkvConfig().to_dict() | over), encoding="utf-8")
    return path


def test_rwkv_is_planned_as_a_state_stack_with_its_token_shift_and_wkv_states(tmp_path):
    """RwkvConfig() (hidden 4096, 32 blocks, attention_hidden_size = hidden): every layer a state layer, no attention
    field read, per layer and request a token-shift state of 2 x 4096 inputs in the model dtype and a float32 wkv
    state [4096, 3] (num, den, max): 2 x 8192 + 4 x 12288 = 65536 bytes. A config with its own
    attention_hidden_size sizes the wkv state by it, the token shift still by hidden_size."""
    from model_infer_kvcache.analyzer.linear_config import RWKV

    m = analyze(AnalyzeRequest(config=str(_rwkv_config(tmp_path))))
    assert not m.blockers and all(layer.is_state for layer in m.layers) and not m.attention_layers
    lin = m.linear_attention
    assert lin.family == RWKV and lin.layers == list(range(32))
    assert {s.name: (s.shape, s.dtype) for s in lin.states} == {"conv_state": ([8192, 1], "bfloat16"),
                                                                "recurrent_state": ([4096, 3], "float32")}
    assert lin.state_bytes_per_layer == 65536
    assert "no torch_npu 2.14.0 / 2.9.0 operator computes RWKV's wkv" in lin.operators["prefill"]
    m = analyze(AnalyzeRequest(config=str(_rwkv_config(tmp_path, attention_hidden_size=2048))))
    assert {s.name: s.shape for s in m.linear_attention.states} == {"conv_state": [8192, 1],
                                                                    "recurrent_state": [2048, 3]}


def test_rwkv_plan_off_transformers_time_mix_fails_the_cross_check_by_name(monkeypatch):
    """Negative control: a reader taking hidden_size for the wkv width where the config names attention_hidden_size
    plans a state transformers' RwkvSelfAttention (time_decay per attention channel) does not keep."""
    from model_infer_kvcache.analyzer import linear_config
    from model_infer_kvcache.analyzer.build import _layers
    from model_infer_kvcache.analyzer.linear_config import RWKV, LinearFacts
    from model_infer_kvcache.analyzer.rules import decide_parallel
    from transformers import RwkvConfig

    data = RwkvConfig(attention_hidden_size=2048).to_dict()
    monkeypatch.setattr(linear_config, "_read_rwkv", lambda r, why, hidden: LinearFacts(
        RWKV, 1, hidden, 3, 1, 2, 2 * hidden, why, None))
    facts = normalize_config(data)
    layers = _layers(facts, decide_parallel(facts, 1, "test"), "paged", "exclusive")
    result = cross_check(data, facts, layers, 1.0, "1")
    assert any("wkv_channels 4096 vs 2048" in e for e in result.errors), result.errors


@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_rwkv_runs_on_cpu_at_the_analyzers_plan_of_a_narrower_hidden_size(tmp_path, mode):
    """RwkvConfig()'s hidden 4096: validation runs the implementer's render of a CPU-sized manifest (tiny_model.cpu_sized,
    recurrent.cpu_widths) that is exactly what the analyzer plans for the same config at hidden_size 128 (the wkv's
    attention_hidden_size cut by the same factor): its linear section, every layer's states, the state bytes. A
    shrink that cut hidden_size alone (the wkv left 4096 wide), or kept the real state shapes, fails the equality by
    field. A config already CPU-sized is not cut."""
    from model_infer_kvcache.validators.pipeline.tiny_model import cpu_sized, cpu_sizes_note

    for real_attn, cut_attn in ((None, 128), (2048, 64)):  # attention_hidden_size absent (= hidden), or its own
        own = {} if real_attn is None else {"attention_hidden_size": real_attn}
        real = json.loads(_rwkv_config(tmp_path, **own).read_text(encoding="utf-8"))
        manifest = analyze(AnalyzeRequest(config=str(tmp_path / "rwkv.json"), deploy_mode=mode))
        small = cpu_sized(manifest, real)
        planned = analyze(AnalyzeRequest(config=str(_rwkv_config(tmp_path, hidden_size=128,
                                                                  attention_hidden_size=cut_attn)), deploy_mode=mode))
        assert small.linear_attention == planned.linear_attention
        assert small.layers == planned.layers and small.model.hidden_size == 128
        assert {s.name: s.shape for s in small.linear_attention.states} == {"conv_state": [256, 1],
                                                                            "recurrent_state": [cut_attn, 3]}
        assert cpu_sizes_note(manifest, small).startswith(
            f"RWKV hidden_size 4096 -> 128 and attention_hidden_size {real_attn or 4096} -> {cut_attn}")
    real = json.loads(_rwkv_config(tmp_path, **RWKV_SMALL).read_text(encoding="utf-8"))
    assert cpu_sized(analyze(AnalyzeRequest(config=str(tmp_path / "rwkv.json"), deploy_mode=mode)), real) is None


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_rwkv_renders_and_validates_against_transformers(tmp_path, mode):
    """Both modes match transformers' RwkvForCausalLM (float64, its rwkv_linear_attention_cpu over the whole prefix)
    on a stream with early finishes and late admits (state slots reused), rescaling every block."""
    from model_infer_kvcache.implementer.render import render_manifest, write_rendered

    manifest = analyze(AnalyzeRequest(config=str(_rwkv_config(tmp_path, **RWKV_SMALL)), deploy_mode=mode))
    (tmp_path / "m.json").write_text(manifest.to_json(), encoding="utf-8")
    write_rendered(render_manifest(manifest), tmp_path / "r")
    text = (tmp_path / "r" / ATTN).read_text(encoding="utf-8")
    assert "def wkv(" in text and "def token_shift(" in text and "def conv_step" not in text
    report = run_validate(tmp_path / "m.json", tmp_path / "r", tmp_path / "rwkv.json", scenario=SHORT)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert check(report, NUMERIC).measured["max_abs_diff"] <= 1e-9
    assert any("rescale_every 6 -> 1" in note for note in report.notes)


@pytest.mark.slow
def test_rwkv_class_defaults_validate_at_hidden_128_with_every_real_layer_checked(tmp_path):
    """RwkvConfig() (hidden 4096) through validate: the stream runs the implementer's render of the CPU-sized manifest
    (hidden 128: ~100 s a mode at 4096 before), the given render's constants and all 32 layers are still checked
    against the real manifest, and the logits match transformers' RwkvForCausalLM at 128."""
    from model_infer_kvcache.implementer.render import render_manifest, write_rendered

    manifest = analyze(AnalyzeRequest(config=str(_rwkv_config(tmp_path)), deploy_mode="standalone"))
    (tmp_path / "m.json").write_text(manifest.to_json(), encoding="utf-8")
    write_rendered(render_manifest(manifest), tmp_path / "r")
    report = run_validate(tmp_path / "m.json", tmp_path / "r", tmp_path / "rwkv.json", scenario=SHORT)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert check(report, NUMERIC).measured["max_abs_diff"] <= 1e-9
    assert any(c.name.startswith("every layer's") and "(32 layers)" in c.name for c in report.checks)
    assert any("RWKV hidden_size 4096 -> 128" in note and "byte for byte" in note for note in report.notes)


RWKV_MISTAKES = [
    # the wkv state not reset on slot reuse: a prefill continues from the finished request's num / den / max
    ("wkv-prefill-reads-the-state", "framework", r"if forward_metadata\.is_prefill:\n(\s+)state = key\.new_zeros",
     r"if False:\n\1state = key.new_zeros"),
    # the token shift not reset on slot reuse: a prompt's first token mixes the finished request's last input
    ("shift-prefill-reads-the-state", "standalone", r"if forward_metadata\.is_prefill:\n(\s+)previous = ",
     r"if False:\n\1previous = "),
    # the channel-mix's shift state not updated at decode: every decode token mixes the prompt's last input
    ("channel-mix-shift-not-updated-at-decode", "framework",
     r"\n(\s+)self\.conv_state\[slots\[row\], channels, 0\] = ",
     r"\n\1if mix == 0 or forward_metadata.is_prefill:\n\1    self.conv_state[slots[row], channels, 0] = "),
    # the shift state taken from the step's first token instead of its last (a prefill's next token mixes it)
    ("shift-state-from-the-first-token", "standalone", r"= tokens\[-1\]\.to\(", "= tokens[0].to("),
]


@pytest.mark.slow
@pytest.mark.parametrize("case, mode, pattern, replacement", RWKV_MISTAKES, ids=[m[0] for m in RWKV_MISTAKES])
def test_an_rwkv_state_mistake_fails_by_name(tmp_path, case, mode, pattern, replacement):
    from model_infer_kvcache.implementer.render import render_manifest, write_rendered

    manifest = analyze(AnalyzeRequest(config=str(_rwkv_config(tmp_path, **RWKV_SMALL)), deploy_mode=mode))
    (tmp_path / "m.json").write_text(manifest.to_json(), encoding="utf-8")
    write_rendered(render_manifest(manifest), tmp_path / "r")
    mistake_fails_by_name((tmp_path / "m.json", tmp_path / "r", tmp_path / "rwkv.json"), pattern, replacement, NUMERIC)


# xLSTM (xLSTMForCausalLM): every block an mLSTM layer, planned as a state family on the recurrent kind: per head the
# matrix memory C, the normalizer n and the max-state m, packed as one recurrent_state [H, Dqk + 1, Dv + 1].
XLSTM_SMALL = {"hidden_size": 128, "num_heads": 4, "num_hidden_layers": 4, "num_blocks": 4, "vocab_size": 512}


def _xlstm_config(tmp_path, **over):
    from transformers import xLSTMConfig

    path = tmp_path / "xlstm.json"
    path.write_text(json.dumps(xLSTMConfig().to_dict() | over), encoding="utf-8")
    return path


def test_xlstm_is_planned_as_a_state_stack_with_its_packed_mlstm_state(tmp_path):
    """xLSTMConfig() (hidden 4096, 8 heads, qk_dim_factor 0.5, v_dim_factor 1): Dqk 256, Dv 512; per layer and
    request one float32 [8, 257, 513] state (C | n, m): 4218912 bytes. A hidden size whose factor width is not a
    multiple of 64 plans int(hidden x factor) / heads, as xLSTMLayer builds it (not the config's rounded qk_dim)."""
    from model_infer_kvcache.analyzer.linear_config import MLSTM

    m = analyze(AnalyzeRequest(config=str(_xlstm_config(tmp_path))))
    assert not m.blockers and all(layer.is_state for layer in m.layers) and not m.attention_layers
    lin = m.linear_attention
    assert lin.family == MLSTM and lin.layers == list(range(32)) and lin.conv_kernel is None
    assert [(s.name, s.shape, s.dtype) for s in lin.states] == [("recurrent_state", [8, 257, 513], "float32")]
    assert lin.state_bytes_per_layer == 4218912
    m = analyze(AnalyzeRequest(config=str(_xlstm_config(tmp_path, hidden_size=4000, embedding_dim=4000))))
    assert m.linear_attention.states[0].shape == [8, 251, 501]  # 2000 / 8 = 250, 4000 / 8 = 500


def test_xlstm_plan_off_transformers_mlstm_layer_fails_the_cross_check_by_name(monkeypatch):
    """Negative control: a reader sizing the heads by the config's rounded qk_dim (round_up(2000, 64) = 2048) where
    xLSTMLayer projects to int(hidden x qk_dim_factor) = 2000 plans a state transformers does not keep."""
    from model_infer_kvcache.analyzer import linear_config
    from model_infer_kvcache.analyzer.build import _layers
    from model_infer_kvcache.analyzer.linear_config import MLSTM, LinearFacts
    from model_infer_kvcache.analyzer.rules import decide_parallel
    from transformers import xLSTMConfig

    data = xLSTMConfig(hidden_size=4000, embedding_dim=4000).to_dict()
    monkeypatch.setattr(linear_config, "_read_mlstm", lambda r, why, hidden, limits: LinearFacts(
        MLSTM, 8, 8, 2048 // 8, 4032 // 8, None, 0, why, None))
    facts = normalize_config(data)
    layers = _layers(facts, decide_parallel(facts, 1, "test"), "paged", "exclusive")
    result = cross_check(data, facts, layers, 1.0, "1")
    assert any("qk_head_dim 256 vs 250" in e and "v_head_dim 504 vs 500" in e for e in result.errors), result.errors


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_xlstm_renders_and_validates_against_transformers(tmp_path, mode):
    """Both modes match transformers' xLSTMForCausalLM (float64; its chunkwise kernel over 64-token chunks of the
    prefix, the recurrent step for the rest) on a stream with early finishes and late admits."""
    from model_infer_kvcache.implementer.render import render_manifest, write_rendered

    manifest = analyze(AnalyzeRequest(config=str(_xlstm_config(tmp_path, **XLSTM_SMALL)), deploy_mode=mode))
    (tmp_path / "m.json").write_text(manifest.to_json(), encoding="utf-8")
    write_rendered(render_manifest(manifest), tmp_path / "r")
    assert "def mlstm(" in (tmp_path / "r" / ATTN).read_text(encoding="utf-8")
    report = run_validate(tmp_path / "m.json", tmp_path / "r", tmp_path / "xlstm.json", scenario=SHORT)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert check(report, NUMERIC).measured["max_abs_diff"] <= 1e-9


XLSTM_MISTAKES = [
    # the mLSTM state not reset on slot reuse: a prefill continues from the finished request's C / n / m
    ("prefill-reads-the-state", "framework", r"if forward_metadata\.is_prefill \\\n(\s+)else self\.recurrent_state",
     r"if False \\\n\1else self.recurrent_state"),
    # the max-state not kept: the next step reads m = 0 while C and n stay scaled by exp(-m)
    ("max-state-dropped", "standalone", r"state\[:, :-1, :-1\], state\[:, :-1, -1\], state\[:, -1, 0\] = c, n, m",
     "state[:, :-1, :-1], state[:, :-1, -1] = c, n"),
]


@pytest.mark.slow
@pytest.mark.parametrize("case, mode, pattern, replacement", XLSTM_MISTAKES, ids=[m[0] for m in XLSTM_MISTAKES])
def test_an_xlstm_state_mistake_fails_by_name(tmp_path, case, mode, pattern, replacement):
    from model_infer_kvcache.implementer.render import render_manifest, write_rendered

    manifest = analyze(AnalyzeRequest(config=str(_xlstm_config(tmp_path, **XLSTM_SMALL)), deploy_mode=mode))
    (tmp_path / "m.json").write_text(manifest.to_json(), encoding="utf-8")
    write_rendered(render_manifest(manifest), tmp_path / "r")
    mistake_fails_by_name((tmp_path / "m.json", tmp_path / "r", tmp_path / "xlstm.json"), pattern, replacement,
                          NUMERIC)


def test_a_state_mixer_routed_to_a_render_of_another_family_is_refused_naming_the_method():
    """The host routes an RWKV block only through a render holding its wkv (and token shift); a render of another
    family (a Mamba state mixin: no wkv) is refused by name, its modules left as they were."""
    import types as _types

    from model_infer_kvcache.analyzer.errors import InputError
    from model_infer_kvcache.validators.pipeline import host_model
    from transformers import RwkvConfig, RwkvModel

    block = RwkvModel(RwkvConfig(hidden_size=32, attention_hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 vocab_size=64)).blocks[0]
    with pytest.raises(InputError) as err:
        host_model.bind_rwkv(block, block.attention, _types.SimpleNamespace(mamba_scan=None))
    assert "RwkvSelfAttention is an RWKV time-mix" in err.value.message and "no wkv" in err.value.message
    assert not hasattr(block.attention, "_kvcache_host")
    host = _types.SimpleNamespace(wkv=None, token_shift=None)
    host_model.bind_rwkv(block, block.attention, host)
    assert block.attention._kvcache_host is host and block.feed_forward._kvcache_host is host
