"""`kvcache validate`: run rendered code against transformers on CPU (emulated) or an NPU."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from model_infer_kvcache.analyzer.config_loader import read_config_file
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.kinds import cross as cross_kind
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from model_infer_kvcache.analyzer.manifest_io import load_manifest
from model_infer_kvcache.analyzer.measured import device_settled
from model_infer_kvcache.analyzer.readings_file import ReadingsFile
from model_infer_kvcache.implementer.render import check_renderable, render_manifest, write_rendered
from model_infer_kvcache.validators.kinds import check_attention_calls, kind_of
from model_infer_kvcache.validators.kinds import recurrent as recurrent_kind
from model_infer_kvcache.validators.pipeline.precision import TOLERANCE, float64_upcasts
from model_infer_kvcache.validators.pipeline.provenance import (
    RENDERED_FILES,
    RenderHeader,
    check_inputs_belong,
)
from model_infer_kvcache.validators.pipeline.report import Report
from model_infer_kvcache.validators.pipeline.request_stream import (
    DEFAULT,
    QUICK,
    STREAM_BUDGET_CHECK,
    Scenario,
    StreamStalled,
)
from model_infer_kvcache.validators.pipeline.runtime_deps import preload_transformers
from model_infer_kvcache.validators.pipeline.tiny_model import (
    cpu_sizes_note,
    heads_reason,
    require_transformers_type,
)


@dataclass(frozen=True)
class ValidateRequest:
    manifest: str
    rendered: str
    config: str
    backend: str = "auto"
    framework_root: str | None = None
    seed: int = 0
    scenario: Scenario = DEFAULT
    sweep_readings: bool = True
    framework_api: str | None = None
    attn_tp_size: int | None = None
    device_readings: str | None = None  # readings file of `kvcache probe`: run under the measured readings
    dtype: str | None = None  # compute dtype of the comparison; None: float64 emulated, the model's on an NPU
    step_seconds: float | None = None  # the watchdog's allowance per forward step; None: the scenario's
    next_n: int | None = None  # --next-n, analyze's MTP switch: must be the manifest's
    encoder_length: int | None = None  # --encoder-length, analyze's cross-attention slot size: must be the manifest's


def resolve_backend(requested: str) -> str:
    from model_infer_kvcache.validators.npu_ops import npu_available

    if requested == "emulated":
        return "emulated"
    available, why = npu_available()
    if requested == "npu":
        if not available:
            raise InputError("--backend", f"npu requested but unavailable ({why})")
        return "npu"
    return "npu" if available else "emulated"


DEVICE_DTYPES = ("bfloat16", "float16", "float32")  # what the real operators take


def resolve_dtype(requested: str | None, backend: str, manifest: SelectionManifest) -> str:
    """float64 by default on the emulated backend (a validation mode: the device ops take 16/32-bit),
    the manifest's dtype by default on an NPU."""
    if requested is None:
        return "float64" if backend == "emulated" else manifest.model.dtype
    if requested not in TOLERANCE:
        raise InputError("--dtype", f"{requested!r} is not one of {', '.join(TOLERANCE)}")
    if backend == "npu" and requested not in DEVICE_DTYPES:
        raise InputError("--dtype", f"{requested} is a CPU emulation mode; the device operators take "
                                    f"{'/'.join(DEVICE_DTYPES)}")
    kind_dtypes = getattr(kind_of(manifest), "RUN_DTYPES", None)  # a kind whose operators take fewer (V4's custom ops)
    if kind_dtypes is not None and requested not in kind_dtypes:
        raise InputError("--dtype", f"{requested}: the {kind_of(manifest).__name__.rsplit('.', 1)[-1]} kind's operators "
                                    f"take {'/'.join(kind_dtypes)} (float64: the CPU validation mode)")
    return requested


@dataclass(frozen=True)
class ValidationInputs:
    """The inputs stage's result: files read and checked to belong together, backend and dtype resolved.

    Plain data (picklable): the multi-rank runner hands it to every rank's process as it is.
    """

    req: ValidateRequest  # with the resolved dtype
    manifest: SelectionManifest
    real_config: dict
    header: RenderHeader | None
    backend: str
    measured: ReadingsFile | None = None  # readings measured by `kvcache probe` (--device-readings)

    @property
    def ranks(self) -> int:
        return self.manifest.parallel.attn_tp_size


