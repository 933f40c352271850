"""KV701: what a hidden-states value IS before it is reshaped to 3-D, in framework paged code.

Framework mode packs the step's tokens as ``[TotalTokens, hidden]``. A 3-D view is wrong only
when it splits that token axis into ``[batch, seq]`` where requests may have different lengths:

* packed tokens (a forward's ``hidden_states`` / ``inputs_embeds`` parameter, the output of the
  embedding, a decoder layer, the norm or the model) viewed as ``[batch, -1 | seq, hidden]`` on a
  path that runs at prefill is the bug;
* rows already selected per request (``torch.index_select(h, 0, cu_seq_lens - 1)``, ``h[idx]``,
  ``torch.gather``) have one row per request: ``view(bs, 1, hidden)`` is right;
* at decode every request has the same query length (1, or 1 + next_n with MTP), so
  ``[batch, q_len, hidden]`` is a valid view of the packed decode tokens;
* ``view(h.shape[0], 1, hidden)`` (or ``-1, 1, ...``) keeps one token per row and splits nothing.

``judge(call)`` returns the reason to report, or None. Anything it cannot see stays unreported.
"""

from __future__ import annotations

import ast
import re

from model_infer_kvcache.validators.lint.scope import DECODE, Ctx, ModuleInfo
from model_infer_kvcache.validators.lint.values import Resolver, as_int

PACKED, ROWS = "packed", "rows"

_BATCH_NAME = re.compile(r"^(b|bs|bsz|batch|batch_size|batchsize|num_seqs|num_reqs|num_requests|B)$|batch",
                         re.IGNORECASE)
_SEQ_NAME = re.compile(r"^(s|S|q_len|seq|seqlen|seq_len|seq_length|sequence_length|q_seq_len|kv_len)$")
_TOKEN_NAME = re.compile(r"token|^t$|^T$|bs_qlen|num_tokens", re.IGNORECASE)
_SELECT_FUNCS = {"index_select", "gather", "take_along_dim", "take"}
_KEEP_METHODS = {"to", "contiguous", "float", "half", "bfloat16", "npu", "cuda", "clone", "detach", "type_as"}
# module calls whose output keeps the packed token axis
_PACKED_PRODUCER = re.compile(r"embed|layer|model|norm|decoder|block|attn|attention|mlp|moe", re.IGNORECASE)


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


