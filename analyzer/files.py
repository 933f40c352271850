"""Reading and writing the files we own: atomic replaces, writability checked before anything is written.

Every command that writes a file (manifests, reports, renders, progress.md, readings, generated
docs) goes through :func:`atomic_write_text`: a temp file in the same directory, fsync, rename; a
reader never sees half a file and a failed write leaves the old one. Problems are one
``InputError`` naming the file.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from model_infer_kvcache.analyzer.errors import InputError


def read_text(path: str | Path) -> str:
    """The file's text ('' when it does not exist yet); unreadable or non-UTF-8 -> InputError."""
    p = Path(path)
    if p.exists() and not p.is_file():
        raise InputError(str(p), "not a regular file")
    try:
        return p.read_bytes().decode("utf-8") if p.exists() else ""
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(str(p), f"cannot read: {exc}") from None


def read_input_text(path: str | Path) -> str:
    """An input file's text, newlines normalised (unlike ``read_text``, which keeps a file's bytes for
    rewriting it); missing, unreadable or non-UTF-8 -> one InputError naming it."""
    p = Path(path)
    if not p.is_file():
        raise InputError(str(p), "file not found")
    try:
        return p.read_text(encoding="utf-8")
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


def umask() -> int:
    """The process umask (read by setting it and putting it back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _default_mode() -> int:
    # mkstemp creates 0600; a new file should get what open() would give it (0666 minus umask).
    return 0o666 & ~umask()


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8, line endings untouched) via a temp file in the same directory and a rename."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` via a temp file in the same directory and a rename (mode kept, or open()'s default)."""
    p = Path(path)
    check_writable(p)
    parent = p.parent if str(p.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=parent)
    except OSError as exc:
        raise InputError(str(p), f"cannot write: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
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
