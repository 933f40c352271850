"""Graph-mode decode on CPU: the step captured once per batch size and replayed over the stream, as the engine does.

The framework compiles only the decode forward (``executor/core/model_worker/model_worker.py``: prefill stays
eager) with ``torch.compile(fullgraph=True)`` (``executor/utils/graph_utils.py``): ``npugraph_ex`` with
``dynamic=enable_dynamic_graph`` (default True, ``inference_config.py``), ``ge_graph`` with ``dynamic=False``. The
engine pads every decode batch to ``batch_size_per_dp_rank`` and warms up one step per batch size before serving.
Here the same compile captures the rendered decode inside the transformers host, the emulated operators seen as
single ``torch.ops.npu`` nodes (their shape rules: ``npu_ops/fake_shapes.py``), so that:

* a graph break (Python branching on tensor values, an untraceable call) or a device value read back on the host
  inside the step (``.item()``, ``.tolist()``: symbolic in a CPU trace, a sync no device graph replays) fails the
  capture, with the line;
* a tensor inside the step shaped or filled from a host value is named with its line: only FA's ``SymInt[]``
  lengths are given afresh to each replay (references/device_questions.md, 图模式回放);
* a recapture after warm-up is named: a guard that failed (a host value the first capture took as a constant:
  on the device the replay reuses it, wrong output and no error; with ``enable_cache_compile`` the framework
  even skips the guards) or a captured input whose shape changed (the device graph holds its capture's shapes);
* rendered mode: every replayed step is compared with the eager run of the same step on the same state (rerun right
  after it: the step's cache writes are the same values at the same slots); in both modes the replayed logits go
  to the oracle comparison.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from model_infer_kvcache.analyzer.operators.fa_facts import FA_KEYWORDS
from model_infer_kvcache.validators.npu_ops.fake_shapes import HOST_INTS
from model_infer_kvcache.validators.pipeline import host_model
from model_infer_kvcache.validators.pipeline.precision import traceable_upcasts, upcast_graph
from model_infer_kvcache.validators.pipeline.report import Report

# The engine's compile per execution mode (graph_utils.compile_model_forward; npugraph_ex's dynamic is the yaml's
# enable_dynamic_graph, whose default is True).
DYNAMIC = {"npugraph_ex": True, "ge_graph": False}
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def graph_mode(manifest) -> str | None:
    """The manifest's captured execution mode (npugraph_ex / ge_graph), None for eager decode."""
    mode = manifest.exe_mode.value if manifest.exe_mode is not None else "eager"
    return None if mode == "eager" else mode


def decode_capture(manifest, host) -> DecodeCapture | None:
    """The capture of the manifest's graph-mode decode (its execution mode and enable_dynamic_graph), None eager."""
    mode = graph_mode(manifest)
    return DecodeCapture(host, mode, host.atol, dynamic=manifest.exe_mode.dynamic_graph) if mode else None


class _Stop(Exception):
    """Raised by the capture backend: a capture after warm-up (its reason is on the recorder)."""


