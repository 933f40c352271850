"""The render side of each cache kind: what its template partial (``templates/kinds/``) needs from the manifest
and what it refuses to render.

One module per kind: ``gqa`` (K/V caches, full and sliding groups), ``mla`` (the latent cache and its rope part),
``dsa`` (MLA plus the indexer's key cache and the sparse FA), ``recurrent`` (the linear layers' states),
``compressed`` (DeepSeek-V4: window, CSA and HCA layers rendered), ``qsa`` (Qwen4-Exp: GQA plus the indexer's raw and
pooled block keys, the block selection and the sparse FA), ``diff`` (DiffLlama: K/V as two half-head caches each,
four FA calls), ``chunked`` (Llama-4's chunked local
attention, inside the GQA partial). Each
exposes ``check(m)`` (raise the manifest field that makes the design unrenderable) and ``fields(m)`` (its
``RenderContext`` fields). ``kinds_of`` maps the kinds a manifest holds (``analyzer.kinds.attention_format``, the one
place that reads them, shared with the validators) to these modules: the rest of the implementer asks the kinds,
never the manifest's kind sections.
"""

from __future__ import annotations

from types import ModuleType

from model_infer_kvcache.analyzer.kinds import (
    COMPRESSED,
    DIFF,
    DSA,
    GQA,
    MLA,
    QSA,
    attention_format,
    holds_chunks,
    holds_cross,
    holds_states,
)
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from model_infer_kvcache.implementer.kinds import (
    chunked,
    compressed,
    cross,
    diff,
    dsa,
    gqa,
    mla,
    qsa,
    recurrent,
)
from model_infer_kvcache.implementer.kinds.common import bad

# Layer kinds the analyzer may plan that no partial renders, and why a render of them would be wrong.
UNRENDERED_LAYER_KINDS: dict[str, str] = {}


_BY_FORMAT = {COMPRESSED: compressed, DSA: dsa, MLA: mla, GQA: gqa, QSA: qsa, DIFF: diff}


def attention_kind(m: SelectionManifest) -> ModuleType:
    """The attention format every attention layer shares: DSA (MLA + indexer), MLA, or GQA/MHA."""
    return _BY_FORMAT[attention_format(m)]


def kinds_of(m: SelectionManifest) -> tuple[ModuleType, ...]:
    """The kinds the manifest's layers hold: its attention format, then the recurrent state of linear layers and the
    chunked local attention of chunked layers, and the cross-attention slots of an encoder-decoder's decoder."""
    return (attention_kind(m), *((recurrent,) if holds_states(m) else ()), *((chunked,) if holds_chunks(m) else ()),
            *((cross,) if holds_cross(m) else ()))


def renders_layer_shapes(m: SelectionManifest) -> bool:
    """Whether the templates give each layer its own K/V shape (layers[i].head_dim / num_kv_heads_per_rank): the
    paged GQA/MHA partial does (implementer/kinds/gqa.py LAYER_SHAPE_ATTRS); Legacy and the other kinds take one."""
    return m.kv_mode.value == "paged" and attention_kind(m) is gqa


def graph_mode_gap(m: SelectionManifest) -> str | None:
    """Why a graph-mode decode of ``m`` is not rendered (None: it is, and validated by capture): the templates
    render npugraph_ex decode (host-list FA lengths) and ge_graph decode (torchair.ops FA with tensor lengths) for
    GQA/MHA and MLA layers, in both deployment modes (the standalone runner pads decode to its batch and keeps a
    null block), MTP verify steps included (a second capture, 1 + next_n tokens per row); DiffLlama's differential
    layers too (their four FA calls are GQA's call on half-head caches)."""
    if m.exe_mode.value == "npugraph_ex" and m.exe_mode.dynamic_graph is False:
        where = m.exe_mode.dynamic_graph_source or "the manifest"
        return (f"with enable_dynamic_graph False ({where}): a static graph takes the host-list FA lengths as "
                "constants of the capture and replays the first step's lengths (serve it with a dynamic graph)")
    if m.kv_mode.value == "legacy":
        return "for a Legacy (contiguous) cache: the engine's graph mode serves paged caches"
    if holds_cross(m):
        return "with cross-attention slots: the templates capture decoder-only decode"
    if attention_format(m) not in (GQA, MLA, DIFF) or holds_states(m):
        return (f"for {attention_format(m).upper()} layers{' with linear-attention states' if holds_states(m) else ''}"
                ": the templates capture GQA/MHA (differential included) and MLA decode only (the others convert "
                "lengths on the host inside the step)")
    return None


def check_unrendered(m: SelectionManifest) -> None:
    compressed.check(m)
    if holds_chunks(m):
        chunked.check(m)
    if m.exe_mode is not None and m.exe_mode.value != "eager":
        why = graph_mode_gap(m)
        if why:
            raise bad("exe_mode", f"not supported by kvcache: {m.exe_mode.value} decode ({m.exe_mode.source}) {why}; "
                                  "serve decode eagerly (--exe-mode eager) or follow the manifest's "
                                  "exe_mode.consequences by hand")
    for kind, why in UNRENDERED_LAYER_KINDS.items():
        layers = [layer.index for layer in m.layers if layer.layer_kind == kind]
        if layers:
            raise bad(f"layers[{layers[0]}].layer_kind", f"{len(layers)} layer(s) use {why}")


__all__ = ["UNRENDERED_LAYER_KINDS", "attention_kind", "renders_layer_shapes", "check_unrendered", "graph_mode_gap", "kinds_of"]
