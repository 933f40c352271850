"""Findings and file errors, and their text / JSON renderings."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True, order=True)
class Finding:
    path: str
    line: int
    col: int  # 1-based, like compilers and ruff
    rule: str
    message: str
    hint: str
    severity: str = "error"

    def to_text(self) -> str:
        return f"{self.path}:{self.line}:{self.col}: {self.rule} {self.message} ({self.hint})"

    def to_dict(self) -> dict:
        return {"rule": self.rule, "path": self.path, "line": self.line, "col": self.col,
                "message": self.message, "hint": self.hint, "severity": self.severity}


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
