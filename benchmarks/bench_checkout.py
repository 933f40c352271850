"""Wall time of checkout-mode validation per model, in one run.

Each model: `kvcache validate --framework-root CHECKOUT --model NAME --config CONFIG` as the CLI runs
it (analyze on the fly, tiny checkpoint, the checkout's engine over the full engine stream with the
sequential-release tail, numeric comparison with transformers, the device-reading sweep where the
manifest depends on a reading). Target: <= 90 s per model on 2 cores.

Run: python benchmarks/bench_checkout.py [--checkout PATH] [--models qwen3_8b,gpt_oss]
(CHECKOUT defaults to $KVCACHE_SHARED/upstream/cann-recipes-infer, else ../shared/upstream/...)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from validators.checkout_run import CheckoutRequest, validate_checkout  # noqa: E402

# registered model -> the real config its tiny model is built from (tests/fixtures/configs)
MODELS = {
    "qwen3_8b": "qwen3_8b",
    "qwen25_7b_instruct": "qwen2_7b",
    "qwen3_moe": "qwen3_30b_a3b",
    "gpt_oss": "gpt_oss_20b",
    "deepseek_r1": "deepseek_v3",
}
TARGET_S = 90.0


def default_checkout() -> Path:
    shared = Path(os.environ.get("KVCACHE_SHARED") or ROOT.parent / "shared")
    return shared / "upstream" / "cann-recipes-infer"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkout", default=str(default_checkout()), help="cann-recipes-infer checkout")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated registered names")
    args = p.parse_args()
    checkout = Path(args.checkout)
    if not (checkout / "executor" / "core" / "support_models.py").is_file():
        print(f"--checkout: {checkout} is not a cann-recipes-infer checkout", file=sys.stderr)
        return 2
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        print(f"--models: {', '.join(unknown)} not benchmarked (known: {', '.join(MODELS)})", file=sys.stderr)
        return 2
    import transformers  # noqa: F401  (import cost is paid once, outside the per-model timings)

    rows = []
    for name in names:
        config = ROOT / "tests" / "fixtures" / "configs" / f"{MODELS[name]}.json"
        t0 = time.perf_counter()
        report = validate_checkout(CheckoutRequest(framework_root=str(checkout), model=name, config=str(config)))
        dt = time.perf_counter() - t0
        failed = report.failed()
        verdict = "passed" if report.passed else f"FAILED: {failed[0].name} ({failed[0].detail[:80]})"
        rows.append((name, dt, report.passed))
        print(f"{name:20s} {dt:6.1f} s  {verdict}{'' if dt <= TARGET_S else '  ABOVE TARGET'}", flush=True)
    print()
    print("| model | config | wall (s) | result |")
    print("|---|---|---|---|")
    for name, dt, ok in rows:
        print(f"| `{name}` | {MODELS[name]} | {dt:.1f} | {'passed' if ok else 'failed'} |")
    worst = max(r[1] for r in rows)
    print(f"\n{len(rows)} models, {sum(r[1] for r in rows):.1f} s total, worst {worst:.1f} s "
          f"(target <= {TARGET_S:.0f} s per model)")
    return 0 if all(r[2] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
