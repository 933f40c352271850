"""Drive a drafter over its target's cache (manifest ``drafter``, Gemma-4 assistants): no request stream of its own.

The host plays the target: per attn_type it fills a paged cache with the target's K/V (through the emulated
``npu_scatter_nd_update_`` at the slots of a shuffled block table), beside a decoy earlier layer of the same type
(other K/V: a render that binds the wrong target layer reads them) and a KV-shared target layer (no cache). Each
request brings its target prefix length P and a block of drafted tokens (inputs_embeds of 2 x backbone hidden,
random). The rendered attention runs inside the transformers drafter's layers (its q_proj / q_norm / RoPE and
o_proj around it) with every request's block packed (TND), and the logits are compared with transformers' own
forward given the same K/V dense (``shared_kv_states``), one request at a time.

The run is at CPU sizes: the config cut to the layers up to the first of every type, a small hidden size and
vocabulary. Its window is the config's up to AS_WRITTEN_WINDOW, and then the given render runs as written (the
prefixes cross the window, its W + 1 keys span a 128-token block boundary); a longer window is cut to CPU_WINDOW and
the implementer's render of that config's drafter manifest (re-analyzed) runs instead, the given render checked byte
for byte against the implementer's render of its own manifest (a note when they differ).
"""

from __future__ import annotations

import copy
import importlib
import json
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.files import atomic_write_text
from model_infer_kvcache.analyzer.kinds.drafter import SHARED_KV_KEYS
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from model_infer_kvcache.implementer.render import render_manifest, write_rendered
from model_infer_kvcache.validators.pipeline.host_model import import_rendered
from model_infer_kvcache.validators.pipeline.precision import TOLERANCE, float64_upcasts
from model_infer_kvcache.validators.pipeline.report import Report

# The longest window a CPU run reads as written: the target caches then hold ~W + 150 positions (Gemma-4's 512 / 1024:
# at 4 KV heads of 512 float64 each cache is ~10 MB); a longer one is cut to CPU_WINDOW.
AS_WRITTEN_WINDOW = 4096
CPU_WINDOW = 150
DRAFTED = (3, 2)  # drafted tokens per request (at most window + 1: analyzer/kinds/drafter.py)
BLOCK_SIZE = 128


def prefixes(window: int | None) -> tuple[int, ...]:
    """The target's prefix length per request: past the window (its start past the first key) by 50 and 150."""
    return ((window or CPU_WINDOW) + 50, (window or CPU_WINDOW) + 150)


def cpu_config(real: dict[str, Any], window: int | None = CPU_WINDOW) -> dict[str, Any]:
    """The drafter config at CPU sizes: the layers up to the first of each type (the heads and head dims kept), its
    window ``window`` (None: the config's)."""
    d = copy.deepcopy(real)
    text = d.get("text_config", d)
    types = text["layer_types"]
    n = 1 + max(types.index(t) for t in set(types))
    text.update(num_hidden_layers=n, layer_types=types[:n], num_kv_shared_layers=n, hidden_size=64,
                intermediate_size=128, vocab_size=512, **({"sliding_window": window} if window else {}))
    if isinstance(text.get("per_layer_config"), dict):
        text["per_layer_config"] = {k: v for k, v in text["per_layer_config"].items() if int(k) < n}
    if "backbone_hidden_size" in d:
        d["backbone_hidden_size"] = 32
    return d


