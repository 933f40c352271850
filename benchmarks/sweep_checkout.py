"""Every model of the pinned snapshot through `kvcache validate --framework-root ROOT --all`, timed in one run.

Configs: the published config.json of the model where the repository keeps one (tests/fixtures/configs, sources
in its SOURCES.md), else transformers' config class of the model's type at its defaults (what `--all` uses without
`--configs`). The validation itself is the CLI's: full engine stream, the device-reading sweep, the layout chosen
by kvcache where the model's code refuses one rank. Target: the whole snapshot in <= 20 min on 2 idle cores, no
row an internal error (exit 3).

Run: python benchmarks/sweep_checkout.py [--checkout PATH] [--markdown FILE] [--no-sweep] [--only a,b]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_checkout import default_checkout  # noqa: E402 - one home for the snapshot's default path

TARGET_S = 20 * 60
# registered model -> the published config the repository keeps for it (tests/fixtures/configs/NAME.json)
PUBLISHED = {
    "qwen3_8b": "qwen3_8b", "qwen25_7b_instruct": "qwen2_7b", "qwen3_moe": "qwen3_30b_a3b", "gpt_oss": "gpt_oss_20b",
    "deepseek_r1": "deepseek_v3", "deepseek_v2_lite": "deepseek_v2_lite", "kimi_k2": "kimi_k2",
    "gemma_4": "gemma4_26b_a4b", "bailing_2_5": "ling_2_5",
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkout", default=str(default_checkout()), help="cann-recipes-infer checkout")
    p.add_argument("--markdown", help="write the table here too")
    p.add_argument("--no-sweep", action="store_true", help="skip the device-reading sweep of each model")
    p.add_argument("--only", help="comma-separated model names (default: every model of the checkout)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvcache-sweep-configs-") as tmp:
        for name, fixture in PUBLISHED.items():
            shutil.copy(ROOT / "tests" / "fixtures" / "configs" / f"{fixture}.json", Path(tmp) / f"{name}.json")
        report = Path(tmp) / "rows.json"
        cmd = [sys.executable, "-m", "model_infer_kvcache", "validate", "--framework-root", args.checkout, "--all",
               "--configs", tmp, "--report", str(report)]
        cmd += ["--no-sweep"] if args.no_sweep else []
        cmd += ["--only", args.only] if args.only else []
        cmd += ["--markdown", str(Path(args.markdown).resolve())] if args.markdown else []
        started = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT)
        wall = time.perf_counter() - started
        rows = json.loads(report.read_text(encoding="utf-8"))
    internal = [r["model"] for r in rows if r["outcome"] == "internal"]
    print(f"\n{len(rows)} models in {wall:.0f} s (target <= {TARGET_S} s); exit {done.returncode}; "
          f"internal errors: {', '.join(internal) or 'none'}")
    return 1 if internal or wall > TARGET_S else 0


if __name__ == "__main__":
    sys.exit(main())
