"""Localisation of a numeric failure: where the model under test first leaves the transformers reference.

Runs only after the numeric link failed (``Report.first_failure`` names the first failing step and request).
The driver replays its stream up to that step with a ``Capture`` on the model under test: hooks on each
decoder layer's attention and MLP modules, and a tap on the cache-writer and FA operators that keeps each
call's arguments, output and ``file:line`` in the code under test (the model file, the rendered files).
``reference_activations`` runs transformers over the failing request with the same hooks, plus the keys and
values its attention receives (after RoPE) and its scaling. ``localise`` compares them layer by layer, in the
order a layer runs: attention input, cache write, attention output, MLP; the first sub-module that differs
is named with its operator calls and the argument that differs from its expected value, where one does,
and with the first per-token map its code computed that contradicts the step's packing (``Capture.packing``:
a token given the previous request's row, as a ``cu_seq_lens`` off by one does), where the driver knows it.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from model_infer_kvcache.analyzer.operators.fa_facts import (
    FA_KEYWORDS,
    FA_OP_NAMES,
    RECORDED_KEYWORDS,
    version_of,
)
from model_infer_kvcache.analyzer.operators.writers import CACHE_WRITERS
from model_infer_kvcache.validators.pipeline.evidence import storage
from model_infer_kvcache.validators.pipeline.host_model import model_inputs
from model_infer_kvcache.validators.pipeline.report import LAYER_OUTPUT

SUBMODULES = ("attention input", "cache write", "attention output", "MLP")
_ATTN_NAMES = ("self_attn", "attention", "self_attention", "attn")
_MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "moe", "ffn")
CACHE_ATTRS = ("k_cache", "v_cache", "nope_cache", "rope_cache")


class ReplayDone(Exception):
    """The target step has been captured: the replay stops there."""


def _child(block: torch.nn.Module, names: tuple[str, ...], parts: tuple[str, ...]):
    children = dict(block.named_children())
    for name in names:
        if name in children:
            return children[name]
    return next((m for n, m in children.items() if any(p in n.lower() for p in parts)), None)


def _attention_of(block):
    return _child(block, _ATTN_NAMES, ("attn", "attention"))


def decoder_blocks(model: torch.nn.Module) -> list[tuple[torch.nn.Module, object, object]]:
    """(block, attention module, MLP module) of each decoder layer: the longest ModuleList of same-class blocks
    with an attention child, found by structure (a transformers model and a checkout's model alike)."""
    best = None
    for path, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or not len(module) or len({type(b) for b in module}) != 1:
            continue
        if _attention_of(module[0]) is None:
            continue
        key = (len(module), -path.count("."))
        if best is None or key > best[0]:
            best = (key, module)
    if best is None:
        return []
    return [(b, _attention_of(b), _child(b, _MLP_NAMES, ("mlp", "moe", "ffn"))) for b in best[1]]


def _rows(value) -> torch.Tensor | None:
    """A module output (a tensor, or a tuple starting with one) as rows [tokens, features] (float64 copy)."""
    if isinstance(value, (tuple, list)):
        value = value[0] if value else None
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return None
    return value.detach().reshape(-1, value.shape[-1]).to("cpu", torch.float64).clone()


def _hidden_input(args, kwargs):
    return kwargs.get("hidden_states", args[0] if args else None)


def cache_namer(holders: Callable[[], Iterable]) -> Callable[[torch.Tensor], str | None]:
    """Cache tensor -> its attribute name (k_cache, v_cache...) on the attention objects ``holders()`` gives."""
    def name(t) -> str | None:
        ptr = storage(t)
        for holder in holders():
            for attr in CACHE_ATTRS:
                if ptr is not None and storage(getattr(holder, attr, None)) == ptr:
                    return attr
        return None

    return name


class Capture:
    """What the model under test did at one step: each layer's sub-module rows and its operator calls.

    ``packing``: the target step's packed rows as (request index within the step, position in its request) per
    row, when the driver knows them (a packed prefill): while ``installed()``, every 1-D integer tensor of one
    value per row that the code under test computes is held to them (``packing_finding``), so a per-token map
    that is wrong only at request boundaries (a ``cu_seq_lens`` off by one) is named by its own line."""

    def __init__(self, model, target_step: int, current_step: Callable[[], int], code_files: Iterable,
                 cache_name: Callable[[torch.Tensor], str | None], *, stop: bool = True,
                 packing: tuple[list[int], list[int]] | None = None):
        self.blocks = decoder_blocks(model)
        self.model = model
        self.target = target_step
        self.current_step = current_step
        self.code_files = {Path(f).resolve() for f in code_files}
        self.cache_name = cache_name
        self.stop = stop
        self.layer = -1
        self.seen: dict[int, dict[str, torch.Tensor]] = {}
        self.calls: list[dict] = []
        self.input_ids: torch.Tensor | None = None
        self.done = False
        self.packing = packing

    def active(self) -> bool:
        return not self.done and self.current_step() == self.target

    @contextlib.contextmanager
    def installed(self):
        handles = self.install()
        try:
            with _PackingMaps(self) if self.packing else contextlib.nullcontext():
                yield self
        finally:
            for h in handles:
                h.remove()

    def install(self) -> list:
        """Register the hooks; returns their handles (a model copy thrown away after the replay keeps them)."""
        handles = [self.model.register_forward_pre_hook(self._model_input, with_kwargs=True)]
        for i, (block, attn, mlp) in enumerate(self.blocks):
            if isinstance(attn, torch.nn.ModuleList):
                # attention sublayers in one list (LongCat-Flash): the list itself never runs, so the layer is
                # judged by its output as a whole (a block's own output is compared only here: a checkout's layer
                # may return its residual apart, which transformers' layer has already added)
                handles.append(block.register_forward_pre_hook(self._attention_input(i, record=False),
                                                               with_kwargs=True))
                handles.append(block.register_forward_hook(self._output(i, LAYER_OUTPUT)))
            elif attn is not None:
                handles.append(attn.register_forward_pre_hook(self._attention_input(i), with_kwargs=True))
                handles.append(attn.register_forward_hook(self._output(i, "attention output")))
            if mlp is not None:
                handles.append(mlp.register_forward_hook(self._output(i, "MLP")))
        if self.blocks:
            handles.append(self.blocks[-1][0].register_forward_hook(self._last_layer_done))
        return handles

    def _model_input(self, _module, args, kwargs):
        if self.active():
            self.layer = -1  # what runs before the first decoder layer (not the previous forward's last layer)
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.input_ids = ids.detach().reshape(-1).cpu().clone() if isinstance(ids, torch.Tensor) else None

    def _attention_input(self, i: int, record: bool = True):
        def hook(_module, args, kwargs):
            self.layer = i
            if self.active() and record:
                self.seen.setdefault(i, {})["attention input"] = _rows(_hidden_input(args, kwargs))

        return hook

    def _output(self, i: int, what: str):
        def hook(_module, _args, output):
            if self.active():
                self.seen.setdefault(i, {})[what] = _rows(output)

        return hook

    def _last_layer_done(self, _module, _args, _output):
        if self.active():
            self.done = True
            if self.stop:
                raise ReplayDone()

    def index_map(self, op: str, values: torch.Tensor) -> None:
        """A 1-D integer tensor the code under test computed at the target step (``_PackingMaps``): recorded, with
        its line, when it disagrees with the step's packing at request boundaries only; the first such map of a
        layer only (the maps computed from it, ``token_idx - cu_seq_lens[batch_idx]``, repeat its mistake)."""
        if not self.active() or values.numel() != len(self.packing[0]) or \
                any(c["kind"] == "index" and c["layer"] == self.layer for c in self.calls):
            return
        finding = packing_finding(values.reshape(-1).tolist(), *self.packing)
        at = self._where()
        if finding is not None and at != "?":
            self.calls.append({"op": op, "at": at, "layer": self.layer, "kind": "index", "finding": finding})

    def _where(self) -> str:
        """file:line (function) of the innermost frame in the code under test."""
        frame = sys._getframe(2)
        while frame is not None:
            try:
                path = Path(frame.f_code.co_filename).resolve()
            except (OSError, ValueError):
                path = None
            if path in self.code_files:
                return f"{path.name}:{frame.f_lineno} ({frame.f_code.co_name})"
            frame = frame.f_back
        return "?"

    def tap(self, op: str, arguments: dict, result) -> None:
        """One FA or cache-writer call (its arguments by parameter name, its result)."""
        if not self.active():
            return
        call = {"op": op, "at": self._where(), "layer": self.layer}
        if op in FA_OP_NAMES:
            call["kind"] = "fa"
            call["output"] = _rows(result[0] if isinstance(result, (tuple, list)) else result)
            call["keywords"] = {k: arguments[k] for k in RECORDED_KEYWORDS if k in arguments}
            call["has_mask"] = arguments.get("atten_mask") is not None
            name = FA_KEYWORDS[version_of(op)].scale  # the scale keyword as this FA version spells it
            if name in arguments:
                call["scale_arg"], call["scale"] = name, float(arguments[name])
        elif op in CACHE_WRITERS:
            writer = CACHE_WRITERS[op]
            call["kind"] = "write"
            call["cache"] = self.cache_name(arguments.get(writer.caches[0]))
            updates = arguments.get("updates")
            call["value"] = updates.detach().to("cpu", torch.float64).clone() if isinstance(updates, torch.Tensor) \
                else None
        else:
            return
        self.calls.append(call)

    def tapping(self, ops):
        """A stand-in for a module's ``torch_npu`` that taps the FA and writer calls through it."""
        return _TappedOps(ops, self)


class _PackingMaps(torch.overrides.TorchFunctionMode):
    """Hands each 1-D integer tensor a torch function returns to ``Capture.index_map`` (the target step only)."""

    def __init__(self, capture: Capture):
        super().__init__()
        self.capture = capture

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if isinstance(result, torch.Tensor) and result.dim() == 1 and not result.is_floating_point() \
                and not result.is_complex() and result.dtype != torch.bool and self.capture.active():
            self.capture.index_map(f"torch.{getattr(func, '__name__', func)}", result)
        return result


def packing_finding(values: list[int], requests: list[int], positions: list[int]) -> str | None:
    """What is wrong with a per-row map the model computed, when it is the step's request index or position of each
    packed row everywhere but at some request boundaries (a request's first or last row); None otherwise (another
    map altogether, or no row of any request lies inside it)."""
    n = len(requests)
    first = {r for r in range(n) if r == 0 or requests[r] != requests[r - 1]}
    last = {r for r in range(n) if r == n - 1 or requests[r] != requests[r + 1]}
    if not set(range(n)) - first - last:  # every row a boundary (decode rows, one-token prompts): nothing to tell
        return None
    for what, want in (("request index", requests), ("position", positions)):
        bad = [r for r in range(n) if values[r] != want[r]]
        if bad and all(r in first or r in last for r in bad):
            shown = bad[:4]
            rows = ", ".join(f"{r} (the {'first' if r in first else 'last'} token of request {requests[r]})"
                             for r in shown) + (" ..." if len(bad) > len(shown) else "")
            return (f"the {what} it gives each packed token is wrong at request boundaries: row(s) {rows} get "
                    f"{', '.join(str(values[r]) for r in shown)} instead of {', '.join(str(want[r]) for r in shown)}; "
                    f"its other {n - len(bad)} rows agree with the step's packing (each request's tokens in order)")
    return None


class _TappedOps:
    def __init__(self, ops, capture: Capture):
        self._ops = ops
        self._capture = capture

    def __getattr__(self, name):
        target = getattr(self._ops, name)
        if name not in FA_OP_NAMES and name not in CACHE_WRITERS:
            return target
        capture = self._capture

        def call(*args, **kwargs):
            result = target(*args, **kwargs)
            if name in FA_OP_NAMES:
                arguments = {**dict(zip(("query", "key", "value"), args, strict=False)), **kwargs}
            else:
                try:
                    arguments = inspect.signature(target).bind(*args, **kwargs).arguments
                except (TypeError, ValueError):
                    arguments = kwargs
            capture.tap(name, arguments, result)
            return result

        return call


# ---------------------------------------------------------------------------------------------- reference
class ReferenceActivations:
    """transformers over one sequence: per layer the sub-module rows, the attention's keys/values after RoPE,
    the keys before RoPE, the attention core's output and its scaling."""

    def __init__(self):
        self.seen: dict[int, dict[str, torch.Tensor]] = {}
        self.scaling: dict[int, float] = {}


@torch.no_grad()
def reference_activations(ref_model, tokens: list[int]) -> ReferenceActivations:
    acts = ReferenceActivations()
    blocks = decoder_blocks(ref_model)
    layer_of = {id(attn): i for i, (_, attn, _) in enumerate(blocks) if attn is not None}
    capture = Capture(ref_model, 0, lambda: 0, (), lambda t: None, stop=False)
    capture.blocks = blocks
    patched: list[tuple[object, object]] = []
    handles = []
    for i, (_, attn, _) in enumerate(blocks):
        if attn is None:
            continue
        module = sys.modules.get(type(attn).__module__)
        eager = getattr(module, "eager_attention_forward", None)
        if eager is not None and not any(m is module for m, _ in patched):
            patched.append((module, eager))
            module.eager_attention_forward = _recording_eager(eager, acts, layer_of)
        pre_rope = getattr(attn, "k_norm", None) or getattr(attn, "k_proj", None)
        if isinstance(pre_rope, torch.nn.Module):
            handles.append(pre_rope.register_forward_hook(_keep(acts, i, "key before RoPE")))
    try:
        with capture.installed():
            ids = torch.tensor(tokens, dtype=torch.long)[None]
            ref_model(input_ids=ids, use_cache=False, **model_inputs(ref_model, ids))
    finally:
        for module, eager in patched:
            module.eager_attention_forward = eager
        for h in handles:
            h.remove()
    for i, parts in capture.seen.items():
        acts.seen.setdefault(i, {}).update(parts)
    return acts


def _keep(acts: ReferenceActivations, i: int, what: str):
    def hook(_module, _args, output):
        if isinstance(output, torch.Tensor) and output.dim() >= 3:  # [1, L, N, D] or [1, L, N*D]
            acts.seen.setdefault(i, {})[what] = output[0].reshape(output.shape[1], -1).to(torch.float64).clone()

    return hook


def _recording_eager(eager, acts: ReferenceActivations, layer_of: dict[int, int]):
    def recording(module, query, key, value, attention_mask, *args, **kwargs):
        out = eager(module, query, key, value, attention_mask, *args, **kwargs)
        i = layer_of.get(id(module))
        if i is not None:
            tokens = key.shape[2]
            layer = acts.seen.setdefault(i, {})
            layer["key"] = key[0].transpose(0, 1).reshape(tokens, -1).to(torch.float64).clone()
            layer["value"] = value[0].transpose(0, 1).reshape(tokens, -1).to(torch.float64).clone()
            core = out[0] if isinstance(out, tuple) else out
            layer["attention core"] = core[0].reshape(tokens, -1).to(torch.float64).clone()
            scaling = kwargs.get("scaling", args[0] if args else None)
            if scaling is not None:
                acts.scaling[i] = float(scaling)
        return out

    return recording


# ---------------------------------------------------------------------------------------------- comparison
def _max_diff(got: torch.Tensor | None, want: torch.Tensor | None) -> float | None:
    if got is None or want is None or got.shape != want.shape:
        return None
    if not torch.isfinite(got).all():
        return float("inf")
    return (got - want).abs().max().item()


def _differs(diff: float | None, want: torch.Tensor | None, atol: float) -> bool:
    return diff is not None and diff > atol * max(1.0, want.abs().max().item())


def _select(t: torch.Tensor | None, total: int, rows: list[int]) -> torch.Tensor | None:
    """The request's rows of a step tensor holding ``total`` rows (any trailing shape)."""
    if t is None or total <= 0 or t.numel() % total:
        return None
    return t.reshape(total, -1)[rows]


def localise(capture: Capture, ref: ReferenceActivations, rows: list[int], positions: list[int],
             tokens: list[int], atol: float, judge: Callable[[dict], list[str]] | None = None) -> dict:
    """The first layer and sub-module where ``capture`` leaves ``ref`` on the request's ``rows`` (its tokens at
    ``positions``), with the operator calls of that sub-module; ``headline`` says where to look. ``judge``
    names the arguments of an FA call (a dict as ``fa_args.check_fa_calls`` takes) that differ from the
    manifest's decision (``fa_args.fa_call_mismatches``)."""
    out: dict = {"layer": None, "submodule": None, "max_abs_diff": None, "where": [], "calls": []}
    got_ids = capture.input_ids
    if got_ids is None or max(rows) >= got_ids.numel() or \
            got_ids[rows].tolist() != [tokens[p] for p in positions]:
        out["headline"] = ("the replay did not reproduce the failing step (its tokens differ from the first run's): "
                           "not localised")
        return out
    for i in range(len(capture.blocks)):
        got, want = capture.seen.get(i, {}), ref.seen.get(i, {})
        total = got["attention input"].shape[0] if got.get("attention input") is not None else 0
        found = _attention_input(got, want, rows, positions, atol)
        if found is None:
            found = _cache_write(capture, i, want, total, rows, positions, atol)
        if found is None:
            found = _attention_output(capture, i, got, want, ref.scaling.get(i), total, rows, positions, atol,
                                      judge)
        if found is None:
            d = _max_diff(_select(got.get("MLP"), total, rows), _pick(want.get("MLP"), positions))
            if _differs(d, _pick(want.get("MLP"), positions), atol):
                found = ("MLP", d, [], "the MLP's output (or the norm before it) differs from the reference's")
        if found is None and got.get(LAYER_OUTPUT) is not None:
            whole = _pick(want.get(LAYER_OUTPUT), positions)
            d = _max_diff(_select(got[LAYER_OUTPUT], got[LAYER_OUTPUT].shape[0], rows), whole)
            if _differs(d, whole, atol):
                calls = [c for c in capture.calls if c["layer"] == i and c["kind"] in ("fa", "write")]
                found = (LAYER_OUTPUT, d, calls, "the layer's output differs from the reference's; its attention "
                                                 "sublayers sit in one ModuleList, so the layer is judged as a whole: "
                                                 "look at its cache writes and FA calls")
        if found is not None:
            submodule, diff, calls, why = found
            if submodule != "attention input":  # a wrong per-token map of this layer's (or the model's) code
                picked = {id(c) for c in calls} | {id(c) for c in capture.calls
                                                   if c["kind"] == "index" and c["layer"] in (-1, i)}
                calls = [c for c in capture.calls if id(c) in picked]  # in the order they ran
            where = [c["at"] for c in calls if c.get("finding")] or [c["at"] for c in calls]
            out.update(layer=i, submodule=submodule, max_abs_diff=diff, where=list(dict.fromkeys(where)),
                       calls=[_plain_call(c) for c in calls])
            first = next((c for c in calls if c.get("finding")), None)
            look = (f"; look at {first['at']} {first['op']}" + (f" ({first['cache']})" if first.get("cache") else "")
                    + f": {first['finding']}") if first else (f"; look at {', '.join(out['where'])}: {why}"
                                                               if out["where"] else f": {why}")
            out["headline"] = (f"first diverging layer {i}, sub-module {submodule} (max |diff| {diff:.3g}; "
                               f"the layers before it agree){look}")
            return out
    out["headline"] = ("no decoder layer's attention input, cache write, attention output or MLP differs from the "
                       "reference at this step: the difference arises after the last decoder layer (final norm, "
                       "lm_head, logits selection)")
    return out


def _pick(t: torch.Tensor | None, positions: list[int]) -> torch.Tensor | None:
    return t[positions] if t is not None and max(positions) < t.shape[0] else None


def _attention_input(got, want, rows, positions, atol):
    total = got["attention input"].shape[0] if got.get("attention input") is not None else 0
    ref_in = _pick(want.get("attention input"), positions)
    d = _max_diff(_select(got.get("attention input"), total, rows), ref_in)
    if _differs(d, ref_in, atol):
        return ("attention input", d, [], "what reaches this layer's attention differs from the reference's "
                                          "(the previous layer's residual or norm, or the embedding)")
    return None


def _cache_write(capture, i, want, total, rows, positions, atol):
    writes = [c for c in capture.calls if c["layer"] == i and c["kind"] == "write"]
    bad = None
    for c in writes:
        kind = "key" if (c.get("cache") or "").startswith("k") else "value" if (c.get("cache") or "").startswith(
            "v") else None
        expected = _pick(want.get(kind), positions) if kind else None
        written = _select(c.get("value"), total, rows)
        d = _max_diff(written, expected)
        if d is None:
            continue
        c["max_abs_diff"] = d
        if _differs(d, expected, atol):
            letter = "K" if kind == "key" else "V"
            finding = (f"updates: the written {letter} differs from the reference's "
                       f"{'rotated K (after RoPE)' if kind == 'key' else 'V'} by {d:.3g}")
            before = _pick(want.get("key before RoPE"), positions) if kind == "key" else None
            if before is not None and not _differs(_max_diff(written, before), before, atol):
                finding += "; it equals the reference's K before RoPE (RoPE applied after the cache write)"
            c["finding"] = finding
            bad = d if bad is None else max(bad, d)
    if bad is None:
        return None
    return "cache write", bad, writes, "a cache write differs from the reference's keys/values"


def _attention_output(capture, i, got, want, scaling, total, rows, positions, atol, judge):
    ref_out = _pick(want.get("attention output"), positions)
    d = _max_diff(_select(got.get("attention output"), total, rows), ref_out)
    if not _differs(d, ref_out, atol):
        return None
    calls = [c for c in capture.calls if c["layer"] == i and c["kind"] == "fa"]
    core = _pick(want.get("attention core"), positions)
    for c in calls:
        findings = []
        if scaling is not None and "scale" in c and abs(c["scale"] - scaling) > 1e-9 * max(1.0, abs(scaling)):
            findings.append(f"{c['scale_arg']}={c['scale']:.8g}, expected {scaling:.8g} (the reference's "
                            "attention scaling)")
        if judge is not None:
            call = {"op": c["op"], "layer": i, "has_mask": c["has_mask"], **c["keywords"]}
            with contextlib.suppress(Exception):  # a call the manifest cannot judge is listed without it
                findings += [m for m in judge(call) if not (findings and m.startswith("scale="))]
        od = _max_diff(_select(c.get("output"), total, rows), core)
        if od is not None:
            c["max_abs_diff"] = od
            if od == float("inf"):
                findings.append("its output is not finite: it read cache blocks no request owns or this step "
                                "had not yet written (those hold NaN)")
            elif _differs(od, core, atol):
                findings.append(f"its output differs from the reference's attention by {od:.3g}")
        at = next(k for k, call in enumerate(capture.calls) if call is c)
        later = [w["at"] for w in capture.calls[at + 1:] if w["layer"] == i and w["kind"] == "write"]
        if later and findings:
            findings.append(f"this layer's cache writes come after this call ({', '.join(dict.fromkeys(later))})")
        if findings:
            c["finding"] = "; ".join(findings)
    return ("attention output", d, calls, "the attention module's output differs from the reference's "
                                         "(its FA output and projection)")


def _plain_call(c: dict) -> dict:
    out = {"op": c["op"], "at": c["at"]}
    for key in ("cache", "scale_arg", "scale", "max_abs_diff", "finding"):
        if c.get(key) is not None:
            out[key] = c[key]
    return out
