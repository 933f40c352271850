"""RecurrentGemma (issue 40): its 'recurrent' blocks planned as a state family on the recurrent kind (rg_lru: the
depthwise conv's state and the RG-LRU's per-channel float32 h), its 'attention' blocks as sliding-window KV-cache
layers. Plan at the class defaults, the cross-check naming a plan off transformers' block, both modes validated
against transformers' RecurrentGemmaForCausalLM, and the state mistakes failing by name."""

from __future__ import annotations

import json

import pytest
from model_infer_kvcache.analyzer.arch_check import cross_check
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.config_loader import normalize_config
from test_hybrid_render import NUMERIC, SHORT, mistake_fails_by_name
from validators_support import check, run_validate

ATTN = "kvcache_attention.py"
# 3 layers: recurrent, recurrent, attention (the class's block_types); a window the short stream's prompts cross;
# 2 query heads of 64 sharing one KV head (MQA, as the 2b checkpoint), 2 RG-LRU blocks of 128 channels: lru_width
# 256 apart from hidden_size 128, so a state sized by the hidden size fails (to_dict saved the class default's head_dim
# and lru_width: the small ones replace them)
SMALL = {"hidden_size": 128, "intermediate_size": 384, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 64, "lru_width": 256, "num_hidden_layers": 3,
         "vocab_size": 512, "attention_window_size": 64}


def _config(tmp_path, **over):
    from transformers import RecurrentGemmaConfig

    path = tmp_path / "recurrent_gemma.json"
    path.write_text(json.dumps(RecurrentGemmaConfig().to_dict() | over, default=str), encoding="utf-8")
    return path


def test_recurrent_gemma_is_planned_as_an_rg_lru_hybrid_with_sliding_attention(tmp_path):
    """RecurrentGemmaConfig() (hidden 2560, 26 layers, block_types recurrent, recurrent, attention): 18 recurrent
    blocks, each a conv state [lru_width, conv1d_width - 1] in the model dtype and a float32 RG-LRU state
    [lru_width] (transformers' conv1d_state / rg_lru.recurrent_states), 8 attention blocks with the 2048-token
    window; no torch_npu operator named for the recurrence. A config with its own lru_width sizes both states by it."""
    from model_infer_kvcache.analyzer.linear_config import RG_LRU

    m = analyze(AnalyzeRequest(config=str(_config(tmp_path))))
    assert not m.blockers
    lin = m.linear_attention
    recurrent = [i for i in range(26) if i % 3 != 2]
    assert lin.family == RG_LRU and lin.layers == recurrent
    assert {s.name: (s.shape, s.dtype) for s in lin.states} == {"conv_state": ([2560, 3], "bfloat16"),
                                                                "recurrent_state": ([2560], "float32")}
    assert lin.state_bytes_per_layer == 2560 * 3 * 2 + 2560 * 4  # 25600
    assert [layer.index for layer in m.attention_layers] == [i for i in range(26) if i % 3 == 2]
    assert {layer.sliding_window for layer in m.attention_layers} == {2048}
    assert "no torch_npu 2.14.0 / 2.9.0 operator computes it" in lin.operators["prefill"]
    # the attention blocks' rule read from RecurrentGemmaAttention (scaling = head_dim**-0.5): a known family
    assert m.fa.softmax_scale == 256 ** -0.5 and not any("unknown model family" in w.message for w in m.warnings)
    m = analyze(AnalyzeRequest(config=str(_config(tmp_path, lru_width=1280))))
    assert {s.name: s.shape for s in m.linear_attention.states} == {"conv_state": [1280, 3],
                                                                    "recurrent_state": [1280]}


@pytest.mark.parametrize("over, field, words", [
    ({"lru_width": 2565}, "lru_width", "10 heads do not divide lru_width 2565"),
    ({"conv1d_width": 1}, "conv1d_width", "must be at least 2"),
])
def test_rg_lru_sizes_transformers_cannot_build_are_refused_naming_the_field(tmp_path, over, field, words):
    """Bad input: an lru_width the RG-LRU's head blocks do not divide (RecurrentGemmaRglru reshapes it to [heads,
    lru_width / heads]), a conv that keeps no previous input."""
    from model_infer_kvcache.analyzer.errors import InputError

    with pytest.raises(InputError) as err:
        analyze(AnalyzeRequest(config=str(_config(tmp_path, **over))))
    assert err.value.field == field and words in err.value.message, err.value.render()


