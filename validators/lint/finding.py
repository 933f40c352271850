"""Findings and file errors, and their text / JSON renderings."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from model_infer_kvcache.validators.lint.deploy_mode import Decision


@dataclass(frozen=True, order=True)
class Finding:
    path: str
    line: int
    col: int  # 1-based, like compilers and ruff
    rule: str
    message: str
    hint: str
    severity: str = "error"
    # the file's deployment mode and why (deploy_mode.decide); not part of what the finding is
    mode: str | None = field(default=None, compare=False)
    mode_reason: str | None = field(default=None, compare=False)

    def to_text(self) -> str:
        return f"{self.path}:{self.line}:{self.col}: {self.rule} {self.message} ({self.hint})"

    def to_dict(self) -> dict:
        out = {"rule": self.rule, "path": self.path, "line": self.line, "col": self.col,
               "message": self.message, "hint": self.hint, "severity": self.severity}
        if self.mode is not None:
            out["mode"], out["mode_reason"] = self.mode, self.mode_reason
        return out


@dataclass(frozen=True)
class FileError:
    """A file that could not be linted (unreadable, not UTF-8, syntax error)."""

    path: str
    message: str
    line: int | None = None
    col: int | None = None

    def to_text(self) -> str:
        where = f"{self.path}:{self.line}:{self.col or 1}" if self.line else self.path
        return f"{where}: {self.message}"


@dataclass
class LintReport:
    findings: list[Finding] = field(default_factory=list)
    errors: list[FileError] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    modes: dict[str, Decision] = field(default_factory=dict)  # each linted file's deployment mode and why

    def __iter__(self):
        return iter(self.findings)

    def __len__(self) -> int:
        return len(self.findings)

    @property
    def exit_code(self) -> int:
        if self.errors:
            return 2
        return 1 if self.findings else 0

    def to_json(self) -> str:
        return json.dumps([f.to_dict() for f in self.findings], indent=2, ensure_ascii=False) + "\n"
