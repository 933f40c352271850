"""`kvcache validate --runner-root FOLDER`: a standalone folder's own runner, unmodified, judged on CPU.

No transformers class is needed: the numeric link is the recompute oracle (the folder's own model and weights,
each prefix computed from scratch). See ``drive`` for what runs and what is replaced, ``checks`` for the links.
"""

from __future__ import annotations

import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.validators.pipeline.precision import TOLERANCE
from model_infer_kvcache.validators.pipeline.report import Report
from model_infer_kvcache.validators.runner_run import checks, serving
from model_infer_kvcache.validators.runner_run.drive import Drive, Scenario, drive_runner, runner_scope
from model_infer_kvcache.validators.runner_run.folder import discover

DTYPE = "float32"


@dataclass(frozen=True)
class RunnerRequest:
    runner_root: str  # models/<name> of a standalone folder
    runner_file: str | None = None  # an edited copy standing in for the folder's runner_*.py
    config: str | None = None  # the model's config.json, read through the folder's config class (default: its defaults)
    yaml: str | None = None
    scenario: Scenario = Scenario()


def _frame(exc: BaseException, folder: Path) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    inside = [f for f in frames if str(Path(f.filename).resolve()).startswith(str(folder))]
    f = (inside or frames or [None])[-1]
    return f"{Path(f.filename).name}:{f.lineno}" if f else "?"


def validate_runner(req: RunnerRequest, progress=None) -> Report:
    say = progress or (lambda msg: None)
    started = time.perf_counter()
    sf = discover(req.runner_root, req.runner_file, req.yaml)
    if req.config and not Path(req.config).is_file():
        raise InputError(req.config, "does not exist", field="--config")
    report = Report(backend="emulated", deploy_mode="standalone", model_type=sf.config_class, manifest_hash="-",
                    dtype=DTYPE, tolerance=TOLERANCE[DTYPE])
    drive = Drive()
    say(f"driving {sf.runner_class} ({sf.runner_file}) on CPU")
    with tempfile.TemporaryDirectory(prefix="kvcache-runner-") as tmp, runner_scope(sf, drive):
        try:
            runner, module = drive_runner(sf, req.scenario, Path(tmp), req.config, drive)
        except InputError:
            raise
        except Exception as exc:  # the runner or its model rejected a step: a finding, in one line
            from model_infer_kvcache.validators.checkout_run.support import (
                missing_config_field,
                unsupported_operator,
            )

            where = _frame(exc, sf.folder)
            lacking = unsupported_operator(exc, where, sf.root) or missing_config_field(exc, req.config or
                                                                                         str(sf.config_file), where)
            if lacking is not None:
                raise lacking from None
            report.add("runner's own prefill and decode run without errors", "runtime", False,
                       detail=f"{where}: {type(exc).__name__}: {exc}")
            if drive.serving and (drive.steps or drive.warm_steps):  # what the steps before the failure fed
                serving.check_rows(report, drive, serving.read_requests(drive))
            elif not drive.serving and any(not s.is_prefill for s in drive.steps):  # where the decodes before it wrote
                checks.check_writes(report, drive)
            _describe(report, sf, drive, started)
            return report
        report.add("runner's own prefill and decode run without errors", "runtime", True, steps=len(drive.steps),
                   warm_up_steps=len(drive.warm_steps))
        if drive.serving:
            longest = max(len(p) + b for p, b in zip(drive.prompts, drive.budgets, strict=True))
            checks.check_init(report, drive, longest)
            reading = serving.read_requests(drive)
            serving.check_rows(report, drive, reading)
            serving.check_slots(report, drive, reading, sorted(drive.write_sites))
            say("recompute oracle: every request's prefix through a fresh prefill")
            oracle = serving.recompute(runner, drive, reading)
        else:
            checks.check_init(report, drive, req.scenario.input_max_len + req.scenario.max_new_tokens)
            checks.check_writes(report, drive)
            say("recompute oracle: every prefix through a fresh prefill")
            oracle = checks.recompute(runner, module, drive)
        checks.check_recompute(report, drive, oracle, report.tolerance)
        checks.check_allocated_once(report, drive)
    _describe(report, sf, drive, started)
    return report


def _describe(report: Report, sf, drive: Drive, started: float) -> None:
    lengths = ", ".join(str(len(p)) for p in drive.prompts)
    entry = sf.entry_script.name if sf.entry_script else "its entry script"
    if drive.serving:
        budgets = ", ".join(str(b) for b in drive.budgets)
        shape = [f"standalone runner {sf.runner_class} ({sf.runner_file.name}) driven as {entry} drives it, serving "
                 f"{len(drive.prompts)} requests ({lengths} prompt tokens; {budgets} new tokens each) over its "
                 f"{drive.rows} cache rows: {len(drive.steps)} steps; requests finish early and waiting ones are "
                 "admitted into the freed rows",
                 "which request each row serves is kvcache's reading (a prefill's packed prompts matched to the "
                 "prompts, a decode row's token to its request), not the runner's bookkeeping"]
    else:
        shape = [f"standalone runner {sf.runner_class} ({sf.runner_file.name}) driven as {entry} drives it: one batch "
                 f"of {len(drive.prompts)} prompts ({lengths} tokens, padded by the runner), {len(drive.steps)} steps "
                 "(prefill + decodes)",
                 "the runner serves one static batch per model_generate: no request finishes early or is admitted "
                 "late, so reuse is judged across its two model_generate calls on the same caches (warm-up, then the "
                 "run)"]
    report.notes += [
        *shape,
        "oracle: recompute (the folder's own model and weights, each row's whole prefix in a fresh prefill; no "
        "transformers class is needed): it catches what the cache and the runner's bookkeeping do wrong, not an "
        "error the prefill and the decode path share",
        *[f"driven: {d}" for d in drive.driven],
    ]
    report.provenance = {"runner_root": str(sf.folder), "runner_file": str(sf.runner_file),
                         "runner_class": sf.runner_class, "model_class": sf.model_class,
                         "config_class": f"{sf.config_file.name}: {sf.config_class}",
                         "yaml": f"{sf.yaml} ({sf.yaml_reason})", "replaced": drive.replaced}
    report.seconds = time.perf_counter() - started
