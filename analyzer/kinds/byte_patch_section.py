"""BLT's manifest section (``byte_patches``), analyzer side: each planned stack's FA shape, scale and band, decided
by the analyzer's rules from the facts analyzer/kinds/byte_patches.py reads. Apart from that module because the
rules read config_loader, which reads byte_patches to refuse BLT configs.

What remains before ``kvcache analyze`` writes this section into a manifest (measured by reading the code, 2026-12-06):
ModelFacts has one query-head count (``heads_at`` varies only through ``layer_mla``) and its scale follows the model's
head_dim (``qk_head_dim_at``), while BLT's stacks differ in both; ``arch_check.cross_check`` compares a plan's
layers with the meta build's modules (which ``byte_patches.stacks_of`` joins in cache order) by its own rules, where
BLT's are ``byte_patches.module_problems`` (no decoder module holds the window); ``kind_problems`` cannot call
``problems`` below (manifest -> invariants -> rules -> manifest would cycle). In framework mode the engine hands ``slot_mapping[manager_key]`` per token position (upstream
executor/core/kv_cache/cache_utils.py prepare_slot_mapping), except for Mamba managers and managers with
compress_ratio > 1, whose slots the model computes: the per-patch stack needs the same, its slots from its own
``block_table[manager_key]`` and each request's patch count (a CacheEntry with a ``manager_key`` of its own); the open
patch's encoder rows have no fixed size without max_patch_length, so no MambaCacheEntry-style state block holds them.
"""

from __future__ import annotations

import math

from model_infer_kvcache.analyzer import kv_cache_spec, rules
from model_infer_kvcache.analyzer.device_questions import QUESTIONS
from model_infer_kvcache.analyzer.kinds import byte_patches as bp
from model_infer_kvcache.analyzer.manifest import BytePatchesDecision, ByteStackPlan


def decide(facts: bp.BytePatchFacts, reading: str) -> BytePatchesDecision:
    """The manifest's ``byte_patches`` section: each planned stack's FA shape, scale and band (the analyzer's rules
    for its attn_type, pre_tokens from its window under the device ``reading``), its cache layers, and the patch
    boundary ``byte_patches.ends_patch`` decides (the render writes the same rule)."""
    plan = bp.cache_plan(facts)
    stacks = []
    for s in facts.stacks:
        mine = [layer.index for layer in plan if layer.stack is s]
        if not mine:  # without entropy patching no patcher is built
            continue
        sparse, mask, _ = rules.decide_sparse(s.attn_type, False, "paged")
        pre, nxt, derivation = rules.decide_window_tokens(s.window, reading)
        stacks.append(ByteStackPlan(section=s.stack.section, module=s.stack.module, rows_per=s.stack.over,
                                    cache_layers=mine, num_heads=s.heads, num_kv_heads=s.kv_heads,
                                    head_dim=s.head_dim, softmax_scale=s.scale, sliding_window=s.window,
                                    sparse_mode=sparse.decode, pre_tokens=pre, next_tokens=nxt, mask=mask.decode,
                                    window_derivation=derivation))
    dec = facts.of("decoder_config")
    return BytePatchesDecision(
        stacks=stacks, entropy_patching=facts.entropy_patching,
        patching_threshold=facts.threshold if facts.entropy_patching else None,
        max_patch_length=facts.max_patch_length, cross_attn_k=facts.cross_attn_k,
        decoder_cross_layers=facts.decoder_cross_layers,
        per_request_states=(f"the open patch's encoder rows; per decoder cross layer the K/V of the latest completed "
                            f"patch ({facts.cross_attn_k} rows x {dec.kv_heads} x {dec.head_dim})"),
        source=bp.SOURCE)


