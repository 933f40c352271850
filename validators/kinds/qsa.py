"""Qwen4-Exp's QSA: GQA's K/V plus the indexer's raw and pooled block keys; its calls are the lightning indexer's
over the pooled keys and the sparse FA's over the selected blocks' tokens, no FA call. Judged here: V235 (each
sparse FA call's selection: per query the tokens of min(block_topk, visible blocks) complete blocks plus its tail
block, causal, no token twice) beside the numeric checks."""

from __future__ import annotations

from model_infer_kvcache.validators.kinds import gqa
from model_infer_kvcache.validators.kinds.gqa import (
    HIDDEN_CAN_TIE_TO_HEADS,
    poison_rejected_drafts,
    shard_attention,
    spec_prompts,
)
from model_infer_kvcache.validators.kinds.gqa import (
    expected_constants as gqa_constants,
)
from model_infer_kvcache.validators.pipeline import dsa_args

QSA_SELECTION = ("QSA selection: each query reads the tokens of its top blocks (min(block_topk, visible blocks) whole "
                 "blocks) and of its tail block, causally, each once")
# blocks a query keeps on CPU (the stream's prompts are 40..300 tokens): the selection drops blocks on every request
# but the shortest; the released budget (2048 tokens) would keep them all
CPU_BLOCK_TOPK = 8
# the render's module constant of the selection width (validate._narrowed_copy sets it in a hand-edited render)
SELECTION_CONSTANT = "QSA_BLOCK_TOPK"


def tiny_attention_fields(d: dict, manifest, *, head_dim_from_hidden: bool) -> None:
    """GQA's, and the indexer's fields from the manifest (its budget possibly narrowed, ``cpu_sized``)."""
    gqa.tiny_attention_fields(d, manifest, head_dim_from_hidden=head_dim_from_hidden)
    q = manifest.qsa
    d.update(indexer_n_heads=q.n_heads, indexer_kv_heads=1, indexer_head_dim=q.head_dim, indexer_budget=q.budget,
             indexer_compress_ratio=q.ratio)


def cpu_narrowed(manifest) -> dict[str, dict]:
    """A budget wider than CPU prompts is narrowed to CPU_BLOCK_TOPK blocks, so the indexer drops blocks."""
    q = manifest.qsa
    if q.block_topk <= CPU_BLOCK_TOPK:
        return {}
    return {"qsa": {"budget": CPU_BLOCK_TOPK * q.ratio, "block_topk": CPU_BLOCK_TOPK}}


def selection_width(manifest) -> int:
    """Blocks kept per query, the width ``cpu_narrowed`` narrows."""
    return manifest.qsa.block_topk


def cpu_size_changes(manifest, small) -> list[str]:
    a, b = manifest.qsa, small.qsa
    return [f"indexer_budget {a.budget} -> {b.budget} ({b.block_topk} blocks)"] if a.budget != b.budget else []


def shrink_notes(manifest, short) -> list[str]:
    if short.qsa.budget == manifest.qsa.budget:
        return []
    return [f"indexer_budget {manifest.qsa.budget} is wider than CPU prompts: the tiny config and the manifest the "
            f"run is judged by carry {short.qsa.budget}, so the selection drops blocks"]


def expected_constants(manifest) -> dict[str, object]:
    q = manifest.qsa
    return {**gqa_constants(manifest), "INDEX_N_HEADS": q.n_heads, "INDEX_HEAD_DIM": q.head_dim,
            "INDEX_ROPE_DIM": q.rope_dim, "QSA_RATIO": q.ratio, "QSA_BLOCK_TOPK": q.block_topk}


def attention_calls(probe) -> list[dict]:
    return probe.sparse_calls


def verify_expectation(manifest, plan) -> tuple[int, bool]:
    """The indexer and the sparse FA of a verify step: rightDownCausal, no mask, as at q_len 2."""
    return dsa_args.CAUSAL, False


def _selection_problems(call: dict, ratio: int, block_topk: int) -> list[str]:
    """Per query of one sparse FA call: its valid indices are distinct, causal, and the tokens of
    min(block_topk, visible) whole blocks plus its tail block's tokens up to it."""
    wrong = []
    for row, (picked, pos) in enumerate(zip(call["picked"], call["positions"], strict=True)):
        valid = [i for i in picked if i >= 0]
        visible = (pos + 1) // ratio
        tail = set(range(visible * ratio, pos + 1))
        blocks = {i // ratio for i in valid if i not in tail}
        whole = all(set(range(b * ratio, (b + 1) * ratio)) <= set(valid) for b in blocks)
        if len(set(valid)) != len(valid) or any(i > pos for i in valid) or not tail <= set(valid) or not whole \
                or len(blocks) != min(block_topk, visible) or any(b >= visible for b in blocks):
            wrong.append(f"step {call['step']} layer {call['layer']} query {row} (position {pos}): {len(valid)} "
                         f"indices, {len(blocks)} blocks of {min(block_topk, visible)} expected, tail "
                         f"{'kept' if tail <= set(valid) else 'missing'}")
    return wrong


def check_attention_calls(report, manifest, host, *, before_failure: bool = False) -> None:
    """V235 over every sparse FA call recorded with its queries' positions."""
    calls = [c for c in host.probe.sparse_calls if c.get("op") == dsa_args.SPARSE_FA_OP and "picked" in c]
    if not calls:
        if not before_failure:
            report.add(QSA_SELECTION, "runtime", False, detail="no QSA sparse attention call was recorded")
        return
    q = manifest.qsa
    wrong = [w for c in calls for w in _selection_problems(c, q.ratio, q.block_topk)]
    report.add(QSA_SELECTION, "runtime", not wrong, detail=wrong[0] if wrong else "", calls=len(calls),
               wrong=len(wrong))


__all__ = ["CPU_BLOCK_TOPK", "HIDDEN_CAN_TIE_TO_HEADS", "SELECTION_CONSTANT", "attention_calls",
           "check_attention_calls", "cpu_narrowed", "cpu_size_changes", "expected_constants", "poison_rejected_drafts",
           "selection_width", "shard_attention", "shrink_notes", "spec_prompts", "tiny_attention_fields",
           "verify_expectation"]
