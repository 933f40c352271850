"""Operator facts have one home (``analyzer/operators``): no copy elsewhere, every consumer's view equals it.

The home holds the pinned torch_npu schemas and ``fa_facts`` (the FA v1/v2 keyword table, INT32_MAX,
the sparse-mode and compressed-mask constants). A copy of the keyword table, of the v1/v2 rename
pairs or of the int32 "no limit" literal anywhere in the package sources, the templates, the tests or
the benchmarks fails here; goldens and fixtures (snippets of modeling code, code inside strings) are
exempt because they are written as a user's code would be.
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import fields
from pathlib import Path

import pytest
from model_infer_kvcache.analyzer.operators import fa_facts, schemas
from model_infer_kvcache.analyzer.operators.fa_facts import FA_KEYWORDS, FA_OPS, INT32_MAX, ROLES

ROOT = Path(__file__).resolve().parent.parent
HOME = ROOT / "analyzer" / "operators"
PACKAGES = ("analyzer", "implementer", "validators")
EXEMPT_DIRS = (ROOT / "tests" / "golden", ROOT / "tests" / "fixtures")
INT32_MAX_NAMES = re.compile(r"^_?(INT32_MAX|INT_MAX|NO_LIMIT|MAX_INT32|.*DEFAULT_PRE_TOKENS)$")
# Every spelling the table owns: the two operator names and each version's keyword of each role.
FA_NAMES = frozenset(getattr(kw, f.name) for kw in FA_KEYWORDS.values() for f in fields(kw))
KEYWORD_NAMES = FA_NAMES - set(FA_OPS.values())


def python_sources() -> list[Path]:
    files = [ROOT / "model_infer_kvcache" / "cli.py"]
    for folder in (*PACKAGES, "tests", "benchmarks"):
        files += sorted((ROOT / folder).rglob("*.py"))
    return [f for f in files if f.is_file() and not any(f.is_relative_to(d) for d in EXEMPT_DIRS)]


_INT_OPS = {ast.Pow: pow, ast.Sub: operator.sub, ast.Add: operator.add, ast.Mult: operator.mul,
            ast.LShift: operator.lshift}


def _int_value(node: ast.AST) -> int | None:
    """Value of an integer literal or of constant arithmetic on them (``2**31 - 1``), else None."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _INT_OPS:
        left, right = _int_value(node.left), _int_value(node.right)
        if left is not None and right is not None and abs(right) <= 64:
            return _INT_OPS[type(node.op)](left, right)
    return None


