"""The one error type for bad input, and the exit codes every `kvcache` command shares.

Exit codes: 0 ok, 1 checks failed (lint findings, validation failures), 2 bad input (one
stderr line naming the file or flag and field, nothing written; an operating-system error such as
a full disk or a denied permission is reported the same way, naming the path), 3 internal error of
the tool itself (a bug: one stderr line saying so; ``KVCACHE_DEBUG=1`` shows the traceback),
130 / 143 interrupted by SIGINT / SIGTERM (one line; what the command was writing is cleaned up).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import traceback

EXIT_OK = 0
EXIT_CHECKS_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3
EXIT_SIGINT = 128 + signal.SIGINT
EXIT_SIGTERM = 128 + signal.SIGTERM
DEBUG_ENV = "KVCACHE_DEBUG"


class InputError(Exception):
    """Bad user input. ``where`` names the file (or flag) and ``field`` the offending field."""

    def __init__(self, where: str, message: str, field: str | None = None):
        self.where = where
        self.field = field
        self.message = message
        super().__init__(self.render())

    def render(self) -> str:
        location = f"{self.where}: {self.field}" if self.field else self.where
        # One line whatever the inputs hold: the CLI promises a single stderr line.
        return " ".join(f"{location}: {self.message}".splitlines())


class NotSupportedByKvcache(InputError):
    """The tool lacks something this model needs (an operator, a cache kind, a config field's meaning): exit 2
    with one line "not supported by kvcache: <what>", nothing written; a gap of kvcache's, never the model's."""

    PREFIX = "not supported by kvcache: "

    def __init__(self, where: str, what: str, field: str | None = None):
        super().__init__(where, self.PREFIX + what, field=field)


class Terminated(BaseException):
    """SIGTERM, raised in the main thread like KeyboardInterrupt is for SIGINT, so the ``finally`` and
    ``except BaseException`` blocks that remove staging files run (timeouts and agent tools send it)."""


# The signal this command received, recorded before raising: a library that calls back into Python (pydantic's
# serializer) may wrap the KeyboardInterrupt / Terminated in its own error, which must still read as the signal.
_received: list[int] = []


# Signals received while a block that must not be cut short runs (``signals_deferred``), raised when it ends. A mask
# alone does not hold them: a process-directed signal goes to another thread that does not block it (torch's, a
# runner's I/O thread), and Python then runs the handler in the main thread all the same.
_deferring: list[int] = [0]
_pending: list[int] = []


def _signalled(signum: int) -> None:
    _received.append(signum)
    if _deferring[0]:
        _pending.append(signum)
        return
    raise KeyboardInterrupt() if signum == signal.SIGINT else Terminated()


def _on_sigterm(signum, frame):
    _signalled(signum)


def _on_sigint(signum, frame):
    _signalled(signum)


def defer_signals() -> None:
    """Enter a block during which this command's SIGINT / SIGTERM handlers hold the signal (main thread only)."""
    _deferring[0] += 1


def release_signals() -> None:
    """Leave it; the outermost release raises a signal held meanwhile (the last one), as its handler would have."""
    _deferring[0] -= 1
    if not _deferring[0] and _pending:
        signum = _pending[-1]
        _pending.clear()
        raise KeyboardInterrupt() if signum == signal.SIGINT else Terminated()


def _interrupted() -> int | None:
    """The exit code of a signal received during this command (whatever exception carried it out), or None."""
    if not _received:
        return None
    return EXIT_SIGINT if _received[-1] == signal.SIGINT else EXIT_SIGTERM


def _say_interrupted(code: int) -> int:
    name = "interrupted (SIGINT)" if code == EXIT_SIGINT else "terminated (SIGTERM)"
    print(f"{name}: stopped, nothing half-written left behind", file=sys.stderr)
    return code


def os_error_line(exc: OSError) -> str:
    """One line for an operating-system error: the path first when the error names one."""
    what = exc.strerror or str(exc) or type(exc).__name__
    if exc.filename is not None:
        return f"{exc.filename}: {what}"
    return f"operating system: {what}"


def internal_error_line(exc: BaseException) -> str:
    """One line that blames the tool, names the exception and where it was raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
    what = " ".join(str(exc).split())
    if len(what) > 200:
        what = what[:200] + "..."
    return (f"internal error (a bug in kvcache, not in your input): {type(exc).__name__}{where}: {what} "
            f"-- rerun with {DEBUG_ENV}=1 for the traceback and report it with the command line")


def guarded(fn, *args) -> int:
    """Run a command: bad input or an OS error -> exit 2 with one line; a bug -> exit 3 with one line;
    SIGINT / SIGTERM -> 130 / 143 with one line; else fn's code."""
    installed, previous, previous_int = False, None, None
    if threading.current_thread() is threading.main_thread():
        previous, installed = signal.signal(signal.SIGTERM, _on_sigterm), True
        previous_int = signal.getsignal(signal.SIGINT)
        if previous_int is signal.default_int_handler:  # an ignored SIGINT (a background job's) stays ignored
            signal.signal(signal.SIGINT, _on_sigint)
    _received.clear()
    _pending.clear()
    try:
        return fn(*args)
    except InputError as exc:
        print(f"error: {exc.render()}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:  # the environment (disk full, permissions, a path that vanished), not a bug
        if os.environ.get(DEBUG_ENV):
            raise
        print(f"error: {' '.join(os_error_line(exc).split())}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return _say_interrupted(EXIT_SIGINT)
    except Terminated:
        return _say_interrupted(EXIT_SIGTERM)
    except Exception as exc:  # anything else is the tool's fault, never "your checks failed"
        if _interrupted() is not None:  # the signal, wrapped by a library on its way out
            return _say_interrupted(_interrupted())
        if os.environ.get(DEBUG_ENV):
            raise
        print(internal_error_line(exc), file=sys.stderr)
        return EXIT_INTERNAL
    finally:
        if installed:  # None: the handler was set outside Python, the default is its nearest equal
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
            if previous_int is signal.default_int_handler:
                signal.signal(signal.SIGINT, previous_int)


def dispatch(prog: str, commands: dict, usage: str, argv: list[str]) -> int:
    """Run the subcommand ``argv[0]`` on the rest of ``argv`` (``commands``: name -> main(argv)).

    ``-h``/``--help`` prints ``usage``; no command or an unknown one is one stderr line, exit 2.
    """
    if argv and argv[0] in ("-h", "--help"):
        sys.stdout.write(usage)
        return EXIT_OK
    if not argv or argv[0] not in commands:
        what = f"unknown command {argv[0]!r}" if argv else "no command given"
        sys.stderr.write(f"error: {prog}: {what}: use one of {', '.join(commands)} (see {prog} --help)\n")
        return EXIT_BAD_INPUT
    # Each command guards itself too; this catches what fails before it can (e.g. its imports).
    return guarded(commands[argv[0]], argv[1:]) or EXIT_OK


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one stderr line (exit 2) like every other bad input."""

    def error(self, message: str):  # noqa: D401 - argparse API
        self.exit(EXIT_BAD_INPUT, f"error: {self.prog}: {' '.join(message.splitlines())} (see --help)\n")
