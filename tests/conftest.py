"""Suite-wide settings. Under pytest-xdist (``-n 2``, pyproject's addopts) each worker computes on one thread:
two workers on two cores then share the machine instead of oversubscribing it. The processes a test starts
(``kvcache run``, a checkout's ranks) inherit one thread through OMP_NUM_THREADS: with torch's default of one thread
per core, a child beside the other worker spins at OpenMP barriers on a shared core, measured 5 s -> 30-40 s for the
README's ``kvcache run`` (benchmarks/bench_threads.py)."""

from __future__ import annotations

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
