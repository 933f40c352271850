"""Shared helpers for the end-to-end validation tests: analyze -> render -> (mutate) -> validate."""

from __future__ import annotations

import json
import re
from pathlib import Path

from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.implementer.render import render_manifest, write_rendered
from model_infer_kvcache.validators.pipeline.request_stream import DEFAULT, QUICK, Scenario
from model_infer_kvcache.validators.pipeline.validate import ValidateRequest, validate

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "tests" / "fixtures" / "configs"


def render_case(tmp: Path, config: str, overrides: dict | None = None, config_path: str | None = None,
                **analyze_kw) -> tuple[Path, Path, Path]:
    """(manifest, rendered dir, config path) for a fixture config (or the file ``config_path``; ``overrides``: fields
    replaced, written beside the run) and analyzer options."""
    config_path = Path(config_path) if config_path else CONFIGS / f"{config}.json"
    if overrides:
        data = {**json.loads(config_path.read_text(encoding="utf-8")), **overrides}
        config_path = tmp / f"{config_path.stem}.json"
        config_path.write_text(json.dumps(data), encoding="utf-8")
    manifest = analyze(AnalyzeRequest(config=str(config_path), **analyze_kw))
    manifest_path = tmp / "manifest.json"
    manifest_path.write_text(manifest.to_json(), encoding="utf-8")
    rendered = tmp / "rendered"
    write_rendered(render_manifest(manifest, allow_blocked=True), rendered)
    return manifest_path, rendered, config_path


def mutate(rendered: Path, pattern: str, replacement: str, count: int = 0,
           name: str = "kvcache_attention.py") -> None:
    """Break a rendered file on purpose (negative controls); the pattern must be found."""
    path = rendered / name
    text = path.read_text(encoding="utf-8")
    new, n = re.subn(pattern, replacement, text, count=count)
    assert n, f"mutation pattern {pattern!r} not found in {path}"
    path.write_text(new, encoding="utf-8")


def run_validate(manifest: Path, rendered: Path, config: Path, scenario: Scenario = QUICK,
                 sweep: bool = False):
    return validate(ValidateRequest(manifest=str(manifest), rendered=str(rendered), config=str(config),
                                    backend="emulated", scenario=scenario, sweep_readings=sweep))


def mistaken_report(case: tuple[Path, Path, Path], pattern: str, replacement: str, scenario: Scenario = QUICK,
                    name: str = "kvcache_attention.py"):
    """The report of ``case``'s render (render_case's paths) with one mistake written in, which must fail it. The
    sub-module localisation's replay is skipped: the check that fails is the point (tests/test_localisation.py
    covers the replay). Where the pipeline plans a CPU-size run of the implementer's own render before the given
    render's 'as written' run, that first run is skipped too: it re-renders the manifest, so the mistake written
    into ``rendered`` never reaches it (the mistake tests assert on 'as written: ...' checks there)."""
    from unittest import mock

    from model_infer_kvcache.validators.pipeline import validate as pipeline

    plan_runs = pipeline._plan_runs

    def as_written_only(*args, **kwargs):
        runs = plan_runs(*args, **kwargs)
        return runs[1:] if len(runs) > 1 else runs

    manifest, rendered, config = case
    mutate(rendered, pattern, replacement, name=name)
    with mock.patch.object(pipeline, "_localise", lambda *args, **kwargs: None), \
            mock.patch.object(pipeline, "_plan_runs", as_written_only):
        report = run_validate(manifest, rendered, config, scenario=scenario)
    assert not report.passed
    return report


def check(report, name_prefix: str):
    matches = [c for c in report.checks if c.name.startswith(name_prefix)]
    assert matches, f"no check named {name_prefix!r} in {[c.name for c in report.checks]}"
    return matches[0]


__all__ = ["DEFAULT", "QUICK", "check", "mistaken_report", "mutate", "render_case", "run_validate"]
