"""Idempotent, atomic edits of progress.md: our sections live between markers, nothing else moves."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from analyzer.errors import InputError


def _markers(section: str) -> tuple[str, str]:
    return f"<!-- kvcache:begin {section} -->", f"<!-- kvcache:end {section} -->"


def upsert_section(text: str, section: str, body: str, where: str = "progress.md") -> str:
    """Return ``text`` with our ``section`` replaced by ``body`` (appended when absent).

    Every byte outside the markers is kept as is; the body takes the file's line ending.
    """
    begin, end = _markers(section)
    newline = "\r\n" if "\r\n" in text else "\n"
    block = begin + newline + body.strip("\n").replace("\n", newline) + newline + end
    b, e = text.count(begin), text.count(end)
    if b != e or b > 1:
        raise InputError(where, f"damaged kvcache section markers for '{section}' "
                                f"({b} begin, {e} end): fix them by hand", field=begin)
    if b == 1:
        start, stop = text.index(begin), text.index(end)
        if stop < start:
            raise InputError(where, f"end marker before begin marker for '{section}'", field=end)
        return text[:start] + block + text[stop + len(end):]
    if not text:
        sep = ""
    elif text.endswith("\n"):
        sep = newline  # one blank line before our block
    else:
        sep = newline * 2
    return text + sep + block + newline


def write_section(path: str | Path, section: str, body: str) -> None:
    """Upsert ``section`` in the file at ``path`` atomically (temp file + rename)."""
    p = Path(path)
    try:
        raw = p.read_bytes() if p.exists() else b""
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(str(p), f"cannot read: {exc}") from None
    new = upsert_section(text, section, body, str(p))
    if new == text:
        return
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(str(p), "directory does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(new.encode("utf-8"))
        if p.exists():
            os.chmod(tmp, p.stat().st_mode & 0o777)
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