def validate(req: ValidateRequest, progress=None) -> Report:
    """The validation pipeline: inputs -> tiny model -> host with its backend -> request stream -> checks -> report.

    The inputs are read once here; the rest (``run_pipeline``) runs on one rank, or, for a manifest
    with attention TP > 1, on that many gloo ranks (``multi_rank.run_ranks``) whose reports merge.
    """
    inputs = load_inputs(req)
    if inputs.ranks == 1:
        return run_pipeline(inputs, progress)
    from model_infer_kvcache.validators.pipeline.multi_rank import run_ranks

    single_run = replace(inputs, req=replace(inputs.req, sweep_readings=False))
    return run_ranks(run_pipeline, single_run, inputs.ranks, inputs.manifest, progress)


def load_inputs(req: ValidateRequest) -> ValidationInputs:
    """Read the manifest, config, render and readings; refuse (InputError) what does not belong together."""
    measured = None
    if req.device_readings:
        from model_infer_kvcache.analyzer.readings_file import load_readings

        measured = load_readings(req.device_readings)
    manifest = load_manifest(req.manifest)
    check_renderable(manifest)
    check_next_n(req.next_n, manifest)
    cross_kind.check_manifest_length(req.encoder_length, manifest.cross_attention, manifest.model.model_type)
    _, real_config = read_config_file(req.config)
    require_transformers_type(manifest.model.model_type)
    rendered_dir = Path(req.rendered)
    if not (rendered_dir / "kvcache_attention.py").is_file():
        raise InputError(str(rendered_dir), "no kvcache_attention.py: run `kvcache render` first", field="--rendered")
    if manifest.deploy_mode.value == "standalone" and manifest.drafter is None and manifest.byte_patches is None \
            and not (rendered_dir / "kvcache_runner.py").is_file():  # a drafter renders no runner: the target's runs;
        # BLT renders none: the validators' byte-stepping host is its runner
        raise InputError(str(rendered_dir), "no kvcache_runner.py (standalone mode renders one): run `kvcache "
                                            "render` again", field="--rendered")
    header = check_inputs_belong(manifest, req.manifest, real_config, req.config, rendered_dir)
    tp = manifest.parallel.attn_tp_size
    if req.attn_tp_size is not None and req.attn_tp_size != tp:
        raise InputError("--attn-tp-size", f"{req.attn_tp_size} differs from the manifest's attn_tp_size {tp} "
                                           "(re-analyze with --attn-tp-size and re-render)")
    backend = resolve_backend(req.backend)
    dtype = resolve_dtype(req.dtype, backend, manifest)
    if tp > 1 and backend != "emulated":
        raise InputError("--backend", "multi-rank validation runs on the emulated backend (gloo) here; "
                                      "on NPU clusters launch one process per card with hccl")
    return ValidationInputs(replace(req, dtype=dtype), manifest, real_config, header, backend, measured)


def check_next_n(next_n: int | None, manifest: SelectionManifest) -> None:
    """A --next-n beside a manifest must be the one the manifest was analyzed with (its MTP depth, 0 when off)."""
    planned = manifest.mtp.speculative_tokens if manifest.mtp is not None else 0
    if next_n is not None and next_n != planned:
        raise InputError("--next-n", f"{next_n} differs from the manifest's {planned} "
                                     f"speculative token(s) (re-analyze with --next-n {next_n})")


