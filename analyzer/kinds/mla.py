"""MLA (a latent row + its rope part per token, shared by every head), analyzer side.

The paged path absorbs kv_b_proj into the query and the output and calls FA over the latent (``nope_cache``) and
the rope part (``rope_cache``), one KV head replicated on every attention-TP rank (references/fa_operators.md,
'MLA absorb 的约束').
"""

from __future__ import annotations

from model_infer_kvcache.analyzer.kinds.gqa import Facts, GqaFormat
from model_infer_kvcache.analyzer.manifest import CacheSpec, Finding, MlaDecision
from model_infer_kvcache.analyzer.operators.fa_facts import (
    MLA_PAGED_LATENT_DIM,
    MLA_PAGED_LATENT_SOURCE,
    MLA_QUERY_HEADS,
    MLA_ROPE_DIM,
)

MLA_LATENT_DIMS = (512, 128)

# MLA families whose attention applies no RoPE to the qk_rope_head_dim part (the config still sizes it).
MLA_WITHOUT_ROPE = {
    "kimi_linear": "transformers KimiLinearAttention splits k_rot from the latent and never rotates it (the "
                   "model builds no rotary embedding)",
}

# MLA families that scale the normalised latent before caching it (and the query before the score) by a factor their
# attention module holds: the module attribute the fused writer's gamma is multiplied by, and where it comes from.
MLA_LATENT_SCALES = {
    "longcat_flash": ("mla_scale_kv_lora",
                      "transformers LongcatFlashMLA.forward: k_pass = kv_a_layernorm(kv_pass) x mla_scale_kv_lora "
                      "((hidden_size / kv_lora_rank)^0.5), q_pass and q_rot x mla_scale_q_lora "
                      "((hidden_size / q_lora_rank)^0.5)"),
}


