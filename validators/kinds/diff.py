"""DiffLlama's differential attention: GQA's checks over four FA calls a layer and step, each of half the rank's query
heads over a half-head key cache and a half-head value cache (V209 judges their heads through
``analyzer.kinds.fa_kv_heads`` / ``fa_q_heads``); the render's module constants name the halves."""

from __future__ import annotations

import torch
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
    shrink_notes,
    spec_prompts,
    tiny_attention_fields,
    verify_expectation,
)
from model_infer_kvcache.validators.kinds.gqa import (
    expected_constants as gqa_constants,
)
from model_infer_kvcache.validators.kinds.sharding import keep_rows


def expected_constants(manifest) -> dict[str, object]:
    """GQA's, and the halves: KV heads per half-head cache and query heads per FA call (half the rank's each)."""
    p = manifest.parallel
    return {**gqa_constants(manifest), "HALF_KV_HEADS": p.num_kv_heads_per_rank // 2,
            "HALF_Q_HEADS": p.num_q_heads_per_rank // 2}


def _halves(start: int, stop: int, total: int, width: int) -> torch.Tensor:
    """Row indices of a rank's share of both head halves: heads [start, stop) of the low half, then the same slice of
    the high half (``total`` heads, ``width`` rows a head)."""
    heads = [*range(start, stop), *range(total // 2 + start, total // 2 + stop)]
    return torch.tensor([h * width + i for h in heads for i in range(width)])


def shard_attention(attn, model, heads: slice, rank: int, tp: int) -> int:
    """One attention-TP rank's heads of a DiffLlama module: the same slice of both halves of its query heads and of
    its KV heads (value heads k/2 apart pair on one rank), not GQA's contiguous share. ``heads`` is the rank's
    contiguous share, as many heads as it keeps; the combined output (out1 - lambda out2, 2 x head_dim a head) of its
    low heads is o_proj's contiguous column share, so the head dim is returned for that cut."""
    d, h, k = model.head_dim, model.num_attention_heads, model.num_key_value_heads
    nq, nk = (heads.stop - heads.start) // 2, k // tp // 2
    for proj, rows in ((attn.q_proj, _halves(rank * nq, (rank + 1) * nq, h, d)),
                       (attn.k_proj, _halves(rank * nk, (rank + 1) * nk, k, d)),
                       (attn.v_proj, _halves(rank * nk, (rank + 1) * nk, k, d))):
        proj.weight = keep_rows(proj.weight.data[rows], 0, len(rows))
        if proj.bias is not None:
            proj.bias = keep_rows(proj.bias.data[rows], 0, len(rows))
    return d


__all__ = ["CPU_KV_HEADS_PER_RANK", "HIDDEN_CAN_TIE_TO_HEADS", "attention_calls", "check_attention_calls", "cpu_heads",
           "cpu_narrowed", "cpu_size_changes", "expected_constants", "layer_shapes", "poison_rejected_drafts",
           "shard_attention", "shrink_notes", "spec_prompts", "tiny_attention_fields", "verify_expectation"]