def run_pipeline(inputs: ValidationInputs, progress=None, rank: int = 0, world: int = 1) -> Report:
    """Everything after the inputs, on one rank (``world`` > 1: this rank's share of the attention heads)."""
    req, manifest, backend, measured = inputs.req, inputs.manifest, inputs.backend, inputs.measured
    say = progress or (lambda msg: None)
    started = time.perf_counter()

    preload_transformers()

    report = Report(backend=backend, deploy_mode=manifest.deploy_mode.value, model_type=manifest.model.model_type,
                    manifest_hash=manifest.content_hash(), dtype=req.dtype, tolerance=TOLERANCE[req.dtype])
    from model_infer_kvcache.validators.npu_ops import DeviceReadings

    base = DeviceReadings.from_settled(measured.settled()) if measured else DeviceReadings()
    settled = device_settled(measured)  # a dry run (emulated backend) settles nothing: its questions are swept
    if measured and measured.backend == "npu":
        report.notes.append(f"device readings measured in {req.device_readings} ({measured.where()}): "
                            + ", ".join(f"{q}={a.reading}" for q, a in measured.questions.items())
                            + ("; 'unknown' settles nothing (default reading used)" if len(settled) < len(
                                measured.questions) else ""))
    elif measured:
        report.notes.append(f"dry-run readings of the emulated backend in {req.device_readings} (not a device "
                            "measurement: they settle nothing, the sweep still runs): "
                            + ", ".join(f"{q}={a.reading}" for q, a in measured.questions.items()))
    report.readings = dataclasses.asdict(base)
    if manifest.drafter is not None:  # a drafter over its target's cache: no request stream of its own
        from model_infer_kvcache.validators.npu_ops import device_readings, install_emulation
        from model_infer_kvcache.validators.pipeline.drafter_run import run_drafter

        ops = install_emulation() if backend == "emulated" else contextlib.nullcontext()
        run_drafter(report, manifest, req.rendered, inputs.real_config, req.seed, getattr(torch, req.dtype), ops,
                    device_readings(base))
        report.seconds = time.perf_counter() - started
        return report
    if manifest.byte_patches is not None:  # BLT's stacks: stepped byte by byte on their paged caches
        from model_infer_kvcache.validators.npu_ops import device_readings, install_emulation
        from model_infer_kvcache.validators.pipeline.byte_patch_run import run_manifest

        ops = install_emulation if backend == "emulated" else contextlib.nullcontext
        run_manifest(report, manifest, req.rendered, inputs.real_config, backend, ops, device_readings(base),
                     req.seed)
        if req.sweep_readings and backend == "emulated":  # as every kind: does the render rest on a reading?
            from model_infer_kvcache.validators.pipeline.sweep import sweep_readings

            def rerun(readings) -> Report:
                swept = report.fresh(backend=backend)
                run_manifest(swept, manifest, req.rendered, inputs.real_config, backend, ops,
                             device_readings(readings), req.seed)
                return swept

            sweep_readings(report, [dep.question for dep in manifest.device_dependencies], base, rerun,
                           settled=settled, say=say)
        report.seconds = time.perf_counter() - started
        return report
    _check_render_as_written(report, manifest, req, backend)
    with tempfile.TemporaryDirectory(prefix="kvcache-validate-") as tmp:
        runs = _plan_runs(report, manifest, req, inputs.header, Path(tmp), inputs.real_config)
        for label, run_manifest, rendered, scenario in runs:
            _validate_run(report, label, run_manifest, rendered, replace(req, scenario=scenario), inputs.real_config,
                          backend, say, rank, world, sweep=req.sweep_readings and not label, base=base,
                          settled=settled)
        if runs[0][2] != req.rendered:  # a CPU-size render in ``tmp``, gone when the run ends: say what it was
            report.provenance["code_under_test"] = (
                f"the render in {Path(req.rendered).resolve()}, and the implementer's render of its manifest at CPU "
                f"sizes ({cpu_sizes_note(manifest, runs[0][1])}), written for the run and removed after it")
    report.seconds = time.perf_counter() - started
    return report


def _check_render_as_written(report: Report, manifest: SelectionManifest, req: ValidateRequest,
                             backend: str) -> None:
    """Init link on the user's render itself: its constants, and init_kv_cache of every real layer."""
    from model_infer_kvcache.validators.npu_ops import install_emulation
    from model_infer_kvcache.validators.pipeline.host_model import import_rendered
    from model_infer_kvcache.validators.pipeline.render_check import check_constants, check_every_layer

    ops = install_emulation() if backend == "emulated" else contextlib.nullcontext()
    with ops, _framework(manifest, req, backend), _torchair(manifest, backend), _custom_ops(manifest, backend):
        rendered = import_rendered(req.rendered)
        check_constants(report, manifest, rendered.attention)
        check_every_layer(report, manifest, rendered.attention_mixin(), getattr(torch, req.dtype),
                          rendered.linear_mixin())


