"""Suite-wide settings. Under pytest-xdist (``-n 2``, pyproject's addopts) each worker computes on one thread:
two workers on two cores then share the machine instead of oversubscribing it. The processes a test starts
(``kvcache run``, a checkout's ranks) inherit one thread through OMP_NUM_THREADS: with torch's default of one thread
per core, a child beside the other worker spins at OpenMP barriers on a shared core, measured 5 s -> 30-40 s for the
README's ``kvcache run`` (benchmarks/bench_threads.py)."""

from __future__ import annotations

import os

# glibc's malloc gives a freed tensor's pages back to the kernel (the heap's top by trimming, a large block by munmap)
# and the next forward faults them in again, zeroed: a third of a DeepSeek-V4 test's CPU time was that system time
# (tests/test_v4_mtp.py framework-None, one process: user 22.8 s + sys 9.8 s; with these, 22.0 s + 3.7 s, peak RSS
# 1.55 -> 1.67 GB). Freed memory stays in the process: a fixed mmap threshold (32 MiB, the most glibc takes), no
# trimming, the heap grown 256 MiB at a time. glibc reads them when a process starts: set here, before pytest-xdist
# starts its workers, they reach the workers and every process a test starts; a variable already set is kept.
MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(4 << 30),
          "MALLOC_TOP_PAD_": str(256 << 20)}
for _name, _value in MALLOC.items():
    os.environ.setdefault(_name, _value)

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
