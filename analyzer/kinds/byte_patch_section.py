"""BLT's manifest section (``byte_patches``), analyzer side: each planned stack's FA shape, scale and band, decided
by the analyzer's rules from the facts analyzer/kinds/byte_patches.py reads. Apart from that module because the
rules read config_loader, which reads byte_patches to refuse BLT configs.
"""

from __future__ import annotations

from model_infer_kvcache.analyzer import rules
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
