"""Which keys each query may see: sparse modes 0-4, the band rule and the device readings.

Convention everywhere: a mask value of ``True`` means *masked out*; ``visible`` is its negation.
The compressed 2048x2048 mask of modes 2/3/4 only carries the shape of the causal template;
the visibility itself comes from the mode's rule, as on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

COMPRESSED_MASK_SIZE = 2048
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


def visible_keys(
    spec: MaskSpec,
    rows: torch.Tensor,
    key_start: int,
    key_stop: int,
    q_lens: torch.Tensor,
    kv_lens: torch.Tensor,
) -> torch.Tensor:
    """Bool ``[B, R, L]``: may query row ``rows[r]`` of request b see key ``key_start + l``?

    Built with broadcast comparisons only (no per-token loops). Rows at or beyond a request's
    query length and keys at or beyond its KV length are never visible.
    """
    r = rows.view(1, -1, 1)
    k = torch.arange(key_start, key_stop, dtype=torch.int64).view(1, 1, -1)
    ql = q_lens.view(-1, 1, 1)
    kl = kv_lens.view(-1, 1, 1)
    vis = (k < kl) & (r < ql)

    band: torch.Tensor | None = None
    if spec.mode == 2:  # left-up causal: origin at the first query/key
        band = k <= r
    elif spec.mode == 3:  # right-down causal: the last query is aligned with the last key
        band = k <= r + (kl - ql)
    elif spec.mode == 4 or (spec.mode == 0 and spec.user_mask is not None):
        # Band: mode 4 takes the right-down origin; mode 0 with a mask takes the left-up one.
        origin = r + (kl - ql) if spec.mode == 4 else r
        lower = origin - spec.pre_tokens + (1 if spec.inclusive_pre_tokens else 0)
        band = (k >= lower) & (k <= origin + spec.next_tokens)
    if band is not None:
        if bool(spec.band_ignored.any()):
            band = band | spec.band_ignored.view(-1, 1, 1)
        vis &= band

    if spec.user_mask is not None and spec.mode in (0, 1):
        user = spec.user_mask[:, rows][:, :, key_start:key_stop]
        vis &= ~user
    return vis
