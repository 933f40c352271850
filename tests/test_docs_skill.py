"""SKILL.md and references/: front matter, relative links and anchors, and every command/flag they show.

Flags are checked against the usage line each command prints for ``--help`` (run once, in-process,
through the real ``kvcache`` entry point), so a renamed or removed option fails here.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from functools import cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "SKILL.md", *sorted((ROOT / "references").glob("*.md")), ROOT / "evals" / "README.md"]
SKILL = ROOT / "SKILL.md"

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_INLINE = re.compile(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)?)`(?!`)")
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
_COMMAND = re.compile(r"\bkvcache ([a-z][a-z-]*)")
_DOC_TABLES = "python -m model_infer_kvcache.validators.docgen.doc_tables"


# --------------------------------------------------------------------------- front matter


def front_matter(text: str) -> dict:
    assert text.startswith("---\n"), "SKILL.md must start with a YAML front matter block"
    end = text.index("\n---\n", 4)
    data = yaml.safe_load(text[4:end])
    assert isinstance(data, dict)
    return data


def test_front_matter_is_valid():
    meta = front_matter(SKILL.read_text(encoding="utf-8"))
    assert set(meta) <= {"name", "description", "license", "compatibility", "allowed-tools", "metadata"}, meta.keys()
    assert meta["name"] == "model-infer-kvcache"
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", meta["name"]) and len(meta["name"]) <= 64
    desc = meta["description"]
    assert isinstance(desc, str) and 0 < len(desc) <= 1024, len(desc)
    assert "<" not in desc and ">" not in desc, "no XML-like tags in the description"
    # when to use, and when not
    for term in ("block_table", "slot_mapping", "MLA", "FA", "OOM", "不适用", "训练"):
        assert term in desc, term


def test_skill_md_stays_short_enough_to_read_first():
    lines = SKILL.read_text(encoding="utf-8").count("\n")
    assert 100 <= lines <= 250, lines


# --------------------------------------------------------------------------- links


def github_slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    body = _FENCE.sub("", text)
    seen: dict[str, int] = {}
    out = set(re.findall(r'<a (?:id|name)="([^"]+)"', body))
    for heading in re.findall(r"^#{1,6} +(.+?) *$", body, re.MULTILINE):
        slug = github_slug(heading)
        n = seen.get(slug, 0)
        out.add(slug if n == 0 else f"{slug}-{n}")
        seen[slug] = n + 1
    return out


def relative_links(text: str) -> list[str]:
    body = _FENCE.sub("", text)
    links = re.findall(r"\]\(([^)\s]+)\)", body)
    return [link for link in links if not re.match(r"[a-z]+:", link)]


def test_slug_rule_matches_github_for_the_headings_we_link():
    assert github_slug("实际长度(actual_seq_lengths*)") == "实际长度actual_seq_lengths"
    assert github_slug("v1 与 v2 的参数名") == "v1-与-v2-的参数名"
    assert github_slug("KV101") == "kv101"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(doc: Path):
    problems = []
    for link in relative_links(doc.read_text(encoding="utf-8")):
        path_part, _, anchor = link.partition("#")
        target = (doc.parent / path_part).resolve() if path_part else doc
        if not target.exists():
            problems.append(f"{link}: {target} does not exist")
            continue
        if anchor:
            if target.suffix != ".md":
                problems.append(f"{link}: anchor into a non-Markdown file")
            elif anchor not in anchors(target.read_text(encoding="utf-8")):
                problems.append(f"{link}: no heading with anchor #{anchor} in {target.name}")
    assert not problems, "\n".join(problems)


def test_link_checker_catches_a_broken_link_and_anchor(tmp_path: Path):
    doc = tmp_path / "a.md"
    (tmp_path / "b.md").write_text("# Title\n\n## 小节 one\n", encoding="utf-8")
    doc.write_text("[ok](b.md#小节-one) [bad](b.md#missing) [gone](c.md)\n", encoding="utf-8")
    links = relative_links(doc.read_text(encoding="utf-8"))
    resolved = {link: (tmp_path / link.partition("#")[0]).exists() for link in links}
    assert resolved == {"b.md#小节-one": True, "b.md#missing": True, "c.md": False}
    assert "小节-one" in anchors((tmp_path / "b.md").read_text(encoding="utf-8"))
    assert "missing" not in anchors((tmp_path / "b.md").read_text(encoding="utf-8"))


# --------------------------------------------------------------------------- commands and flags


def _usage_flags(help_text: str) -> set[str]:
    usage = help_text.split("\n\n", 1)[0]
    assert usage.startswith("usage:"), help_text[:200]
    return set(_FLAG.findall(usage)) | {"--help"}


def _help_of(command: str) -> str:
    from model_infer_kvcache import cli as kvcache_cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            code = kvcache_cli.main([command, "--help"])
        except SystemExit as exc:  # argparse exits after printing help
            code = exc.code
    assert code in (0, None), f"kvcache {command} --help exited {code}"
    return out.getvalue()


@cache
def command_flags() -> dict[str, frozenset[str]]:
    """Flags of every `kvcache` command (from its --help usage), plus the doc-table checker's."""
    from model_infer_kvcache.validators.docgen.doc_tables import build_parser

    from model_infer_kvcache import cli as kvcache_cli

    flags = {name: frozenset(_usage_flags(_help_of(name))) for name in kvcache_cli._commands()}
    flags[_DOC_TABLES] = frozenset(_usage_flags(build_parser().format_help()))
    return flags


