"""Cutting a transformers attention module down to one attention-TP rank's heads (the multi-rank run)."""

from __future__ import annotations

import torch


def keep_rows(weight: torch.Tensor, start: int, stop: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(weight.data[start:stop].clone(), requires_grad=False)


def kv_head_of_rank(rank: int, tp: int, kv_heads: int) -> tuple[int, int]:
    """[first, last) KV heads a rank holds: a split when kv >= tp, else the one replicated head."""
    if kv_heads >= tp:
        per = kv_heads // tp
        return rank * per, (rank + 1) * per
    head = rank // (tp // kv_heads)
    return head, head + 1