@dataclass
class CaptureRecorder:
    """The capture backend and what it saw: captures per batch size, graph breaks and host reads, recaptures after
    warm-up, tensors shaped or filled from host values, replays. Serves the rendered host (``DecodeCapture``) and
    the checkout's engine (registered as its ``npugraph_ex`` backend, ``checkout_run/engine_run.py``)."""

    exe_mode: str
    files: tuple[str, ...] = ()  # where a finding points: the rendered code, the model's file
    dynamic: bool | None = None
    captures: list[tuple[int, int]] = field(default_factory=list)  # (step, batch rows) of each capture
    replays: int = 0
    broken: str | None = None  # the graph break or host read, with its line
    recaptured: str | None = None  # the first capture after warm-up, with its reason and line
    host_shapes: list[str] = field(default_factory=list)  # tensors inside the graph shaped or filled by a host value
    notes: list[str] = field(default_factory=list)
    rows: int = 0  # the batch rows of the step being run (0: one batch size, the engine's)
    step: int = 0  # the step being run
    _shapes: dict[int, list] = field(default_factory=dict)  # batch rows -> the captured inputs' (name, shape)
    _lines: dict[str, str] = field(default_factory=dict)  # captured input -> ' (first used at file:line)'

    def __post_init__(self):
        if self.dynamic is None:
            self.dynamic = DYNAMIC[self.exe_mode]

    @property
    def active(self) -> bool:
        return self.broken is None and self.recaptured is None

    def failed_call(self, exc: Exception) -> None:
        """A compiled call raised: a graph break (fullgraph), unless it was this recorder's own recapture stop."""
        if self.recaptured is None and self.broken is None:
            self.broken = _graph_break(exc, self.files)

    def backend(self, gm: torch.fx.GraphModule, example_inputs, **_options):
        """The compile backend: records the capture and returns its replay (the graph run as captured)."""
        if self.rows in self._shapes:  # this batch size was captured already: a recapture
            self.recaptured = f"{self._when()}: recompiled after warm-up: {_guard_failure(self.files, self._lines)}"
            raise _Stop(self.recaptured)
        self.captures.append((self.step, self.rows))
        self.host_shapes += [f for f in _host_shaped(gm, self.files) if f not in self.host_shapes]
        reads = _host_reads(gm, self.files)
        if reads and self.broken is None:
            self.broken = reads[0]
        if not reads:  # (a host read's own finding stands; its rerun would stop at the same read)
            upcast_graph(gm)  # float64 kept float64 (a validation run's rule), as the eager step keeps it
        names = [_input_name(node) for node in gm.graph.nodes if node.op == "placeholder"]
        self._shapes[self.rows] = [(n, tuple(x.shape)) for n, x in zip(names, example_inputs, strict=False)
                                   if isinstance(x, torch.Tensor)]
        lines = _first_use_lines(gm, self.files)
        self._lines.update({_plain(name): where for name, where in lines.items()})
        rows = self.rows

        def replay(*args):
            shapes = [(n, tuple(x.shape)) for n, x in zip(names, args, strict=False) if isinstance(x, torch.Tensor)]
            for (name, want), (_, got) in zip(self._shapes[rows], shapes, strict=False):
                if want != got and self.recaptured is None:
                    self.recaptured = (f"{self._when()}: captured input {name} changed shape {list(want)} -> "
                                       f"{list(got)} after warm-up (the device graph replays its capture's shapes)"
                                       f"{lines.get(name, '')}")
            self.replays += 1
            return gm.forward(*args)

        return replay

    def _when(self) -> str:
        """The step being run: its index and rows where the driver says (rendered mode), else the replay count."""
        return f"step {self.step} ({self.rows} rows)" if self.rows else f"replay {self.replays + 1}"

    def check(self, report: Report, stream_steps: int) -> None:
        report.notes.extend(self.notes)
        mode = f"{self.exe_mode}, dynamic={self.dynamic}"
        report.add(f"graph mode ({mode}): the decode step captures as one graph", "runtime",
                   self.broken is None and bool(self.captures),
                   detail=self.broken or ("" if self.captures else "nothing was captured: no decode step compiled"),
                   captures=len(self.captures))
        rows = sorted({r for _, r in self.captures})
        report.add(f"graph mode: no capture after warm-up ({len(self.captures)} captures for {len(rows)} batch sizes "
                   f"over {self.replays} replays)", "runtime", self.recaptured is None and self.broken is None,
                   detail=self.recaptured or ("" if self.broken is None else "not reached: the capture broke"),
                   batch_rows=rows, stream_steps=stream_steps)
        report.add("graph mode: no tensor inside the captured step is shaped or filled from a host length", "runtime",
                   not self.host_shapes, detail="; ".join(self.host_shapes[:2]), findings=len(self.host_shapes))


