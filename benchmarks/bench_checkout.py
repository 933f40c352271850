"""Wall time of checkout-mode validation per model, in one run.

Each model: `kvcache validate --framework-root CHECKOUT --model NAME --config CONFIG` as the CLI runs
it (analyze on the fly, tiny checkpoint, the checkout's engine over the full engine stream with the
sequential-release tail, numeric comparison with transformers, the device-reading sweep over the
manifest's dependencies and the operator questions the run consulted). Target: <= 90 s per model on 2 cores.

Run: python benchmarks/bench_checkout.py [--checkout PATH] [--models qwen3_8b,gpt_oss]
(CHECKOUT defaults to $KVCACHE_SHARED/upstream/cann-recipes-infer, else ../shared/upstream/...)
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from model_infer_kvcache.validators.checkout_run import CheckoutRequest, validate_checkout  # noqa: E402

# registered model -> (the real config its tiny model is built from (tests/fixtures/configs), attention TP).
# Qwen3-MoE and DeepSeek at one rank take their expert-parallel paths, which need an EP group the models
# register only for EP > 1: they run at TP 2, as the tests run them.
MODELS = {
    "qwen3_8b": ("qwen3_8b", None),
    "qwen3_8b@tp2": ("qwen3_8b", 2),
    "qwen25_7b_instruct": ("qwen2_7b", None),
    "qwen3_moe@tp2": ("qwen3_30b_a3b", 2),
    "gpt_oss": ("gpt_oss_20b", None),
    "deepseek_r1@tp2": ("deepseek_v3", 2),
    # the newer folders (issue 23): transformers' own config class at its defaults, written to a config.json
    "longcat_flash": ("transformers:LongcatFlashConfig", None),
    "kimi_k2_thinking@tp2": ("transformers:DeepseekV3Config", 2),  # as shipped; decode rests on mla_decode_sparse_mode3
    "hy3": ("transformers:HYV3Config", None),  # with token ids (the class defaults carry none)
    "gemma_4": ("gemma4_26b_a4b", None),  # the folder's gemma-4-26B-A4B; --uniform-prefill (UNIFORM_PREFILL)
    "deepseek_v3_2_exp@tp2": ("transformers:DeepseekV32Config", 2),  # DSA: index_topk narrowed to 64 on CPU
    "qwen3.5@tp2": ("transformers:Qwen3_5MoeTextConfig", 2),  # Legacy (owns its caches); --uniform-prefill
}
# models whose own code refuses a prefill batch of unequal prompts: run as `validate --uniform-prefill`
UNIFORM_PREFILL = {"gemma_4", "qwen3.5@tp2"}
# fields a saved config.json carries that a class's defaults leave out
OVERRIDES = {"HYV3Config": {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}}


def config_path(config: str, tmp: Path) -> Path:
    """A fixture config.json, or ``transformers:CLASS``: that class's defaults written to ``tmp``."""
    if not config.startswith("transformers:"):
        return ROOT / "tests" / "fixtures" / "configs" / f"{config}.json"
    import json

    import transformers

    name = config.split(":", 1)[1]
    path = tmp / f"{name}.json"
    path.write_text(json.dumps({**getattr(transformers, name)().to_dict(), **OVERRIDES.get(name, {})}, default=str))
    return path
TARGET_S = 90.0


def cpu_seconds() -> float:
    """User + system CPU of this process and its reaped children (the TP ranks): on a shared machine the
    wall time grows with the load, the CPU time does not."""
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


def default_checkout() -> Path:
    shared = Path(os.environ.get("KVCACHE_SHARED") or ROOT.parent / "shared")
    return shared / "upstream" / "cann-recipes-infer"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkout", default=str(default_checkout()), help="cann-recipes-infer checkout")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated names of MODELS (NAME@tp2: at TP 2)")
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
    import tempfile

    import transformers  # noqa: F401  (import cost is paid once, outside the per-model timings)

    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="bench-checkout-"))
    for name in names:
        config, tp = MODELS[name]
        path = config_path(config, tmp)
        t0, c0 = time.perf_counter(), cpu_seconds()
        report = validate_checkout(CheckoutRequest(
            framework_root=str(checkout), model=name.split("@")[0], config=str(path), attn_tp_size=tp,
            uniform_prefill=name in UNIFORM_PREFILL))
        dt, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        failed = report.failed()
        verdict = "passed" if report.passed else f"FAILED: {failed[0].name} ({failed[0].detail[:80]})"
        rows.append((name, dt, cpu, report.passed, [n for n in report.notes if "reading" in n]))
        print(f"{name:20s} {dt:6.1f} s (CPU {cpu:6.1f} s)  {verdict}{'' if dt <= TARGET_S else '  ABOVE TARGET'}", flush=True)
    print()
    print("| model | config | attention TP | wall (s) | CPU (s) | result |")
    print("|---|---|---|---|---|---|")
    for name, dt, cpu, ok, reading in rows:
        config, tp = MODELS[name]
        result = "passed" if ok else "failed" + (f" ({reading[0][:120]})" if reading else "")
        print(f"| `{name.split('@')[0]}` | {config} | {tp or 1} | {dt:.1f} | {cpu:.1f} | {result} |")
    worst = max(r[1] for r in rows)
    print(f"\n{len(rows)} models, {sum(r[1] for r in rows):.1f} s total, worst {worst:.1f} s "
          f"(target <= {TARGET_S:.0f} s per model)")
    return 0 if all(r[3] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
