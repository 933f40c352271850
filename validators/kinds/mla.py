"""MLA: one latent cache and its rope part, shared by every head (one KV head per rank), attended by FA calls."""

from __future__ import annotations

from model_infer_kvcache.validators.kinds.gqa import (
    attention_calls,
    check_attention_calls,
    cpu_narrowed,
    cpu_size_changes,
    poison_rejected_drafts,
    shrink_notes,
    spec_prompts,
    verify_expectation,
)
from model_infer_kvcache.validators.kinds.sharding import keep_rows

HIDDEN_CAN_TIE_TO_HEADS = False  # the latent sets the widths, not heads x head_dim


def tiny_attention_fields(d: dict, manifest, *, head_dim_from_hidden: bool) -> None:
    """One KV head per query head as transformers' MLA builds them, and a narrow query LoRA where there is one."""
    d["num_key_value_heads"] = manifest.model.num_attention_heads
    if d.get("q_lora_rank") is not None:
        d["q_lora_rank"] = 64


def expected_constants(manifest) -> dict[str, object]:
    mla = manifest.model.mla
    return {"KV_LORA_RANK": mla.kv_lora_rank, "QK_ROPE_HEAD_DIM": mla.qk_rope_head_dim,
            "QK_NOPE_HEAD_DIM": mla.qk_nope_head_dim, "V_HEAD_DIM": mla.v_head_dim}


def shard_attention(attn, model, heads: slice, rank: int, tp: int) -> int:
    """Keep one rank's query heads (q_b_proj / q_proj rows) and their slice of kv_b_proj; the latent stays whole."""
    mla = model.mla
    qk, per_head = model.qk_head_dim, mla.qk_nope_head_dim + mla.v_head_dim
    q = attn.q_proj if attn.q_lora_rank is None else attn.q_b_proj
    q.weight = keep_rows(q.weight, heads.start * qk, heads.stop * qk)
    attn.kv_b_proj.weight = keep_rows(attn.kv_b_proj.weight, heads.start * per_head, heads.stop * per_head)
    return mla.v_head_dim


__all__ = ["HIDDEN_CAN_TIE_TO_HEADS", "attention_calls", "check_attention_calls", "cpu_narrowed", "cpu_size_changes",
           "expected_constants", "tiny_attention_fields", "shard_attention",
           "poison_rejected_drafts", "shrink_notes", "spec_prompts",
           "verify_expectation"]