@dataclass
class DecodeCapture:
    """The rendered code's decode step captured inside the transformers host and compared with eager every step."""

    host: object
    exe_mode: str
    atol: float
    dynamic: bool | None = None  # the manifest's exe_mode.dynamic_graph (None: the mode's default)
    recorder: CaptureRecorder = None
    max_diff: float = 0.0
    worst_step: int | None = None

    def __post_init__(self):
        self.recorder = CaptureRecorder(self.exe_mode, files=_host_files(self.host), dynamic=self.dynamic)
        self.recorder.notes += _capturable_experts(self.host.hf_model)
        # A fresh cache (captures of an earlier run must not answer this one's steps), reset with torch's own tensor
        # methods in place: Dynamo rebuilds its table of known functions from what it finds then.
        with traceable_upcasts():
            torch._dynamo.reset()
            self._compiled = torch.compile(self._decode, fullgraph=True, dynamic=self.recorder.dynamic,
                                           backend=self.recorder.backend)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, forward_metadata) -> torch.Tensor:
        """One decode step: the captured graph (capturing it first for a new batch size), then the eager step on the
        same inputs; returns the graph's logits [T, vocab] (the eager ones once the capture has failed)."""
        graph, rec = None, self.recorder
        if rec.active:
            rec.rows, rec.step = int(input_ids.shape[0]), self.host.step_index + 1
            positions = position_ids.to(self.host.device)[None]
            # the model's own position ids (a Roberta-style offset added: host_model.position_offset) enter as an
            # input of the call, so the captured step holds no op fed from a host value
            ids = input_ids.to(self.host.device)[None]
            # what the model takes beside ids and positions (XLM's langs / lengths: host_model.model_inputs), made
            # here, outside the captured function, and passed in as inputs of the call like the positions
            args = (ids, positions, positions + self.host.position_offset, forward_metadata,
                    host_model.model_inputs(self.host.hf_model, ids))
            if rec.rows not in rec._shapes:  # about to capture this batch size
                _static_shapes((args, self.host.hf_model))
            try:
                with torch.no_grad(), traceable_upcasts(), quiet_side_effects():
                    graph = self._compiled(*args)
            except Exception as exc:  # noqa: BLE001 - a failed capture is this check's finding, not a crash
                rec.failed_call(exc)
        eager = self.host.forward(input_ids, position_ids, forward_metadata)
        if graph is None or rec.broken is not None:  # a broken capture's replay is no step of the device's
            return eager
        graph = graph[0].double().cpu()
        # NaN where both are NaN is a padded row reading the poisoned null block, in both runs alike
        both_nan = graph.isnan() & eager.isnan()
        gap = (graph - eager).abs().masked_fill(both_nan, 0).nan_to_num(nan=float("inf"))
        diff = float(gap.max()) if gap.numel() else 0.0
        if diff > self.max_diff:
            self.max_diff, self.worst_step = diff, rec.step
        return graph

    def check(self, report: Report, stream_steps: int) -> None:
        self.recorder.check(report, stream_steps)
        replays = self.recorder.replays
        report.add(f"graph mode: replayed decode logits vs eager max |diff| <= {self.atol:g}", "numeric",
                   replays > 0 and self.max_diff <= self.atol, max_diff=self.max_diff, worst_step=self.worst_step,
                   replays=replays, detail="" if replays else "no step replayed")

    def _decode(self, input_ids, position_ids, model_position_ids, forward_metadata, extra):
        # The metadata stack is pushed inside the captured function, so that the graph reads the step's metadata
        # as an input of the call, not as a global the first capture saw.
        host_model._CURRENT.append((forward_metadata, position_ids, None))
        logits = self.host.hf_model(input_ids=input_ids, position_ids=model_position_ids, use_cache=False,
                                    **extra).logits
        host_model._CURRENT.pop()
        return logits


def quiet_side_effects():
    """Dynamo's default side-effect policy formats a message with the whole Python stack for every object the step
    mutates (the metadata stack, the mode stack): a fifth of the trace's time, for a debug log nobody reads here."""
    return torch._dynamo.config.patch(side_effect_replay_policy="silent")


