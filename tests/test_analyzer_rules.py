"""Unit tests for every decision rule (analyzer/rules.py) and the block math (analyzer/memory.py).

Expected numbers are computed by hand in the comments, from references/framework.md, references/fa_operators.md
and the framework's cache_utils formulas, never by calling the code under test.
"""

from __future__ import annotations

import math

import pytest
from model_infer_kvcache.analyzer import kv_cache_spec, memory, rules
from model_infer_kvcache.analyzer.config_loader import normalize_config, yarn_mscale
from model_infer_kvcache.analyzer.kinds import mla as mla_kind
from model_infer_kvcache.analyzer.manifest import CacheSpec, Finding
from model_infer_kvcache.analyzer.operators.fa_facts import INT32_MAX

GIB = 1024**3


def cfg(**over) -> dict:
    """A small Llama-like config; ``None`` removes a key."""
    base = {
        "model_type": "llama", "num_hidden_layers": 4, "hidden_size": 1024, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 64, "torch_dtype": "bfloat16",
    }
    base.update(over)
    return {k: v for k, v in base.items() if v is not None}


def facts(**over):
    return normalize_config(cfg(**over), "test.json")


MLA = {
    "model_type": "deepseek_v3", "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "num_key_value_heads": 16, "head_dim": None,
}


# ---------------------------------------------------------------- blockers and KV mode


def test_no_blocker_for_plain_gqa():
    assert rules.find_blockers(facts()) == []


@pytest.mark.parametrize("over, field, words", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping", "soft-capping"),
    ({"alibi": True}, "alibi", "ALiBi"),
    ({"position_embedding_type": "alibi"}, "position_embedding_type", "ALiBi"),
    ({"attn_config": {"alibi": True}}, "attn_config.alibi", "ALiBi"),
    # a chunk that starts inside a block (8200 is no multiple of block 128): no shifted block table reads it
    ({"layer_types": ["chunked_attention", "full_attention"] * 2, "attention_chunk_size": 8200},
     "attention_chunk_size", "not a multiple of block_size 128"),
    ({"layer_types": ["linear_attention", "full_attention"] * 2}, "layer_types", "linear-attention"),
    ({"head_dim": 576}, "head_dim", "head_dim 576"),
    ({"head_dim": 72}, "head_dim", "head_dim 72"),
])
def test_each_blocker_names_its_field(over, field, words):
    found = rules.find_blockers(facts(**over))
    assert len(found) == 1, found
    assert found[0].fields[0] == field and words in found[0].message


def test_a_chunk_of_whole_blocks_is_no_blocker():
    chunked = {"layer_types": ["chunked_attention", "full_attention"] * 2, "attention_chunk_size": 8192}
    assert rules.find_blockers(facts(**chunked)) == []
    assert rules.find_blockers(facts(**chunked), block_size=512) == []
    assert "block_size 384" in rules.find_blockers(facts(**chunked), block_size=384)[0].message
    both = {"layer_types": ["chunked_attention", "sliding_attention", "full_attention", "full_attention"],
            "attention_chunk_size": 256,
            "sliding_window": 128}
    assert ["SlidingWindow manager" in b.message for b in rules.find_blockers(facts(**both))] == [True]


def test_mla_blockers_on_rope_and_latent_dims():
    ok = rules.find_blockers(facts(**MLA))
    assert ok == []
    bad = rules.find_blockers(facts(**{**MLA, "qk_rope_head_dim": 32, "kv_lora_rank": 256}))
    assert sorted(f for b in bad for f in b.fields) == ["kv_lora_rank", "qk_rope_head_dim"]
    # a 512-wide latent is fine for MLA even though a GQA head_dim of 576 would not be
    assert rules.find_blockers(facts(**{**MLA, "qk_nope_head_dim": 512})) == []