def problems(section: BytePatchesDecision) -> list[tuple[str, str]]:
    """(field, why) for each invariant a hand edit of the section can break: every cache layer one stack's, each
    stack's scale its head_dim's (BltSelfAttention.scaling), its band its window's (rules: a windowed stack banded
    by sparse_mode 4 with pre_tokens W - 1 or W by the device reading, a full one causal), its query heads a multiple
    of its KV heads, the per-patch stack unwindowed (BltGlobalTransformer: full causal)."""
    out: list[tuple[str, str]] = []
    layers = sorted(i for s in section.stacks for i in s.cache_layers)
    if layers != list(range(len(layers))):
        out.append(("byte_patches.stacks", f"the stacks' cache_layers {layers} must number 0..{len(layers) - 1} "
                                           "once each"))
    for i, s in enumerate(section.stacks):
        where = f"byte_patches.stacks[{i}]"
        if s.num_heads % s.num_kv_heads:
            out.append((f"{where}.num_heads", f"{s.num_heads} is not a multiple of num_kv_heads {s.num_kv_heads}"))
        if not math.isclose(s.softmax_scale, s.head_dim ** -0.5, rel_tol=1e-12):
            out.append((f"{where}.softmax_scale", f"{s.softmax_scale!r} is not head_dim {s.head_dim} ** -0.5 "
                                                  f"({s.section}: BltSelfAttention.scaling)"))
        sparse, _, _ = rules.decide_sparse(
            kv_cache_spec.SLIDING_WINDOW if s.sliding_window else kv_cache_spec.FULL_ATTENTION, False, "paged")
        if s.sparse_mode != sparse.decode:
            out.append((f"{where}.sparse_mode", f"{s.sparse_mode}: a {'windowed' if s.sliding_window else 'full'} "
                                                f"stack's decode FA call uses {sparse.decode}"))
        readings = {rules.decide_window_tokens(s.sliding_window, r)[0]
                    for r in QUESTIONS["window_pre_tokens"].readings}
        if s.pre_tokens not in readings:
            out.append((f"{where}.pre_tokens", f"{s.pre_tokens}: window {s.sliding_window} gives "
                                               f"{' or '.join(map(str, sorted(readings)))} (by the device reading)"))
        if s.rows_per == bp.PER_PATCH and s.sliding_window:
            out.append((f"{where}.sliding_window", f"{s.sliding_window}: the per-patch stack attends full causal"))
    return out


def memory_groups(section: BytePatchesDecision, block_size: int, itemsize: int) -> list[kv_cache_spec.Spec]:
    """The memory groups a BLT plan needs, one manager per stack (their K/V shapes differ, so no two share a pool):
    a windowed byte stack keeps its window's blocks (SlidingWindowSpec), a full one grows with the bytes; the
    per-patch stack grows at most a row per byte (a patch may end at every byte: the bytes bound it); and the
    decoder's cross K/V, a slot per request of cross_attn_k rows per cross layer (CrossAttentionSpec). The open
    patch's encoder rows are no group: unbounded without max_patch_length (the module's docstring)."""
    groups: list[kv_cache_spec.Spec] = []
    for s in section.stacks:
        per_token = 2 * len(s.cache_layers) * kv_cache_spec.token_bytes(s.head_dim, s.num_kv_heads, itemsize)
        if s.sliding_window:
            groups.append(kv_cache_spec.SlidingWindowSpec(s.section, len(s.cache_layers), per_token, block_size,
                                                          window=s.sliding_window))
        else:
            groups.append(kv_cache_spec.FullAttentionSpec(s.section, len(s.cache_layers), per_token, block_size))
    dec = next(s for s in section.stacks if s.section == "decoder_config")
    slot = 2 * section.decoder_cross_layers * section.cross_attn_k * kv_cache_spec.token_bytes(
        dec.head_dim, dec.num_kv_heads, itemsize)
    groups.append(kv_cache_spec.CrossAttentionSpec(kv_cache_spec.CROSS_ATTENTION, slot,
                                                   num_layers=section.decoder_cross_layers,
                                                   slot_tokens=section.cross_attn_k))
    return groups
