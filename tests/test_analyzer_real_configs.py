"""Decisions the analyzer takes on published configs, checked against SKILL.md and references/*.md.

Every test asserts the decision itself (mode, per-layer types and indices, windows, sparse modes,
FA version/reason, layout, scale, cache shapes, per-rank heads), not that something printed.
"""

from __future__ import annotations

import math
from collections import Counter
from functools import cache
from pathlib import Path

import pytest
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.decisions_table import decisions_markdown
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from model_infer_kvcache.analyzer.kv_cache_spec import ChunkedLocalSpec
from model_infer_kvcache.analyzer.operators.fa_facts import (
    INT32_MAX as NO_LIMIT,  # pre_tokens of non-sliding layers
)

CONFIGS = Path(__file__).parent / "fixtures" / "configs"


@cache  # manifests are frozen; each (config, options) pair is analyzed once per session
def run(name: str, **kw) -> SelectionManifest:
    return analyze(AnalyzeRequest(config=str(CONFIGS / f"{name}.json"), **kw))


def types(m: SelectionManifest) -> Counter:
    return Counter(layer.attn_type for layer in m.layers)


def indices(m: SelectionManifest, attn_type: str) -> list[int]:
    return [layer.index for layer in m.layers if layer.attn_type == attn_type]


def only(values):
    values = set(values)
    assert len(values) == 1, values
    return values.pop()


def assert_standard_gqa_paged(m: SelectionManifest, n_layers: int, kv_heads: int, head_dim: int):
    """The Qwen3-reference path: Paged, FullAttention, TND, FA v1, sparse 3/3 with the 2048 mask."""
    assert m.kv_mode.value == "paged" and not m.blockers
    assert types(m) == Counter({"FullAttention": n_layers})
    assert [layer.index for layer in m.layers] == list(range(n_layers))
    assert m.fa.version == "v1" and m.fa.is_default and "Qwen3" in m.fa.reason
    assert m.fa.input_layout == "TND"
    assert math.isclose(m.fa.softmax_scale, head_dim**-0.5)
    assert not m.mixed_attn_types and not m.mla.enabled and not m.mla.absorb
    for layer in m.layers:
        assert (layer.sparse_mode.prefill, layer.sparse_mode.decode) == (3, 3)
        assert (layer.mask.prefill, layer.mask.decode) == ("causal_2048", "causal_2048")
        assert (layer.pre_tokens, layer.next_tokens) == (NO_LIMIT, 0)
        assert layer.sliding_window is None and layer.group_key == "FullAttention"
        assert layer.write_op == "npu_scatter_nd_update_"
        assert [(c.name, c.dim, c.num_head, c.dtype) for c in layer.caches] == [
            ("k_cache", head_dim, kv_heads, "bfloat16"), ("v_cache", head_dim, kv_heads, "bfloat16")]


# ---------------------------------------------------------------- standard GQA / MHA / MQA


def test_qwen3_8b_standard_paged_and_tp4_heads():
    m = run("qwen3_8b")
    assert_standard_gqa_paged(m, 36, 8, 128)
    assert (m.model.num_attention_heads, m.model.num_key_value_heads, m.model.head_dim) == (32, 8, 128)
    assert m.model.sources["head_dim"] == "head_dim"
    assert m.model.sources["layer_kinds"] == "use_sliding_window=false"
    assert m.model.max_position_embeddings == 40960
    # 36 layers x (k + v) x 128 x 8 heads x 2 bytes
    assert m.memory.per_token_bytes == 36 * 2 * 128 * 8 * 2
    tp4 = run("qwen3_8b", attn_tp_size=4)
    assert (tp4.parallel.num_q_heads_per_rank, tp4.parallel.num_kv_heads_per_rank) == (8, 2)
    assert not tp4.parallel.kv_heads_replicated
    assert only(c.num_head for layer in tp4.layers for c in layer.caches) == 2
    assert tp4.memory.per_token_bytes == m.memory.per_token_bytes // 4


def test_qwen3_30b_a3b_moe_follows_qwen3_and_replicates_kv_at_tp8():
    m = run("qwen3_30b_a3b")
    assert m.model.family == "qwen3" and m.model.model_type == "qwen3_moe"
    assert_standard_gqa_paged(m, 48, 4, 128)
    tp8 = run("qwen3_30b_a3b", attn_tp_size=8)
    # 4 KV heads over 8 ranks: max(4 // 8, 1) = 1 per rank, each KV head held by two ranks.
    assert (tp8.parallel.num_q_heads_per_rank, tp8.parallel.num_kv_heads_per_rank) == (4, 1)
    assert tp8.parallel.kv_heads_replicated and not tp8.parallel.latent_replicated


