"""The attention kernel: softmax(scale * q.k^T [+ rope term], masked) @ v, with optional sinks.

Inputs are already validated and canonical. Two strategies, same arithmetic:

* request-major (prefill, non-paged, any layout): query rows are processed in chunks; for
  each chunk the per-row visible key intervals give the key range to touch (causal and
  band patterns skip most of the upper triangle and out-of-window blocks), and only the
  columns some row cannot see are masked. Keys are converted to head-major once when
  several chunks need them; each chunk costs one batched matmul for the scores and one
  for ``P @ V``.
* block-major (paged, short queries - decode and MTP): each *physical* cache block that some
  request needs is multiplied by its owner's queries. A ``[bn, bs, N*D]`` cache in the
  compute dtype is read in place (one strided batched matmul per KV head, no copy); other
  forms are converted a bounded step at a time. A block referenced by several requests
  (shared prefix, the null block of padded decode rows) is read in place for its first
  reference; the further references are gathered, one copy each, into a second round.

Masked keys get probability exactly 0; if a masked value row holds NaN/inf (poisoned null
block, stale slots) the affected product is redone with those rows zeroed, so only keys a
query may see can reach its output. There is no per-token or per-request Python loop; the
loops run over row chunks, key pieces, block steps, rounds and (in place) KV heads.
Arithmetic is in the compute dtype (float32, or float64 for float64 inputs).
"""

from __future__ import annotations

import math

import torch
from model_infer_kvcache.validators.npu_ops.fa_kv import KVSource, PagedKV
from model_infer_kvcache.validators.npu_ops.fa_masks import (
    MaskSpec,
    fully_visible_columns,
    visible_bounds,
    visible_keys,
)

SCORE_BUDGET_BYTES = 32 << 20  # score tile of one row chunk (request-major)
KV_CHUNK_BYTES = 8 << 20  # one gathered key (or value) piece (request-major)
BLOCK_CHUNK_BYTES = 8 << 20  # physical blocks per step (block-major)
BLOCK_MAJOR_MAX_ROWS = 16  # longest query handled block-major (decode, MTP)
IN_PLACE_STEP_BYTES = 256 << 20  # block-major, no conversion needed: blocks per batched matmul
MATERIALIZE_BYTES = 512 << 20  # request-major: convert all keys/values up front when they fit


