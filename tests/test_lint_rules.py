"""Every lint rule: a realistic snippet that triggers it at the marked line, and its corrected twin.

Fixtures live in tests/fixtures/lint/. A line ending in ``# expect: KV201`` (or ``KV201,KV204``)
must carry exactly those findings; the bad file must have no other finding, and the ``_good``
twin none at all. A first-lines header ``# lint-manifest: <config> <G0|G1|G2>`` lints the pair
against the manifest `kvcache analyze` builds from tests/fixtures/configs/<config>.json.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest
from model_infer_kvcache.validators.lint import RULES, lint_paths

FIXTURES = Path(__file__).parent / "fixtures" / "lint"
CONFIGS = Path(__file__).parent / "fixtures" / "configs"
_EXPECT = re.compile(r"#\s*expect:\s*([A-Z0-9_, ]+)")
_HEADER = re.compile(r"#\s*lint-manifest:\s*(\S+)\s+(G[012])")

BAD = sorted(FIXTURES.glob("*_bad.py"))


@cache
def manifest_for(config: str, gen: str):
    from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze

    return analyze(AnalyzeRequest(config=str(CONFIGS / f"{config}.json"), framework_api=gen))


def _manifest_of(path: Path):
    head = "\n".join(path.read_text(encoding="utf-8").splitlines()[:5])
    match = _HEADER.search(head)
    return manifest_for(match.group(1), match.group(2)) if match else None


def expected_findings(path: Path) -> set[tuple[str, int]]:
    out = set()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        match = _EXPECT.search(line)
        if match:
            out |= {(rule.strip(), number) for rule in match.group(1).split(",") if rule.strip()}
    return out


def _found(path: Path) -> set[tuple[str, int]]:
    report = lint_paths([path], manifest=_manifest_of(path))
    assert not report.errors, report.errors
    return {(f.rule, f.line) for f in report.findings}


@pytest.mark.parametrize("bad", BAD, ids=lambda p: p.stem)
def test_bad_snippet_fires_at_marked_lines(bad: Path):
    expected = expected_findings(bad)
    assert expected, f"{bad.name} marks no expected finding"
    assert _found(bad) == expected


@pytest.mark.parametrize("bad", BAD, ids=lambda p: p.stem)
def test_corrected_twin_is_clean(bad: Path):
    good = bad.with_name(bad.name.replace("_bad.py", "_good.py"))
    assert good.exists(), f"{bad.name} has no corrected twin {good.name}"
    assert not expected_findings(good)
    assert _found(good) == set()


def test_every_rule_has_a_triggering_snippet():
    covered = {rule for bad in BAD for rule, _ in expected_findings(bad)}
    assert covered == set(RULES), f"rules without a snippet: {sorted(set(RULES) - covered)}"


def test_manifest_rules_need_the_manifest():
    """Without --manifest no KV8xx rule fires (they compare code with the manifest)."""
    for bad in BAD:
        report = lint_paths([bad])
        assert not [f for f in report.findings if f.rule.startswith("KV8")], bad.name
