"""One run of the checkout's model in the checkout's engine: build, init link, stream, checks, release."""

from __future__ import annotations

import contextlib
import copy
import json
import traceback
from dataclasses import replace
from pathlib import Path

import torch
from model_infer_kvcache.analyzer.errors import InputError, NotSupportedByKvcache
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from model_infer_kvcache.validators.pipeline.report import Report
from model_infer_kvcache.validators.pipeline.request_stream import (
    STREAM_BUDGET_CHECK,
    Scenario,
    StreamStalled,
)

# Modules of ours that a run puts between the checkout and the CPU (the provenance lists them).
OURS = ("validators.npu_ops (torch_npu operators, emulated)", "validators.standins (torchair, torch.npu, Tensor.npu)",
        "validators.checkout_run (driver: observes the engine, poisons unowned blocks, compares logits)")


def _model_frame(exc: BaseException, model_file: Path) -> str:
    """file:line of the innermost frame inside the model file (or the checkout), for the one-line failure."""
    if isinstance(exc, SyntaxError) and exc.filename:  # the file that does not parse, not the importer's frame
        return f"{Path(exc.filename).name}:{exc.lineno}"
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        if model_file is not None and Path(frame.filename).resolve() == model_file:
            return f"{model_file.name}:{frame.lineno}"
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"


