"""Idempotent, atomic edits of progress.md: our sections live between markers, nothing else moves."""

from __future__ import annotations

from pathlib import Path

from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.files import atomic_write_text, read_text


def markers(section: str) -> tuple[str, str]:
    return f"<!-- kvcache:begin {section} -->", f"<!-- kvcache:end {section} -->"


def _defuse(body: str) -> str:
    # A body that carried a marker (e.g. from a hostile model_type) would corrupt the next upsert;
    # stray CR/CRLF in it would change the file's detected line ending on the next run.
    return body.replace("<!--", "&lt;!--").replace("\r\n", "\n").replace("\r", "\n")


def _newline(outside: str) -> str:
    """CRLF only when every line ending outside our block is CRLF (so our own bytes never flip it)."""
    n = outside.count("\n")
    return "\r\n" if n and outside.count("\r\n") == n else "\n"


def upsert_section(text: str, section: str, body: str, where: str = "progress.md") -> str:
    """Return ``text`` with our ``section`` replaced by ``body`` (appended when absent).

    Every byte outside the markers is kept as is; the body takes the file's line ending.
    """
    begin, end = markers(section)
    b, e = text.count(begin), text.count(end)
    if b != e or b > 1:
        raise InputError(where, f"damaged kvcache section markers for '{section}' "
                                f"({b} begin, {e} end): fix them by hand", field=begin)
    start = stop = None
    if b == 1:
        start, stop = text.index(begin), text.index(end) + len(end)
        if stop - len(end) < start:
            raise InputError(where, f"end marker before begin marker for '{section}'", field=end)
    outside = text if start is None else text[:start] + text[stop:]
    newline = _newline(outside)
    block = begin + newline + _defuse(body).strip("\n").replace("\n", newline) + newline + end
    if start is not None:
        return text[:start] + block + text[stop:]
    if not text:
        sep = ""
    elif text.endswith("\n"):
        sep = newline  # one blank line before our block
    else:
        sep = newline * 2
    return text + sep + block + newline


def plan_section(path: str | Path, section: str, body: str) -> tuple[str, str]:
    """(current text, new text) of ``path`` with ``section`` upserted; nothing is written."""
    text = read_text(path)
    return text, upsert_section(text, section, body, str(path))


def write_section(path: str | Path, section: str, body: str) -> None:
    """Upsert ``section`` in the file at ``path`` atomically (temp file + rename); no-op when unchanged."""
    text, new = plan_section(path, section, body)
    if new != text:
        atomic_write_text(path, new)
