"""Safe output: paths stay inside the output dir, writes are atomic, nothing half-written."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from analyzer.errors import InputError


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file in the same directory and a rename."""
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(str(path), "directory does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
