"""Reading and writing the files we own: atomic replaces, writability checked before anything is written.

Every command that writes a file (manifests, reports, renders, progress.md, readings, generated
docs) goes through :func:`atomic_write_text`: a temp file in the same directory, fsync, rename; a
reader never sees half a file and a failed write leaves the old one. Problems are one
``InputError`` naming the file.
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import hashlib
import json
import os
import signal
import stat
import tempfile
import threading
from pathlib import Path

from model_infer_kvcache.analyzer import errors
from model_infer_kvcache.analyzer.errors import InputError

# Byte-order marks editors write ("Unicode" in Windows Notepad is UTF-16 LE), UTF-32's first: its LE mark
# starts with UTF-16 LE's. Each decodes with its mark kept as U+FEFF, as a UTF-8 file's mark does.
_BOM_ENCODINGS = ((codecs.BOM_UTF32_LE, "utf-32-le"), (codecs.BOM_UTF32_BE, "utf-32-be"),
                  (codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be"))


def decode_text(data: bytes, where: str) -> str:
    """``data`` as text: UTF-8, or the UTF-16/32 its byte-order mark names (a leading mark stays U+FEFF);
    anything else is one InputError in the user's terms, not the codec's ("can't decode byte 0xff...")."""
    encoding = next((enc for bom, enc in _BOM_ENCODINGS if data.startswith(bom)), "utf-8")
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise InputError(where, f"not UTF-8 text at line {line}: save it as UTF-8") from None


def read_text(path: str | Path) -> str:
    """The file's text ('' when it does not exist yet); unreadable or not text -> InputError. A UTF-16/32
    file (with its byte-order mark) is read too: whoever rewrites it writes UTF-8."""
    p = Path(path)
    if p.exists() and not p.is_file():
        raise InputError(str(p), "not a regular file")
    try:
        data = p.read_bytes() if p.exists() else b""
    except OSError as exc:
        raise InputError(str(p), f"cannot read: {exc}") from None
    return decode_text(data, str(p))


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
    """An input file's text, newlines normalised and a byte-order mark dropped (unlike ``read_text``, which
    keeps a file's bytes for rewriting it); missing, unreadable or not text -> one InputError naming it.
    Every user file read as text (config.json, progress.md, a dispatch file, a manifest) comes through here."""
    p = Path(path)
    problem = not_a_file(p)
    if problem:
        raise InputError(str(p), problem)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise InputError(str(p), f"cannot read: {exc}") from None
    text = decode_text(data, str(p)).removeprefix("\ufeff")  # the mark is not content
    return text.replace("\r\n", "\n").replace("\r", "\n")  # what open()'s universal newlines gave


def json_syntax_problem(exc: json.JSONDecodeError) -> str:
    """A JSON syntax error as a whole sentence naming where: json's own text is a fragment meant to be
    followed by the position ("Unterminated string starting at"), and a file cut short is said to be."""
    if not exc.doc.strip():
        return "invalid JSON: the file is empty"
    at = f"invalid JSON at line {exc.lineno} column {exc.colno}"
    if exc.msg.startswith("Unterminated string"):  # only the end of the text leaves a string open
        return f"{at}: a string starts there and the file ends before it is closed (is it truncated?)"
    what = _JSON_SAYS.get(exc.msg) or exc.msg.replace("Expecting", "expected")
    if not exc.doc[exc.pos:].strip():
        return f"{at}: {what}, where the file ends (is it truncated?)"
    return f"{at}: {what}"


# json's fragments that do not read as a clause once the position moves to the front.
_JSON_SAYS = {"Expecting value": "expected a value",
              "Invalid control character at": "a control character (a raw tab or line break) inside a string",
              "Extra data": "more text after the JSON value",
              "Invalid \\escape": "an invalid backslash escape",
              "Invalid \\uXXXX escape": "an invalid \\uXXXX escape"}


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
    with signals_held():  # created and removed in one step: a signal in between would leave the probe behind
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
    tmp = None
    try:
        # the temp file is created and named in one step: a SIGINT/SIGTERM between mkstemp's return and the
        # assignment would leave it beside the target with no cleanup knowing its name
        with signals_held():
            try:
                fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=parent)
            except OSError as exc:
                raise InputError(str(p), f"cannot write: {exc.strerror or exc}") from None
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, p.stat().st_mode & 0o777 if p.exists() else _default_mode())
        os.replace(tmp, p)
    except OSError as exc:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        raise InputError(str(p), f"cannot write: {exc}") from None
    except BaseException:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def signals_held():
    """Defer SIGINT/SIGTERM until the block is done (delivered right after it): a file or folder created inside is
    named (and so cleaned up on the way out) before the signal's exception can be raised. Two holds: the command's
    handlers keep a signal that arrives meanwhile (analyzer.errors: whichever thread the kernel hands it to, Python
    runs them in the main thread), and this thread's mask keeps the ones no handler of ours catches."""
    main = threading.current_thread() is threading.main_thread()
    if main:
        errors.defer_signals()
    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    except (AttributeError, ValueError, OSError):  # no pthread_sigmask here: the handlers' hold only
        old = None
    try:
        yield
    finally:
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        if main:
            errors.release_signals()


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
