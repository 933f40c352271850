"""Operator facts the linter needs: names, v1/v2 argument tables, and the pinned real schemas."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from functools import cache
from pathlib import Path

FA_V1 = "npu_fused_infer_attention_score"
FA_V2 = "npu_fused_infer_attention_score_v2"
FA_OPS = frozenset({FA_V1, FA_V2})
SCATTER_ND = "npu_scatter_nd_update_"
SCATTER_LEGACY = "scatter_update_"
RMSNORM_ROPE_CACHE = "npu_kv_rmsnorm_rope_cache"
# the out-of-place / v2 variants take the same arguments
SCATTER_ND_OUT = "npu_scatter_nd_update"
SCATTER_LEGACY_OUT = "scatter_update"
RMSNORM_ROPE_CACHE_V2 = "npu_kv_rmsnorm_rope_cache_v2"
RMSNORM_OPS = frozenset({RMSNORM_ROPE_CACHE, RMSNORM_ROPE_CACHE_V2})
WRITER_OPS = frozenset({SCATTER_ND, SCATTER_LEGACY, RMSNORM_ROPE_CACHE, SCATTER_ND_OUT, SCATTER_LEGACY_OUT,
                        RMSNORM_ROPE_CACHE_V2})
ALL_OPS = FA_OPS | WRITER_OPS

# (v1 name, v2 name, default the op falls back to when the other version's name is passed)
VERSION_NAMES = (
    ("scale", "softmax_scale", "1.0"),
    ("num_heads", "num_query_heads", "1"),
    ("actual_seq_lengths", "actual_seq_qlen", "None"),
    ("actual_seq_lengths_kv", "actual_seq_kvlen", "None"),
)
V1_ONLY = {v1: (v2, default) for v1, v2, default in VERSION_NAMES}
V2_ONLY = {v2: (v1, default) for v1, v2, default in VERSION_NAMES}

# Where a writer takes its slot index when passed positionally (keyword name, position).
WRITER_INDEX_ARG = {SCATTER_ND: ("indices", 1), SCATTER_ND_OUT: ("indices", 1),
                    RMSNORM_ROPE_CACHE: ("index", 4), RMSNORM_ROPE_CACHE_V2: ("index", 4)}


@cache
def _schema_module():
    """``validators.npu_ops.schemas`` without running ``validators/npu_ops/__init__.py``.

    The package's ``__init__`` imports torch and the emulation (seconds); its ``schemas`` module
    is stdlib-only. When the package is already imported (a validation process), use it as is.
    """
    name = "validators.npu_ops.schemas"
    if "validators.npu_ops" in sys.modules:
        try:
            return importlib.import_module(name)
        except ImportError:
            return None
    path = Path(__file__).resolve().parent.parent / "npu_ops" / "schemas.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("_kvcache_lint_op_schemas", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception:  # a broken sibling module must not take the linter down; KV103 goes quiet
        return None
    return module


@cache
def accepted_keywords(op: str) -> frozenset[str] | None:
    """Argument names of the real torch_npu 2.9.0 op, from the pinned schemas; None if unavailable.

    The schemas belong to ``validators.npu_ops`` (``op_schemas.json``); the linter still runs,
    without rule KV103, where that module or its JSON is missing.
    """
    module = _schema_module()
    schema_keywords = getattr(module, "accepted_keywords", None)
    if schema_keywords is None:
        return None
    try:
        names = schema_keywords(op)
    except (FileNotFoundError, KeyError, ValueError, OSError):
        return None
    return frozenset(names) if names else None


def schemas_available() -> bool:
    return accepted_keywords(FA_V1) is not None


def terminal_name(node: ast.AST) -> str | None:
    """Last identifier of a Name / Attribute chain (``self.fa_ops.op`` -> ``op``)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def op_of_expr(node: ast.AST) -> str | None:
    """Operator named by an expression such as ``torch_npu.op``, ``torch.ops.npu.op.default``."""
    name = terminal_name(node)
    if name == "default" and isinstance(node, ast.Attribute):
        name = terminal_name(node.value)
    return name if name in ALL_OPS else None


def collect_aliases(nodes) -> tuple[dict[str, str], dict[str, str]]:
    """Names and ``self.<attr>`` attributes bound to an operator in this file.

    Covers ``from torch_npu import op as fa``, ``fa = torch_npu.op`` (any scope) and
    ``self.fa = torch.ops.npu.op`` in a method.
    """
    names: dict[str, str] = {}
    attrs: dict[str, str] = {}
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name in ALL_OPS:
                    names[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            op = op_of_expr(node.value)
            if op is None:
                continue
            target = node.targets[0]
            if isinstance(target, ast.Name):
                names[target.id] = op
            elif isinstance(target, ast.Attribute):
                attrs[target.attr] = op
    return names, attrs


def call_op(call: ast.Call, names: dict[str, str], attrs: dict[str, str]) -> str | None:
    """Operator a call invokes, recognised by its final name or a file-local alias."""
    func = call.func
    op = op_of_expr(func)
    if op is not None:
        return op
    if isinstance(func, ast.Name):
        return names.get(func.id)
    if isinstance(func, ast.Attribute):
        return attrs.get(func.attr)
    return None
