"""The attention kernel: softmax(scale * q.k^T [+ rope term], masked) @ v, with optional sinks.

Inputs are already validated and canonical. Work is tiled so memory stays bounded and
fully-masked regions are skipped:

* query rows are processed in chunks; for each chunk the union of visible keys across the
  batch is computed from the mask rule and only that key range is touched (causal and band
  patterns skip most of the upper triangle / out-of-window blocks);
* inside a chunk, keys are gathered in block-aligned pieces (one ``index_select`` each), the
  scores for every KV head are produced with one batched matmul per head, the softmax is
  done once over the whole range, and ``P @ V`` is accumulated piece by piece.

There is no per-token or per-request Python loop; the loops are over row chunks, key chunks
and KV heads only. Arithmetic is in the compute dtype (float32, or float64 for float64 inputs).
"""

from __future__ import annotations

import math

import torch

from validators.npu_ops.fa_kv import KVSource
from validators.npu_ops.fa_masks import MaskSpec, visible_keys

SCORE_BUDGET_BYTES = 32 << 20  # score tile of one row chunk
KV_CHUNK_BYTES = 8 << 20  # one gathered key (or value) piece


def _row_chunk(batch: int, num_q_heads: int, num_keys: int, itemsize: int, total_rows: int) -> int:
    per_row = max(1, batch * num_q_heads * num_keys * itemsize)
    return max(1, min(total_rows, SCORE_BUDGET_BYTES // per_row))


def _key_chunk(batch: int, num_kv_heads: int, head_dim: int, itemsize: int, granularity: int) -> int:
    per_key = max(1, batch * num_kv_heads * head_dim * itemsize)
    keys = max(granularity, KV_CHUNK_BYTES // per_key)
    return max(granularity, keys // granularity * granularity)


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

    ``q``/``q_rope``: ``[B, N_kv, S, G, D]`` already multiplied by the softmax scale (query head
    ``h * G + g`` uses KV head ``h``). ``sinks``: ``[N_kv, G]`` logits or None.
    Returns ``out [B, N_kv, S, G, Dv]`` and ``lse [B, N_kv, S, G]`` in the compute dtype; rows
    that see no key (and have no sink) get zeros and ``-inf``.
    """
    dtype = q.dtype
    batch, n_kv, rows_total, group, head_dim = q.shape
    out = torch.zeros(batch, n_kv, rows_total, group, value_dim, dtype=dtype)
    lse = torch.full((batch, n_kv, rows_total, group), -math.inf, dtype=dtype)
    n_keys = kv.num_keys
    if n_keys == 0 or rows_total == 0 or batch == 0:
        return out, lse

    itemsize = q.element_size()
    gran = kv.granularity
    row_step = _row_chunk(batch, n_kv * group, n_keys, itemsize, rows_total)
    key_step = _key_chunk(batch, n_kv, max(head_dim, value_dim), itemsize, gran)
    sink_b = sinks.view(1, n_kv, 1, group, 1) if sinks is not None else None

    for r0 in range(0, rows_total, row_step):
        r1 = min(rows_total, r0 + row_step)
        n_rows = r1 - r0
        rows = torch.arange(r0, r1, dtype=torch.int64)
        vis = visible_keys(mask, rows, 0, n_keys, q_lens, kv_lens)  # [B, R, n_keys]
        used = vis.any(dim=1).any(dim=0).nonzero()
        if used.numel() == 0 and sink_b is None:
            continue
        if used.numel() == 0:
            lo, hi = 0, 0
        else:
            lo = int(used[0]) // gran * gran
            hi = min(n_keys, -(-(int(used[-1]) + 1) // gran) * gran)
        span = hi - lo
        pieces = [(a, min(hi, a + key_step)) for a in range(lo, hi, key_step)]

        scores = torch.empty(batch, n_kv, n_rows * group, span, dtype=dtype)
        q_heads = [q[:, h, r0:r1].reshape(batch, n_rows * group, head_dim) for h in range(n_kv)]
        qr_heads = (
            [q_rope[:, h, r0:r1].reshape(batch, n_rows * group, q_rope.shape[-1]) for h in range(n_kv)]
            if q_rope is not None else None
        )
        kept_keys = []
        for a, b in pieces:
            k = kv.keys(a, b)
            if kv.same_kv:
                kept_keys.append(k)
            kr = kv.key_rope(a, b) if qr_heads is not None else None
            for h in range(n_kv):
                dst = scores[:, h, :, a - lo:b - lo]
                torch.bmm(q_heads[h], k[:, :, h, :].transpose(1, 2), out=dst)
                if kr is not None:
                    dst.baddbmm_(qr_heads[h], kr[:, :, h, :].transpose(1, 2))

        view = scores.view(batch, n_kv, n_rows, group, span)
        view.masked_fill_(~vis[:, None, :, None, lo:hi], -math.inf)
        row_max = view.amax(dim=-1, keepdim=True) if span else torch.full(
            (batch, n_kv, n_rows, group, 1), -math.inf, dtype=dtype)
        if sink_b is not None:
            row_max = torch.maximum(row_max, sink_b)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        view.sub_(row_max).exp_()
        denom = view.sum(dim=-1, keepdim=True)
        if sink_b is not None:
            denom = denom + torch.exp(sink_b - row_max)

        acc = torch.zeros(batch, n_kv, n_rows * group, value_dim, dtype=dtype)
        for i, (a, b) in enumerate(pieces):
            v = kept_keys[i] if kv.same_kv else kv.values(a, b)
            for h in range(n_kv):
                acc[:, h].baddbmm_(scores[:, h, :, a - lo:b - lo], v[:, :, h, :value_dim])
        acc = acc.view(batch, n_kv, n_rows, group, value_dim)
        safe = torch.where(denom > 0, denom, torch.ones_like(denom))
        out[:, :, r0:r1] = acc / safe
        lse[:, :, r0:r1] = (row_max + torch.log(denom)).squeeze(-1)
    return out, lse