def test_llama31_8b_llama3_rope_keeps_plain_scale():
    m = run("llama31_8b")
    assert_standard_gqa_paged(m, 32, 8, 128)
    assert m.model.rope.rope_type == "llama3" and m.model.rope.factor == 8.0
    # llama3 rope scaling changes frequencies, never the softmax scale.
    assert m.fa.scale_derivation == "head_dim^-0.5 = 128^-0.5"


def test_qwen2_7b_inert_sliding_window_is_ignored():
    m = run("qwen2_7b")
    # use_sliding_window=false: sliding_window 131072 and max_window_layers 28 must not create sliding layers.
    assert_standard_gqa_paged(m, 28, 4, 128)
    assert m.model.sources["sliding_window"] == "use_sliding_window=false"


def test_glm4_moe_gqa_with_one_mtp_layer():
    m = run("glm4_moe")
    assert_standard_gqa_paged(m, 46, 8, 128)
    assert m.mtp is not None and m.mtp.num_layers == 1 and m.mtp.holds_caches
    assert m.mtp.decode_sparse_mode == 3 and m.mtp.decode_mask == "causal_2048"
    assert any("MTP" in w.message and "num_nextn_predict_layers" in w.fields for w in m.warnings)
    tp8 = run("glm4_moe", attn_tp_size=8)
    assert (tp8.parallel.num_q_heads_per_rank, tp8.parallel.num_kv_heads_per_rank) == (12, 1)


def test_falcon_7b_multi_query_one_kv_head():
    m = run("falcon_7b")
    assert m.model.attention_kind == "mqa"
    assert m.model.num_key_value_heads == 1 and m.model.sources["num_key_value_heads"].startswith("multi_query")
    # no head_dim field: 4544 / 71 = 64
    assert m.model.head_dim == 64 and m.model.sources["head_dim"].startswith("default: hidden_size / ")
    assert m.model.sources["alibi"] == "alibi"  # alibi: false stated, not a blocker
    # 71 query heads on one KV head: FA takes a query/KV ratio of at most 64 (torch_npu docs).
    assert [b.message.split(":")[0] for b in m.blockers] == ["71 query heads per 1 KV head(s) on a rank"]
    assert m.kv_mode.value == "legacy"
    # 71 query heads split only by 71: one query head and a replicated KV head per rank.
    tp71 = run("falcon_7b", attn_tp_size=71)
    assert (tp71.parallel.num_q_heads_per_rank, tp71.parallel.num_kv_heads_per_rank) == (1, 1)
    assert tp71.parallel.kv_heads_replicated
    assert_standard_gqa_paged(tp71, 32, 1, 64)  # ratio 1 per rank: the standard path again
    with pytest.raises(InputError) as err:
        run("falcon_7b", attn_tp_size=2)
    assert err.value.where == "--attn-tp-size" and err.value.field == "num_attention_heads"
    assert "71 query heads are not divisible by attn_tp_size 2" in err.value.message


def test_phi3_mini_every_layer_sliding_mha():
    m = run("phi3_mini")
    assert m.kv_mode.value == "paged" and not m.blockers
    assert m.model.attention_kind == "mha" and m.model.head_dim == 96
    assert types(m) == Counter({"SlidingWindow": 32}) and not m.mixed_attn_types
    assert m.model.sources["layer_kinds"] == "sliding_window with no layer_types (every layer)"
    assert only(layer.sliding_window for layer in m.layers) == 2047
    assert only(layer.pre_tokens for layer in m.layers) == 2046
    assert only((layer.sparse_mode.prefill, layer.sparse_mode.decode) for layer in m.layers) == (4, 4)
    assert math.isclose(m.fa.softmax_scale, 96**-0.5)
    assert only(c.num_head for layer in m.layers for c in layer.caches) == 32


