"""BLT's manifest section (``byte_patches``), analyzer side: each planned stack's FA shape, scale and band, decided
by the analyzer's rules from the facts analyzer/kinds/byte_patches.py reads, and the manifest's layers built from it
(``layers``: one AttentionLayerPlan per cache layer, in cache order, each with its stack's own query heads, KV heads,
head_dim, scale and window where they differ from the model-level stack, the local decoder's). Apart from
byte_patches.py because the rules read config_loader, which reads byte_patches to keep BLT off the one-stack path.

Framework mode (upstream executor/core/kv_cache/cache_utils.py prepare_slot_mapping): the engine hands
``slot_mapping[manager_key]`` per token (byte) position and ``block_table[manager_key]`` per manager; each stack is a
manager of its own (group_key: its section). The per-patch (global) stack's rows are not the bytes' positions, so
its slots are the model's to compute, from its own block table and each request's patch count, as the engine leaves
Mamba and compressed managers' to the model; the render does (implementer/kinds/byte_patches.py). The open patch's
encoder rows are a per-request state slot of ``open_patch_rows`` rows (max_patch_length, else the request's bytes:
a patch never holds more bytes than its request).
"""

from __future__ import annotations

import math

from model_infer_kvcache.analyzer import kv_cache_spec, rules
from model_infer_kvcache.analyzer.device_questions import QUESTIONS
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.kinds import byte_patches as bp
from model_infer_kvcache.analyzer.manifest import (
    AttentionLayerPlan,
    BytePatchesDecision,
    ByteStackPlan,
    CacheSpec,
)

# the stack the manifest's model-level fields describe: the local decoder, whose rows give the logits
MODEL_STACK = "decoder_config"
OPEN_PATCH = "open_patch"  # the memory group of the open patch's encoder rows (a slot per request)


def decide(facts: bp.BytePatchFacts, reading: str, request_bytes: int | None = None,
           where: str = "config") -> BytePatchesDecision:
    """The manifest's ``byte_patches`` section: each planned stack's FA shape, scale and band (the analyzer's rules
    for its attn_type, pre_tokens from its window under the device ``reading``), its cache layers, and the patch
    boundary ``byte_patches.ends_patch`` decides (the render writes the same rule). The open patch's rows: at most
    max_patch_length, else at most ``request_bytes`` (the longest request: a patch is never longer)."""
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
    if facts.max_patch_length is not None:
        rows, bound = facts.max_patch_length, f"max_patch_length {facts.max_patch_length} (process_patch_lengths " \
                                              "splits longer patches)"
    elif not facts.entropy_patching:
        rows, bound = 1, "every byte is a patch (no entropy patching)"
    elif request_bytes is not None:
        rows, bound = request_bytes, (f"no max_patch_length: the request's bytes bound the open patch (at most "
                                      f"{request_bytes}, the longest request planned: --max-len, else "
                                      "max_position_embeddings)")
    else:
        raise InputError(where, "no max_patch_length and no request length (--max-len or max_position_embeddings): "
                                   "nothing bounds the open patch's encoder rows", field="max_patch_length")
    return BytePatchesDecision(
        stacks=stacks, entropy_patching=facts.entropy_patching,
        patching_threshold=facts.threshold if facts.entropy_patching else None,
        max_patch_length=facts.max_patch_length, cross_attn_k=facts.cross_attn_k,
        decoder_cross_layers=facts.decoder_cross_layers,
        per_request_states=(f"the open patch's encoder rows; per decoder cross layer the K/V of the latest completed "
                            f"patch ({facts.cross_attn_k} rows x {dec.kv_heads} x {dec.head_dim})"),
        open_patch_rows=rows, open_patch_bound=bound, source=bp.SOURCE)


def window_reading(section: BytePatchesDecision) -> str:
    """The device reading a section's windowed stacks were planned under (pre_tokens W: inclusive, W - 1:
    exclusive): a re-derivation of the section (a config check, its CPU-sized copy) plans under the same."""
    windowed = next((s for s in section.stacks if s.sliding_window), None)
    return "inclusive" if windowed and windowed.pre_tokens == windowed.sliding_window else "exclusive"


