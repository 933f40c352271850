"""DeepSeek sparse attention: MLA's caches plus the indexer key cache; its calls are the indexer's and the sparse
FA's over its selection (V221, V222: ``validators/pipeline/dsa_args.py``), no FA call."""

from __future__ import annotations

from model_infer_kvcache.validators.kinds import mla
from model_infer_kvcache.validators.kinds.mla import (
    HIDDEN_CAN_TIE_TO_HEADS,
    expected_constants,
    poison_rejected_drafts,
    shard_attention,
    spec_prompts,
)
from model_infer_kvcache.validators.pipeline import dsa_args
from model_infer_kvcache.validators.pipeline.evidence import storage

# the indexer keeps this many keys per query on CPU (the stream's prompts are 40..300 tokens), so the selection
# drops keys on every request but the shortest; the real index_topk (2048) would keep them all
CPU_INDEX_TOPK = 64


def tiny_attention_fields(d: dict, manifest, *, head_dim_from_hidden: bool) -> None:
    """MLA's, and the manifest's selection width, like its window (``cpu_sized``)."""
    mla.tiny_attention_fields(d, manifest, head_dim_from_hidden=head_dim_from_hidden)
    d["index_topk"] = manifest.dsa.index_topk


def cpu_narrowed(manifest) -> dict[str, dict]:
    """A selection wider than CPU prompts is narrowed, so the indexer drops keys."""
    return {"dsa": {"index_topk": CPU_INDEX_TOPK}} if manifest.dsa.index_topk > CPU_INDEX_TOPK else {}


def selection_width(manifest) -> int:
    """The indexer's top-k, the width ``cpu_narrowed`` narrows."""
    return manifest.dsa.index_topk


def cpu_size_changes(manifest, small) -> list[str]:
    top, narrow = manifest.dsa.index_topk, small.dsa.index_topk
    return [f"index_topk {top} -> {narrow}"] if top != narrow else []


def attention_calls(probe) -> list[dict]:
    return probe.sparse_calls


def verify_expectation(manifest, plan) -> tuple[int, bool]:
    """The indexer and the sparse FA of a verify step: rightDownCausal, no mask, as at q_len 2."""
    return dsa_args.CAUSAL, False


def shrink_notes(manifest, short) -> list[str]:
    """What a CPU-sized copy of the manifest (checkout run) changed about this kind: a top-k wider than CPU prompts
    is narrowed so the selection drops keys."""
    if short.dsa.index_topk == manifest.dsa.index_topk:
        return []
    return [f"index_topk {manifest.dsa.index_topk} is wider than CPU prompts: the tiny config and the manifest the run "
            f"is judged by carry index_topk {short.dsa.index_topk}, so the indexer's selection drops keys"]


def check_attention_calls(report, manifest, host, *, before_failure: bool = False) -> None:
    calls = [c for c in host.probe.sparse_calls if c.get("layer") is not None]
    if before_failure:
        if not calls or any(c.name in (dsa_args.SPARSE_ARGS, dsa_args.INDEXER_READS) for c in report.checks):
            return
        report.notes.append(f"the run stopped at an operator error; the DSA argument checks judge the {len(calls)} "
                            "indexer and sparse-attention calls made up to it")
    complete = not before_failure
    dsa_args.check_sparse_args(report, manifest, [c for c in calls if c["op"] == dsa_args.SPARSE_FA_OP],
                               complete=complete)
    own = {a.layer_idx: storage(getattr(a, "indexer_key_cache", None)) for a in host.attentions}
    dsa_args.check_rendered_indexer(report, manifest, [c for c in calls if c["op"] == dsa_args.INDEXER_OP], own.get,
                                    complete=complete)


__all__ = ["CPU_INDEX_TOPK", "HIDDEN_CAN_TIE_TO_HEADS", "attention_calls", "check_attention_calls", "cpu_narrowed",
           "cpu_size_changes", "expected_constants", "selection_width", "tiny_attention_fields", "shard_attention",
           "poison_rejected_drafts", "shrink_notes", "spec_prompts",
           "verify_expectation"]
