"""Decoder layers called several times per forward, a cache per call (manifest recurrent_loops: Dory per_loop, HRM's
cycles; analyzer/kinds/loops.py): the tiny model the validation runs, and its manifest.

The decoder layers fall into sections, runs of layers always called one after the other (Dory: input, recurrent,
output; HRM: the L stack, the H stack). The tiny model keeps the first layer of a section called once and the
shortest start (two layers at least) of a section called several times that holds each of its layer plans; its
manifest is the real one's calls of those layers, in transformers' cache order (``layer_idx`` + the call's offset):
the render of that manifest is what runs.
"""

from __future__ import annotations

import json
from typing import Any


def _plan(layer) -> str:
    return json.dumps(layer.model_dump(mode="json", exclude={"index", "decoder_layer"}), sort_keys=True)


def sections(calls: list[int], n: int) -> list[list[int]]:
    """The decoder layers 0..n-1 as sections: layer d + 1 joins d's when each of d's calls is followed by one of
    d + 1 (same count, the next cache layer)."""
    at: dict[int, list[int]] = {d: [] for d in range(n)}
    for i, d in enumerate(calls):
        at[d].append(i)
    out: list[list[int]] = []
    for d in range(n):
        if out and [i + 1 for i in at[d - 1]] == at[d]:
            out[-1].append(d)
        else:
            out.append([d])
    return out


def kept_layers(manifest) -> list[int] | None:
    """The real decoder layers the tiny model keeps; None without loops."""
    x = manifest.recurrent_loops
    if x is None:
        return None
    first = {d: x.calls.index(d) for d in range(manifest.model.num_layers)}
    kept = []
    for section in sections(x.calls, manifest.model.num_layers):
        if x.calls.count(section[0]) == 1:
            kept.append(section[0])
            continue
        # at least two: a call routed by the section's first layer index instead of its own shows from the second
        wanted = {_plan(manifest.layers[first[d]]) for d in section}
        seen = set()
        for j, d in enumerate(section):
            kept.append(d)
            seen.add(_plan(manifest.layers[first[d]]))
            if seen == wanted and j >= 1:
                break
    return kept


def cuts(manifest) -> bool:
    """The tiny model keeps fewer layers than the manifest plans (cpu_loops has something to cut)."""
    kept = kept_layers(manifest)
    return kept is not None and len(kept) < manifest.model.num_layers


def cpu_loops(data: dict[str, Any], manifest) -> bool:
    """The manifest ``data`` (a model_dump of ``manifest``) cut to the tiny model's layers, in place; False where
    nothing is cut."""
    if not cuts(manifest):
        return False
    kept = kept_layers(manifest)
    x = manifest.recurrent_loops
    tiny = {d: j for j, d in enumerate(kept)}
    out, calls = [], []
    for i, d in enumerate(x.calls):
        if d in tiny:
            plan = json.loads(json.dumps(data["layers"][i]))
            plan.update(index=len(out), decoder_layer=tiny[d])
            out.append(plan)
            calls.append(tiny[d])
    data["layers"] = out
    data["model"]["num_layers"] = len(kept)
    data["recurrent_loops"].update(calls=calls, cache_layers=[i for i, d in enumerate(calls) if calls.index(d) != i])
    return True


def tiny_loop_fields(d: dict[str, Any], manifest) -> int | None:
    """The tiny config's layer fields (``manifest``: the tiny one, cpu_loops), every manifest layer kept; the
    decoder layer count, None without loops."""
    x = manifest.recurrent_loops
    if x is None:
        return None
    n = manifest.model.num_layers
    if x.stacks:  # HRM: two stacks of n / 2 layers; HrmTextConfig keeps num_hidden_layers as the slot count
        d.update(num_layers_per_stack=n // 2, num_hidden_layers=len(x.calls))
        return n
    # Dory: the sections' counts, layer_types in the halved form DoryConfig.__post_init__ keeps (no "mlp" entries)
    looped = [i for i in range(n) if x.calls.count(i) > 1]
    types = {layer.decoder_layer: layer for layer in manifest.layers}
    d["layer_types"] = ["sliding_attention" if types[i].is_sliding else "full_attention" for i in range(n)]
    d.update(num_hidden_layers=n, n_input_layers=looped[0], n_recurrent_layers=len(looped),
             n_output_layers=n - looped[-1] - 1, n_recurrent_loops=max(map(x.calls.count, looped)))
    return n