def test_mistral_7b_v01_every_layer_sliding_4096():
    m = run("mistral_7b_v01")
    assert m.kv_mode.value == "paged" and not m.blockers
    assert types(m) == Counter({"SlidingWindow": 32})
    assert only(layer.group_key for layer in m.layers) == "SlidingWindow"
    for layer in m.layers:
        assert layer.sliding_window == 4096
        # HF sees W keys including the query; the band admits pre_tokens + 1 -> W - 1.
        assert (layer.pre_tokens, layer.next_tokens) == (4095, 0)
        assert "W-1 = 4095" in layer.window_derivation
        assert (layer.sparse_mode.prefill, layer.sparse_mode.decode) == (4, 4)
        assert (layer.mask.prefill, layer.mask.decode) == ("causal_2048", "causal_2048")
    assert m.fa.version == "v1" and m.fa.input_layout == "TND"
    deps = {d.question: d for d in m.device_dependencies}
    assert deps["band_at_single_query"].layers == list(range(32))
    assert deps["window_pre_tokens"].assumed == "exclusive"
    inclusive = run("mistral_7b_v01", window_reading="inclusive")
    assert only(layer.pre_tokens for layer in inclusive.layers) == 4096


# ---------------------------------------------------------------- mixed sliding / full


def test_gpt_oss_20b_sinks_force_v2_and_alternate_sliding_layers():
    m = run("gpt_oss_20b")
    assert m.kv_mode.value == "paged" and not m.blockers
    assert m.model.has_sinks
    assert m.fa.version == "v2" and not m.fa.is_default and "sink" in m.fa.reason
    assert m.fa.input_layout == "TND"
    assert m.mixed_attn_types
    assert indices(m, "SlidingWindow") == list(range(0, 24, 2))
    assert indices(m, "FullAttention") == list(range(1, 24, 2))
    assert m.model.sources["layer_kinds"] == "layer_types"
    for layer in m.layers:
        if layer.attn_type == "SlidingWindow":
            assert (layer.sliding_window, layer.pre_tokens, layer.group_key) == (128, 127, "SlidingWindow")
            assert (layer.sparse_mode.prefill, layer.sparse_mode.decode) == (4, 4)
        else:
            assert (layer.sliding_window, layer.pre_tokens, layer.group_key) == (None, NO_LIMIT, "FullAttention")
            assert (layer.sparse_mode.prefill, layer.sparse_mode.decode) == (3, 3)
        assert [(c.name, c.dim, c.num_head) for c in layer.caches] == [("k_cache", 64, 8), ("v_cache", 64, 8)]
    # yarn without mscale_all_dim: the attention factor goes into cos/sin, not the softmax scale.
    assert m.model.rope.rope_type == "yarn" and m.fa.softmax_scale == 0.125
    # the published file has no dtype: a default, said so
    assert m.model.sources["dtype"].startswith("default")
    assert any("dtype" in q.message for q in m.open_questions)
    assert run("gpt_oss_20b", fa_version="v1").fa.version == "v2"  # sinks exist only on v2
    assert [g.group_key for g in m.memory.groups] == ["FullAttention", "SlidingWindow"]
    assert [g.num_layers for g in m.memory.groups] == [12, 12]


def test_gemma3_4b_pattern_six_from_class_defaults():
    m = run("gemma3_4b")
    assert m.model.model_type == "gemma3_text" and m.model.family == "gemma3"
    # published text_config omits heads/head_dim: transformers Gemma3TextConfig defaults, marked as such
    assert (m.model.num_attention_heads, m.model.num_key_value_heads, m.model.head_dim) == (8, 4, 256)
    assert m.model.sources["head_dim"] == "default: transformers Gemma3TextConfig.head_dim"
    assert m.kv_mode.value == "paged" and not m.blockers and m.mixed_attn_types
    assert indices(m, "FullAttention") == [5, 11, 17, 23, 29]
    assert len(indices(m, "SlidingWindow")) == 29
    assert only(layer.sliding_window for layer in m.layers if layer.attn_type == "SlidingWindow") == 1024
    assert only(layer.pre_tokens for layer in m.layers if layer.attn_type == "SlidingWindow") == 1023
    # query_pre_attn_scalar 256 sets the scale (= 256^-0.5, equal to head_dim^-0.5 here)
    assert m.fa.scale_derivation.startswith("query_pre_attn_scalar^-0.5") and m.fa.softmax_scale == 0.0625
    assert m.model.dtype == "bfloat16" and m.model.sources["dtype"] == "torch_dtype"


