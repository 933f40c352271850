"""`kvcache validate --framework-root CHECKOUT --model NAME`: the checkout's model in the checkout's engine.

The model file that ships (the checkout's, or ``model_file``: an edited copy standing in for it)
is loaded by the checkout's registry and weight loader from a checkpoint of the tiny transformers
model, driven by the checkout's Scheduler and ExecutionEngine on CPU, and compared step by step
with transformers' own forward on the same weights. The links and the report are the rendered
mode's (``validators.pipeline``): init (``get_cache_info`` of the real model vs the manifest),
runtime (every FA call and cache write, observed), numeric, release.
"""

from __future__ import annotations

import copy
import dataclasses
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from model_infer_kvcache.analyzer.config_loader import model_section, read_config_file
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.kinds import cross as cross_kind
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from model_infer_kvcache.validators.kinds import kind_of
from model_infer_kvcache.validators.pipeline.precision import TOLERANCE
from model_infer_kvcache.validators.pipeline.report import Report
from model_infer_kvcache.validators.pipeline.request_stream import Scenario
from model_infer_kvcache.validators.pipeline.validate import check_next_n

# The stream in the engine. Offline scheduling gives every request the same number of new tokens
# (Scheduler._should_finish counts decode steps against scheduler_config.max_new_tokens), so
# early finishes come from admission times: see engine_run.drive.
ENGINE_STREAM = Scenario(first=((150, 8), (40, 8), (300, 8), (290, 8)), late=((200, 8), (60, 8)),
                         max_concurrency=4, release_requests=3)
ENGINE_QUICK = Scenario(first=((150, 4), (40, 4), (300, 4)), late=((60, 4),), max_concurrency=3,
                        release_requests=0)
DTYPE = "float32"  # the device's widest dtype: what the checkout's float32 path computes in


@dataclass(frozen=True)
class CheckoutRequest:
    framework_root: str
    model: str  # key of executor/core/support_models.py, or a directory under models/
    config: str  # the model's config.json (the tiny model is built from it)
    manifest: str | None = None  # None: analyzed on the fly from config + checkout
    attn_tp_size: int | None = None  # None: the manifest's
    model_file: str | None = None  # an edited copy standing in for the registered model file
    seed: int = 0
    scenario: Scenario = ENGINE_STREAM
    sweep_readings: bool = True
    device_readings: str | None = None  # readings file of `kvcache probe`
    readings: tuple[tuple[str, str], ...] = ()  # API: (question, reading) pairs the run assumes instead
    step_seconds: float | None = None  # the watchdog's allowance per forward step; None: the scenario's
    # every prompt as long as the longest: for a model that only supports equal-length prefill batches
    uniform_prefill: bool = False
    next_n: int | None = None  # --next-n: analyze's MTP switch (0: the model is built and served without MTP)
    # What the numeric link compares the cached run with: "transformers" (its model on the same weights),
    # "recompute" (the checkout's own model over each whole prefix, no cache: needs no transformers class),
    # "both" (framework runs; a note says which failed when they disagree). See checkout_run/recompute.py.
    oracle: str = "both"
    # --exe-mode: the engine's decode mode; npugraph_ex compiles and captures decode (graph_capture.CaptureRecorder)
    exe_mode: str = "eager"
    static_graph: bool = False  # --static-graph: the engine's enable_dynamic_graph False (npugraph_ex only)
    # --encoder-length: analyze's cross-attention slot size (beside a manifest: must be the manifest's)
    encoder_length: int | None = None

    def __post_init__(self):
        from model_infer_kvcache.validators.checkout_run.recompute import check_oracle

        check_oracle(self.oracle)


def stream_of(req: CheckoutRequest, scenario: Scenario, manifest: SelectionManifest) -> Scenario:
    """The request stream of a run: ``scenario`` past the manifest's window, uniform when asked."""
    crossing = scenario.crossing_window_of(manifest)
    return crossing.uniform_prefill() if req.uniform_prefill else crossing


