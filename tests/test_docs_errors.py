"""references/errors.md: one section per lint rule, whose snippets really behave as the text says.

The wrong snippet of each rule must make `kvcache lint` report that rule; the right snippet must
be clean (no finding of any rule). KV8xx sections name the model kind and framework generation
of the manifest they are linted against (``<!-- lint-manifest: KIND GEN -->``).
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest
from model_infer_kvcache.validators.docgen.doc_tables import MODEL_KINDS, kind_manifest
from model_infer_kvcache.validators.lint import RULES, lint_source

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "references" / "errors.md"
_SECTION = re.compile(r"^### (KV[0-9]{3})\n(.*?)(?=^### |^## |\Z)", re.MULTILINE | re.DOTALL)
_SNIPPET = re.compile(r"(错误写法|正确写法)[::]\s*\n+```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
_MANIFEST = re.compile(r"<!-- lint-manifest: (\S+) (G[012]) -->")


def sections(text: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in _SECTION.finditer(text)}


@cache
def _manifest(kind: str, gen: str):
    return kind_manifest(kind, gen)


def snippets(section: str) -> tuple[str, str, object]:
    found = dict(_SNIPPET.findall(section))
    assert set(found) == {"错误写法", "正确写法"}, f"needs one wrong and one right python snippet, got {set(found)}"
    match = _MANIFEST.search(section)
    manifest = _manifest(match.group(1), match.group(2)) if match else None
    return found["错误写法"], found["正确写法"], manifest


def test_book_has_exactly_one_section_per_rule():
    text = BOOK.read_text(encoding="utf-8")
    ids = re.findall(r"^### (KV[0-9]{3})", text, re.MULTILINE)
    assert sorted(ids) == sorted(RULES)
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("rule_id", sorted(RULES))
def test_wrong_snippet_fires_its_rule_and_right_snippet_is_clean(rule_id: str):
    section = sections(BOOK.read_text(encoding="utf-8"))[rule_id]
    wrong, right, manifest = snippets(section)
    rule = RULES[rule_id]
    if rule.needs_manifest:
        assert manifest is not None, f"{rule_id} needs a <!-- lint-manifest: KIND GEN --> line"
    assert f"`{rule.name}`" in section, f"{rule_id} section should name the rule ({rule.name})"
    fired = {f.rule for f in lint_source(wrong, path=f"<{rule_id} wrong>", manifest=manifest)}
    assert rule_id in fired, f"wrong snippet of {rule_id} does not trigger it (found {sorted(fired)})"
    clean = lint_source(right, path=f"<{rule_id} right>", manifest=manifest)
    assert not clean, f"right snippet of {rule_id} is not clean: {[(f.rule, f.line, f.message) for f in clean]}"


def test_manifest_kinds_named_in_the_book_exist():
    kinds = {k.key for k in MODEL_KINDS}
    named = set(_MANIFEST.findall(BOOK.read_text(encoding="utf-8")))
    assert named and {kind for kind, _ in named} <= kinds

