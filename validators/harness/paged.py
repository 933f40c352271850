"""Plain paged-cache read/write helpers (reference semantics for tests and validators)."""

from __future__ import annotations

import torch


def write_slots(cache: torch.Tensor, slot_mapping: torch.Tensor, states: torch.Tensor) -> None:
    """Scatter packed token states into ``cache[num_blocks, block_size, ...]`` at flat slots."""
    flat = cache.view(-1, *cache.shape[2:])
    flat[slot_mapping.long()] = states.to(cache.dtype)


def slots_of(block_table_row: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat slots of logical positions of one request: ``table[pos // bs] * bs + pos % bs``."""
    positions = positions.long()
    return block_table_row.long()[positions // block_size] * block_size + positions % block_size


def read_positions(
    cache: torch.Tensor, block_table_row: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Gather the cached states of logical ``positions`` through one block-table row."""
    flat = cache.view(-1, *cache.shape[2:])
    return flat[slots_of(block_table_row, positions, block_size)]


__all__ = ["read_positions", "slots_of", "write_slots"]