def load_or_analyze(req: CheckoutRequest, root: Path) -> SelectionManifest:
    if req.manifest:
        from model_infer_kvcache.analyzer.manifest_io import load_manifest

        manifest = load_manifest(req.manifest)
        if req.attn_tp_size is not None and req.attn_tp_size != manifest.parallel.attn_tp_size:
            raise InputError("--attn-tp-size", f"{req.attn_tp_size} differs from the manifest's attn_tp_size "
                                               f"{manifest.parallel.attn_tp_size} (re-analyze with --attn-tp-size)")
        check_next_n(req.next_n, manifest)
        cross_kind.check_manifest_length(req.encoder_length, manifest.cross_attention, manifest.model.model_type)
        return manifest
    from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze

    return analyze(AnalyzeRequest(config=req.config, framework_root=str(root), attn_tp_size=req.attn_tp_size,
                                  dispatch="部署模式: 框架部署", device_readings=req.device_readings, next_n=req.next_n,
                                  encoder_length=req.encoder_length))



def _rank_step(req: CheckoutRequest, rank: int, world: int) -> Report:
    """What each of the ``run_ranks`` processes runs: this mode's validation on one rank."""
    return validate_checkout(req, rank=rank, world=world)


def validate_checkout(req: CheckoutRequest, progress=None, rank: int = 0, world: int = 1) -> Report:
    """One rank; a manifest with attention TP > 1 launches that many ranks (gloo).

    Where the user left the layout to kvcache (no --attn-tp-size, no manifest) and the model's own code refuses
    one rank (``layout.rank_refusal``), the run starts again at attention TP 2; the report says which layout ran
    and why, beside the layouts the folder's yamls serve."""
    from model_infer_kvcache.validators.checkout_run import layout

    if world > 1:
        return _validate_checkout(req, progress, rank, world)
    chosen = layout.chosen_by_kvcache(req, world)
    refused = None
    try:
        report = _validate_checkout(req, progress, rank, world)
    except layout.RanksRefused as exc:
        if progress:
            progress(f"one rank refused by the model ({exc.where}): running at attention TP {layout.TRY_NEXT}")
        refused = exc
        report = _validate_checkout(replace(req, attn_tp_size=layout.TRY_NEXT), progress, rank, world)
        _refuse_both_layouts(req, report, exc)
    _note_layout(report, req, refused, chosen)
    return report


def _note_layout(report: Report, req: CheckoutRequest, refused, chosen: bool) -> None:
    """The first note (and ``provenance['layout']``): the layout that ran, who chose it, what the folder serves."""
    from model_infer_kvcache.validators.checkout_run import layout
    from model_infer_kvcache.validators.checkout_run.registry import model_folders

    root = Path(req.framework_root)
    served = layout.served_layouts(root, model_folders(root, req.model))
    world = report.provenance.get("layout", {}).get("world_size", 1)
    if refused is not None:
        why = (f"chosen by kvcache: at one rank the model refused, {refused.where} ({refused.reason})")
    elif chosen:
        why = "kvcache's first layout (no --attn-tp-size; the model's code accepted it)"
    else:
        why = "--attn-tp-size" if req.attn_tp_size else "the manifest's attn_tp_size"
    report.notes.insert(0, f"layout: {layout.layout_phrase(world)}, {why}; {layout.describe_served(served)}")
    report.provenance["layout"] = {"attn_tp_size": world, "moe_tp_size": world,
                                   "chosen_by": "kvcache" if chosen else "user",
                                   **({"one_rank_refused_at": refused.where} if refused else {}),
                                   "served": layout.describe_served(served)}


