"""Harness copy of the mask helpers of ``executor/utils/common_utils.py``."""

from __future__ import annotations

from functools import lru_cache

import torch

# Fused-attention compressed-mask size for sparse modes 2/3/4.
MASK_SIZE = 2048


def get_init_attn_mask(mask_length: int, device=None, valid_len: int | None = None) -> torch.Tensor:
    """Causal mask with ``True`` = masked out (strict upper triangle), built as ``~tril``.

    ``valid_len`` clears the last ``valid_len`` rows (nothing masked there), as the
    framework helper does.
    """
    mask = _causal(mask_length).to(device=device, copy=True)  # a fresh tensor each call, as the framework's
    if valid_len is not None:
        mask[-valid_len:, :] = False
    return mask


@lru_cache(maxsize=2)
def _causal(mask_length: int) -> torch.Tensor:
    """~tril(ones), built once: the framework driver asks for one every step (a 2048^2 tril took ~8 ms of it; a
    copy ~0.7 ms)."""
    return ~torch.tril(torch.ones((mask_length, mask_length), dtype=torch.bool))


def get_decode_mask(mask_length: int, device, position: int) -> torch.Tensor:
    """Row mask of shape ``[1, mask_length]`` with ones on the first ``position`` columns."""
    mask = torch.zeros((1, mask_length), device=device)
    mask[0, :position] = 1
    return mask


__all__ = ["MASK_SIZE", "get_decode_mask", "get_init_attn_mask"]
