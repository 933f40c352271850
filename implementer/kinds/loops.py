"""Recurrent loops (Dory per_loop, manifest.recurrent_loops): what get_cache_info and INTEGRATION.md need to register
each later loop's attention modules as the cache layers after the model's (analyzer/kinds/loops.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoopCtx:
    first_layer: int  # the looped section's first decoder layer
    num_layers: int  # its decoder layers
    loops: int  # passes per forward
    module_attr: str  # the decoder layer's ModuleList of its loops-1 extra attention modules (the port adds it)


def fields(m) -> dict:
    x = m.recurrent_loops
    return {"loops": LoopCtx(int(x.first_layer), int(x.num_layers), int(x.loops), x.module_attr) if x else None}
