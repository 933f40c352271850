"""Reading and writing the files we own: atomic replaces, writability checked before anything is written.

Every command that writes a file (manifests, reports, renders, progress.md, readings, generated
docs) goes through :func:`atomic_write_text`: a temp file in the same directory, fsync, rename; a
reader never sees half a file and a failed write leaves the old one. Problems are one
``InputError`` naming the file.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
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


def not_a_file(path: str | Path) -> str | None:
    """Why ``path`` cannot be read as an input file, in the user's terms (None: a regular file).

    "file not found" only when nothing is there: a directory, a symbolic link loop or a dangling link,
    a FIFO (reading it would block) or a device (reading /dev/zero never ends) are named as such.
    """
    p = Path(path)
    try:
        mode = os.stat(p).st_mode
    except OSError as exc:
        if p.is_symlink():
            return "symbolic link loop" if exc.errno == errno.ELOOP else f"broken symbolic link (to {os.readlink(p)!r})"
        if os.path.lexists(p):
            return f"cannot read: {exc.strerror}"
        return "file not found"
    if stat.S_ISDIR(mode):
        return "is a directory, not a file"
    if not stat.S_ISREG(mode):
        return "not a regular file (a FIFO, socket or device): inputs are read from regular files"
    return None


def read_input_text(path: str | Path) -> str:
    """An input file's text, newlines normalised (unlike ``read_text``, which keeps a file's bytes for
    rewriting it); missing, unreadable or non-UTF-8 -> one InputError naming it."""
    p = Path(path)
    problem = not_a_file(p)
    if problem:
        raise InputError(str(p), problem)
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


@contextlib.contextmanager
def exclusive_output(path: str | Path, flag: str):
    """Hold ``path`` (an output folder) for one writer for the duration of the block.

    A second writer of the same resolved path is refused at once (exit 2 naming ``flag`` and the
    holder's pid) instead of racing it: two runs would both report success while one result
    silently replaced the other. The lock is an advisory ``flock`` on a file in the system temp
    folder, never beside ``path`` (nothing is left there); the kernel releases it when the process
    dies, however it dies.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, as before
        yield
        return
    key = hashlib.sha256(str(Path(os.path.abspath(path)).resolve()).encode()).hexdigest()[:32]
    folder = Path(tempfile.gettempdir()) / "kvcache-locks"
    try:
        folder.mkdir(mode=0o1777, exist_ok=True)
        fd = os.open(folder / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:  # no usable temp folder: run without the lock rather than refuse the work
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
            raise InputError(str(path), f"another kvcache command (pid {holder}) is writing here now: wait for it "
                                        "to finish or choose another folder", field=flag) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)
