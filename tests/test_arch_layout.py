"""Decoder layers and attention modules found by structure, and config ids inside the tiny vocabulary."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.hf_layout import LayoutError, attention_modules, find_decoder_stack
from model_infer_kvcache.validators.pipeline.host_model import attention_route, decoder_layers
from model_infer_kvcache.validators.pipeline.tiny_model import TINY_VOCAB, build_tiny_model, fit_token_ids
from transformers import AutoConfig, AutoModelForCausalLM

CONFIGS = Path(__file__).resolve().parent / "fixtures" / "configs"
SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3, "vocab_size": 128,
         "intermediate_size": 128}


def _meta(model_type: str, **kw):
    config = AutoConfig.for_model(model_type, **kw)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("model_type, extra, path, attention", [
    ("qwen3", {"num_key_value_heads": 2, "head_dim": 16}, "model.layers", "self_attn"),
    ("falcon", {"multi_query": True, "new_decoder_architecture": False}, "transformer.h", "self_attention"),
    ("gpt_neox", {}, "gpt_neox.layers", "attention"),
    ("opt", {"ffn_dim": 128, "word_embed_proj_dim": 64}, "model.decoder.layers", "self_attn"),
    ("gpt2", {"n_embd": 64, "n_head": 4, "n_layer": 3}, "transformer.h", "attn"),
])
def test_decoder_stack_is_found_in_every_layout(model_type, extra, path, attention):
    model = _meta(model_type, **{**SMALL, **extra})
    stack = find_decoder_stack(model)
    assert stack.path == path and len(stack.layers) == 3
    mods = attention_modules(model)
    assert [p for p, _ in mods] == [f"{path}.{i}.{attention}" for i in range(3)]


def test_multimodal_model_finds_the_text_decoder_not_the_vision_tower():
    config = json.loads((CONFIGS / "gemma3_4b.json").read_text(encoding="utf-8"))
    cfg = AutoConfig.for_model("gemma3", **{k: v for k, v in config.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    stack = find_decoder_stack(model)
    assert stack.path == "model.language_model.layers" and len(stack.layers) == 34


def test_two_attention_blocks_per_layer_are_both_listed():
    config = json.loads((CONFIGS / "longcat_flash.json").read_text(encoding="utf-8"))
    cfg = AutoConfig.for_model("longcat_flash", **{k: v for k, v in config.items() if k not in ("model_type", "auto_map")})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    paths = [p for p, _ in attention_modules(model)]
    assert len(paths) == 56 and paths[:2] == ["model.layers.0.self_attn.0", "model.layers.0.self_attn.1"]


def test_a_model_without_attention_is_a_layout_error():
    with pytest.raises(LayoutError, match="no nn.ModuleList of decoder blocks"):
        find_decoder_stack(torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2)] * 3)))
    with pytest.raises(InputError) as err:
        decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert "\n" not in err.value.render() and "found no decoder layers" in err.value.render()


def test_attention_routes():
    qwen = _meta("qwen3", **SMALL, num_key_value_heads=2, head_dim=16)
    falcon = _meta("falcon", **SMALL, multi_query=True)
    mpt = _meta("mpt", d_model=64, n_heads=4, n_layers=2, vocab_size=128)
    bloom = _meta("bloom", hidden_size=64, n_head=4, n_layer=2, vocab_size=128)
    assert attention_route(attention_modules(qwen)[0][1], is_mla=False) == "interface"
    # transformers 5.25's Falcon calls the attention interface; earlier 5.x split its fused query_key_value itself
    falcon_attn = attention_modules(falcon)[0][1]
    interface = "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(type(falcon_attn).forward)
    assert attention_route(falcon_attn, is_mla=False) == ("interface" if interface else "fused_qkv")
    assert attention_route(attention_modules(mpt)[0][1], is_mla=False) is None  # own forward, no interface
    assert attention_route(attention_modules(bloom)[0][1], is_mla=False) is None  # ALiBi-only fused attention
    assert attention_route(attention_modules(qwen)[0][1], is_mla=True) is None


def test_a_fused_qkv_rotary_attention_takes_the_fused_route():
    """The fused route whatever Falcon does in the installed transformers: a module that splits its own
    query_key_value and takes position embeddings (Falcon before 5.25), not through the interface."""

    class FusedRotary(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.query_key_value, self.dense = torch.nn.Linear(8, 24), torch.nn.Linear(8, 8)

        def _split_heads(self, fused):
            return fused.chunk(3, dim=-1)

        def forward(self, hidden_states, position_embeddings, attention_mask=None):
            q, k, v = self._split_heads(self.query_key_value(hidden_states))
            return self.dense(torch.softmax(q @ k.transpose(-1, -2), -1) @ v)

    class Alibi(FusedRotary):  # Bloom's shape: no position embeddings, so not routed
        def forward(self, hidden_states, alibi, attention_mask=None):
            return hidden_states

    assert attention_route(FusedRotary(), is_mla=False) == "fused_qkv"
    assert attention_route(Alibi(), is_mla=False) is None


# ---------------------------------------------------------------- token ids in the tiny vocabulary


def test_fit_token_ids_keeps_equal_ids_equal_and_distinct_ids_distinct():
    d = {"pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "bos_token_id": 7}
    moved = fit_token_ids(d, {"pad_token_id": 0, "sep_token_id": 200000}, 512)
    ids = [d["pad_token_id"], *d["eos_token_id"], d["bos_token_id"], d["sep_token_id"]]
    assert all(0 <= i < 512 for i in ids)
    assert d["pad_token_id"] == d["eos_token_id"][0] and len(set(d["eos_token_id"])) == 3
    assert d["bos_token_id"] == 7  # already inside: untouched
    assert d["sep_token_id"] not in (*d["eos_token_id"], 7)  # a class default outside the vocabulary, moved
    assert set(moved) == {151329, 151336, 151338, 200000}


@pytest.mark.parametrize("name", ["glm4_9b_0414", "phi3_mini"])
def test_tiny_model_builds_with_every_id_inside_the_vocabulary(name):
    """GLM-4 and Phi-3 once failed here: 'Padding_idx must be within num_embeddings'."""
    config = json.loads((CONFIGS / f"{name}.json").read_text(encoding="utf-8"))
    manifest = analyze(AnalyzeRequest(config=str(CONFIGS / f"{name}.json")))
    model, plan = build_tiny_model(config, manifest)
    ids = {k: v for k, v in model.config.to_dict().items() if k.endswith("token_id") and v is not None}
    flat = [i for v in ids.values() for i in (v if isinstance(v, list) else [v])]
    assert flat and all(0 <= i < TINY_VOCAB for i in flat), ids
    assert model.get_input_embeddings().num_embeddings == TINY_VOCAB
    assert any(n.startswith("token ids moved") for n in plan.notes)


@pytest.mark.parametrize("cls_name, hidden", [
    ("HeliumConfig", 20 * 128),  # o_proj: hidden_size -> hidden_size
    ("OlmoeConfig", 16 * 128),  # q_norm / k_norm over the whole hidden_size-wide projection
    ("GPT2Config", 12 * 64),  # refuses to build a hidden size its 12 heads do not divide
    ("StableLmConfig", 32 * 80),  # runs at 128, but with head_dim 128 / 32 = 4 instead of the config's 80
    ("Qwen3Config", 128),
])
def test_tiny_model_keeps_hidden_equal_to_heads_x_head_dim_only_where_the_attention_needs_it(tmp_path, cls_name,
                                                                                            hidden):
    """Helium's o_proj maps hidden_size -> hidden_size and OLMoE norms q / k over hidden_size: with hidden shrunk to 128
    beside heads x head_dim attention widths the tiny model could not run, and the failure was reported against the
    render. Qwen3 projects from heads x head_dim and keeps the cheap 128."""
    import transformers

    path = tmp_path / "config.json"
    config = {**getattr(transformers, cls_name)().to_dict()}
    path.write_text(json.dumps(config, default=str), encoding="utf-8")
    manifest = analyze(AnalyzeRequest(config=str(path)))
    model, plan = build_tiny_model(json.loads(path.read_text()), manifest)
    assert model.config.hidden_size == hidden
    assert any(n.startswith("hidden_size") for n in plan.notes) == (hidden != 128)
    with torch.no_grad():
        assert model(input_ids=torch.zeros(1, 3, dtype=torch.long)).logits.shape == (1, 3, TINY_VOCAB)


def test_every_mlp_width_a_family_names_is_shrunk(tmp_path):
    """Qwen2-MoE's shared_expert_intermediate_size (5632) and Ergo's first_dense_ / shared_intermediate_size (32768 /
    8192) are MLP widths besides intermediate_size: at a tied hidden size of heads x head_dim (Ergo: 64 x 128) an
    unshrunk dense layer alone took gigabytes, and the sweep's Ergo run was killed for memory."""
    import transformers

    path = tmp_path / "config.json"
    path.write_text(transformers.Qwen2MoeConfig().to_json_string(), encoding="utf-8")
    manifest = analyze(AnalyzeRequest(config=str(path)))
    model, _ = build_tiny_model(json.loads(path.read_text()), manifest)
    assert model.config.shared_expert_intermediate_size == 128
    widths = {p.shape for name, p in model.named_parameters() if "shared_expert." in name}
    assert widths and all(max(shape) <= max(128, model.config.hidden_size) for shape in widths), widths
