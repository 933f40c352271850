"""Negative-control matrix: every rule-book pattern, on every path where it can occur, is caught.

Each row breaks a fresh render (analyze -> render -> one edit) the way the pattern looks on that
path, and names the tool that must catch it: ``lint`` (the rule ID on the rendered files, linted
with the manifest) or ``validate`` (a named check fails on the quick scenario). Lint is used
wherever it suffices (milliseconds); validate where only running the code shows the bug (the value
is built in another file, or the code has no branch that tells lint the phase).

The 24 patterns are the code rules of the lint registry (KV101-KV954). A pattern that cannot occur
in a render, or that neither tool sees there, is listed in ``NOT_IN_RENDERS`` with the reason; the
same list is in references/validation.md (a test checks both agree).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from model_infer_kvcache.validators.lint import RULES, lint_paths
from validators_support import ROOT, check, mutate, render_case, run_validate

pytestmark = pytest.mark.slow

# path name -> (fixture config, analyze options)
PATHS = {
    "framework paged GQA (FA v1)": ("qwen3_8b", {"framework_api": "G2"}),
    "framework paged MHA": ("phi3_mini", {"framework_api": "G2"}),
    "framework paged sliding (FA v2)": ("gpt_oss_20b", {"framework_api": "G2"}),
    "framework paged MLA absorb": ("deepseek_v2_lite", {"framework_api": "G2"}),
    "framework paged GQA, attention TP 2": ("qwen3_8b", {"framework_api": "G2", "attn_tp_size": 2}),
    "framework Legacy GQA": ("qwen3_8b", {"framework_api": "G2", "kv_mode": "legacy"}),
    "standalone paged GQA": ("qwen3_8b", {"deploy_mode": "standalone"}),
    "standalone paged sliding": ("gpt_oss_20b", {"deploy_mode": "standalone"}),
    "standalone paged MLA absorb": ("deepseek_v2_lite", {"deploy_mode": "standalone"}),
    "standalone Legacy GQA": ("qwen3_8b", {"deploy_mode": "standalone", "kv_mode": "legacy"}),
    "framework paged DSA": ("deepseek_v32", {"framework_api": "G2"}),
    "standalone paged DSA": ("deepseek_v32", {"deploy_mode": "standalone"}),
}

ATTN, RUNNER = "kvcache_attention.py", "kvcache_runner.py"


@dataclass(frozen=True)
class Row:
    pattern: str  # the lint rule ID naming the pattern
    path: str  # a key of PATHS
    edits: tuple[tuple[str, str], ...]  # (regex, replacement) applied in order to `file`
    tool: str  # "lint" or "validate"
    expect: str  # lint: the rule ID; validate: the check name that must fail
    file: str = ATTN
    detail: str = ""  # validate: text the failed check's detail must contain
    count: int = 0  # replace only the first `count` matches (0: all)
    tags: tuple[str, ...] = field(default_factory=tuple)


V1_PREFILL_3 = r"sparse_mode = 3\n(\s+)atten_mask = forward_metadata\.attention_mask"
MATRIX = [
    # ------------------------------------------------------------ KV101 / KV102 / KV103: argument names
    Row("KV101", "framework paged sliding (FA v2)", ((r"softmax_scale=SOFTMAX_SCALE", "scale=SOFTMAX_SCALE"),),
        "lint", "KV101", count=1),
    Row("KV101", "framework paged MLA absorb", ((r"softmax_scale=SOFTMAX_SCALE", "scale=SOFTMAX_SCALE"),),
        "lint", "KV101"),
    Row("KV101", "standalone paged sliding", ((r"softmax_scale=SOFTMAX_SCALE", "scale=SOFTMAX_SCALE"),),
        "lint", "KV101", count=1),
    Row("KV102", "framework paged GQA (FA v1)", ((r"\bscale=SOFTMAX_SCALE", "softmax_scale=SOFTMAX_SCALE"),),
        "lint", "KV102"),
    Row("KV102", "standalone Legacy GQA", ((r"\bscale=SOFTMAX_SCALE", "softmax_scale=SOFTMAX_SCALE"),),
        "lint", "KV102"),
    Row("KV102", "framework paged MHA", ((r"\bnum_heads=NUM_HEADS_PER_RANK", "num_query_heads=NUM_HEADS_PER_RANK"),),
        "lint", "KV102"),
    Row("KV103", "framework paged GQA (FA v1)", ((r'input_layout="TND"', 'layout="TND"'),), "lint", "KV103"),
    Row("KV103", "framework paged MLA absorb", ((r"epsilon=", "eps="),), "lint", "KV103"),
    Row("KV103", "standalone paged GQA", ((r"block_size=block_size", "page_size=block_size"),), "lint", "KV103"),
    # ------------------------------------------------------------ KV201: prefill without causal mask
    Row("KV201", "framework paged MLA absorb", ((V1_PREFILL_3, r"sparse_mode = 0\n\1atten_mask = None"),),
        "lint", "KV201", count=1),
    Row("KV201", "standalone Legacy GQA", ((V1_PREFILL_3, r"sparse_mode = 0\n\1atten_mask = None"),),
        "lint", "KV201", count=1),
    Row("KV201", "framework Legacy GQA", ((V1_PREFILL_3, r"sparse_mode = 0\n\1atten_mask = None"),),
        "lint", "KV201", count=1),
    # one FA call serves prefill and decode (no phase branch): lint cannot tell the phase, running it shows it
    Row("KV201", "framework paged GQA (FA v1)", ((V1_PREFILL_3, r"sparse_mode = 0\n\1atten_mask = None"),),
        "validate", "logits vs transformers", detail="first diverging layer 0"),
    Row("KV201", "standalone paged GQA", ((V1_PREFILL_3, r"sparse_mode = 0\n\1atten_mask = None"),),
        "validate", "logits vs transformers", detail="first diverging layer 0"),
    # ------------------------------------------------------------ KV202: sliding layer with mode 0
    Row("KV202", "framework paged sliding (FA v2)", ((r"sparse_mode = 4", "sparse_mode = 0"),), "lint", "KV202"),
    Row("KV202", "standalone paged sliding", ((r"sparse_mode = 4", "sparse_mode = 0"),), "lint", "KV202"),
    # ------------------------------------------------------------ KV203: MLA absorb decode with mode 3
    Row("KV203", "framework paged MLA absorb",
        ((r"sparse_mode = 0\n(\s+)atten_mask = None", r"sparse_mode = 3\n\1atten_mask = forward_metadata.attention_mask"),),
        "lint", "KV203"),
    Row("KV203", "standalone paged MLA absorb",
        ((r"sparse_mode = 0\n(\s+)atten_mask = None", r"sparse_mode = 3\n\1atten_mask = forward_metadata.attention_mask"),),
        "validate", "FA call arguments match the manifest", detail="(decode): sparse_mode=3 (manifest 0)"),
    # ------------------------------------------------------------ KV204 / KV205: mask dtype and shape
    Row("KV204", "framework paged GQA (FA v1)",
        ((r"atten_mask = forward_metadata\.attention_mask", "atten_mask = forward_metadata.attention_mask.half()"),),
        "lint", "KV204"),
    Row("KV204", "framework paged sliding (FA v2)",
        ((r"atten_mask=forward_metadata\.attention_mask", "atten_mask=forward_metadata.attention_mask.float()"),),
        "lint", "KV204"),
    # standalone: the runner builds the mask, the attention file reads it from the metadata (two files)
    Row("KV204", "standalone paged GQA", ((r"(self\.attention_mask = )(~torch\.tril\(.*\))\n", r"\1(\2).half()\n"),),
        "validate", "rendered code runs without operator errors", file=RUNNER, detail="atten_mask"),
    Row("KV205", "framework paged MLA absorb",
        ((r"atten_mask = forward_metadata\.attention_mask",
          "atten_mask = ~torch.tril(torch.ones(4096, 4096, dtype=torch.bool))"),), "lint", "KV205", count=1),
    Row("KV205", "standalone Legacy GQA", ((r"MASK_SIZE = 2048", "MASK_SIZE = 4096"),),
        "validate", "rendered code runs without operator errors", file=RUNNER, detail="atten_mask"),
    # ------------------------------------------------------------ KV301 / KV302: per-group dicts passed whole
    Row("KV301", "framework paged GQA (FA v1)", ((r"forward_metadata\.block_table\[self\.attn_type\]",
                                                  "forward_metadata.block_table"),), "lint", "KV301"),
    Row("KV301", "framework paged sliding (FA v2)", ((r"forward_metadata\.block_table\[self\.attn_type\]",
                                                      "forward_metadata.block_table"),), "lint", "KV301"),
    Row("KV301", "framework paged MLA absorb", ((r"forward_metadata\.block_table\[self\.attn_type\]",
                                                 "forward_metadata.block_table"),), "lint", "KV301"),
    Row("KV302", "framework paged GQA (FA v1)", ((r"forward_metadata\.slot_mapping\[self\.attn_type\]",
                                                  "forward_metadata.slot_mapping"),), "lint", "KV302"),
    Row("KV302", "framework paged MLA absorb", ((r"forward_metadata\.slot_mapping\[self\.attn_type\]",
                                                 "forward_metadata.slot_mapping"),), "lint", "KV302"),
    # ------------------------------------------------------------ KV401: kv_len changed inside a layer
    Row("KV401", "standalone Legacy GQA",
        ((r"(\n        self\.update_cache\(key_states, value_states, forward_metadata\.kv_len\)\n)",
          r"\1        forward_metadata.kv_len += 1\n"),), "lint", "KV401"),
    Row("KV401", "framework Legacy GQA",
        ((r"(\n        self\.update_cache\(key_states, value_states, forward_metadata\.kv_len\)\n)",
          r"\1        forward_metadata.kv_len.add_(1)\n"),), "lint", "KV401"),
    Row("KV401", "standalone Legacy GQA",
        ((r"(\n        self\.update_cache\(key_states, value_states, forward_metadata\.kv_len\)\n)",
          r"\1        forward_metadata.kv_len += 1\n"),), "validate", "logits vs transformers"),
    # ------------------------------------------------------------ KV501: un-split KV head count
    Row("KV501", "framework paged GQA, attention TP 2",
        ((r"num_head=NUM_KV_HEADS_PER_RANK", "num_head=self.config.num_key_value_heads"),), "lint", "KV501"),
    # ------------------------------------------------------------ KV502: MLA absorb with more than one KV head
    Row("KV502", "framework paged MLA absorb", ((r"num_key_value_heads=1", "num_key_value_heads=NUM_HEADS_PER_RANK"),),
        "lint", "KV502"),
    Row("KV502", "standalone paged MLA absorb", ((r"num_key_value_heads=1,\n", ""),), "lint", "KV502"),
    # ------------------------------------------------------------ KV601: literal epsilon in the MLA writer
    Row("KV601", "framework paged MLA absorb", ((r"epsilon=self\.kv_a_layernorm\.variance_epsilon", "epsilon=1e-5"),),
        "lint", "KV601"),
    Row("KV601", "standalone paged MLA absorb", ((r"\n\s*epsilon=self\.kv_a_layernorm\.variance_epsilon,", ""),),
        "lint", "KV601"),
    # ------------------------------------------------------------ KV206 / KV503: DSA's indexer and sparse attention
    Row("KV206", "framework paged DSA", ((r"sparse_count=INDEX_TOPK,\n(\s+)sparse_mode=3,", r"sparse_count=INDEX_TOPK,\n\1sparse_mode=0,"),),
        "lint", "KV206"),
    Row("KV206", "standalone paged DSA", ((r"sparse_mode=3,\n(\s+)attention_mode=2,", r"sparse_mode=0,\n\1attention_mode=2,"),),
        "lint", "KV206"),
    Row("KV503", "framework paged DSA", ((r"self\.nope_cache,\n(\s+)self\.nope_cache,\n(\s+)topk,",
                                         r"self.nope_cache,\n\1self.rope_cache,\n\2topk,"),), "lint", "KV503"),
    Row("KV503", "standalone paged DSA", ((r"self\.nope_cache,\n(\s+)self\.nope_cache,\n(\s+)topk,",
                                          r"self.nope_cache,\n\1self.indexer_key_cache,\n\2topk,"),), "lint", "KV503"),
]

# Patterns that cannot occur in a render (or that neither tool sees there), with the reason.
NOT_IN_RENDERS = {
    "KV701": "renders hold the attention/cache code only; the hidden-states reshape lives in the user's decoder "
             "forward, which validate replaces with its own harness model: lint covers it on modeling files "
             "(tests/fixtures/lint/kv701_*)",
    # Standalone runner loops: the rendered runner takes its rows from the caller, allocates once in _init_kvcache and
    # derives every length from self.kv_len, so these live in the user's own runner (tests/fixtures/lint/kv90*).
    "KV902": "a per-slot length never reset on reuse is the user's runner loop; the rendered runner resets its rows "
             "(tests/fixtures/lint/kv902_*)",
    "KV903": "a cache allocated per step is the user's runner loop; the render allocates once in _init_kvcache "
             "(tests/fixtures/lint/kv903_*)",
    "KV904": "host lengths from another counter than the slots are the user's runner; the render derives both from "
             "self.kv_len (tests/fixtures/lint/kv904_*)",
    # Graph-mode decode: lint judges the branches a model file writes for its exe_mode; a render branches on none (its
    # graph-mode decode is captured code throughout), so the same mistakes there are the capture's findings.
    "KV951": "a render has no exe_mode branch; a host read in its captured decode is V228's finding "
             "(tests/test_graph_capture.py; lint: tests/fixtures/lint/kv951_*)",
    "KV952": "a render has no exe_mode branch; a tensor built from host lengths in its captured decode is V230's "
             "finding (tests/test_graph_capture.py; lint: tests/fixtures/lint/kv951_*)",
    "KV953": "a render has no exe_mode branch; FA lengths given as tensors in its captured decode are V228's finding "
             "(tests/test_graph_checkout.py; lint: tests/fixtures/lint/kv951_*)",
    "KV954": "a render has no exe_mode branch; a Python branch on a device value in its captured decode is V228's "
             "finding (the capture reads the value back; lint: tests/fixtures/lint/kv951_*)",
}


def _render(tmp_path: Path, path: str):
    config, options = PATHS[path]
    return render_case(tmp_path, config, **options)


def _ids(row: Row) -> str:
    return f"{row.pattern}-{row.tool}-{re.sub(r'[^a-z0-9]+', '_', row.path.lower()).strip('_')}"


def test_matrix_covers_every_code_rule():
    code_rules = {rule_id for rule_id, rule in RULES.items() if not rule.needs_manifest}
    assert len(code_rules) == 24
    covered = {row.pattern for row in MATRIX}
    assert covered | set(NOT_IN_RENDERS) == code_rules, sorted(code_rules - covered - set(NOT_IN_RENDERS))
    assert not covered & set(NOT_IN_RENDERS)
    assert {row.path for row in MATRIX} == set(PATHS)  # every path has at least one row


def test_patterns_outside_renders_are_named_in_the_docs():
    text = (ROOT / "references" / "validation.md").read_text(encoding="utf-8")
    for rule_id in NOT_IN_RENDERS:
        assert rule_id in text, f"{rule_id} is not named in references/validation.md"


@pytest.mark.parametrize("path", sorted(PATHS))
def test_unmutated_render_is_clean(tmp_path, path):
    manifest, rendered, _ = _render(tmp_path, path)
    report = lint_paths([rendered], manifest=manifest)
    assert not report.errors and report.findings == [], [f"{f.rule} {f.line}" for f in report.findings]


@pytest.mark.parametrize("row", [r for r in MATRIX if r.tool == "lint"], ids=_ids)
def test_lint_catches(tmp_path, row: Row):
    manifest, rendered, _ = _render(tmp_path, row.path)
    for pattern, replacement in row.edits:
        mutate(rendered, pattern, replacement, count=row.count, name=row.file)
    report = lint_paths([rendered], manifest=manifest)
    assert not report.errors, report.errors
    assert row.expect in {f.rule for f in report.findings}, [f"{f.rule} {f.line}" for f in report.findings]


@pytest.mark.parametrize("row", [r for r in MATRIX if r.tool == "validate"], ids=_ids)
def test_validate_catches(tmp_path, row: Row):
    manifest, rendered, cfg = _render(tmp_path, row.path)
    for pattern, replacement in row.edits:
        mutate(rendered, pattern, replacement, count=row.count, name=row.file)
    report = run_validate(manifest, rendered, cfg)
    failed = check(report, row.expect)
    assert not failed.passed, failed
    assert row.detail in (failed.detail or ""), failed.detail
