"""Decoder layers called several times per forward, each call with a KV cache of its own, analyzer side.

One weight set run in several places of the forward, each run writing its own cache layer at transformers' own cache
index ``layer_idx + offset`` (the offset a keyword of the attention's forward). For the cache each such call is a
cache layer of its own, of its layer's attention type: the plan lists the cache layers in transformers' index order
(``LoopFacts.calls``: the decoder layer each one runs), and the port gives every call after a layer's first its own
attention module with the layer's weights tied (one module keeps one cache, as for Zamba2's shared block).

- Dory's ``recurrent_kv_cache_mode`` ``per_loop`` (transformers ``DoryModel.forward``): the input section
  (``n_input_layers``) runs once, then the recurrent section (``n_recurrent_layers``) ``n_recurrent_loops`` times,
  then the output section. Loop 0 writes the recurrent layers' own cache layers; loop k >= 1 writes copies appended
  after the model's layers, ``cache_offset = offset + k x n_recurrent`` (``offset`` = the output section's count).
  ``last_loop`` (earlier loops read, without writing, the cache only the last loop writes: ``DoryPastReader``) is
  refused: those reads attend over the cached past plus the loop's own tokens without storing them, which the paged
  write-then-attend call does not express.
- HRM-text (transformers ``HrmTextModel.forward``): two stacks of ``num_layers_per_stack`` layers (``L_module``,
  ``H_module``); each of ``H_cycles`` high cycles runs the L stack ``L_cycles`` times, then the H stack once, the
  call at (h, l) writing cache slots ``(h x (L_cycles + 1) + l) x num_layers_per_stack + layer_idx``
  (``cycle_offset``; HrmTextConfig rewrites ``num_hidden_layers`` to the slot count). The decoder layers are the L
  stack's then the H stack's. What the cycles carry (z_H, z_L) lives within one forward: no state across forwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from model_infer_kvcache.analyzer.errors import InputError

PER_LOOP, LAST_LOOP = "per_loop", "last_loop"
# the decoder layer's attribute the port adds: its attention modules of its calls 1.. (nn.ModuleList), weights tied
MODULE_ATTR = "loop_attentions"
DORY_SOURCE = "transformers DoryModel.forward (cache_offset = offset + extra_idx * n_recurrent)"
HRM_SOURCE = ("transformers HrmTextModel.forward (cycle_offset = (h * (L_cycles + 1) + l) * num_layers_per_stack; "
              "L_module then H_module, HrmTextStack.layers)")
# HrmTextModel's two stacks, in decoder-layer order: the L stack's layers, then the H stack's
HRM_STACKS = ("L_module.layers", "H_module.layers")


@dataclass(frozen=True)
class LoopFacts:
    """The decoder layers called several times per forward: ``calls[i]`` is the decoder layer cache layer i (in
    transformers' cache index order) runs; each call passes ``offset_kwarg`` to the attention, its cache index being
    the module's ``layer_idx`` plus it. ``stacks``: the paths (under the model) of the stacks whose concatenation is
    the decoder, where it has several (HRM); None: one stack."""

    calls: tuple[int, ...]
    offset_kwarg: str
    stacks: tuple[str, ...] | None
    source: str

    def extra_layers(self) -> tuple[int, ...]:
        """The decoder layer of each cache layer that is not its layer's first call, in cache index order."""
        seen: set[int] = set()
        out = []
        for decoder in self.calls:
            if decoder in seen:
                out.append(decoder)
            seen.add(decoder)
        return tuple(out)


def _int(get, where: str, name: str, default: int | None, cls: str) -> tuple[int, str]:
    hit = get(name) or (default, f"default: transformers {cls}.{name}")
    if not isinstance(hit[0], int) or isinstance(hit[0], bool) or hit[0] < 0:
        raise InputError(where, f"must be a non-negative integer, got {hit[0]!r}", field=hit[1])
    return hit


def read_facts(get: Callable[..., tuple[Any, str] | None], where: str, num_layers: int) -> LoopFacts | None:
    """Dory's loops (``get``: the config reader, the halved layer counts DoryConfig.__post_init__ keeps); None where
    the section runs once. ``last_loop`` and an unknown mode are refused by name."""
    loops, loops_src = _int(get, where, "n_recurrent_loops", 2, "DoryConfig")
    if loops < 1:
        raise InputError(where, f"must be at least 1, got {loops} (DoryConfig.validate_architecture)", field=loops_src)
    if loops == 1:
        return None
    mode, mode_src = get("recurrent_kv_cache_mode") or (PER_LOOP, "default: transformers "
                                                                  "DoryConfig.recurrent_kv_cache_mode")
    if mode == LAST_LOOP:
        raise InputError(where, f"{mode!r}: Dory's loops before the last read the recurrent layers' cache without "
                                "writing it (transformers DoryPastReader: the cached past plus the loop's own tokens, "
                                f"nothing stored), which kvcache's paged write-then-attend call does not express "
                                f"({loops_src} = {loops}); 'per_loop' (a cache per loop) is planned",
                         field=mode_src)
    if mode != PER_LOOP:
        raise InputError(where, f"{mode!r} is not one of 'per_loop', 'last_loop' (DoryConfig)", field=mode_src)
    first, _ = _int(get, where, "n_input_layers", 8, "DoryConfig")
    out, _ = _int(get, where, "n_output_layers", 8, "DoryConfig")
    rec_hit = get("n_recurrent_layers")
    rec = rec_hit[0] if rec_hit else num_layers - first - out
    if not isinstance(rec, int) or isinstance(rec, bool) or rec < 1 or first + rec + out != num_layers:
        raise InputError(where, f"n_input_layers {first} + n_recurrent_layers {rec} + n_output_layers {out} must "
                                f"equal num_hidden_layers {num_layers} (DoryConfig.validate_architecture)",
                         field=rec_hit[1] if rec_hit else "n_input_layers")
    # the model's layers in order (loop 0 included), then loop k's copies of the recurrent section
    calls = tuple(range(num_layers)) + tuple(first + j for _ in range(1, loops) for j in range(rec))
    return LoopFacts(calls, "cache_offset", None, f"{loops_src} = {loops}, {mode_src} = {mode!r}: {DORY_SOURCE}")


def hrm_stacks(get: Callable[..., tuple[Any, str] | None], where: str) -> tuple[int, int, int, str] | None:
    """(num_layers_per_stack, H_cycles, L_cycles, source) of an HRM-style config (its cycle fields), None without them
    (read whatever the model_type: the fields say the decoder is two cycled stacks)."""
    per_stack, high, low = get("num_layers_per_stack"), get("H_cycles"), get("L_cycles")
    if per_stack is None or high is None or low is None:
        return None
    for value, field in (per_stack, high, low):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InputError(where, f"must be a positive integer, got {value!r} (HrmTextConfig)", field=field)
    slots = get("num_hidden_layers")
    want = per_stack[0] * high[0] * (low[0] + 1)
    if slots is not None and slots[0] != want:
        raise InputError(where, f"{slots[0]} is not {per_stack[1]} {per_stack[0]} x {high[1]} {high[0]} x "
                                f"({low[1]} {low[0]} + 1) = {want}: HrmTextConfig counts one cache slot per stack "
                                "call there", field=slots[1])
    return per_stack[0], high[0], low[0], (f"{per_stack[1]} = {per_stack[0]}, {high[1]} = {high[0]}, "
                                           f"{low[1]} = {low[0]}: {HRM_SOURCE}")


def stacks_of(section: dict[str, Any]) -> tuple[str, ...] | None:
    """The stacks whose joined layers are the decoder of a model built from this config section (HRM's two), None
    for one stack."""
    def get(name):
        return (section[name], name) if name in section else None
    try:
        return HRM_STACKS if hrm_stacks(get, "config") else None
    except InputError:  # the analyzer refuses that config by name; the build finds what it finds
        return None


def hrm_facts(per_stack: int, high: int, low: int, source: str) -> LoopFacts:
    """HRM's cache slots in transformers' order: cycle h runs the L stack (decoder layers 0..P-1) L_cycles times,
    then the H stack (decoder layers P..2P-1) once."""
    calls = []
    for _ in range(high):
        for _ in range(low):
            calls += range(per_stack)
        calls += range(per_stack, 2 * per_stack)
    return LoopFacts(tuple(calls), "cycle_offset", HRM_STACKS, source)


def loop_problems(m) -> list[tuple[str, str]]:
    """(field, why) where the manifest's layers contradict its recurrent_loops section: cache layer i must be a call of
    decoder layer calls[i], with that layer's attention, every decoder layer called, cache_layers its later calls."""
    loops = getattr(m, "recurrent_loops", None)
    if loops is None:
        return []
    calls = loops.calls
    if len(calls) != len(m.layers):
        return [("layers", f"{len(m.layers)} entries: recurrent_loops.calls lists {len(calls)} cache layers "
                           f"({loops.source})")]
    missing = sorted(set(range(m.model.num_layers)) - set(calls))
    if missing or any(not 0 <= d < m.model.num_layers for d in calls):
        return [("recurrent_loops.calls", f"must call each of the {m.model.num_layers} decoder layers (missing: "
                                          f"{missing}) and no other")]
    first: dict[int, int] = {}
    for i, (layer, decoder) in enumerate(zip(m.layers, calls, strict=True)):
        if layer.decoder_layer != decoder:
            return [(f"layers[{i}].decoder_layer", f"{layer.decoder_layer}: cache layer {i} is a call of decoder "
                                                    f"layer {decoder} ({loops.source})")]
        own = m.layers[first.setdefault(decoder, i)]
        if layer.attn_type != own.attn_type:
            return [(f"layers[{i}].attn_type", f"{layer.attn_type}: decoder layer {decoder} attends {own.attn_type}")]
    later = [i for i in range(len(calls)) if first[calls[i]] != i]
    if loops.cache_layers != later:
        return [("recurrent_loops.cache_layers", f"{loops.cache_layers}: the later calls are cache layers {later}")]
    return []
