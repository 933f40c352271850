"""DiffLlama's differential attention: GQA's checks over four FA calls a layer and step, each of half the rank's query
heads over a half-head key cache and a half-head value cache (V209 judges their heads through
``analyzer.kinds.fa_kv_heads`` / ``fa_q_heads``); the render's module constants name the halves."""

from __future__ import annotations

from model_infer_kvcache.validators.kinds.gqa import (
    CPU_KV_HEADS_PER_RANK,
    HIDDEN_CAN_TIE_TO_HEADS,
    attention_calls,
    check_attention_calls,
    cpu_heads,
    cpu_narrowed,
    cpu_size_changes,
    layer_shapes,
    poison_rejected_drafts,
    shard_attention,
    shrink_notes,
    spec_prompts,
    tiny_attention_fields,
    verify_expectation,
)
from model_infer_kvcache.validators.kinds.gqa import (
    expected_constants as gqa_constants,
)


def expected_constants(manifest) -> dict[str, object]:
    """GQA's, and the halves: KV heads per half-head cache and query heads per FA call (half the rank's each)."""
    p = manifest.parallel
    return {**gqa_constants(manifest), "HALF_KV_HEADS": p.num_kv_heads_per_rank // 2,
            "HALF_Q_HEADS": p.num_q_heads_per_rank // 2}


__all__ = ["CPU_KV_HEADS_PER_RANK", "HIDDEN_CAN_TIE_TO_HEADS", "attention_calls", "check_attention_calls", "cpu_heads",
           "cpu_narrowed", "cpu_size_changes", "expected_constants", "layer_shapes", "poison_rejected_drafts",
           "shard_attention", "shrink_notes", "spec_prompts", "tiny_attention_fields", "verify_expectation"]