def _plan_runs(report: Report, manifest: SelectionManifest, req: ValidateRequest, header, tmp: Path,
               real_config: dict | None = None):
    """(label, manifest, rendered dir, scenario) of each run. The code under test always runs as written.

    Sizes a CPU can exercise: the user's render. A longer window, a DSA selection wider than CPU prompts, or a
    tiny model with wide heads (a tied heads x head_dim, or wide K/V rows): the implementer's render of the same manifest at CPU sizes
    (tiny.cpu_sized) crosses the window, drops keys, runs fewer heads, and the user's render runs too, at its
    real sizes, unless it is byte for byte the implementer's render of the manifest.
    """
    from model_infer_kvcache.validators.pipeline.tiny_model import cpu_sized, cpu_sizes_note

    def crossing(m: SelectionManifest):
        scenario = req.scenario.crossing_of(m)
        uncut = req.scenario.crossing_window_of(m).crossing_chunks_of(m)
        if scenario != uncut:  # a learned position table shorter than the stream (CTRL's 256 rows)
            report.notes.append(f"request stream cut to the model's {m.model.max_position_embeddings} positions "
                                f"(max_position_embeddings): longest request {scenario.max_model_len - 8} tokens, "
                                f"{uncut.max_model_len - 8} uncut")
        return scenario

    tiny = cpu_sized(manifest, real_config)
    if tiny is None:
        return [("", manifest, req.rendered, crossing(manifest))]
    tiny_dir = tmp / "tiny-window"
    write_rendered(render_manifest(tiny, framework_api=header.api if header else None, allow_blocked=True), tiny_dir)
    sizes = cpu_sizes_note(manifest, tiny)
    what = ("window " + str(manifest.sliding_window()) + " is too long for CPU sequences"
            if manifest.sliding_window() != tiny.sliding_window() else
            f"attention_chunk_size {manifest.attention_chunk_size()} is too long for CPU sequences to cross"
            if manifest.attention_chunk_size() != tiny.attention_chunk_size() else
            f"the selection width {_index_topk(manifest)} is wider than CPU prompts"
            if _index_topk(manifest) != _index_topk(tiny) else
            f"the {manifest.model.num_layers} decoder layers make {len(manifest.recurrent_loops.calls)} calls per "
            "forward (a cache per call): a tiny stack keeps the first layer of each section called once and the "
            "first plans of each section called several times"
            if manifest.recurrent_loops is not None and tiny.model.num_layers != manifest.model.num_layers else
            recurrent_kind.cpu_widths_reason(manifest, tiny) or
            heads_reason(manifest))
    runs = [("", tiny, str(tiny_dir), crossing(tiny))]
    if _is_implementer_render(manifest, req.rendered, header):
        report.notes.append(f"{what}: the checks ran on the implementer's render of this manifest with {sizes} "
                            f"(the given render is that render at the real sizes, byte for byte; its constants and "
                            f"every layer are checked above)")
    elif manifest.sliding_window() == tiny.sliding_window() and _same_heads(manifest, tiny) and \
            (narrowed := _narrowed_copy(req.rendered, tiny, tmp)):
        # DSA, CSA and QSA: at its real width a CPU stream selects every key, so the given render's own selection
        # code would go unexercised; with the one constant narrowed it runs as written otherwise.
        report.notes.append(f"{what}: the CPU-size run used the implementer's render with {sizes}; the given "
                            f"render differs from the implementer's and also ran as written with only its "
                            f"{getattr(kind_of(tiny), 'SELECTION_CONSTANT', 'INDEX_TOPK')} set to {_index_topk(tiny)} "
                            "(checks 'as written: ...')")
        runs.append(("as written: ", tiny, str(narrowed), QUICK))
    else:
        report.notes.append(f"{what}: the CPU-size run used the implementer's render with {sizes}; the given "
                            f"render differs from the implementer's and also ran as written at "
                            + ("window " + str(manifest.sliding_window()) if manifest.sliding_window()
                               != tiny.sliding_window() else "its real sizes") + " (checks 'as written: ...')")
        runs.append(("as written: ", manifest, req.rendered, QUICK))
    return runs


