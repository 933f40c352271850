"""Every validation check carries a stable ID from one registry (validators/pipeline/check_ids.py).

Report.add refuses a name no entry matches, so an unregistered check fails the first run that reports it;
the call sites under validators/ are read here too, so one that no test runs cannot slip through.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from model_infer_kvcache.validators.pipeline.check_ids import BY_ID, CHECKS, UnregisteredCheck, check_def
from model_infer_kvcache.validators.pipeline.report import Report

ROOT = Path(__file__).resolve().parent.parent
LINKS = {"init": "1", "runtime": "2", "numeric": "3", "release": "4"}


def test_ids_are_unique_and_numbered_by_link():
    assert len(BY_ID) == len(CHECKS)
    assert len({(c.link, c.name) for c in CHECKS}) == len(CHECKS)
    for c in CHECKS:
        assert re.fullmatch(r"V[1-4][0-9]{2}", c.id) and c.id[1] == LINKS[c.link], c


def test_report_carries_the_id_and_refuses_an_unregistered_name():
    report = Report(backend="emulated", deploy_mode="framework", model_type="qwen3", manifest_hash="x")
    report.add("logits vs transformers max |diff| <= 1e-09", "numeric", True)
    report.add("as written: FA call arguments match the manifest", "runtime", False)
    report.add("rank 1: finished", "runtime", True)
    assert [c.id for c in report.checks] == ["V301", "V209", "V204"]
    assert [c["id"] for c in report.to_dict()["checks"]] == ["V301", "V209", "V204"]
    assert "| V209 | runtime | as written: FA call arguments match the manifest | ❌ |" in report.to_markdown()
    with pytest.raises(UnregisteredCheck, match="check_ids.py"):
        report.add("cache looks fine", "runtime", True)
    with pytest.raises(UnregisteredCheck):  # a registered name under another link is not that check
        report.add("FA call arguments match the manifest", "numeric", True)


def _template(node: ast.AST, constants: dict[str, str]) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "<N>" for v in node.values)
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    return None


def test_every_call_site_names_a_registered_check():
    trees = {p: ast.parse(p.read_text(encoding="utf-8")) for p in sorted((ROOT / "validators").rglob("*.py"))}
    constants = {t.id: n.value.value for tree in trees.values() for n in tree.body if isinstance(n, ast.Assign)
                 and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                 for t in n.targets if isinstance(t, ast.Name)}
    sites, unknown = 0, []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add"
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value in LINKS):
                name = _template(node.args[0], constants)
                assert name is not None, f"{path}:{node.lineno}: a check name the registry cannot be matched to"
                sites += 1
                try:
                    found = check_def(node.args[1].value, name)
                except UnregisteredCheck:
                    unknown.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
                    continue
                assert found.name == name, (path, node.lineno, name, found)
    assert unknown == [] and sites >= 45


def test_a_non_finite_measurement_is_written_as_strict_json():
    """A NaN logit gives max_abs_diff inf or nan: report.json must stay parseable by strict JSON readers (jq, JS),
    so the value is the string "inf" / "nan", not the bare Infinity / NaN Python's json would write."""
    import json

    from model_infer_kvcache.validators.pipeline.report import Report

    report = Report(backend="emulated", deploy_mode="framework", model_type="m", manifest_hash="h")
    report.add("logits vs transformers max |diff| <= 1e-09", "numeric", False, max_abs_diff=float("inf"),
               spread=[float("nan"), 1.5, float("-inf")])
    text = report.to_json()

    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    measured = json.loads(text, parse_constant=refuse)["checks"][0]["measured"]
    assert measured == {"max_abs_diff": "inf", "spread": ["nan", 1.5, "-inf"]}
    assert report.checks[0].measured["max_abs_diff"] == float("inf")  # the in-memory report keeps the number
