"""Which torch-npu release a source file is judged against (KV103: keywords an operator schema has).

Upstream model folders target different torch-npu releases (their README / requirements name one:
2.7.1.post5, 2.8.0.post4, 2.11.0rc1, ...), and a keyword can be valid in one release and unknown in
another. The target is the first ``torch_npu`` 2.x release named by a ``README.md`` or
``requirements*.txt`` in the file's folder or a folder above it (up to the checkout root: the folder
holding ``executor/``); it is judged against the newest committed schema release not newer than it, or
the oldest committed one when the target is older than all. A file whose folders name no release is
judged against the newest committed release (only a keyword no known release has is then reported).
``--torch-npu`` on the command line overrides the search.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import cache

from model_infer_kvcache.analyzer.operators.schemas import RELEASES

# `torch_npu-2.8.0.post4-cp311...whl`, `torch_npu==2.9.0`, `torch-npu 2.11.0rc1`; Ascend's own product
# numbering (`torch_npu v26.0.0`) is not a torch-npu release and is not read.
_NAMED = re.compile(r"torch[_-]npu\s*(?:==|>=|-|\s|版本为\s*`?)\s*`?(2\.\d+(?:\.\d+)?(?:\.post\d+|rc\d+)?)",
                    re.IGNORECASE)
_MAX_UP = 6
_README_BYTES = 1 << 20


@dataclass(frozen=True)
class Target:
    release: str  # the committed schema release the file is judged against
    why: str  # where that choice came from, for the finding's message


def version_key(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def nearest_committed(named: str) -> str:
    """The newest committed release not newer than ``named`` (by major.minor.patch), else the oldest."""
    key = version_key(named)
    older = [r for r in RELEASES if version_key(r) <= key]
    return max(older, key=version_key) if older else min(RELEASES, key=version_key)


def newest_committed() -> str:
    return max(RELEASES, key=version_key)


def chosen(release: str | None) -> Target | None:
    """The explicit ``--torch-npu`` choice, or None when not given. Raises ValueError for an unknown one."""
    if release is None:
        return None
    if release not in RELEASES:
        raise ValueError(f"no committed schemas for torch-npu {release!r}; known: {', '.join(RELEASES)}")
    return Target(release, "--torch-npu")


def target_for(path: str) -> Target:
    folder = os.path.dirname(os.path.abspath(path))
    for _ in range(_MAX_UP):
        found = _named_in(folder)
        if found is not None:
            named, source = found
            committed = nearest_committed(named)
            return Target(committed, f"{source} targets torch_npu {named}")
        if os.path.isdir(os.path.join(folder, "executor")):
            break  # the checkout root: nothing above it speaks for the model
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    return Target(newest_committed(), "no torch_npu release named beside the file: the newest committed")


@cache
def _named_in(folder: str) -> tuple[str, str] | None:
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return None
    for name in names:
        lower = name.lower()
        if lower != "readme.md" and not (lower.startswith("requirements") and lower.endswith(".txt")):
            continue
        path = os.path.join(folder, name)
        try:
            if not os.path.isfile(path):
                continue
            with open(path, encoding="utf-8", errors="replace") as handle:
                text = handle.read(_README_BYTES)
        except OSError:
            continue
        match = _NAMED.search(text)
        if match:
            return match.group(1), name
    return None
