"""Recurrent states of a hybrid's linear layers (gated delta net, KDA, lightning, Mamba-2, Mamba-1): one block per
request."""

from __future__ import annotations

import torch
from model_infer_kvcache.analyzer.linear_config import INNER_IS_INTERMEDIATE


def expected_constants(manifest) -> dict[str, object]:
    lin = manifest.linear_attention
    if lin is None:
        return {}
    want: dict[str, object] = {"LINEAR_LAYERS": frozenset(lin.layers)}
    dtypes = {s.name: getattr(torch, s.dtype) for s in lin.states}
    if lin.num_v_heads is not None:  # a short conv keeps no recurrent state: none of its constants
        want.update({
            "LINEAR_NUM_K_HEADS_PER_RANK": lin.num_k_heads_per_rank, "LINEAR_NUM_V_HEADS_PER_RANK":
            lin.num_v_heads_per_rank, "LINEAR_HEAD_K_DIM": lin.head_k_dim, "LINEAR_HEAD_V_DIM": lin.head_v_dim})
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


# The config field a Mamba family sizes its inner width by (expand x hidden_size), when it names no width itself
_EXPAND_FIELDS = ("mamba_expand", "expand")



def tiny_state_fields(d: dict, manifest) -> None:
    """The tiny config's Mamba inner width, in place: the rendered code keeps the real heads x head_dim (Mamba-2)
    or inner channels (Mamba-1), so at the tiny hidden size the expand factor grows to give the same width (a
    family naming the width itself, Falcon-H1's ``mamba_d_ssm``, keeps it); a short conv (LFM2) keeps the real
    hidden_size, its conv's channels. Other families: nothing."""
    lin = manifest.linear_attention
    if lin is not None and lin.family == "short_conv":  # the render convolves the real hidden_size channels
        d["hidden_size"] = lin.conv_channels_per_rank * manifest.parallel.attn_tp_size
        return
    if lin is None or lin.family not in ("mamba2", "mamba") or d.get("mamba_d_ssm"):
        return
    inner = lin.num_v_heads * lin.head_v_dim
    field = next((f for f in _EXPAND_FIELDS if f in d), None)
    if field is not None and inner % d["hidden_size"] == 0:
        d[field] = inner // d["hidden_size"]
    if manifest.model.model_type in INNER_IS_INTERMEDIATE:  # the saved width the mixer is built at
        d["intermediate_size"] = inner
