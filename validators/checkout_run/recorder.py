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
from model_infer_kvcache.analyzer.kv_cache_spec import holds_state
from model_infer_kvcache.analyzer.operators.fa_facts import FA_OP_NAMES, RECORDED_KEYWORDS
from model_infer_kvcache.analyzer.operators.writers import CACHE_WRITERS
from model_infer_kvcache.validators.npu_ops import emulated
from model_infer_kvcache.validators.pipeline import dsa_args
from model_infer_kvcache.validators.pipeline.evidence import snapshot, storage

# writer -> (the cache arguments it writes, the argument holding the slots), by parameter name
WRITERS = {op: (writer.caches, writer.index) for op, writer in CACHE_WRITERS.items()}


def lengths_of(kv) -> list[int] | None:
    """Recorded lengths (a tensor or a list) as a list of ints."""
    return kv.tolist() if isinstance(kv, torch.Tensor) else (list(kv) if kv is not None else None)


@dataclass(frozen=True)
class ForwardSeen:
    """What the engine handed the model for one forward: its kind and the forward metadata (copies)."""

    is_prefill: bool
    is_mtp: bool
    block_table: dict  # group key -> table (every row, padded ones included)
    slot_mapping: dict  # group key -> slots
    kv_lens: list[int]
    cu_kv_lens: list[int]  # the same lengths as prefix sums (the packed TND prefill form)

    def engine_kv(self, kv) -> bool:
        """A call's kv lengths are this forward's as the engine set them (per request, or as the prefix sums the
        packed TND layout takes)."""
        kv = lengths_of(kv)
        return kv is not None and kv in (self.kv_lens, self.cu_kv_lens)

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
    # DSA calls (dsa_args.DSA_OPS), recorded like FA calls: which cache, table, lengths, selection width
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
                "op": name, "step": self.step, "forward": self.forward, "key_storage": storage(key),
                "value_storage": storage(value),
                "key_rope_storage": storage(kwargs.get("key_rope")), "q_shape": tuple(query.shape),
                "block_table": snapshot(kwargs.get("block_table")), "kv_lens": snapshot(kv),
                "has_mask": kwargs.get("atten_mask") is not None,
                **{k: kwargs[k] for k in sorted(RECORDED_KEYWORDS) if k in kwargs},
            })
            result = fn(query, key, value, **kwargs)
            if self.tap is not None:
                self.tap(name, {"query": query, "key": key, "value": value, **kwargs}, result)
            return result

        return call

    def _sparse(self, name, fn):
        def call(*args, **kwargs):
            bound = dsa_args.bind(fn, args, kwargs)
            if bound is None:  # the operator itself reports the bad call
                return fn(*args, **kwargs)
            self.sparse_calls.append({**dsa_args.describe(name, bound), "step": self.step, "forward": self.forward})
            result = fn(*args, **kwargs)
            if name == dsa_args.INDEXER_OP:
                self.sparse_calls[-1].update(dsa_args.selection(bound, result[0]))
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
                                    "storage": storage(bound.get(cache)), "index": snapshot(bound.get(index))})
            result = fn(*args, **kwargs)
            if self.tap is not None:
                self.tap(name, bound, result)
            return result

        return call


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
        for name in dsa_args.DSA_OPS:
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
                    self.by_storage[storage(t)] = CacheSlot(layer.layer_idx, entry.cache_name,
                                                             getattr(entry, "group_key", entry.attn_type),
                                                             entry.attn_type)

    def layers(self) -> set[int]:
        return {s.layer for s in self.by_storage.values()}

    def attention_layers(self) -> list[int]:
        """The layers that attend over a KV cache, in call order (a hybrid's linear layers keep states only)."""
        return sorted({s.layer for s in self.by_storage.values() if not holds_state(s.attn_type)})

    def slot(self, storage: int | None) -> CacheSlot | None:
        return self.by_storage.get(storage) if storage is not None else None