def decision_row(section: BytePatchesDecision) -> tuple[str, str, str]:
    """progress.md's row of a BLT manifest: the stacks, the patch boundary and the per-request states."""
    rate = {bp.PER_BYTE: "每字节一行", bp.PER_PATCH: "每 patch 一行"}
    stacks = "; ".join(f"{s.section} 层 {s.cache_layers[0]}-{s.cache_layers[-1]} {rate[s.rows_per]} "
                       f"(Q {s.num_heads} / KV {s.num_kv_heads} x {s.head_dim})" for s in section.stacks)
    boundary = (f"a patch ends at byte p >= 1 when the patcher's entropy at p exceeds {section.patching_threshold}"
                + (f" or at {section.max_patch_length} bytes" if section.max_patch_length else "")
                if section.entropy_patching else "every byte is a patch")
    return ("BLT 分块(byte_patches)", stacks, f"{boundary}; the global stack writes a row per completed patch, its "
            f"slots from its own block table and the request's patch count; per request: "
            f"{section.per_request_states}; open patch rows <= {section.open_patch_rows} ({section.open_patch_bound}) "
            f"({section.source})")


def _model_stack(section: BytePatchesDecision) -> ByteStackPlan:
    return next(s for s in section.stacks if s.section == MODEL_STACK)


def model_heads(section: BytePatchesDecision) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim) of the manifest's model-level fields: the local decoder's."""
    s = _model_stack(section)
    return s.num_heads, s.num_kv_heads, s.head_dim


def layers(section: BytePatchesDecision, dtype: str) -> list[AttentionLayerPlan]:
    """The manifest's layers: every stack's cache layers in cache order, each its stack's band, its K/V entries of
    the stack's shape, and the stack's query heads / KV heads / head_dim / scale where they differ from the model
    stack's (AttentionLayerPlan's per-layer fields). group_key: the stack, a manager of its own."""
    model = _model_stack(section)
    out: dict[int, AttentionLayerPlan] = {}
    for s in section.stacks:
        attn_type = kv_cache_spec.SLIDING_WINDOW if s.sliding_window else kv_cache_spec.FULL_ATTENTION
        sparse, mask, _ = rules.decide_sparse(attn_type, False, "paged")
        shape = {}
        if s.head_dim != model.head_dim:
            shape["head_dim"] = s.head_dim
        if s.num_kv_heads != model.num_kv_heads:
            shape["num_kv_heads_per_rank"] = s.num_kv_heads
        if s.num_heads != model.num_heads:
            shape["num_q_heads_per_rank"] = s.num_heads
        if s.softmax_scale != model.softmax_scale:
            shape.update(softmax_scale=s.softmax_scale,
                         scale_derivation=f"{s.section} head_dim = {s.head_dim}^-0.5 (BltSelfAttention.scaling)")
        caches = [CacheSpec(name=n, dim=s.head_dim, num_head=s.num_kv_heads, dtype=dtype) for n in ("k_cache",
                                                                                                   "v_cache")]
        for i in s.cache_layers:
            out[i] = AttentionLayerPlan(
                index=i, decoder_layer=i, attn_type=attn_type, layer_kind="sliding" if s.sliding_window else "full",
                group_key=s.section, sliding_window=s.sliding_window, sparse_mode=sparse, pre_tokens=s.pre_tokens,
                next_tokens=s.next_tokens, mask=mask, write_op="npu_scatter_nd_update_", caches=caches,
                window_derivation=s.window_derivation, **shape)
    return [out[i] for i in sorted(out)]


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
    if section.max_patch_length is not None and section.open_patch_rows != section.max_patch_length:
        out.append(("byte_patches.open_patch_rows", f"{section.open_patch_rows}: a patch holds at most "
                                                    f"max_patch_length {section.max_patch_length} bytes"))
    if not any(s.section == MODEL_STACK for s in section.stacks):
        out.append(("byte_patches.stacks", f"no {MODEL_STACK} stack (the model-level fields are its)"))
    return out


def memory_groups(section: BytePatchesDecision, block_size: int, itemsize: int) -> list[kv_cache_spec.Spec]:
    """The memory groups a BLT plan needs, one manager per stack (their K/V shapes differ, so no two share a pool):
    a windowed byte stack keeps its window's blocks (SlidingWindowSpec), a full one grows with the bytes; the
    per-patch stack grows at most a row per byte (a patch may end at every byte: the bytes bound it); and the
    decoder's cross K/V, a slot per request of cross_attn_k rows per cross layer (CrossAttentionSpec); the open
    patch's encoder rows, a state slot per request of open_patch_rows x the encoder's hidden size (MambaSpec)."""
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
    enc = next(s for s in section.stacks if s.section == "encoder_config")
    groups.append(kv_cache_spec.MambaSpec(OPEN_PATCH, section.open_patch_rows * enc.num_heads * enc.head_dim * itemsize,
                                          0, 1))
    return groups
