"""Harness copy of ``executor/utils/forward_metadata.py`` (the framework-mode step metadata).

Field names, order and defaults follow the public repository (G0..G2 era); a later
``cp_metadata`` field (prefill context parallelism) is included with its ``None`` default.
The module-level ``get/set/reset_forward_metadata`` mirror the framework's global holder.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch


@dataclass
class ForwardMetaData:
    """Metadata every layer reads during one forward step."""

    is_prefill: bool = False
    attention_mask: torch.Tensor | None = None
    # Runner-owned: position of the token being written (decode) per request.
    kv_len: torch.Tensor | None = None
    # Per-request KV lengths (paged FA reads these, not the cumulative form).
    actual_seq_lengths_kv: torch.Tensor | None = None
    actual_seq_lengths_q: torch.Tensor | None = None
    actual_seq_lengths_cu_kv: torch.Tensor | None = None
    actual_seq_lengths_cu_q: torch.Tensor | None = None
    # Host-side copies used by graph mode (None in eager mode and in prefill).
    actual_seq_lengths_cu_list_kv: list | None = None
    actual_seq_lengths_cu_list_q: list | None = None
    actual_seq_lengths_list_kv: list | None = None
    actual_seq_lengths_list_q: list | None = None
    prompt_tokens: int = 0
    # Dicts keyed by attn_type (G0/G1) or group_key (G2).
    block_table: dict[str, torch.Tensor] | None = None
    slot_mapping: dict[str, torch.Tensor] | None = None
    cp_metadata: Any | None = None


_forward_metadata = ForwardMetaData()


def get_forward_metadata() -> ForwardMetaData:
    return _forward_metadata


def set_forward_metadata(**kwargs) -> None:
    # replace() keeps unspecified fields, as the framework's setter does.
    global _forward_metadata
    _forward_metadata = replace(_forward_metadata, **kwargs)


def reset_forward_metadata() -> None:
    global _forward_metadata
    _forward_metadata = ForwardMetaData()


__all__ = ["ForwardMetaData", "get_forward_metadata", "reset_forward_metadata", "set_forward_metadata"]
