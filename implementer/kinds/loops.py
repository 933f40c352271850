"""Decoder layers called several times per forward (Dory per_loop, HRM's cycles; manifest.recurrent_loops): what
get_cache_info and INTEGRATION.md need to register each call's attention module as its cache layer, in transformers'
cache index order (analyzer/kinds/loops.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoopCtx:
    # the cache layers in transformers' order as runs of consecutive decoder layers: (first layer, count) pairs
    runs: tuple[tuple[int, int], ...]
    calls_per_layer: tuple[int, ...]  # per decoder layer, its calls per forward
    offset_kwarg: str  # the attention forward's keyword carrying the call's cache offset
    module_attr: str  # the decoder layer's ModuleList of its later calls' attention modules (the port adds it)
    # the model's stacks whose layers, joined in this order, are the decoder layers (HRM: L_module.layers,
    # H_module.layers); empty: the model's own ``layers``
    stacks: tuple[str, ...] = ()

    def call_counts(self) -> str:
        """'decoder layers 0..15: 6 calls, 16..31: 2 calls' (consecutive layers with one count grouped)."""
        groups: list[list[int]] = []
        for i, n in enumerate(self.calls_per_layer):
            if groups and groups[-1][2] == n:
                groups[-1][1] = i
            else:
                groups.append([i, i, n])
        return ", ".join((f"{a}..{b}" if a != b else f"{a}") + f": {n} call(s)" for a, b, n in groups)


def _runs(calls: list[int]) -> tuple[tuple[int, int], ...]:
    out: list[list[int]] = []
    for d in calls:
        if out and out[-1][0] + out[-1][1] == d:
            out[-1][1] += 1
        else:
            out.append([d, 1])
    return tuple((a, n) for a, n in out)


def fields(m) -> dict:
    x = m.recurrent_loops
    if x is None:
        return {"loops": None}
    counts = tuple(x.calls.count(d) for d in range(m.model.num_layers))
    return {"loops": LoopCtx(_runs(x.calls), counts, x.offset_kwarg, x.module_attr, tuple(x.stacks or ()))}
