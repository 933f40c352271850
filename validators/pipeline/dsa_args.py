"""DeepSeek sparse attention's runtime evidence and its argument checks, for rendered and checkout runs alike.

A DSA layer makes two calls per forward where other designs make one FA call: ``npu_lightning_indexer`` (the top
``index_topk`` keys per query, over the layer's indexer key cache) and ``npu_sparse_flash_attention`` (MLA absorb
over those keys only). ``describe(op, arguments)`` turns one call into a record; ``check_sparse_args`` (V221) and
``check_indexer_args`` (V222's argument half) judge the records against the manifest the run was rendered from.
"""

from __future__ import annotations

import functools
import inspect

import torch
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from model_infer_kvcache.analyzer.operators.fa_facts import SPARSE_FA
from model_infer_kvcache.validators.pipeline.evidence import snapshot, storage
from model_infer_kvcache.validators.pipeline.report import Report

INDEXER_OP, SPARSE_FA_OP = "npu_lightning_indexer", SPARSE_FA.op
DSA_OPS = (INDEXER_OP, SPARSE_FA_OP)
SPARSE_ARGS = "sparse attention: scale, causal sparse_mode 3 and index_topk keys per query as the manifest"
INDEXER_READS = ("each indexer layer's lightning indexer reads that layer's indexer key cache (own table, kv "
                 "lengths, sparse_count = index_topk)")
CAUSAL = SPARSE_FA.sparse_mode  # rightDownCausal: a query selects / attends only keys up to its own position


@functools.cache
def _signature(fn) -> inspect.Signature:
    return inspect.signature(fn)


def bind(fn, args: tuple, kwargs: dict) -> dict | None:
    """The call's arguments by name, defaults filled in; None when they do not bind (the op reports it)."""
    try:
        bound = _signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError):  # a bad call, or an operator without a Python signature (the device build)
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def describe(op: str, a: dict) -> dict:
    """One DSA call as evidence: the cache it read (storage), its table and lengths, mode, scale, width."""
    indices = a.get("sparse_indices")
    return {
        "op": op, "key_storage": storage(a.get("key")), "key_rope_storage": storage(a.get("key_rope")),
        "block_table": snapshot(a.get("block_table")),
        "kv_lens": snapshot(a.get("actual_seq_lengths_kv", a.get("actual_seq_lengths_key"))),
        "q_shape": tuple(a["query"].shape) if isinstance(a.get("query"), torch.Tensor) else None,
        "sparse_mode": a.get("sparse_mode"), "scale_value": a.get("scale_value"),
        "sparse_count": a.get("sparse_count"),
        "indices_width": indices.shape[-1] if isinstance(indices, torch.Tensor) else None,
    }


def selection(a: dict, indices: torch.Tensor) -> dict:
    """How many keys the indexer kept (valid indices) of the causal keys its queries could see: the measure of
    how much the selection dropped (``visible - selected``). TND queries with per-request key lengths only."""
    q, kv = a.get("actual_seq_lengths_query"), a.get("actual_seq_lengths_key")
    if a.get("layout_query") != "TND" or not isinstance(q, torch.Tensor) or not isinstance(kv, torch.Tensor):
        return {}
    cu = [0] + q.tolist()
    visible = 0
    for b, s2 in enumerate(kv.tolist()):
        s1 = cu[b + 1] - cu[b]
        visible += sum(min(s2, s2 - s1 + i + 1) for i in range(s1) if s2 - s1 + i + 1 > 0)
    rows = cu[-1]
    return {"selected": int((indices.reshape(-1, indices.shape[-1])[:rows] != -1).sum()), "visible": visible}


def sparse_rows(a: dict) -> dict:
    """A TND sparse FA call's indices per query (KV head 0's) and each query's position in its request (its KV length
    less the queries after it): what a block selection is judged by (validators/kinds/qsa.py V235)."""
    q, kv, indices = a.get("actual_seq_lengths_query"), a.get("actual_seq_lengths_kv"), a.get("sparse_indices")
    if a.get("layout_query") != "TND" or not all(isinstance(x, torch.Tensor) for x in (q, kv, indices)):
        return {}
    cu = [0] + q.tolist()
    positions = [n - (cu[b + 1] - cu[b]) + i for b, n in enumerate(kv.tolist()) for i in range(cu[b + 1] - cu[b])]
    return {"picked": indices[:len(positions), 0].tolist(), "positions": positions}


def _where(c: dict) -> str:
    return f"{c.get('at') or ('step ' + str(c.get('step')))} layer {c.get('layer')}"


