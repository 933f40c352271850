"""Run the rules over sources, files and directories; suppression comments; rule selection."""

from __future__ import annotations

import ast
import io
import os
import re
import stat
import tokenize
from collections.abc import Iterable

from model_infer_kvcache.validators.lint.checks import FileChecker, format_fields
from model_infer_kvcache.validators.lint.deploy_mode import (
    AUTO,
    CHOICES,
    Decision,
    FolderFacts,
    applies,
    folder_facts,
)
from model_infer_kvcache.validators.lint.finding import FileError, Finding, LintReport
from model_infer_kvcache.validators.lint.registry import RULES, parse_id_list
from model_infer_kvcache.validators.lint.target_release import Target, chosen, target_for

_SUPPRESS = re.compile(r"#\s*kvcache:\s*ignore\[([A-Za-z0-9_,\s]+)\]")
_SKIP_DIRS = {"__pycache__", ".git", ".venv", "venv", "node_modules", ".mypy_cache", ".pytest_cache",
              ".ruff_cache", "build", "dist", ".tox"}
# Model files are tens of kB; a source larger than this is not a model file (or is /dev/zero-like) and
# is refused instead of read into memory.
MAX_SOURCE_BYTES = 16 * 1024 * 1024


def suppressions(source: str) -> dict[int, set[str]]:
    """Line number -> rule IDs silenced there by ``# kvcache: ignore[ID1,ID2]``."""
    out: dict[int, set[str]] = {}
    if "kvcache:" not in source:
        return out
    for number, line in enumerate(source.splitlines(), start=1):
        match = _SUPPRESS.search(line)
        if match:
            out[number] = {part.strip().upper() for part in match.group(1).split(",") if part.strip()}
    return out


def _selected(select: Iterable[str] | str | None, ignore: Iterable[str] | str | None) -> set[str]:
    def as_set(value) -> set[str]:
        if value is None:
            return set()
        if isinstance(value, str):
            return parse_id_list(value)
        return parse_id_list(",".join(value))

    chosen = as_set(select) or set(RULES)
    return chosen - as_set(ignore)


def checked_mode(mode: str | None) -> str:
    """``mode`` (None: auto) when it is one of CHOICES; ValueError naming the choices otherwise."""
    mode = AUTO if mode is None else mode
    if mode not in CHOICES:
        raise ValueError(f"unknown mode {mode!r} (choose {', '.join(CHOICES)})")
    return mode


def lint_source(source: str, path: str = "<string>", manifest=None, select=None, ignore=None,
                torch_npu: str | None = None, mode: str = AUTO) -> list[Finding]:
    """Lint one module's source text. Raises SyntaxError when it does not parse.

    ``mode``: "framework" / "standalone" force the deployment mode; "auto" decides it from the manifest,
    the text and, when ``path`` is a file on disk, the folder around it (``deploy_mode``)."""
    mode = checked_mode(mode)
    tree = ast.parse(source, filename=path)
    findings, _ = _lint_tree(tree, source, path, manifest, _selected(select, ignore), chosen(torch_npu), mode,
                             folder_facts(path))
    return findings


def _lint_tree(tree: ast.Module, source: str, path: str, manifest, selected: set[str],
               release: Target | None = None, mode: str = AUTO,
               folder: FolderFacts | None = None) -> tuple[list[Finding], Decision]:
    checker = FileChecker(tree, path, manifest, release or target_for(path), mode=mode, folder=folder)
    decision = checker.deploy
    raw = checker.run()
    if manifest is not None:  # the manifest rules revisit the calls the code-only pass collected
        from model_infer_kvcache.validators.lint.manifest_checks import (
            ManifestChecks,  # lazily: it imports the analyzer
        )

        ManifestChecks(checker).run()
    quiet = suppressions(source)
    findings = []
    for rule_id, node, fields in raw:
        # a rule of the other deployment mode is a contract this file does not have (Rule.deploy)
        if rule_id not in selected or not applies(RULES[rule_id].deploy, decision.mode):
            continue
        line = getattr(node, "lineno", 1)
        stmt_line = getattr(checker.info.statement_of(node), "lineno", line)
        if rule_id in quiet.get(line, ()) or rule_id in quiet.get(stmt_line, ()):
            continue
        message, hint = format_fields(rule_id, fields)
        rule = RULES[rule_id]
        findings.append(Finding(path, line, getattr(node, "col_offset", 0) + 1, rule_id, message, hint,
                                rule.severity, decision.mode, decision.reason))
    findings.sort(key=lambda f: (f.line, f.col, f.rule))
    return findings, decision


