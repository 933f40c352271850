"""A section run several times per forward, a cache per loop (manifest recurrent_loops: Dory per_loop,
analyzer/kinds/loops.py): the tiny model the validation runs, and its manifest.

The tiny model keeps one input layer, the shortest start of the looped section that holds each of its layer plans,
and one output layer; its manifest is the real one's plans of those layers, then each later loop's copies of the
looped ones, in transformers' cache order (``layer_idx + cache_offset``): the render of that manifest is what runs.
"""

from __future__ import annotations

import json
from typing import Any


def _plan(layer) -> str:
    return json.dumps(layer.model_dump(mode="json", exclude={"index", "decoder_layer"}), sort_keys=True)


def kept_layers(manifest) -> tuple[list[int], list[int], list[int]] | None:
    """(input, looped, output) real decoder layers the tiny model keeps; None without loops."""
    x = manifest.recurrent_loops
    if x is None:
        return None
    section = range(x.first_layer, x.first_layer + x.num_layers)
    wanted = {_plan(manifest.layers[i]) for i in section}
    looped, seen = [], set()
    for i in section:
        looped.append(i)
        seen.add(_plan(manifest.layers[i]))
        if seen == wanted:
            break
    end = x.first_layer + x.num_layers
    return ([0] if x.first_layer else []), looped, ([end] if end < manifest.model.num_layers else [])


def cuts(manifest) -> bool:
    """The tiny model keeps fewer layers than the manifest plans (cpu_loops has something to cut)."""
    kept = kept_layers(manifest)
    return kept is not None and sum(map(len, kept)) < manifest.model.num_layers


def cpu_loops(data: dict[str, Any], manifest) -> bool:
    """The manifest ``data`` (a model_dump of ``manifest``) cut to the tiny model's layers, in place; False where
    nothing is cut."""
    kept = kept_layers(manifest)
    if not cuts(manifest):
        return False
    inputs, looped, outputs = kept
    layers = inputs + looped + outputs
    x = manifest.recurrent_loops
    extra = [len(inputs) + j for _ in range(1, x.loops) for j in range(len(looped))]
    out = []
    for decoder, real in [*enumerate(layers), *((d, layers[d]) for d in extra)]:
        plan = json.loads(json.dumps(data["layers"][real]))
        plan.update(index=len(out), decoder_layer=decoder)
        out.append(plan)
    data["layers"] = out
    data["model"]["num_layers"] = len(layers)
    data["recurrent_loops"].update(first_layer=len(inputs), num_layers=len(looped),
                                   cache_layers=list(range(len(layers), len(out))))
    return True


def tiny_loop_fields(d: dict[str, Any], manifest) -> int | None:
    """The tiny Dory config's layers (``manifest``: the tiny one, cpu_loops): every manifest layer kept, its
    layer_types in the halved form DoryConfig.__post_init__ keeps (no "mlp" entries), the sections' counts; the
    layer count, None without loops."""
    x = manifest.recurrent_loops
    if x is None:
        return None
    n = manifest.model.num_layers
    types = {layer.decoder_layer: layer for layer in manifest.layers}
    d["layer_types"] = ["sliding_attention" if types[i].is_sliding else "full_attention" for i in range(n)]
    d.update(num_hidden_layers=n, n_input_layers=x.first_layer, n_recurrent_layers=x.num_layers,
             n_output_layers=n - x.first_layer - x.num_layers, n_recurrent_loops=x.loops)
    return n
