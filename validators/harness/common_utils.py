"""Harness copy of the mask helpers of ``executor/utils/common_utils.py``."""

from __future__ import annotations

import torch

# Fused-attention compressed-mask size for sparse modes 2/3/4.
MASK_SIZE = 2048


def get_init_attn_mask(mask_length: int, device=None, valid_len: int | None = None) -> torch.Tensor:
    """Causal mask with ``True`` = masked out (strict upper triangle), built as ``~tril``.

    ``valid_len`` clears the last ``valid_len`` rows (nothing masked there), as the
    framework helper does.
    """
    ones = torch.ones((mask_length, mask_length), dtype=torch.bool, device=device)
    mask = ~torch.tril(ones)
    if valid_len is not None:
        mask[-valid_len:, :] = False
    return mask


def get_decode_mask(mask_length: int, device, position: int) -> torch.Tensor:
    """Row mask of shape ``[1, mask_length]`` with ones on the first ``position`` columns."""
    mask = torch.zeros((1, mask_length), device=device)
    mask[0, :position] = 1
    return mask


__all__ = ["MASK_SIZE", "get_decode_mask", "get_init_attn_mask"]
