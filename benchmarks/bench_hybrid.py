"""Wall time of hybrid linear-attention validation per model and mode, in one run.

Rendered: the fixture configs (Qwen3-Next as published; Qwen3.5-MoE as transformers' Qwen3_5MoeConfig defaults)
-> analyze -> render -> `kvcache validate` as the CLI runs it (the full request stream, the reading sweep),
framework and standalone mode. The tiny model keeps the published linear sizes (16 key / 32 value heads of 128:
npu_chunk_gated_delta_rule takes head dims of 128 only), so each step runs 32 value heads of 128 x 128 states.
Target on 2 idle cores: <= 60 s per deployment mode (issue #25).

Run: python benchmarks/bench_hybrid.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_checkout import cpu_seconds  # noqa: E402

TARGET_S = 60.0  # per deployment mode
CONFIGS = {"qwen3_next": ROOT / "tests" / "fixtures" / "configs" / "qwen3_next.json",
           "qwen3_5_moe": ROOT / "tests" / "fixtures" / "configs" / "qwen3_5_moe.json"}
MODES = ("framework", "standalone")


def rendered_case(config: Path, mode: str, tmp: Path):
    from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
    from model_infer_kvcache.implementer.render import render_manifest, write_rendered
    from model_infer_kvcache.validators.pipeline.validate import ValidateRequest, validate

    m = analyze(AnalyzeRequest(config=str(config), deploy_mode=mode))
    (tmp / "m.json").write_text(m.to_json())
    write_rendered(render_manifest(m), tmp / "r")
    return validate(ValidateRequest(manifest=str(tmp / "m.json"), rendered=str(tmp / "r"), config=str(config),
                                    backend="emulated"))


def _max_diff(report) -> str:
    values = [c.measured.get("max_abs_diff") for c in report.checks if c.id == "V301"]
    return f"{values[0]:.2g}" if values and values[0] is not None else "-"


def main() -> int:
    import transformers  # noqa: F401  (import cost is paid once, outside the per-case timings)

    rows = []
    for model, config in CONFIGS.items():
        for mode in MODES:
            with tempfile.TemporaryDirectory() as tmp:
                t0, c0 = time.perf_counter(), cpu_seconds()
                report = rendered_case(config, mode, Path(tmp))
                dt, cpu = time.perf_counter() - t0, cpu_seconds() - c0
            rows.append((f"{model} {mode}", dt, cpu, report.passed, _max_diff(report)))
            print(f"{rows[-1][0]:28s} {dt:6.1f} s (CPU {cpu:6.1f} s)  {'passed' if report.passed else 'FAILED'}"
                  f"  max |diff| {rows[-1][4]}{'' if dt <= TARGET_S else '  ABOVE TARGET'}", flush=True)
    print()
    print("| case | wall (s) | CPU (s) | max abs diff | result | target (s) |")
    print("|---|---|---|---|---|---|")
    for name, dt, cpu, ok, diff in rows:
        print(f"| {name} | {dt:.1f} | {cpu:.1f} | {diff} | {'passed' if ok else 'FAILED'} | {TARGET_S:.0f} |")
    return 0 if all(r[3] and r[1] <= TARGET_S for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
