"""What every kind's render module shares: the refusal naming a manifest field."""

from __future__ import annotations

from model_infer_kvcache.analyzer.errors import InputError


def bad(field: str, message: str) -> InputError:
    return InputError("--manifest", message, field=field)