def test_gemma2_softcap_keeps_legacy_with_window_band():
    m = run("gemma2_9b")
    assert m.kv_mode.value == "legacy"
    assert [b.fields for b in m.blockers] == [["attn_logit_softcapping"]]
    assert "soft-capping" in m.kv_mode.reason
    assert indices(m, "SlidingWindow") == list(range(0, 42, 2))
    assert indices(m, "FullAttention") == list(range(1, 42, 2))
    assert m.fa.input_layout == "BSH" and math.isclose(m.fa.softmax_scale, 256**-0.5)
    for layer in m.layers:
        assert layer.write_op == "scatter_update_"
        # Legacy cache_unit = (num_kv_heads_per_rank * head_dim,) in the model dtype (float32 here)
        assert [(c.name, c.dim, c.num_head, c.dtype) for c in layer.caches] == [
            ("k_cache", 8 * 256, 1, "float32"), ("v_cache", 8 * 256, 1, "float32")]
        if layer.attn_type == "SlidingWindow":
            # the window still needs the band on Legacy: 3 would see the whole prefix
            assert (layer.sparse_mode.prefill, layer.pre_tokens, layer.sliding_window) == (4, 4095, 4096)
        else:
            assert (layer.sparse_mode.prefill, layer.sparse_mode.decode) == (3, 0)
            assert layer.mask.decode == "none"
    messages = " ".join(w.message for w in m.warnings)
    assert "offline only" in messages and "soft-cap" in messages and "q_len 1" in messages
    assert m.device_dependencies == []  # no paged design, nothing to settle on the device


# ---------------------------------------------------------------- blocked hybrids


def test_llama4_scout_chunked_attention_is_planned_paged():
    """Llama-4 Scout: 36 RoPE layers attend within chunks of 8192 (ChunkedLocal, kept by the framework's SlidingWindow
    manager with window 8192), every 4th layer is NoPE full attention. By hand: one rank holds 8 KV heads x 128 x 2
    (K and V) x 2 B = 4096 B per token and layer; a chunked request keeps ceil(8192 / 128) + 1 = 65 blocks."""
    m = run("llama4_scout")
    assert m.model.model_type == "llama4_text" and m.model.attention_kind == "hybrid"
    assert m.kv_mode.value == "paged" and m.blockers == []
    chunked = [layer for layer in m.layers if layer.layer_kind == "chunked"]
    full = [layer.index for layer in m.layers if layer.layer_kind == "full"]
    assert full == list(range(3, 48, 4)) and len(chunked) == 36  # every 4th layer is NoPE / global
    assert {(layer.attn_type, layer.group_key, layer.attention_chunk_size, layer.sliding_window, layer.pre_tokens)
            for layer in chunked} == {("ChunkedLocal", "SlidingWindow", 8192, None, NO_LIMIT)}
    assert (m.model.num_attention_heads, m.model.num_key_value_heads, m.model.head_dim) == (40, 8, 128)
    assert only(len(layer.caches) for layer in m.layers) == 2
    groups = {g.group_key: g for g in m.memory.groups}
    assert groups["SlidingWindow"].attn_type == "ChunkedLocal" and groups["SlidingWindow"].fixed_blocks
    assert groups["SlidingWindow"].per_token_bytes == 36 * 4096 and groups["FullAttention"].per_token_bytes == 12 * 4096
    spec = ChunkedLocalSpec("SlidingWindow", 36, 36 * 4096, 128, window=8192)
    assert spec.blocks_per_request(10 ** 6) == 65 and spec.fixed_blocks(4) == 4 * 65 + 1


