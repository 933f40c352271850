"""Run the rules over sources, files and directories; suppression comments; rule selection."""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterable

from model_infer_kvcache.validators.lint.checks import FileChecker, format_fields
from model_infer_kvcache.validators.lint.finding import FileError, Finding, LintReport
from model_infer_kvcache.validators.lint.registry import RULES, parse_id_list
from model_infer_kvcache.validators.lint.target_release import Target, chosen, target_for

_SUPPRESS = re.compile(r"#\s*kvcache:\s*ignore\[([A-Za-z0-9_,\s]+)\]")
_SKIP_DIRS = {"__pycache__", ".git", ".venv", "venv", "node_modules", ".mypy_cache", ".pytest_cache",
              ".ruff_cache", "build", "dist", ".tox"}


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


def lint_source(source: str, path: str = "<string>", manifest=None, select=None, ignore=None,
                torch_npu: str | None = None) -> list[Finding]:
    """Lint one module's source text. Raises SyntaxError when it does not parse."""
    tree = ast.parse(source, filename=path)
    return _lint_tree(tree, source, path, manifest, _selected(select, ignore), chosen(torch_npu))


def _lint_tree(tree: ast.Module, source: str, path: str, manifest, selected: set[str],
               release: Target | None = None) -> list[Finding]:
    checker = FileChecker(tree, path, manifest, release or target_for(path))
    raw = checker.run()
    if manifest is not None:  # the manifest rules revisit the calls the code-only pass collected
        from model_infer_kvcache.validators.lint.manifest_checks import (
            ManifestChecks,  # lazily: it imports the analyzer
        )

        ManifestChecks(checker).run()
    quiet = suppressions(source)
    findings = []
    for rule_id, node, fields in raw:
        if rule_id not in selected:
            continue
        line = getattr(node, "lineno", 1)
        stmt_line = getattr(checker.info.statement_of(node), "lineno", line)
        if rule_id in quiet.get(line, ()) or rule_id in quiet.get(stmt_line, ()):
            continue
        message, hint = format_fields(rule_id, fields)
        rule = RULES[rule_id]
        findings.append(Finding(path, line, getattr(node, "col_offset", 0) + 1, rule_id, message, hint,
                                rule.severity))
    findings.sort(key=lambda f: (f.line, f.col, f.rule))
    return findings


def iter_python_files(paths: Iterable[str | os.PathLike]) -> tuple[list[str], list[FileError]]:
    """Expand directories to their ``*.py`` files (sorted); name paths that do not exist."""
    files: list[str] = []
    errors: list[FileError] = []
    for raw in paths:
        path = str(raw)
        if os.path.isdir(path):
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
                files.extend(os.path.join(root, n) for n in sorted(names) if n.endswith(".py"))
        elif os.path.exists(path):
            files.append(path)
        else:
            errors.append(FileError(path, "no such file or directory"))
    return files, errors


def lint_paths(paths: Iterable[str | os.PathLike], manifest=None, select=None, ignore=None,
               torch_npu: str | None = None) -> LintReport:
    """Lint files and directories. ``manifest`` is a SelectionManifest or a path to one.

    ``torch_npu`` names the committed schema release keywords are judged against; None: each file's
    target release (``target_release.target_for``). Unreadable or unparsable files are reported in
    ``errors`` (the others are still linted). Raises InputError (analyzer.errors) for a bad manifest
    and ValueError for unknown rule IDs or an uncommitted release.
    """
    release = chosen(torch_npu)
    if manifest is not None and not hasattr(manifest, "fa"):
        from model_infer_kvcache.analyzer.manifest_io import (
            load_manifest,  # lazily: pydantic only when a manifest is given
        )

        manifest = load_manifest(manifest)
    selected = _selected(select, ignore)
    files, errors = iter_python_files(paths)
    report = LintReport(errors=errors)
    for path in files:
        try:
            with open(path, "rb") as handle:
                data = handle.read()
            source = data.decode("utf-8-sig")
        except (OSError, UnicodeDecodeError) as exc:
            report.errors.append(FileError(path, f"cannot read: {exc}"))
            continue
        try:
            tree = ast.parse(source, filename=path)
        except SyntaxError as exc:
            report.errors.append(FileError(path, f"syntax error: {exc.msg}", exc.lineno, exc.offset))
            continue
        except ValueError as exc:  # e.g. null bytes
            report.errors.append(FileError(path, f"cannot parse: {exc}"))
            continue
        report.files.append(path)
        report.findings.extend(_lint_tree(tree, source, path, manifest, selected, release))
    return report