def _same_heads(manifest: SelectionManifest, tiny: SelectionManifest) -> bool:
    return manifest.model.num_attention_heads == tiny.model.num_attention_heads


def _index_topk(manifest: SelectionManifest) -> int | None:
    """The selection width a CPU run narrows (a kind's ``selection_width``: DSA's indexer's, DeepSeek-V4 CSA's)."""
    width = getattr(kind_of(manifest), "selection_width", None)
    return width(manifest) if width else None


def _narrowed_copy(rendered: str, tiny: SelectionManifest, tmp: Path) -> Path | None:
    """A copy of the given render with its selection width constant (the kind's ``SELECTION_CONSTANT``, else
    ``INDEX_TOPK``) set to the CPU run's (None: no such single constant, e.g. a hand edit that inlined it)."""
    import re
    import shutil

    name = getattr(kind_of(tiny), "SELECTION_CONSTANT", "INDEX_TOPK")
    source = Path(rendered) / "kvcache_attention.py"
    text = source.read_text(encoding="utf-8")
    new, n = re.subn(rf"^{name} = \d+", f"{name} = {_index_topk(tiny)}", text, flags=re.M)
    if n != 1:
        return None
    from model_infer_kvcache.analyzer.files import atomic_write_text

    out = tmp / "as-written-narrowed"
    shutil.copytree(rendered, out)
    atomic_write_text(out / "kvcache_attention.py", new)
    return out


def _is_implementer_render(manifest: SelectionManifest, rendered_dir: str, header) -> bool:
    ours = render_manifest(manifest, framework_api=header.api if header else None, allow_blocked=True).files
    for name in RENDERED_FILES:
        path = Path(rendered_dir) / name
        if path.is_file() != (name in ours) or (path.is_file() and path.read_text(encoding="utf-8") != ours[name]):
            return False
    return True




def _validate_run(report: Report, label: str, manifest: SelectionManifest, rendered: str, req: ValidateRequest,
                  real_config: dict, backend: str, say, rank: int, world: int, sweep: bool,
                  base=None, settled: dict | None = None) -> None:
    from model_infer_kvcache.validators.npu_ops import DeviceReadings
    from model_infer_kvcache.validators.pipeline.tiny_model import build_tiny_model

    say("building the tiny transformers model" + (f" ({label.strip(': ')})" if label else ""))
    pristine, plan = build_tiny_model(real_config, manifest, seed=req.seed)
    run = report.fresh(backend=backend, checks=[c for c in report.checks if c.link == "init" and not label])
    start = len(run.checks)
    say(f"running the {manifest.deploy_mode.value}-mode checks on the {backend} backend")
    base = base or DeviceReadings()
    settled = settled or {}
    _run(run, manifest, rendered, req, pristine, backend, base, req.scenario, rank, world)
    if run.first_failure and not report.localisation and backend == "emulated":
        _localise(report, run, label, manifest, rendered, req, pristine, base, world, say)
    for c in run.checks[start:]:
        c.name = label + c.name
        report.checks.append(c)
    report.provenance = report.provenance or run.provenance
    report.consulted = sorted(set(report.consulted) | set(run.consulted))
    if not label:
        report.notes += plan.notes + run.notes
        _note_coverage(report, manifest, run)
    if sweep and backend == "emulated":
        from model_infer_kvcache.validators.pipeline.sweep import sweep_readings

        def rerun(readings) -> Report:
            swept = report.fresh(backend=backend)
            _run(swept, manifest, rendered, req, pristine, backend, readings, QUICK)
            return swept

        questions = [dep.question for dep in manifest.device_dependencies] + run.consulted
        sweep_readings(report, questions, base, rerun, settled=settled, say=say)


