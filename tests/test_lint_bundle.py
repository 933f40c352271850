"""The linter on real code: the bundle's own sources, the implementer's rendered output (clean, and
caught when mutated the way the silent bugs happen), golden files, and the speed budget."""

from __future__ import annotations

import ast
import json
import sys
from functools import cache
from pathlib import Path

import pytest
from model_infer_kvcache.analyzer.operators.fa_facts import FA_KEYWORDS
from model_infer_kvcache.validators.lint import lint_paths, lint_source

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "tests" / "fixtures" / "configs"
GOLDEN = ROOT / "tests" / "golden"

# (config, deploy mode, framework API): MLA, mixed sliding + sinks, GQA, plain MHA/GQA; every generation
RENDER_MATRIX = [
    ("deepseek_v3", "framework", "G0"), ("deepseek_v3", "framework", "G1"), ("deepseek_v3", "framework", "G2"),
    ("gpt_oss_20b", "framework", "G1"), ("gpt_oss_20b", "framework", "G2"),
    ("qwen3_8b", "framework", "G0"), ("qwen3_8b", "framework", "G2"),
    ("llama31_8b", "framework", "G1"),
    ("qwen3_8b", "standalone", None), ("deepseek_v3", "standalone", None), ("gpt_oss_20b", "standalone", None),
]


@cache
def _manifest(config: str, deploy: str, gen: str | None):
    from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze

    return analyze(AnalyzeRequest(config=str(CONFIGS / f"{config}.json"), deploy_mode=deploy, framework_api=gen))


@cache
def _rendered(config: str, deploy: str, gen: str | None) -> dict[str, str]:
    from model_infer_kvcache.implementer.render import render_manifest

    files = render_manifest(_manifest(config, deploy, gen)).files
    return {name: text for name, text in files.items() if name.endswith(".py")}


def test_bundle_code_is_clean():
    paths = [ROOT / p for p in ("analyzer", "implementer", "validators", "templates", "benchmarks", "examples",
                                "model_infer_kvcache") if (ROOT / p).exists()]
    report = lint_paths(paths)
    assert not report.errors, report.errors
    assert [f.to_text() for f in report.findings] == []
    assert len(report.files) > 20  # the walk really covered the packages


@pytest.mark.parametrize("config, deploy, gen", RENDER_MATRIX, ids=lambda v: str(v))
def test_rendered_code_is_clean_against_its_manifest(config, deploy, gen):
    manifest = _manifest(config, deploy, gen)
    files = _rendered(config, deploy, gen)
    assert files
    for name, text in files.items():
        assert [f.to_text() for f in lint_source(text, name, manifest=manifest)] == []


# ---------------------------------------------------------------- mutations of rendered code


class _RenameKeyword(ast.NodeTransformer):
    def __init__(self, old: str, new: str) -> None:
        self.old, self.new, self.done = old, new, 0

    def visit_keyword(self, node):
        if node.arg == self.old:
            node.arg = self.new
            self.done += 1
        return node


class _UnindexDict(ast.NodeTransformer):
    """``forward_metadata.<field>[key]`` -> ``forward_metadata.<field>`` (the dict passed whole)."""

    def __init__(self, field: str) -> None:
        self.field, self.done = field, 0

    def visit_Subscript(self, node):
        self.generic_visit(node)
        if isinstance(node.value, ast.Attribute) and node.value.attr == self.field:
            self.done += 1
            return node.value
        return node


class _SwapOp(ast.NodeTransformer):
    def __init__(self) -> None:
        self.done = 0

    def visit_Attribute(self, node):
        self.generic_visit(node)
        if node.attr == "npu_fused_infer_attention_score_v2":
            node.attr = "npu_fused_infer_attention_score"
            self.done += 1
        elif node.attr == "npu_fused_infer_attention_score":
            node.attr = "npu_fused_infer_attention_score_v2"
            self.done += 1
        return node


def _mutate(text: str, transformer) -> str:
    tree = transformer.visit(ast.parse(text))
    assert transformer.done, f"{type(transformer).__name__} found nothing to mutate"
    return ast.unparse(ast.fix_missing_locations(tree))


def _attention(config: str, gen: str) -> str:
    return _rendered(config, "framework", gen)["kvcache_attention.py"]


@pytest.mark.parametrize("config, gen", [("deepseek_v3", "G2"), ("gpt_oss_20b", "G2"), ("qwen3_8b", "G0")])
def test_mutated_rendered_code_is_caught(config, gen):
    manifest = _manifest(config, "framework", gen)
    text = _attention(config, gen)
    version = manifest.fa.version
    scale_kw, wrong_kw = (FA_KEYWORDS[v].scale for v in (version, "v2" if version == "v1" else "v1"))
    cases = {
        "KV101" if version == "v2" else "KV102": _RenameKeyword(scale_kw, wrong_kw),
        "KV301": _UnindexDict("block_table"),
        "KV302": _UnindexDict("slot_mapping"),
        "KV803": _SwapOp(),
    }
    for rule, transformer in cases.items():
        mutated = _mutate(text, transformer)
        found = {f.rule for f in lint_source(mutated, "kvcache_attention.py", manifest=manifest)}
        assert rule in found, (rule, found)


# ---------------------------------------------------------------- golden files


def _golden_manifest(py: Path):
    """A manifest JSON next to a golden file (or in a parent under tests/golden/), if any."""
    from model_infer_kvcache.analyzer.errors import InputError
    from model_infer_kvcache.analyzer.manifest_io import load_manifest

    for folder in [py.parent, *py.parent.parents]:
        for candidate in sorted(folder.glob("*.json")):
            try:
                return load_manifest(candidate)
            except InputError:
                continue
        if folder == GOLDEN:
            break
    return None


def test_golden_files_are_clean():
    files = sorted(GOLDEN.rglob("*.py"))
    assert files, "tests/golden/ holds no .py file"
    for py in files:
        report = lint_paths([py], manifest=_golden_manifest(py))
        assert not report.errors, report.errors
        assert [f.to_text() for f in report.findings] == []


# ---------------------------------------------------------------- speed


def test_3000_line_benchmark_file_trips_the_rules_it_is_meant_to_time():
    # The speed itself is a benchmark figure (benchmarks/bench_lint.py, README), never a timed assert.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_lint
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    source = bench_lint.generate(3000)
    assert source.count("\n") >= 3000
    findings = lint_source(source, "bench.py")
    assert {f.rule for f in findings} >= {"KV101", "KV201", "KV301", "KV401", "KV501"}


def test_benchmark_script_reports_json(capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_lint
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert bench_lint.main(["--lines", "600", "--repeat", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["lines"] >= 600 and result["seconds_best"] > 0
    assert "KV804" in result["rules_fired"]  # the manifest rules ran too