def test_kv_mode_paged_by_default_legacy_only_with_a_blocker():
    paged = rules.decide_kv_mode([], ["legacy_cache_unit"])
    assert paged.value == "paged" and paged.is_default
    assert paged.evidence == ["progress.md starting point: legacy_cache_unit"]
    blocker = Finding(message="soft-capping", fields=["attn_logit_softcapping"])
    legacy = rules.decide_kv_mode([blocker], [])
    assert legacy.value == "legacy" and not legacy.is_default
    assert "soft-capping" in legacy.reason and "attn_logit_softcapping" in legacy.evidence


# ---------------------------------------------------------------- per-layer decisions


def test_attn_type_per_kind():
    assert rules.decide_attn_type("sliding") == "SlidingWindow"
    assert rules.decide_attn_type("linear") == "Mamba"  # a recurrent state in the framework's Mamba group
    assert rules.decide_attn_type("full") == "FullAttention"
    assert rules.decide_attn_type("chunked") == "ChunkedLocal"  # its own kind, kept by the SlidingWindow manager


def test_window_tokens_both_readings():
    assert rules.decide_window_tokens(None) == (INT32_MAX, 0, None)
    pre, nxt, why = rules.decide_window_tokens(128)
    assert (pre, nxt) == (127, 0) and "W-1 = 127" in why  # band admits pre+1 keys; HF sees W
    pre, nxt, why = rules.decide_window_tokens(128, "inclusive")
    assert (pre, nxt) == (128, 0) and "inclusive" in why


@pytest.mark.parametrize("attn_type, is_mla, kv_mode, sparse, masks", [
    ("FullAttention", False, "paged", (3, 3), ("causal_2048", "causal_2048")),
    ("SlidingWindow", False, "paged", (4, 4), ("causal_2048", "causal_2048")),
    ("FullAttention", True, "paged", (3, 0), ("causal_2048", "none")),
    ("FullAttention", False, "legacy", (3, 0), ("causal_2048", "none")),
    ("SlidingWindow", False, "legacy", (4, 4), ("causal_2048", "causal_2048")),
    ("FullAttention", True, "legacy", (3, 0), ("causal_2048", "none")),
])
def test_sparse_mode_and_mask_per_path(attn_type, is_mla, kv_mode, sparse, masks):
    per_path, mask, reason = rules.decide_sparse(attn_type, is_mla, kv_mode)
    assert (per_path.prefill, per_path.decode) == sparse
    assert (mask.prefill, mask.decode) == masks
    assert reason


def test_write_op():
    assert rules.decide_write_op("paged", False) == "npu_scatter_nd_update_"
    assert rules.decide_write_op("paged", True) == "npu_kv_rmsnorm_rope_cache"
    assert rules.decide_write_op("legacy", False) == "scatter_update_"
    assert rules.decide_write_op("legacy", True) == "scatter_update_"


# ---------------------------------------------------------------- FA


def test_fa_version_defaults_and_overrides():
    gqa = rules.decide_fa_version(facts())
    assert (gqa.value, gqa.is_default) == ("v1", True)
    mla = rules.decide_fa_version(facts(**MLA))
    assert (mla.value, mla.is_default) == ("v2", True)
    assert rules.decide_fa_version(facts(**MLA), "v1").value == "v1"
    assert rules.decide_fa_version(facts(), "v2").value == "v2"
    sinks = facts(model_type="gpt_oss")
    assert rules.decide_fa_version(sinks).value == "v2"
    refused = rules.decide_fa_version(sinks, "v1")
    assert refused.value == "v2" and "refused" in refused.reason


def test_input_layout():
    assert rules.decide_input_layout(facts(), "paged").value == "TND"
    assert rules.decide_input_layout(facts(**MLA), "paged").value == "TND_NTD"
    assert rules.decide_input_layout(facts(), "legacy").value == "BSH"
    assert rules.decide_input_layout(facts(**MLA), "legacy").value == "BSH"


def test_scale_plain_head_dim():
    scale, why = rules.decide_scale(facts())
    assert scale == 64**-0.5 == 0.125 and why == "head_dim^-0.5 = 64^-0.5"


def test_scale_query_pre_attn_scalar_wins_over_head_dim():
    scale, why = rules.decide_scale(facts(model_type="gemma2", query_pre_attn_scalar=144))
    assert math.isclose(scale, 1 / 12) and why.startswith("query_pre_attn_scalar")