def _refuse_both_layouts(req: CheckoutRequest, report: Report, refused) -> None:
    """Exit 2 when the model's own size check refuses attention TP 2 as well: no layout kvcache validates runs
    it (kvcache's gap: it runs attention TP = MoE TP, not the folder's EP or DP layouts), not the model's failure."""
    import re

    from model_infer_kvcache.validators.checkout_run import layout

    for check in report.failed():
        found = re.match(r"(\S+: )(\w+): (.*)", check.detail or "")
        if check.link == "runtime" and found and layout.size_check(found.group(2), found.group(3)):
            raise InputError(req.model, f"not supported by kvcache: no layout kvcache runs is accepted by the "
                                        f"model: one rank ({refused.where}: {refused.reason}), attention TP "
                                        f"{layout.TRY_NEXT} ({check.detail}); kvcache runs attention TP = MoE TP "
                                        "only, not the folder's expert- or data-parallel layouts", field="--model")


def _validate_checkout(req: CheckoutRequest, progress=None, rank: int = 0, world: int = 1) -> Report:
    from model_infer_kvcache.validators.checkout_run.scope import require_checkout
    from model_infer_kvcache.validators.pipeline.tiny_model import require_transformers_type

    say = progress or (lambda msg: None)
    started = time.perf_counter()
    root = require_checkout(req.framework_root)
    from model_infer_kvcache.validators.checkout_run.registry import check_model_name

    check_model_name(root, req.model)
    _, real_config = read_config_file(req.config)
    if req.model_file and not Path(req.model_file).is_file():
        raise InputError(req.model_file, "does not exist", field="--model-file")
    manifest = load_or_analyze(req, root)
    require_transformers_type(manifest.model.model_type)
    from model_infer_kvcache.validators.checkout_run.support import preflight

    preflight(req.config, manifest)  # a kind the run cannot drive: said before a checkpoint is built for it
    tp = manifest.parallel.attn_tp_size
    measured = None
    if req.device_readings:
        from model_infer_kvcache.analyzer.readings_file import load_readings

        measured = load_readings(req.device_readings)
    from model_infer_kvcache.validators.npu_ops import DeviceReadings

    base = DeviceReadings.from_settled(measured.settled()) if measured else DeviceReadings()
    if req.readings:
        base = replace(base, **dict(req.readings))
    if tp > 1 and world == 1:
        report = _validate_ranks(req, manifest, tp, base, measured, say)
        report.seconds = time.perf_counter() - started
        report.provenance["layout"] = {"world_size": tp}
        return report

    report = Report(backend="emulated", deploy_mode="framework", model_type=manifest.model.model_type,
                    manifest_hash=manifest.content_hash(), dtype=DTYPE, tolerance=TOLERANCE[DTYPE])
    from model_infer_kvcache.validators.pipeline.tiny_model import cpu_sized

    short = cpu_sized(manifest)
    if short is not None:
        # The tiny config carries the short window (and DSA's narrow selection), so the checkout's model reads it
        # like any config field (cache entries, FA band, indexer top-k) and CPU sequences cross it; the manifest's
        # offsets are kept (cpu_sized).
        if short.sliding_window() != manifest.sliding_window():
            report.notes.append(f"window {manifest.sliding_window()} is too long for CPU sequences: the tiny config "
                                f"and the manifest the run is judged by carry window {short.sliding_window()}")
        report.notes += kind_of(manifest).shrink_notes(manifest, short)
        manifest = short
    if manifest.mtp is not None:
        from model_infer_kvcache.validators.checkout_run import layout
        from model_infer_kvcache.validators.checkout_run.registry import model_folders

        root = Path(req.framework_root)
        report.notes.append(layout.speculation_note(layout.served_next_n(root, model_folders(root, req.model)),
                                                    manifest.mtp.num_layers))
    report.readings = dataclasses.asdict(base)
    if req.readings:
        report.notes.append("readings set by the caller: " + ", ".join(f"{q}={r}" for q, r in req.readings))
    scenario = stream_of(req, req.scenario, manifest)
    if req.uniform_prefill:
        report.notes.append(f"--uniform-prefill: every prompt is {scenario.first[0][0]} tokens, so each prefill "
                            "batch holds one length; variable-length prefill batches were not exercised")
    say("building the tiny transformers model and its checkpoint")
    with tempfile.TemporaryDirectory(prefix="kvcache-checkout-") as tmp:
        from model_infer_kvcache.validators.checkout_run.registry import config_class_constants

        fixed = config_class_constants(root, req.model, _model_type(real_config))
        ref, checkpoint, plan = _checkpoint(real_config, manifest, req.seed, Path(tmp), fixed)
        report.notes += plan.notes
        say(f"running {req.model} in the checkout's engine ({root})")
        from model_infer_kvcache.validators.checkout_run.run import run_checkout
        from model_infer_kvcache.validators.pipeline.host_model import ReferenceMemo

        memo = ReferenceMemo(ref)  # the sweep's reruns replay the stream: their sequences' logits are known
        run_checkout(report, manifest, req, root, checkpoint, ref, scenario, base, rank, world, full=True, memo=memo)
        if req.sweep_readings and world == 1:
            def rerun(readings) -> Report:
                swept = report.fresh()
                run_checkout(swept, manifest, req, root, checkpoint, ref, stream_of(req, ENGINE_QUICK, manifest),
                             readings, full=False, memo=memo)
                return swept

            _sweep(report, manifest, req, base, measured, rerun, say)
    report.seconds = time.perf_counter() - started
    report.provenance["layout"] = {"world_size": world}
    return report


