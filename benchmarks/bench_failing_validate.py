"""Time to a failing verdict / time of the clean run, for wrong renders (paged and Legacy, both modes).

The mistakes are tests/wrong_renders.py's (Mistral-7B, window 4096): each is validated as `kvcache validate`
would (emulated backend, default stream, reading sweep on), next to the clean render of the same mode,
in one run. Goal: ratio <= 2. Run: python benchmarks/bench_failing_validate.py
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze  # noqa: E402
from model_infer_kvcache.implementer.render import render_manifest, write_rendered  # noqa: E402
from model_infer_kvcache.validators.pipeline.validate import ValidateRequest, validate  # noqa: E402
from wrong_renders import CLEAN, CONFIG, MISTAKES, clean_case  # noqa: E402

GOAL = 2.0
CONFIG_PATH = ROOT / "tests" / "fixtures" / "configs" / f"{CONFIG}.json"


def _validate(flags: dict, mistake: tuple[str, str, str] | None) -> tuple[float, bool]:
    with tempfile.TemporaryDirectory() as tmp:
        manifest = analyze(AnalyzeRequest(config=str(CONFIG_PATH), **flags))
        (Path(tmp) / "m.json").write_text(manifest.to_json(), encoding="utf-8")
        rendered = Path(tmp) / "r"
        write_rendered(render_manifest(manifest, allow_blocked=True), rendered)
        if mistake is not None:
            name, pattern, replacement = mistake
            path = rendered / name
            path.write_text(re.sub(pattern, replacement, path.read_text(encoding="utf-8"), count=1), encoding="utf-8")
        started = time.perf_counter()
        report = validate(ValidateRequest(manifest=f"{tmp}/m.json", rendered=str(rendered), config=str(CONFIG_PATH),
                                          backend="emulated"))
        return time.perf_counter() - started, report.passed


def main() -> int:
    import transformers  # noqa: F401  (paid once, outside the timings)

    _validate(CLEAN["paged-framework"], None)  # warm-up: first-use costs out of the first row
    clean = {}
    for name, flags in CLEAN.items():
        clean[name], passed = _validate(flags, None)
        print(f"{'clean ' + name:48s} {clean[name]:6.1f} s  {'passed' if passed else 'FAILED (unexpected)'}",
              flush=True)
    worst = 0.0
    for case, flags, file, pattern, replacement, _ in MISTAKES:
        seconds, passed = _validate(flags, (file, pattern, replacement))
        ratio = seconds / clean[clean_case(flags)]
        worst = max(worst, ratio)
        print(f"{case:48s} {seconds:6.1f} s  ratio {ratio:4.2f}  {'PASSED (unexpected)' if passed else 'failed'}"
              f"{'' if ratio <= GOAL else '  ABOVE GOAL'}", flush=True)
    print(f"worst ratio {worst:.2f} (goal <= {GOAL:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