class HiddenLayout:
    def __init__(self, info: ModuleInfo, resolver: Resolver) -> None:
        self.info = info
        self.resolver = resolver

    # ------------------------------------------------------------ what the value is

    def kinds(self, expr: ast.AST, at: ast.AST, ctx: Ctx, depth: int = 0) -> set[tuple[str | None, Ctx]]:
        """(kind, context) for each value ``expr`` may hold at ``at``; kind None when unknown."""
        if depth > 6:
            return {(None, ctx)}
        if isinstance(expr, ast.Subscript):
            index = expr.slice
            if isinstance(index, ast.Slice):  # h[:num_tokens]: the token axis, trimmed
                return self.kinds(expr.value, at, ctx, depth + 1)
            if isinstance(index, ast.Tuple):
                return {(None, ctx)}
            return {(ROWS, ctx)}  # h[idx]: rows picked per request
        if isinstance(expr, ast.Call):
            func = expr.func
            fname = _name(func)
            if fname in _SELECT_FUNCS:
                return {(ROWS, ctx)}
            if isinstance(func, ast.Attribute) and fname in _KEEP_METHODS:
                return self.kinds(func.value, at, ctx, depth + 1)
            if isinstance(func, ast.Attribute) and fname in ("view", "reshape") and _flat_2d(expr):
                return self.kinds(func.value, at, ctx, depth + 1)  # h.view(-1, hidden): still [T, H]
            if isinstance(func, ast.Subscript) and _PACKED_PRODUCER.search(ast.unparse(func.value)):
                return {(PACKED, ctx)}  # self.layers[i](h, ...)
            if isinstance(func, (ast.Name, ast.Attribute)) and _PACKED_PRODUCER.search(fname) and \
                    fname not in ("view", "reshape"):
                return {(PACKED, ctx)}
            return {(None, ctx)}
        if isinstance(expr, (ast.Name, ast.Attribute)):
            out: set[tuple[str | None, Ctx]] = set()
            for v in self.resolver.variants(expr, at, ctx):
                if v.node is expr or not v.certain:
                    out.add((self._named_kind(expr, at), v.ctx))
                else:
                    out |= self.kinds(v.node, v.at, v.ctx, depth + 1)
            return out
        return {(None, ctx)}

    def _named_kind(self, expr: ast.AST, at: ast.AST) -> str | None:
        """A value the resolver cannot see through: the forward's hidden-states input is packed."""
        name = _name(expr).lower()
        if "hidden" in name or name == "inputs_embeds":
            func = self.info.function_of(at)
            fname = getattr(func, "name", "").lower()
            if "forward" in fname or not self.info.is_parameter(func, _name(expr)):
                return PACKED
        return None

    # ------------------------------------------------------------ the view

    def shape_args(self, call: ast.Call) -> list[ast.AST] | None:
        args = list(call.args)
        if call.keywords:
            return None
        if len(args) == 1 and isinstance(args[0], ast.Starred):
            args = [args[0].value]
        if len(args) == 1:
            only = args[0]
            if isinstance(only, (ast.Name, ast.Attribute)):
                v = self.resolver.single(only, call, self.info.ctx_of(call))
                only = v.node if v is not None else only
            if isinstance(only, (ast.Tuple, ast.List)):
                args = list(only.elts)
        if any(isinstance(a, ast.Starred) for a in args):
            return None
        return args

    def _dim_kind(self, dim: ast.AST, at: ast.AST, ctx: Ctx) -> str | None:
        """'tokens' (the packed axis length), 'batch', 'seq', 'one', 'rest' (-1) or None."""
        value = as_int(dim)
        if value == 1:
            return "one"
        if value == -1:
            return "rest"
        node = dim
        if isinstance(dim, (ast.Name, ast.Attribute)):
            v = self.resolver.single(dim, at, ctx)
            if v is not None and v.node is not dim:
                inner = self._dim_kind(v.node, v.at, v.ctx) if not isinstance(v.node, (ast.Name, ast.Attribute)) \
                    else None
                if inner in ("tokens", "one", "rest"):
                    return inner
                node = v.node
        text = _name(dim)
        if _is_token_count(node) or _TOKEN_NAME.search(text):
            return "tokens"
        if _BATCH_NAME.search(text):
            return "batch"
        if _SEQ_NAME.match(text):
            return "seq"
        return None

    def judge(self, call: ast.Call) -> bool:
        """True when ``call`` (a ``.view`` / ``.reshape``) splits packed tokens into [batch, seq] at prefill."""
        args = self.shape_args(call)
        if args is None or len(args) != 3:
            return False
        ctx = self.info.ctx_of(call)
        first = self._dim_kind(args[0], call, ctx)
        second = self._dim_kind(args[1], call, ctx)
        if first in ("tokens", "one", "rest") and second in ("one", None) and first != "one":
            return False  # [T, 1, H] / [-1, 1, H]: one token per row
        if first != "batch" and second != "seq":
            return False
        if self._restores_own_shape(args, call):
            return False
        for kind, where in self.kinds(call.func.value, call, ctx):
            if kind == PACKED and where.phase != DECODE:
                return True
        return False

    def _restores_own_shape(self, args: list[ast.AST], at: ast.AST) -> bool:
        """The batch / seq dims are unpacked from a 3-D ``.shape`` in this function: the code is 3-D by design.

        ``b, s, h = x.shape`` proves ``x`` already was ``[batch, seq, hidden]``; a later
        ``view(b, s | -1, h)`` puts back a layout the value had on entry and splits nothing that was
        packed (bailing_2_5's MoE). Which tensor is viewed does not matter: the layer's input was 3-D.
        """
        func = self.info.function_of(at)
        if func is None:
            return False
        defs = self.info.local_defs(func)
        dims = [a for a in args[:2] if as_int(a) is None]
        return bool(dims) and all(_from_3d_shape(dim, defs) for dim in dims)


def _from_3d_shape(dim: ast.AST, defs: dict[str, list[ast.stmt]]) -> bool:
    """``dim`` is a name bound only by ``a, b, c = <value>.shape`` (or ``.size()``)."""
    if not isinstance(dim, ast.Name) or not defs.get(dim.id):
        return False
    for stmt in defs[dim.id]:
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Tuple)):
            return False
        target, value = stmt.targets[0], stmt.value
        shape = (isinstance(value, ast.Attribute) and value.attr == "shape") or (
            isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "size"
            and not value.args)
        if not shape or len(target.elts) != 3 or any(isinstance(e, ast.Starred) for e in target.elts):
            return False
    return True


def _flat_2d(call: ast.Call) -> bool:
    args = call.args[0].elts if len(call.args) == 1 and isinstance(call.args[0], (ast.Tuple, ast.List)) \
        else call.args
    return len(args) == 2 and as_int(args[0]) == -1


def _is_token_count(node: ast.AST) -> bool:
    """``h.shape[0]``, ``h.size(0)``, ``len(input_ids)``-free forms of the packed axis length."""
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "shape":
        return as_int(node.slice) == 0 and _refers_to_hidden(node.value.value)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "size":
        return len(node.args) == 1 and as_int(node.args[0]) == 0 and _refers_to_hidden(node.func.value)
    return False


def _refers_to_hidden(node: ast.AST) -> bool:
    name = _name(node).lower()
    return "hidden" in name or "embeds" in name or name in ("x", "outputs", "input_ids", "positions")