def _strings(nodes) -> list[str]:
    return [n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _table_names(node: ast.AST) -> set[str]:
    """FA names a table-like node lists: tuple/list/set, dict, call arguments, or a v1-vs-v2 ``a if c else b``."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        names = _strings(node.elts)
    elif isinstance(node, ast.Dict):
        names = _strings(node.values) + _strings(k for k in node.keys if k is not None)
        if not _strings(node.values) and not set(names) & KEYWORD_NAMES:
            return set()  # operator name -> object: a registry of operators, not a keyword table
    elif isinstance(node, ast.Call):
        names = _strings(node.args)
    elif isinstance(node, ast.IfExp):
        names = []
        for branch in (node.body, node.orelse):
            names += _strings([branch]) + sorted(_table_names(branch) if not isinstance(branch, ast.Dict) else
                                                 set(_strings(k for k in branch.keys if k is not None)))
    else:
        return set()
    return set(names) & FA_NAMES


def duplicates_in(source: str, where: str) -> list[str]:
    """Copies of operator facts in one Python source: the int32 literal, a definition of it, an FA name table."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if _int_value(node) == INT32_MAX:
            found.append((line, f"{where}:{line}: int32 max literal {ast.unparse(node)}"))
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            if isinstance(target, ast.Name) and INT32_MAX_NAMES.match(target.id):
                found.append((line, f"{where}:{line}: defines {target.id}"))
        names = _table_names(node)
        if len(names) >= 2:
            found.append((line, f"{where}:{line}: FA keyword/operator table {sorted(names)}"))
    return [text for _, text in sorted(found)]


# --------------------------------------------------------------------------- no copies


def test_no_operator_fact_is_copied_outside_its_home():
    problems = []
    for path in python_sources():
        if path.is_relative_to(HOME):
            continue
        problems += duplicates_in(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert not problems, "operator facts copied outside analyzer/operators:\n" + "\n".join(problems)


def _fa_call_texts(text: str) -> list[str]:
    """Argument text of every ``torch_npu.{{ c.fa.op }}(...)`` / ``{{ c.fa_module }}.{{ c.fa.op }}(...)`` call in a
    template (balanced parentheses)."""
    calls = []
    for m in re.finditer(r"(?:torch_npu|\{\{ c\.fa_module \}\})\.\{\{ c\.fa\.op \}\}\(", text):
        depth, i = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        calls.append(text[m.end():i - 1])
    return calls


def test_templates_take_every_fa_keyword_from_the_context():
    """A template that spells an FA keyword itself would render the wrong name for the other version."""
    renamed = {getattr(kw, role) for kw in FA_KEYWORDS.values() for role in ROLES}
    keyword = re.compile(r"(?<![\w.])(" + "|".join(sorted(renamed, key=len, reverse=True)) + r")\s*=(?!=)")
    problems, calls = [], 0
    for path in sorted((ROOT / "templates").rglob("*.j2")):
        text, where = path.read_text(encoding="utf-8"), path.relative_to(ROOT)
        for call in _fa_call_texts(text):
            calls += 1
            problems += [f"{where}: {m.group(0)}" for m in keyword.finditer(call)]
            problems += [f"{where}: keyword not from c.fa" for role in ROLES if role != "lse_flag" and f"{{{{ c.fa.{role} }}}}=" not in call]
        problems += [f"{where}: int32 max" for _ in re.finditer(str(INT32_MAX), text)]
        problems += [f"{where}: {op}" for op in FA_OPS.values() if re.search(rf"\b{op}\b", text)]
    assert calls >= 4 and not problems, (calls, problems)


def test_the_scanner_finds_each_kind_of_copy():
    """The duplicate finder is not vacuous: each kind of copy it looks for is reported."""
    source = '''
NO_LIMIT = 2147483647
LIMIT = 2**31 - 1
def op(pre_tokens=2147483647): ...
NAMES = ("scale", "softmax_scale")
V2 = FaArgs("npu_fused_infer_attention_score_v2", "softmax_scale")
RENAMES = {"actual_seq_lengths": "actual_seq_qlen"}
SNIPPET = "pre_tokens = 2147483647; kw = ('scale', 'softmax_scale')"  # code in a string: a fixture
ONE = {"num_heads": 2}  # one keyword of one version: a call, not a table
PICK = "actual_seq_kvlen" if v2 else "actual_seq_lengths_kv"
HEADS = {"num_query_heads": 2} if v2 else {"num_heads": 2}
OPS = {"npu_fused_infer_attention_score": f, "npu_fused_infer_attention_score_v2": g}  # a registry of ops
BY_VERSION = {"v1": "npu_fused_infer_attention_score", "v2": "npu_fused_infer_attention_score_v2"}
'''
    found = duplicates_in(source, "x.py")
    assert [f.split(":")[1] for f in found] == ["2", "2", "3", "4", "5", "6", "7", "10", "11", "13"], found
    assert sum("defines NO_LIMIT" in f for f in found) == 1


# --------------------------------------------------------------------------- the home agrees with the schemas


def test_every_role_is_a_rename_the_real_schemas_show():
    """Each version's keyword of a role is accepted by its operator only (the rename is real)."""
    from typing import get_args

    from model_infer_kvcache.analyzer.manifest import FaVersion

    v1, v2 = (schemas.accepted_keywords(FA_OPS[v]) for v in ("v1", "v2"))
    assert fa_facts.FA_VERSIONS == get_args(FaVersion) == ("v1", "v2")  # one entry per manifest fa.version
    assert set(FA_OPS.values()) <= set(schemas.load_schemas()["ops"])
    for role in ROLES:
        a, b = getattr(FA_KEYWORDS["v1"], role), getattr(FA_KEYWORDS["v2"], role)
        assert a in v1 - v2 and b in v2 - v1, role
    assert fa_facts.renames() == tuple((getattr(FA_KEYWORDS["v1"], r), getattr(FA_KEYWORDS["v2"], r)) for r in ROLES)


def test_int32_max_is_the_schemas_no_limit():
    import torch

    assert INT32_MAX == torch.iinfo(torch.int32).max
    for op in FA_OPS.values():
        for name in ("pre_tokens", "next_tokens"):
            assert schemas.default_value(op, name) == INT32_MAX, (op, name)


def test_other_version_names_carry_the_right_names_schema_default():
    for version, own in FA_KEYWORDS.items():
        other = FA_KEYWORDS["v2" if version == "v1" else "v1"]
        table = fa_facts.other_version_names(own.op)
        assert set(table) == {getattr(other, r) for r in ROLES}
        for role in ROLES:
            right = getattr(own, role)
            assert table[getattr(other, role)] == (right, schemas.op_arg(own.op, right)["default"])
    with pytest.raises(KeyError):
        fa_facts.keywords_of("npu_scatter_nd_update_")


def test_value_passed_is_the_keyword_or_the_schema_default():
    op = FA_OPS["v2"]
    assert fa_facts.value_passed(op, {"sparse_mode": 3}, "sparse_mode") == 3
    assert fa_facts.value_passed(op, {}, "sparse_mode") == 0
    assert fa_facts.value_passed(op, {}, "input_layout") == "BSH"
    assert fa_facts.value_passed(op, {}, "pre_tokens") == INT32_MAX
    with pytest.raises(KeyError):
        fa_facts.value_passed(op, {}, "scale")  # the v1 name is no argument of v2


# --------------------------------------------------------------------------- each consumer's view


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_templates_context_uses_the_homes_keywords(version):
    from model_infer_kvcache.analyzer.manifest_io import load_manifest
    from model_infer_kvcache.implementer.template_context import Names, build_context

    manifest = load_manifest(ROOT / "tests" / "golden" / f"qwen3_{version}" / "framework_g2" / "manifest.json")
    assert manifest.fa.version == version
    ctx = build_context(manifest, Names())
    assert ctx.fa == FA_KEYWORDS[version]
    assert ctx.full.prefill.pre_tokens == INT32_MAX


def test_lint_views_are_the_homes():
    from model_infer_kvcache.validators.lint import ops

    assert (ops.FA_V1, ops.FA_V2) == (FA_OPS["v1"], FA_OPS["v2"]) and ops.FA_OPS == frozenset(FA_OPS.values())
    for op in FA_OPS.values():
        assert ops.WRONG_VERSION_NAMES[op] == fa_facts.other_version_names(op)
        assert ops.accepted_keywords(op) == schemas.accepted_keywords(op)
    for op, (name, position) in ops.WRITER_INDEX_ARG.items():
        assert schemas.op_schema(op)["args"][position]["name"] == name
    assert ops.accepted_keywords("npu_not_an_op") is None


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_lint_reports_every_renamed_keyword_with_its_fix(version):
    """KV101/KV102 come from the home's table: each role's other-version name is named with the fix."""
    from model_infer_kvcache.validators.lint import lint_source

    own, other = FA_KEYWORDS[version], FA_KEYWORDS["v2" if version == "v1" else "v1"]
    kwargs = ", ".join(f"{getattr(other, role)}=x" for role in ROLES)
    found = lint_source(f"import torch_npu\n\ndef f(q, x):\n    return torch_npu.{own.op}(q, q, q, {kwargs})\n",
                        select=["KV101", "KV102", "KV103"])
    rule = "KV101" if version == "v2" else "KV102"
    assert [f.rule for f in found] == [rule] * len(ROLES)
    for finding, role in zip(found, ROLES, strict=True):
        assert f"`{getattr(other, role)}=`" in finding.message and f"`{getattr(own, role)}=`" in finding.hint


def test_emulator_front_end_views_are_the_homes():
    import inspect

    from model_infer_kvcache.validators.npu_ops import emulated, fused_attention

    assert fused_attention.V1_NAMES == FA_KEYWORDS["v1"] and fused_attention.V2_NAMES == FA_KEYWORDS["v2"]
    for kw in FA_KEYWORDS.values():
        params = inspect.signature(emulated.OPS[kw.op]).parameters
        assert {getattr(kw, role) for role in ROLES} <= set(params)
        assert params["pre_tokens"].default == params["next_tokens"].default == INT32_MAX


def test_emulator_names_the_argument_in_the_versions_spelling():
    import torch
    from model_infer_kvcache.validators.npu_ops import emulated
    from model_infer_kvcache.validators.npu_ops.errors import NpuOpError

    q = torch.zeros(2, 2, 16)
    for kw in FA_KEYWORDS.values():
        call = {kw.num_heads: 2, kw.q_lens: [2], kw.kv_lens: [3]}  # 3 KV tokens of 2: out of range
        with pytest.raises(NpuOpError, match=re.escape(kw.kv_lens)):
            emulated.OPS[kw.op](q, q, q, input_layout="TND", **call)


def test_numeric_call_check_reads_each_version_through_the_home():
    """The FA call check compares scale / heads in the called op's spelling, defaults from the schema."""
    from model_infer_kvcache.analyzer.manifest_io import load_manifest
    from model_infer_kvcache.analyzer.operators.fa_facts import RECORDED_KEYWORDS
    from model_infer_kvcache.validators.checkout_run import recorder
    from model_infer_kvcache.validators.pipeline import host_model
    from model_infer_kvcache.validators.pipeline.fa_args import check_fa_calls
    from model_infer_kvcache.validators.pipeline.report import Report

    assert host_model.RECORDED_KEYWORDS is RECORDED_KEYWORDS is recorder.RECORDED_KEYWORDS  # both modes record alike
    for kw in FA_KEYWORDS.values():
        assert {kw.scale, kw.num_heads} <= RECORDED_KEYWORDS
    for version in ("v1", "v2"):
        m = load_manifest(ROOT / "tests" / "golden" / f"qwen3_{version}" / "framework_g2" / "manifest.json")
        kw = FA_KEYWORDS[version]
        good = {"op": kw.op, "step": 0, "layer": 0, "is_prefill": True, "has_mask": True,
                "sparse_mode": m.layers[0].sparse_mode.prefill, "input_layout": m.fa.input_layout,
                kw.scale: m.fa.softmax_scale, kw.num_heads: m.parallel.num_q_heads_per_rank,
                "num_key_value_heads": m.parallel.num_kv_heads_per_rank}
        outcomes = []
        for call in (good, {k: v for k, v in good.items() if k != kw.scale}):  # scale left to the default 1.0
            report = Report(backend="emulated", deploy_mode="framework", model_type="qwen3", manifest_hash="")
            check_fa_calls(report, m, [call])
            outcomes.append((report.checks[-1].passed, report.checks[-1].detail))
        assert outcomes[0] == (True, "")
        assert not outcomes[1][0] and "scale=1.0" in outcomes[1][1], outcomes[1]


def test_doc_table_rows_follow_the_home():
    from model_infer_kvcache.validators.docgen import doc_tables

    rows = [line for line in doc_tables.fa_args_table().splitlines()[2:]]
    names = [tuple(cell.strip(" `") for cell in row.split("|")[2:4]) for row in rows]
    expected = [(getattr(FA_KEYWORDS["v1"], f.name), getattr(FA_KEYWORDS["v2"], f.name))
                for f in fields(FA_KEYWORDS["v1"])]
    assert names[:len(expected)] == expected


def test_analyzer_rules_use_the_homes_constants():
    from model_infer_kvcache.analyzer import rules
    from model_infer_kvcache.analyzer.kinds import gqa, mla

    assert rules.decide_window_tokens(None)[:2] == (INT32_MAX, 0)
    # the formats' head rules (analyzer/kinds) take the operator's limits from the op facts, not a copy
    assert gqa.MAX_GQA_RATIO is fa_facts.MAX_GQA_RATIO and mla.MLA_ROPE_DIM is fa_facts.MLA_ROPE_DIM
