"""Init link on the render as written: its constants and every layer of the real model.

The numeric run builds a tiny prefix of the layers (and, for windows a CPU cannot cross, runs
the implementer's render of the tiny window), so what the render decides for the other layers and
at the real window is checked here: each module constant against the manifest the render
claims, and ``init_kv_cache`` run for every layer index of the full model (placeholders only, no
cache is allocated) against that layer's attn_type, window and cache entries.
"""

from __future__ import annotations

import math
import types

import torch
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from model_infer_kvcache.validators.kinds import kind_of, kinds_of
from model_infer_kvcache.validators.pipeline.host_model import state_dtypes
from model_infer_kvcache.validators.pipeline.report import Report


def expected_constants(manifest: SelectionManifest) -> dict[str, object]:
    """Module constant -> the value the manifest decided (names as the templates write them)."""
    m, p = manifest.model, manifest.parallel
    want: dict[str, object] = {"SOFTMAX_SCALE": manifest.fa.softmax_scale, "NUM_HEADS_PER_RANK": p.num_q_heads_per_rank,
                               "CACHE_DTYPE": getattr(torch, manifest.cache_dtype.value if manifest.cache_dtype
                                                      else m.dtype)}
    if manifest.kv_mode.value == "paged":
        want["BLOCK_SIZE"] = manifest.block_size
    if manifest.legacy_attention is not None and manifest.legacy_attention.kernel == "model":
        want["ATTN_LOGIT_SOFTCAPPING"] = manifest.legacy_attention.softcap
    for kind in kinds_of(manifest):  # each kind's own constants (validators/kinds)
        want.update(kind.expected_constants(manifest))
    sliding = [layer for layer in manifest.layers if layer.is_sliding]
    if sliding:
        want["SLIDING_WINDOW"] = sliding[0].sliding_window
        band = sliding[0]
        want["WINDOW_PRE_TOKENS_OFFSET"] = band.sliding_window - band.pre_tokens
        if len(sliding) != len(manifest.layers):
            want["SLIDING_LAYERS"] = frozenset(manifest.module_index(layer) for layer in sliding)
    return want


def _same(got: object, want: object) -> bool:
    if isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        return math.isclose(got, want, rel_tol=1e-12)
    return got == want


def check_constants(report: Report, manifest: SelectionManifest, module: types.ModuleType) -> None:
    """Constants the render defines must equal the manifest's; a missing one is left to the runtime checks."""
    want = expected_constants(manifest)
    bad = [f"{name} = {getattr(module, name)!r} (manifest {value!r})" for name, value in want.items()
           if hasattr(module, name) and not _same(getattr(module, name), value)]
    checked = sorted(name for name in want if hasattr(module, name))
    report.add("rendered constants match the manifest", "init", not bad, detail="; ".join(bad[:4]),
               checked=checked)


