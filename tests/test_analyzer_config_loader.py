"""Config normalization: every spelling (analyzer.config_loader._layer_kinds) and the issue's list, each fact
with its source."""

from __future__ import annotations

import pytest
from model_infer_kvcache.analyzer.config_loader import normalize_config
from model_infer_kvcache.analyzer.errors import InputError


def norm(**cfg):
    base = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8}
    base.update(cfg)
    return normalize_config({k: v for k, v in base.items() if v is not None}, "c.json")


def test_defaults_for_head_dim_kv_heads_and_dtype_are_marked():
    f = norm()
    assert (f.head_dim.value, f.head_dim.source) == (32, "default: hidden_size / num_attention_heads")
    assert f.num_key_value_heads.value == 8 and f.num_key_value_heads.is_default
    assert f.dtype.value == "bfloat16" and f.dtype.is_default
    assert f.layer_kinds.value == ("full",) * 4 and f.sliding_window.value is None


def test_generic_gpt2_style_names_for_an_unknown_model_type():
    f = normalize_config({"model_type": "my_lm", "n_layer": 6, "n_embd": 384, "n_head": 6}, "c.json")
    assert (f.num_layers.value, f.hidden_size.value, f.num_attention_heads.value) == (6, 384, 6)
    assert (f.num_layers.source, f.hidden_size.source, f.num_attention_heads.source) == ("n_layer", "n_embd", "n_head")
    assert f.family == "my_lm" and f.head_dim.value == 64


@pytest.mark.parametrize("cfg, kv, source", [
    ({"multi_query": True}, 1, "multi_query=true (one shared KV head)"),
    ({"multi_query": True, "new_decoder_architecture": True, "num_kv_heads": 4}, 4, "num_kv_heads"),
    ({"n_head_kv": 2}, 2, "n_head_kv"),
    ({"multi_query_group_num": 2}, 2, "multi_query_group_num"),
    ({"num_key_value_heads": None}, 8, "default: = num_attention_heads (no KV-head field, MHA)"),
])
def test_kv_head_spellings(cfg, kv, source):
    f = norm(**cfg)
    assert (f.num_key_value_heads.value, f.num_key_value_heads.source) == (kv, source)


@pytest.mark.parametrize("key", ["text_config", "language_config"])
def test_nested_text_config(key):
    f = normalize_config({
        "model_type": "wrapper", "architectures": ["XForConditionalGeneration"], "torch_dtype": "float16",
        key: {"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4},
    }, "c.json")
    assert f.model_type == "qwen2" and f.num_layers.source == f"{key}.num_hidden_layers"
    assert f.dtype.value == "float16" and f.dtype.source == "torch_dtype"  # outer field as fallback
    assert f.architectures == ["XForConditionalGeneration"]


@pytest.mark.parametrize("cfg, dtype, source", [
    ({"torch_dtype": "bfloat16"}, "bfloat16", "torch_dtype"),
    ({"dtype": "float16"}, "float16", "dtype"),
    ({"torch_dtype": "torch.float32"}, "float32", "torch_dtype"),
    ({"torch_dtype": "fp8"}, "bfloat16", "default: bfloat16 (torch_dtype='fp8' is not a cache dtype)"),
])
def test_dtype_spellings(cfg, dtype, source):
    f = norm(**cfg)
    assert (f.dtype.value, f.dtype.source) == (dtype, source)


@pytest.mark.parametrize("cfg, rope_type, source", [
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "yarn", "rope_scaling.type"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3", "rope_scaling.rope_type"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "default", "rope_parameters.rope_type"),
    ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0},
                          "sliding_attention": {"rope_type": "default"}}},
     "linear", "rope_parameters.full_attention.rope_type"),
    ({"rope_scaling": None}, "default", "default: no rope_scaling/rope_parameters"),
    # Beam: its full-attention layers have no RoPE (NoPE), written as null
    ({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4}, "full_attention": None}},
     "default", "rope_parameters.sliding_attention.rope_type"),
    ({"rope_parameters": {"full_attention": None}}, "default", "rope_parameters: null for every layer type (no RoPE)"),
])
def test_rope_spellings(cfg, rope_type, source):
    f = norm(**cfg)
    assert (f.rope.value.rope_type, f.rope.source) == (rope_type, source)


