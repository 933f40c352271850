"""Benchmark: wall time of `kvcache probe` on the CPU emulation (the dry run of the NPU probe).

Runs the whole probe (every experiment, both FA versions, both writers) ``--repeats`` times on
the emulated backend and prints the best and median wall time, plus the time per question.
On the NPU the same calls are a few tiny kernels each; the figure here bounds the Python and
emulation overhead. Run: ``python benchmarks/bench_probe.py [--repeats N] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from model_infer_kvcache.validators.probe import experiments
from model_infer_kvcache.validators.probe.device import open_device
from model_infer_kvcache.validators.probe.run import probe

STEPS = {
    "window_pre_tokens": experiments.window_experiment,
    "band_at_single_query": lambda dev: experiments.band_experiment(dev, "exclusive"),
    "null_block_contents": experiments.null_block_experiment,
    "repeated_slots": experiments.repeated_slots_experiment,
    "mla_decode_sparse_mode3": experiments.mla_experiment,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    dev = open_device("emulated", None)
    probe(dev)  # warm-up: imports, the cached 2048x2048 mask check
    totals = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        probe(dev)
        totals.append(time.perf_counter() - start)
    per_question = {}
    for name, step in STEPS.items():
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            step(dev)
            times.append(time.perf_counter() - start)
        per_question[name] = min(times)
    result = {"best_s": min(totals), "median_s": statistics.median(totals), "repeats": args.repeats,
              "per_question_best_s": per_question}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"kvcache probe (emulated): best {result['best_s']:.3f} s, median {result['median_s']:.3f} s "
              f"over {args.repeats} runs")
        for name, seconds in per_question.items():
            print(f"  {name:<26} {seconds:.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