def run_drafter(report: Report, manifest: SelectionManifest, rendered_dir: str, real: dict[str, Any], seed: int,
                dtype: torch.dtype, ops, readings) -> None:
    """The given render against the implementer's, then the CPU-sized drafter run inside ``ops`` (the emulated
    torch_npu, or the device's) under the run's device ``readings`` (the band's pre_tokens reading among them: the
    CPU-sized manifest is planned under the reading the given one was)."""
    window = max((layer.sliding_window or 0 for layer in manifest.layers), default=0)
    with tempfile.TemporaryDirectory(prefix="kvcache-drafter-") as tmp:
        path = Path(tmp) / "config.json"
        as_written = window <= AS_WRITTEN_WINDOW
        atomic_write_text(path, json.dumps(cpu_config(real, None if as_written else CPU_WINDOW)))
        if as_written:
            run_manifest, run_render = manifest, rendered_dir
        else:
            given = {p.name: p.read_text(encoding="utf-8") for p in Path(rendered_dir).glob("*.py")}
            if given != {n: t for n, t in render_manifest(manifest).files.items() if n.endswith(".py")}:
                report.notes.append("the given render differs from the implementer's render of its manifest: the CPU "
                                    "run judges the implementer's render of the CPU-sized manifest only")
            run_manifest = analyze(AnalyzeRequest(config=str(path), deploy_mode=manifest.deploy_mode.value,
                                                  window_reading=window_reading(manifest)))
            run_render = str(Path(tmp) / "render")
            write_rendered(render_manifest(run_manifest), run_render)
            report.notes.append(f"window {window} > {AS_WRITTEN_WINDOW}: the run reads the implementer's render of the "
                                f"config at window {CPU_WINDOW}")
        model = build_drafter(path, seed)
        with ops, readings, float64_upcasts():  # float64 stays float64 in transformers' eager softmax and norms
            check_drafter(report, run_manifest, run_render, model, seed, dtype)


def window_reading(manifest: SelectionManifest) -> str:
    """The window reading the manifest's sliding layers were planned under (pre_tokens W: exclusive, W + 1:
    inclusive, analyzer/kinds/drafter.window_tokens), for the CPU-sized manifest."""
    sliding = next((layer for layer in manifest.layers if layer.sliding_window), None)
    return "inclusive" if sliding and sliding.pre_tokens == sliding.sliding_window + 1 else "exclusive"


def build_drafter(config_path: Path, seed: int) -> torch.nn.Module:
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    d = json.loads(config_path.read_text(encoding="utf-8"))
    cfg = CONFIG_MAPPING[d["model_type"]](**{k: v for k, v in d.items() if k not in ("model_type",
                                                                                        "transformers_version")})
    cfg._attn_implementation = "eager"
    cfg.get_text_config()._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # random weights, not the init's zeros / ones (norms included)
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    return model


