"""Operator facts the linter needs, read from their one home (``analyzer.operators``, torch-free)."""

from __future__ import annotations

import ast
from functools import cache

from model_infer_kvcache.analyzer.operators import fa_facts, schemas
from model_infer_kvcache.analyzer.operators.writers import CACHE_WRITERS

FA_V1 = fa_facts.FA_OPS["v1"]
FA_V2 = fa_facts.FA_OPS["v2"]
FA_OPS = fa_facts.FA_OP_NAMES
SCATTER_ND = "npu_scatter_nd_update_"
SCATTER_LEGACY = "scatter_update_"
RMSNORM_ROPE_CACHE = "npu_kv_rmsnorm_rope_cache"
# the out-of-place / v2 variants take the same arguments
SCATTER_ND_OUT = "npu_scatter_nd_update"
SCATTER_LEGACY_OUT = "scatter_update"
RMSNORM_ROPE_CACHE_V2 = "npu_kv_rmsnorm_rope_cache_v2"
RMSNORM_OPS = frozenset({RMSNORM_ROPE_CACHE, RMSNORM_ROPE_CACHE_V2})
WRITER_OPS = frozenset(CACHE_WRITERS)
# DeepSeek sparse attention: the indexer's top-k selection and the attention over the selected keys
INDEXER = "npu_lightning_indexer"
SPARSE_FA = "npu_sparse_flash_attention"
DSA_OPS = frozenset({INDEXER, SPARSE_FA})
ALL_OPS = FA_OPS | WRITER_OPS | DSA_OPS

# On a call of one FA version, the other version's keywords: {wrong name: (right name, op default)}.
WRONG_VERSION_NAMES = {op: fa_facts.other_version_names(op) for op in FA_OPS}

# Where a writer takes its slot index when passed positionally (keyword name, position in the schema).
WRITER_INDEX_ARG = {op: (w.index, schemas.arg_position(op, w.index)) for op, w in CACHE_WRITERS.items() if w.paged}


PINNED_RELEASE = schemas.PINNED_RELEASE


@cache
def accepted_keywords(op: str, release: str = PINNED_RELEASE) -> frozenset[str] | None:
    """Argument names of the real torch_npu op in ``release``, from the committed schemas; None if not there."""
    try:
        return schemas.accepted_keywords(op, release)
    except KeyError:
        return None


@cache
def releases_accepting(op: str, keyword: str) -> tuple[str, ...]:
    return schemas.releases_accepting(op, keyword)


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