def test_qwen3_next_linear_layers_hold_recurrent_states_and_the_full_layers_page():
    """Qwen3-Next (published config): 36 gated-delta-net layers keep a fixed state, 12 full layers page. Sizes by
    hand from the config: conv channels 2 x 16 x 128 + 32 x 128 = 8192 (4096 per rank at TP 2) x (kernel 4 - 1);
    recurrent state 32 / 2 value heads x 128 x 128 in bfloat16 (the NPU operator's only state dtype)."""
    m = run("qwen3_next", attn_tp_size=2, max_len=4096, max_concurrency=8)
    assert m.kv_mode.value == "paged" and not m.blockers
    full = [layer.index for layer in m.layers if layer.layer_kind == "full"]
    assert full == list(range(3, 48, 4))
    lin = m.linear_attention
    assert lin.family == "gated_delta_net" and lin.layers == [i for i in range(48) if i % 4 != 3]
    assert (lin.num_k_heads_per_rank, lin.num_v_heads_per_rank, lin.conv_channels_per_rank) == (8, 16, 4096)
    assert [(s.name, s.shape, s.dtype) for s in lin.states] == [
        ("conv_state", [4096, 3], "bfloat16"), ("recurrent_state", [16, 128, 128], "bfloat16")]
    assert lin.state_bytes_per_layer == 4096 * 3 * 2 + 16 * 128 * 128 * 2
    for layer in m.layers:
        if layer.layer_kind == "linear":
            assert layer.attn_type == "Mamba" and layer.caches == [] and layer.states == lin.states
        else:
            assert layer.attn_type == "FullAttention" and layer.states == []
            assert [(c.name, c.dim, c.num_head) for c in layer.caches] == [("k_cache", 256, 1), ("v_cache", 256, 1)]
    # per token only the 12 full layers grow: 12 x 2 x 256 x 1 head x 2 B
    assert m.memory.per_token_bytes == 12 * 2 * 256 * 2
    groups = {g.group_key: g for g in m.memory.groups}
    assert groups["FullAttention"].num_layers == 12 and groups["Mamba"].num_layers == 36
    assert groups["Mamba"].state_bytes == 36 * lin.state_bytes_per_layer and groups["Mamba"].fixed_blocks
    # offline: ceil(4096 / 128) x 8 + 1 paged blocks; one state block per request + the null block
    assert m.memory.blocks == {"FullAttention": 257, "Mamba": 9}
    assert any("MambaCacheEntry" in q.message for q in m.open_questions)  # no checkout: G3 not verified


def test_a_linear_family_kvcache_does_not_know_stays_blocked(tmp_path):
    """layer_types naming linear layers on a model_type with no known linear family: no state shapes to plan."""
    import json

    cfg = json.loads((CONFIGS / "qwen3_8b.json").read_text())
    cfg["layer_types"] = ["linear_attention" if i % 4 != 3 else "full_attention" for i in range(cfg["num_hidden_layers"])]
    cfg["model_type"] = "acme_hybrid"  # no transformers class either (one would have refused the layer types)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    m = analyze(AnalyzeRequest(config=str(path)))
    assert m.kv_mode.value == "legacy" and m.linear_attention is None
    assert "unknown family" in m.blockers[0].message and m.blockers[0].fields == ["layer_types"]
    assert all(layer.attn_type == "FullAttention" and not layer.states for layer in m.layers)


# ---------------------------------------------------------------- MLA


def _yarn(factor: float, mscale_all_dim: float) -> float:
    m = 0.1 * mscale_all_dim * math.log(factor) + 1
    return m * m


def assert_mla_absorb(m: SelectionManifest, n_layers: int):
    assert m.kv_mode.value == "paged" and not m.blockers
    assert m.model.attention_kind == "mla" and m.mla.enabled and m.mla.absorb and m.mla.cache_mode == "PA_NZ"
    assert m.fa.input_layout == "TND_NTD"
    assert types(m) == Counter({"FullAttention": n_layers})
    for layer in m.layers:
        assert [(c.name, c.dim, c.num_head, c.dtype) for c in layer.caches] == [
            ("nope_cache", 512, 1, "bfloat16"), ("rope_cache", 64, 1, "bfloat16")]
        assert layer.write_op == "npu_kv_rmsnorm_rope_cache"
        # absorb prefill: causal 3; absorb decode (q_len 1): 0 without mask (3 deviates)
        assert (layer.sparse_mode.prefill, layer.sparse_mode.decode) == (3, 0)
        assert (layer.mask.prefill, layer.mask.decode) == ("causal_2048", "none")
    assert any("num_key_value_heads = 1" in c for c in m.mla.constraints)
    assert m.model.qk_head_dim == 192


def test_deepseek_v3_mla_yarn_scale_mtp_and_tp16():
    m = run("deepseek_v3")
    assert_mla_absorb(m, 61)
    assert m.fa.version == "v2" and m.fa.is_default and "DeepSeek-R1" in m.fa.reason
    assert math.isclose(m.fa.softmax_scale, 192**-0.5 * (0.1 * math.log(40) + 1) ** 2, rel_tol=1e-12)
    assert math.isclose(m.fa.softmax_scale, 0.1352337, rel_tol=1e-6)
    assert "mscale^2" in m.fa.scale_derivation and "rope_scaling.type" in m.fa.scale_derivation
    assert m.mtp is not None and m.mtp.num_layers == 1 and m.mtp.decode_sparse_mode == 3
    # the MTP layer's latent cache is allocated from the same pool as the 61 decoder layers'
    assert m.memory.per_token_bytes == (61 + 1) * (512 + 64) * 2
    assert [g.num_layers for g in m.memory.groups] == [62]
    tp16 = run("deepseek_v3", attn_tp_size=16)
    assert tp16.parallel.num_q_heads_per_rank == 8 and tp16.parallel.num_kv_heads_per_rank == 1
    assert tp16.parallel.latent_replicated and not tp16.parallel.kv_heads_replicated
    # the latent is never split: per-token bytes do not shrink with TP
    assert tp16.memory.per_token_bytes == m.memory.per_token_bytes