@pytest.mark.parametrize("cfg, kinds, window", [
    ({"sliding_window": None}, "FFFF", None),
    ({"sliding_window": 64}, "SSSS", 64),  # Mistral v0.1 style: every layer
    ({"sliding_window_size": 64}, "SSSS", 64),
    ({"layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": 64}, "SFSF", 64),
    ({"use_sliding_window": False, "sliding_window": 64, "max_window_layers": 2}, "FFFF", None),
    ({"use_sliding_window": False, "sliding_window": 0}, "FFFF", None),  # how transformers' Qwen2-MoE writes it
    ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2}, "FFSS", 64),
    ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0}, "SSSS", 64),
    ({"sliding_window_pattern": 2, "sliding_window": 64}, "SFSF", 64),
    ({"model_type": "gemma2", "sliding_window": 64}, "SFSF", 64),
    ({"model_type": "gemma3_text", "num_hidden_layers": 6, "sliding_window": 64}, "SSSSSF", 64),
])
def test_sliding_window_spellings(cfg, kinds, window):
    f = norm(**cfg)
    assert "".join(k[0].upper() for k in f.layer_kinds.value) == kinds
    assert f.sliding_window.value == window


def test_hybrid_layer_kinds():
    nxt = norm(model_type="qwen3_next", full_attention_interval=2)
    assert nxt.layer_kinds.value == ("linear", "full", "linear", "full")
    linear = norm(layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
    assert linear.layer_kinds.source == "layer_types"
    l4 = norm(model_type="llama4_text", attention_chunk_size=64, no_rope_layers=[1, 1, 0, 1])
    assert l4.layer_kinds.value == ("chunked", "chunked", "full", "chunked")
    assert l4.attention_chunk_size.value == 64
    l4_default = norm(model_type="llama4_text", attention_chunk_size=64, no_rope_layers=[])
    assert l4_default.layer_kinds.value == ("chunked", "chunked", "chunked", "full")


def test_mla_mtp_softcap_alibi_sinks():
    mla = norm(model_type="deepseek_v2", kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
               qk_rope_head_dim=64, v_head_dim=128, num_nextn_predict_layers=1)
    assert mla.is_mla and mla.mla.value.q_lora_rank is None and mla.qk_head_dim == 192
    assert mla.head_dim.source == "qk_nope_head_dim + qk_rope_head_dim (MLA)"
    assert (mla.num_mtp_layers.value, mla.num_mtp_layers.source) == (1, "num_nextn_predict_layers")
    assert norm(attn_logit_softcapping=30.0).attn_logit_softcapping.value == 30.0
    assert norm(model_type="bloom").alibi.value is True
    assert norm(model_type="gpt_oss", layer_types=["full_attention"] * 4).has_sinks.value is True
    assert norm().has_sinks.value is False
    assert norm(model_type="longcat_flash", num_hidden_layers=None, num_layers=3).sublayers_per_layer.value == 2


def test_head_dim_without_field_is_transformers_floor():
    # Glm4MoeConfig() has no head_dim and 4096 / 96 heads: transformers' attention builds heads of 4096 // 96 = 42
    f = norm(hidden_size=250)  # 8 heads
    assert f.head_dim.value == 31 and "floor" in f.head_dim.source and "250 // 8" in f.head_dim.source
    assert norm(hidden_size=256).head_dim.source == "default: hidden_size / num_attention_heads"


@pytest.mark.parametrize("cfg, field", [
    ({"num_hidden_layers": None}, "num_hidden_layers"),
    ({"num_attention_heads": "8"}, "num_attention_heads"),
    ({"num_attention_heads": True}, "num_attention_heads"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types"),
    ({"layer_types": ["full_attention", "odd", "full_attention", "full_attention"]}, "layer_types[1]"),
    ({"layer_types": ["sliding_attention"] * 4}, "sliding_window"),
    ({"sliding_window": -1}, "sliding_window"),
    ({"kv_lora_rank": 512}, "qk_nope_head_dim"),
    ({"num_nextn_predict_layers": 1.5}, "num_nextn_predict_layers"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
    ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": -1}, "max_window_layers"),
    ({"model_type": "llama4_text", "attention_chunk_size": 64, "no_rope_layers": [1, 0]}, "no_rope_layers"),
])
def test_bad_fields_name_themselves(cfg, field):
    with pytest.raises(InputError) as err:
        norm(**cfg)
    assert err.value.where == "c.json" and err.value.field == field