def test_rg_lru_plan_off_transformers_block_fails_the_cross_check_by_name(monkeypatch):
    """Negative control: a reader taking hidden_size for the RG-LRU width where the config names lru_width plans
    states transformers' RecurrentGemmaRecurrentBlock (conv_1d and recurrent_param over lru_width) does not keep."""
    from model_infer_kvcache.analyzer import linear_config
    from model_infer_kvcache.analyzer.build import _layers
    from model_infer_kvcache.analyzer.linear_config import RG_LRU, LinearFacts
    from model_infer_kvcache.analyzer.rules import decide_parallel
    from transformers import RecurrentGemmaConfig

    data = RecurrentGemmaConfig(lru_width=1280).to_dict()
    monkeypatch.setattr(linear_config, "_read_rg_lru", lambda r, why, hidden, limits: LinearFacts(
        RG_LRU, 1, hidden, 1, 1, 4, hidden, why, None))
    facts = normalize_config(data)
    layers = _layers(facts, decide_parallel(facts, 1, "test"), "paged", "exclusive")
    result = cross_check(data, facts, layers, 256 ** -0.5, "head_dim^-0.5")
    assert any("lru_width 2560 vs 1280" in e for e in result.errors), result.errors


def _rendered(tmp_path, mode):
    from model_infer_kvcache.implementer.render import render_manifest, write_rendered

    manifest = analyze(AnalyzeRequest(config=str(_config(tmp_path, **SMALL)), deploy_mode=mode))
    (tmp_path / "m.json").write_text(manifest.to_json(), encoding="utf-8")
    write_rendered(render_manifest(manifest), tmp_path / "r")
    return tmp_path / "m.json", tmp_path / "r", tmp_path / "recurrent_gemma.json"


@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_the_render_reads_both_kinds_of_block_as_temporal_block(tmp_path, mode):
    """RecurrentGemmaDecoderLayer keeps its attention block as temporal_block too (no self_attn): the framework's
    get_cache_info and the runner's module list read that attribute, not the default self_attn a port would fail on
    (AttributeError in get_cache_info); a user's own --attn-attr is kept."""
    from model_infer_kvcache.implementer.names import Names
    from model_infer_kvcache.implementer.render import render_manifest

    manifest = analyze(AnalyzeRequest(config=str(_config(tmp_path, **SMALL)), deploy_mode=mode))
    files = render_manifest(manifest).files
    code = files["kvcache_attention.py" if mode == "framework" else "kvcache_runner.py"]
    assert "self_attn" not in code and "self_attn" not in files["INTEGRATION.md"]
    if mode == "framework":
        assert "attn = decoder_layer.temporal_block" in code
    else:
        assert "_init_kvcache([layer.temporal_block for layer in model.model.layers]" in files["INTEGRATION.md"]
    own = render_manifest(manifest, names=Names(attn_attr="mixer_block")).files
    assert "mixer_block" in own["INTEGRATION.md"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_recurrent_gemma_renders_and_validates_against_transformers(tmp_path, mode):
    """Both modes match transformers' RecurrentGemmaForCausalLM (float64: its conv over the prefix and its
    RG-LRU scan) on a stream with early finishes and late admits (state slots reused) crossing the window."""
    case = _rendered(tmp_path, mode)
    text = (case[1] / ATTN).read_text(encoding="utf-8")
    assert "def rg_lru(" in text and "def conv_step(" in text and "self.conv_1d.weight" in text
    report = run_validate(*case, scenario=SHORT)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert check(report, NUMERIC).measured["max_abs_diff"] <= 1e-9


RG_LRU_MISTAKES = [
    # the conv state not reset on slot reuse: a prefill convolves the finished request's last inputs
    ("conv-prefill-reads-the-state", "framework", r"if is_prefill:\n(\s+)history = x\.new_zeros",
     r"if False:\n\1history = x.new_zeros"),
    # the RG-LRU state read at prefill: a finite stale h is multiplied away by position 0's a = 0, but a block handed
    # over uncleared may hold NaN / Inf (0 x NaN = NaN): the poisoned slot shows it
    ("lru-prefill-reads-the-state", "standalone", r"state = x\.new_zeros\(RECURRENT_STATE_SHAPE, dtype=torch\.float32\)",
     "state = self.recurrent_state[slots[row]].float()"),
    # the conv state shifted by one: it keeps the inputs before the newest instead of the newest K - 1
    ("conv-state-shifted-by-one", "standalone", r"window\[-\(CONV_KERNEL - 1\):\]", "window[-CONV_KERNEL:-1]"),
    # the sqrt(1 - a^2) input normalisation dropped
    ("normalisation-dropped", "framework", r"scale = torch\.sqrt\(1 - torch\.exp\(2 \* log_a\)\)",
     "scale = torch.ones_like(log_a)"),
    # the reset at a prompt's first token dropped: position 0 scaled by sqrt(1 - a^2) as every other token
    ("position-0-reset-dropped", "standalone", r"a\[0\], norm\[0\] = 0, 1", "pass"),
]


@pytest.mark.slow
@pytest.mark.parametrize("case, mode, pattern, replacement", RG_LRU_MISTAKES, ids=[m[0] for m in RG_LRU_MISTAKES])
def test_an_rg_lru_state_mistake_fails_by_name(tmp_path, case, mode, pattern, replacement):
    mistake_fails_by_name(_rendered(tmp_path, mode), pattern, replacement, NUMERIC)
