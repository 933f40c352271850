"""What the checkout's model passed to the emulated operators: the runtime link's evidence.

``recording_ops()`` wraps the emulated FA and cache-writer operators (``validators.npu_ops.emulated``)
for one scope, before the emulation is installed, so calls through ``torch_npu.<op>`` and through
``torch.ops.npu.<op>`` are both seen. Each record names the cache tensor the call read or wrote by
its storage (``data_ptr``), which ``CacheMap`` turns into (layer, cache entry, group): the model
is observed, never modified.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from model_infer_kvcache.analyzer.operators.fa_facts import FA_OP_NAMES, RECORDED_KEYWORDS
from model_infer_kvcache.analyzer.operators.writers import CACHE_WRITERS
from model_infer_kvcache.validators.npu_ops import emulated

# writer -> (the cache arguments it writes, the argument holding the slots), by parameter name
WRITERS = {op: (writer.caches, writer.index) for op, writer in CACHE_WRITERS.items()}
# DSA: the indexer's top-k selection and the attention over the selected keys (npu_ops.sparse_attention)
INDEXER_OP, SPARSE_FA_OP = "npu_lightning_indexer", "npu_sparse_flash_attention"


def _storage(t) -> int | None:
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) and t.numel() else None


def _copy(t):
    return t.detach().clone() if isinstance(t, torch.Tensor) else (list(t) if t is not None else None)


@dataclass(frozen=True)
class ForwardSeen:
    """What the engine handed the model for one forward: its kind and the forward metadata (copies)."""

    is_prefill: bool
    is_mtp: bool
    block_table: dict  # group key -> table (every row, padded ones included)
    slot_mapping: dict  # group key -> slots
    kv_lens: list[int]
    cu_kv_lens: list[int]  # the same lengths as prefix sums (the packed TND prefill form)

    @classmethod
    def of(cls, model_inputs: dict, is_prefill: bool, is_mtp: bool) -> ForwardSeen:
        fm = model_inputs["forward_metadata"]

        def lengths(t):
            return t.tolist() if t is not None else []

        return cls(bool(is_prefill), bool(is_mtp),
                   {k: v.clone() for k, v in (getattr(fm, "block_table", None) or {}).items()},
                   {k: v.clone() for k, v in (getattr(fm, "slot_mapping", None) or {}).items()},
                   lengths(getattr(fm, "actual_seq_lengths_kv", None)),
                   lengths(getattr(fm, "actual_seq_lengths_cu_kv", None)))


@dataclass
class OpRecorder:
    step: int = -1  # the validation stream's step (-1: warm-up, release run)
    # Every model forward (``engine_run.observed_forwards`` records them, warm-up included): a call names
    # its forward, so the k-th FA call of a forward is decoder layer k and its lengths, table and slots
    # are judged against that forward's metadata, also when an operator stops the run mid-forward.
    forwards: list[ForwardSeen] = field(default_factory=list)
    fa_calls: list[dict] = field(default_factory=list)
    writes: list[dict] = field(default_factory=list)
    # DSA calls (INDEXER_OP, SPARSE_FA_OP), recorded like FA calls: which cache, table, lengths, selection width
    sparse_calls: list[dict] = field(default_factory=list)
    # Localisation's replay: called as tap(op, arguments by name, result) after each FA and writer call.
    tap: object = None

    @property
    def forward(self) -> int:
        return len(self.forwards) - 1

    def _fa(self, name, fn):
        def call(query, key, value, **kwargs):
            kv = kwargs.get("actual_seq_kvlen", kwargs.get("actual_seq_lengths_kv"))
            # Recorded before the operator runs: a call the operator rejects is evidence too.
            self.fa_calls.append({
                "op": name, "step": self.step, "forward": self.forward, "key_storage": _storage(key),
                "value_storage": _storage(value),
                "key_rope_storage": _storage(kwargs.get("key_rope")), "q_shape": tuple(query.shape),
                "block_table": _copy(kwargs.get("block_table")), "kv_lens": _copy(kv),
                "has_mask": kwargs.get("atten_mask") is not None,
                **{k: kwargs[k] for k in sorted(RECORDED_KEYWORDS) if k in kwargs},
            })
            result = fn(query, key, value, **kwargs)
            if self.tap is not None:
                self.tap(name, {"query": query, "key": key, "value": value, **kwargs}, result)
            return result

        return call

    def _sparse(self, name, fn):
        signature = inspect.signature(fn)
        defaults = {k: p.default for k, p in signature.parameters.items() if p.default is not inspect.Parameter.empty}

        def call(*args, **kwargs):
            try:
                bound = signature.bind(*args, **kwargs).arguments
            except TypeError:  # the operator itself reports the bad call
                return fn(*args, **kwargs)
            bound = {**defaults, **bound}
            indices = bound.get("sparse_indices")
            self.sparse_calls.append({
                "op": name, "step": self.step, "forward": self.forward, "key_storage": _storage(bound.get("key")),
                "key_rope_storage": _storage(bound.get("key_rope")), "block_table": _copy(bound.get("block_table")),
                "kv_lens": _copy(bound.get("actual_seq_lengths_kv", bound.get("actual_seq_lengths_key"))),
                "q_shape": tuple(bound["query"].shape) if isinstance(bound.get("query"), torch.Tensor) else None,
                "sparse_mode": bound["sparse_mode"], "scale_value": bound.get("scale_value"),
                "sparse_count": bound.get("sparse_count"),
                "indices_width": indices.shape[-1] if isinstance(indices, torch.Tensor) else None,
            })
            result = fn(*args, **kwargs)
            if name == INDEXER_OP:
                self.sparse_calls[-1].update(_selection(bound, result[0]))
            if self.tap is not None:
                self.tap(name, bound, result)
            return result

        return call

    def _writer(self, name, fn):
        caches, index = WRITERS[name]
        signature = inspect.signature(fn)

        def call(*args, **kwargs):
            try:
                bound = signature.bind(*args, **kwargs).arguments
            except TypeError:  # the operator itself reports the bad call
                return fn(*args, **kwargs)
            for cache in caches:
                self.writes.append({"op": name, "step": self.step, "forward": self.forward,
                                    "storage": _storage(bound.get(cache)), "index": _copy(bound.get(index))})
            result = fn(*args, **kwargs)
            if self.tap is not None:
                self.tap(name, bound, result)
            return result

        return call


def _selection(bound: dict, indices: torch.Tensor) -> dict:
    """How many keys the indexer kept (valid indices) of the causal keys its queries could see: the measure of
    how much the selection dropped (``visible - selected``). TND queries with per-request key lengths only."""
    q, kv = bound.get("actual_seq_lengths_query"), bound.get("actual_seq_lengths_key")
    if bound.get("layout_query") != "TND" or not isinstance(q, torch.Tensor) or not isinstance(kv, torch.Tensor):
        return {}
    cu = [0] + q.tolist()
    visible = 0
    for b, s2 in enumerate(kv.tolist()):
        s1 = cu[b + 1] - cu[b]
        visible += sum(min(s2, s2 - s1 + i + 1) for i in range(s1) if s2 - s1 + i + 1 > 0)
    rows = cu[-1]
    return {"selected": int((indices.reshape(-1, indices.shape[-1])[:rows] != -1).sum()), "visible": visible}


@contextlib.contextmanager
def recording_ops() -> Iterator[OpRecorder]:
    """Record FA and writer calls inside the block (enter before the emulation is installed)."""
    rec = OpRecorder()
    saved = dict(emulated.OPS)
    try:
        for name in sorted(FA_OP_NAMES):
            if name in emulated.OPS:
                emulated.OPS[name] = rec._fa(name, saved[name])
        for name in WRITERS:
            if name in emulated.OPS:
                emulated.OPS[name] = rec._writer(name, saved[name])
        for name in (INDEXER_OP, SPARSE_FA_OP):
            emulated.OPS[name] = rec._sparse(name, saved[name])
        yield rec
    finally:
        emulated.OPS.clear()
        emulated.OPS.update(saved)


@dataclass(frozen=True)
class CacheSlot:
    layer: int
    cache_name: str
    group: str
    attn_type: str


class CacheMap:
    """Cache tensor storage -> the entry of ``get_cache_info()`` it was allocated for."""

    def __init__(self, cache_info):
        self.by_storage: dict[int, CacheSlot] = {}
        for layer in cache_info.layer_infos:
            for entry in layer.caches:
                t = getattr(entry, "tensor", None)
                if isinstance(t, torch.Tensor) and t.numel():
                    self.by_storage[_storage(t)] = CacheSlot(layer.layer_idx, entry.cache_name,
                                                             getattr(entry, "group_key", entry.attn_type),
                                                             entry.attn_type)

    def layers(self) -> set[int]:
        return {s.layer for s in self.by_storage.values()}

    def slot(self, storage: int | None) -> CacheSlot | None:
        return self.by_storage.get(storage) if storage is not None else None