def run_checkout(report: Report, manifest: SelectionManifest, req, root: Path, checkpoint: Path, ref_model,
                 scenario: Scenario, readings, rank: int = 0, world: int = 1, *, full: bool = True,
                 memo=None) -> None:
    """Append the checks of one run to ``report``; ``full`` adds provenance, the init link over the real
    layer count and the sequential-release check (the reading sweep reruns without them). ``memo``
    (host_model.ReferenceMemo of ``ref_model``): the reference's logits shared with the sweep's reruns."""
    if req.step_seconds is not None:
        scenario = replace(scenario, step_seconds=req.step_seconds)
    from model_infer_kvcache.analyzer.framework_checkout import checkout_commit
    from model_infer_kvcache.validators.checkout_run import checks, engine_run
    from model_infer_kvcache.validators.checkout_run.recorder import CacheMap, recording_ops
    from model_infer_kvcache.validators.checkout_run.registry import resolve
    from model_infer_kvcache.validators.checkout_run.scope import checkout_scope
    from model_infer_kvcache.validators.npu_ops import consulted_questions, device_readings

    dtype = torch.float32
    model_file = caches = capture = None
    oracle = _oracle_for(report, getattr(req, "oracle", "both"), ref_model, full)
    recomputed = None  # the recompute oracle's logits (framework runs; see recompute.py)
    with recording_ops() as rec, checkout_scope(root) as scope, device_readings(readings), \
            consulted_questions() as consulted:
        try:
            classes = resolve(root, req.model, _config_model_type(checkpoint), req.model_file)
            model_file = classes.model_file
            # Legacy: the model owns its caches (init_cache, no get_cache_info), so the engine makes no
            # KVCacheManager; its cache rows are the batch's rows, never reused: one batch, prefilled together.
            legacy = not hasattr(classes.model_cls, "get_cache_info")
            if legacy:
                scenario = scenario.one_batch()
            from model_infer_kvcache.validators.checkout_run.support import preflight

            preflight(req.config, manifest)  # a manifest naming no reference for its linear family (older kvcache): exit 2
            from model_infer_kvcache.validators.checkout_run.compat import fit_checkpoint_config

            fitted = fit_checkpoint_config(checkpoint, classes.config_cls)
            if full:
                report.notes += fitted
            from executor.core.config import InferenceConfig

            max_new = max(new for _, new in scenario.first + scenario.late)
            folder = classes.model_module.split(".")[1]
            layout = engine_run.shipped_layout(root / "models" / folder / "config", world) if world > 1 else {}
            if full and engine_run.engine_batch_size(scenario.max_concurrency, world) != scenario.max_concurrency:
                report.notes.append(f"engine batch size {engine_run.engine_batch_size(scenario.max_concurrency, world)}"
                                    f": the stream's {scenario.max_concurrency} concurrent requests rounded up to a "
                                    f"multiple of attention TP {world} (decode batches are padded to it)")
            if full and layout:
                report.notes.append(f"parallel sizes from the model's own launch yamls (models/{folder}/config/*.yaml "
                                    "with attention TP over every rank): "
                                    + ", ".join(f"{k} {v}" for k, v in sorted(layout.items())))
            exe_mode = getattr(req, "exe_mode", "eager")
            # npugraph_ex: the yaml's enable_dynamic_graph (default True); ge_graph always compiles static
            dynamic = exe_mode == "npugraph_ex" and not getattr(req, "static_graph", False)
            if full and exe_mode != "eager":
                from model_infer_kvcache.validators.checkout_run.layout import exe_mode_note, served_exe_modes

                report.notes.append(exe_mode_note(exe_mode, served_exe_modes(root, [folder])))
            infer = InferenceConfig.from_dict(
                engine_run.infer_config_dict(req.model, str(checkpoint), world, scenario, manifest.block_size,
                                             max_new, layout, exe_mode=exe_mode, dynamic_graph=dynamic),
                global_rank=rank, local_rank=rank)
            with contextlib.ExitStack() as stack, engine_run.cpu_engine_patches(dtype):
                if exe_mode != "eager":  # the engine compiles decode: its npugraph_ex backend is the recorder
                    from model_infer_kvcache.validators.pipeline.graph_capture import CaptureRecorder

                    capture = stack.enter_context(engine_run.graph_backend(
                        CaptureRecorder(exe_mode, files=(str(Path(model_file).resolve()),), dynamic=dynamic)))
                from model_infer_kvcache.validators.checkout_run.compat import legacy_rope_scaling

                stack.enter_context(legacy_rope_scaling(classes.config_cls))
                if world == 1:
                    stack.enter_context(engine_run.single_rank_group())
                coverage = stack.enter_context(engine_run.load_coverage(classes.model_cls, {}))
                published = getattr(torch, manifest.model.dtype, dtype) if isinstance(manifest.model.dtype, str) \
                    else dtype
                declared = stack.enter_context(engine_run.cpu_cache_dtype(classes.model_cls, dtype, published, []))
                if legacy:  # its caches, and its casts for the operators, in the comparison dtype (HalfDtypesAs)
                    stack.enter_context(engine_run.HalfDtypesAs(dtype))
                engine = engine_run.build_engine(infer, classes.model_cls, classes.config_cls)
                info = None if legacy else engine.kvcache_manager.cache_info
                if not legacy:
                    stack.enter_context(engine_run.declared_caches(engine))
                # The init link judges the allocated caches before any forward: a wrong entry must fail
                # there, by name, not as the warm-up's operator error.
                if full:
                    report.provenance = _provenance(root, checkout_commit(root), classes, info, scope)
                    _note_config_class(report, classes.config_cls, _config_model_type(checkpoint))
                    if legacy:
                        report.notes.append(legacy_note(classes.model_cls.__name__, scenario))
                    else:
                        _init_link(report, manifest, engine, classes, info, dtype, _real_layer_types(req.config),
                                   _real_per_layer_lists(req.config))
                    if declared:
                        names = sorted({f"{name} ({dt})" for _, name, dt in declared})
                        report.notes.append(f"the model declares its caches in its published dtype, not the "
                                            f"config's: {', '.join(names)}; allocated in float32 for the comparison")
                    _load_link(report, coverage, classes.model_file)
                    if any(not c.passed for c in report.checks if c.link == "init"):
                        report.notes.append("init link failed: runtime, numeric and release checks not run")
                        return
                caches = None if legacy else CacheMap(info)
                stack.enter_context(engine_run.observed_forwards(engine, rec))
                engine.warm_up()
                if not legacy:
                    start_usage = engine_run.pool_usage(engine.kvcache_manager)
                    start_bytes = engine_run.cache_bytes(info)
                run = engine_run.drive(engine, scenario, req.seed, rec)
                if full and scenario.release_requests and not legacy:
                    seq = engine_run.drive_sequential(engine, scenario.release_requests, req.seed + 1,
                                                      scenario.vocab, scenario.watchdog("release run"))
                if not legacy:
                    # The release link reads the pool now, so the oracle's prefills below are not what it judges.
                    released = _release_checks(report, run, start_usage, start_bytes, info,
                                               seq if full and scenario.release_requests else None)
                if not legacy and _recompute_wanted(oracle, full):
                    recomputed = _recompute(engine, run, scenario.step_seconds, req.uniform_prefill, rec,
                                            Path(model_file).resolve())
        except StreamStalled as exc:  # the watchdog: a request that never finishes, a forward that never returns
            report.add(STREAM_BUDGET_CHECK, "runtime", False, detail=str(exc))
            if caches is not None:
                checks.check_calls_before_failure(report, manifest, rec, caches)
            return
        except InputError:  # something kvcache does not support (exit 2), not the model's failure
            raise
        except Exception as exc:  # the model or an operator rejected a call: a finding, in one line
            from model_infer_kvcache.validators.checkout_run.layout import (
                RanksRefused,
                chosen_by_kvcache,
                rank_refusal,
            )
            from model_infer_kvcache.validators.checkout_run.support import (
                missing_config_field,
                missing_package,
                none_config_field,
                unsupported_operator,
            )

            frame = _model_frame(exc, Path(model_file).resolve() if model_file else None)
            lacking = unsupported_operator(exc, frame, root) or missing_package(exc, root, req.model_file) \
                or missing_config_field(exc, req.config, frame) or none_config_field(exc, req.config)
            if lacking is not None:  # kvcache lacks it, or the config does: exit 2 naming it, not the model's failure
                raise lacking from None
            refusal = rank_refusal(exc, world)
            if refusal and chosen_by_kvcache(req, world):  # kvcache's layout, not the user's: try the next one
                raise RanksRefused(f"{frame}: {type(exc).__name__}: {exc}", refusal) from None
            if capture is not None and _from_dynamo(exc):  # the capture broke or recaptured: named with its line
                from model_infer_kvcache.validators.pipeline.graph_capture import capture_gap

                gap = capture_gap(exc, capture.files)
                if gap is not None:  # an operator the capture has no shape rule for: kvcache's gap, exit 2
                    raise NotSupportedByKvcache(gap[1] or frame, gap[0].removeprefix("not supported by kvcache: "),
                                                field="--exe-mode") from None
                if capture.active:
                    capture.failed_call(exc)
                frame, exc = capture.broken or capture.recaptured, None
            report.add("checkout model runs in the engine without errors", "runtime", False,
                       detail=f"{frame}: {type(exc).__name__}: {exc}{_hint(exc, world)}" if exc is not None else frame)
            if capture is not None:
                capture.check(report, stream_steps=0)
            if caches is not None:
                checks.check_calls_before_failure(report, manifest, rec, caches)
            return
        finally:
            report.consulted = sorted(set(report.consulted) | consulted)
        report.add("checkout model runs in the engine without errors", "runtime", True, steps=len(run.steps))
        if capture is not None:
            capture.check(report, stream_steps=len(run.steps))
        if legacy:  # no framework entries to judge: the logits judge the model's own caches
            _legacy_oracle(report, req, oracle, ref_model)
            _numeric(report, ref_model, run, memo=memo)
            # nothing was poisoned (no pool, no freed rows): V401's claim does not hold; V301 fails on NaN logits
            report.checks = [c for c in report.checks if c.id != "V401"]
            if full and report.first_failure:  # where it starts (a replay of its one batch; failures only)
                from model_infer_kvcache.validators.checkout_run.localise import localise_checkout

                localise_checkout(report, manifest, engine, run, scenario, req.seed, rec, None, ref_model,
                                  Path(model_file).resolve(), dtype, world)
            return
        n_layers = len(info.layer_infos)
        checks.check_runtime(report, manifest, rec, caches, run, n_layers)
        checks.check_padding(report, run)
        _judge_numeric(report, ref_model, run, oracle, recomputed, memo)
        report.checks += released.checks
        if full and report.first_failure and ref_model is not None:  # where it starts (a replay; failures only)
            from model_infer_kvcache.validators.checkout_run.localise import localise_checkout

            localise_checkout(report, manifest, engine, run, scenario, req.seed, rec, caches, ref_model,
                              Path(model_file).resolve(), dtype, world)


