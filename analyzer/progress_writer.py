"""Idempotent, atomic edits of progress.md: our sections live between markers, nothing else moves."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from analyzer.errors import InputError


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


def read_text(path: str | Path) -> str:
    """The file's text ('' when it does not exist yet); unreadable or non-UTF-8 -> InputError."""
    p = Path(path)
    if p.exists() and not p.is_file():
        raise InputError(str(p), "not a regular file")
    try:
        return p.read_bytes().decode("utf-8") if p.exists() else ""
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(str(p), f"cannot read: {exc}") from None


def check_writable(path: str | Path) -> None:
    """Fail before anything is written when ``path`` cannot be replaced atomically."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(str(p), "directory does not exist")
    if p.exists() and not p.is_file():
        raise InputError(str(p), "not a regular file")
    check_dir_writable(parent, str(p))


def check_dir_writable(folder: str | Path, where: str | None = None) -> None:
    """Fail unless a file can be created in ``folder``: probed with a temp file (os.access lies to
    root and on read-only mounts), removed at once."""
    where = where or str(folder)
    try:
        fd, probe = tempfile.mkstemp(prefix=".kvcache-probe.", dir=folder)
    except OSError as exc:
        raise InputError(where, f"directory is not writable ({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(probe)


def check_out_dir(path: str | Path, field: str = "--out") -> None:
    """Fail before anything is written unless ``path`` is, or can be created as, a writable directory."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise InputError(str(p), "exists and is not a directory", field=field)
    base = p.absolute()
    while not base.exists():
        base = base.parent
    if not base.is_dir():
        raise InputError(str(p), f"{base} is not a directory", field=field)
    try:
        check_dir_writable(base)
    except InputError as exc:
        raise InputError(str(p), exc.message, field=field) from None


def _default_mode() -> int:
    # mkstemp creates 0600; a new file should get what open() would give it (0666 minus umask).
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8, line endings untouched) via a temp file in the same directory and a rename."""
    p = Path(path)
    check_writable(p)
    parent = p.parent if str(p.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=parent)
    except OSError as exc:
        raise InputError(str(p), f"cannot write: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(text.encode("utf-8"))
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, p.stat().st_mode & 0o777 if p.exists() else _default_mode())
        os.replace(tmp, p)
    except OSError as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise InputError(str(p), f"cannot write: {exc}") from None
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name one file (existing or not yet)."""
    pa, pb = Path(a), Path(b)
    if pa.exists() and pb.exists():
        return pa.samefile(pb)
    return pa.resolve() == pb.resolve()


def plan_section(path: str | Path, section: str, body: str) -> tuple[str, str]:
    """(current text, new text) of ``path`` with ``section`` upserted; nothing is written."""
    text = read_text(path)
    return text, upsert_section(text, section, body, str(path))


def write_section(path: str | Path, section: str, body: str) -> None:
    """Upsert ``section`` in the file at ``path`` atomically (temp file + rename); no-op when unchanged."""
    text, new = plan_section(path, section, body)
    if new != text:
        atomic_write_text(path, new)
