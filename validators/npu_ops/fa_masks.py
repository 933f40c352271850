"""Which keys each query may see: sparse modes 0-4, the band rule and the device readings.

Convention everywhere: a mask value of ``True`` means *masked out*; ``visible`` is its negation.
The compressed 2048x2048 mask of modes 2/3/4 only carries the shape of the causal template;
the visibility itself comes from the mode's rule, as on the device.

Every rule of modes 0/2/3/4 makes the visible keys of one query row a contiguous interval,
so visibility is first computed as per-row bounds ``[lo, hi)`` (cheap, ``[B, R]``) and only
expanded to a ``[B, R, L]`` boolean where needed. An explicit mode-0/1 mask is applied on top.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from model_infer_kvcache.analyzer.operators.fa_facts import COMPRESSED_MASK_MODES, COMPRESSED_MASK_SIZE

MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)


@lru_cache(maxsize=1)
def causal_template() -> torch.Tensor:
    """The 2048x2048 template the device expects for modes 2/3/4: True strictly above the diagonal."""
    ones = torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool)
    return torch.triu(ones, diagonal=1)


@dataclass(frozen=True)
class MaskSpec:
    """Everything the visibility rule needs, already validated.

    ``user_mask`` is ``[Bm, Qm, Km]`` bool (True = masked) with ``Bm`` 1 or B; only modes 0/1 use it.
    ``band_ignored`` is ``[B]`` bool: requests whose band/causal rule is switched off because
    their query length is 1 and the ``band_at_single_query="ignored"`` reading is active.
    """

    mode: int
    pre_tokens: int
    next_tokens: int
    inclusive_pre_tokens: bool
    band_ignored: torch.Tensor
    user_mask: torch.Tensor | None = None


def visible_bounds(spec: MaskSpec, rows: torch.Tensor, q_lens: torch.Tensor,
                   kv_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (request, row) the interval ``[lo, hi)`` of keys the band/causal rule admits.

    ``lo >= hi`` means no key; rows at or beyond a request's query length get ``[0, 0)``.
    The explicit mode-0/1 mask is *not* included (see :func:`visible_keys`).
    """
    r = rows.view(1, -1)
    ql = q_lens.view(-1, 1)
    kl = kv_lens.view(-1, 1)
    zero = torch.zeros((), dtype=torch.int64)
    lo = torch.zeros(q_lens.numel(), rows.numel(), dtype=torch.int64)
    hi = kl.expand_as(lo).clone()
    banded = spec.mode in COMPRESSED_MASK_MODES or (spec.mode == 0 and spec.user_mask is not None)
    if banded:
        if spec.mode == 2:  # left-up causal: origin at the first query/key
            band_lo, band_hi = lo, r + 1
        elif spec.mode == 3:  # right-down causal: the last query is aligned with the last key
            band_lo, band_hi = lo, r + (kl - ql) + 1
        else:  # band; mode 4 takes the right-down origin, mode 0 with a mask the left-up one
            origin = r + (kl - ql) if spec.mode == 4 else r.expand_as(lo)
            band_lo = origin - spec.pre_tokens + (1 if spec.inclusive_pre_tokens else 0)
            band_hi = origin + spec.next_tokens + 1
        keep = spec.band_ignored.view(-1, 1)
        lo = torch.where(keep, lo, torch.maximum(band_lo, zero))
        hi = torch.where(keep, hi, torch.minimum(band_hi, kl))
    valid = r < ql
    return torch.where(valid, lo, zero), torch.where(valid, hi, zero)


def visible_keys(spec: MaskSpec, rows: torch.Tensor, key_start: int, key_stop: int,
                 bounds: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Bool ``[B, R, L]``: may query row ``rows[r]`` of request b see key ``key_start + l``?

    Built with broadcast comparisons only (no per-token loops) from ``visible_bounds``.
    """
    lo, hi = bounds
    k = torch.arange(key_start, key_stop, dtype=torch.int64).view(1, 1, -1)
    vis = (k >= lo.unsqueeze(-1)) & (k < hi.unsqueeze(-1))
    if spec.user_mask is not None and spec.mode in (0, 1):
        vis &= ~spec.user_mask[:, rows][:, :, key_start:key_stop]
    return vis


def fully_visible_columns(spec: MaskSpec, bounds, q_lens: torch.Tensor, rows: torch.Tensor) -> tuple[int, int]:
    """Key interval every valid row of the chunk sees (``(0, 0)`` when there is none)."""
    if spec.user_mask is not None:
        return 0, 0
    lo, hi = bounds
    valid = rows.view(1, -1) < q_lens.view(-1, 1)
    if not bool(valid.any()):
        return 0, 0
    a = int(lo[valid].max())
    b = int(hi[valid].min())
    return (a, b) if a < b else (0, 0)
