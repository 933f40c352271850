"""DeepSeek sparse attention (DSA): ``npu_lightning_indexer`` selects, ``npu_sparse_flash_attention`` attends.

Doc (torch-npu 2.9.0 / 2.14.0 ``_op_plugin_docs.py``; the score formula from the quantized variant's doc,
``ops/ascendc/docs/custom-npu_quant_lightning_indexer.md`` of cann-recipes-infer, less its dequant scales):

* ``npu_lightning_indexer``: per query token and key head ``n2``, ``score_j = sum over the query heads g of
  group n2 of weights[g] * ReLU(query[g] . key_j)`` over the request's keys (``sparse_mode=3``: rightDownCausal,
  query ``i`` of ``S1`` sees keys ``j <= S2 - S1 + i``; ``0``: every key); out: the indices of the
  ``sparse_count`` largest scores, ``[B, S1, N2, sparse_count]`` (BSND) or ``[T1, N2, sparse_count]`` (TND),
  int32. The op applies no scale: a positive factor (transformers' ``softmax_scale * n_heads**-0.5``) does not
  change the selection.
* ``npu_sparse_flash_attention``: per query token, softmax attention over the keys its ``sparse_indices`` row
  names (``sparse_block_size=1``: token positions in the request's sequence, read through ``block_table`` for
  ``PA_BSND``), ``scale_value`` times ``query . key`` (+ ``query_rope . key_rope``: MLA), under the same
  ``sparse_mode``; ``attention_mode=2`` is MLA absorb (key and value are one tensor).

Fixed rules, not switches (references/emulated_ops.md): a row with fewer selectable keys than
``sparse_count`` is filled with -1 after its valid indices, in descending score order, and the attention
treats -1 as "no key" -- the sparse-attention doc requires valid indices first and invalid ones after, and
upstream deepseek_v3_2_exp feeds the indexer's output to the attention unchanged and writes -1 itself for
invalid entries (its offload path), so any other fill would break every prompt shorter than ``sparse_count``
there. A row without a valid key outputs 0 (as the FA emulation's keyless rows). Enforced: ranks and shapes
of every input against each other, int32 lengths / tables / indices, prefix-sum lengths for TND, a block
table for ``PA_BSND``, ``sparse_count`` 1..2048, ``sparse_mode`` 0/3, indices inside the request's keys.
Refused as not emulated: ``pre_tokens`` / ``next_tokens`` other than their defaults, ``return_value`` /
``return_softmax_lse``, ``sparse_block_size`` other than 1. torch_npu's quantized variants
(``npu_quant_lightning_indexer``, ``npu_kv_quant_sparse_flash_attention``) are not emulated at all; the checkout's
own ``custom.npu_quant_lightning_indexer`` (DeepSeek-V4) is, in ``custom_ops``, with this module's length rules.
"""

from __future__ import annotations

import torch
from model_infer_kvcache.validators.npu_ops import op_checks as chk
from model_infer_kvcache.validators.npu_ops.errors import NpuOpError, UnemulatedFeatureError

LI = "npu_lightning_indexer"
SFA = "npu_sparse_flash_attention"
INT64_MAX = 9223372036854775807
SPARSE_COUNT_MAX = 2048
SPARSE_MODES = (0, 3)
INVALID = -1  # the fill of an index row past its valid entries (module docstring)


def _lengths(op: str, name: str, value, batch: int | None, *, prefix_sum: bool) -> list[int] | None:
    """Per-request lengths from an int32 1-D tensor (``prefix_sum``: TND cumulative lengths, differenced)."""
    if value is None:
        return None
    t = chk.tensor(op, name, value, dims=(1,), dtypes=(torch.int32,))
    vals = [int(v) for v in t.tolist()]
    if batch is not None and len(vals) != batch:
        raise NpuOpError(op, name, f"has {len(vals)} entries for a batch of {batch}")
    if any(v < 0 for v in vals):
        raise NpuOpError(op, name, f"holds a negative length: {vals}")
    if not prefix_sum:
        return vals
    if any(b < a for a, b in zip(vals, vals[1:], strict=False)):
        raise NpuOpError(op, name, f"must be prefix sums (non-decreasing) for TND, got {vals}")
    return [b - a for a, b in zip([0] + vals[:-1], vals, strict=True)]


