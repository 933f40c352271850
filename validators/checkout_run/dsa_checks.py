"""The runtime link of DeepSeek sparse attention (DSA) in a checkout run.

A DSA layer makes two calls per forward instead of one FA call: ``npu_lightning_indexer`` over the layer's
indexer key cache (the top ``index_topk`` keys per query) and ``npu_sparse_flash_attention`` over its MLA
caches (only those keys). The sparse attention calls take the FA calls' place in the generic checks (each
layer reads its own cache, with its group's table and the engine's kv lengths); this module judges what is
DSA's own: the selection width, the causal mode, the scale, and which cache each layer's indexer reads.
"""

from __future__ import annotations

from model_infer_kvcache.analyzer.manifest import INDEXER_KEY_CACHE, SelectionManifest
from model_infer_kvcache.validators.checkout_run.recorder import CacheMap, OpRecorder, lengths_of
from model_infer_kvcache.validators.pipeline import dsa_args
from model_infer_kvcache.validators.pipeline.report import Report


def sparse_fa_calls(rec: OpRecorder) -> list[dict]:
    return [c for c in rec.sparse_calls if c["op"] == dsa_args.SPARSE_FA_OP]


def check_indexer_calls(report: Report, manifest: SelectionManifest, rec: OpRecorder, caches: CacheMap,
                        steps: set[int] | None, n_layers: int) -> None:
    """Each forward's k-th indexer call belongs to the k-th layer (of the run's ``n_layers``) that runs its own
    indexer: it reads that layer's indexer key cache with its group's table and the engine's kv lengths, and
    keeps ``index_topk`` keys causally. ``steps``: the validation steps (None: every recorded forward, the
    calls up to an operator error)."""
    layers = [i for i in manifest.dsa.indexer_layers if i < n_layers]
    index_topk = manifest.dsa.index_topk
    by_forward: dict[int, list[dict]] = {}
    for c in rec.sparse_calls:
        if c["op"] != dsa_args.INDEXER_OP or c["forward"] < 0 or rec.forwards[c["forward"]].is_mtp:
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
            if table is None or not dsa_args.same(c["block_table"], table):
                wrong.append(f"{at} layer {layer}: the indexer's block_table is not {slot.group!r}'s")
            if not seen.engine_kv(c["kv_lens"]):
                kv = lengths_of(c["kv_lens"])
                wrong.append(f"{at} layer {layer}: indexer kv lengths {kv and kv[:6]} != {seen.kv_lens[:6]}")
            wrong += dsa_args.indexer_problems({**c, "at": at, "layer": layer}, index_topk)
    calls = [c for v in by_forward.values() for c in v]
    dsa_args.report_indexer(report, calls, wrong, complete=steps is not None, notes=steps is not None)
