"""Deployment context: the dispatch prompt line and the facts a progress.md states.

Both parsers are total: any text yields a result (possibly empty); only a line that clearly tries
to state a deployment mode in an unknown wording is an error, because guessing it would be silent.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.files import read_input_text

_COLON = r"[:：]"
# The value runs to the end of the line; alternatives inside it are split by _ALTERNATIVES.
# The key in the wordings prompts use (Chinese or English): a line in any of them states the mode, so
# one that cannot be mapped is refused rather than dropped (the default mode would then win silently).
_DEPLOY_KEY = r"(?:部署模式|部署方式|部署形态|\bdeploy(?:ment)?[ _-]?mode\b)"
_DEPLOY_LINE = re.compile(rf"{_DEPLOY_KEY}[*`_ \t\u3000]*{_COLON}[ \t\u3000]*(?P<value>[^\r\n]*)", re.IGNORECASE)
_ALTERNATIVES = re.compile(r"[|/，,;；、]|还是|或者|或|\bor\b", re.IGNORECASE)
# Values that say the mode is not decided yet: no statement, not an unknown wording.
_UNDECIDED = ("待定", "未定", "未知", "不确定", "tbd", "todo", "unknown", "n/a", "none", "无", "-", "?", "？")
# Decoration around a value: Markdown emphasis/code, quotes, brackets, full-width spaces.
_DECORATION = "`*_ \t\u3000\"'“”‘’「」『』【】[]()（）<>《》"
_MODE_WORDS = {
    "framework": ("框架部署", "框架模式", "框架", "framework"),
    "standalone": ("独立部署", "独立模式", "独立", "standalone", "independent"),
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
        # Quote the statement itself, not the rest of a (possibly one-line) prompt.
        first = _ALTERNATIVES.split(m.group("value"))[0]
        found.append((mode, _short((text[m.start():m.start("value")] + first).strip(), 40)))
    if not found:
        return DispatchFacts(None, None)
    modes = {mode for mode, _ in found}
    if len(modes) > 1:
        raise InputError(where, f"states both deployment modes: {[line for _, line in found]}", field="部署模式")
    return DispatchFacts(found[0][0], found[0][1])


@dataclass(frozen=True)
class Stated:
    """A value stated in progress.md, its line (1-based) and the phrase that stated it (shortened)."""

    value: object
    line: int
    text: str
    kind: str = "key"  # key (a `key: value` line), table (a cell), inline (`TP=4` in a line), prose


# The facts progress.md may state, with the label used in messages (the usual Chinese key).
FACT_LABELS = {
    "deploy_mode": "部署模式",
    "attn_tp_size": "attn_tp_size",
    "num_cards": "部署卡数",
    "npu_model": "NPU 型号",
    "hbm_gb": "单卡 HBM",
    "exe_mode": "exe_mode",
    "dynamic_graph": "enable_dynamic_graph",
}
# The framework's execution modes (executor/core/config/inference_config.py: model_config.exe_mode).
EXE_MODES = ("eager", "npugraph_ex", "ge_graph")
_BOOLEANS = {"true": True, "false": False, "yes": True, "no": False, "1": True, "0": False, "是": True, "否": False,
             "开": True, "关": False}


@dataclass
class ProgressFacts:
    path: str | None = None
    deploy_mode: Stated | None = None
    attn_tp_size: Stated | None = None
    num_cards: Stated | None = None
    npu_model: Stated | None = None
    hbm_gb: Stated | None = None
    exe_mode: Stated | None = None  # eager | npugraph_ex | ge_graph (the yaml's model_config.exe_mode)
    dynamic_graph: Stated | None = None  # True | False (the yaml's model_config.enable_dynamic_graph)
    # fact -> one statement per distinct value, when progress.md states the fact in contradicting ways
    # (the fact itself is then None: no value is picked silently).
    conflicts: dict[str, list[Stated]] = field(default_factory=dict)
    starting_point: list[Stated] = field(default_factory=list)  # legacy_cache_unit | kv_list | paged
    runner_files: list[str] = field(default_factory=list)
    unclosed_section: int | None = None  # line of a kvcache begin marker with no end: the rest is not read

    def where(self, stated: Stated) -> str:
        return f"{self.path or 'progress.md'}:{stated.line}"


# key patterns (normalized: NFKC, lower-cased, no spaces/emphasis, '-' -> '_') -> fact name
_KEYS = [
    (re.compile(r"^(部署模式|部署方式|部署形态|deploy_?mode|deployment(_?mode)?)$"), "deploy_mode"),
    (re.compile(r"^((attn|attention|注意力)_?tp(_?size)?|tp(_?size)?|张量并行(度|大小)?|注意力tp切分)$"), "attn_tp_size"),
    (re.compile(r"^(部署卡数|卡数|总卡数|npu数量|npu卡数|world_?size|num_?cards|cards)$"), "num_cards"),
    (re.compile(r"^(npu型号|芯片型号|硬件型号|硬件|设备型号|npu|device)$"), "npu_model"),
    (re.compile(r"^(单卡hbm|hbm|单卡显存|显存|hbm容量|单卡hbm容量|每卡hbm|单卡内存)$"), "hbm_gb"),
    (re.compile(r"^(exe_?mode|执行模式|运行模式|图模式)$"), "exe_mode"),
    (re.compile(r"^(enable_?dynamic_?graph|dynamic_?graph|动态图)$"), "dynamic_graph"),
]
# `key: value` / `key = value` anywhere a line starts: bullets, numbered items, headings, quotes, YAML.
_KV = re.compile(r"^\s*(?:>\s*)*(?:#{1,6}\s+)?(?:[-*+]\s+|\d{1,3}[.)、]\s*)?"
                 r"(?P<key>[^:=|]{1,40}?)\s*[:=]\s*(?P<value>.*?)\s*$")
_SEPARATOR_ROW = re.compile(r"^\s*\|?\s*:?-{2,}:?\s*(\|\s*:?-{2,}:?\s*)*\|?\s*$")
# Attention TP inside a line or cell: attn_tp_size=4, TP=4, attention TP 4, attn TP: 4, TP4.
_TP = re.compile(r"(?<![a-z0-9_])(?P<key>(?:attn|attention|注意力)[ _-]?tp(?:[ _-]?size)?|tp(?:[ _-]?size)?)(?![a-z])"
                 r"\s*(?:[=:]\s*|\s+)?(?P<num>[-+]?\d+(?:\.\d+)?)(?![\d.])")
# A bare "TP" that belongs to another module's split is not the attention TP.
_OTHER_TP = re.compile(r"(moe|embed(?:ding)?|lm_?head|dense|mlp|ffn|experts?|专家|o_?proj|shared|dp)[ _\-/]*$")
_CARDS = re.compile(r"(?<![a-z0-9_])(?:world_?size|num_?cards|部署卡数)\s*[=:]\s*(?P<num>[-+]?\d+(?:\.\d+)?)(?![\d.])")
# Deployment mode stated in prose; a negation just before the phrase states the other mode.
_PROSE_MODES = [
    ("framework", re.compile(r"框架部署|框架模式|接入框架|框架接入|framework[ -](?:mode|deployment)")),
    ("standalone", re.compile(r"独立部署|独立模式|(?<![a-z_/.-])standalone(?:[ -](?:mode|deployment))?(?![a-z_/-]|\.[a-z])")),
]
_NEGATION = re.compile(r"(不|非(?!常)|没有|没|无需|无须|未|并非|勿|\bnot\b|\bno\b|\bwithout\b|instead of|rather than|non-?)")
_CLAUSE_END = re.compile(r"[,.;!?()\[\]{}|、。;:「」『』【】]")
_OWN_MARKER = re.compile(r"<!--\s*kvcache:(?P<edge>begin|end)\s+(?P<section>[\w.-]+)\s*-->")
_FENCE = re.compile(r"^\s*(```|~~~)")
_NUMBER = re.compile(r"(?<![a-z0-9_.])(?P<sign>[-+]?)(?P<num>\d+(?:\.\d+)?)\s*(?P<unit>[a-z]+)?")
_UNDECIDED_WORDS = ("待定", "未定", "未知", "不确定", "tbd", "todo", "unknown", "n/a")
_UNDECIDED_EXACT = {"", "-", "--", "—", "?", "无", "none", "null", "n/a", "na", "x", "n"}
_MAX_COUNT = 100_000  # no deployment has more cards or TP ranks than this
_HBM_UNITS = {None: 1.0, "g": 1.0, "gb": 1.0, "gib": 1.0, "t": 1024.0, "tb": 1024.0, "tib": 1024.0,
              "m": 1 / 1024, "mb": 1 / 1024, "mib": 1 / 1024}
_RUNNER = re.compile(r"\brunner_[A-Za-z0-9_]+\.py\b")


def _norm(text: str) -> str:
    """Full-width colons, digits and letters become ASCII; the case is folded."""
    return unicodedata.normalize("NFKC", text).lower()


def _quote(text: str, low: str, m: re.Match) -> str:
    """The matched phrase in the author's own characters when normalizing kept the offsets."""
    return _short(text[m.start():m.end()] if len(low) == len(text) else m.group(0))


