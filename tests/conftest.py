"""Suite-wide settings. Under pytest-xdist (``-n 2``, pyproject's addopts) each worker computes on one thread:
two workers on two cores then share the machine instead of oversubscribing it."""

from __future__ import annotations

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    torch.set_num_threads(1)
