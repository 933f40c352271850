"""The one rule every command follows for the paths on its command line.

Before any work, every output path is resolved (symbolic links, ``..``, hard links of existing
files) and compared with every input path and every other output of the same call. A clash is one
``InputError`` naming both flags: an output never replaces an input (``analyze --out config.json``),
and two outputs never replace each other (``probe --out r.json --markdown r.json``). The one
exception is declared by the command: ``--write-progress`` may name the ``--progress`` it reads,
because updating that file is its purpose.

``-`` as an output means stdout where the command offers it; an empty path is refused naming the
flag (``--out ''`` would otherwise fall back to a default or to the current directory).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from model_infer_kvcache.analyzer.errors import InputError

STDOUT = "-"


@dataclass(frozen=True)
class PathArg:
    """One path flag of a call.

    ``is_dir``: the flag names a directory. For an output directory, ``entries`` lists what the command
    writes under it (None: it owns the whole directory); for an input directory, ``whole`` says whether
    every file under it is read (a render folder) or only files the command picks (a framework
    checkout, where writing a report inside is harmless).
    """

    flag: str
    path: str | os.PathLike
    is_dir: bool = False
    entries: tuple[str, ...] | None = None
    whole: bool = True


def _resolved(path: str | os.PathLike, flag: str = "") -> Path:
    try:
        return Path(os.path.abspath(path)).resolve()
    except (RuntimeError, OSError) as exc:  # a symbolic link loop (RuntimeError before Python 3.13)
        raise InputError(str(path), f"cannot resolve: {'symbolic link loop' if isinstance(exc, RuntimeError) else exc}",
                         field=flag or None) from None


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def _same_existing(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _written(arg: PathArg) -> list[Path]:
    """The paths an output argument replaces."""
    base = _resolved(arg.path, arg.flag)
    if arg.is_dir and arg.entries is not None:
        return [base / entry for entry in arg.entries]
    return [base]


def _read(arg: PathArg) -> tuple[Path, bool]:
    """An input's resolved path and whether writing anywhere under it harms what is read."""
    return _resolved(arg.path, arg.flag), (not arg.is_dir) or arg.whole


def check_nonempty(args: list[PathArg]) -> None:
    for arg in args:
        if str(arg.path) == "" or str(arg.path).isspace():
            raise InputError(arg.flag, "empty path: name a file or directory")


def check_paths(inputs: list[PathArg], outputs: list[PathArg], same_ok: frozenset[tuple[str, str]] = frozenset(),
                stdout_ok: frozenset[str] = frozenset()) -> None:
    """Refuse (one ``InputError`` naming both flags) any output that would replace an input or another output.

    ``same_ok`` holds (input flag, output flag) pairs allowed to name one file; ``stdout_ok`` the output
    flags that take ``-`` for stdout (elsewhere ``-`` is refused rather than creating a file named '-').
    """
    inputs = [a for a in inputs if a.path is not None]
    outputs = [a for a in outputs if a.path is not None]
    check_nonempty(inputs + outputs)
    to_stdout = [a for a in outputs if str(a.path) == STDOUT]
    for arg in to_stdout:
        if arg.flag not in stdout_ok:
            raise InputError(arg.flag, "'-' (stdout) is not offered here: name a file"
                             + (" or directory" if arg.is_dir else ""))
    if len(to_stdout) > 1:
        raise InputError(to_stdout[1].flag, f"and {to_stdout[0].flag} both write to stdout ('-'): "
                                            "name a file for one of them")
    outputs = [a for a in outputs if str(a.path) != STDOUT]
    for out in outputs:
        if out.is_dir:  # the folder itself is written to: it may not be an input either
            _check_folder(out, inputs, same_ok)
        for written in _written(out):
            for inp in inputs:
                if (inp.flag, out.flag) in same_ok:
                    continue
                read, whole = _read(inp)
                hit = _within(read, written) or (whole and _within(written, read)) or _same_existing(read, written)
                if hit:
                    raise InputError(str(out.path), f"would overwrite the {inp.flag} input {str(inp.path)!r}: "
                                                    "choose another output path", field=out.flag)
    for i, a in enumerate(outputs):
        for b in outputs[i + 1:]:
            if any(_within(x, y) or _within(y, x) or _same_existing(x, y)
                   for x in _written(a) for y in _written(b)):
                raise InputError(str(b.path), f"names the same file as {a.flag} {str(a.path)!r}: each output "
                                              "needs its own path", field=b.flag)


def _check_folder(out: PathArg, inputs: list[PathArg], same_ok: frozenset[tuple[str, str]]) -> None:
    folder = _resolved(out.path, out.flag)
    for inp in inputs:
        if (inp.flag, out.flag) not in same_ok and _resolved(inp.path, inp.flag) == folder:
            raise InputError(str(out.path), f"would overwrite the {inp.flag} input {str(inp.path)!r} (the folder "
                                            "it writes into): choose another output folder", field=out.flag)


def config_file(path: str | os.PathLike | None) -> str | None:
    """The config file a --config / --model-dir value names (a model directory holds config.json)."""
    if path is None or str(path) == "":
        return path
    p = Path(path)
    return str(p / "config.json") if p.is_dir() else str(path)