def _localise(report: Report, run: Report, label: str, manifest: SelectionManifest, rendered: str,
              req: ValidateRequest, pristine, readings, world: int, say) -> None:
    """A numeric failure of ``run``: replay its stream up to the first failing step with a capture on the
    model under test, run transformers over the failing request, name the first diverging layer and
    sub-module (``localise``) in ``report.localisation``."""
    from model_infer_kvcache.validators.pipeline.fa_args import fa_call_mismatches
    from model_infer_kvcache.validators.pipeline.localise import (
        Capture,
        cache_namer,
        localise,
        reference_activations,
    )

    failure = run.first_failure
    if world > 1 or failure.get("rows") is None:
        report.notes.append("numeric failure not localised: localisation replays a single-rank run")
        return
    say(f"localising the numeric failure: replaying the stream to step {failure['step']}")
    captures: list[Capture] = []

    def observe(host) -> None:
        capture = Capture(host.hf_model, failure["step"], lambda: host.step_index, Path(rendered).glob("*.py"),
                          cache_namer(lambda: host.attentions))
        capture.install()  # on the replay's own model copy, discarded with it
        host.rendered.attention.torch_npu = capture.tapping(host.rendered.attention.torch_npu)
        captures.append(capture)

    try:
        _run(report.fresh(backend="emulated"), manifest, rendered, req, pristine, "emulated", readings, req.scenario,
             observe=observe)
        ref = copy.deepcopy(pristine).to(dtype=torch.float64 if req.dtype == "float64" else torch.float32)
        with float64_upcasts():
            acts = reference_activations(ref, failure["tokens"])
        start, stop = failure["rows"]
        loc = localise(captures[0], acts, list(range(start, stop)), failure["positions"], failure["tokens"],
                       TOLERANCE[req.dtype],
                       judge=lambda call: fa_call_mismatches(manifest, {**call, "is_prefill": failure["is_prefill"]}))
    except Exception as exc:  # localisation explains a failure; it never turns the report into a crash
        report.notes.append(f"numeric failure not localised: {type(exc).__name__}: {exc}")
        return
    report.localisation = {**({"run": label.strip(": ")} if label else {}), "step": failure["step"],
                           "request": failure["request"], **loc}


def _note_coverage(report: Report, manifest: SelectionManifest, run: Report) -> None:
    """The longest sequence per path, and whether it crossed the window by two blocks."""
    numeric = next((c for c in run.checks if c.link == "numeric" and "max_abs_diff" in c.measured), None)
    if numeric is None:
        return
    prefill, decode = numeric.measured["longest_prefill"], numeric.measured["longest_decode"]
    window = manifest.sliding_window()
    report.notes.append(f"longest sequence: prefill {prefill}, decode {decode} tokens"
                        + (f" (window {window}, block {manifest.block_size})" if window else ""))
    if window:
        need = window + 2 * manifest.block_size
        report.add(f"request stream crosses the window by >= 2 blocks ({need} tokens) on both paths", "numeric",
                   min(prefill, decode) >= need, longest_prefill=prefill, longest_decode=decode, window=window)