def _from_dynamo(exc: BaseException) -> bool:
    """An exception the graph capture raised (a graph break under fullgraph, a backend failure)."""
    return type(exc).__module__.startswith("torch._dynamo")


def legacy_note(model_cls: str, scenario: Scenario) -> str:
    n = len(scenario.first)
    return (f"Legacy: {model_cls} owns its caches (init_cache, no get_cache_info), so the engine makes no "
            f"KVCacheManager and its cache rows are the batch's rows, never reused: the stream is one batch of {n} "
            "requests prefilled together (no late admits, no release run); the checks of framework cache entries, "
            "blocks and pools (init link but the loader's, runtime, release) do not apply, and the logits judge the "
            "model's own caches and states. Its bfloat16 allocations and casts (init_cache in config.torch_dtype, operator "
            "inputs) run in float32, the comparison dtype")


def _hint(exc: BaseException, world: int) -> str:
    """What to do about a failure the upstream model itself causes at this world size."""
    from model_infer_kvcache.validators.checkout_run.layout import rank_refusal

    refusal = rank_refusal(exc, world) if world == 1 else None
    if refusal and isinstance(exc, KeyError):
        # e.g. Qwen3-MoE / DeepSeek: with moe_tp_size 1 the MoE takes its expert-parallel path, whose group
        # the model registers only for moe_ep_size > 1; the validator runs MoE TP = attention TP.
        return f" ({refusal}: validate with --attn-tp-size 2, which runs its MoE tensor-parallel path)"
    if refusal:  # bailing_2_5: hccl_comm_dict is built only above one rank and its MoE reads it (line 423)
        return f" ({refusal}: validate with --attn-tp-size 2)"
    if isinstance(exc, NotImplementedError) and any(w in str(exc) for w in ("MTP", "nextn", "next_n")):
        # bailing_2_5: the folder serves no MTP yet (its README says so) and refuses a config with MTP layers
        return (" (the model itself refuses MTP layers: serve it without speculative decoding, validate with "
                "--next-n 0)")
    return ""