def _validate_ranks(req: CheckoutRequest, manifest: SelectionManifest, tp: int, base, measured, say) -> Report:
    """Attention TP > 1: every rank runs this mode on its shard (gloo); the sweep reruns all ranks."""
    from model_infer_kvcache.validators.pipeline.multi_rank import run_ranks

    fields = replace(req, attn_tp_size=tp, sweep_readings=False)
    if not req.manifest:  # every rank analyzes the same inputs; pass the result instead
        tmp = tempfile.NamedTemporaryFile("w", suffix=".json", prefix="kvcache-manifest-", delete=False)
        tmp.write(manifest.to_json())
        tmp.close()
        fields = replace(fields, manifest=tmp.name)
    try:
        report = run_ranks(_rank_step, fields, tp, manifest, say)
        if req.sweep_readings:
            quick = ENGINE_QUICK  # each rank's _rank_step applies stream_of

            def rerun(readings) -> Report:
                pairs = tuple(dataclasses.asdict(readings).items())
                return run_ranks(_rank_step, replace(fields, readings=pairs, scenario=quick), tp, manifest)

            _sweep(report, manifest, req, base, measured, rerun, say)
    finally:
        if not req.manifest:
            Path(fields.manifest).unlink(missing_ok=True)
    return report


def _model_type(real_config: dict) -> str:
    src = model_section(real_config)[0]
    return str(src.get("model_type") or real_config.get("model_type") or "")


def _checkpoint(real_config: dict, manifest: SelectionManifest, seed: int, tmp: Path, fixed: dict):
    from model_infer_kvcache.validators.checkout_run.checkpoint import (
        checkpoint_config,
        round_to_bfloat16,
        save_checkpoint,
    )
    from model_infer_kvcache.validators.pipeline.tiny_model import build_tiny_model

    model, plan = build_tiny_model(real_config, manifest, seed=seed, fixed=fixed)
    round_to_bfloat16(model)
    path = save_checkpoint(model, checkpoint_config(real_config, plan.config), tmp / "checkpoint")
    ref = copy.deepcopy(model).to(torch.float32)
    return ref, path, plan




def _sweep(report: Report, manifest, req, base, measured, rerun, say) -> None:
    from model_infer_kvcache.analyzer.measured import device_settled
    from model_infer_kvcache.validators.pipeline.sweep import sweep_readings

    questions = [dep.question for dep in manifest.device_dependencies] + report.consulted
    sweep_readings(report, questions, base, rerun, settled=device_settled(measured),
                   caller=dict(req.readings), subject="the model", say=say)