def _run(report: Report, manifest: SelectionManifest, rendered_dir: str, req: ValidateRequest, pristine, backend: str,
         readings, scenario: Scenario, rank: int = 0, world: int = 1, observe=None) -> None:
    from model_infer_kvcache.validators.npu_ops import consulted_questions, device_readings, install_emulation
    from model_infer_kvcache.validators.pipeline.host_model import (
        OWN_DEFAULT_DTYPE,
        HostModel,
        import_rendered,
    )

    parameters = sum(p.numel() for p in pristine.parameters())
    scenario = scenario.sized_for(parameters) if req.step_seconds is None else \
        replace(scenario, step_seconds=req.step_seconds)
    if parameters > SHARED_WEIGHTS_ABOVE // 4:
        # a big model: the last run's model and host (cycles: bound forwards) freed before this run's copies. Not for
        # every run: a collection takes ~0.16 s with transformers loaded, minutes over the test suite's runs
        gc.collect()
    model = copy.deepcopy(pristine)
    if world > 1:
        from model_infer_kvcache.validators.pipeline.multi_rank import shard_attention

        shard_attention(model, manifest, rank, world)
    ops = install_emulation() if backend == "emulated" else contextlib.nullcontext()
    # The model under test and its caches in the compute dtype (float64 by default on CPU, so that
    # honest code differs by rounding only); the transformers reference in float64 for float64, else
    # float32 on CPU.
    on_npu = backend == "npu"
    device = torch.device("npu") if on_npu else torch.device("cpu")
    cache_dtype = getattr(torch, req.dtype)
    model.to(device=device, dtype=cache_dtype)
    ref_dtype = torch.float64 if cache_dtype == torch.float64 else torch.float32
    # the single-rank reference, whatever the TP; a big tiny model's shares the model's weights (one copy in memory)
    shared = world == 1 and not on_npu and ref_dtype == cache_dtype and parameters > SHARED_WEIGHTS_ABOVE
    ref = sharing_weights(pristine, model) if shared else copy.deepcopy(pristine)
    ref.to(dtype=ref_dtype)
    for copy_ in (model, ref):  # init-time float32 buffers of a linear module, redone in the comparison dtype
        recurrent_kind.exact_buffers(copy_, cache_dtype if copy_ is model else ref_dtype)
    fingerprint = weights_fingerprint(model) if shared else None
    with ops, device_readings(readings), consulted_questions() as consulted, \
            _framework(manifest, req, backend) as handle, _torchair(manifest, backend), \
            _custom_ops(manifest, backend), float64_upcasts():
        rendered = import_rendered(rendered_dir)
        if not report.provenance:
            from model_infer_kvcache.validators.pipeline.provenance import rendered_provenance

            report.provenance = rendered_provenance(rendered_dir, handle, backend)
        host = HostModel(model, rendered, is_mla=manifest.mla.enabled, cache_dtype=cache_dtype, device=device,
                         block_size=manifest.block_size,
                         uncached=frozenset(b.decoder_layer for b in manifest.no_cache_layers or ()),
                         loops=manifest.recurrent_loops)
        host.atol = TOLERANCE[req.dtype]
        if host.encoder is not None:  # an encoder-decoder's decoder: the reference reads each request's own states
            ref._kvcache_encoder = host.encoder
        if observe is not None:  # localisation's replay: a capture on the model under test
            observe(host)
        try:
            if manifest.kv_mode.value == "legacy":
                from model_infer_kvcache.validators.pipeline.legacy_run import run_legacy

                run_legacy(report, manifest, host, ref, req.seed, cache_dtype,
                           framework=manifest.deploy_mode.value == "framework", scenario=scenario)
            elif manifest.deploy_mode.value == "framework":
                from model_infer_kvcache.validators.harness import FrameworkAPI
                from model_infer_kvcache.validators.pipeline.framework_run import run_framework

                if handle.real:
                    report.notes.append(f"checkout {handle.root} (detected {handle.generation}); modules from the "
                                        f"harness: {', '.join(handle.fallbacks) or 'none'}")

                run_framework(report, manifest, host, ref, FrameworkAPI.from_handle(handle), handle.generation, scenario,
                              req.seed, cache_dtype)
            else:
                from model_infer_kvcache.validators.pipeline.standalone_run import run_standalone

                run_standalone(report, manifest, host, ref, scenario, req.seed, cache_dtype)
        except StreamStalled as exc:  # the watchdog: a request that never finishes, a step that never returns
            report.add(STREAM_BUDGET_CHECK, "runtime", False, detail=str(exc))
            check_attention_calls(report, manifest, host, before_failure=True)
            return
        except Exception as exc:  # the rendered code or an operator rejected a call: a finding, not a crash
            layer = host.probe.last_layer
            where = f"step {host.step_index}, layer {'?' if layer is None else layer}"
            report.add("rendered code runs without operator errors", "runtime", False,
                       detail=f"{where}: {type(exc).__name__}: {exc}{_raised_outside_render(exc, rendered_dir)}")
            check_attention_calls(report, manifest, host, before_failure=True)
            return
        finally:
            report.consulted = sorted(set(report.consulted) | consulted)
        if fingerprint is not None and not torch.equal(fingerprint, weights_fingerprint(model)):
            report.add("rendered code runs without operator errors", "runtime", False,
                       detail="the model's weights changed during the stream (the reference shares them: "
                              "weights_fingerprint); the rendered code must not write the model's parameters")
            return
        report.add("rendered code runs without operator errors", "runtime", True, steps=host.step_index + 1,
                   **({"shared_weights": True} if shared else {}))
        raised = getattr(ref, OWN_DEFAULT_DTYPE, None)
        if raised:
            report.notes.append(f"the reference's {ref_dtype} forward raised in torch's default dtype "
                                f"{torch.get_default_dtype()} ({raised}): it ran with {ref_dtype} as the default "
                                "dtype, so its own constants hold the values its code asked for")