def _static_shapes(inputs) -> None:
    """Every tensor the step reads keeps its capture's shape: the engine allocates the caches once and pads decode
    to one batch and a static block-table width, so only host ints (FA's lengths) vary between replays. Symbolic
    tensor sizes would cost the trace about half its time and find nothing more: a tensor whose shape changes fails
    a size guard instead, a recapture (V229) with the input named."""
    seen, todo = set(), [inputs]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (int, float, str, bool, type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            torch._dynamo.mark_static(obj)
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif hasattr(obj, "__dict__"):  # metadata objects; modules, whose attributes hold the caches
            todo.extend(vars(obj).values())


PADDING_CHECK = "decode padded to the per-DP batch size; padded rows write only the null block"


def check_runner_padding(report: Report, runner, fm, real: int, step: int, findings: list[str], q_len: int = 1) -> None:
    """A standalone graph-mode step's padding findings (``runner_padding_problems``) added to ``findings``; the
    first is reported at once, since the step may then stop at an operator error."""
    problems = runner_padding_problems(runner, fm, real, step, q_len)
    if problems and not findings:
        report.add(PADDING_CHECK, "runtime", False, detail=problems[0], runner=runner_line(runner))
    findings.extend(problems)


def runner_padding_problems(runner, fm, real: int, step: int, q_len: int = 1) -> list[str]:
    """A graph-mode decode step (``q_len`` tokens per row: 1 + next_n on a verify step): ``batch_size`` rows, every
    padded row's slots and block-table row in the null block (anywhere else it overwrites a live request's cache)."""
    rows = fm.block_table.shape[0]
    if rows != runner.batch_size or fm.slot_mapping.numel() != rows * q_len:
        return [f"step {step}: {rows} rows ({fm.slot_mapping.numel()} slots), not the runner's batch of "
                f"{runner.batch_size} x {q_len} token(s) (one captured shape)"]
    null = getattr(runner, "null_block", None)
    slots = fm.slot_mapping.view(-1)[real * q_len:].long()
    tables = fm.block_table[real:].long()
    if null is None or bool((slots // _block_size(runner) != null).any()) or bool((tables != null).any()):
        return [f"step {step}: padded rows write slots {slots.tolist()[:4]} / read blocks "
                f"{sorted(set(tables.view(-1).tolist()))[:4]}, not the null block {null}"]
    return []


def _block_size(runner) -> int:
    return runner.max_seq_len // runner.block_table.shape[1]


def runner_line(runner) -> str:
    """file:line of the runner's padding (its ``_padded_decode_metadata``), where a padding finding points."""
    import inspect

    fn = getattr(type(runner), "_padded_decode_metadata", type(runner)._build_forward_metadata)
    try:
        return f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
    except (OSError, TypeError):
        return "?"


def _host_files(host) -> tuple[str, ...]:
    """The files a finding points into: the rendered code first, then the model's own."""
    import sys

    rendered = [getattr(m, "__file__", None) for m in (host.rendered.attention, host.rendered.runner)]
    module = sys.modules.get(getattr(type(host.hf_model), "__module__", ""))
    return tuple(f for f in (*rendered, getattr(module, "__file__", None)) if f)


def _capturable_experts(model) -> list[str]:
    """transformers' default MoE experts loop over the experts the router hit (data-dependent: no graph holds it),
    where the device serves MoE through grouped-matmul operators: the model under test takes transformers' own
    batched_mm experts instead, prefill and eager reruns included (the reference keeps its default)."""
    configs = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None),
                                                                          "_experts_implementation")}
    changed = [c for c in configs.values() if c._experts_implementation in (None, "eager")]
    for config in changed:
        config._experts_implementation = "batched_mm"
    return (["graph mode: the model under test runs transformers' batched_mm experts (its default experts loop is "
             "data-dependent, which the device's grouped-matmul MoE is not)"] if changed else [])


def _input_name(node) -> str:
    name = getattr(getattr(node.meta.get("grapharg"), "source", None), "name", None)  # a property in newer torch
    name = name() if callable(name) else name
    return name or node.name


def _host_reads(gm, files: tuple[str, ...]) -> list[str]:
    """Device values read on the host inside the captured step (``.item()``, ``.tolist()``, ``int(tensor)``): CPU
    tracing keeps them as data-dependent (unbacked) symbols, but a device graph replays launches and cannot stop to
    read a value back, so the capture breaks there or keeps the first step's value. (A Python float the tracer turned
    into an input and reads back with ``.item()`` is backed, not a host read.)"""
    out = []
    for node in gm.graph.nodes:
        values = node.meta.get("example_value")
        values = values if isinstance(values, (list, tuple)) else [values]
        if any(isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) and any(
                str(sym).startswith("u") for sym in v.node.expr.free_symbols) for v in values):
            where = _where(node.meta.get("stack_trace") or "", files)
            what = f".{node.target}()" if node.op == "call_method" else str(node.target)
            out.append(f"{what} reads a device value on the host inside the captured step (a sync the device "
                       "graph cannot replay)" + (f" at {where}" if where else ""))
    return out


# The FA operators' SymInt[] lengths: what npugraph_ex gives a replay afresh (the engine's host lists per step).
_REPLAYED_HOST_ARGS = {getattr(kw, role) for kw in FA_KEYWORDS.values() for role in ("q_lens", "kv_lens")}


def _host_shaped(gm, files: tuple[str, ...]) -> list[str]:
    """Tensors of the captured graph shaped or filled from a host value (an int input: a host-list length, a Python
    int of the metadata): a block table cut to the step's longest request, slots or positions computed from the host
    lengths. The trace here takes the value symbolically; the device graph keeps its capture's shapes and the values
    it copied or passed to a kernel then. Only the FA operators' SymInt[] lengths are given afresh to every replay."""
    host = {}
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        source = getattr(node.meta.get("grapharg"), "source", None)
        if node.op == "placeholder" and isinstance(value, torch.SymInt) and "TensorPropertySource" not in \
                type(source).__name__:
            host.update({str(sym): _input_name(node) for sym in value.node.expr.free_symbols})

    def from_host(values) -> set[str]:
        return {host[str(sym)] for v in values if isinstance(v, (torch.SymInt, torch.SymFloat))
                for sym in v.node.expr.free_symbols if str(sym) in host}

    out = []
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        if node.op not in ("call_function", "call_method") or not isinstance(value, (torch.Tensor, tuple, list)):
            continue
        tensors = [v for v in (value if isinstance(value, (tuple, list)) else [value]) if isinstance(v, torch.Tensor)]
        shaped = from_host([size for t in tensors for size in t.shape])
        args = [a for a in node.args] + [a for k, a in node.kwargs.items() if k not in _REPLAYED_HOST_ARGS]
        filled = from_host(_arg_values(args))
        if shaped or filled:
            where = _where(node.meta.get("stack_trace") or "", files)
            how = (f"shape {list(tensors[0].shape)} from " if shaped else "values from ") + \
                ", ".join(sorted(shaped or filled)[:3])
            out.append(f"{node.name}: {how}" + (f" at {where}" if where else ""))
    return out