def code_snippets(text: str) -> list[str]:
    """Shell lines of fenced blocks (continuations joined, comments dropped) and inline code spans."""
    out = []
    for block in _FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            out.append(re.sub(r"\s#\s.*$", "", line))
    body = _FENCE.sub("", text)
    out += [span.replace("\n", " ") for span in _INLINE.findall(body)]
    return out


def invocations(snippet: str) -> list[tuple[str, list[str]]]:
    """(command, flags) of each `kvcache <cmd> ...` or doc-table checker call in one snippet."""
    found = []
    starts = [(m.start(), m.group(1), m.end()) for m in _COMMAND.finditer(snippet)]
    starts += [(m.start(), _DOC_TABLES, m.end()) for m in re.finditer(re.escape(_DOC_TABLES), snippet)]
    starts.sort()
    for i, (_, command, end) in enumerate(starts):
        stop = starts[i + 1][0] if i + 1 < len(starts) else len(snippet)
        rest = re.split(r"[;|]|&&", snippet[end:stop], maxsplit=1)[0]
        found.append((command, _FLAG.findall(rest)))
    return found


def test_invocation_parser_reads_commands_flags_and_stops_at_the_next_command():
    snippet = "kvcache analyze --config c.json --out m.json && kvcache render --manifest m.json --out r/"
    assert invocations(snippet) == [("analyze", ["--config", "--out"]), ("render", ["--manifest", "--out"])]
    assert invocations("python -m model_infer_kvcache.validators.docgen.doc_tables --write") == [(_DOC_TABLES, ["--write"])]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_command_and_flag_shown_exists(doc: Path):
    flags = command_flags()
    everything = frozenset().union(*flags.values())
    problems = []
    seen_commands = 0
    for snippet in code_snippets(doc.read_text(encoding="utf-8")):
        calls = invocations(snippet)
        seen_commands += len(calls)
        for command, used in calls:
            if command not in flags:
                problems.append(f"unknown command `kvcache {command}` in: {snippet.strip()}")
                continue
            problems += [f"`{command}` has no {flag} (in: {snippet.strip()})" for flag in used
                         if flag not in flags[command]]
        if not calls:
            # a bare flag in inline code (e.g. `--fa-version`) must belong to some command
            problems += [f"{flag} is not a flag of any command (in: {snippet.strip()})"
                         for flag in _FLAG.findall(snippet) if flag not in everything]
    assert not problems, "\n".join(problems)
    if doc == SKILL:
        assert seen_commands >= 8, "SKILL.md must show the workflow's commands"


def test_skill_workflow_shows_each_step_command_in_order():
    text = SKILL.read_text(encoding="utf-8")
    workflow = text[text.index("## 工作流"):text.index("## 第一层")]
    positions = [workflow.index(f"kvcache {cmd}") for cmd in ("analyze", "render", "lint", "validate")]
    assert positions == sorted(positions)
    for must in ("--write-progress", "INTEGRATION.md", "--manifest manifest.json", "自验证结果", "--markdown"):
        assert must in workflow, must


def test_flag_check_fails_on_an_invented_flag():
    flags = command_flags()
    calls = invocations("kvcache analyze --config c.json --no-such-flag")
    assert [f for c, used in calls for f in used if f not in flags[c]] == ["--no-such-flag"]
    assert "--window-reading" in flags["analyze"] and "--markdown" in flags["validate"]


def test_evals_mention_only_existing_flags():
    evals = json.loads((ROOT / "evals" / "evals.json").read_text(encoding="utf-8"))
    everything = frozenset().union(*command_flags().values())
    text = " ".join(e["prompt"] + " " + e["expected_output"] for e in evals["evals"])
    unknown = sorted({f for f in _FLAG.findall(text) if f not in everything})
    assert not unknown, unknown
    commands = set(_COMMAND.findall(text))
    assert commands <= set(command_flags()), commands - set(command_flags())


def test_skill_text_covers_the_terms_the_text_evals_expect():
    """Each `contains` expectation of the evals answered from text alone appears in SKILL.md."""
    evals = json.loads((ROOT / "evals" / "evals.json").read_text(encoding="utf-8"))
    skill = SKILL.read_text(encoding="utf-8")
    missing = [(e["id"], x["pattern"]) for e in evals["evals"] if not e["files"]
               for x in e["expectations"] if x["type"] == "contains" and x["pattern"] not in skill]
    assert not missing, missing
