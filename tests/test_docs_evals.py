"""evals/evals.json: the upstream skills' format (evals/evals.schema.json), the required case kinds,
and the command cases kept true against the code (analyze output, lint findings, report checks).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EVALS = ROOT / "evals" / "evals.json"
SCHEMA = ROOT / "evals" / "evals.schema.json"


def schema_errors(value, schema: dict, where: str = "$") -> list[str]:
    """The JSON Schema subset evals.schema.json uses (type, enum, required, properties,
    additionalProperties false, items, minItems, minLength, minimum); kept here so the check needs no
    extra dependency."""
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "number": (int, float)}
    errors: list[str] = []
    kind = schema.get("type")
    if kind == "integer":
        if not isinstance(value, int) or isinstance(value, bool):
            return [f"{where}: expected integer"]
    elif kind and (not isinstance(value, types[kind]) or (kind != "boolean" and isinstance(value, bool))):
        return [f"{where}: expected {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} not in {schema['enum']}")
    if "minLength" in schema and len(value) < schema["minLength"]:
        errors.append(f"{where}: shorter than {schema['minLength']}")
    if "minimum" in schema and value < schema["minimum"]:
        errors.append(f"{where}: below {schema['minimum']}")
    if kind == "object":
        errors += [f"{where}: missing {key!r}" for key in schema.get("required", []) if key not in value]
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is False:
            errors += [f"{where}: unknown key {key!r}" for key in value if key not in props]
        for key, sub in props.items():
            if key in value:
                errors += schema_errors(value[key], sub, f"{where}.{key}")
    if kind == "array":
        if len(value) < schema.get("minItems", 0):
            errors.append(f"{where}: fewer than {schema['minItems']} items")
        for i, item in enumerate(value):
            errors += schema_errors(item, schema.get("items", {}), f"{where}[{i}]")
    return errors


def load() -> dict:
    return json.loads(EVALS.read_text(encoding="utf-8"))


def by_file(name: str) -> dict:
    cases = [e for e in load()["evals"] if any(f.endswith(name) for f in e["files"])]
    assert len(cases) == 1, name
    return cases[0]


def contains(case: dict) -> list[str]:
    return [x["pattern"] for x in case["expectations"] if x["type"] == "contains"]


# --------------------------------------------------------------------------- format


def test_evals_match_the_format_schema():
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    assert schema_errors(load(), schema) == []


def test_schema_check_rejects_malformed_cases():
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    bad = load()
    bad["evals"][0] = dict(bad["evals"][0], id="1", extra=True)
    del bad["evals"][1]["prompt"]
    bad["evals"][2]["expectations"] = [{"type": "regex", "pattern": "x", "description": "d"}]
    errors = schema_errors(bad, schema)
    assert "$.evals[0]: unknown key 'extra'" in errors
    assert "$.evals[0].id: expected integer" in errors
    assert "$.evals[1]: missing 'prompt'" in errors
    assert any(e.startswith("$.evals[2].expectations[0].type:") for e in errors)


def test_cases_are_consistent():
    data = load()
    skill_meta = (ROOT / "SKILL.md").read_text(encoding="utf-8").split("\n---\n", 1)[0]
    assert f"name: {data['skill_name']}" in skill_meta
    cases = data["evals"]
    assert len(cases) >= 10
    assert [c["id"] for c in cases] == list(range(1, len(cases) + 1))
    assert len({c["title"] for c in cases}) == len(cases)
    for case in cases:
        for path in case["files"]:
            assert (ROOT / path).is_file(), path
            assert path in case["prompt"], f"case {case['id']} does not point the agent at {path}"
        for x in case["expectations"]:
            if x["type"] == "skill_activated":
                assert x["pattern"] == data["skill_name"]


# The six kinds of the upstream evals, plus the cases that need the commands.
REQUIRED = {
    "three-mode overview": ("连续缓存", "分页注意力", "MLA"),
    "block_table vs slot_mapping": ("block_table", "slot_mapping", "每个 decode 步"),
    "MLA memory and absorb": ("MLA", "省显存", "absorb"),
    "missing information": ("帮我给模型接入 KVCache",),
    "choosing this skill": ("只说方向",),
    "training memory out of scope": ("训练",),
    "analyze a config": ("config.json", "命令"),
    "lint a buggy file": ("buggy_modeling", "工具"),
    "read a failing report": ("validate", "报告"),
}


@pytest.mark.parametrize("kind", list(REQUIRED))
def test_required_case_kind_is_present(kind: str):
    words = REQUIRED[kind]
    assert any(all(w in c["prompt"] for w in words) for c in load()["evals"]), kind


def test_choosing_case_has_distractors_and_out_of_scope_case_expects_a_refusal():
    cases = load()["evals"]
    chooser = next(c for c in cases if "只说方向" in c["prompt"])
    assert len(chooser["config"]["distractor_skills"]) >= 2
    training = next(c for c in cases if "训练" in c["prompt"])
    assert "不适用" in training["expected_output"]


# --------------------------------------------------------------------------- command cases vs code


def test_analyze_case_expects_what_the_analyzer_decides():
    from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
    from model_infer_kvcache.analyzer.decisions_table import decisions_markdown

    case = by_file("gpt_oss_20b_config.json")
    m = analyze(AnalyzeRequest(config=str(ROOT / case["files"][0]), dispatch="部署模式: 框架部署",
                               framework_api="G2"))
    table = decisions_markdown(m)
    values = [p for p in contains(case) if not p.startswith("kvcache ")]
    assert values and all(p in table for p in values), [p for p in values if p not in table]
    sliding = [layer for layer in m.layers if layer.attn_type == "SlidingWindow"]
    # the numbers the expected output states
    assert m.fa.version == "v2" and m.mixed_attn_types and m.fa.input_layout == "TND"
    assert {(layer.sparse_mode.prefill, layer.sparse_mode.decode, layer.pre_tokens) for layer in sliding} == {(4, 4, 127)}
    for text in ("pre_tokens 127", "sparse_mode 4", "v2", "0.125"):
        assert text in case["expected_output"], text
    assert f"{m.fa.softmax_scale:g}" == "0.125"


def test_lint_case_expects_exactly_what_the_linter_finds():
    from model_infer_kvcache.validators.lint import RULES, lint_paths

    case = by_file("buggy_modeling_qwen3.py")
    report = lint_paths([ROOT / case["files"][0]])
    assert not report.errors
    found = {f.rule for f in report.findings}
    expected = {p for p in contains(case) if re.fullmatch(r"KV[0-9]{3}", p)}
    assert expected == found
    assert expected <= set(RULES)
    for rule in found:
        assert rule in case["expected_output"]


def test_report_case_is_a_real_failing_validation_report():
    from model_infer_kvcache.validators.docgen.doc_tables import validation_checks
    from model_infer_kvcache.validators.lint.registry import RULES

    case = by_file("gpt_oss_failing_report.json")
    report = json.loads((ROOT / "evals" / "files" / "gpt_oss_failing_report.json").read_text(encoding="utf-8"))
    markdown = (ROOT / "evals" / "files" / "gpt_oss_failing_report.md").read_text(encoding="utf-8")
    assert report["passed"] is False and "未通过" in markdown
    templates = validation_checks()
    patterns = [(link, re.compile(re.escape(name).replace("<N>", r"[0-9.e+-]+") + r"\Z")) for link, name in templates]
    for check in report["checks"]:
        assert any(link == check["link"] and p.match(check["name"]) for link, p in patterns), check["name"]
        assert check["name"] in markdown
    failed = {c["name"] for c in report["checks"] if not c["passed"]}
    assert "FA call arguments match the manifest" in failed
    detail = next(c["detail"] for c in report["checks"] if c["name"] == "FA call arguments match the manifest")
    assert "pre_tokens=128 (manifest 127)" in detail
    for pattern in contains(case):
        if re.fullmatch(r"KV[0-9]{3}", pattern):
            assert pattern in RULES and RULES[pattern].name == "pre-tokens-differs"