class MlaFormat(GqaFormat):
    name = "mla"
    latent = True
    hf_projections = (frozenset({"kv_a_proj_with_mqa"}),)  # DeepSeek-V2/V3, Kimi-K2, LongCat
    doc_example = ("MLA(latent cache),含 YaRN 与 MTP", "DeepSeek-V3/R1、Kimi-K2、LongCat-Flash",
                   {"model_type": "deepseek_v3", "num_key_value_heads": 8, "kv_lora_rank": 512, "q_lora_rank": 1536,
                    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "num_nextn_predict_layers": 1,
                    "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                                     "original_max_position_embeddings": 4096}})

    def kv_heads_per_rank(self, facts: Facts, tp: int, decoder_layer: int | None = None) -> int:
        return 1  # the latent is one head, never split by attention TP

    def head_problems(self, facts: Facts) -> list[Finding]:
        mla, out = facts.mla.value, []
        if mla.qk_rope_head_dim != MLA_ROPE_DIM:
            out.append(Finding(message=f"MLA rope dim {mla.qk_rope_head_dim} != {MLA_ROPE_DIM} required by FA",
                               fields=["qk_rope_head_dim"]))
        if mla.kv_lora_rank not in MLA_LATENT_DIMS:
            out.append(Finding(message=f"MLA latent dim {mla.kv_lora_rank} not in {MLA_LATENT_DIMS} (FA MLA query D)",
                               fields=["kv_lora_rank"]))
        elif mla.kv_lora_rank != MLA_PAGED_LATENT_DIM:
            out.append(Finding(message=f"MLA latent dim {mla.kv_lora_rank}: FA takes query D {mla.kv_lora_rank} with "
                                       f"query_rope only without page attention ({MLA_PAGED_LATENT_SOURCE}); the "
                                       f"paged absorb call needs {MLA_PAGED_LATENT_DIM}",
                               fields=["kv_lora_rank"]))
        return out

    def heads_problem(self, facts: Facts, parallel) -> Finding | None:
        """MLA absorb: FA takes MLA_QUERY_HEADS query heads per call (op docs); a rank's share outside them
        cannot run."""
        q = parallel.num_q_heads_per_rank
        if q in MLA_QUERY_HEADS:
            return None
        heads = facts.num_attention_heads.value
        fits = [tp for tp in range(1, heads + 1) if heads % tp == 0 and heads // tp in MLA_QUERY_HEADS]
        return Finding(
            message=f"{q} query heads per rank at attn_tp_size {parallel.attn_tp_size}: MLA's FA call takes "
                    f"{'/'.join(map(str, MLA_QUERY_HEADS))} query heads (npu_fused_infer_attention_score_v2 doc, "
                    "query_rope); " + (f"re-analyze with --attn-tp-size {' / '.join(map(str, fits))} "
                                       f"({' / '.join(str(heads // tp) for tp in fits)} heads per rank)"
                                       if fits else "no attention TP divides the heads into such a count")
                    + " (padding the query heads with zeros is not rendered by this skill)",
            fields=[facts.num_attention_heads.source, "attn_tp_size"],
        )

    def kv_tp_problems(self, facts: Facts, tp: int) -> list[str]:
        return []  # the latent is replicated, whatever the TP

    def attention_kind(self, facts: Facts) -> str:
        return "mla"

    def default_fa_version(self, facts: Facts) -> tuple[str, str, list[str]]:
        return "v2", "MLA default v2 (DeepSeek-R1 reference); v1 also works (Kimi-K2)", [facts.mla.source]

    paged_layout = ("TND_NTD", "MLA absorb: packed query TND, output NTD for the per-head V up-projection")
    scale_label = "(qk_nope_head_dim + qk_rope_head_dim)"
    yarn_scales_softmax = True

    def caches(self, facts: Facts, tp: int, kv_mode: str, dtype: str, decoder_layer: int | None) -> list[CacheSpec]:
        mla = facts.mla.value
        return [CacheSpec(name="nope_cache", dim=mla.kv_lora_rank, num_head=1, dtype=dtype),
                CacheSpec(name="rope_cache", dim=mla.qk_rope_head_dim, num_head=1, dtype=dtype)]

    def mla(self, facts: Facts, kv_mode: str) -> MlaDecision:
        """Absorb on the paged path (latent nope + rope caches, kv_b_proj absorbed into Q and the output)."""
        absorb = kv_mode == "paged"
        if absorb:
            reason = ("MLA: cache the latent (nope) + rope parts, absorb kv_b_proj into Q and the output; "
                      "latent replicated across attention TP")
        else:
            reason = "MLA on the Legacy path: no absorb (the FA absorb call needs the paged latent cache)"
        rope = facts.model_type not in MLA_WITHOUT_ROPE
        if not rope:
            reason += f"; position-free: {MLA_WITHOUT_ROPE[facts.model_type]}, so the rope part is cached and " \
                      "attended unrotated"
        scale = MLA_LATENT_SCALES.get(facts.model_type)
        if scale is not None:
            reason += f"; the latent is scaled after its norm: {scale[1]}, so the writer's gamma is " \
                      f"kv_a_layernorm.weight x the module's {scale[0]} (the query keeps its own scale)"
        return MlaDecision(enabled=True, absorb=absorb, cache_mode="PA_NZ" if absorb else None, rope=rope,
                           latent_scale=scale[0] if scale else None,
                           reason=reason, constraints=constraints(facts, rope) if absorb else [])

    def notes(self, facts: Facts) -> tuple[list[Finding], list[Finding]]:
        warnings, questions = [], []
        if facts.model_type in MLA_WITHOUT_ROPE:
            warnings.append(Finding(
                message=f"MLA without positional encoding: {MLA_WITHOUT_ROPE[facts.model_type]}; the fused MLA "
                        "writer (npu_kv_rmsnorm_rope_cache) rotates the rope part, so the render passes it cos 1 / "
                        "sin 0 (the identity) and leaves the query's rope part unrotated; hand-written code must do "
                        "the same, never the DeepSeek rotary (mla.rope false)",
                fields=["model_type", facts.mla.source]))
        if not facts.rms_norm_eps.value:
            questions.append(Finding(message="no rms_norm_eps in config: take epsilon from the kv_a_layernorm "
                                             "module", fields=["rms_norm_eps"]))
        return warnings, questions


def constraints(facts: Facts, rope: bool = True) -> list[str]:
    """What the MLA absorb path requires of the FA call and the fused writer (references/fa_operators.md,
    'MLA absorb 的约束')."""
    mla = facts.mla.value
    if mla is None:
        return []
    out = [
        "FA call: key = value = nope_cache, query_rope with key_rope = rope_cache (both or neither), "
        "num_key_value_heads = 1",
        f"query D = kv_lora_rank = {mla.kv_lora_rank} (FA accepts {' or '.join(map(str, MLA_LATENT_DIMS))}); "
        f"rope D = qk_rope_head_dim = {mla.qk_rope_head_dim} (FA requires {MLA_ROPE_DIM})",
        "with query D 512 only sparse_mode 0/3/4; decode (q_len 1) uses 0 without mask",
        "PA_NZ writes: view caches 5-D [blocks, 1, D/16, block_size, 16] (32 for int8) before the FA call; "
        "block_size 16 unsupported",
        "npu_kv_rmsnorm_rope_cache epsilon from the kv_a_layernorm module, never a literal",
        f"absorb kv_b_proj: W_UK into the query ({mla.qk_nope_head_dim} -> {mla.kv_lora_rank}), "
        f"W_UV after FA ({mla.kv_lora_rank} -> v_head_dim {mla.v_head_dim})",
    ]
    if mla.q_lora_rank is None:
        out.append("q_lora_rank is null: the query comes from a plain q_proj (no q_a_proj/q_b_proj)")
    if not rope:
        out.append("position-free: npu_kv_rmsnorm_rope_cache gets cos 1 / sin 0 (the identity: it writes k_rot as "
                   "it is) and the query's rope part reaches FA unrotated")
    return out


FORMAT = MlaFormat()
