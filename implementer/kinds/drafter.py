"""A drafter over its target model's cache (analyzer/kinds/drafter.py), render side: its own attention file, no
cache entries and no runner (the target's engine or runner owns every block; the drafter reads two of its layers).

The render binds each drafter layer to the target's module whose cache it reads (``bind_target_caches``: per
attn_type the target's last layer of that type holding its own cache, transformers' "store" layer) and takes the
target's block table from the step's metadata: ``block_table[attn_type]`` in framework mode (the engine's table per
manager), the runner's one ``block_table`` in standalone mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import jinja2
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.framework_checkout import DEFAULT_RENDER_CONTRACT, render_api
from model_infer_kvcache.analyzer.kinds.drafter import INT32_MAX
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from model_infer_kvcache.analyzer.operators.fa_facts import FA_KEYWORDS
from model_infer_kvcache.analyzer.version import __version__
from model_infer_kvcache.implementer.header import design_line, generated_line
from model_infer_kvcache.implementer.kinds.common import bad

TEMPLATE = "kinds/drafter_attention.py.j2"
INTEGRATION_TEMPLATE = "kinds/drafter_integration.md.j2"


@dataclass(frozen=True)
class DrafterLayerCtx:
    attn_type: str
    head_dim: int
    kv_heads: int
    sparse_mode: int
    pre_tokens: int
    next_tokens: int
    window: int | None
    derivation: str | None


def check(m: SelectionManifest) -> None:
    """What the drafter render serves: a paged target cache read by FA in TND."""
    if m.kv_mode.value != "paged":
        raise bad("kv_mode", f"not supported by kvcache: a drafter over a {m.kv_mode.value} target cache (the drafter "
                             "reads the target's cache through its block table: paged only)")
    if m.fa.input_layout != "TND":
        raise bad("fa.input_layout", f"{m.fa.input_layout}: the drafter packs each request's drafted tokens (TND)")
    if m.exe_mode is not None and m.exe_mode.value != "eager":
        raise bad("exe_mode", f"not supported by kvcache yet: a {m.exe_mode.value} drafter ({m.exe_mode.source}): the "
                              "drafter's FA calls are rendered and validated eager only")
    if m.parallel.attn_tp_size > 1:
        raise bad("parallel.attn_tp_size", f"not supported by kvcache yet: a drafter at attention TP "
                                           f"{m.parallel.attn_tp_size}: its validation shards no drafter's heads "
                                           "(validators/pipeline/drafter_run.py runs one rank)")


def layer_ctx(m: SelectionManifest) -> dict[str, DrafterLayerCtx]:
    """One plan per attn_type (every layer of a type reads the same target layer with the same band)."""
    out: dict[str, DrafterLayerCtx] = {}
    for layer in m.layers:
        plan = DrafterLayerCtx(layer.attn_type, layer.head_dim or m.model.head_dim,
                               layer.num_kv_heads_per_rank or m.parallel.num_kv_heads_per_rank,
                               layer.sparse_mode.decode, layer.pre_tokens, layer.next_tokens, layer.sliding_window,
                               layer.window_derivation)
        if out.setdefault(layer.attn_type, plan) != plan:
            raise bad(f"layers[{layer.index}]", f"{layer.attn_type} layers disagree on their shape or band: they read "
                                                "one target layer's cache")
    return out


def render(m: SelectionManifest, env: jinja2.Environment, attention_file: str, integration_file: str,
           decisions: list[tuple[str, ...]]) -> dict[str, str]:
    check(m)
    if m.blockers:
        raise InputError("--manifest", "manifest has blockers: " + "; ".join(b.message for b in m.blockers),
                         field="blockers")
    c = dict(generated_line=generated_line(__version__, m.content_hash()),
             design_line=design_line(m.model.model_type, m.deploy_mode.value,
                                     render_api(m.framework_api or DEFAULT_RENDER_CONTRACT), m.kv_mode.value,
                                     m.fa.version, m.fa.input_layout),
             model_type=m.model.model_type, deploy_mode=m.deploy_mode.value, fa=FA_KEYWORDS[m.fa.version],
             scale=repr(float(m.fa.softmax_scale)), scale_derivation=m.fa.scale_derivation,
             num_heads_per_rank=m.parallel.num_q_heads_per_rank, layers=layer_ctx(m),
             layer_types={layer.index: layer.attn_type for layer in m.layers}, int32_max=INT32_MAX,
             shared_kv_keys=m.drafter.shared_kv_keys)
    files = {attention_file: env.get_template(TEMPLATE).render(c=c)}
    windows = [p.window for p in c["layers"].values() if p.window]
    files[integration_file] = env.get_template(INTEGRATION_TEMPLATE).render(
        c={**c, "window": min(windows) if windows else None}, files=sorted(files), decisions=decisions)
    return files