def _real_per_layer_lists(config_path: str) -> dict[str, list]:
    """The real config's per-layer lists (``mlp_layer_types``...: one entry per layer), which the tiny model
    cut to its layers; the init link's full-depth model gets them back."""
    from model_infer_kvcache.analyzer.config_loader import model_section, read_config_file

    _, real = read_config_file(config_path)
    src = model_section(real)[0]
    layers = src.get("num_hidden_layers", src.get("num_layers"))
    return {k: v for k, v in src.items() if "layer" in k and isinstance(v, list) and len(v) == layers}


def _real_layer_types(config_path: str) -> list | None:
    from model_infer_kvcache.analyzer.config_loader import model_section, read_config_file

    _, real = read_config_file(config_path)
    src = model_section(real)[0]
    types = src.get("layer_types")
    return list(types) if isinstance(types, list) else None


def _note_config_class(report: Report, config_cls, model_type: str) -> None:
    """Say when the registered config class reads a config.json of another model type: legitimate for
    some keys (deepseek_v2_lite reads a deepseek_v2 config into DeepseekV3Config), a likely cause of
    failures below for others (a Llama config under qwen3_8b leaves Qwen3's q/k norms unloaded)."""
    expected = getattr(config_cls, "model_type", "") or ""
    if expected and model_type and expected != model_type:
        report.notes.append(f"the checkout's {config_cls.__name__} (model_type {expected!r}) reads a config.json "
                            f"of model_type {model_type!r}: check --model and --config belong together")


def _config_model_type(checkpoint: Path) -> str:
    return json.loads((checkpoint / "config.json").read_text(encoding="utf-8")).get("model_type", "")


# The logits tolerance is never below the float32 one, and never below this many times the rounding noise the
# architecture itself shows in float32 (measured on the reference: honest float32 code and the float32
# reference each carry about that much, in independent directions).
NOISE_MARGIN = 4.0