def _arg_values(args) -> list:
    """The traced values of a node's arguments, nested lists flattened."""
    out = []
    for a in args:
        if isinstance(a, (list, tuple)):
            out += _arg_values(a)
        elif isinstance(a, torch.fx.Node):
            out.append(a.meta.get("example_value"))
    return out


def _first_use_lines(gm, files: tuple[str, ...]) -> dict[str, str]:
    """input name -> ' (first used at file:line)' from the graph's own stack traces (the rendered code or the
    model's file where the use is inside them)."""
    out = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        for user in node.users:
            where = _where(user.meta.get("stack_trace") or "", files)
            if where:
                out[_input_name(node)] = f" (first used at {where})"
                break
    return out


def _where(text: str, files: tuple[str, ...]) -> str:
    """The innermost frame of ``text`` in the rendered code or the model's file, else the innermost outside torch
    and this package's pipeline; '' when none."""
    frames = _FRAME.findall(text)
    for f, line in reversed(frames):
        if f in files:
            return f"{f}:{line}"
    for f, line in reversed(frames):
        if "/torch/" not in f and "/validators/" not in f:
            return f"{f}:{line}"
    return ""


def _graph_break(exc: Exception, files: tuple[str, ...]) -> str:
    text = str(exc)
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)
    gap = _unsupported(exc) or _carried(exc, re.escape(HOST_INTS) + r": [^'\"\n]+")
    if gap:  # an operator the capture has no shape rule for (kvcache's gap), or a device tensor for host ints
        first = gap
    where = _where(text, files)
    return f"{type(exc).__name__}: {first[:300]}" + (f" at {where}" if where else "")


def capture_gap(exc: BaseException, files: tuple[str, ...]) -> tuple[str, str] | None:
    """(message, file:line) when a capture stopped at an operator kvcache cannot capture (no shape rule): kvcache's
    gap, not the model's; None for anything else."""
    gap = _unsupported(exc)
    return (gap, _where(str(exc), files)) if gap else None


def _unsupported(exc: BaseException) -> str | None:
    """The "not supported by kvcache" message an exception carries in its chain (Dynamo wraps the one an operator
    wrapper raised while tracing), None without one."""
    return _carried(exc, r"not supported by kvcache: [^'\"\n]+")


def _carried(exc: BaseException, pattern: str) -> str | None:
    """The first match of ``pattern`` in the exception's chain (also inside Dynamo's repr of a wrapped one)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        found = re.search(pattern, str(exc))
        if found:
            return found.group(0).strip()
        exc = exc.__cause__ or exc.__context__
    return None


def _guard_failure(files: tuple[str, ...], lines: dict[str, str]) -> str:
    """The failed guard of the last recompilation, as Dynamo recorded it, with the line that read the value (a
    tensor's size guard: the line that first used the input)."""
    failures = getattr(torch._dynamo.utils, "guard_failures", {})
    texts = [t for reasons in failures.values() for t in reasons]
    if not texts:
        return "a guard of the first capture failed"
    text = texts[-1]
    guard = text.split("#", 1)[0].strip()
    guard = re.sub(r"^\d+/\d+:\s*", "", guard)
    tensor = re.match(r"tensor '([^']+)' (size|stride)", guard)
    if tensor:
        return (f"guard {guard!r} failed (a captured input changed shape: the device graph replays its capture's "
                f"shapes){lines.get(tensor.group(1), '')}")
    where = _where(text, files)
    return f"guard {guard!r} failed (a value the capture took as a constant)" + (f" read at {where}" if where else "")


def _plain(source: str) -> str:
    """A Dynamo source name as its guards print it: ``L['forward_metadata'].block_table`` -> ``forward_metadata.
    block_table``."""
    return re.sub(r"\[['\"]([^'\"]+)['\"]\]", r".\1", re.sub(r"^L\['([^']+)'\]", r"\1", source))