def test_scale_query_pre_attn_scalar_is_ignored_by_a_family_that_does_not_read_it():
    scale, why = rules.decide_scale(facts(query_pre_attn_scalar=144))  # Llama: self.scaling = head_dim**-0.5
    assert math.isclose(scale, 64 ** -0.5) and why.startswith("head_dim")


def test_scale_deepseek_v3_yarn():
    f = facts(**MLA, rope_scaling={"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                                   "original_max_position_embeddings": 4096})
    scale, why = rules.decide_scale(f)
    # 192^-0.5 = 0.07216878; m = 0.1 x 1.0 x ln 40 + 1 = 1.36888794; m^2 = 1.87385...
    # scale = 0.07216878 x 1.87385 = 0.13523377
    assert math.isclose(scale, 192**-0.5 * (0.1 * math.log(40) + 1) ** 2, rel_tol=1e-12)
    assert math.isclose(scale, 0.135234, rel_tol=1e-5)
    assert "mscale^2" in why and "1.368888" in why


def test_scale_yarn_spelled_as_rope_parameters_with_rope_type():
    f = facts(**MLA, rope_parameters={"rope_type": "yarn", "factor": 40.0, "mscale_all_dim": 1.0,
                                      "rope_theta": 10000.0})
    assert math.isclose(rules.decide_scale(f)[0], 192**-0.5 * (0.1 * math.log(40) + 1) ** 2)
    assert f.rope.source == "rope_parameters.rope_type"


def test_scale_yarn_without_mscale_all_dim_or_without_stretch_is_plain():
    gpt_oss_like = facts(rope_scaling={"rope_type": "yarn", "factor": 32.0})
    assert rules.decide_scale(gpt_oss_like)[0] == 0.125
    no_stretch = facts(**MLA, rope_scaling={"type": "yarn", "factor": 1.0, "mscale_all_dim": 1.0})
    assert rules.decide_scale(no_stretch)[0] == 192**-0.5
    assert yarn_mscale(1.0, 1.0) == 1.0 and yarn_mscale(None, 1.0) == 1.0 and yarn_mscale(40, None) == 1.0
    assert math.isclose(yarn_mscale(math.e, 0.5), 1.05)  # 0.1 x 0.5 x ln e + 1


def test_scale_yarn_mscale_is_an_mla_rule_only():
    """transformers applies yarn_apply_mscale (any rope_type but default) in MLA families only; Ministral 3 publishes
    the same rope fields (yarn, mscale_all_dim 1, factor 16) on GQA attention and keeps head_dim^-0.5."""
    yarn = {"rope_type": "yarn", "factor": 16.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 1e6,
            "original_max_position_embeddings": 16384}
    ministral3_like = facts(model_type="ministral3", rope_parameters=yarn)
    scale, why = rules.decide_scale(ministral3_like)
    assert scale == 64 ** -0.5 and "mscale" not in why
    mla = facts(**MLA, rope_parameters=yarn)  # the same fields on MLA: mscale^2 applies
    assert math.isclose(rules.decide_scale(mla)[0], 192 ** -0.5 * (0.1 * math.log(16) + 1) ** 2)


# ---------------------------------------------------------------- parallel and caches


@pytest.mark.parametrize("heads, tp, fits", [
    (20, 1, "5 / 10 / 20"),  # GLM-4.7-Flash (glm4_moe_lite): 20 MLA heads
    (20, 5, None),
    (128, 1, None),  # DeepSeek-V3
    (96, 2, "3 / 6 / 12 / 24 / 48 / 96"),  # 48 per rank
])
def test_mla_query_heads_per_rank_must_be_a_count_fa_takes(heads, tp, fits):
    f = facts(**{**MLA, "num_attention_heads": heads, "num_key_value_heads": heads})
    problem = rules.heads_problem(f, rules.decide_parallel(f, tp, "x"))
    if fits is None:
        assert problem is None
    else:
        assert f"{heads // tp} query heads per rank at attn_tp_size {tp}" in problem.message
        assert f"--attn-tp-size {fits} (" in problem.message


def test_mla_heads_rule_is_not_applied_to_gqa_or_dsa():
    """Each format asks its own call's head rule: GQA's query/KV ratio (20 / 4 fits), none for DSA's sparse FA."""
    gqa = facts(num_attention_heads=20, num_key_value_heads=4)
    assert rules.heads_problem(gqa, rules.decide_parallel(gqa, 1, "x")) is None
    dsa = facts(**{**MLA, "num_attention_heads": 20, "num_key_value_heads": 20, "model_type": "deepseek_v32"},
                index_topk=2048, index_n_heads=64, index_head_dim=128)
    assert dsa.dsa.value is not None
    assert rules.heads_problem(dsa, rules.decide_parallel(dsa, 1, "x")) is None


def test_tp16_with_8_kv_heads_gives_one_per_rank_and_flags_replication():
    f = facts(num_attention_heads=32, num_key_value_heads=8, hidden_size=4096, head_dim=128)
    assert rules.tp_problems(f, 16) == []
    p = rules.decide_parallel(f, 16, "--attn-tp-size")
    # query heads 32 / 16 = 2; KV max(8 // 16, 1) = 1, each KV head on two ranks
    assert (p.num_q_heads_per_rank, p.num_kv_heads_per_rank) == (2, 1)
    assert p.kv_heads_replicated and not p.latent_replicated and p.attn_tp_source == "--attn-tp-size"
    caches = rules.decide_caches(f, p, "paged")
    assert [(c.name, c.dim, c.num_head) for c in caches] == [("k_cache", 128, 1), ("v_cache", 128, 1)]


def test_tp_that_splits_kv_heads_evenly():
    f = facts(num_attention_heads=32, num_key_value_heads=8)
    p = rules.decide_parallel(f, 4, "x")
    assert (p.num_q_heads_per_rank, p.num_kv_heads_per_rank, p.kv_heads_replicated) == (8, 2, False)


@pytest.mark.parametrize("heads, kv, tp, words", [
    (32, 8, 3, "32 query heads are not divisible by attn_tp_size 3"),
    (24, 6, 4, "6 KV heads are not divisible by attn_tp_size 4"),
    (24, 4, 6, "attn_tp_size 6 is not a multiple of 4 KV heads"),
])
def test_tp_problems(heads, kv, tp, words):
    f = facts(num_attention_heads=heads, num_key_value_heads=kv, hidden_size=heads * 64)
    assert any(words in p for p in rules.tp_problems(f, tp))


def test_mla_heads_per_rank_and_latent_replicated():
    f = facts(**{**MLA, "num_attention_heads": 128, "num_key_value_heads": 128, "hidden_size": 7168})
    assert rules.tp_problems(f, 16) == []
    p = rules.decide_parallel(f, 16, "x")
    assert (p.num_q_heads_per_rank, p.num_kv_heads_per_rank) == (8, 1)
    assert p.latent_replicated and not p.kv_heads_replicated
    caches = rules.decide_caches(f, p, "paged")
    assert [(c.name, c.dim, c.num_head) for c in caches] == [("nope_cache", 512, 1), ("rope_cache", 64, 1)]


def test_legacy_caches_are_cache_unit_rows_and_linear_layers_have_none():
    f = facts()
    p = rules.decide_parallel(f, 2, "x")  # 8 KV heads / 2 = 4 per rank
    legacy = rules.decide_caches(f, p, "legacy")
    assert [(c.name, c.dim, c.num_head) for c in legacy] == [("k_cache", 4 * 64, 1), ("v_cache", 4 * 64, 1)]
    assert rules.decide_caches(f, p, "legacy", layer_kind="linear") == []
    assert rules.decide_caches(f, p, "paged", layer_kind="sliding")[0].num_head == 4


def test_cache_token_bytes():
    caches = [CacheSpec(name="k_cache", dim=128, num_head=8, dtype="bfloat16"),
              CacheSpec(name="v_cache", dim=128, num_head=8, dtype="float32"),
              CacheSpec(name="q", dim=16, num_head=1, dtype="int8")]
    assert rules.cache_token_bytes(caches) == 128 * 8 * 2 + 128 * 8 * 4 + 16


@pytest.mark.parametrize("value, ok", [
    (128, True), (256, True), (384, True), (512, True),
    (16, False), (64, False), (100, False), (640, False), (0, False), (-128, False),
])
def test_block_size(value, ok):
    assert (rules.check_block_size(value) is None) == ok


def test_mla_constraints_and_mtp_decision():
    assert mla_kind.constraints(facts()) == []
    text = " ".join(mla_kind.constraints(facts(**{**MLA, "q_lora_rank": None})))
    assert "num_key_value_heads = 1" in text and "rope D = qk_rope_head_dim = 64" in text
    assert "q_lora_rank is null" in text and "epsilon" in text
    assert rules.decide_mtp(facts()) is None
    mtp = rules.decide_mtp(facts(**MLA, num_nextn_predict_layers=1))
    assert (mtp.num_layers, mtp.decode_sparse_mode, mtp.decode_mask) == (1, 3, "causal_2048")


# ---------------------------------------------------------------- deployment mode priority


def test_deploy_mode_priority_and_losers():
    value, source, evidence, losers = rules.decide_deploy_mode(
        "standalone", "部署模式: 独立部署", "framework", [("framework", "support_models"), ("standalone", "md")])
    assert (value, source) == ("standalone", "dispatch")
    assert "部署模式: 独立部署" in evidence[0]
    assert [(v, s) for v, s, _ in losers] == [("framework", "user"), ("framework", "self_check"),
                                              ("standalone", "self_check")]
    assert rules.decide_deploy_mode(None, None, "standalone", [("framework", "x")])[:2] == ("standalone", "user")
    assert rules.decide_deploy_mode(None, None, None, [("standalone", "runner")])[:2] == ("standalone", "self_check")
    value, source, evidence, losers = rules.decide_deploy_mode(None, None, None, [])
    assert (value, source, losers) == ("framework", "default", [])
    assert "default" in evidence[0]


# ---------------------------------------------------------------- block math (memory.py)


def test_offline_blocks_full_attention():
    # Qwen3-8B-like group: ceil(8192 / 128) = 64 blocks per request, x 4 requests, + 1 null block = 257
    g = kv_cache_spec.FullAttentionSpec("FullAttention", 36, 147456, 128)
    assert g.blocks_offline(8192, 4) == 257
    # a partial last block still costs a block: ceil(8193 / 128) = 65 -> 65 x 4 + 1 = 261
    assert g.blocks_offline(8193, 4) == 261
    plan = memory.plan_offline([g], 8192, 4)
    assert plan.blocks == {"FullAttention": 257} and plan.max_concurrency_at_max_len == 4
    # pool bytes: 257 blocks x 128 tokens x 147456 B = 4850712576
    assert memory.plan_bytes([g], plan.blocks) == 257 * 128 * 147456


def test_offline_with_a_sliding_group_keeps_its_fixed_count():
    # gpt-oss-20b-like: 12 sliding + 12 full layers, each group 12 x (k+v) x 64 x 8 x 2 B = 24576 B/token
    full = kv_cache_spec.FullAttentionSpec("FullAttention", 12, 24576, 128)
    sw = kv_cache_spec.SlidingWindowSpec("SlidingWindow", 12, 24576, 128, window=128)
    plan = memory.plan_offline([full, sw], 4096, 4)
    # full: ceil(4096/128) = 32 x 4 + 1 = 129; sliding: 4 x (ceil(128/128) + 1) + 1 = 9, even offline
    assert plan.blocks == {"FullAttention": 129, "SlidingWindow": 9}


def test_sliding_fixed_blocks_with_next_n():
    # W = 4096, next_n = 1, bs = 128: ceil((4096 + 2) / 128) = 33, + 1 boundary block = 34 per request;
    # 8 requests -> 8 x 34 + 1 null block = 273
    g = kv_cache_spec.SlidingWindowSpec("SlidingWindow", 32, 131072, 128, window=4096, next_n=1)
    assert g.blocks_per_request(10**6) == 34 and g.fixed_blocks(8) == 273


def test_budget_full_attention_only():
    # Qwen3-8B, one rank: 147456 B per token (36 layers x k,v x 128 x 8 x 2 B).
    # budget 10 GiB x 0.9 = 9663676416 B; max_tokens = floor(9663676416 / 147456) = 65536;
    # blocks = floor(65536 / 128) = 512 (block 0 is the null block).
    # requests of 8192 tokens: (512 - 1) // ceil(8192 / 128) = 511 // 64 = 7
    g = kv_cache_spec.FullAttentionSpec("FullAttention", 36, 147456, 128)
    plan = memory.plan_budget([g], 10 * GIB * 0.9, 1, 8192)
    assert plan.max_tokens == 65536
    assert plan.blocks == {"FullAttention": 512}
    assert plan.max_concurrency_at_max_len == 7


def test_budget_with_sliding_group_reserved_first():
    # gpt-oss-20b-like groups (24576 B/token each, block = 24576 x 128 = 3 MiB), budget 1 GiB, 4 requests.
    # sliding fixed: 4 x (ceil(128/128) + 1) + 1 = 9 blocks = 27 MiB = 28311552 B
    # max_tokens = floor((1073741824 - 28311552) / 24576) = floor(42538.67) = 42538
    # full blocks = floor(42538 / 128) = 332
    full = kv_cache_spec.FullAttentionSpec("FullAttention", 12, 24576, 128)
    sw = kv_cache_spec.SlidingWindowSpec("SlidingWindow", 12, 24576, 128, window=128)
    plan = memory.plan_budget([full, sw], GIB, 4, 4096)
    assert plan.blocks == {"SlidingWindow": 9, "FullAttention": 332}
    assert plan.max_tokens == 42538
    # max concurrency at 4096 tokens, sliding reservation growing with it (all in 3 MiB blocks,
    # 1 GiB = 341.33 blocks): sliding takes 2c + 1, full gets floor(341.33 - 2c - 1) = 340 - 2c;
    # need 1 + 32c <= 340 - 2c -> c <= 9.97 -> 9
    assert plan.max_concurrency_at_max_len == 9
    assert memory.max_concurrency_at([full, sw], GIB, 4096) == 9


def test_budget_sliding_only():
    # Mistral-7B-like: 32 sliding layers x k,v x 128 x 8 x 2 B = 131072 B/token, block = 16 MiB.
    # W = 4096 -> ceil(4096/128) + 1 = 33 blocks per request; 2 requests -> 2 x 33 + 1 = 67 blocks.
    # 67 x 16 MiB = 1072 MiB fits in 2 GiB.
    sw = kv_cache_spec.SlidingWindowSpec("SlidingWindow", 32, 131072, 128, window=4096)
    plan = memory.plan_budget([sw], 2 * GIB, 2, 8192)
    assert plan.blocks == {"SlidingWindow": 67} and plan.max_tokens is None
    # 2 GiB = 128 blocks of 16 MiB: 33c + 1 <= 128 -> c = 3
    assert plan.max_concurrency_at_max_len == 3
    # 1 GiB = 64 blocks: 33c + 1 <= 64 -> c = 1; the 67 blocks for 2 requests do not fit at all
    assert memory.max_concurrency_at([sw], GIB, 8192) == 1
    assert memory.plan_budget([sw], GIB, 2, 8192).blocks == {"SlidingWindow": 0}


def test_budget_too_small_for_the_fixed_reservation():
    sw = kv_cache_spec.SlidingWindowSpec("SlidingWindow", 32, 131072, 128, window=4096)
    full = kv_cache_spec.FullAttentionSpec("FullAttention", 4, 16384, 128)
    plan = memory.plan_budget([full, sw], 100 * 2**20, 8, 4096)
    assert plan.blocks == {"FullAttention": 0, "SlidingWindow": 0}
    assert plan.max_concurrency_at_max_len == 0 and plan.max_tokens == 0
    assert any("nothing fits" in line for line in plan.derivation)
