"""DeepSeek sparse attention: MLA's caches plus the indexer key cache; its calls are the indexer's and the sparse
FA's over its selection (V221, V222: ``validators/pipeline/dsa_args.py``), no FA call."""

from __future__ import annotations

from model_infer_kvcache.validators.kinds.mla import expected_constants, shard_attention
from model_infer_kvcache.validators.pipeline import dsa_args
from model_infer_kvcache.validators.pipeline.evidence import storage


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


__all__ = ["attention_calls", "check_attention_calls", "expected_constants", "shard_attention",
           "shrink_notes", "verify_expectation"]
