"""Wall time of DeepSeek sparse attention (DSA) validation per family and mode, in one run.

Rendered: transformers' own config class at its defaults (DeepSeek-V3.2 with its published MTP layer,
GLM-5) -> analyze -> render -> `kvcache validate` as the CLI runs it (index_topk narrowed to 64 so the
selection drops keys, the full request stream, the reading sweep), framework and standalone mode.
Checkout: `kvcache validate --framework-root CHECKOUT --model deepseek_v3_2_exp --attn-tp-size 2` on
DeepseekV32Config() defaults (the model registers its MoE expert-parallel group only with two ranks).
Targets on 2 idle cores: <= 60 s per deployment mode (rendered); the checkout run keeps the checkout
benchmark's <= 90 s (bench_checkout.py: it includes the engine's reading sweep over both ranks).

Run: python benchmarks/bench_dsa.py [--checkout PATH] [--skip-checkout]
(CHECKOUT defaults to $KVCACHE_SHARED/upstream/cann-recipes-infer, else ../shared/upstream/...)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_checkout import cpu_seconds, default_checkout  # noqa: E402

TARGET_S = 60.0  # per deployment mode (rendered)
CHECKOUT_TARGET_S = 90.0  # bench_checkout.py's
FAMILIES = {"deepseek_v32": {"num_nextn_predict_layers": 1}, "glm_moe_dsa": {}}
MODES = ("framework", "standalone")


def _config(tmp: Path, family: str, changes: dict) -> Path:
    import transformers

    path = tmp / f"{family}.json"
    path.write_text(json.dumps({**transformers.AutoConfig.for_model(family).to_dict(), **changes}, default=str))
    return path


def rendered_case(family: str, mode: str, tmp: Path):
    from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
    from model_infer_kvcache.implementer.render import render_manifest, write_rendered
    from model_infer_kvcache.validators.pipeline.validate import ValidateRequest, validate

    config = _config(tmp, family, FAMILIES[family])
    m = analyze(AnalyzeRequest(config=str(config), deploy_mode=mode))
    (tmp / "m.json").write_text(m.to_json())
    write_rendered(render_manifest(m), tmp / "r")
    return validate(ValidateRequest(manifest=str(tmp / "m.json"), rendered=str(tmp / "r"), config=str(config),
                                    backend="emulated"))


def checkout_case(checkout: Path, tmp: Path):
    from model_infer_kvcache.validators.checkout_run import CheckoutRequest, validate_checkout

    config = _config(tmp, "deepseek_v32", {})
    return validate_checkout(CheckoutRequest(framework_root=str(checkout), model="deepseek_v3_2_exp",
                                             config=str(config), attn_tp_size=2))


def _dropped(report) -> str:
    values = [c.measured.get("keys_dropped") for c in report.checks if c.id == "V222"]
    return f"{values[0]:.1%}" if values and values[0] is not None else "-"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkout", default=str(default_checkout()), help="cann-recipes-infer checkout")
    p.add_argument("--skip-checkout", action="store_true", help="rendered cases only")
    args = p.parse_args()
    cases = [(f"{family} {mode}", lambda tmp, f=family, m=mode: rendered_case(f, m, tmp))
             for family in FAMILIES for mode in MODES]
    if not args.skip_checkout:
        checkout = Path(args.checkout)
        if not (checkout / "executor" / "core" / "support_models.py").is_file():
            print(f"--checkout: {checkout} is not a cann-recipes-infer checkout", file=sys.stderr)
            return 2
        cases.append(("deepseek_v3_2_exp checkout (TP 2)", lambda tmp: checkout_case(checkout, tmp)))
    import transformers  # noqa: F401  (import cost is paid once, outside the per-case timings)

    rows = []
    for name, run in cases:
        target = CHECKOUT_TARGET_S if "checkout" in name else TARGET_S
        with tempfile.TemporaryDirectory() as tmp:
            t0, c0 = time.perf_counter(), cpu_seconds()
            report = run(Path(tmp))
            dt, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        rows.append((name, dt, cpu, report.passed, _dropped(report), target))
        print(f"{name:36s} {dt:6.1f} s (CPU {cpu:6.1f} s)  {'passed' if report.passed else 'FAILED'}"
              f"  keys dropped {rows[-1][4]}{'' if dt <= target else '  ABOVE TARGET'}", flush=True)
    print()
    print("| case | wall (s) | CPU (s) | keys dropped | result | target (s) |")
    print("|---|---|---|---|---|---|")
    for name, dt, cpu, ok, dropped, target in rows:
        print(f"| {name} | {dt:.1f} | {cpu:.1f} | {dropped} | {'passed' if ok else 'FAILED'} | {target:.0f} |")
    return 0 if all(r[3] and r[1] <= r[5] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