# The noise is the rows' NOISE_QUANTILE quantile, not their maximum: a discrete flip on a few rows (an MoE routing
# tie decided one way in float32 and the other in float64: Gemma-4 26B-A4B's tiny model flips 14 of 1716 rows, by up
# to 0.83) is not rounding, and a tolerance widened to it would pass a cache bug's 0.27 (measured).
NOISE_QUANTILE = 0.99


def float32_noise(ref_model, sequences: dict[int, list[int]], base=None) -> float:
    """How much float32 rounding this architecture amplifies: the NOISE_QUANTILE quantile over the stream's rows of
    max |logits in float32 - logits in float64| of the reference (scale 1.0 over a 512-wide normalised head, a
    near-one-hot softmax, shows ~1e-4 where a Llama shows ~1e-6). ``base``: the float32 logits already computed
    (host_model.ReferenceMemo of ``ref_model``)."""
    import copy

    from model_infer_kvcache.validators.pipeline.host_model import reference_logits

    base = base or (lambda seq: reference_logits(ref_model, seq))
    wide = copy.deepcopy(ref_model).to(torch.float64)
    with torch.no_grad():
        rows = torch.cat([(base(seq) - reference_logits(wide, seq)).abs().amax(-1)
                          for seq in sequences.values()])
    return float(torch.quantile(rows, NOISE_QUANTILE))


def _numeric(report: Report, ref_model, run, noise: dict | None = None, memo=None) -> None:
    """V301/V302 (and V401) against transformers' model on the same weights; ``noise`` caches the measured
    float32 rounding noise for the recompute oracle's tolerance; ``memo`` (host_model.ReferenceMemo) the
    reference's logits per sequence, for the comparisons and the noise measurement alike."""
    from model_infer_kvcache.validators.pipeline.host_model import ReferenceMemo
    from model_infer_kvcache.validators.pipeline.numeric import NumericTracker

    memo = memo or ReferenceMemo(ref_model)
    tracker = NumericTracker(ref_model, host=None, atol=report.tolerance, reference=memo)
    for s in run.steps:
        for i, rid in enumerate(s.request_ids):
            tracker.add_rows(rid, s.index, s.is_prefill, [s.positions[i]], s.logits[i:i + 1])
    judged = report.fresh()
    with torch.no_grad():
        tracker.check_numeric(judged, run.sequences)
    logits = next(c for c in judged.checks if c.id == "V301")
    if not logits.passed and not any(c.id == "V401" and not c.passed for c in judged.checks):
        # Finite logits beyond the float32 tolerance: is it this architecture's own float32 rounding? (Measured
        # only here: a passing comparison needs no wider tolerance.)
        if _widen_tolerance(report, ref_model, run.sequences, noise if noise is not None else {}, memo):
            tracker.atol = report.tolerance
            judged = report.fresh()
            with torch.no_grad():
                tracker.check_numeric(judged, run.sequences)
    report.checks += judged.checks
    report.first_failure = judged.first_failure
    _note_longest(report, run)


def _widen_tolerance(report: Report, ref_model, sequences: dict[int, list[int]], noise: dict, memo=None) -> bool:
    """Widen ``report.tolerance`` to NOISE_MARGIN x the float32 noise of the reference when that is wider, with a
    note; True when it changed. ``noise`` keeps the measurement for a second oracle of the same run."""
    if "value" not in noise:
        noise["value"] = float32_noise(ref_model, sequences, memo)
    measured = noise["value"]
    if NOISE_MARGIN * measured <= report.tolerance:
        return False
    report.notes.append(f"logits tolerance {NOISE_MARGIN * measured:.3g} = {NOISE_MARGIN:g} x the float32 "
                        f"rounding noise of this architecture ({measured:.3g}: the reference in float32 vs "
                        f"float64, the {NOISE_QUANTILE:g} quantile of the stream's rows), above the float32 default "
                        f"{report.tolerance:g}")
    report.tolerance = float(f"{NOISE_MARGIN * measured:.3g}")
    return True


