"""Benchmark: the README's ``kvcache run`` on a machine whose other core is busy, with torch's default intra-op
threads (one per core) and with one thread.

Why: the suite runs on two xdist workers over two cores, and ``benchmarks/sweep_families.py --jobs 2`` runs two
``kvcache run`` at once. A process with two OpenMP threads beside a busy core spins at every barrier of the tiny
ops the CPU validation is made of, and its time grows several-fold; one thread does not. ``tests/conftest.py`` and
``sweep_families.py`` therefore hand their children ``OMP_NUM_THREADS`` (one thread per worker / per job).

Each round runs, in fresh processes beside one busy-looping process: ``kvcache run`` with OMP_NUM_THREADS=1, then
with OMP_NUM_THREADS=<cores>. The figures are medians over the rounds; the ratio is taken within this one run.
Target: one thread no slower than the default (ratio default / one >= 1.0); exit 1 when missed.
Run: ``python benchmarks/bench_threads.py [--rounds N] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = 1.0


def _busy(stop) -> None:  # the other worker of the suite: one core kept busy
    while not stop.is_set():
        sum(range(10_000))


def _run(threads: int) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with tempfile.TemporaryDirectory(prefix="kvcache-bench-threads-") as tmp:
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "model_infer_kvcache", "run"], cwd=tmp, env=env,
                              capture_output=True, text=True)
        elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"kvcache run (OMP_NUM_THREADS={threads}) exited {proc.returncode}: {proc.stderr[-300:]}")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    cores = os.cpu_count() or 1
    stop = multiprocessing.Event()
    busy = multiprocessing.Process(target=_busy, args=(stop,), daemon=True)
    busy.start()
    try:
        times: dict[int, list[float]] = {1: [], cores: []}
        for _ in range(args.rounds):
            for threads in times:
                times[threads].append(_run(threads))
    finally:
        stop.set()
        busy.join()
    one, default = statistics.median(times[1]), statistics.median(times[cores])
    result = {"cores": cores, "one_thread_s": round(one, 2), "default_threads_s": round(default, 2),
              "ratio_default_over_one": round(default / one, 2), "target": TARGET, "rounds": args.rounds}
    print(json.dumps(result) if args.json else
          f"kvcache run beside a busy core: 1 thread {one:.1f} s, {cores} threads {default:.1f} s "
          f"(ratio {default / one:.2f}, target >= {TARGET})")
    return 0 if default / one >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