def _fact_of_key(key: str) -> str | None:
    k = re.sub(r"[\s`*_]+", "_", _norm(key)).strip("_").replace("-", "_")
    k = re.sub(r"_(?=[\u4e00-\u9fff])|(?<=[\u4e00-\u9fff])_", "", k)  # 单卡 HBM -> 单卡hbm
    for pattern, name in _KEYS:
        if pattern.match(k) or pattern.match(k.replace("_", "")):
            return name
    return None


def _undecided(value: str) -> bool:
    v = value.strip(_DECORATION).lower()
    return v in _UNDECIDED_EXACT or v.startswith(_UNDECIDED_WORDS)


def _foreign_lines(text: str) -> tuple[list[tuple[int, str]], int | None]:
    """(line number, line) of everything outside our own kvcache sections (what we wrote is never
    evidence), and the line of a begin marker that never ends (None when every section is closed)."""
    out: list[tuple[int, str]] = []
    inside: str | None = None
    opened = None
    for n, raw in enumerate(text.split("\n"), start=1):
        raw = raw.rstrip("\r")
        m = _OWN_MARKER.search(raw)
        if inside is None:
            if m and m.group("edge") == "begin":
                inside, opened = m.group("section"), n
                raw = raw[: m.start()]
            out.append((n, raw))
        elif m and m.group("edge") == "end" and m.group("section") == inside:
            inside = None
            out.append((n, raw[m.end():]))
    return out, opened if inside is not None else None


