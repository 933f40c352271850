"""Recurrent loops, analyzer side: a decoder whose middle section runs several times per forward (Dory,
transformers ``DoryModel.forward``), each loop with a KV cache of its own.

Dory's ``recurrent_kv_cache_mode`` ``per_loop``: the input section (``n_input_layers``) runs once, then the recurrent
section (``n_recurrent_layers``) ``n_recurrent_loops`` times, then the output section. Loop 0 writes the recurrent
layers' own cache layers; loop k >= 1 writes copies appended after the model's layers, reached through
``cache_offset = offset + k x n_recurrent`` (``offset`` = the output section's layer count), so its call of layer i
updates cache index ``i + cache_offset`` (``DoryAttention.forward``). For the cache each such call is a cache layer
of its own, of its layer's attention type: the plan lists them after the model's layers, in that index order, and
the port gives every loop its own attention module with the layer's weights tied (one module keeps one cache, as
for Zamba2's shared block).

``last_loop`` (earlier loops read, without writing, the cache only the last loop writes: ``DoryPastReader``) is
refused: those reads attend over the cached past plus the loop's own tokens without storing them, which the paged
write-then-attend call does not express.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from model_infer_kvcache.analyzer.errors import InputError

PER_LOOP, LAST_LOOP = "per_loop", "last_loop"
# the decoder layer's attribute the port adds: its attention modules of loops 1.. (nn.ModuleList), weights tied
MODULE_ATTR = "loop_attentions"
SOURCE = "transformers DoryModel.forward (cache_offset = offset + extra_idx * n_recurrent)"


@dataclass(frozen=True)
class LoopFacts:
    """The recurrent section (decoder layers first_layer .. first_layer + num_layers - 1) run ``loops`` times."""

    first_layer: int
    num_layers: int
    loops: int
    source: str

    def extra_layers(self) -> tuple[int, ...]:
        """The decoder layer each extra cache layer belongs to, in transformers' cache index order (after the
        model's own layers): loop 1's recurrent layers, then loop 2's, ..."""
        return tuple(self.first_layer + j for _ in range(1, self.loops) for j in range(self.num_layers))


def _int(get, where: str, name: str, default: int) -> tuple[int, str]:
    hit = get(name) or (default, f"default: transformers DoryConfig.{name}")
    if not isinstance(hit[0], int) or isinstance(hit[0], bool) or hit[0] < 0:
        raise InputError(where, f"must be a non-negative integer, got {hit[0]!r}", field=hit[1])
    return hit


def read_facts(get: Callable[..., tuple[Any, str] | None], where: str, num_layers: int) -> LoopFacts | None:
    """Dory's loops (``get``: the config reader, the halved layer counts DoryConfig.__post_init__ keeps); None where
    the section runs once. ``last_loop`` and an unknown mode are refused by name."""
    loops, loops_src = _int(get, where, "n_recurrent_loops", 2)
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
    first, _ = _int(get, where, "n_input_layers", 8)
    out, _ = _int(get, where, "n_output_layers", 8)
    rec_hit = get("n_recurrent_layers")
    rec = rec_hit[0] if rec_hit else num_layers - first - out
    if not isinstance(rec, int) or isinstance(rec, bool) or rec < 1 or first + rec + out != num_layers:
        raise InputError(where, f"n_input_layers {first} + n_recurrent_layers {rec} + n_output_layers {out} must "
                                f"equal num_hidden_layers {num_layers} (DoryConfig.validate_architecture)",
                         field=rec_hit[1] if rec_hit else "n_input_layers")
    return LoopFacts(first, rec, loops, f"{loops_src} = {loops}, {mode_src} = {mode!r}: {SOURCE}")


def loop_problems(m) -> list[tuple[str, str]]:
    """(field, why) where the manifest's layers contradict its recurrent_loops section: each extra cache layer (after
    the model's num_layers) must be its loop's copy of the recurrent layer it runs, with that layer's attention."""
    loops = getattr(m, "recurrent_loops", None)
    if loops is None:
        return []
    facts = LoopFacts(loops.first_layer, loops.num_layers, loops.loops, loops.source)
    base = m.model.num_layers * m.model.sublayers_per_layer
    for k, decoder in enumerate(facts.extra_layers()):
        if base + k >= len(m.layers):
            return [("layers", f"{len(m.layers)} entries: loop cache layer {base + k} (loop "
                               f"{1 + k // loops.num_layers}, decoder layer {decoder}) is missing")]
        layer = m.layers[base + k]
        if layer.decoder_layer != decoder:
            return [(f"layers[{base + k}].decoder_layer", f"{layer.decoder_layer}: cache layer {base + k} is loop "
                                                          f"{1 + k // loops.num_layers}'s call of decoder layer "
                                                          f"{decoder} ({SOURCE})")]
        if layer.attn_type != m.layers[decoder].attn_type:
            return [(f"layers[{base + k}].attn_type", f"{layer.attn_type}: decoder layer {decoder} attends "
                                                      f"{m.layers[decoder].attn_type}")]
    return []