def path_problem(path: str) -> str | None:
    """Why ``path`` cannot be linted as a file (None: a regular file). Only regular files are read: a FIFO
    would block, a device such as /dev/zero never ends."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        if os.path.islink(path):
            return "symbolic link loop" if exc.errno == 40 else f"broken symbolic link to {os.readlink(path)!r}"
        return "no such file or directory" if not os.path.lexists(path) else f"cannot read: {exc.strerror}"
    if stat.S_ISDIR(mode):
        return None
    if not stat.S_ISREG(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) \
            else "a socket" if stat.S_ISSOCK(mode) else "not a regular file"
        return f"{kind}, not a regular file: lint reads source files only"
    return None


def iter_python_files(paths: Iterable[str | os.PathLike]) -> tuple[list[str], list[FileError]]:
    """Expand directories to their ``*.py`` files (sorted); name paths that cannot be linted (missing,
    not a regular file; no Python file under any of them)."""
    paths = list(paths)
    files: list[str] = []
    errors: list[FileError] = []
    for raw in paths:
        path = str(raw)
        problem = path_problem(path)
        if problem:
            errors.append(FileError(path, problem))
        elif os.path.isdir(path):
            found = []
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
                found.extend(os.path.join(root, n) for n in sorted(names)
                             if n.endswith(".py") and path_problem(os.path.join(root, n)) is None)
            files.extend(found)
        else:
            files.append(path)
    if not files and not errors:  # "clean" would claim something was checked
        given = ", ".join(str(p) for p in paths)
        errors.append(FileError(given, "no Python files under this path" if "," not in given else
                                "no Python files under these paths"))
    return files, errors


def read_source(path: str) -> str:
    """A source file's text in the encoding Python itself would use (BOM, PEP 263 coding line), at most
    MAX_SOURCE_BYTES. Raises OSError / UnicodeDecodeError / SyntaxError / ValueError."""
    with open(path, "rb") as handle:
        data = handle.read(MAX_SOURCE_BYTES + 1)
    if len(data) > MAX_SOURCE_BYTES:
        raise ValueError(f"larger than {MAX_SOURCE_BYTES // (1024 * 1024)} MiB: not a model source file")
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    return data.decode(encoding)


def lint_paths(paths: Iterable[str | os.PathLike], manifest=None, select=None, ignore=None,
               torch_npu: str | None = None, mode: str = AUTO) -> LintReport:
    """Lint files and directories. ``manifest`` is a SelectionManifest or a path to one.

    ``mode`` ("auto", "framework", "standalone"): the deployment mode of every file, or "auto" to decide
    it per file (``deploy_mode.decide``); ``report.modes`` maps each linted file to the mode and why.

    ``torch_npu`` names the committed schema release keywords are judged against; None: each file's
    target release (``target_release.target_for``). Unreadable or unparsable files are reported in
    ``errors`` (the others are still linted). Raises InputError (analyzer.errors) for a bad manifest
    and ValueError for unknown rule IDs, an unknown mode or an uncommitted release.
    """
    mode = checked_mode(mode)
    release = chosen(torch_npu)
    if manifest is not None and not hasattr(manifest, "fa"):
        from model_infer_kvcache.analyzer.manifest_io import (
            load_manifest,  # lazily: pydantic only when a manifest is given
        )

        manifest = load_manifest(manifest)
    selected = _selected(select, ignore)
    files, errors = iter_python_files(paths)
    report = LintReport(errors=errors)
    folders: dict[str, FolderFacts] = {}  # one model folder's facts serve all its files
    for path in files:
        try:
            source = read_source(path)
        except (OSError, UnicodeDecodeError, LookupError, SyntaxError, ValueError) as exc:
            # SyntaxError here: a coding line naming an unknown encoding.
            report.errors.append(FileError(path, f"cannot read: {getattr(exc, 'strerror', None) or exc}"))
            continue
        try:
            tree = ast.parse(source, filename=path)
        except SyntaxError as exc:
            report.errors.append(FileError(path, f"syntax error: {exc.msg}", exc.lineno, exc.offset))
            continue
        except ValueError as exc:  # e.g. null bytes
            report.errors.append(FileError(path, f"cannot parse: {exc}"))
            continue
        except (RecursionError, MemoryError):
            report.errors.append(FileError(path, "cannot parse: nested too deeply for Python's parser"))
            continue
        try:
            findings, decision = _lint_tree(tree, source, path, manifest, selected, release, mode,
                                            folder_facts(path, folders))
        except RecursionError:  # hostile nesting the parser accepted but a rule cannot walk
            report.errors.append(FileError(path, "cannot lint: expressions nested too deeply"))
            continue
        report.files.append(path)
        report.modes[path] = decision
        report.findings.extend(findings)
    return report
