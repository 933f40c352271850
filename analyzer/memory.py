"""KV memory plan: one small frozen spec per kind of cache group, the arithmetic on the spec.

Formulas are the framework's (DOMAIN.md §5): offline ``ceil(max_len/bs) * concurrency + 1``
blocks per manager; budget-based: fixed-block groups (SlidingWindow) first, then the rest of
the budget in tokens for the growing groups; block 0 of every pool is the null block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class FullAttentionGroup:
    """Layers whose cache grows with the sequence; one block pool."""

    group_key: str
    num_layers: int
    per_token_bytes: int  # all layers of the group, one rank
    block_size: int
    fixed: bool = False

    @property
    def block_bytes(self) -> int:
        return self.per_token_bytes * self.block_size

    def blocks_offline(self, max_len: int, concurrency: int) -> int:
        return math.ceil(max_len / self.block_size) * concurrency + 1

    def blocks_per_request(self, seq_len: int) -> int:
        return math.ceil(seq_len / self.block_size)


@dataclass(frozen=True)
class SlidingWindowGroup(FullAttentionGroup):
    """Layers that keep only a window: a fixed number of blocks per request."""

    window: int = 0
    next_n: int = 0  # speculative (MTP) tokens per step
    fixed: bool = True

    def blocks_per_request(self, seq_len: int) -> int:
        return math.ceil((self.window + 2 * self.next_n) / self.block_size) + 1

    def fixed_blocks(self, concurrency: int) -> int:
        return concurrency * self.blocks_per_request(0) + 1


Group = FullAttentionGroup | SlidingWindowGroup


@dataclass(frozen=True)
class BudgetPlan:
    blocks: dict[str, int]
    max_tokens: int | None
    max_concurrency_at_max_len: int | None
    derivation: list[str]


def plan_budget(
    groups: list[Group],
    available_bytes: float,
    concurrency: int,
    max_len: int | None,
) -> BudgetPlan:
    """Budget-based block counts (online path): fixed groups first, then growing groups by tokens."""
    lines: list[str] = [f"budget = {available_bytes:.0f} B"]
    blocks: dict[str, int] = {}
    fixed_bytes = 0
    for g in groups:
        if g.fixed:
            n = g.fixed_blocks(concurrency)
            blocks[g.group_key] = n
            fixed_bytes += n * g.block_bytes
            lines.append(
                f"{g.group_key}: fixed {concurrency} x (ceil(({g.window} + 2x{g.next_n})/{g.block_size}) + 1) + 1 "
                f"= {n} blocks x {g.block_bytes} B"
            )
    growing = [g for g in groups if not g.fixed]
    left = available_bytes - fixed_bytes
    if left < 0:
        lines.append(f"fixed groups need {fixed_bytes} B > budget: nothing fits")
        return BudgetPlan({g.group_key: 0 for g in groups}, 0, 0, lines)
    max_tokens: int | None = None
    if growing:
        per_token = sum(g.per_token_bytes for g in growing)
        max_tokens = math.floor(left / per_token)
        lines.append(f"max_tokens = floor(({available_bytes:.0f} - {fixed_bytes}) / {per_token}) = {max_tokens}")
        for g in growing:
            blocks[g.group_key] = max_tokens // g.block_size
            lines.append(f"{g.group_key}: floor({max_tokens} / {g.block_size}) = {blocks[g.group_key]} blocks "
                         "(block 0 is the null block)")
    concurrency_fit = None
    if max_len:
        if growing:
            concurrency_fit = min(
                (blocks[g.group_key] - 1) // g.blocks_per_request(max_len) for g in growing
            )
        else:
            per_req = sum(g.blocks_per_request(max_len) * g.block_bytes for g in groups)
            nulls = sum(g.block_bytes for g in groups)
            concurrency_fit = max(int((available_bytes - nulls) // per_req), 0)
        lines.append(f"requests of {max_len} tokens that fit: {concurrency_fit}")
    return BudgetPlan(blocks, max_tokens, concurrency_fit, lines)


def plan_offline(groups: list[Group], max_len: int, concurrency: int) -> BudgetPlan:
    blocks = {g.group_key: g.blocks_offline(max_len, concurrency) for g in groups}
    lines = [
        f"{g.group_key}: ceil({max_len} / {g.block_size}) x {concurrency} + 1 = {blocks[g.group_key]} blocks (offline)"
        for g in groups
    ]
    return BudgetPlan(blocks, None, concurrency, lines)