# Above this many parameters (Ergo's tiny model: 64 heads x 128 at a tied hidden size, 634M) the reference shares
# the float64 weights of the model under test instead of holding a copy: two float64 copies and the float32
# original took ~12.5 GB a run (`kvcache run` killed, exit -9). What the rendered code could do to shared weights,
# it may not: the weights are fingerprinted before and after the stream.
SHARED_WEIGHTS_ABOVE = 200_000_000


def sharing_weights(pristine: torch.nn.Module, model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``pristine`` (the reference: transformers' own forwards, untouched by the host) whose parameters are
    ``model``'s own tensors, by name (its buffers stay its own)."""
    own = dict(model.named_parameters(remove_duplicate=False))
    memo = {id(t): own[name] for name, t in pristine.named_parameters(remove_duplicate=False) if name in own}
    return copy.deepcopy(pristine, memo)


def weights_fingerprint(model: torch.nn.Module) -> torch.Tensor:
    """Each parameter's sum and sum of squares (float64): any write into the weights shows."""
    with torch.no_grad():
        return torch.stack([torch.stack((p.double().sum(), p.double().square().sum())) for p in model.parameters()])


def _raised_outside_render(exc: BaseException, rendered_dir) -> str:
    """Where an exception with no frame of the rendered code on its stack was raised. Such an error is either the
    render's output failing downstream (a wrong shape reaching transformers' o_proj) or the validation's own failure
    (the host, the emulation): the report says which file raised, so a kvcache bug does not read as a render's."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    root = str(Path(rendered_dir).resolve())
    if not frames or any(str(Path(f.filename).resolve()).startswith(root) for f in frames):
        return ""
    last = frames[-1]
    return f" (raised at {Path(last.filename).name}:{last.lineno} in {last.name}; no frame of the rendered code on the stack)"


def _custom_ops(manifest: SelectionManifest, backend: str):
    """A DeepSeek-V4 render imports the checkout's own operators (``custom_ops``, ``torch.ops.custom``): on CPU their
    emulation (validators/npu_ops/custom_ops.py)."""
    if backend != "emulated" or not getattr(kind_of(manifest), "CALLS_CUSTOM_OPS", False):
        return contextlib.nullcontext()
    from model_infer_kvcache.validators.standins import custom_ops_standin

    return custom_ops_standin()


def _torchair(manifest: SelectionManifest, backend: str):
    """A rendered ge_graph decode imports torchair (its decode FA is torchair.ops'): on CPU the stand-in."""
    from model_infer_kvcache.validators.pipeline.graph_capture import graph_mode

    if backend != "emulated" or graph_mode(manifest) != "ge_graph":
        return contextlib.nullcontext()
    from model_infer_kvcache.validators.standins import torchair_standin

    return torchair_standin()


@contextlib.contextmanager
def _framework(manifest: SelectionManifest, req: ValidateRequest, backend: str = "emulated"):
    if manifest.deploy_mode.value != "framework":
        yield None
        return
    from model_infer_kvcache.validators.harness import install_framework
    from model_infer_kvcache.validators.standins import device_standins
    from model_infer_kvcache.validators.standins.third_party import absent_third_party

    generation = req.framework_api or manifest.framework_api or "G2"
    # Without a checkout a G2 manifest is validated against the newest framework behaviour (G3:
    # same model-side contract, HEAD's sliding layout and engine); --framework-api G2 asks for 48a59dc's.
    if req.framework_root is None and req.framework_api is None and generation == "G2":
        generation = "G3"
    # A checkout imports torch_npu / torchair / torch.npu: on CPU they are the stand-ins. Its G2+ allocation
    # imports the KV-transfer package, whose client imports third-party modules a CPU run never calls.
    on_cpu = req.framework_root and backend == "emulated"
    standins = device_standins() if on_cpu else contextlib.nullcontext()
    third_party = absent_third_party() if on_cpu else contextlib.nullcontext()
    with standins, third_party, install_framework(generation, req.framework_root,
                                                  fallback_to_harness=["executor.utils.common_utils"]) as handle:
        yield handle