def check_sparse_args(report: Report, manifest: SelectionManifest, calls: list[dict], *, complete: bool = True) -> None:
    """V221: every sparse-FA call against the manifest: scale (``fa.softmax_scale``, the MLA scale with its
    mscale), ``sparse_mode`` 3, ``dsa.index_topk`` indices per query (the run's manifest: a CPU run's is narrowed,
    ``tiny_model.cpu_sized``). ``complete``: a run without such a call fails (else the check is left out)."""
    want_scale, index_topk = manifest.fa.softmax_scale, manifest.dsa.index_topk
    wrong = []
    for c in calls:
        scale = c.get("scale_value")
        if not isinstance(scale, (int, float)) or abs(scale - want_scale) > 1e-12 * max(1.0, abs(want_scale)):
            wrong.append(f"{_where(c)}: scale_value {scale} != {want_scale}")
        if c.get("sparse_mode") != CAUSAL:
            wrong.append(f"{_where(c)}: sparse_mode {c.get('sparse_mode')} != {CAUSAL} (causal)")
        if c.get("indices_width") != index_topk:
            wrong.append(f"{_where(c)}: sparse_indices hold {c.get('indices_width')} keys per query, index_topk is "
                         f"{index_topk}")
    if calls or complete:
        report.add(SPARSE_ARGS, "runtime", not wrong and bool(calls), detail="; ".join(wrong[:3]),
                   calls=len(calls), mismatches=len(wrong), index_topk=index_topk)


def indexer_problems(c: dict, index_topk: int) -> list[str]:
    """What an indexer call's own arguments get wrong (width, mode); the caller judges cache, table, lengths."""
    out = []
    if c.get("sparse_count") != index_topk:
        out.append(f"{_where(c)}: sparse_count {c.get('sparse_count')} != index_topk {index_topk}")
    if c.get("sparse_mode") != CAUSAL:
        out.append(f"{_where(c)}: indexer sparse_mode {c.get('sparse_mode')} != {CAUSAL} (causal)")
    return out


def report_indexer(report: Report, calls: list[dict], wrong: list[str], *, complete: bool, notes: bool) -> None:
    """V222 with the keys dropped measured; ``notes``: also say it in a note (once per run)."""
    selected = sum(c.get("selected", 0) for c in calls)
    visible = sum(c.get("visible", 0) for c in calls)
    dropped = round(1 - selected / visible, 4) if visible else None
    if calls or complete:
        report.add(INDEXER_READS, "runtime", not wrong and bool(calls), detail="; ".join(wrong[:3]),
                   calls=len(calls), mismatches=len(wrong), keys_dropped=dropped)
    if notes and dropped is not None:
        report.notes.append(f"the indexer kept {selected} of the {visible} causal keys its queries could see "
                            f"({dropped:.1%} dropped)"
                            + ("" if selected < visible else ": the selection dropped nothing, so the run did not "
                               "exercise it"))


def same(got, want) -> bool:
    """Two tables / length lists hold the same integers (tensors or lists; None only equals None)."""
    if got is None or want is None:
        return got is None and want is None
    got, want = torch.as_tensor(got).reshape(-1).long(), torch.as_tensor(want).reshape(-1).long()
    return got.shape == want.shape and torch.equal(got.cpu(), want.cpu())


def rendered_call(op: str, a: dict, forward_metadata, layer_record: dict) -> dict:
    """A rendered layer's DSA call as evidence, with whether its table and kv lengths are the step's own
    (``forward_metadata`` as the validation step built it; the table of the layer's group in framework mode)."""
    rec = {**describe(op, a), "layer": layer_record.get("layer"), "is_prefill": layer_record.get("is_prefill")}
    tables = forward_metadata.block_table
    want = tables.get(layer_record.get("attn_type")) if isinstance(tables, dict) else tables
    rec["table_ok"] = same(a.get("block_table"), want)
    rec["kv_ok"] = same(rec["kv_lens"], forward_metadata.actual_seq_lengths_kv)
    return rec


def check_rendered_indexer(report: Report, manifest: SelectionManifest, calls: list[dict], own_storage, *,
                           complete: bool = True) -> None:
    """V222 for a rendered run: each indexer call reads the calling layer's ``indexer_key_cache``
    (``own_storage(layer)``) with the table and lengths of the step's metadata (recorded as ``table_ok`` /
    ``kv_ok`` when the call was made), and keeps ``index_topk`` keys causally."""
    wrong = []
    for c in calls:
        if c.get("key_storage") != own_storage(c.get("layer")):
            wrong.append(f"{_where(c)}: the indexer reads no indexer_key_cache of its own layer")
        if not c.get("table_ok", True):
            wrong.append(f"{_where(c)}: the indexer's block_table is not the step's table of its group")
        if not c.get("kv_ok", True):
            wrong.append(f"{_where(c)}: indexer kv lengths differ from the step's actual_seq_lengths_kv")
        wrong += indexer_problems(c, manifest.dsa.index_topk)
    report_indexer(report, calls, wrong, complete=complete, notes=complete)
