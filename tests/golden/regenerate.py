"""Regenerate the implementer's golden renders: `python tests/golden/regenerate.py` (from anywhere).

Each case is one fixture config analyzed with fixed flags (config path relative to the repo
root, so the manifest is the same on every machine) and rendered with the default names.
A case directory holds the manifest it was rendered from (``manifest.json``) next to the
rendered files. ``tests/test_implementer_golden.py`` re-does both steps and fails on drift.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
MANIFEST_FILE = "manifest.json"


@dataclass(frozen=True)
class Model:
    name: str
    config: str  # relative to the repo root
    flags: tuple[str, ...] = ()
    allow_blocked: bool = False


@dataclass(frozen=True)
class Case:
    model: Model
    mode: str

    @property
    def id(self) -> str:
        return f"{self.model.name}/{self.mode}"

    @property
    def dir(self) -> Path:
        return GOLDEN / self.model.name / self.mode

    @property
    def argv(self) -> list[str]:
        return ["--config", self.model.config, *self.model.flags, *MODES[self.mode]]


MODELS = (
    Model("qwen3_v1", "tests/fixtures/configs/qwen3_8b.json", ("--fa-version", "v1")),
    Model("qwen3_v2", "tests/fixtures/configs/qwen3_8b.json", ("--fa-version", "v2")),
    Model("gpt_oss", "tests/fixtures/configs/gpt_oss_20b.json"),  # sinks force v2
    Model("mistral", "tests/fixtures/configs/mistral_7b_v01.json"),
    Model("deepseek_v3", "tests/fixtures/configs/deepseek_v3.json"),
    Model("deepseek_v2_lite", "tests/fixtures/configs/deepseek_v2_lite.json"),
    Model("gemma2_legacy", "tests/fixtures/configs/gemma2_9b.json", allow_blocked=True),  # soft-capping: own attention
    Model("gemma3_legacy", "tests/fixtures/configs/gemma3_4b.json", ("--kv-mode", "legacy")),  # Legacy FA (BSH)
)
MODES = {
    "framework_g1": ("--deploy-mode", "framework", "--framework-api", "G1"),
    "framework_g2": ("--deploy-mode", "framework", "--framework-api", "G2"),
    "standalone": ("--deploy-mode", "standalone"),
}
CASES = tuple(Case(model, mode) for model in MODELS for mode in MODES)


def analyze_case(case: Case):
    """The case's manifest, analyzed from the repo root (relative paths inside the manifest)."""
    from model_infer_kvcache.analyzer.build import analyze
    from model_infer_kvcache.analyzer.cli import build_parser, request_from_args

    previous = os.getcwd()
    os.chdir(ROOT)
    try:
        return analyze(request_from_args(build_parser().parse_args(case.argv)))
    finally:
        os.chdir(previous)


def render_case(case: Case, manifest) -> dict[str, str]:
    from model_infer_kvcache.implementer.render import render_manifest

    return render_manifest(manifest, allow_blocked=case.model.allow_blocked).files


def expected_files(case: Case) -> dict[str, str]:
    """Every file of the case directory, as a fresh analyze + render produces it."""
    manifest = analyze_case(case)
    return {MANIFEST_FILE: manifest.to_json(), **render_case(case, manifest)}


def write_case(case: Case) -> list[str]:
    files = expected_files(case)
    if case.dir.exists():
        shutil.rmtree(case.dir)
    case.dir.mkdir(parents=True)
    for name, text in sorted(files.items()):
        (case.dir / name).write_text(text, encoding="utf-8", newline="\n")
    return sorted(files)


def main() -> int:
    sys.path.insert(0, str(ROOT))
    known = {case.model.name for case in CASES}
    for stale in sorted(p for p in GOLDEN.iterdir() if p.is_dir() and p.name not in known and p.name != "__pycache__"):
        shutil.rmtree(stale)
        print(f"removed stale {stale.relative_to(ROOT)}")
    for case in CASES:
        names = write_case(case)
        print(f"{case.dir.relative_to(ROOT)}: {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