def _note_longest(report: Report, run) -> None:
    prefill = max((p for s in run.steps if s.is_prefill for p in s.positions), default=-1) + 1
    decode = max((p for s in run.steps if not s.is_prefill for p in s.positions), default=-1) + 1
    report.notes.append(f"longest sequence: prefill {prefill}, decode {decode} tokens; "
                        f"{sum(1 for s in run.steps if s.padded_rows)} decode steps padded by the engine")


def _outputs_finite(report: Report, run) -> None:
    """V401 without the transformers comparison (which otherwise reports it): the stream's own logits are finite
    with every unowned block poisoned."""
    nonfinite = [f"step {s.index} request {rid}" for s in run.steps for i, rid in enumerate(s.request_ids)
                 if not torch.isfinite(s.logits[i]).all()]
    report.add("outputs finite with unowned cache (freed, null, unwritten) poisoned (NaN)", "release", not nonfinite,
               detail="; ".join(nonfinite[:3]), nonfinite_chunks=len(nonfinite))


def _oracle_for(report: Report, oracle: str, ref_model, full: bool) -> str:
    """The oracle(s) this run can use: without a transformers reference (no class for the architecture), "both"
    is the recompute oracle alone, said in a note; "transformers" cannot run at all."""
    if ref_model is not None or oracle == "recompute":
        return oracle
    if oracle == "transformers":
        raise InputError("--oracle", "transformers: no transformers reference model for this architecture "
                                     "(use the recompute oracle)")
    if full:
        report.notes.append("transformers oracle not run: no transformers reference for this architecture; the "
                            "recompute oracle judges the numeric link alone")
    return "recompute"


def _recompute_wanted(oracle: str, full: bool) -> bool:
    """The recompute oracle runs on the judged stream; the reading sweep's reruns need it only when it is the one
    numeric judge (with both, transformers judges each reading)."""
    return oracle == "recompute" or (oracle == "both" and full)


def _recompute(engine, run, step_seconds: float, uniform: bool, rec, model_file: Path):
    """The recompute oracle's prefills (recompute.py). Its forwards are no evidence of the judged run: their
    recorded calls are dropped. A failure of its own is reported by V305, not as the judged run's."""
    from model_infer_kvcache.validators.checkout_run.recompute import Recomputed, prefixes, recompute

    marks = [(calls, len(calls)) for calls in (rec.forwards, rec.fa_calls, rec.writes, rec.sparse_calls)]
    try:
        return recompute(engine, run, step_seconds, uniform)
    except Exception as exc:  # the model or an operator rejected a prefix the stream never prefilled
        return Recomputed(prefills=len(prefixes(run)),
                          error=f"{_model_frame(exc, model_file)}: {type(exc).__name__}: {exc}")
    finally:
        for calls, n in marks:
            del calls[n:]


def _release_checks(report: Report, run, start_usage: dict, start_bytes: int, info, seq: int | None) -> Report:
    """The release link's checks, read right after the stream (and its sequential release run), before anything
    else runs on the engine; appended to the report in their usual place."""
    from model_infer_kvcache.validators.checkout_run import checks, engine_run

    released = report.fresh()
    checks.check_release(released, run, start_usage, start_bytes, engine_run.cache_bytes(info))
    if seq is not None:
        usage = engine_run.pool_usage(run.engine.kvcache_manager)
        after = engine_run.cache_bytes(info)
        released.add(f"{seq} sequential requests leave the pool and memory unchanged", "release",
                     usage == start_usage and after == start_bytes, usage_before=start_usage, usage_after=usage,
                     bytes_before=start_bytes, bytes_after=after)
    return released


def _legacy_oracle(report: Report, req, oracle: str, ref_model) -> None:
    """A Legacy model owns its caches (one batch's rows, no cache manager to give a fresh prefix fresh blocks):
    the recompute oracle does not run there; transformers judges it."""
    if oracle == "transformers":
        return
    if ref_model is None:
        raise NotSupportedByKvcache(req.model, "the recompute oracle of a Legacy model (it owns its caches: "
                                               "no cache manager gives a recomputed prefix fresh blocks)",
                                    field="--oracle")
    report.notes.append("recompute oracle not run: a Legacy model owns its caches (rows of one batch, no cache "
                        "manager to give a recomputed prefix fresh blocks); judged against transformers only")