def attend(
    q: torch.Tensor,
    q_rope: torch.Tensor | None,
    kv: KVSource,
    q_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    mask: MaskSpec,
    sinks: torch.Tensor | None,
    value_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention for canonical inputs.

    ``q``/``q_rope``: contiguous ``[B, N_kv, S, G, D]`` already multiplied by the softmax scale
    (query head ``h * G + g`` uses KV head ``h``). ``sinks``: ``[N_kv, G]`` logits or None.
    Returns ``out [B, S, N_kv, G, Dv]`` and ``lse [B, S, N_kv, G]`` (token-major, so the
    operator's output layouts are views of them) in the compute dtype; rows that see no key
    (and have no sink) get zeros and ``-inf``.
    """
    batch, n_kv, rows_total, group, _ = q.shape
    out_tm = torch.empty(batch, rows_total, n_kv, group, value_dim, dtype=q.dtype)
    lse_tm = torch.empty(batch, rows_total, n_kv, group, dtype=q.dtype)
    out, lse = out_tm.permute(0, 2, 1, 3, 4), lse_tm.permute(0, 2, 1, 3)  # head-major views
    if kv.num_keys == 0 or rows_total == 0 or batch == 0:
        _no_keys(out, lse, torch.arange(rows_total), q_lens, sinks)
    elif isinstance(kv, PagedKV) and rows_total <= BLOCK_MAJOR_MAX_ROWS:
        _block_major(q, q_rope, kv, q_lens, kv_lens, mask, sinks, value_dim, out, lse)
    else:
        _request_major(q, q_rope, kv, q_lens, kv_lens, mask, sinks, value_dim, out, lse)
    return out_tm, lse_tm


def _no_keys(out_slice, lse_slice, rows, q_lens, sinks) -> None:
    """Rows that see no key: output 0; lse is the sink logit when there is one, else -inf."""
    out_slice.zero_()
    lse_slice.fill_(-math.inf)
    if sinks is not None and lse_slice.numel():
        valid = (rows.view(1, -1) < q_lens.view(-1, 1))[:, None, :, None]
        n_kv, group = sinks.shape
        lse_slice.copy_(torch.where(valid, sinks.view(1, n_kv, 1, group), lse_slice))


def _masked_softmax_(scores: torch.Tensor, hide, sinks: torch.Tensor | None):
    """In place on ``scores [B, N_kv, R, G, L]``: mask, subtract the row max, exponentiate.

    ``hide`` is a list of ``(c0, c1, hidden [B, R, c1 - c0])`` column ranges to fill with
    -inf (columns outside them are visible to every valid row). Returns (row max used,
    denominator), both ``[B, N_kv, R, G, 1]``; the sink (if any) takes part in the max and the
    denominator but has no value row.
    """
    for c0, c1, hidden in hide:
        scores[..., c0:c1].masked_fill_(hidden[:, None, :, None, :], -math.inf)
    row_max = scores.amax(dim=-1, keepdim=True)
    sink_b = sinks.view(1, sinks.shape[0], 1, sinks.shape[1], 1) if sinks is not None else None
    if sink_b is not None:
        row_max = torch.maximum(row_max, sink_b)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    scores.sub_(row_max).exp_()
    denom = scores.sum(dim=-1, keepdim=True)
    if sink_b is not None:
        denom = denom + torch.exp(sink_b - row_max)
    return row_max, denom


def _weighted_values(probs: torch.Tensor, values: torch.Tensor, key_seen) -> torch.Tensor:
    """``probs @ values`` where keys no row of the request can see contribute exactly zero.

    Masked keys already have probability 0, but ``0 * NaN`` is NaN: a poisoned null block or
    stale slots past the KV length would leak into the output. Data is normally finite, so
    the product is checked once and recomputed with the unseen value rows zeroed only when
    needed. ``key_seen()`` returns one flag per key row, broadcastable against ``values``.
    """
    result = torch.matmul(probs, values)
    if math.isfinite(float(result.sum())):  # a NaN/inf anywhere reaches the sum; no big temporaries
        return result
    return torch.matmul(probs, values.masked_fill(~key_seen(), 0.0))


def _finish(acc, row_max, denom, valid, out_slice, lse_slice) -> None:
    """Normalize and store; rows outside a request's query length get zero / -inf."""
    acc.div_(torch.where(denom > 0, denom, torch.ones_like(denom)))
    lse = (row_max + torch.log(denom)).squeeze(-1)
    if not bool(valid.all()):
        rows_ok = valid[:, None, :, None]
        acc.masked_fill_(~rows_ok.unsqueeze(-1), 0.0)
        lse.masked_fill_(~rows_ok, -math.inf)
    out_slice.copy_(acc)
    lse_slice.copy_(lse)


def _hidden_ranges(mask: MaskSpec, rows, bounds, q_lens, lo: int, hi: int) -> list:
    """Column ranges of ``[lo, hi)`` that need masking, relative to ``lo``, with their masks."""
    full_a, full_b = fully_visible_columns(mask, bounds, q_lens, rows)
    full_a, full_b = max(full_a, lo), min(full_b, hi)
    spans = [(lo, hi)] if full_a >= full_b else [(lo, full_a), (full_b, hi)]
    return [(a - lo, b - lo, ~visible_keys(mask, rows, a, b, bounds)) for a, b in spans if b > a]


# --------------------------------------------------------------------------- request-major
class _Materialized(KVSource):
    """Head-major copies of the whole key range, made once and sliced per row chunk."""

    def __init__(self, kv: KVSource, with_rope: bool) -> None:
        self.num_keys, self.granularity, self.same_kv = kv.num_keys, kv.granularity, kv.same_kv
        self._k = kv.keys(0, kv.num_keys)
        self._v = self._k if kv.same_kv else kv.values(0, kv.num_keys)
        self._kr = kv.key_rope(0, kv.num_keys) if with_rope else None

    def keys(self, t0, t1):
        return self._k[:, :, t0:t1]

    def values(self, t0, t1):
        return self._v[:, :, t0:t1]

    def key_rope(self, t0, t1):
        return self._kr[:, :, t0:t1]


def _request_major(q, q_rope, kv, q_lens, kv_lens, mask, sinks, value_dim, out, lse) -> None:
    batch, n_kv, rows_total, group, head_dim = q.shape
    itemsize = q.element_size()
    n_keys, gran = kv.num_keys, kv.granularity
    per_row = max(1, batch * n_kv * group * n_keys * itemsize)
    row_step = max(1, min(rows_total, SCORE_BUDGET_BYTES // per_row))
    per_key = max(1, batch * n_kv * max(head_dim, value_dim) * itemsize)
    key_step = max(gran, KV_CHUNK_BYTES // per_key // gran * gran)
    if rows_total > row_step and 2 * per_key * n_keys <= MATERIALIZE_BYTES:
        # Several row chunks would gather overlapping key ranges again: convert K/V once.
        kv = _Materialized(kv, q_rope is not None)
        key_step = max(key_step, n_keys)

    for r0 in range(0, rows_total, row_step):
        r1 = min(rows_total, r0 + row_step)
        n_rows = r1 - r0
        rows = torch.arange(r0, r1, dtype=torch.int64)
        bounds = visible_bounds(mask, rows, q_lens, kv_lens)
        valid = rows.view(1, -1) < q_lens.view(-1, 1)
        some = bounds[0] < bounds[1]
        if not bool(some.any()):
            _no_keys(out[:, :, r0:r1], lse[:, :, r0:r1], rows, q_lens, sinks)
            continue
        lo = int(bounds[0][some].min()) // gran * gran
        hi = min(n_keys, -(-int(bounds[1][some].max()) // gran) * gran)
        pieces = [(a, min(hi, a + key_step)) for a in range(lo, hi, key_step)]

        qc = q[:, :, r0:r1].reshape(batch, n_kv, n_rows * group, head_dim)
        qrc = q_rope[:, :, r0:r1].reshape(batch, n_kv, n_rows * group, -1) if q_rope is not None else None
        kept = []
        if len(pieces) == 1:
            k = kv.keys(lo, hi)
            kept.append(k)
            scores = torch.matmul(qc, k.transpose(-1, -2))
            if qrc is not None:
                scores.add_(torch.matmul(qrc, kv.key_rope(lo, hi).transpose(-1, -2)))
        else:
            scores = torch.empty(batch, n_kv, n_rows * group, hi - lo, dtype=q.dtype)
            for a, b in pieces:
                k = kv.keys(a, b)
                if kv.same_kv:
                    kept.append(k)
                part = torch.matmul(qc, k.transpose(-1, -2))
                if qrc is not None:
                    part.add_(torch.matmul(qrc, kv.key_rope(a, b).transpose(-1, -2)))
                scores[..., a - lo:b - lo] = part
        view = scores.view(batch, n_kv, n_rows, group, hi - lo)
        row_max, denom = _masked_softmax_(view, _hidden_ranges(mask, rows, bounds, q_lens, lo, hi), sinks)

        acc = None
        for i, (a, b) in enumerate(pieces):
            v = kept[i] if kv.same_kv else kv.values(a, b)

            def seen(a=a, b=b, rows=rows, bounds=bounds):
                return visible_keys(mask, rows, a, b, bounds).any(dim=1).view(batch, 1, b - a, 1)

            part = _weighted_values(scores[..., a - lo:b - lo], v[..., :value_dim], seen)
            acc = part if acc is None else acc.add_(part)
        acc = acc.view(batch, n_kv, n_rows, group, value_dim)
        _finish(acc, row_max, denom, valid, out[:, :, r0:r1], lse[:, :, r0:r1])


# --------------------------------------------------------------------------- block-major
class _Round:
    """One round of the block-major path: one slot per entry (a request's block column).

    Blocks are addressed through *slots*: in a dense round (distinct blocks) slot ``i`` is
    cache block ``lo + i`` (read in place, a range at a time); in a sparse round slot ``i`` is
    the i-th listed block (gathered: ``gathered`` rounds list a block once per entry that
    needs it). ``slot[e]`` is the slot of entry ``e``; ``steps`` are consecutive slot ranges
    with what to load for them.
    """

    def __init__(self, phys: torch.Tensor, block_bytes: int, budget: int, gathered: bool = False) -> None:
        step = max(1, budget // max(1, block_bytes))
        lo, hi = int(phys.min()), int(phys.max()) + 1
        if not gathered and hi - lo <= 2 * phys.numel():
            self.num_slots = hi - lo
            self.slot = phys - lo
            self.block = torch.arange(lo, hi)  # slot -> physical block
            self.steps = [(a - lo, min(hi, a + step) - lo, (a, min(hi, a + step))) for a in range(lo, hi, step)]
        else:
            order = torch.argsort(phys)
            listed = phys[order]
            self.num_slots = phys.numel()
            self.slot = torch.empty_like(phys)
            self.slot[order] = torch.arange(phys.numel())
            self.block = listed
            self.steps = [(a, min(self.num_slots, a + step), listed[a:a + step])
                          for a in range(0, self.num_slots, step)]


def _load(kv: PagedKV, which: str, where, buffer: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(where, tuple):
        return kv.block_range(which, *where, buffer=buffer)
    return kv.block_list(which, where, buffer=buffer)


def _block_major(q, q_rope, kv: PagedKV, q_lens, kv_lens, mask, sinks, value_dim, out, lse) -> None:
    batch, n_kv, rows, group, head_dim = q.shape
    bs, n_keys = kv.block_size, kv.num_keys
    n_cols = n_keys // bs
    row_ids = torch.arange(rows, dtype=torch.int64)
    bounds = visible_bounds(mask, row_ids, q_lens, kv_lens)
    vis = visible_keys(mask, row_ids, 0, n_keys, bounds)  # [B, S, n_keys]; S <= 16 here
    # A (request, block column) entry is computed only if some row sees some key in it.
    key_seen = vis.view(batch, rows, n_cols, bs).any(dim=1)  # [B, n_cols, bs]
    eb, ec = key_seen.any(dim=2).nonzero(as_tuple=True)
    width = rows * group
    scores = torch.full((batch, n_kv, width, n_cols * bs), -math.inf, dtype=q.dtype)
    scores5 = scores.view(batch, n_kv, width, n_cols, bs)
    q_flat = q.view(batch, n_kv, width, head_dim)
    qr_flat = q_rope.view(batch, n_kv, width, -1) if q_rope is not None else None

    rounds = []  # (entry request ids, entry block columns, _Round)
    if eb.numel():
        phys = kv.ids[eb, ec]
        order = torch.argsort(phys, stable=True)
        sorted_phys = phys[order]
        rank = torch.empty_like(phys)
        rank[order] = torch.arange(phys.numel()) - torch.searchsorted(sorted_phys, sorted_phys)

    # Token-major [bn, bs, N*D] caches in the compute dtype are used in place, one strided
    # batched matmul per KV head; other forms are converted to head-major per step (bounded
    # steps keep the conversion buffer small; in place, bigger steps mean fewer calls).
    in_place = kv.token_major_ok(q.dtype)
    if eb.numel():
        block_bytes = n_kv * bs * max(head_dim, value_dim) * q.element_size()
        no_conversion = in_place or kv.head_major_ok(q.dtype)
        budget = IN_PLACE_STEP_BYTES if no_conversion else BLOCK_CHUNK_BYTES
        first, again = (rank == 0).nonzero().squeeze(1), (rank > 0).nonzero().squeeze(1)
        rounds.append((eb[first], ec[first], _Round(phys[first], block_bytes, budget)))
        if again.numel():  # further references of shared blocks: gathered, one slot each
            rounds.append((eb[again], ec[again], _Round(phys[again], block_bytes, BLOCK_CHUNK_BYTES, gathered=True)))
    # One reusable conversion buffer (page-faulting a fresh one per step costs as much as the copy).
    step_blocks = max((b - a for _, _, rnd in rounds for a, b, _ in rnd.steps), default=0)
    buffer = None if in_place else torch.empty(step_blocks * n_kv * bs * max(head_dim, value_dim), dtype=q.dtype)

    def load(which: str, where, keep: bool = False) -> torch.Tensor:
        if in_place:
            return kv.token_major(which, where)  # [n, bs, N_kv, D]
        return _load(kv, which, where, None if keep else buffer)  # [n, N_kv, bs, D]

    def product(lhs: torch.Tensor, blocks: torch.Tensor, out: torch.Tensor, keys: bool, clean=None) -> None:
        """``out = lhs @ K^T`` (keys) or ``lhs @ V`` for one step (``lhs``/``out``: slot slices)."""
        if in_place:
            if clean is not None:
                blocks = blocks.masked_fill(~clean.view(-1, bs, 1, 1), 0.0)
            for h in range(n_kv):
                rhs = blocks[:, :, h, :].transpose(1, 2) if keys else blocks[:, :, h, :value_dim]
                torch.bmm(lhs[:, h], rhs, out=out[:, h])
            return
        if clean is not None:
            blocks = blocks.masked_fill(~clean.view(-1, 1, bs, 1), 0.0)
        torch.matmul(lhs, blocks.transpose(-1, -2) if keys else blocks[..., :value_dim], out=out)

    def slot_tensor(num_slots: int, last: int, zeros: bool = False) -> torch.Tensor:
        """``[slots, N_kv, W, last]``; head-major storage on the in-place path so that each
        per-head matmul reads and writes contiguous matrices (strided ones fall back to a
        slow per-matrix loop inside ``bmm``)."""
        make = torch.zeros if zeros else torch.empty
        if in_place:
            return make(n_kv, num_slots, width, last, dtype=q.dtype).permute(1, 0, 2, 3)
        return make(num_slots, n_kv, width, last, dtype=q.dtype)

    kept: dict[tuple[int, int], torch.Tensor] = {}  # MLA: the latent blocks serve as values too
    for r, (r_b, r_c, rnd) in enumerate(rounds):
        q_slots = slot_tensor(rnd.num_slots, head_dim, zeros=True)
        q_slots[rnd.slot] = q_flat[r_b]
        qr_slots = None
        if qr_flat is not None:
            qr_slots = slot_tensor(rnd.num_slots, qr_flat.shape[-1], zeros=True)
            qr_slots[rnd.slot] = qr_flat[r_b]
        s_slots = slot_tensor(rnd.num_slots, bs)
        for i, (a, b, where) in enumerate(rnd.steps):
            blocks = load("k", where, keep=kv.same_kv)
            if kv.same_kv:
                kept[(r, i)] = blocks
            product(q_slots[a:b], blocks, s_slots[a:b], keys=True)
            if qr_slots is not None:
                rope = slot_tensor(b - a, bs)
                product(qr_slots[a:b], load("kr", where, keep=True), rope, keys=True)
                s_slots[a:b].add_(rope)
        scores5[r_b, :, :, r_c, :] = s_slots[rnd.slot]

    view = scores.view(batch, n_kv, rows, group, n_cols * bs)
    row_max, denom = _masked_softmax_(view, [(0, n_cols * bs, ~vis)], sinks)

    acc = torch.zeros(batch, n_kv, width, value_dim, dtype=q.dtype)
    for r, (r_b, r_c, rnd) in enumerate(rounds):
        p_slots = slot_tensor(rnd.num_slots, bs, zeros=True)
        p_slots[rnd.slot] = scores5[r_b, :, :, r_c, :]
        o_slots = slot_tensor(rnd.num_slots, value_dim)

        def values(i: int, where, r: int = r) -> torch.Tensor:
            return kept[(r, i)] if kv.same_kv else load("v", where)

        for i, (a, b, where) in enumerate(rnd.steps):
            product(p_slots[a:b], values(i, where), o_slots[a:b], keys=False)
        picked = o_slots[rnd.slot]
        if not math.isfinite(float(picked.sum())):
            # 0 * NaN: some value row no query may see is poisoned (null block, stale slot).
            # Redo the blocks that hold such rows (a decode step's last, partial block per
            # request) with those rows zeroed; a NaN that survives is a visible one.
            partial = ~key_seen[r_b, r_c].all(dim=1)
            redo = rnd.slot[partial]  # one entry per slot in a round
            if redo.numel():
                blocks = load("k" if kv.same_kv else "v", rnd.block[redo], keep=True)
                p_redo = slot_tensor(redo.numel(), bs)
                p_redo.copy_(p_slots[redo])
                o_redo = slot_tensor(redo.numel(), value_dim)
                product(p_redo, blocks, o_redo, keys=False, clean=key_seen[r_b, r_c][partial])
                o_slots[redo] = o_redo
                picked = o_slots[rnd.slot]
        acc.index_add_(0, r_b, picked)
    valid = row_ids.view(1, -1) < q_lens.view(-1, 1)
    _finish(acc.view(batch, n_kv, rows, group, value_dim), row_max, denom, valid, out, lse)
