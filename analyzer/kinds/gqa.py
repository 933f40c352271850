"""GQA / MHA / MQA attention (per-head K and V caches), analyzer side: the attention format every other refines.

An attention format answers what the decision rules and the plan builder would otherwise branch on: how many KV
heads a rank caches, which cache entries a layer holds, what FA takes of its head shapes, its default FA version
and layout, how its softmax scale is labelled, how its layers group into the framework's managers, and the notes a
port must not miss. ``analyzer/kinds/formats.py`` picks the one a model's facts hold; MLA, DSA and the compressed
kind subclass this and override what differs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from model_infer_kvcache.analyzer import kv_cache_spec
from model_infer_kvcache.analyzer.manifest import CacheSpec, Finding, LayerPlan, MlaDecision
from model_infer_kvcache.analyzer.operators.fa_facts import MAX_GQA_RATIO, VALUE_DIM_PAIRS, VALUE_DIM_SOURCE

FA_MAX_HEAD_DIM = 512
FA_HEAD_DIM_ALIGN = 16

Facts = Any  # analyzer.config_loader.ModelFacts (not imported: config_loader reads the compressed kind's facts)


# arch_check.score_terms' word for a forward that assigns its attention_mask before the attention call (a bias or a
# selection folded into the mask)
MASK_REWRITTEN = "attention_mask rewritten in its forward"


class GqaFormat:
    """K/V caches of ``num_key_value_heads / attn_tp_size`` heads (replicated below one per rank)."""

    name = "gqa"
    latent = False  # one latent row shared by every query head (MLA), never split by attention TP
    # its sliding layers band FA (sparse_mode 4, pre_tokens): FA's band readings are device dependencies of the plan
    fa_band = True

    # ------------------------------------------------------------------ heads and the FA call's shape rules

    def kv_heads_per_rank(self, facts: Facts, tp: int, decoder_layer: int | None = None) -> int:
        """KV heads one rank holds for a layer: split by attention TP, replicated when fewer heads than ranks."""
        return max(facts.kv_heads_at(decoder_layer) // tp, 1) if facts.attends else 0

    def head_problems(self, facts: Facts) -> list[Finding]:
        per_layer = facts.layer_heads.value
        out = []
        if not facts.attends:  # a pure state stack: no FA call
            return out
        for d in sorted({h.head_dim for h in per_layer} if per_layer else {facts.head_dim.value}):
            if d > FA_MAX_HEAD_DIM or d % FA_HEAD_DIM_ALIGN:
                out.append(Finding(
                    message=f"head_dim {d} is unsupported by FA (must be <= {FA_MAX_HEAD_DIM} and a multiple of 16)",
                    fields=[facts.head_dim.source if d == facts.head_dim.value else facts.layer_heads.source],
                ))
        vd = facts.v_head_dim.value
        if vd is not None and (facts.head_dim.value, vd) not in VALUE_DIM_PAIRS:
            pairs = ", ".join(f"K_D {k} / V_D {v}" for k, v in sorted(VALUE_DIM_PAIRS))
            out.append(Finding(
                message=f"value head dim {vd} beside key head dim {facts.head_dim.value}: FA documents value heads "
                        f"of another width than the key's only for {pairs} ({VALUE_DIM_SOURCE})",
                fields=[facts.v_head_dim.source, facts.head_dim.source],
            ))
        elif vd is not None and facts.layer_heads.value and len({h.head_dim for h in facts.layer_heads.value}) > 1:
            out.append(Finding(message=f"value head dim {vd} beside per-layer key head dims: not supported by "
                                       "kvcache yet (one value head dim for layers of one key head dim)",
                               fields=[facts.v_head_dim.source, facts.layer_heads.source]))
        return out

    def heads_problem(self, facts: Facts, parallel) -> Finding | None:
        """FA takes at most 64 query heads per KV head (GQA/MQA), on every layer."""
        q = parallel.num_q_heads_per_rank
        if not facts.attends:
            return None
        kv = min(max(k // parallel.attn_tp_size, 1) for k in facts.distinct_kv_heads())
        if q // kv <= MAX_GQA_RATIO:
            return None
        return Finding(
            message=f"{q} query heads per {kv} KV head(s) on a rank: FA takes a query/KV head ratio of at most "
                    f"{MAX_GQA_RATIO} (num_key_value_heads rule of the FA operator); one FA call cannot serve this "
                    "layer (replicating the KV heads in the cache or splitting the call by query-head groups is not "
                    "rendered by this skill)",
            fields=[facts.num_attention_heads.source, facts.num_key_value_heads.source],
        )

    def kv_tp_problems(self, facts: Facts, tp: int) -> list[str]:
        out = []
        for kv in facts.distinct_kv_heads() if facts.attends else ():
            if kv >= tp and kv % tp:
                out.append(f"{kv} KV heads are not divisible by attn_tp_size {tp}")
            if kv < tp and tp % kv:
                out.append(f"attn_tp_size {tp} is not a multiple of {kv} KV heads (uneven replication)")
        return out

    def attention_kind(self, facts: Facts) -> str:
        if set(facts.layer_kinds.value) & {"linear", "chunked", "parallel"}:
            return "hybrid"
        kv, heads = facts.num_key_value_heads.value, facts.num_attention_heads.value
        return "mha" if kv == heads else "mqa" if kv == 1 else "gqa"

    # ------------------------------------------------------------------ FA defaults and the scale's wording

    def default_fa_version(self, facts: Facts) -> tuple[str, str, list[str]]:
        return "v1", "GQA/MHA default v1 (Qwen3 reference)", [facts.num_key_value_heads.source]

    # the paged FA layout and why; the head size the softmax scale is taken from, as the derivation writes it;
    # whether transformers' yarn_apply_mscale squares YaRN's mscale into the softmax scale (MLA families only)
    paged_layout = ("TND", "packed variable-length batch [TotalTokens, N, D] matches the framework's 1-D inputs")
    scale_label = "head_dim"
    yarn_scales_softmax = False
    # score terms a transformers attention call of this format adds that the plan itself covers (arch_check's
    # score_terms): none for plain GQA/MHA, whose scale, window and sinks the cross-check compares
    planned_score_terms: frozenset[str] = frozenset()

    # ------------------------------------------------------------------ caches and their managers

    def caches(self, facts: Facts, tp: int, kv_mode: str, dtype: str, decoder_layer: int | None) -> list[CacheSpec]:
        n, d = self.kv_heads_per_rank(facts, tp, decoder_layer), facts.head_dim_at(decoder_layer)
        vd = facts.v_head_dim_at(decoder_layer)  # MiMo-V2-Flash: value heads narrower than key heads
        if kv_mode == "legacy":
            # cache_unit = (num_kv_heads_per_rank * head_dim,): one BSH row per token.
            return [CacheSpec(name="k_cache", dim=n * d, num_head=1, dtype=dtype),
                    CacheSpec(name="v_cache", dim=n * vd, num_head=1, dtype=dtype)]
        return [CacheSpec(name="k_cache", dim=d, num_head=n, dtype=dtype),
                CacheSpec(name="v_cache", dim=vd, num_head=n, dtype=dtype)]

    def layer_fields(self, facts: Facts, decoder_layer: int, dtype: str, block_size: int) -> dict[str, Any]:
        """The format's own fields of an attention layer's plan (a second branch with caches of its own): none."""
        return {}

    def group_key(self, attn_type: str, caches: list[CacheSpec]) -> str:
        """The key of the layer's block table / slot mapping: its attn_type's manager (a chunked layer's is the
        SlidingWindow manager that keeps it, kv_cache_spec.ChunkedLocalSpec)."""
        return kv_cache_spec.manager_attn_type(attn_type)

    def memory_groups(self, facts: Facts, layers: list[LayerPlan], token_bytes: Callable[[LayerPlan], int],
                      next_n: int, block_size: int) -> tuple[list[kv_cache_spec.Spec], list[str]]:
        """The framework's growing / sliding managers of the layers' KV caches, and what the derivation says of
        them. MTP layers are full-attention decoder layers whose caches the framework merges into the main
        model's pools (ModelCacheInfo.merge) when speculative decoding is on: counted there."""
        cached = [layer for layer in layers if layer.caches]  # recurrent layers hold no KV cache
        mtp = facts.num_mtp_layers.value if cached else 0
        mtp_layer = next((layer for layer in cached if not layer.is_sliding), cached[0]) if mtp else None
        full = kv_cache_spec.FULL_ATTENTION
        groups: list[kv_cache_spec.Spec] = []
        for key in sorted({layer.group_key for layer in cached} | ({full} if mtp else set())):
            members = [layer for layer in cached if layer.group_key == key]
            extra = mtp if key == full else 0
            per_token = sum(token_bytes(layer) for layer in members) + (extra * token_bytes(mtp_layer) if extra else 0)
            if members and members[0].is_chunked:
                groups.append(kv_cache_spec.ChunkedLocalSpec(key, len(members), per_token, block_size,
                                                             window=members[0].attention_chunk_size, next_n=next_n))
            elif members and members[0].is_sliding:
                groups.append(kv_cache_spec.SlidingWindowSpec(key, len(members), per_token, block_size,
                                                              window=members[0].sliding_window, next_n=next_n))
            else:
                groups.append(kv_cache_spec.FullAttentionSpec(key, len(members) + extra, per_token, block_size))
        notes = [f"includes {mtp} MTP layer(s) ({facts.num_mtp_layers.source}) in {full}: speculative decoding "
                 "allocates their caches from the same pools"] if mtp else []
        return groups, notes

    def per_token_note(self) -> str:
        return ""

    def sections(self, facts: Facts, layers: list[LayerPlan], groups: list[kv_cache_spec.Spec], parallel,
                 dtype: str, block_size: int, max_len: int | None) -> dict[str, Any]:
        """The manifest sections this format adds (keyword -> decision), from the planned layers and groups."""
        return {}

    # ------------------------------------------------------------------ transformers' modules (analyzer/arch_check.py)

    # child names that make a transformers module this format's attention, beyond the q/k/v layouts
    # analyzer/hf_layout.py knows (each set must be present whole)
    hf_projections: tuple[frozenset[str], ...] = ()

    def hf_facts(self, module) -> dict[str, int | None]:
        """What this format reads off a transformers attention module beyond its heads, scale, window and sinks
        (empty where the module holds none of its parts)."""
        return {}

    def hf_off(self, layer: LayerPlan, module_facts: dict[str, int | None], cls: str) -> str | None:
        """Where the layer's plan differs from those facts: a module holding another format's parts is planned
        without them."""
        held = ", ".join(f"{k} {v}" for k, v in sorted(module_facts.items()) if v is not None)
        if held:
            return f"{self.name} plan vs transformers {cls} holding {held} (another format's parts, none planned)"
        return None

    # ------------------------------------------------------------------ what the decisions table says of a manifest

    fa_call = True  # the layers attend through FA (its version, layout and path table apply)

    def decision_rows(self, m) -> list[tuple[str, str, str]]:
        """The format's own rows of progress.md's decisions table (analyzer/decisions_table.py)."""
        return []

    # SKILL.md's model-kinds table (validators/docgen/doc_tables.py): the format's example row (label, models, the
    # config fields over the table's base config; GQA's rows are the table's own), the attention cell when no FA call
    # is made, the layout and the writers
    doc_example: tuple[str, str, dict] | None = None

    def doc_attention(self, m) -> str | None:
        return None  # FA: its version (or the Legacy kernel) says it

    def doc_layout(self, m) -> str:
        return m.fa.input_layout

    def doc_write(self, m) -> str:
        return f"`{m.attention_layers[0].write_op}`"

    # ------------------------------------------------------------------ the MLA section and the notes

    def mla(self, facts: Facts, kv_mode: str) -> MlaDecision:
        return MlaDecision(enabled=False, absorb=False, cache_mode=None, rope=True, reason="not an MLA model",
                           constraints=[])

    def checkout_refusal(self, m) -> tuple[str, str] | None:
        """(manifest field, why) when the checkout run cannot drive this format on CPU yet: its operators not
        emulated, no oracle for it (validators/checkout_run/support.py says it as "not supported by kvcache")."""
        return None

    def check_kv_mode(self, kv_mode: str, reason: str, where: str) -> None:
        """Refuse a KV mode this format cannot be served in (every mode serves GQA)."""

    def notes(self, facts: Facts) -> tuple[list[Finding], list[Finding]]:
        """(warnings, open questions) a port of this format must not miss."""
        return [], []


FORMAT = GqaFormat()