def _judge_numeric(report: Report, ref_model, run, oracle: str, recomputed, memo=None) -> None:
    """The numeric link by the oracles asked for; with both, a note says which failed and what that locates
    (``memo``: the reference's logits per sequence, host_model.ReferenceMemo)."""
    from model_infer_kvcache.validators.checkout_run.recompute import check_recompute, disagreement_note

    noise: dict = {}
    if oracle != "recompute":
        _numeric(report, ref_model, run, noise, memo)
    else:
        _outputs_finite(report, run)
        _note_longest(report, run)
        report.notes.append("oracle: recompute only (the model's own forward over each whole prefix, no cache): it "
                            "judges what the cache holds and how it is read, not errors the prefill and the decode "
                            "path share (softmax scale, RoPE, weights layout): those need the transformers oracle")
    if recomputed is None:
        return
    judged = report.fresh()
    passed = check_recompute(judged, run, recomputed, report.tolerance)
    finite = not recomputed.error and all(torch.isfinite(t).all() for t in recomputed.logits.values()) and \
        not any(c.id == "V401" and not c.passed for c in report.checks)
    if not passed and finite and ref_model is not None and _widen_tolerance(report, ref_model, run.sequences, noise,
                                                                            memo):
        judged = report.fresh()
        passed = check_recompute(judged, run, recomputed, report.tolerance)
    report.checks += judged.checks
    if oracle == "both":
        transformers = all(c.passed for c in report.checks if c.id in ("V301", "V302"))
        greedy = next(c for c in judged.checks if c.id == "V306").passed
        note = disagreement_note(transformers, passed and greedy)
        if note:
            report.notes.append(note)


def _init_link(report: Report, manifest: SelectionManifest, engine, classes, info, dtype,
               real_layer_types: list | None, real_per_layer: dict | None = None) -> None:
    """get_cache_info() of the engine's model, and of the same model class at the real layer count."""
    import executor.core.kv_cache.cache_info as cache_info_mod
    from model_infer_kvcache.validators.harness.generations import detect_generation_from_classes
    from model_infer_kvcache.validators.pipeline.framework_run import check_cache_info

    api = detect_generation_from_classes(cache_info_mod.CacheEntry, cache_info_mod.ModelCacheInfo, cache_info_mod)
    full_layers = manifest.model.num_layers
    # one layer info per attention (LongCat-Flash: 2 per decoder layer)
    cache_layers = full_layers * getattr(manifest.model, "sublayers_per_layer", 1)
    full_info = info
    if len(info.layer_infos) != cache_layers:
        from model_infer_kvcache.validators.checkout_run.compat import set_config_field

        cfg = copy.deepcopy(engine.main_worker.hf_config)
        set_config_field(cfg, "num_hidden_layers", full_layers)
        if isinstance(getattr(cfg, "layer_types", None), list):  # the tiny config kept a prefix of the pattern
            # a config without layer_types (the pattern is the class's default): the analyzer's per-layer plan
            planned = [("sliding_attention" if layer.is_sliding else "full_attention")
                       for layer in manifest.layers if layer.sublayer == 0][:full_layers]
            cfg.layer_types = list(real_layer_types or planned)
        for key, value in (real_per_layer or {}).items():
            if key != "layer_types" and isinstance(getattr(cfg, key, None), list):  # mlp_layer_types...
                setattr(cfg, key, list(value))
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            full_model = classes.model_cls(cfg, engine.infer_config, comm_manager=engine.comm_manager)
        finally:
            torch.set_default_dtype(prev)
        full_info = full_model.get_cache_info()
        del full_model
    from model_infer_kvcache.validators.checkout_run.compat import entries_named_by_the_manifest

    full_info, renamed = entries_named_by_the_manifest(full_info, manifest)
    if renamed:
        report.notes.append(f"the model names its cache entries {renamed}: compared by width with the manifest's")
    check_cache_info(report, manifest, full_info, cache_layers, api, dtype, full_layers)
    report.notes.append(f"init link on {len(full_info.layer_infos)} layers (the real count; the stream ran "
                        f"{len(info.layer_infos)})")
    allocated = [f"{layer.layer_idx}.{e.cache_name}" for layer in info.layer_infos for e in layer.caches
                 if getattr(e, "needs_block", True) and (getattr(e, "tensor", None) is None or not e.tensor.numel())]
    report.add("allocate_cache_tensors gave every entry a tensor", "init", not allocated,
               detail=", ".join(allocated[:4]))


