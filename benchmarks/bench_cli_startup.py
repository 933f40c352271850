"""Benchmark: wall time of the commands an agent calls most, side by side with the interpreter's own.

Each round runs, one after the other in fresh processes: ``python -c pass``, ``python -c "import torch"``,
``kvcache analyze`` on the bundled example with a warm cache (what transformers reports kept in
``KVCACHE_CACHE_DIR``, the repeated call of a task), the same with an empty cache (the first call after
installing, or after transformers or the config changed) and ``kvcache <command> --help`` for every
command. Rounds interleave the commands so that load on the machine hits them alike; the figures are
medians over the rounds and the ratios are taken within this one run.

Targets (issue 26): warm ``analyze`` / ``import torch`` <= 1.2 and every ``--help`` / ``pass`` <= 10.
Exit 1 when a target is missed. Run: ``python benchmarks/bench_cli_startup.py [--rounds N] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tiny_qwen3" / "config.json"
COMMANDS = ("analyze", "schema", "render", "lint", "validate", "run", "probe")
ANALYZE_TARGET = 1.2  # warm analyze / import torch
HELP_TARGET = 10.0  # --help / python -c pass


def _time(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(argv, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    py = sys.executable
    kvcache = [py, "-m", "model_infer_kvcache"]
    analyze = [*kvcache, "analyze", "--config", str(EXAMPLE), "--dispatch", "部署模式：框架部署"]
    work = Path(tempfile.mkdtemp(prefix="kvcache-bench-"))
    warm_env = {**os.environ, "KVCACHE_CACHE_DIR": str(work / "warm")}
    cases: dict[str, tuple[list[str], dict[str, str] | None]] = {
        "python -c pass": ([py, "-c", "pass"], None),
        "python -c 'import torch'": ([py, "-c", "import torch"], None),
        "kvcache analyze (warm cache)": (analyze, warm_env),
        "kvcache analyze (empty cache)": (analyze, None),
        **{f"kvcache {c} --help": ([*kvcache, c, "--help"], None) for c in COMMANDS},
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    try:
        _time(analyze, warm_env)  # fills the warm cache
        for r in range(args.rounds):
            for name, (cmd, env) in cases.items():
                if env is None:
                    env = {**os.environ, "KVCACHE_CACHE_DIR": str(work / f"empty-{r}")}
                times[name].append(_time(cmd, env))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    bare, torch_s = median["python -c pass"], median["python -c 'import torch'"]
    ratios = {"kvcache analyze (warm cache)": median["kvcache analyze (warm cache)"] / torch_s,
              "kvcache analyze (empty cache)": median["kvcache analyze (empty cache)"] / torch_s,
              **{f"kvcache {c} --help": median[f"kvcache {c} --help"] / bare for c in COMMANDS}}
    missed = [name for name, ratio in ratios.items()
              if "empty cache" not in name and ratio > (ANALYZE_TARGET if "analyze (" in name else HELP_TARGET)]
    result = {"rounds": args.rounds, "median_s": median, "min_s": {n: min(ts) for n, ts in times.items()},
              "ratios": ratios, "targets": {"analyze / import torch": ANALYZE_TARGET, "--help / pass": HELP_TARGET},
              "missed": missed}
    if args.json:
        print(json.dumps(result, indent=2, ensure_ascii=False))
    else:
        print(f"medians over {args.rounds} interleaved rounds (python {sys.version.split()[0]})")
        for name, seconds in median.items():
            ratio = ratios.get(name)
            against = "import torch" if "analyze (" in name else "pass"
            print(f"  {name:<34} {seconds * 1000:8.0f} ms" + (f"   {ratio:5.2f} x {against}" if ratio else ""))
        print("targets: warm analyze <= 1.2 x import torch, --help <= 10 x pass: "
              + ("met" if not missed else "MISSED by " + ", ".join(missed)))
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