def _query_rows(op: str, query: torch.Tensor, layout: str, actual_q) -> tuple[list[int], list[int], int]:
    """(per-request query lengths, per-request first row in the flattened [rows, ...] view, batch)."""
    if layout == "TND":
        if actual_q is None:
            raise NpuOpError(op, "actual_seq_lengths_query", "is required when layout_query is TND")
        lens = _lengths(op, "actual_seq_lengths_query", actual_q, None, prefix_sum=True)
        if sum(lens) > query.shape[0]:
            raise NpuOpError(op, "actual_seq_lengths_query", f"sums to {sum(lens)} > query's T {query.shape[0]}")
        starts = [sum(lens[:b]) for b in range(len(lens))]
        return lens, starts, len(lens)
    batch, s1 = query.shape[0], query.shape[1]
    lens = _lengths(op, "actual_seq_lengths_query", actual_q, batch, prefix_sum=False) or [s1] * batch
    if any(v > s1 for v in lens):
        raise NpuOpError(op, "actual_seq_lengths_query", f"{lens} exceeds query's S {s1}")
    return lens, [b * s1 for b in range(batch)], batch


class _Keys:
    """A key (or value) tensor of one of the layouts, read per request as ``[S2_b, N2, D]``."""

    def __init__(self, op: str, name: str, t: torch.Tensor, layout: str, batch: int, actual_kv, block_table,
                 lens_name: str):
        self.t, self.layout = t, layout
        if layout == "PA_BSND":
            chk.tensor(op, name, t, dims=(4,))
            if block_table is None:
                raise NpuOpError(op, "block_table", f"is required when {name}'s layout is PA_BSND")
            table = chk.tensor(op, "block_table", block_table, dims=(2,), dtypes=(torch.int32,))
            if table.shape[0] != batch:
                raise NpuOpError(op, "block_table", f"has {table.shape[0]} rows for a batch of {batch}")
            if actual_kv is None:
                raise NpuOpError(op, lens_name, f"is required when {name}'s layout is PA_BSND")
            self.lens = _lengths(op, lens_name, actual_kv, batch, prefix_sum=False)
            block_size = t.shape[1]
            need = max([-(-n // block_size) for n in self.lens] + [0])
            if table.shape[1] < need:
                raise NpuOpError(op, "block_table", f"has {table.shape[1]} columns; the longest request needs {need}")
            used = table[:, :need]
            if used.numel() and (int(used.min()) < 0 or int(used.max()) >= t.shape[0]):
                raise NpuOpError(op, "block_table", f"names a block outside {name}'s {t.shape[0]} blocks")
            self.table, self.block_size = table, block_size
            self.heads, self.dim = t.shape[2], t.shape[3]
        elif layout == "BSND":
            chk.tensor(op, name, t, dims=(4,))
            if t.shape[0] != batch:
                raise NpuOpError(op, name, f"has batch {t.shape[0]}, the query {batch}")
            self.lens = _lengths(op, lens_name, actual_kv, batch, prefix_sum=False) or [t.shape[1]] * batch
            if any(v > t.shape[1] for v in self.lens):
                raise NpuOpError(op, lens_name, f"{self.lens} exceeds {name}'s S {t.shape[1]}")
            self.heads, self.dim = t.shape[2], t.shape[3]
        else:  # TND
            chk.tensor(op, name, t, dims=(3,))
            if actual_kv is None:
                raise NpuOpError(op, lens_name, f"is required when {name}'s layout is TND")
            self.lens = _lengths(op, lens_name, actual_kv, batch, prefix_sum=True)
            if sum(self.lens) > t.shape[0]:
                raise NpuOpError(op, lens_name, f"sums to {sum(self.lens)} > {name}'s T {t.shape[0]}")
            self.starts = [sum(self.lens[:b]) for b in range(batch)]
            self.heads, self.dim = t.shape[1], t.shape[2]

    def positions(self, b: int, idx: torch.Tensor) -> torch.Tensor:
        """Rows of the flattened ``[*, N2, D]`` view holding request ``b``'s tokens ``idx``."""
        if self.layout == "PA_BSND":
            return self.table[b].long()[idx // self.block_size] * self.block_size + idx % self.block_size
        if self.layout == "BSND":
            return b * self.t.shape[1] + idx
        return self.starts[b] + idx

    def flat(self) -> torch.Tensor:
        return self.t.reshape(-1, self.heads, self.dim)


def _defaults_only(op: str, **values) -> None:
    for name, value in values.items():
        if value != INT64_MAX:
            raise UnemulatedFeatureError(op, name, f"{value} is not emulated (only the default 2^63-1)")


def _visible(q_len: int, kv_len: int, mode: int) -> torch.Tensor:
    """[q_len, kv_len] bool: key j visible to query i (mode 3: rightDownCausal; mode 0: all)."""
    j = torch.arange(kv_len).view(1, -1)
    if mode == 0:
        return torch.ones(q_len, kv_len, dtype=torch.bool)
    return j <= (kv_len - q_len + torch.arange(q_len)).view(-1, 1)


def npu_lightning_indexer(query, key, weights, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
                          block_table=None, layout_query="BSND", layout_key="BSND", sparse_count=2048, sparse_mode=3,
                          pre_tokens=INT64_MAX, next_tokens=INT64_MAX, return_value=False):
    """``(sparse_indices, sparse_values)``: the top ``sparse_count`` key positions per query token and key head
    (-1 past a row's valid entries); ``sparse_values`` is empty (``return_value`` is refused)."""
    op = LI
    chk.choice(op, "layout_query", layout_query, ("BSND", "TND"))
    chk.choice(op, "layout_key", layout_key, ("PA_BSND", "BSND", "TND"))
    if layout_key != "PA_BSND" and layout_key != layout_query:
        raise NpuOpError(op, "layout_key", f"{layout_key!r} must equal layout_query {layout_query!r} outside "
                                           "PageAttention (PA_BSND)")
    chk.integer(op, "sparse_count", sparse_count, low=1, high=SPARSE_COUNT_MAX)
    chk.choice(op, "sparse_mode", sparse_mode, SPARSE_MODES)
    _defaults_only(op, pre_tokens=pre_tokens, next_tokens=next_tokens)
    if return_value:
        raise UnemulatedFeatureError(op, "return_value", "True is not emulated")
    dtypes = chk.FLOAT_DTYPES
    chk.tensor(op, "query", query, dims=(4,) if layout_query == "BSND" else (3,), dtypes=dtypes)
    chk.tensor(op, "key", key, dtypes=dtypes)
    chk.same_dtype(op, "key", key, "query", query)
    q_lens, q_starts, batch = _query_rows(op, query, layout_query, actual_seq_lengths_query)
    keys = _Keys(op, "key", key, layout_key, batch, actual_seq_lengths_key, block_table, "actual_seq_lengths_key")
    n1, d = query.shape[-2], query.shape[-1]
    if keys.dim != d:
        raise NpuOpError(op, "key", f"head dim {keys.dim} must equal query's {d}")
    if n1 % keys.heads:
        raise NpuOpError(op, "key", f"{keys.heads} heads do not divide the query's {n1}")
    w_shape = tuple(query.shape[:-1])
    chk.tensor(op, "weights", weights, dtypes=dtypes)
    if tuple(weights.shape) != w_shape:
        raise NpuOpError(op, "weights", f"shape {tuple(weights.shape)} must be {w_shape} ([B,S1,N1] / [T,N1])")
    cdt = chk.compute_dtype(query.dtype)
    q = query.reshape(-1, n1, d).to(cdt)
    w = weights.reshape(-1, n1).to(cdt)
    n2, group = keys.heads, n1 // keys.heads
    out = torch.full((q.shape[0], n2, sparse_count), INVALID, dtype=torch.int32)
    flat = keys.flat()
    for b in range(batch):
        s1, s2 = q_lens[b], keys.lens[b]
        if s1 == 0 or s2 == 0:
            continue
        rows = slice(q_starts[b], q_starts[b] + s1)
        k = flat[keys.positions(b, torch.arange(s2))].to(cdt)  # [S2, N2, D]
        qb = q[rows].view(s1, n2, group, d)
        dots = torch.einsum("sngd,tnd->sngt", qb, k).relu()
        scores = torch.einsum("sng,sngt->snt", w[rows].view(s1, n2, group), dots)
        hidden = ~_visible(s1, s2, sparse_mode)
        scores = scores.masked_fill(hidden.view(s1, 1, s2), float("-inf"))
        top = scores.topk(min(sparse_count, s2), dim=-1)
        idx = torch.where(torch.isinf(top.values), torch.full_like(top.indices, INVALID), top.indices)
        out[rows, :, : idx.shape[-1]] = idx.to(torch.int32)
    if layout_query == "BSND":
        out = out.view(query.shape[0], query.shape[1], n2, sparse_count)
    return out, torch.empty(0, dtype=query.dtype)


def npu_sparse_flash_attention(query, key, value, sparse_indices, scale_value, *, block_table=None,
                               actual_seq_lengths_query=None, actual_seq_lengths_kv=None, query_rope=None,
                               key_rope=None, sparse_block_size=1, layout_query="BSND", layout_kv="BSND",
                               sparse_mode=3, pre_tokens=INT64_MAX, next_tokens=INT64_MAX, attention_mode=0,
                               return_softmax_lse=False):
    """``(attention_out, softmax_max, softmax_sum)``: attention over the selected keys; the lse outputs are empty
    (``return_softmax_lse`` is refused)."""
    op = SFA
    chk.choice(op, "layout_query", layout_query, ("BSND", "TND"))
    chk.choice(op, "layout_kv", layout_kv, ("PA_BSND", "BSND", "TND"))
    chk.choice(op, "sparse_mode", sparse_mode, SPARSE_MODES)
    chk.choice(op, "attention_mode", attention_mode, (0, 2))
    if chk.integer(op, "sparse_block_size", sparse_block_size, low=1) != 1:
        raise UnemulatedFeatureError(op, "sparse_block_size", f"{sparse_block_size} is not emulated (only 1: "
                                                              "indices name tokens)")
    _defaults_only(op, pre_tokens=pre_tokens, next_tokens=next_tokens)
    if return_softmax_lse:
        raise UnemulatedFeatureError(op, "return_softmax_lse", "True is not emulated")
    if isinstance(scale_value, bool) or not isinstance(scale_value, (int, float)):
        raise NpuOpError(op, "scale_value", f"must be a float, got {type(scale_value).__name__}")
    dtypes = chk.FLOAT_DTYPES
    chk.tensor(op, "query", query, dims=(4,) if layout_query == "BSND" else (3,), dtypes=dtypes)
    for name, t in (("key", key), ("value", value)):
        chk.tensor(op, name, t, dtypes=dtypes)
        chk.same_dtype(op, name, t, "query", query)
    if attention_mode == 2 and not (value.data_ptr() == key.data_ptr() and value.shape == key.shape):
        raise NpuOpError(op, "value", "attention_mode=2 (MLA absorb) takes key and value as one tensor")
    q_lens, q_starts, batch = _query_rows(op, query, layout_query, actual_seq_lengths_query)
    keys = _Keys(op, "key", key, layout_kv, batch, actual_seq_lengths_kv, block_table, "actual_seq_lengths_kv")
    values = _Keys(op, "value", value, layout_kv, batch, actual_seq_lengths_kv, block_table, "actual_seq_lengths_kv")
    n1, d = query.shape[-2], query.shape[-1]
    if keys.dim != d:
        raise NpuOpError(op, "key", f"head dim {keys.dim} must equal query's {d}")
    if values.dim != d or values.heads != keys.heads:
        raise NpuOpError(op, "value", f"[N2, D] [{values.heads}, {values.dim}] must equal the key's "
                                      f"[{keys.heads}, {keys.dim}] (the output has the query's shape)")
    if n1 % keys.heads:
        raise NpuOpError(op, "key", f"{keys.heads} heads do not divide the query's {n1}")
    n2, group = keys.heads, n1 // keys.heads
    rope = None
    if (query_rope is None) != (key_rope is None):
        raise NpuOpError(op, "key_rope" if key_rope is None else "query_rope",
                         "query_rope and key_rope are given together or not at all")
    if query_rope is not None:
        chk.tensor(op, "query_rope", query_rope, dims=(query.dim(),), dtypes=(query.dtype,))
        if tuple(query_rope.shape[:-1]) != tuple(query.shape[:-1]):
            raise NpuOpError(op, "query_rope", f"shape {tuple(query_rope.shape)} must match the query's "
                                               f"{tuple(query.shape[:-1])} but the last axis")
        rope = _Keys(op, "key_rope", chk.tensor(op, "key_rope", key_rope, dtypes=(query.dtype,)), layout_kv, batch,
                     actual_seq_lengths_kv, block_table, "actual_seq_lengths_kv")
        if rope.heads != n2 or rope.dim != query_rope.shape[-1]:
            raise NpuOpError(op, "key_rope", f"[N2, D] [{rope.heads}, {rope.dim}] must be [{n2}, "
                                             f"{query_rope.shape[-1]}]")
    want = (*query.shape[:-2], n2)
    ind = chk.tensor(op, "sparse_indices", sparse_indices, dims=(len(want) + 1,), dtypes=(torch.int32,))
    if tuple(ind.shape[:-1]) != want:
        raise NpuOpError(op, "sparse_indices", f"shape {tuple(ind.shape)} must be {want} + [sparse_size] "
                                               f"({'[B, Q_S, KV_N, K]' if layout_query == 'BSND' else '[Q_T, KV_N, K]'})")
    cdt = chk.compute_dtype(query.dtype)
    q = query.reshape(-1, n1, d).to(cdt)
    qr = query_rope.reshape(-1, n1, query_rope.shape[-1]).to(cdt) if rope else None
    idx_all = ind.reshape(-1, n2, ind.shape[-1]).long()
    out = torch.zeros(q.shape[0], n1, d, dtype=cdt)
    kflat, vflat = keys.flat(), values.flat()
    rflat = rope.flat() if rope else None
    for b in range(batch):
        s1, s2 = q_lens[b], keys.lens[b]
        if s1 == 0:
            continue
        rows = torch.arange(q_starts[b], q_starts[b] + s1)
        idx = idx_all[rows]  # [s1, N2, K]
        valid = idx != INVALID
        after = torch.cumsum((~valid).int(), dim=-1) > 0
        if bool((valid & after).any()):
            raise NpuOpError(op, "sparse_indices", f"request {b}: a valid index follows an invalid (-1) one; valid "
                                                   "indices come first in each row")
        if bool(((idx < 0) & valid).any()) or bool(((idx >= s2) & valid).any()):
            bad = int(idx[valid & ((idx < 0) | (idx >= s2))][0])
            raise NpuOpError(op, "sparse_indices", f"request {b}: index {bad} is outside its {s2} keys")
        # Valid entries come first in each row: the columns past the longest row's are all -1, read nothing.
        width = max(int(valid.sum(-1).max()), 1)
        idx, valid = idx[..., :width], valid[..., :width]
        limit = (s2 - s1 + torch.arange(s1)).view(s1, 1, 1)
        if sparse_mode == 3:
            valid = valid & (idx <= limit)
        safe = torch.where(valid, idx, torch.zeros_like(idx))
        pos = keys.positions(b, safe.reshape(-1)).view(s1, n2, -1)
        k = kflat[pos, torch.arange(n2).view(1, n2, 1)].to(cdt)  # [s1, N2, K, D]
        v = vflat[pos, torch.arange(n2).view(1, n2, 1)].to(cdt)
        qb = q[rows].view(s1, n2, group, d)
        scores = torch.einsum("sngd,snkd->sngk", qb, k)
        if rope:
            kr = rflat[pos, torch.arange(n2).view(1, n2, 1)].to(cdt)
            scores = scores + torch.einsum("sngd,snkd->sngk", qr[rows].view(s1, n2, group, -1), kr)
        scores = (scores * float(scale_value)).masked_fill(~valid.view(s1, n2, 1, -1), float("-inf"))
        any_key = valid.any(dim=-1).view(s1, n2, 1, 1)
        probs = torch.softmax(torch.where(any_key, scores, torch.zeros_like(scores)), dim=-1)
        probs = torch.where(any_key, probs, torch.zeros_like(probs))
        out[rows] = torch.einsum("sngk,snkd->sngd", probs, v).reshape(s1, n1, d)
    out = out.to(query.dtype).view(query.shape)
    empty = torch.empty(0, dtype=torch.float32)
    return out, empty, empty


OPS = {LI: npu_lightning_indexer, SFA: npu_sparse_flash_attention}