def check_every_layer(report: Report, manifest: SelectionManifest, mixin: type | None, cache_dtype: torch.dtype,
                      linear_mixin: type | None = None) -> None:
    """``init_kv_cache`` (``init_state_cache`` on a linear layer) for each of the model's layers: attn_type, window
    and entries per the manifest."""
    bad: list[str] = []
    for plan in manifest.layers:
        if plan.is_state:
            bad += _state_layer_problems(plan, linear_mixin, cache_dtype)
            continue
        if mixin is None:
            bad.append(f"layer {plan.index}: an attention layer and the render has no init_kv_cache")
            continue
        attn = mixin.__new__(mixin)
        try:
            attn.init_kv_cache(manifest.module_index(plan), cache_dtype)  # the index its module keeps
        except Exception as exc:  # the render's own init failing is a finding, named by layer
            bad.append(f"layer {plan.index}: init_kv_cache raised {type(exc).__name__}: {exc}")
            continue
        attn_type, window = plan.registers_as  # a chunked layer: the SlidingWindow manager, window = chunk
        got = (getattr(attn, "attn_type", None), getattr(attn, "sliding_window", None))
        if got != (attn_type, window):
            bad.append(f"layer {plan.index}: (attn_type, window) {got} != {(attn_type, window)}")
            continue
        if plan.is_chunked and getattr(attn, "attention_chunk_size", None) != plan.attention_chunk_size:
            bad.append(f"layer {plan.index}: attention_chunk_size {getattr(attn, 'attention_chunk_size', None)} != "
                       f"{plan.attention_chunk_size}")
            continue
        if getattr(attn, "kv_head_dim", None) is not None and plan.caches:
            # a per-layer-shape render (LAYER_SHAPES): the shape the layer's writes, FA call and (standalone) the
            # runner's allocation read is the layer's own
            want_shape = (plan.head_dim or manifest.model.head_dim,
                          plan.num_kv_heads_per_rank or manifest.parallel.num_kv_heads_per_rank)
            got_shape = (attn.kv_head_dim, getattr(attn, "kv_heads_per_rank", None))
            if got_shape != want_shape:
                bad.append(f"layer {plan.index}: (kv_head_dim, kv_heads_per_rank) {got_shape} != {want_shape}")
                continue
        entries = getattr(attn, "cache_entries", None)
        if entries is None:  # standalone and Legacy renders declare no entries
            continue
        got_entries = {e.cache_name: e for e in entries}
        split_kind = getattr(kind_of(manifest), "split_entries", None)  # a kind's own entries (V4's compressed)
        if split_kind is not None:
            got_entries, kind_problems = split_kind(manifest, plan, got_entries)
            bad += kind_problems
        want = {c.name: (attn_type, c.dim, c.num_head, window, manifest.block_size) for c in plan.caches}
        have = {e.cache_name: (e.attn_type, e.dim, e.num_head, e.sliding_window,
                               getattr(e, "block_size", manifest.block_size)) for e in got_entries.values()}
        if have != want:
            diff = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
            bad.append(f"layer {plan.index} {diff[0]}: (attn_type, dim, num_head, window, block_size) "
                       f"{have.get(diff[0])} != {want.get(diff[0])}")
    report.add(f"every layer's attn_type, window and cache entries match the manifest ({len(manifest.layers)} "
               "layers)", "init", not bad, detail="; ".join(bad[:3]), mismatches=len(bad),
               layers=len(manifest.layers))


def _state_layer_problems(plan, linear_mixin: type | None, cache_dtype: torch.dtype) -> list[str]:
    """A linear layer's ``init_state_cache``: attn_type Mamba and one MambaCacheEntry per planned state, with the
    planned shape (the dtype is the run's, as for KV caches)."""
    if linear_mixin is None:
        return [f"layer {plan.index}: a linear (Mamba) layer and the render has no init_state_cache"]
    layer = linear_mixin.__new__(linear_mixin)
    try:
        layer.init_state_cache(plan.index, **state_dtypes(cache_dtype, any(s.name == "conv_state" for s in plan.states),
                                                           any(s.name == "recurrent_state" for s in plan.states)))
    except Exception as exc:
        return [f"layer {plan.index}: init_state_cache raised {type(exc).__name__}: {exc}"]
    if getattr(layer, "attn_type", None) != plan.attn_type:
        return [f"layer {plan.index}: attn_type {getattr(layer, 'attn_type', None)!r} != {plan.attn_type!r}"]
    entries = getattr(layer, "cache_entries", None)
    if entries is None:  # standalone: the runner allocates the states
        return []
    want = {s.name: (plan.attn_type, list(s.shape)) for s in plan.states}
    have = {e.cache_name: (e.attn_type, list(getattr(e, "shape", []) or [])) for e in entries}
    if have != want:
        diff = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
        return [f"layer {plan.index} {diff[0]}: (attn_type, shape) {have.get(diff[0])} != {want.get(diff[0])}"]
    return []
