"""The runtime link of DeepSeek sparse attention (DSA) in a checkout run.

A DSA layer makes two calls per forward instead of one FA call: ``npu_lightning_indexer`` over the layer's
indexer key cache (the top ``index_topk`` keys per query) and ``npu_sparse_flash_attention`` over its MLA
caches (only those keys). The sparse attention calls take the FA calls' place in the generic checks (each
layer reads its own cache, with its group's table and the engine's kv lengths); this module judges what is
DSA's own: the selection width, the causal mode, the scale, and which cache each layer's indexer reads.
"""

from __future__ import annotations

import torch
from model_infer_kvcache.analyzer.manifest import INDEXER_KEY_CACHE, SelectionManifest
from model_infer_kvcache.validators.checkout_run.recorder import (
    INDEXER_OP,
    SPARSE_FA_OP,
    CacheMap,
    OpRecorder,
)
from model_infer_kvcache.validators.pipeline.report import Report

SPARSE_ARGS = "sparse attention: scale, causal sparse_mode 3 and index_topk keys per query as the manifest"
INDEXER_READS = ("each indexer layer's lightning indexer reads that layer's indexer key cache (own table, kv "
                 "lengths, sparse_count = index_topk)")
CAUSAL = 3  # rightDownCausal: a query selects / attends only keys up to its own position


def sparse_fa_calls(rec: OpRecorder) -> list[dict]:
    return [c for c in rec.sparse_calls if c["op"] == SPARSE_FA_OP]


def check_sparse_args(report: Report, manifest: SelectionManifest, calls: list[dict], index_topk: int,
                      *, complete: bool) -> None:
    """The attributed sparse-FA calls against the manifest: scale (``fa.softmax_scale``, the MLA scale with
    its mscale), ``sparse_mode`` 3, ``index_topk`` indices per query (the run's config value)."""
    want_scale = manifest.fa.softmax_scale
    wrong = []
    for c in calls:
        where = f"{c['at']} layer {c['layer']}"
        scale = c.get("scale_value")
        if not isinstance(scale, (int, float)) or abs(scale - want_scale) > 1e-12 * max(1.0, abs(want_scale)):
            wrong.append(f"{where}: scale_value {scale} != {want_scale}")
        if c.get("sparse_mode") != CAUSAL:
            wrong.append(f"{where}: sparse_mode {c.get('sparse_mode')} != {CAUSAL} (causal)")
        if c.get("indices_width") != index_topk:
            wrong.append(f"{where}: sparse_indices hold {c.get('indices_width')} keys per query, index_topk is "
                         f"{index_topk}")
    if calls or complete:
        report.add(SPARSE_ARGS, "runtime", not wrong and bool(calls), detail="; ".join(wrong[:3]),
                   calls=len(calls), mismatches=len(wrong), index_topk=index_topk)


def check_indexer_calls(report: Report, manifest: SelectionManifest, rec: OpRecorder, caches: CacheMap,
                        steps: set[int] | None, n_layers: int, index_topk: int) -> None:
    """Each forward's k-th indexer call belongs to the k-th layer (of the run's ``n_layers``) that runs its own
    indexer: it reads that layer's indexer key cache with its group's table and the engine's kv lengths, and
    keeps ``index_topk`` keys causally. ``steps``: the validation steps (None: every recorded forward, the
    calls up to an operator error)."""
    layers = [i for i in manifest.dsa.indexer_layers if i < n_layers]
    by_forward: dict[int, list[dict]] = {}
    for c in rec.sparse_calls:
        if c["op"] != INDEXER_OP or c["forward"] < 0 or rec.forwards[c["forward"]].is_mtp:
            continue
        if steps is None or c["step"] in steps:
            by_forward.setdefault(c["forward"], []).append(c)
    wrong = []
    for forward, calls in sorted(by_forward.items()):
        seen = rec.forwards[forward]
        at = f"step {calls[0]['step']}" if calls[0]["step"] >= 0 else "warm-up"
        if steps is not None and len(calls) != len(layers):
            wrong.append(f"{at}: {len(calls)} indexer calls for {len(layers)} indexer layers")
        for layer, c in zip(layers, calls, strict=False):
            slot = caches.slot(c["key_storage"])
            if slot is None or slot.layer != layer or slot.cache_name != INDEXER_KEY_CACHE:
                got = f"layer {slot.layer}'s {slot.cache_name}" if slot else "no allocated cache tensor"
                wrong.append(f"{at} layer {layer}: the indexer reads {got}, not its own {INDEXER_KEY_CACHE}")
                continue
            table = seen.block_table.get(slot.group)
            got = c["block_table"]
            if table is None or got is None or got.shape != table.shape or not torch.equal(got.to(table.dtype), table):
                wrong.append(f"{at} layer {layer}: the indexer's block_table is not {slot.group!r}'s")
            kv = c["kv_lens"].tolist() if isinstance(c["kv_lens"], torch.Tensor) else c["kv_lens"]
            if kv is None or list(kv) not in (seen.kv_lens, seen.cu_kv_lens):
                wrong.append(f"{at} layer {layer}: indexer kv lengths {kv and list(kv)[:6]} != {seen.kv_lens[:6]}")
            if c.get("sparse_count") != index_topk:
                wrong.append(f"{at} layer {layer}: sparse_count {c.get('sparse_count')} != index_topk {index_topk}")
            if c.get("sparse_mode") != CAUSAL:
                wrong.append(f"{at} layer {layer}: indexer sparse_mode {c.get('sparse_mode')} != {CAUSAL} (causal)")
    calls = sum(len(v) for v in by_forward.values())
    selected = sum(c.get("selected", 0) for v in by_forward.values() for c in v)
    visible = sum(c.get("visible", 0) for v in by_forward.values() for c in v)
    dropped = round(1 - selected / visible, 4) if visible else None
    if calls or steps is not None:
        report.add(INDEXER_READS, "runtime", not wrong and bool(calls), detail="; ".join(wrong[:3]),
                   calls=calls, mismatches=len(wrong), keys_dropped=dropped)
    if steps is not None and dropped is not None:
        report.notes.append(f"the indexer kept {selected} of the {visible} causal keys its queries could see "
                            f"({dropped:.1%} dropped, index_topk {index_topk})"
                            + ("" if selected < visible else ": the selection dropped nothing, so the run did not "
                               "exercise it"))