class _Reader:
    def __init__(self, where: str):
        self.where = where
        self.said: dict[str, list[Stated]] = {name: [] for name in FACT_LABELS}

    def error(self, line: int, name: str, message: str) -> InputError:
        return InputError(f"{self.where}:{line}", message, field=FACT_LABELS[name])

    def add(self, name: str, raw_value: str, line: int, quote: str, kind: str) -> None:
        value = self.value(name, raw_value, line)
        if value is not None:
            self.said[name].append(Stated(value, line, _short(quote.strip()), kind))

    def value(self, name: str, raw: str, line: int) -> object | None:
        """The stated value, None when it states nothing yet ('待定', '-'), InputError when impossible."""
        v = _norm(raw).strip(_DECORATION)
        if name == "deploy_mode":
            return self.mode(raw, line)
        if _undecided(v):
            return None
        if name == "npu_model":
            return _short(raw.strip().strip(_DECORATION), 80)
        if name == "dynamic_graph":
            flag = v.strip("'\"` ").lower()
            if flag not in _BOOLEANS:
                raise self.error(line, name, f"not true or false: {_short(raw.strip())!r} (the yaml's "
                                             "model_config.enable_dynamic_graph)")
            return _BOOLEANS[flag]
        if name == "exe_mode":
            mode = v.strip("'\"` ").replace("-", "_")
            if mode not in EXE_MODES:
                raise self.error(line, name, f"unknown execution mode {_short(raw.strip())!r} (expected one of "
                                             f"{', '.join(EXE_MODES)}, as the yaml's model_config.exe_mode)")
            return mode
        m = _NUMBER.search(v)
        if name == "hbm_gb":
            if not m:
                raise self.error(line, name, f"not a size in GB: {_short(raw.strip())!r}")
            unit = m.group("unit")
            if unit not in _HBM_UNITS:
                raise self.error(line, name, f"unknown unit {unit!r} in {_short(raw.strip())!r} (expected GB)")
            gb = float(m.group("sign") + m.group("num")) * _HBM_UNITS[unit]
            if not 0 < gb <= 1e6:
                raise self.error(line, name, f"must be a positive size in GB, got {_short(raw.strip())!r}")
            return gb
        return self.count(name, m, raw, line)

    def count(self, name: str, m: re.Match | None, raw: str, line: int) -> int:
        if not m:
            raise self.error(line, name, f"must be a positive integer, got {_short(raw.strip())!r}")
        number = m.group("sign") + m.group("num")
        if "." in number or int(number) <= 0 or int(number) > _MAX_COUNT:
            raise self.error(line, name, f"must be a positive integer (at most {_MAX_COUNT}), got {number}")
        return int(number)

    def mode(self, raw: str, line: int) -> str | None:
        parts = [p.strip(_DECORATION) for p in _ALTERNATIVES.split(raw)]
        if not parts[0] or _undecided(parts[0]):
            return None
        mode = _mode_of(parts[0])
        if mode is not None and {_mode_of(p) for p in parts[1:]} - {None, mode}:
            raise self.error(line, "deploy_mode", f"lists both deployment modes in {_short(raw.strip())!r} "
                                                  "(a template?): state one")
        if mode is None:
            modes = {m for m, _ in _prose_modes(raw)}
            if len(modes) == 1:
                return modes.pop()
            raise self.error(line, "deploy_mode", f"unknown deployment wording {_short(raw.strip())!r} "
                                                  "(expected 框架部署 or 独立部署)")
        return mode

    def inline(self, text: str, line: int, prose: bool) -> None:
        low = _norm(text)
        for m in _TP.finditer(low):
            if m.group("key").startswith("tp") and _OTHER_TP.search(low[: m.start()]):
                continue
            number = _NUMBER.search(m.group("num"))
            self.said["attn_tp_size"].append(Stated(self.count("attn_tp_size", number, m.group(0), line), line,
                                                    _quote(text, low, m), "inline"))
        for m in _CARDS.finditer(low):
            number = _NUMBER.search(m.group("num"))
            self.said["num_cards"].append(Stated(self.count("num_cards", number, m.group(0), line), line,
                                                 _quote(text, low, m), "inline"))
        if prose:
            for mode, phrase in _prose_modes(text):
                self.said["deploy_mode"].append(Stated(mode, line, phrase, "prose"))

    def facts(self, facts: ProgressFacts) -> ProgressFacts:
        for name, statements in self.said.items():
            distinct: dict[object, Stated] = {}
            for s in statements:
                key = s.value.lower() if isinstance(s.value, str) else s.value
                distinct.setdefault(key, s)
            if len(distinct) == 1:
                setattr(facts, name, statements[0])
            elif len(distinct) > 1:
                facts.conflicts[name] = list(distinct.values())
        return facts


