"""Decision rules: one pure function per decision, facts in, value + reason (+ evidence) out.

Nothing here reads files or flags; ``analyzer.build`` gathers the facts and calls these.
The tables in SKILL.md / references/ are generated from or checked against this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from model_infer_kvcache.analyzer.config_loader import ModelFacts, yarn_mscale
from model_infer_kvcache.analyzer.kinds.formats import format_of
from model_infer_kvcache.analyzer.kv_cache_spec import (
    DTYPE_BYTES,
    is_windowed,
    spec_for_layer_kind,
    token_bytes,
)
from model_infer_kvcache.analyzer.linear_config import (
    CCA,
    GATED_DELTA_NET,
    KIMI_DELTA,
    LIGHTNING,
    MAMBA,
    MAMBA2,
    MLSTM,
    RG_LRU,
    RWKV,
    SHORT_CONV,
    attends,
    holds_state,
)
from model_infer_kvcache.analyzer.manifest import (
    CacheDtypeDecision,
    CacheSpec,
    ExecModeDecision,
    Finding,
    LegacyAttention,
    LinearAttentionDecision,
    MaskPerPath,
    MlaDecision,
    MtpDecision,
    ParallelPlan,
    PerPath,
    StateSpec,
)
from model_infer_kvcache.analyzer.operators.fa_facts import (
    INT32_MAX,
    VALID_BLOCK_SIZES,
)
from model_infer_kvcache.analyzer.operators.gdr_facts import RECURRENT_MAX_LEN, chunk_misfit

DEFAULT_BLOCK_SIZE = 128
STATE_DTYPE_BYTES = {**DTYPE_BYTES, "int32": 4}  # a state entry may be an index (the speculative anchor)
SPEC_ANCHOR = "state_anchor"  # the speculative state slots' anchor entry (one int32 per request's first block)

# Softmax-scale rule of every family whose transformers attention code these rules were read from
# (`self.scaling = ...` in modeling_<family>.py); MLA families add YaRN mscale² on top of head_dim.
# A family missing here is unknown: its position encoding and attention variants are unverified.
FAMILY_SCALE_RULE = {
    **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "qwen3_next", "qwen3_5", "gpt_oss", "llama4", "glm4", "glm4_moe",
                     "phi3", "phimoe", "falcon", "deepseek_v2", "deepseek_v3", "longcat_flash",
                     "deepseek_v4",
                     # NemotronHAttention.scaling = head_dim**-0.5 (no RoPE: the block attends position-free)
                     "nemotron_h"), "head_dim"),
    "gemma2": "query_pre_attn_scalar",
    "gemma3": "query_pre_attn_scalar",
    "granite": "attention_multiplier",
    # Gemma-4: q and k are RMS-normalised per head (q_norm / k_norm) and the scores are not scaled
    # (transformers' Gemma4TextAttention.scaling = 1.0)
    **dict.fromkeys(("gemma4", "gemma4_text"), "unit"),
    # Gemma-3n: the same (transformers' Gemma3nTextAttention.scaling = 1.0, q_norm / k_norm / v_norm)
    "gemma3n": "unit",
    # OPT: the module scales its queries itself (q_proj(x) * self.scaling) and calls attention with scaling=1.0,
    # so the attention call over its queries scales by 1
    # Whisper: the same in self- and cross-attention (WhisperAttention: q_proj(x) * self.scaling, scaling=1.0)
    **dict.fromkeys(("opt", "whisper"), "prescaled"),
    # GPT-Neo: its own _attn scores matmul(query, key^T) with no 1/sqrt(head_dim) (transformers GPTNeoSelfAttention)
    "gpt_neo": "unscaled",
    # XLM (causal true: its CLM checkpoints): MultiHeadAttention divides q by math.sqrt(self.head_dim) and scores
    # itself; learned absolute positions (a sinusoidal table only initialises them) and language embeddings are added
    # before the first layer, no bias on the scores (modeling_xlm.py)
    "xlm": "head_dim",
    # Zamba / Zamba2: ZambaAttention.scaling / Zamba2Attention.scaling = (head_dim / 2) ** -0.5, the head spanning
    # concat(hidden, embeddings)
    **dict.fromkeys(("zamba", "zamba2"), "half_head_dim"),
    # RecurrentGemma's attention blocks: RecurrentGemmaAttention.scaling = head_dim**-0.5, no bias on the scores, no
    # soft-cap there (logits_soft_cap caps the final logits, RecurrentGemmaForCausalLM); partial rotary
    # (rope_parameters' partial_rotary_factor) applied by the module to q / k before the cache
    "recurrent_gemma": "head_dim",
    # DiffLlama: DiffLlamaAttention.scaling = head_dim**-0.5 in both of its attention calls, RoPE on q / k before the
    # cache, no bias or soft-cap on the scores; its two calls over V's halves are the differential kind
    # (analyzer/kinds/diff.py)
    "diffllama": "head_dim",
}


@dataclass(frozen=True)
class Decision:
    value: object
    reason: str
    evidence: list[str] = field(default_factory=list)
    is_default: bool = False


# ---------------------------------------------------------------- blockers and KV mode


def find_blockers(facts: ModelFacts, block_size: int = DEFAULT_BLOCK_SIZE) -> list[Finding]:
    """Config facts that make the standard Paged + FA path impossible (SKILL.md, '第一层:快速选型')."""
    out: list[Finding] = []
    if facts.attn_logit_softcapping.value is not None:
        out.append(Finding(
            message=f"attention logit soft-capping ({facts.attn_logit_softcapping.value}) has no FA equivalent",
            fields=[facts.attn_logit_softcapping.source],
        ))
    if facts.alibi.value:
        out.append(Finding(
            message="ALiBi position bias: the TND/paged FA path takes no pse_shift",
            fields=[facts.alibi.source],
        ))
    kinds = facts.layer_kinds.value
    chunk = facts.attention_chunk_size.value
    if "chunked" in kinds and chunk is not None and chunk % block_size:
        # The paged path reads a chunk through the block table shifted by chunk_start // block_size: a chunk start
        # inside a block has no block-table expression (FA's pre_tokens band is one value for the whole batch).
        out.append(Finding(
            message=f"chunked local attention on {kinds.count('chunked')} layers: attention_chunk_size {chunk} is "
                    f"not a multiple of block_size {block_size}, so a chunk starts inside a block and the decode "
                    "step cannot read it through a shifted block table (choose a block size dividing the chunk)",
            fields=[facts.attention_chunk_size.source, "--block-size"],
        ))
    if "chunked" in kinds and "sliding" in kinds:
        # both would register in the framework's one SlidingWindow manager, whose window is one value
        out.append(Finding(
            message="chunked and sliding-window layers in one model: both are kept by the framework's SlidingWindow "
                    "manager, which holds one window",
            fields=[facts.layer_kinds.source],
        ))
    if "linear" in kinds and facts.linear.value is None:
        # A known family plans its states (decide_linear); an unknown one has no state shapes to plan.
        out.append(Finding(
            message=f"{kinds.count('linear')} linear-attention/recurrent layers of an unknown family "
                    f"({facts.linear.source}): kvcache cannot plan their state (known: {KNOWN_LINEAR})",
            fields=[facts.layer_kinds.source],
        ))
    out += format_of(facts).head_problems(facts)
    return out


def decide_kv_mode(blockers: list[Finding], starting_point: list[str], requested: str | None = None) -> Decision:
    evidence = [f"progress.md starting point: {s}" for s in starting_point]
    if requested == "legacy" and not blockers:
        return Decision("legacy", "Legacy kept on the user's request (--kv-mode legacy): offline only; online "
                                  "serving, PD disaggregation and dataset evaluation need Paged", evidence + ["--kv-mode"])
    if blockers:
        reason = "Legacy kept: " + "; ".join(b.message for b in blockers)
        return Decision("legacy", reason, evidence + [f for b in blockers for f in b.fields])
    return Decision(
        "paged",
        "Paged is the target: online serving, PD disaggregation and dataset evaluation need it; no blocker found",
        evidence,
        is_default=True,
    )


def decide_legacy_attention(facts: ModelFacts, kv_mode: str, blockers: list[Finding]) -> LegacyAttention | None:
    """How the Legacy path attends (SKILL.md, '第一层:快速选型': Legacy keeps the model's own attention).

    Every blocker is something the FA path cannot express (soft-capping, ALiBi, a head_dim or head ratio FA
    refuses, chunk boundaries, recurrent layers): with one, the render keeps the model's own eager attention
    over the contiguous cache (the soft-cap and window applied there); an FA call would silently drop it.
    Without a blocker (Legacy on the user's request) one BSH FA call computes the same attention.
    """
    if kv_mode != "legacy":
        return None
    softcap = facts.attn_logit_softcapping.value
    # chunked local attention is planned paged (no blocker), but Legacy's one BSH FA call has one band for the batch
    chunked = ["chunked local attention on {} layers: a chunk start jumps by attention_chunk_size, which the one "
               "pre_tokens band of a BSH FA call cannot follow".format(facts.layer_kinds.value.count("chunked"))] \
        if "chunked" in facts.layer_kinds.value else []
    if not blockers and not chunked:
        return LegacyAttention(kernel="fa", reason="no blocker: FA expresses the model's attention, one BSH FA "
                                                   "call over the contiguous cache")
    terms = []
    if softcap is not None:
        terms.append(f"soft-cap tanh(scores / {softcap:g}) * {softcap:g}")
    if facts.alibi.value:
        terms.append("ALiBi bias")
    return LegacyAttention(
        kernel="model", softcap=softcap, alibi=bool(facts.alibi.value),
        reason="FA cannot express this attention (" + "; ".join([b.message for b in blockers] + chunked) + "): the Legacy "
               "path keeps the model's own eager attention over the contiguous cache (scores x scale"
               + "".join(f", {t}" for t in terms) + ", causal and window mask, softmax, x V); no FA call")


# ---------------------------------------------------------------- per-layer attention


def decide_attn_type(kind: str) -> str:
    """Framework attn_type of one layer kind (blocked kinds never reach the paged path)."""
    return spec_for_layer_kind(kind).attn_type


def full_context_window(window: int | None, max_positions: int | None) -> str | None:
    """Why a sliding window is plain full attention (None when it is not).

    A query at position q sees keys k > q - W; with q < max_position_embeddings <= W that is every
    key from 0, so the band never excludes anything and FullAttention is exact (no device reading).
    """
    if window is None or max_positions is None or window < max_positions:
        return None
    return (f"sliding_window {window} >= max_position_embeddings {max_positions}: every query sees all earlier "
            "keys, so the layer is full attention (exact)")


def planned_layer_kind(kind: str, window: int | None, max_positions: int | None) -> tuple[str, int | None, str | None]:
    """(kind, window, reason) a config layer is planned as: the one definition of "decided from this config".

    The analyzer plans each layer with it, and validate re-derives the plan from the config with it
    before comparing with a manifest (a full-context window is planned as full attention, not refused).
    """
    reason = full_context_window(window, max_positions) if kind == "sliding" else None
    if reason:
        return "full", None, reason
    return kind, (window if kind == "sliding" else None), None


def unknown_family(facts: ModelFacts, transformers_ships: bool | None, cross_checked: bool = True,
                   unread: list[str] | None = None) -> Finding | None:
    """A warning when the family's attention code was never read: the config alone cannot rule out
    position biases (ALiBi lives in modeling code, e.g. Baichuan2-13B) or other attention variants.
    ``cross_checked``: whether the cross-check compared any layer (False: transformers ships the type but its own
    code did not build this config, so nothing was compared). ``unread``: the compared modules whose score the
    cross-check could not read whole (arch_check.unread_score; None: no cross-check ran). Read by hand
    (FAMILY_SCALE_RULE) or by the cross-check (transformers' modules compared, every attention call read: its scale,
    window and sinks compared, no other score term), a family is known."""
    if facts.family in FAMILY_SCALE_RULE or not facts.attends:  # a pure state stack has no attention to read
        return None
    if transformers_ships and cross_checked and unread == []:
        return None
    unverified = ["a custom softmax scale", "extra attention terms (soft-capping, sinks, biases)"]
    if facts.alibi.is_default:
        unverified.insert(0, "ALiBi / position biases (the config has no alibi or position_embedding_type field)")
    if transformers_ships is False:
        where = "transformers does not ship it, so nothing was cross-checked against its code"
    elif transformers_ships and not cross_checked:
        where = "transformers ships it but did not build this config, so nothing was cross-checked against its code"
    elif transformers_ships and unread:
        where = (f"scale, windows, KV shapes and sinks were cross-checked against transformers on the meta device, "
                 f"but {unread[0]}" + (f" (and {len(unread) - 1} more module(s))" if len(unread) > 1 else ""))
    elif transformers_ships:
        where = "scale and windows were cross-checked against transformers on the meta device, nothing else"
    else:
        where = "transformers is not installed, so nothing was cross-checked"
    return Finding(
        message=f"unknown model family {facts.model_type!r} ({where}): the config alone cannot rule out "
                f"{'; '.join(unverified)}; read the model's attention code before trusting 'no blocker found'",
        fields=["model_type"],
    )


def decide_window_tokens(window: int | None, reading: str = "exclusive") -> tuple[int, int, str | None]:
    """FA ``pre_tokens`` / ``next_tokens`` for a layer, and the derivation.

    Hugging Face lets a query see W keys including itself (``kv_idx > q_idx - W``). Under the
    documented band rule (``i' - pre_tokens <= j <= i'``, reading "exclusive") that is
    ``pre_tokens = W - 1``; if the device counts the query inside pre_tokens (reading
    "inclusive"), it is ``W``. Validated by measurement against transformers (validators).
    """
    if window is None:
        return INT32_MAX, 0, None
    if reading == "inclusive":
        return window, 0, (f"HF window W={window} sees W keys incl. the query; device reading 'inclusive' "
                           f"(pre_tokens counts the query) -> pre_tokens = W = {window}")
    return window - 1, 0, (f"HF window W={window} sees W keys incl. the query (kv_idx > q_idx - W); band rule "
                           f"i'-pre_tokens <= j <= i' (reading 'exclusive') -> pre_tokens = W-1 = {window - 1}")


def decide_sparse(attn_type: str, is_mla: bool, kv_mode: str) -> tuple[PerPath, MaskPerPath, str]:
    """sparse_mode and mask per path (references/fa_operators.md, 'sparse_mode 与 atten_mask').

    A sliding layer needs the band (4 + pre_tokens) whatever the KV mode: any other mode lets the
    query see keys outside the window, silently, once the sequence outgrows it.
    """
    if is_windowed(attn_type):
        return (PerPath(prefill=4, decode=4), MaskPerPath(prefill="causal_2048", decode="causal_2048"),
                "sliding layer: band 4 with pre_tokens on prefill and decode (0 would see outside the window)")
    if kv_mode == "legacy":
        return (PerPath(prefill=3, decode=0), MaskPerPath(prefill="causal_2048", decode="none"),
                "Legacy BSH: causal prefill (3 + 2048 mask); q_len 1 decode needs no mask (0)")
    if is_mla:
        return (PerPath(prefill=3, decode=0), MaskPerPath(prefill="causal_2048", decode="none"),
                "MLA absorb: prefill 3 + causal mask; decode 0 without mask (3 at decode deviates)")
    return (PerPath(prefill=3, decode=3), MaskPerPath(prefill="causal_2048", decode="causal_2048"),
            "standard TND paged: right-down causal 3 + 2048 mask on prefill and decode")


def decide_write_op(kv_mode: str, is_mla: bool) -> str:
    if kv_mode == "legacy":
        return "scatter_update_"
    return "npu_kv_rmsnorm_rope_cache" if is_mla else "npu_scatter_nd_update_"


# ---------------------------------------------------------------- FA operator


def decide_fa_version(facts: ModelFacts, requested: str | None = None, checkout_version: str | None = None,
                      checkout_evidence: str = "") -> Decision:
    """Sinks force v2; then the user's request; then the version the checkout's own model file already
    calls (``--framework-root``: ``checkout_version`` with ``checkout_evidence`` naming file:line), so the
    design and the file it edits agree; else the family default."""
    if facts.has_sinks.value:
        if requested == "v1":
            return Decision("v2", "learnable sinks exist only on FA v2 (requested v1 refused)",
                            [facts.has_sinks.source])
        return Decision("v2", "learnable sinks require FA v2 (learnable_sink)", [facts.has_sinks.source])
    if facts.v_head_dim.value is not None:
        # v1's TND section: "N等于8/16/32/64/128, 且Q_N、K_N、V_N相等" (2.14.0 _op_plugin_docs.py:8195): no GQA there
        why = ("value heads narrower than key heads take the packed layout, where FA v1 requires Q_N = K_N = V_N "
               "(torch_npu 2.14.0 _op_plugin_docs.py:8195) and v2 takes GQA (:8731)")
        return Decision("v2", why + (" (requested v1 refused)" if requested == "v1" else ""),
                        [facts.v_head_dim.source])
    if requested:
        return Decision(requested, f"requested {requested} by the user", ["--fa-version"])
    if checkout_version:  # a preference, not a requirement: either version computes the same attention
        return Decision(checkout_version, f"{checkout_evidence} (--framework-root)", ["--framework-root"],
                        is_default=True)
    unsettled = f"; --framework-root did not settle it ({checkout_evidence})" if checkout_evidence else ""
    version, reason, evidence = format_of(facts).default_fa_version(facts)
    return Decision(version, reason + unsettled, evidence, is_default=True)


def decide_input_layout(facts: ModelFacts, kv_mode: str) -> Decision:
    if kv_mode == "legacy":
        return Decision("BSH", "Legacy contiguous cache [batch, seq, heads*dim]")
    return Decision(*format_of(facts).paged_layout)


def decide_scale(facts: ModelFacts, decoder_layer: int | None = None) -> tuple[float, str]:
    """Softmax scale with its derivation, by the family's own rule (FAMILY_SCALE_RULE): a config
    multiplier (Granite ``attention_multiplier``), ``query_pre_attn_scalar^-0.5`` (Gemma 2/3), else
    ``head_dim^-0.5``; on MLA, YaRN mscale² on top when mscale_all_dim is set. Unknown families follow
    whichever of those fields the config carries. ``decoder_layer``: that layer's, where its MLA head differs
    (per_layer_config)."""
    rule = FAMILY_SCALE_RULE.get(facts.family)
    qpas = facts.query_pre_attn_scalar.value
    multiplier = facts.attention_multiplier
    if not facts.attends:
        return 1.0, "1 (no layer attends: a pure state stack has no softmax; not used)"
    if rule == "unit":
        base, base_txt = 1.0, f"1 (model family {facts.family}: q/k RMS-normalised per head, scores not scaled)"
    elif rule == "unscaled":
        base, base_txt = 1.0, (f"1 (model family {facts.family}: the module scores q k^T unscaled, no 1/sqrt(head_dim) "
                               "in its own score code)")
    elif rule == "prescaled":
        # no "D^-0.5" in the text: the manifest checks a scale against the head_dim^-0.5 its derivation states
        base, base_txt = 1.0, (f"1 (model family {facts.family}: queries pre-scaled in the module, q_proj(x) x "
                               f"1/sqrt(head_dim {facts.head_dim.value}), attention called with scaling=1.0; a port "
                               "that drops the pre-scale passes 1/sqrt(head_dim) instead)")
    elif rule == "half_head_dim":
        half = facts.head_dim.value / 2
        base, base_txt = half ** -0.5, (f"(head_dim / 2)^-0.5 = {half:g}^-0.5 (model family {facts.family}: the "
                                        f"head of {facts.head_dim.value} spans concat(hidden, embeddings))")
    elif multiplier.value is not None and rule in ("attention_multiplier", None):
        base, base_txt = multiplier.value, f"attention_multiplier = {multiplier.value:g} ({multiplier.source})"
    elif qpas and rule in ("query_pre_attn_scalar", None):
        base, base_txt = qpas ** -0.5, f"query_pre_attn_scalar^-0.5 = {qpas:g}^-0.5"
    else:
        d = facts.qk_head_dim_at(decoder_layer)
        base, base_txt = d ** -0.5, f"{format_of(facts).scale_label}^-0.5 = {d}^-0.5"
    rope = facts.rope.value
    # transformers' yarn_apply_mscale: any rope_type but "default" with mscale_all_dim. Every family that calls it is
    # MLA; elsewhere (Ministral 3) YaRN's attention factor scales cos/sin in the model's RoPE, not the softmax.
    if format_of(facts).yarn_scales_softmax and rope.rope_type != "default" and rope.mscale_all_dim:
        m = yarn_mscale(rope.factor, rope.mscale_all_dim)
        if m != 1.0:
            return base * m * m, (
                f"{base_txt} x mscale^2, mscale = 0.1 x mscale_all_dim({rope.mscale_all_dim:g}) x "
                f"ln(factor {rope.factor:g}) + 1 = {m:.6f} ({facts.rope.source})"
            )
    return base, base_txt


# ---------------------------------------------------------------- parallel and caches


def decide_parallel(facts: ModelFacts, tp: int, tp_source: str) -> ParallelPlan:
    heads, kv = facts.num_attention_heads.value, facts.num_key_value_heads.value
    latent = format_of(facts).latent
    return ParallelPlan(
        attn_tp_size=tp,
        attn_tp_source=tp_source,
        num_q_heads_per_rank=heads // tp,
        num_kv_heads_per_rank=kv_heads_per_rank(facts, tp),
        kv_heads_replicated=not latent and kv < tp,
        latent_replicated=latent,
    )


def kv_heads_per_rank(facts: ModelFacts, tp: int, decoder_layer: int | None = None) -> int:
    """KV heads one rank holds for a layer (the model's count where layers are alike): split by attention TP,
    replicated when there are fewer KV heads than ranks; MLA's latent is one head."""
    return format_of(facts).kv_heads_per_rank(facts, tp, decoder_layer)


def heads_problem(facts: ModelFacts, parallel: ParallelPlan) -> Finding | None:
    """Whether the attention call takes a rank's query heads: FA's query/KV head ratio (GQA), MLA's query-head
    counts; DSA's sparse FA has neither rule."""
    return format_of(facts).heads_problem(facts, parallel)


def tp_problems(facts: ModelFacts, tp: int) -> list[str]:
    """Why ``tp`` cannot split this model's attention (empty when it can)."""
    heads = facts.num_attention_heads.value
    out = []
    if heads % tp:
        out.append(f"{heads} query heads are not divisible by attn_tp_size {tp}")
    out += format_of(facts).kv_tp_problems(facts, tp)
    lin = facts.linear.value
    if lin and lin.family == SHORT_CONV:
        # a depthwise conv: each rank convolves its share of the hidden channels (as in_proj's columns split)
        if lin.conv_channels % tp:
            out.append(f"{lin.conv_channels} short-conv channels (hidden_size) are not divisible by attn_tp_size {tp}")
    elif lin:
        # Linear layers split their heads (and so their state) by attention TP like any head; Mamba's B/C groups
        # may be replicated instead (LinearFacts.k_heads_per_rank).
        if not lin.k_heads_split_by(tp):
            out.append(f"{lin.num_k_heads} linear-attention key heads are not divisible by attn_tp_size {tp}")
        if lin.num_v_heads % tp:
            out.append(f"{lin.num_v_heads} linear-attention value heads are not divisible by attn_tp_size {tp}")
    return out


def decide_caches(facts: ModelFacts, parallel: ParallelPlan, kv_mode: str, layer_kind: str = "full",
                  dtype: str | None = None, decoder_layer: int | None = None) -> list[CacheSpec]:
    """KV cache entries of one layer (references/framework.md, 'cache_entries(每个 attention 层)'); per rank, in the
    model dtype (``dtype``: the one --cache-dtype asked for instead).

    Linear-attention layers keep a fixed-size recurrent state, not a per-token KV cache: no entries. A DSA layer
    that runs its indexer (``decoder_layer`` in the config's indexer layers) adds the indexer key cache.
    """
    if layer_kind == "linear" or facts.kv_source_at(decoder_layer) is not None:
        # a KV-shared layer reads its source layer's cache (ModelFacts.kv_sources): no entries of its own
        return []
    return format_of(facts).caches(facts, parallel.attn_tp_size, kv_mode, dtype or facts.dtype.value, decoder_layer)


# The linear families kvcache plans, as the unknown-family blocker names them
KNOWN_LINEAR = ("gated delta net (Qwen3-Next, Qwen3.5, LaraMini, OLMo-Hybrid), Kimi delta attention (Kimi-Linear, "
                "Ling-3.0), lightning attention (Ling-2.5, MiniMax), Mamba-2, Mamba-1, short conv (LFM2)")


# The linear families' operators: what computes the recurrence on the NPU (or the pure-torch path upstream uses).
LINEAR_OPERATORS = {
    GATED_DELTA_NET: {"prefill": "torch_npu.npu_chunk_gated_delta_rule (2.14.0; else the model's torch chunk loop)",
                      "decode": "torch_npu.npu_recurrent_gated_delta_rule (state updated in place through "
                                "ssm_state_indices)",
                      "conv": "causal conv1d over [conv state | new inputs]; the state keeps the last kernel-1 inputs"},
    KIMI_DELTA: {"prefill": "the model's torch chunk_kimi_delta_attention (no torch-npu KDA operator)",
                 "decode": "the model's torch recurrent_kimi_delta_attention",
                 "conv": "causal conv1d over [conv state | new inputs]; the state keeps the last kernel-1 inputs"},
    LIGHTNING: {"prefill": "the model's torch chunk simple-GLA (upstream bailing_2_5 simple_gla_torch.py)",
                "decode": "the model's torch fused-recurrent simple-GLA"},
    # torch_npu 2.9.0 / 2.14.0 schemas have no selective-scan / SSD operator (npu_fused_causal_conv1d is the conv only)
    MAMBA2: {"prefill": "torch SSD recurrence (no torch-npu selective-scan operator in the pinned releases)",
             "decode": "torch SSD recurrence, one token per step (mamba2_selective_state_update's arithmetic)",
             "conv": "causal conv1d over [conv state | new x|B|C inputs]; the state keeps the last kernel-1 inputs"},
    MAMBA: {"prefill": "torch selective-scan recurrence (no torch-npu selective-scan operator in the pinned releases)",
            "decode": "torch selective-scan recurrence, one token per step (selective_state_update's arithmetic)",
            "conv": "causal conv1d over [conv state | new inner-channel inputs]; the state keeps the last kernel-1 "
                    "inputs"},
    # LFM2's layer has no recurrence: the conv is all it keeps. torch_npu 2.14.0's npu_fused_causal_conv1d takes a
    # width-3 conv without bias or activation over [.., K-1, dim] states (dim % 128 == 0, Ascend 950 only, bias and
    # activation "not yet supported"): LFM2's conv_L_cache 3 fits it, LFM3's 7 does not, so the render convolves in
    # torch for every width
    SHORT_CONV: {"prefill": "none: no recurrence (in_proj, B*x, the conv, C*, out_proj; the conv state is the only "
                            "state)",
                 "decode": "none: no recurrence",
                 "conv": "depthwise causal conv1d of width conv_L_cache, no activation, over [conv state | new B*x "
                         "inputs] in torch; the state keeps the last kernel-1 inputs (torch_npu 2.14.0 "
                         "npu_fused_causal_conv1d takes width 3 only, on Ascend 950, states [K-1, dim])"},
    # RWKV-4's wkv (per channel: num, den and a running max exponent). No pinned release has an operator for it:
    # torch_npu 2.14.0 and 2.9.0 (_op_plugin_docs.py, npu_native_functions_by_codegen.yaml, _meta_registrations.py)
    # name no rwkv / wkv / time-mix operator; the recurrent ones there are npu_recurrent_gated_delta_rule (a delta
    # rule over a [Dv, Dk] matrix state, not a max-stabilised per-channel exp ratio) and the Mamba-free conv
    # xLSTM's mLSTM: exponential input gate, sigmoid forget gate (log space), normaliser n and max-state m. The pinned
    # releases' recurrent operator, npu_recurrent_gated_delta_rule, is a delta rule (state - beta k (k^T state)) with no
    # normaliser or max-state: it does not compute this update; no op doc names an mLSTM / xLSTM operator
    MLSTM: {"prefill": "torch mLSTM recurrence, token by token from C 0, n 0, m 0 (xLSTM's native step kernel's "
                       "arithmetic, float32 state); no torch_npu 2.14.0 / 2.9.0 operator computes it (their op docs "
                       "name no mlstm / xlstm operator; npu_recurrent_gated_delta_rule is a delta rule without the "
                       "normalizer and max-state)",
            "decode": "torch mLSTM recurrence, one token per step from the request's state"},
    # RecurrentGemma's RG-LRU: h <- a h + sqrt(1 - a^2) (i x) per channel, a = exp(-8 r softplus(Lambda)). Searched
    # the pinned op docs and schemas (torch_npu 2.14.0 / 2.9.0: _op_plugin_docs.py, op-plugin yaml, docs) for lru /
    # rglru / griffin / linear recurrence / scan: nothing; npu_recurrent_gated_delta_rule is a delta rule over a
    # [Dv, Dk] matrix state (state - beta k (k^T state)), not a per-channel diagonal recurrence with its input
    # normalisation and its reset. The conv has a bias, which npu_fused_causal_conv1d does not support (2.14.0 docs:
    # bias "not yet supported", width 3, Ascend 950 only); RecurrentGemma's conv1d_width is 4 by default.
    RG_LRU: {"prefill": "torch RG-LRU recurrence, token by token from a zero state, the first token reset (a = 0, "
                        "no sqrt(1 - a^2) normalisation: position 0, as RecurrentGemmaRglru resets), float32 state; "
                        "no torch_npu 2.14.0 / 2.9.0 operator computes it (their op docs name no lru / rglru / "
                        "linear-recurrence operator; npu_recurrent_gated_delta_rule is a delta rule over a matrix "
                        "state)",
             "decode": "torch RG-LRU recurrence, one token per step from the request's state (a h + sqrt(1 - a^2) "
                       "(i x))",
             "conv": "depthwise causal conv1d of width conv1d_width with bias, no activation, over [conv state | "
                     "new linear_x inputs] in torch; the state keeps the last kernel-1 inputs (torch_npu 2.14.0 "
                     "npu_fused_causal_conv1d takes width 3 without bias only, on Ascend 950)"},
    RWKV: {"prefill": "torch wkv recurrence, token by token from a zero state (num 0, den 0, max -1e38: "
                      "rwkv_linear_attention_cpu's arithmetic in float32); no torch_npu 2.14.0 / 2.9.0 operator "
                      "computes RWKV's wkv (their op docs and schemas name no rwkv / wkv operator)",
           "decode": "torch wkv recurrence, one token per step from the request's state",
           "conv": "token shift: each mix reads [shift state | new inputs] shifted by one token (time_shift); the "
                   "state keeps the last time-mix and channel-mix inputs"},
    # ZAYA's CCA projection: two stacked convs with bias (depthwise width cca_time0, grouped per head width
    # cca_time1), which npu_fused_causal_conv1d does not take (2.14.0 docs: depthwise, width 3, bias "not yet
    # supported", Ascend 950 only); the delayed value is a copy, no recurrence
    CCA: {"prefill": "none: no recurrence (the delayed value of each token is the previous token's v_proj_delayed "
                     "output, v_proj_delayed(0) before the first)",
          "decode": "none: the request's recurrent_state is the previous token's v_proj_delayed output",
          "conv": "depthwise conv1d (width cca_time0) then grouped conv1d (width cca_time1, one group per head), both "
                  "with bias, over [conv state | new q|k inputs] in torch; the state keeps the last t0 + t1 - 2 "
                  "inputs (torch_npu 2.14.0 npu_fused_causal_conv1d is depthwise, width 3, without bias, on "
                  "Ascend 950 only)"},
}


def linear_operators(lin, tp: int) -> dict[str, str]:
    """The family's operators; a gated delta net whose per-rank sizes npu_chunk_gated_delta_rule does not take
    (OLMo-Hybrid's Dk 96 / Dv 192) prefills through npu_recurrent_gated_delta_rule, L_i <= 8 tokens per call."""
    ops = LINEAR_OPERATORS[lin.family]
    if lin.family != GATED_DELTA_NET:
        return ops
    misfit = chunk_misfit(lin.k_heads_per_rank(tp), lin.num_v_heads // tp, lin.head_k_dim, lin.head_v_dim)
    if misfit is None:
        return ops
    return {**ops, "prefill": f"torch_npu.npu_recurrent_gated_delta_rule in windows of {RECURRENT_MAX_LEN} tokens "
                              f"per request from a zeroed state block ({misfit})"}


def linear_states(facts: ModelFacts, tp: int, dtype: str | None = None, next_n: int = 0) -> list[StateSpec]:
    """One linear layer's state entries on one rank (empty without linear layers).

    The conv state keeps ``kernel - 1`` inputs: the convolution of a new token reads exactly the previous
    ``kernel - 1`` (transformers and upstream qwen3_5 keep ``kernel`` columns, the oldest never read). The
    recurrent state is laid out as the code that updates it takes it: gated delta net ``[Nv, Dv, Dk]``
    (npu_recurrent_gated_delta_rule, bfloat16 only), KDA / lightning ``[H, Dk, Dv]`` (their torch recurrences).
    ``next_n`` > 0 (speculative decoding): one more entry, the anchor (decide_linear's ``speculative``).
    """
    lin = facts.linear.value
    if lin is None:
        return []
    dtype = dtype or facts.dtype.value
    dtype = dtype if dtype in ("bfloat16", "float16", "float32") else facts.dtype.value
    nv = lin.num_v_heads // tp
    out = []
    if lin.family == RWKV:
        return _rwkv_states(lin, tp, dtype)
    if lin.family == RG_LRU:
        # RecurrentGemmaRecurrentBlock keeps conv1d_state in the input's dtype and the RG-LRU's recurrent_states in
        # float32 (_setup_cache: "recurrent_states always computed in full precision")
        return [StateSpec(name="conv_state", shape=[lin.conv_channels_per_rank(tp), lin.conv_kernel - 1],
                          dtype=dtype, layout="[lru_width channels of this rank, kernel - 1 previous linear_x "
                                              "inputs] (transformers' conv1d_state)"),
                StateSpec(name="recurrent_state", shape=[nv], dtype="float32",
                          layout="[lru_width channels of this rank]: the RG-LRU's h (transformers' "
                                 "rg_lru.recurrent_states)")]
    if lin.family == CCA:
        # transformers keeps both in the model's dtype (update_conv_state / update_recurrent_state of its tensors)
        return [StateSpec(name="conv_state", shape=[lin.conv_channels_per_rank(tp), lin.conv_kernel - 1],
                          dtype=dtype, layout="[q|k conv channels of this rank (its query heads, then its KV heads), "
                                              "the t0 + t1 - 2 previous inputs] (transformers' conv_states)"),
                StateSpec(name="recurrent_state", shape=[nv, lin.head_v_dim], dtype=dtype,
                          layout="[KV heads of this rank, head_dim / 2]: the previous token's v_proj_delayed output "
                                 "(transformers' recurrent_states)")]
    if lin.family == MLSTM:
        # float32: xLSTMConfig.inference_state_dtype, what the native kernels keep C, n and m in
        return [StateSpec(name="recurrent_state", shape=[nv, lin.head_k_dim + 1, lin.head_v_dim + 1], dtype="float32",
                          layout="[heads, Dqk + 1, Dv + 1]: the matrix memory C in [:Dqk, :Dv], the normalizer n in "
                                 "column Dv, the max-state m at [Dqk, 0] (transformers' c / n / m states, packed)")]
    if lin.conv_kernel:
        channels = {MAMBA2: "x|B|C", MAMBA: "inner", SHORT_CONV: "hidden (B*x)"}.get(lin.family, "q|k|v")
        out.append(StateSpec(name="conv_state", shape=[lin.conv_channels_per_rank(tp), lin.conv_kernel - 1],
                             dtype=dtype, layout=f"[{channels} conv channels of this rank, kernel - 1 previous inputs]"))
    if lin.family == SHORT_CONV:  # the conv state is all the layer keeps
        return out
    if lin.family == GATED_DELTA_NET:
        out.append(StateSpec(name="recurrent_state", shape=[nv, lin.head_v_dim, lin.head_k_dim], dtype="bfloat16",
                             layout="[value heads, Dv, Dk] (npu_recurrent_gated_delta_rule's state, transposed from "
                                    "transformers' [H, Dk, Dv])"))
    elif lin.family == MAMBA2:
        # float32: the scan accumulates in float32 (transformers' chunk scan returns a float32 final state; Nemotron-H
        # names mamba_ssm_cache_dtype float32)
        out.append(StateSpec(name="recurrent_state", shape=[nv, lin.head_v_dim, lin.head_k_dim], dtype="float32",
                             layout="[heads, head_dim P, d_state N] (transformers' Mamba-2 recurrent state)"))
    elif lin.family == MAMBA and lin.num_k_heads > 1:
        # Zamba's multi-head mixer: transformers scans each head on its own and stacks the heads' [I / H, N] states
        # (ZambaMambaMixer.forward: torch.stack(final_states, dim=1), recurrent_state[:, head_idx] when decoding)
        nk = lin.k_heads_per_rank(tp)
        out.append(StateSpec(name="recurrent_state", shape=[nk, nv // nk, lin.head_k_dim], dtype="float32",
                             layout="[mamba heads, inner channels per head, d_state N] (transformers' Zamba "
                                    "recurrent state: each head a Mamba-1 state with its own B/C)"))
    elif lin.family == MAMBA:
        out.append(StateSpec(name="recurrent_state", shape=[nv, lin.head_k_dim], dtype="float32",
                             layout="[inner channels, d_state N] (transformers' Mamba-1 recurrent state)"))
    else:
        # KDA: transformers keeps its recurrent state in float32 (update_recurrent_state(... .to(float32))).
        out.append(StateSpec(name="recurrent_state", shape=[nv, lin.head_k_dim, lin.head_v_dim],
                             dtype="float32" if lin.family == KIMI_DELTA else dtype,
                             layout="[heads, Dk, Dv] (the torch recurrence's state)"))
    if next_n:
        out.append(StateSpec(name=SPEC_ANCHOR, shape=[1], dtype="int32",
                             layout="[the position whose state the request's first state block holds]: column c of "
                                    "its 1 + next_n blocks holds the state after position anchor + c"))
    return out


def _rwkv_states(lin, tp: int, dtype: str) -> list[StateSpec]:
    """RWKV-4's block: the token shift of both mixes in the model dtype (transformers' state[1] / state[0], the
    embeddings' dtype) and the wkv's num / den / max in float32 (state[2..4], torch.float32 whatever the model's)."""
    return [StateSpec(name="conv_state", shape=[lin.conv_channels_per_rank(tp), lin.conv_kernel - 1], dtype=dtype,
                      layout="[time-mix | channel-mix inputs (hidden_size each), the 1 previous token]: the token "
                             "shift (transformers' state[1] | state[0])"),
            StateSpec(name="recurrent_state", shape=[lin.num_v_heads // tp, lin.head_k_dim], dtype="float32",
                      layout="[attention channels of this rank, (num, den, max)]: the wkv state (transformers' "
                             "state[2], state[3], state[4]; the CUDA kernel's [hidden, 3] layout)")]


def state_bytes(states: list[StateSpec]) -> int:
    """Bytes of one request's states of one layer."""
    return sum(s.numel * STATE_DTYPE_BYTES[s.dtype] for s in states)


def decide_speculative_states(next_n: int, has_conv: bool) -> str | None:
    """How a verify step (1 + next_n tokens per request) keeps recurrent states; None without speculation."""
    if not next_n:
        return None
    conv = "its conv window and " if has_conv else ""
    return (f"speculative decoding verifies 1 + {next_n} tokens per request, and a rejected draft must not advance "
            "a recurrent state: each request holds 1 + next_n state blocks (the framework's Mamba table at decode, "
            "MambaCacheEntry(next_n=...); cache_utils: width 1 + next_n once decoding) and token c of a verify step "
            f"writes {conv}its state after that token to column c. The next step resumes from the column of the last "
            "accepted token. The framework's ForwardMetaData names no accepted count, so each request's first block "
            f"keeps an anchor ({SPEC_ANCHOR}, int32): column c holds the state after position anchor + c, and a step "
            "starting at position s (actual_seq_lengths_kv - q_len) resumes from column s - anchor - 1, then sets "
            "anchor = s. Decode runs the recurrence one token per call (each call reads and writes one slot), so no "
            "device reading of num_accepted_tokens / every-token writes is relied on (gdr_accepted_start, "
            "gdr_state_writes)")


def decide_linear(facts: ModelFacts, parallel: ParallelPlan, dtype: str | None = None, next_n: int = 0
                  ) -> LinearAttentionDecision | None:
    """The recurrent-state plan of a hybrid model's linear layers; None without linear layers of a known family."""
    lin = facts.linear.value
    if lin is None:
        return None
    tp = parallel.attn_tp_size
    states = linear_states(facts, tp, dtype, next_n)
    layers = [i for i, kind in enumerate(facts.layer_kinds.value) if holds_state(kind)]
    conv = (f"conv state [{lin.conv_channels_per_rank(tp)}, {lin.conv_kernel - 1}] and " if lin.conv_kernel else "")
    recurrent = lin.family != SHORT_CONV  # a short-conv layer keeps its conv state only
    kept = f"{conv}a recurrent state" if recurrent else conv[:-len(" and ")] + " (no recurrent state)"
    # a parallel / hybrid layer (Falcon-H1, Zamba, ZAYA) keeps its states beside its attention's KV cache
    beside = all(attends(kind) for kind in facts.layer_kinds.value if holds_state(kind))
    what, where = ("hybrid layers", "beside their attention's KV cache") if beside else \
        ("linear layers", "instead of a KV cache")
    sizes = dict(num_k_heads=lin.num_k_heads, num_v_heads=lin.num_v_heads, head_k_dim=lin.head_k_dim,
                 head_v_dim=lin.head_v_dim, num_k_heads_per_rank=lin.k_heads_per_rank(tp),
                 num_v_heads_per_rank=lin.num_v_heads // tp) if recurrent else {}
    return LinearAttentionDecision(
        family=lin.family,
        layers=layers,
        **sizes,
        conv_kernel=lin.conv_kernel,
        conv_channels_per_rank=lin.conv_channels_per_rank(tp),
        states=states,
        state_bytes_per_layer=state_bytes(states),
        framework_entry="MambaCacheEntry(cache_name=<state name>, dtype, shape=<state shape>, needs_block=True) "
                        "per state, attn_type Mamba (block size 1, one block per request plus one per speculative "
                        "token): frameworks from fda5670 on (executor/core/kv_cache/cache_info.py defines MambaCacheEntry)",
        operators=linear_operators(lin, tp),
        state_blocks_per_request=1 + next_n,
        beta_scale=lin.beta_scale if lin.beta_scale != 1 else None,
        query_scale=lin.query_scale,
        speculative=decide_speculative_states(next_n, bool(lin.conv_kernel)),
        reference=lin.reference,
        source=lin.source,
        reason=f"{len(layers)} {what} keep {kept} per request {where}: the "
               "state is found by the request's state block (block_table['Mamba'][row, 0]), read at the step's "
               "start and written back after it; the framework never zeroes a block (torch.empty, reused FIFO after "
               "its request finishes), so prefill starts from a zero state and never reads the block",
    )


def decide_cache_dtype(facts: ModelFacts, requested: str | None) -> CacheDtypeDecision | None:
    """--cache-dtype: plan the cache (entries, memory) in another dtype than the config's torch_dtype; None when
    not asked for or equal to it (the manifest then says nothing new)."""
    if requested is None or requested == facts.dtype.value:
        return None
    stated = (f"the config states {facts.dtype.value} ({facts.dtype.source})" if not facts.dtype.is_default
              else f"the config states no dtype ({facts.dtype.value} assumed)")
    return CacheDtypeDecision(
        value=requested, config_dtype=facts.dtype.value,
        reason=f"--cache-dtype {requested}: {stated}; every cache entry and the memory plan use {requested} "
               f"({DTYPE_BYTES[requested]} B per element), the model's weights and compute dtype stay as deployed")


def cache_token_bytes(caches: list[CacheSpec]) -> int:
    return sum(token_bytes(c.dim, c.num_head, DTYPE_BYTES[c.dtype]) for c in caches)


def check_block_size(value: int) -> str | None:
    """None when the paged FA path accepts ``value``, else why not."""
    if value not in VALID_BLOCK_SIZES:
        return f"block_size {value} rejected: the paged FA path takes 128..512 in multiples of 128"
    return None


# ---------------------------------------------------------------- deployment mode


def decide_deploy_mode(
    dispatch: str | None,
    dispatch_line: str | None,
    user: str | None,
    self_checks: Sequence[tuple[str, str]] = (),
) -> tuple[str, str, list[str], list[tuple[str, str, str]]]:
    """Priority dispatch > user > self-check > default framework (SKILL.md, '开始前:部署模式与必要输入').

    ``self_checks`` are (value, detail) pairs, strongest first (support_models registration, own
    runner loop, progress.md wording). Returns (value, source, evidence, losers) with every losing
    source as (value, source, detail), so the manifest shows what was overridden.
    """
    candidates: list[tuple[str, str, str]] = []
    if dispatch:
        candidates.append((dispatch, "dispatch", f"dispatch line {dispatch_line!r}"))
    if user:
        candidates.append((user, "user", "--deploy-mode"))
    for value, detail in self_checks:
        candidates.append((value, "self_check", detail))
    if not candidates:
        return "framework", "default", ["no dispatch line, flag or self-check evidence: repository default"], []
    value, source, detail = candidates[0]
    return value, source, [detail], candidates[1:]


def decide_mla(facts: ModelFacts, kv_mode: str) -> MlaDecision:
    """MLA: absorb on the paged path (latent nope + rope caches, kv_b_proj absorbed into Q and the output)."""
    return format_of(facts).mla(facts, kv_mode)


GRAPH_CONSEQUENCES = [
    "decode batches padded to the scheduler's batch_size_per_dp_rank, the padded rows on the null block "
    "(executor/core/engine/execution_engine.py: _pad_batch): one captured shape per batch size",
    "block tables of one width, ceil(max_len / block_size) (cache_utils.prepare_block_tables' max_block_num)",
    "no host synchronisation and no Python branching on tensor values inside the decode step: .item(), "
    ".tolist() of device tensors and loops over the batch break the capture or bake one step's value into every "
    "replay",
]
EXE_MODE_CONSEQUENCES = {
    "npugraph_ex": ["FA sequence lengths as host lists: on decode the engine fills forward_metadata."
                    "actual_seq_lengths_list_kv / actual_seq_lengths_cu_list_q (execution_engine.py, exe_mode "
                    "npugraph_ex) and FA v2 types actual_seq_qlen / actual_seq_kvlen SymInt[] (the torch_npu "
                    "schema); upstream qwen (models/qwen/models/modeling_qwen.py) passes those lists"],
    "ge_graph": ["FA through torchair.ops on decode (upstream models/qwen/models/modeling_qwen.py: fa_ops = "
                 "torchair.ops when enable_gegraph), the lengths as device tensors (torchair defines "
                 "torch.ops.air.npu_fused_infer_attention_score(_v2) with Tensor? actual_seq_* and no eager kernel); "
                 "prefill stays on torch_npu, and the graph is compiled static (graph_utils.py: dynamic=False)"],
}


STATIC_GRAPH_CONSEQUENCE = ("enable_dynamic_graph False: the decode graph is compiled static "
                            "(executor/utils/graph_utils.py: torch.compile(dynamic=enable_dynamic_graph)), so the "
                            "host-list FA lengths become constants of the capture and every replay reuses the first "
                            "step's lengths; only a dynamic graph takes them per replay")


def decide_exe_mode(mode: str | None, source: str, next_n: int = 0,
                    dynamic: tuple[bool | None, str] = (None, "")) -> ExecModeDecision | None:
    """The decode step's execution mode, stated by --exe-mode or progress.md; None when not stated (eager).
    ``dynamic``: enable_dynamic_graph as stated (value, source); the framework's default is True for npugraph_ex
    and ge_graph compiles static whatever it says (inference_config.py, graph_utils.py)."""
    if mode is None:
        return None
    if mode == "eager":
        return ExecModeDecision(value=mode, source=source, reason="eager: every decode step runs op by op, nothing "
                                                                  "is captured; the rendered code runs as written")
    verify = ([f"speculative verify steps of a fixed 1 + {next_n} tokens per request, padded rows included (their "
               f"1 + {next_n} slots in the null block): a capture of their own beside the decode step's"]
              if next_n else [])
    stated, where = dynamic
    value = False if mode == "ge_graph" else (True if stated is None else stated)
    static = ([STATIC_GRAPH_CONSEQUENCE] if mode == "npugraph_ex" and not value else [])
    return ExecModeDecision(
        value=mode, source=source, consequences=[*GRAPH_CONSEQUENCES, *EXE_MODE_CONSEQUENCES[mode], *static, *verify],
        dynamic_graph=value, dynamic_graph_source=where if stated is not None else "",
        reason=f"{mode}: the framework captures the decode step once per batch size and replays it, so a length, a "
               "slot or a table width computed on the host inside the step is captured as a constant and replayed "
               "for every later step (wrong output, no error); kvcache renders npugraph_ex (host-list FA lengths) and "
               "ge_graph (torchair.ops FA) decode for GQA/MHA and MLA layers and validates its capture, and refuses "
               "the rest by name")


def decide_mtp(facts: ModelFacts, next_n: int | None = None) -> MtpDecision | None:
    """MTP layers hold caches too, and speculative decode runs q_len = 1 + next_n: causal 3, not 0. ``next_n``
    (--next-n) is recorded where it is not one token per MTP layer."""
    n = facts.num_mtp_layers.value
    if not n:
        return None
    return MtpDecision(
        num_layers=n,
        next_n=None if next_n in (None, n) else next_n,
        holds_caches=True,
        decode_sparse_mode=3,
        decode_mask="causal_2048",
        reason=f"{n} MTP layer(s) ({facts.num_mtp_layers.source}): with speculative decoding each decode step "
               "carries 1 + next_n query tokens, so non-sliding layers need right-down causal 3 + 2048 mask "
               "(sliding layers keep 4); get_cache_info must list the MTP layers' caches too",
    )

