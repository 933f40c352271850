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
    "dots3_note_text": ("kv_lora_scale",
                        "transformers Dots3NoteTextAttention.forward multiplies the normalized latent by kv_lora_scale "
                        "= (hidden_size / kv_lora_rank)^0.5 (the cached row); its query residual (the indexer's input "
                        "too) is scaled by q_lora_scale = (hidden_size / q_lora_rank)^0.5"),
}

# MLA families whose module RMS-normalizes k_rot before its RoPE (mla.rope_norm: the render normalizes it with the
# module's k_rope_only_layernorm before the writer rotates it).
MLA_ROPE_NORMED = {
    "dots3_note_text": "transformers Dots3NoteTextAttention.forward: k_rot = k_rope_only_layernorm(k_rot) before its "
                       "RoPE",
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

    # the module attributes that size its latent cache row (DeepseekV3Attention, Dots3NoteTextAttention, ...)
    HF_LATENT = ("kv_lora_rank", "qk_rope_head_dim")

    def hf_facts(self, module) -> dict[str, int | None]:
        """An MLA module's latent width and rope part (what its kv_a_proj_with_mqa splits), per layer as built."""
        if getattr(module, "kv_a_proj_with_mqa", None) is None:
            return {}
        return {name: value for name in self.HF_LATENT
                if isinstance(value := getattr(module, name, None), int) and not isinstance(value, bool)}

    def hf_off(self, layer, module_facts: dict[str, int | None], cls: str) -> str | None:
        """Where the layer's latent / rope cache widths differ from the module's kv_lora_rank / qk_rope_head_dim
        (a per-layer override the plan missed); any other format's parts as GQA says them."""
        caches = {c.name: c.dim for c in layer.caches}
        rest = dict(module_facts)
        got = tuple(rest.pop(name, None) for name in self.HF_LATENT)
        planned = (caches.get("nope_cache"), caches.get("rope_cache"))
        if None not in got and got != planned:
            return (f"MLA latent cache (kv_lora_rank + qk_rope_head_dim): analyzer {planned[0]} + {planned[1]} "
                    f"(nope_cache + rope_cache) vs transformers {got[0]} + {got[1]} ({cls}.kv_lora_rank, "
                    f"{cls}.qk_rope_head_dim)")
        return super().hf_off(layer, rest, cls)

    def kv_heads_per_rank(self, facts: Facts, tp: int, decoder_layer: int | None = None) -> int:
        return 1  # the latent is one head, never split by attention TP

    def head_problems(self, facts: Facts) -> list[Finding]:
        """FA's MLA dims (rope 64, latent 512 / 128), per distinct layer shape: a per-layer shape outside them names
        its first layer (Dots3-Note's sliding layers: kv_lora_rank 1024)."""
        out = []
        for mla, layers in _dims_by_layer(facts):
            where, fields = _where(facts, layers, mla == facts.mla.value)
            where += self.dims_note(facts, layers)
            if mla.qk_rope_head_dim != MLA_ROPE_DIM:
                out.append(Finding(message=f"MLA rope dim {mla.qk_rope_head_dim} != {MLA_ROPE_DIM} required by FA"
                                           f"{where}", fields=["qk_rope_head_dim", *fields]))
            if mla.kv_lora_rank not in MLA_LATENT_DIMS:
                out.append(Finding(message=f"MLA latent dim {mla.kv_lora_rank} not in {MLA_LATENT_DIMS} (FA MLA "
                                           f"query D){where}", fields=["kv_lora_rank", *fields]))
            elif mla.kv_lora_rank != MLA_PAGED_LATENT_DIM and self.fa_attends(facts, layers):
                out.append(Finding(message=f"MLA latent dim {mla.kv_lora_rank}: FA takes query D {mla.kv_lora_rank} "
                                           f"with query_rope only without page attention ({MLA_PAGED_LATENT_SOURCE}); "
                                           f"the paged absorb call needs {MLA_PAGED_LATENT_DIM}{where}",
                                   fields=["kv_lora_rank", *fields]))
        return out

    def fa_attends(self, facts: Facts, layers: tuple[int, ...]) -> bool:
        """Whether these layers attend through FA's MLA call (its paged latent rule applies), not another op."""
        return True

    def dims_note(self, facts: Facts, layers: tuple[int, ...]) -> str:
        """What a dims finding adds on these layers (() = every layer): nothing, FA's rule is the op doc's."""
        return ""

    def heads_problem(self, facts: Facts, parallel, layers: tuple[int, ...] | None = None) -> Finding | None:
        """MLA absorb: FA takes MLA_QUERY_HEADS query heads per call (op docs); a rank's share outside them
        cannot run. Per layer where layers differ (``layers``: those FA serves; default all)."""
        tp = parallel.attn_tp_size
        for heads, at in _heads_by_layer(facts, layers):
            q = heads // tp if heads % tp == 0 else heads / tp
            if q in MLA_QUERY_HEADS:
                continue
            where, fields = _where(facts, at, heads == facts.num_attention_heads.value)
            fits = [t for t in range(1, heads + 1) if heads % t == 0 and heads // t in MLA_QUERY_HEADS]
            return Finding(
                message=f"{q:g} query heads per rank at attn_tp_size {tp}{where}: MLA's FA call takes "
                        f"{'/'.join(map(str, MLA_QUERY_HEADS))} query heads (npu_fused_infer_attention_score_v2 doc, "
                        "query_rope); " + (f"re-analyze with --attn-tp-size {' / '.join(map(str, fits))} "
                                           f"({' / '.join(str(heads // t) for t in fits)} heads per rank)"
                                           if fits else "no attention TP divides the heads into such a count")
                        + " (padding the query heads with zeros is not rendered by this skill)",
                fields=[facts.num_attention_heads.source, "attn_tp_size", *fields],
            )
        return None

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
        mla = facts.mla_at(decoder_layer)  # the layer's own latent width where per_layer_config sets one
        return [CacheSpec(name="nope_cache", dim=mla.kv_lora_rank, num_head=1, dtype=dtype),
                CacheSpec(name="rope_cache", dim=mla.qk_rope_head_dim, num_head=1, dtype=dtype)]

    def layer_fields(self, facts: Facts, decoder_layer: int, dtype: str, block_size: int) -> dict:
        """A layer's own MLA dims where per_layer_config sets them (Dots3-Note's sliding layers)."""
        dims = facts.mla_at(decoder_layer)
        return {"mla_dims": dims} if dims != facts.mla.value else {}

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
        rope_norm = MLA_ROPE_NORMED.get(facts.model_type)
        if rope_norm is not None:
            reason += f"; k_rot normalized before its RoPE: {rope_norm}"
        return MlaDecision(enabled=True, absorb=absorb, cache_mode="PA_NZ" if absorb else None, rope=rope,
                           latent_scale=scale[0] if scale else None, rope_norm=True if rope_norm else None,
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
        scale, normed = MLA_LATENT_SCALES.get(facts.model_type), MLA_ROPE_NORMED.get(facts.model_type)
        if scale or normed:
            done = ([f"multiplies npu_kv_rmsnorm_rope_cache's gamma by the module's {scale[0]}"] if scale else []) + \
                   (["normalizes k_rot with k_rope_only_layernorm before it"] if normed else [])
            message = "; ".join(x for x in (scale and scale[1], normed) if x)
            warnings.append(Finding(
                message=f"MLA latent not as the plain fused writer makes it: {message}; the render "
                        f"{' and '.join(done)} (mla.latent_scale / mla.rope_norm); the model keeps its own query "
                        "scale before kv_cache_attention",
                fields=["model_type", facts.mla.source]))
        if not facts.rms_norm_eps.value:
            questions.append(Finding(message="no rms_norm_eps in config: take epsilon from the kv_a_layernorm "
                                             "module", fields=["rms_norm_eps"]))
        return warnings, questions


def _dims_by_layer(facts: Facts) -> list[tuple]:
    """(MLA dims, decoder layers having them), the model's first: one entry where every layer is alike."""
    per_layer = facts.layer_mla.value
    if not per_layer:
        return [(facts.mla.value, ())]
    out: dict = {}
    for i, layer in enumerate(per_layer):
        out.setdefault(layer.dims.model_dump_json(), (layer.dims, []))[1].append(i)
    return sorted(((d, tuple(at)) for d, at in out.values()), key=lambda e: (e[0] != facts.mla.value, e[1]))


def _heads_by_layer(facts: Facts, only: tuple[int, ...] | None) -> list[tuple[int, tuple[int, ...]]]:
    """(query heads, decoder layers having them) over ``only`` (default every layer)."""
    if not facts.layer_mla.value:
        return [(facts.num_attention_heads.value, ())] if only is None or only else []
    out: dict[int, list[int]] = {}
    for i in range(len(facts.layer_mla.value)) if only is None else only:
        out.setdefault(facts.heads_at(i), []).append(i)
    return sorted((h, tuple(at)) for h, at in out.items())


def _where(facts: Facts, layers: tuple[int, ...], model_wide: bool) -> tuple[str, list[str]]:
    """How a finding names a per-layer shape: its layers and per_layer_config (nothing for the model's own)."""
    if not layers or (model_wide and len(layers) == len(facts.layer_kinds.value)):
        return "", []
    more = f" (and {len(layers) - 1} more: {', '.join(map(str, layers[1:4]))}{'...' if len(layers) > 4 else ''})" \
        if len(layers) > 1 else ""
    return f" on layer {layers[0]}{more}", [facts.layer_mla.source]


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
    for dims, layers in _dims_by_layer(facts)[1:]:  # per_layer_config's own shapes: each its entries and calls
        heads = sorted({facts.heads_at(i) for i in layers})
        out.append(f"layers {', '.join(map(str, layers[:4]))}{'...' if len(layers) > 4 else ''} ({len(layers)}, "
                   f"per_layer_config): their own latent {dims.kv_lora_rank} (nope_cache dim, query D) and rope "
                   f"{dims.qk_rope_head_dim}, W_UK {dims.qk_nope_head_dim} -> {dims.kv_lora_rank}, W_UV -> "
                   f"{dims.v_head_dim}, {'/'.join(map(str, heads))} query heads and scale "
                   f"{dims.qk_nope_head_dim + dims.qk_rope_head_dim}^-0.5 in their entries, writes and FA call")
    return out


FORMAT = MlaFormat()
