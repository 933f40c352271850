"""What the runtime checks keep of an operator call: which tensor storage it touched, and copies of its small
arguments (tables, lengths) as they were at the call. One home for rendered and checkout runs."""

from __future__ import annotations

import torch


def storage(t) -> int | None:
    """The storage a tensor views (two views of one cache compare equal); None for an empty or a non-tensor."""
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) and t.numel() else None


def snapshot(t):
    """A copy of a table / lengths argument as passed (a later in-place change does not rewrite the evidence)."""
    return t.detach().clone() if isinstance(t, torch.Tensor) else (list(t) if t is not None else None)
