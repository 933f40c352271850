"""Deployment context: the dispatch prompt line and the facts a progress.md states.

Both parsers are total: any text yields a result (possibly empty); only a line that clearly tries
to state a deployment mode in an unknown wording is an error, because guessing it would be silent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from analyzer.errors import InputError

_COLON = r"[:：]"
# The value runs to the end of the line; alternatives inside it are split by _ALTERNATIVES.
_DEPLOY_LINE = re.compile(rf"部署模式[*`_ \t\u3000]*{_COLON}[ \t\u3000]*(?P<value>[^\r\n]*)")
_ALTERNATIVES = re.compile(r"[|/，,;；、]|还是|或者|或|\bor\b", re.IGNORECASE)
# Values that say the mode is not decided yet: no statement, not an unknown wording.
_UNDECIDED = ("待定", "未定", "未知", "不确定", "tbd", "todo", "unknown", "n/a", "none", "无", "-", "?", "？")
# Decoration around a value: Markdown emphasis/code, quotes, brackets, full-width spaces.
_DECORATION = "`*_ \t\u3000\"'“”‘’「」『』【】[]()（）<>《》"
_MODE_WORDS = {
    "framework": ("框架部署", "框架模式", "框架", "framework"),
    "standalone": ("独立部署", "独立模式", "独立", "standalone"),
}


def _mode_of(value: str) -> str | None:
    v = value.strip().strip(_DECORATION).lower()
    for mode, words in _MODE_WORDS.items():
        if any(v.startswith(w.lower()) for w in words):
            return mode
    return None


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass(frozen=True)
class DispatchFacts:
    deploy_mode: str | None
    line: str | None


def parse_dispatch(text: str | None, where: str = "--dispatch") -> DispatchFacts:
    """Find ``部署模式: 框架部署|独立部署`` (ASCII or full-width colon) in a dispatch prompt."""
    if not text:
        return DispatchFacts(None, None)
    found: list[tuple[str, str]] = []
    for m in _DEPLOY_LINE.finditer(text):
        parts = [p.strip(_DECORATION) for p in _ALTERNATIVES.split(m.group("value"))]
        value = parts[0]
        if not value or value.lower().startswith(_UNDECIDED):
            continue  # "部署模式:" with nothing (or "待定") after it states nothing
        mode = _mode_of(value)
        others = {_mode_of(p) for p in parts[1:]} - {None, mode}
        if mode is not None and others:
            raise InputError(where, f"lists both deployment modes in {_short(m.group(0).strip())!r} (a template?): "
                                    "state one", field="部署模式")
        if mode is None:
            raise InputError(
                where,
                f"unknown deployment wording {_short(value)!r} (expected 部署模式: 框架部署 or 部署模式: 独立部署)",
                field="部署模式",
            )
        found.append((mode, m.group(0).strip()))
    if not found:
        return DispatchFacts(None, None)
    modes = {mode for mode, _ in found}
    if len(modes) > 1:
        raise InputError(where, f"states both deployment modes: {[line for _, line in found]}", field="部署模式")
    return DispatchFacts(found[0][0], found[0][1])


@dataclass(frozen=True)
class Stated:
    """A value stated in progress.md and the line that stated it (1-based)."""

    value: object
    line: int
    text: str


@dataclass
class ProgressFacts:
    path: str | None = None
    deploy_mode: Stated | None = None
    attn_tp_size: Stated | None = None
    num_cards: Stated | None = None
    npu_model: Stated | None = None
    hbm_gb: Stated | None = None
    starting_point: list[Stated] = field(default_factory=list)  # legacy_cache_unit | kv_list | paged
    runner_files: list[str] = field(default_factory=list)


# key patterns (lower-cased, spaces removed) -> fact name
_KEYS = [
    (re.compile(r"^(部署模式|deploy_?mode|部署方式)$"), "deploy_mode"),
    (re.compile(r"^(attn_?tp_?size|注意力tp|attentiontp|attntp|attn_tp|tp|tp_?size|张量并行|注意力tp切分)$"), "attn_tp_size"),
    (re.compile(r"^(部署卡数|卡数|npu数量|npu卡数|world_?size|num_?cards|cards)$"), "num_cards"),
    (re.compile(r"^(npu型号|芯片型号|硬件型号|硬件|设备型号|npu|device)$"), "npu_model"),
    (re.compile(r"^(单卡hbm|hbm|单卡显存|显存|hbm容量|每卡hbm|单卡内存)$"), "hbm_gb"),
]
_ITEM = re.compile(rf"^\s*[-*+]\s*(?:\*\*)?(?P<key>[^:：*]+?)(?:\*\*)?\s*{_COLON}\s*(?P<value>.+?)\s*$")
_ROW = re.compile(r"^\s*\|\s*(?P<key>[^|]+?)\s*\|\s*(?P<value>[^|]+?)\s*\|")
# ASCII digits only, bounded: a stated card count or HBM size is never astronomically long.
_INT = re.compile(r"(?<![0-9])[0-9]{1,6}(?![0-9])")
_GB = re.compile(r"(?<![0-9.])([0-9]{1,6}(?:\.[0-9]{1,6})?)\s*(gb|gib|g)(?![a-z])", re.IGNORECASE)
_RUNNER = re.compile(r"\brunner_[A-Za-z0-9_]+\.py\b")


def parse_progress(text: str, where: str = "progress.md") -> ProgressFacts:
    """Extract the KV-relevant facts from a progress.md in the repository's Chinese section style."""
    facts = ProgressFacts(path=where)
    for lineno, raw in enumerate(text.splitlines(), start=1):
        m = _ITEM.match(raw) or _ROW.match(raw)
        if m:
            key = re.sub(r"[\s`]", "", m.group("key")).lower()
            value = m.group("value").strip()
            for pattern, name in _KEYS:
                if pattern.match(key) and getattr(facts, name) is None:
                    parsed = _parse_value(name, value)
                    if parsed is not None:
                        setattr(facts, name, Stated(parsed, lineno, raw.strip()))
                    break
        low = raw.lower()
        if "cache_unit" in low:
            facts.starting_point.append(Stated("legacy_cache_unit", lineno, raw.strip()))
        if re.search(r"list\s*of\s*\(\s*k\s*,\s*v\s*\)|past_key_values", low):
            facts.starting_point.append(Stated("kv_list", lineno, raw.strip()))
        if "get_cache_info" in low or "block_table" in low:
            facts.starting_point.append(Stated("paged", lineno, raw.strip()))
        for runner in _RUNNER.findall(raw):
            if runner not in facts.runner_files:
                facts.runner_files.append(runner)
    return facts


def _parse_value(name: str, value: str) -> object | None:
    if name == "deploy_mode":
        return _mode_of(value)
    if name in ("attn_tp_size", "num_cards"):
        m = _INT.search(value)
        return int(m.group(0)) if m and int(m.group(0)) > 0 else None
    if name == "hbm_gb":
        m = _GB.search(value)
        return float(m.group(1)) if m else None
    return value


def load_progress(path: str | Path) -> ProgressFacts:
    p = Path(path)
    if not p.is_file():
        raise InputError(str(p), "file not found")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(str(p), f"cannot read: {exc}") from None
    return parse_progress(text, str(p))
