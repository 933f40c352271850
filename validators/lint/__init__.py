"""Static linter for silent KV-cache / fused-attention failure patterns (`kvcache lint`).

Public API::

    from model_infer_kvcache.validators.lint import lint_paths, lint_source, RULES
    report = lint_paths(["models/"], manifest="manifest.json", select=None, ignore="KV701", mode="auto")
    report.findings   # list[Finding]: rule, path, line, col, message, hint, severity, mode, mode_reason
    report.modes      # path -> Decision(mode, reason): "framework" / "standalone" / "unknown" and why
    report.errors     # list[FileError]: files that could not be read or parsed
    report.exit_code  # 0 clean, 1 findings, 2 file errors
"""

from model_infer_kvcache.validators.lint.engine import lint_paths, lint_source
from model_infer_kvcache.validators.lint.finding import FileError, Finding, LintReport
from model_infer_kvcache.validators.lint.registry import RULES, Rule, rule_ids

__all__ = ["RULES", "FileError", "Finding", "LintReport", "Rule", "lint_paths", "lint_source", "rule_ids"]
