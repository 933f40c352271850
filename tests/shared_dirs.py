"""Where the tests find `../shared/` (the pinned upstream snapshot and the torch-npu 2.9.0 files).

One environment variable, ``KVCACHE_SHARED``, names the folder; `.ci/run` sets it when
``../shared`` exists next to the project root. Without it the folder next to the root is used
when present. Tests that need a part of it skip with a reason naming the missing path.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENV = "KVCACHE_SHARED"


def shared_root() -> Path | None:
    """The shared folder, or None when neither $KVCACHE_SHARED nor ../shared exists."""
    named = os.environ.get(ENV)
    if named:
        path = Path(named)
        return path if path.is_dir() else None
    beside = ROOT.parent / "shared"
    return beside if beside.is_dir() else None


def shared_path(*parts: str) -> Path:
    """A path inside the shared folder; skips the calling test (with the reason) when absent."""
    root = shared_root()
    if root is None:
        named = os.environ.get(ENV)
        pytest.skip(f"{ENV}={named} is not a folder" if named
                    else f"{ENV} is not set and {ROOT.parent / 'shared'} does not exist")
    path = root.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} does not exist")
    return path


def upstream_head() -> Path:
    """HEAD snapshot of cann-recipes-infer (executor/, module/, models/)."""
    return shared_path("upstream", "cann-recipes-infer")


def upstream_history(commit: str) -> Path:
    """Root holding `executor/` of an older upstream commit (f0b0fde, 2c2336a, 48a59dc)."""
    return shared_path("upstream", "history", commit)


def torch_npu_files() -> Path:
    """The torch-npu 2.9.0 wheel files (schema yaml, op docs, meta registrations)."""
    return shared_path("torch_npu-2.9.0", "torch_npu")
