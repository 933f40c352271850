"""Wall time of `kvcache validate` per covered case and for the whole matrix, in one run.

Each case: analyze a real config -> render -> validate on the emulated backend with the full
request stream (prefill of 4 requests, >= 16 decode steps, early finish, 2 late admits, 50
sequential requests). Target: <= 20 s per case on 2 cores. Run: python benchmarks/bench_validate.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze  # noqa: E402
from model_infer_kvcache.implementer.render import render_manifest, write_rendered  # noqa: E402
from model_infer_kvcache.validators.pipeline.request_stream import DEFAULT, QUICK  # noqa: E402
from model_infer_kvcache.validators.pipeline.validate import ValidateRequest, validate  # noqa: E402

FAMILIES = {
    "qwen3": ("qwen3_8b", {}),
    "llama": ("llama31_8b", {}),
    "gpt_oss": ("gpt_oss_20b", {}),
    "mistral": ("mistral_7b_v01", {}),
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v2_lite": ("deepseek_v2_lite", {}),
    "legacy": ("qwen3_8b", {"kv_mode": "legacy"}),
}
MODES = {"G1": {"framework_api": "G1"}, "G2": {"framework_api": "G2"}, "standalone": {"deploy_mode": "standalone"}}
TARGET_S = 20.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="the shorter stream the G1/standalone tests use")
    args = p.parse_args()
    scenario = QUICK if args.quick else DEFAULT
    import transformers  # noqa: F401  (import cost is paid once, outside the per-case timings)

    rows, total0 = [], time.perf_counter()
    for family, (config, extra) in FAMILIES.items():
        for mode, flags in MODES.items():
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                m = analyze(AnalyzeRequest(config=str(ROOT / "tests/fixtures/configs" / f"{config}.json"),
                                           **extra, **flags))
                (Path(tmp) / "m.json").write_text(m.to_json())
                write_rendered(render_manifest(m, allow_blocked=True), Path(tmp) / "r")
                report = validate(ValidateRequest(manifest=f"{tmp}/m.json", rendered=f"{tmp}/r",
                                                  config=str(ROOT / "tests/fixtures/configs" / f"{config}.json"),
                                                  backend="emulated", scenario=scenario, sweep_readings=False))
                dt = time.perf_counter() - t0
            rows.append((family, mode, dt, report.passed))
            print(f"{family:18s} {mode:11s} {dt:6.1f} s  {'passed' if report.passed else 'FAILED'}"
                  f"{'' if dt <= TARGET_S else '  ABOVE TARGET'}", flush=True)
    total = time.perf_counter() - total0
    worst = max(r[2] for r in rows)
    print(f"matrix: {len(rows)} cases, {total:.1f} s total, worst {worst:.1f} s (target <= {TARGET_S:.0f} s per case)")
    return 0 if all(r[3] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
