"""Localisation of a checkout run's numeric failure: replay the stream in the same engine up to the first
failing step with a capture on the checkout's model (``validators.pipeline.localise``), then compare it
with transformers over the failing request. The model file's lines are named by the operator calls made
from it. Runs only after the numeric link failed, on one rank, after every check of the run."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from model_infer_kvcache.validators.checkout_run import engine_run
from model_infer_kvcache.validators.checkout_run.checks import (
    attributed_fa_calls,
    judged_manifest,
    own_layout_layers,
    window_dependent_layers,
)
from model_infer_kvcache.validators.checkout_run.recorder import CacheMap, OpRecorder
from model_infer_kvcache.validators.pipeline.evidence import storage
from model_infer_kvcache.validators.pipeline.fa_args import fa_call_mismatches
from model_infer_kvcache.validators.pipeline.localise import (
    Capture,
    ReplayDone,
    localise,
    reference_activations,
)
from model_infer_kvcache.validators.pipeline.report import Report
from model_infer_kvcache.validators.pipeline.request_stream import Scenario


def request_rows(run: engine_run.EngineRun, step_index: int, rid: int) -> tuple[list[int], list[int]]:
    """(rows of the step's packed tokens, their positions) of request ``rid`` in step ``step_index``: a prefill
    packs the batch's prompts in order, a decode has one row per request (padded rows after them)."""
    step = run.steps[step_index]
    i = step.request_ids.index(rid)
    if not step.is_prefill:
        return [i], [step.positions[i]]
    lens = [run.prompt_len[r] for r in step.request_ids]
    start = sum(lens[:i])
    return list(range(start, start + lens[i])), list(range(lens[i]))


def localise_checkout(report: Report, manifest: SelectionManifest, engine, run: engine_run.EngineRun, scenario: Scenario, seed: int,
                      rec: OpRecorder, caches: CacheMap, ref_model, model_file: Path, dtype: torch.dtype,
                      world: int = 1) -> None:
    """Set ``report.localisation`` for the numeric failure ``report.first_failure`` names (a note if it cannot)."""
    failure = report.first_failure
    if world > 1:
        report.notes.append("numeric failure not localised: localisation replays a single-rank run")
        return
    try:
        # How the runtime check judged the main run's FA calls (attributed before the replay adds its own)
        stepped = [c for c in attributed_fa_calls(rec, caches, run, 0)[0] if c["cache"] is not None]
        main_judgement = (judged_manifest(report.fresh(), manifest, stepped),
                          own_layout_layers(report.fresh(), manifest, stepped))
        rows, positions = request_rows(run, failure["step"], failure["request"])
        tokens = list(run.sequences[failure["request"]][:positions[-1] + 1])

        def cache_name(t):
            slot = caches.slot(storage(t))
            return slot.cache_name if slot is not None else None

        capture = Capture(engine.main_worker.model, failure["step"], lambda: rec.step, [model_file], cache_name)
        rec.tap = capture.tap
        # The replay runs the stream as the first run did: the same scheduler, stand-ins and caches declared.
        with contextlib.ExitStack() as stack:
            stack.enter_context(engine_run.cpu_engine_patches(dtype))
            stack.enter_context(engine_run.single_rank_group())
            stack.enter_context(engine_run.declared_caches(engine))
            stack.enter_context(engine_run.observed_forwards(engine, rec))
            stack.enter_context(capture.installed())
            try:
                engine_run.drive(engine, scenario, seed, rec)
            except ReplayDone:
                pass
        with torch.no_grad():
            acts = reference_activations(ref_model, tokens)
        # FA arguments judged as the runtime check judges them (checks.judged_manifest: the choices the model may
        # make differently, e.g. the FA version when the manifest's was only the family default; window layers'
        # pre_tokens left to the reading sweep)
        judged, layouts = main_judgement
        dependent = window_dependent_layers(manifest)

        def judge(call: dict) -> list[str]:
            return fa_call_mismatches(judged, {**call, "is_prefill": run.steps[failure["step"]].is_prefill},
                                      dependent, layouts)

        loc = localise(capture, acts, rows, positions, tokens, report.tolerance, judge=judge)
    except Exception as exc:  # localisation explains a failure; it never turns the report into a crash
        report.notes.append(f"numeric failure not localised: {type(exc).__name__}: {exc}")
        return
    finally:
        rec.tap = None
    report.localisation = {"step": failure["step"], "request": failure["request"], **loc}