def test_deepseek_v2_lite_null_q_lora_and_fractional_mscale():
    m = run("deepseek_v2_lite")
    assert_mla_absorb(m, 27)
    assert m.model.mla.q_lora_rank is None
    assert any("q_lora_rank is null" in c for c in m.mla.constraints)
    assert math.isclose(m.fa.softmax_scale, 192**-0.5 * _yarn(40, 0.707), rel_tol=1e-12)
    assert m.mtp is None


def test_kimi_k2_follows_deepseek_v3():
    m = run("kimi_k2")
    assert m.model.family == "deepseek_v3"
    assert_mla_absorb(m, 61)
    assert math.isclose(m.fa.softmax_scale, 192**-0.5 * _yarn(32, 1.0), rel_tol=1e-12)
    assert m.mtp is None  # num_nextn_predict_layers 0
    assert run("kimi_k2", fa_version="v1").fa.version == "v1"  # v1 also works for MLA (Kimi-K2 reference)


def test_longcat_flash_two_mla_sublayers_per_layer():
    m = run("longcat_flash")
    assert m.model.sublayers_per_layer == 2 and m.model.num_layers == 28
    assert_mla_absorb(m, 56)
    assert [(layer.decoder_layer, layer.sublayer) for layer in m.layers[:4]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert m.layers[-1].index == 55 and m.layers[-1].decoder_layer == 27
    assert math.isclose(m.fa.softmax_scale, 192**-0.5)  # no rope scaling in the file
    assert m.memory.per_token_bytes == 56 * (512 + 64) * 2


# ---------------------------------------------------------------- every fixture


@pytest.mark.parametrize("name", sorted(p.stem for p in CONFIGS.glob("*.json")))
def test_every_fixture_round_trips_and_renders_the_table(name):
    m = run(name)
    assert SelectionManifest.model_validate_json(m.to_json()) == m
    md = decisions_markdown(m)
    assert "| 决策项 | 选择 | 理由 |" in md
    assert f"| KV 模式 | {m.kv_mode.value} |" in md
    # each attention kind shows its own call: FA, DSA's sparse FA, the model's own eager attention (no call), or none
    # at all (a pure state stack: no layer attends)
    if not m.attention_layers:
        assert "| 注意力 | 无(纯状态栈) |" in md and "| FA 版本 |" not in md
    elif m.dsa is not None:
        assert "| 稀疏注意力调用 |" in md and "| FA 版本 |" not in md
    elif m.legacy_attention is not None and m.legacy_attention.kernel == "model":
        assert "| cache 布局 |" in md and "| FA 版本 |" not in md
    else:
        assert f"| FA 版本 | {m.fa.version} |" in md
    # blockers <-> legacy, one way and the other
    assert (m.kv_mode.value == "legacy") == bool(m.blockers)
    for b in m.blockers:
        assert b.fields and all(b.fields), b


def test_gpt_oss_budget_sizes_the_sliding_reservation_for_the_concurrency_that_fits():
    m = run("gpt_oss_20b", hbm_gb=1.0, kv_mem_ratio=1.0, max_len=4096)
    # Both groups: 12 layers x k,v x 64 x 8 x 2 B = 24576 B/token, 3 MiB per 128-token block; 1 GiB = 341.33 blocks.
    # c requests hold 2c + 1 sliding blocks and need 32c + 1 full blocks of the 340 - 2c left: c = 9.
    # Sliding 9 x 2 + 1 = 19 blocks (57 MiB); full floor(floor((1 GiB - 57 MiB) / 24576) / 128) = 322.
    assert m.memory.max_concurrency == 9 and m.memory.max_concurrency_at_max_len == 9
    assert m.memory.blocks == {"SlidingWindow": 19, "FullAttention": 322}
    assert [(g.group_key, g.fixed_blocks, g.blocks) for g in m.memory.groups] == [
        ("FullAttention", False, 322), ("SlidingWindow", True, 19)]