# Calls that only allocate: a parameter made from one of them holds nothing until the loader fills it.
_ALLOCATORS = {"empty", "zeros", "ones", "randn", "rand", "Tensor", "tensor", "empty_like", "zeros_like",
               "ones_like", "full", "new_empty", "new_zeros", "new_ones"}


def model_computed_parameters(model_file: Path) -> dict[str, str]:
    """``{attribute: "file:line"}`` for parameters the model's own code fills when it is built
    (``self.hadamard_matrix = nn.Parameter(get_had_pow2(128), requires_grad=False)``): no checkpoint carries
    them, so the loader leaving them alone is no missing weight. Read from the model folder's sources."""
    import ast

    found: dict[str, str] = {}
    for path in sorted(Path(model_file).parent.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Attribute) and isinstance(node.value, ast.Call)):
                continue
            func = node.value.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name != "Parameter" or not node.value.args or not isinstance(node.value.args[0], ast.Call):
                continue
            inner = node.value.args[0].func
            inner_name = inner.attr if isinstance(inner, ast.Attribute) else getattr(inner, "id", "")
            if inner_name not in _ALLOCATORS:
                found[node.targets[0].attr] = f"{path.name}:{node.lineno}"
    return found


def _load_link(report: Report, coverage: dict, model_file: Path) -> None:
    if coverage.get("loaded") is None:
        report.notes.append("the model's load_weights returns no loaded set: checkpoint coverage not checked")
        return
    missing = sorted(coverage["params"] - coverage["loaded"])
    computed = model_computed_parameters(model_file)
    own = [m for m in missing if m.rsplit(".", 1)[-1] in computed]
    if own:
        kinds = sorted({m.rsplit(".", 1)[-1] for m in own})
        report.notes.append(f"{len(own)} parameter(s) the model computes when it is built, not loaded: "
                            + ", ".join(f"{k} ({computed[k]})" for k in kinds))
        missing = [m for m in missing if m not in own]
    report.add("the checkout's loader filled every parameter from the checkpoint", "init", not missing,
               detail=", ".join(missing[:4]), parameters=len(coverage["params"]), missing=len(missing))


def _provenance(root: Path, commit: str | None, classes, info, scope) -> dict:
    import executor.core.kv_cache.cache_info as cache_info_mod
    from model_infer_kvcache.validators.checkout_run.engine_run import CPU_STANDINS
    from model_infer_kvcache.validators.harness.generations import detect_generation_from_classes

    api = detect_generation_from_classes(cache_info_mod.CacheEntry, cache_info_mod.ModelCacheInfo, cache_info_mod)
    from_checkout = scope.modules_from_checkout()
    return {
        "checkout": str(root),
        "commit": commit or "(not a git work tree)",
        "api_generation": api,
        "model": f"{classes.name} ({'support_models' if classes.registered else 'models/ directory'}): "
                 f"{classes.model_cls.__module__}.{classes.model_cls.__name__} + {classes.config_cls.__name__}",
        "model_file": str(classes.model_file),
        "config_class": f"{classes.config_cls.__module__}.{classes.config_cls.__name__}: the config.json is read "
                        "through the class the checkout registers (its defaults fill the fields the file lacks)",
        "from_checkout": [m for m in from_checkout if m.startswith(("executor.core", "executor.model_loader",
                                                                      "executor.utils", "models.", "module."))],
        "stand_ins": [*scope.standins, *CPU_STANDINS],
        "ours": list(OURS),
    }