def _target(shapes: dict[str, tuple[int, int]], plens: tuple[int, ...], gen: torch.Generator, dtype):
    """The target's modules as the drafter's render meets them (attn_type, layer_idx, kv_source_layer, k_cache,
    v_cache), its per-request dense K/V of the layer the drafter must read, and the block table per attn_type."""
    per_request = -(-max(plens) // BLOCK_SIZE)
    num_blocks = 1 + per_request * len(plens)  # block 0: the null block, never a request's
    table = (1 + torch.randperm(num_blocks - 1, generator=gen)).view(len(plens), per_request).to(torch.int32)
    modules, dense = [], {}
    import torch_npu  # the emulation (install_emulation) or the device's

    for i, attn_type in enumerate(sorted(shapes)):
        heads, d = shapes[attn_type]
        for role, layer_idx in (("decoy", 2 * i), ("store", 2 * i + 1)):
            k_cache = torch.zeros(num_blocks, BLOCK_SIZE, heads, d, dtype=dtype)
            v_cache = torch.zeros_like(k_cache)
            # keys of norm ~1 (a q_norm'ed query of norm ~sqrt(d) at scale 1 then scores ~N(0, 1)): a soft attention,
            # where a key masked or shown wrongly moves the output (unit keys make it an argmax that hides them)
            kv = [(torch.randn(p, heads, d, generator=gen, dtype=dtype) / d**0.5,
                   torch.randn(p, heads, d, generator=gen, dtype=dtype)) for p in plens]
            for row, (k, v) in enumerate(kv):
                pos = torch.arange(k.shape[0])
                slots = (table[row, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE).view(-1, 1)
                torch_npu.npu_scatter_nd_update_(k_cache.view(-1, heads, d), slots, k)
                torch_npu.npu_scatter_nd_update_(v_cache.view(-1, heads, d), slots, v)
            modules.append(SimpleNamespace(attn_type=attn_type, layer_idx=layer_idx, kv_source_layer=None,
                                           k_cache=k_cache, v_cache=v_cache, role=role))
            if role == "store":
                dense[attn_type] = kv
        modules.append(SimpleNamespace(attn_type=attn_type, layer_idx=2 * len(shapes) + i, kv_source_layer=2 * i + 1,
                                       role="shared"))
    return modules, dense, table


def check_drafter(report: Report, manifest: SelectionManifest, rendered_dir: str, model: torch.nn.Module, seed: int,
                  dtype: torch.dtype) -> None:
    """Run ``rendered_dir`` (the render of ``manifest``) inside ``model`` over a filled target cache; report V233 and
    V308. Call under the emulation (or on the device)."""
    gen = torch.Generator().manual_seed(seed)
    plens = prefixes(max((layer.sliding_window or 0 for layer in manifest.layers), default=0))
    text = model.config.get_text_config()
    attn_modules = [layer.self_attn for layer in model.model.layers]
    # per attn_type the target cache's (KV heads, head_dim): transformers' module of that type
    shapes = {layer.attn_type: (text.num_attention_heads // attn.num_key_value_groups, attn.head_dim)
              for layer, attn in zip(manifest.layers[:len(attn_modules)], attn_modules, strict=True)}
    dims = shapes
    model = model.to(dtype)
    rendered = import_rendered(rendered_dir).attention
    target, dense, table = _target(shapes, plens, gen, dtype)
    framework = manifest.deploy_mode.value == "framework"
    hidden = model.pre_projection.in_features
    embeds = [torch.randn(1, t, hidden, generator=gen, dtype=dtype) for t in DRAFTED]
    positions = [torch.arange(p, p + t)[None] for p, t in zip(plens, DRAFTED, strict=True)]

    # the reference: transformers' drafter, one request at a time, the target K/V dense
    with torch.no_grad():
        want = [model(inputs_embeds=x, position_ids=pos, shared_kv_states={
            SHARED_KV_KEYS[t]: tuple(s.permute(1, 0, 2)[None] for s in dense[t][r]) for t in dense
        }).logits[0] for r, (x, pos) in enumerate(zip(embeds, positions, strict=True))]

    meta = SimpleNamespace(
        block_table={t: table for t in dims} if framework else table,
        actual_seq_lengths_cu_q=torch.tensor(DRAFTED).cumsum(0),
        actual_seq_lengths_kv=torch.tensor(plens),
        attention_mask=~torch.tril(torch.ones(2048, 2048, dtype=torch.bool)),  # the engine's band / causal mask
    )
    calls: list[tuple[int, Any, Any]] = []  # per FA call: the layer, its key cache's storage, its block table
    rendered.torch_npu = _Recording(rendered.torch_npu, calls)
    layers = []
    for i, attn in enumerate(attn_modules):
        layer = type("DrafterLayer", (rendered.KVCacheDrafterMixin,), {})()
        layer.init_drafter_cache(i)
        layers.append(layer)
        _route(attn, layer, meta, rendered.torch_npu)
    rendered.bind_target_caches(layers, target)
    owner = {t: next(m for m in target if m.attn_type == t and m.role == "store") for t in dims}
    try:
        with torch.no_grad():
            x = torch.cat(embeds, dim=1)
            h = model.model(inputs_embeds=model.pre_projection(x), position_ids=torch.cat(positions, dim=1),
                            attention_mask={k: None for k in SHARED_KV_KEYS.values()}, shared_kv_states={},
                            use_cache=False).last_hidden_state
            got = model.lm_head(h)[0] if not model.config.use_ordered_embeddings \
                else model.masked_embedding(h, model.lm_head.weight)[0]
    except Exception as exc:  # the rendered code or an operator rejected a call: a finding, not a crash
        got = None
        report.add("rendered code runs without operator errors", "runtime", False,
                   detail=f"layer {calls[-1][0] if calls else '?'}: {type(exc).__name__}: {exc}")
    _check_reads(report, manifest, len(attn_modules), calls, owner, table)
    if got is None:
        return
    diff = max(float((g - w).abs().max()) for g, w in zip(got.split(list(DRAFTED)), want, strict=True))
    tol = TOLERANCE[str(dtype).removeprefix("torch.")]
    report.add(f"drafter logits vs transformers (the same K/V dense as shared_kv_states) max |diff| <= {tol:g}",
               "numeric", diff <= tol, max_abs_diff=diff,
               requests=len(plens), prefixes=list(plens), drafted=list(DRAFTED))


def _check_reads(report: Report, manifest: SelectionManifest, n: int, calls: list, owner: dict, table) -> None:
    """V233: one FA call per layer, its key cache the target's last layer of the layer's attn_type (not the decoy
    before it) and its block table the target's."""
    seen = {i for i, _, _ in calls}
    problem = ""
    for i, key, block_table in calls:
        want = owner[manifest.layers[i].attn_type]
        if key != want.k_cache.untyped_storage().data_ptr():
            got = next((m for m in owner.values() if m.k_cache.untyped_storage().data_ptr() == key), None)
            problem = problem or (f"layer {i} ({manifest.layers[i].attn_type}) reads "
                                  + (f"the target's {got.attn_type} layer {got.layer_idx}" if got else
                                     "a cache that is not its target layer's (the decoy before it)")
                                  + f", not the target's last {want.attn_type} layer {want.layer_idx}")
        elif block_table is not table:
            problem = problem or f"layer {i} passes a block table that is not the target's"
    if not problem and (len(calls) != n or len(seen) != n):
        problem = f"{len(calls)} FA calls for {n} layers (layers {sorted(seen)})"
    report.add(f"drafter: each layer's FA reads the target's last layer of its attn_type through its block table "
               f"({n} layers)", "runtime", not problem, detail=problem, calls=len(calls))


class _Recording:
    """The render's ``torch_npu`` with its FA calls recorded: the calling layer, the key cache's storage, the
    block table (the op itself runs unchanged)."""

    def __init__(self, ops, calls: list):
        self._ops, self._calls = ops, calls

    def __getattr__(self, name: str):
        op = getattr(self._ops, name)
        if not name.startswith("npu_fused_infer_attention_score"):
            return op

        def recorded(query, key, value, *args, **kwargs):
            self._calls.append((self._calls_layer, key.untyped_storage().data_ptr(), kwargs.get("block_table")))
            return op(query, key, value, *args, **kwargs)

        return recorded


def _route(attn, layer, meta, recording: _Recording) -> None:
    """The transformers drafter layer's queries (q_proj, q_norm, RoPE as its forward computes them) through the
    render's ``drafter_attention``, then its o_proj; its K/V path (shared_kv_states) is never read."""
    rope = importlib.import_module(type(attn).__module__).apply_rotary_pos_emb

    def forward(hidden_states, position_embeddings, attention_mask=None, shared_kv_states=None, cache=None,
                **kwargs):
        cos, sin = position_embeddings
        q = attn.q_proj(hidden_states).view(*hidden_states.shape[:-1], -1, attn.head_dim)
        q = rope(attn.q_norm(q), cos, sin, unsqueeze_dim=2)
        recording._calls_layer = layer.layer_idx  # the layer the next FA call is recorded under
        out = layer.drafter_attention(q[0], meta)
        return attn.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), None

    attn.forward = forward
