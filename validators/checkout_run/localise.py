"""Localisation of a checkout run's numeric failure: replay the stream in the same engine up to the first
failing step with a capture on the checkout's model (``validators.pipeline.localise``), then compare it
with transformers over the failing request. The model file's lines are named by the operator calls made
from it, and by a per-token map it computes that the step's packing contradicts (``Capture.packing``). Runs only after the numeric link failed, after every check of the run.

At attention TP > 1 every rank replays (the model's collectives need every rank) and localises its own capture;
the merged report keeps rank 0's (``multi_rank.run_ranks``). Only what every rank holds alike is compared with
the single-rank transformers reference (``rank_invariant``): the sub-modules' outputs, which the framework's
models all-reduce inside each module's forward (qwen3_5: its linear and full attention, MoE and shared expert),
and the per-token maps of the packing check. An FA output or a written K/V holds the rank's own heads and is left
out, said in a note (unless every rank holds the same heads: one replicated KV head)."""

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


def step_packing(run: engine_run.EngineRun, step_index: int) -> tuple[list[int], list[int]] | None:
    """(request index within the step, position) of each packed row of a prefill step (``Capture.packing``)."""
    step = run.steps[step_index]
    if not step.is_prefill:
        return None
    lens = [run.prompt_len[r] for r in step.request_ids]
    return [k for k, n in enumerate(lens) for _ in range(n)], [p for n in lens for p in range(n)]


def rank_invariant(capture: Capture, atol: float) -> int:
    """Leave in ``capture`` only the tensors every rank holds alike (within ``atol``, relative as ``localise``
    compares); returns how many it left out. A collective: every rank calls it on its capture of the same code."""
    import torch.distributed as dist

    # every captured tensor, in the same order on every rank (the same layers and operator calls)
    slots = [(capture.seen[i], what) for i in sorted(capture.seen) for what in sorted(capture.seen[i])]
    slots += [(c, key) for c in capture.calls for key in ("output", "value") if key in c]
    shapes = [None if holder[key] is None else tuple(holder[key].shape) for holder, key in slots]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, shapes)
    if any(len(other) != len(shapes) for other in every):
        raise RuntimeError("the ranks' captures differ in their calls (not the same code path)")
    left_out = 0
    for n, (holder, key) in enumerate(slots):
        if shapes[n] is None:
            continue
        if any(other[n] != shapes[n] for other in every):  # every rank sees it: none transfers it
            holder[key] = None
            left_out += 1
            continue
        t = holder[key].nan_to_num(nan=1e300, posinf=1e301, neginf=-1e301).reshape(-1)
        bounds = torch.cat([t, -t])
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX)  # [max over the ranks | -min over the ranks]
        spread = (bounds[:t.numel()] + bounds[t.numel():]).abs().max().item() if t.numel() else 0.0
        if spread > atol * max(1.0, holder[key].nan_to_num(0.0, 0.0, 0.0).abs().max().item()):
            holder[key] = None
            left_out += 1
    return left_out


def localise_checkout(report: Report, manifest: SelectionManifest, engine, run: engine_run.EngineRun, scenario: Scenario, seed: int,
                      rec: OpRecorder, caches: CacheMap | None, ref_model, model_file: Path, dtype: torch.dtype,
                      world: int = 1) -> None:
    """Set ``report.localisation`` for the numeric failure ``report.first_failure`` names (a note if it cannot)."""
    failure = report.first_failure
    legacy = caches is None  # the model owns its caches: no framework entries to name, no FA judgement to repeat
    try:
        if world > 1:  # every rank must replay to the same step (its collectives): the ranks agree on it first
            import torch.distributed as dist

            every: list = [None] * world
            dist.all_gather_object(every, (failure["step"], failure["request"]))
            if len(set(every)) > 1:
                raise RuntimeError(f"the ranks' first numeric failures differ (step, request): {every}")
        main_judgement = None
        if not legacy:
            # How the runtime check judged the main run's FA calls (attributed before the replay adds its own)
            stepped = [c for c in attributed_fa_calls(rec, caches, run, 0)[0] if c["cache"] is not None]
            main_judgement = (judged_manifest(report.fresh(), manifest, stepped),
                              own_layout_layers(report.fresh(), manifest, stepped))
        rows, positions = request_rows(run, failure["step"], failure["request"])
        tokens = list(run.sequences[failure["request"]][:positions[-1] + 1])

        def cache_name(t):
            slot = caches.slot(storage(t)) if caches is not None else None
            return slot.cache_name if slot is not None else None

        capture = Capture(engine.main_worker.model, failure["step"], lambda: rec.step, [model_file], cache_name,
                          packing=step_packing(run, failure["step"]))
        rec.tap = capture.tap
        # The replay runs the stream as the first run did: the same scheduler, stand-ins and caches declared.
        with contextlib.ExitStack() as stack:
            stack.enter_context(engine_run.cpu_engine_patches(dtype))
            stack.enter_context(engine_run.single_rank_group())  # at TP > 1 the ranks' group is already up
            if legacy:  # its casts for the operators in the comparison dtype, as in the run (HalfDtypesAs)
                stack.enter_context(engine_run.HalfDtypesAs(dtype))
            else:
                stack.enter_context(engine_run.declared_caches(engine))
            stack.enter_context(engine_run.observed_forwards(engine, rec))
            stack.enter_context(capture.installed())
            try:
                engine_run.drive(engine, scenario, seed, rec)
            except ReplayDone:
                pass
        left_out = rank_invariant(capture, report.tolerance) if world > 1 else 0
        with torch.no_grad():
            acts = reference_activations(ref_model, tokens)
        judge = None
        if main_judgement is not None:
            # FA arguments judged as the runtime check judges them (checks.judged_manifest: the choices the model
            # may make differently, e.g. the FA version when the manifest's was only the family default; window
            # layers' pre_tokens left to the reading sweep)
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
    if world > 1:
        report.notes.append(f"localisation at attention TP {world}: rank 0's replay, compared with the single-rank "
                            "reference where every rank holds the same values (the sub-modules' all-reduced outputs"
                            + (f"; {left_out} tensor(s) holding a rank's own heads, FA outputs or written K/V, left "
                               "out)" if left_out else ")"))
