"""Recurrent states of a hybrid's linear layers (gated delta net, KDA, lightning): one block per request."""

from __future__ import annotations

import torch


def expected_constants(manifest) -> dict[str, object]:
    lin = manifest.linear_attention
    if lin is None:
        return {}
    want: dict[str, object] = {
        "LINEAR_NUM_K_HEADS_PER_RANK": lin.num_k_heads_per_rank, "LINEAR_NUM_V_HEADS_PER_RANK":
        lin.num_v_heads_per_rank, "LINEAR_HEAD_K_DIM": lin.head_k_dim, "LINEAR_HEAD_V_DIM": lin.head_v_dim,
        "LINEAR_LAYERS": frozenset(lin.layers)}
    dtypes = {s.name: getattr(torch, s.dtype) for s in lin.states}
    want.update(STATE_DTYPE=dtypes.get("recurrent_state"))
    if lin.conv_kernel is not None:  # lightning has no short conv, and so no conv constants
        want.update(CONV_KERNEL=lin.conv_kernel, CONV_CHANNELS_PER_RANK=lin.conv_channels_per_rank,
                    CONV_STATE_DTYPE=dtypes.get("conv_state"))
    return want


def states(manifest) -> dict:
    """name -> StateSpec of each state entry a linear layer holds (empty without linear layers)."""
    lin = manifest.linear_attention
    return {s.name: s for s in lin.states} if lin else {}


def state_slots_per_row(manifest) -> int:
    """State slots one runner row holds: 1 + next_n under speculative decoding (one per verify token)."""
    lin = manifest.linear_attention
    return lin.state_blocks_per_request if lin else 1
