"""Graph-mode decode rules (KV951-KV953, issue 39 step 4): judged on the graph-mode decode branches the upstream
model files write for their exe_mode, silent on the correct ones, and each realistic mistake named at its line.

The whole-snapshot precision (every folder, the engine's own host-list building included) is
tests/test_lint_upstream.py; here the branches themselves are shown to be seen, so that silence means "right",
not "not looked at".
"""

from __future__ import annotations

import ast

import pytest
from model_infer_kvcache.validators.lint import lint_paths, lint_source
from model_infer_kvcache.validators.lint.scope import DECODE, ModuleInfo
from shared_dirs import upstream_head

GRAPH_RULES = {"KV951", "KV952", "KV953", "KV954"}
QWEN_BRANCH = "            actual_seq_kvlen = forward_metadata.actual_seq_lengths_list_kv\n"


def _qwen() -> str:
    path = upstream_head() / "models/qwen/models/modeling_qwen.py"
    if not path.is_file():
        pytest.skip(f"{path} does not exist")
    return path.read_text(encoding="utf-8")


def _graph_findings(tmp_path, source: str) -> list:
    path = tmp_path / "modeling_qwen.py"
    path.write_text(source, encoding="utf-8")
    return [f for f in lint_paths([path]).findings if f.rule in GRAPH_RULES]


def test_the_upstream_graph_branches_are_seen_and_clean():
    """qwen's npugraph_ex branch (host lists from the engine) is placed in graph-mode decode by the scope, and every
    model folder's graph branches give no finding."""
    src = _qwen()
    info = ModuleInfo(ast.parse(src))
    line = src[:src.index(QWEN_BRANCH)].count("\n") + 1
    node = next(n for n in info.nodes if isinstance(n, ast.Assign) and n.lineno == line)
    ctx = info.ctx_of(node)
    assert (ctx.graph, ctx.phase) == (True, DECODE)
    report = lint_paths([upstream_head() / "models", upstream_head() / "executor"])
    assert [f"{f.path}:{f.line} {f.rule}" for f in report.findings if f.rule in GRAPH_RULES] == []


@pytest.mark.parametrize(("new", "rule"), [
    # the KV lengths read back from the device tensor instead of the engine's host list
    ("            actual_seq_kvlen = forward_metadata.actual_seq_lengths_kv.tolist()\n", "KV951"),
    # the metadata tensor handed to FA's SymInt[] lengths in the captured step
    ("            actual_seq_kvlen = forward_metadata.actual_seq_lengths_kv\n", "KV953"),
    # the host list turned into a tensor inside the step: copied once at capture
    ("            actual_seq_kvlen = forward_metadata.actual_seq_lengths_list_kv\n"
     "            positions = torch.tensor(forward_metadata.actual_seq_lengths_list_kv) - 1\n", "KV952"),
])
def test_a_mistake_in_qwens_graph_branch_is_named_at_its_line(tmp_path, new, rule):
    src = _qwen()
    assert src.count(QWEN_BRANCH) == 1
    line = src[:src.index(QWEN_BRANCH)].count("\n") + 1 + (1 if rule == "KV952" else 0)
    found = _graph_findings(tmp_path, src.replace(QWEN_BRANCH, new))
    assert [(f.rule, f.line) for f in found] == [(rule, line)], [(f.rule, f.line, f.message) for f in found]


@pytest.mark.parametrize("test", ['self.exe_mode == "ge_graph"', 'self.exe_mode != "eager"',
                                  'exe_mode in ("ge_graph", "npugraph_ex")', "self.enable_gegraph",
                                  "is_npugraph_ex_decode"])
def test_each_way_upstream_names_graph_mode_opens_a_graph_branch(test):
    src = (f"class Attn(nn.Module):\n    def forward_decode(self, x, exe_mode, is_npugraph_ex_decode):\n"
           f"        if {test}:\n            return x.item()\n        return x.item()\n")
    assert [(f.rule, f.line) for f in lint_source(src)] == [("KV951", 4)]


@pytest.mark.parametrize("src", [
    # eager decode, prefill in graph mode, a constructor, the engine building host lists before the step, a
    # constant tensor: none is inside a captured decode step
    "class Attn(nn.Module):\n    def forward_decode(self, x):\n        if self.exe_mode == 'eager':\n"
    "            return x.item()\n        return x\n",
    "class Attn(nn.Module):\n    def forward(self, x, is_prefill):\n        if is_prefill and self.enable_npugraph_ex:\n"
    "            return x.tolist()\n        return x\n",
    "class Attn(nn.Module):\n    def __init__(self, x):\n        if self.enable_npugraph_ex:\n"
    "            self.ids = x.cpu()\n",
    "class ExecutionEngine:\n    def prepare_decode(self, kv):\n        if self.exe_mode == 'npugraph_ex':\n"
    "            self.kv_list = kv.detach().cpu().numpy().tolist()\n",
    "class Attn(nn.Module):\n    def forward_decode(self, x):\n        if self.enable_npugraph_ex:\n"
    "            return x + torch.tensor([1, 2, 3])\n        return x\n",
])
def test_code_outside_a_captured_decode_step_is_not_judged(src):
    assert lint_source(src) == []