def _prose_modes(text: str) -> list[tuple[str, str]]:
    """(mode, quoted phrase) for each deployment phrase in ``text``; a negated phrase states the other mode."""
    low = _norm(text)
    out: list[tuple[str, str]] = []
    for mode, pattern in _PROSE_MODES:
        for m in pattern.finditer(low):
            clause = _CLAUSE_END.split(low[: m.start()])[-1][-8:]
            negation = _NEGATION.search(clause)
            stated = ("standalone" if mode == "framework" else "framework") if negation else mode
            phrase = (clause[negation.start():] if negation else "") + m.group(0)
            if len(low) == len(text):  # quote the author's characters
                phrase = text[m.start() - len(phrase) + len(m.group(0)):m.end()]
            if (stated, phrase) not in out:
                out.append((stated, phrase))
    return out


def _cells(row: str) -> list[str]:
    body = row.strip()
    body = body[1:] if body.startswith("|") else body
    body = body[:-1] if body.endswith("|") and not body.endswith("\\|") else body
    return [c.strip() for c in re.split(r"(?<!\\)\|", body)]


def parse_progress(text: str, where: str = "progress.md") -> ProgressFacts:
    """Extract the KV-relevant facts a progress.md states, wherever and however migrator output states them.

    Read: `key: value` lines with or without a bullet (half- or full-width colon, `=` too), Markdown
    tables (a key column with a value column, or a header naming the fact over a value column, and
    cells such as `attn_tp_size=4`), attention TP written inline (`TP=4`, `attention TP 4`), and the
    deployment mode in prose with its negations. Our own kvcache sections are skipped. An impossible
    value raises InputError (file:line, field); facts stated in contradicting ways land in
    ``conflicts`` with no value picked.
    """
    facts = ProgressFacts(path=where)
    reader = _Reader(where)
    lines, facts.unclosed_section = _foreign_lines(text)
    in_code = False
    header: dict[int, str] = {}  # column -> fact, for the Markdown table being read
    for i, (lineno, raw) in enumerate(lines):
        if _FENCE.match(raw):
            in_code = not in_code
            continue
        stripped = raw.strip()
        if stripped.startswith("|") and stripped.count("|") >= 2:
            if _SEPARATOR_ROW.match(stripped):
                continue
            cells = _cells(stripped)
            following = lines[i + 1][1] if i + 1 < len(lines) else ""
            if _SEPARATOR_ROW.match(following.strip()) and "-" in following:
                header = {col: name for col, cell in enumerate(cells) if (name := _fact_of_key(cell))}
                continue
            key_fact = _fact_of_key(cells[0]) if len(cells) >= 2 and 0 not in header else None
            for col, cell in enumerate(cells):
                if col in header:
                    reader.add(header[col], cell, lineno, f"{cells[0]}: {cell}", "table")
                elif key_fact and col == 1:
                    reader.add(key_fact, cell, lineno, f"{cells[0]}: {cell}", "table")
                elif not (key_fact and col == 0):
                    reader.inline(cell, lineno, prose=not in_code)
        else:
            header = {}
            m = _KV.match(_norm(raw))
            name = _fact_of_key(m.group("key")) if m else None
            if name:
                reader.add(name, _value_part(raw), lineno, stripped, "key")
            else:
                reader.inline(raw, lineno, prose=not in_code and not stripped.startswith("#"))
        low = raw.lower()
        if "cache_unit" in low:
            facts.starting_point.append(Stated("legacy_cache_unit", lineno, stripped))
        if re.search(r"list\s*of\s*\(\s*k\s*,\s*v\s*\)|past_key_values", low):
            facts.starting_point.append(Stated("kv_list", lineno, stripped))
        if "get_cache_info" in low or "block_table" in low:
            facts.starting_point.append(Stated("paged", lineno, stripped))
        for runner in _RUNNER.findall(raw):
            if runner not in facts.runner_files:
                facts.runner_files.append(runner)
    return reader.facts(facts)


def _value_part(raw: str) -> str:
    """The text after the first key separator (':' '：' '='), in the line's own characters."""
    m = re.search(r"[:：=]", raw)
    return raw[m.end():] if m else ""


def load_progress(path: str | Path) -> ProgressFacts:
    text = read_input_text(path)
    return parse_progress(text, str(Path(path)))
