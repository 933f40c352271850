"""KV memory plan of the manifest: block counts, budget fit and their derivation lines.

The arithmetic lives on the group specs of ``analyzer.kv_cache_spec`` (shared with the framework
harness): offline ``ceil(max_len/bs) * concurrency + 1`` blocks per manager; budget-based:
fixed-block groups (SlidingWindow) first, then the rest of the budget in tokens for the growing
groups; block 0 of every pool is the null block.
"""

from __future__ import annotations

from dataclasses import dataclass

from model_infer_kvcache.analyzer.kv_cache_spec import (
    NULL_BLOCKS,
    CompressedSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
    fixed_bytes,
    max_tokens_in,
    pool_bytes,
)

GIB = 1024**3

Group = FullAttentionSpec | CompressedSpec | SlidingWindowSpec | MambaSpec


@dataclass(frozen=True)
class BudgetPlan:
    blocks: dict[str, int]
    max_tokens: int | None
    max_concurrency_at_max_len: int | None
    derivation: list[str]


def _growing_blocks(groups: list[Group], available_bytes: float, concurrency: int
                    ) -> tuple[int, dict[str, int]] | None:
    """(max_tokens, blocks of each growing group) left once the fixed groups are reserved: one token budget over
    every growing group, each group's blocks ``max_tokens // its block_size`` (a compressed group's block spans
    more tokens; cache_utils.calculate_block_num)."""
    growing = [g for g in groups if not g.fixed]
    per_token = sum(g.per_token_bytes for g in growing)
    left = available_bytes - fixed_bytes(groups, concurrency)
    if not growing or per_token <= 0 or left < 0:
        return None
    max_tokens = max_tokens_in(left, per_token)
    return max_tokens, {g.group_key: g.blocks_for_tokens(max_tokens) for g in growing}


def max_concurrency_at(groups: list[Group], available_bytes: float, seq_len: int) -> int:
    """Largest number of requests of ``seq_len`` tokens that fit, fixed reservations included.

    Each extra request grows the fixed (sliding) reservation and needs ceil(seq_len / bs) blocks in
    every growing pool, block 0 excluded (null block). Monotone in the count: binary search.
    """

    def fits(c: int) -> bool:
        if fixed_bytes(groups, c) > available_bytes:
            return False
        growing = [g for g in groups if not g.fixed]
        if not growing:
            return True
        got = _growing_blocks(groups, available_bytes, c)
        return got is not None and all(g.usable_blocks(got[1][g.group_key]) >= c * g.blocks_per_request(seq_len)
                                       for g in growing)

    per_request = sum(g.blocks_per_request(seq_len) * g.block_bytes for g in groups)
    if per_request <= 0 or not fits(0):
        return 0
    lo, hi = 0, int(available_bytes // per_request) + 1  # hi never fits: each request costs >= per_request
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def plan_budget(
    groups: list[Group],
    available_bytes: float,
    concurrency: int,
    max_len: int | None,
) -> BudgetPlan:
    """Budget-based block counts (online path): fixed groups first, then growing groups by tokens.

    Framework formulas (cache_utils.calculate_block_num): a SlidingWindow group reserves
    ``concurrency x (ceil((W + 2 next_n) / bs) + 1) + 1`` blocks; then
    ``max_tokens = floor((budget - fixed_bytes) / per_token_bytes)`` over all growing groups and
    ``blocks = floor(max_tokens / bs)`` per growing group, block 0 being the null block.
    """
    lines: list[str] = [f"budget = {available_bytes:.0f} B"]
    blocks: dict[str, int] = {}
    reserved = fixed_bytes(groups, concurrency)
    for g in groups:
        if g.fixed:
            blocks[g.group_key] = g.fixed_blocks(concurrency)
            lines.append(f"{g.group_key}: fixed {g.fixed_formula(concurrency)} x {g.block_bytes} B")
    growing = [g for g in groups if not g.fixed]
    if reserved > available_bytes:
        lines.append(f"fixed groups need {reserved} B > budget: nothing fits")
        return BudgetPlan({g.group_key: 0 for g in groups}, 0 if growing else None, 0, lines)
    max_tokens: int | None = None
    got = _growing_blocks(groups, available_bytes, concurrency)
    if got is not None:
        max_tokens, n_blocks = got
        per_token = sum(g.per_token_bytes for g in growing)
        lines.append(f"max_tokens = floor(({available_bytes:.0f} - {reserved}) / {per_token}) = {max_tokens}")
        for g in growing:
            blocks[g.group_key] = n_blocks[g.group_key]
            lines.append(f"{g.group_key}: floor({max_tokens} / {g.block_size}) = {n_blocks[g.group_key]} blocks "
                         "(block 0 is the null block)")
    concurrency_fit = None
    if max_len:
        concurrency_fit = max_concurrency_at(groups, available_bytes, max_len)
        lines.append(f"requests of {max_len} tokens that fit (fixed reservations grown to match): {concurrency_fit}")
    return BudgetPlan(blocks, max_tokens, concurrency_fit, lines)


def plan_offline(groups: list[Group], max_len: int, concurrency: int) -> BudgetPlan:
    """Offline block counts: growing groups by max_len, fixed (sliding) groups keep their fixed count.

    The framework reserves the sliding groups' fixed blocks first even offline, and sizes only the
    growing groups from ``max_len`` (cache_utils.calculate_block_num).
    """
    blocks: dict[str, int] = {}
    lines: list[str] = []
    for g in groups:
        if g.fixed:
            blocks[g.group_key] = g.fixed_blocks(concurrency)
            lines.append(f"{g.group_key}: fixed {g.fixed_formula(concurrency)} (offline too)")
        else:
            blocks[g.group_key] = g.blocks_offline(max_len, concurrency)
            lines.append(f"{g.group_key}: ceil({max_len} / {g.block_size}) x {concurrency} + 1 = "
                         f"{blocks[g.group_key]} blocks (offline)")
    return BudgetPlan(blocks, None, concurrency, lines)


def plan_bytes(groups: list[Group], blocks: dict[str, int]) -> int:
    """Bytes the pools take: blocks x block_size x per-token bytes of the group, summed."""
    return pool_bytes(groups, blocks)


def plan_warnings(plan: BudgetPlan, requested_concurrency: int | None, max_len: int | None) -> list[str]:
    """Why a budget plan cannot serve the request it was asked for (empty when it can).

    A pool of n blocks holds n - 1 usable ones (block 0 is the null block), so a pool of at most
    one block serves nothing; and fewer requests of ``max_len`` fitting than asked is a plan that
    the framework would start but could not fill.
    """
    out = []
    starved = {key: n for key, n in sorted(plan.blocks.items()) if n <= NULL_BLOCKS}
    if starved:
        listed = ", ".join(f"{key} {n}" for key, n in starved.items())
        out.append(f"the KV budget leaves no usable block (block 0 is the null block) in: {listed} block(s); "
                   "no request can be served: raise --hbm-gb / --kv-mem-ratio or lower --max-concurrency")
    fit = plan.max_concurrency_at_max_len
    if requested_concurrency is not None and fit is not None and fit < requested_concurrency:
        out.append(f"only {fit} requests of {max_len} tokens fit in the KV budget, fewer than "
                   f"--max-concurrency {requested_concurrency}")
    return out
