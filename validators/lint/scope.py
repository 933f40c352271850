"""Where a node sits: enclosing function/class, the branch (prefill/decode, sliding or not) it runs in.

A *context* (``Ctx``) records what is certain about a piece of code: the phase
(``prefill``/``decode``) and whether the layer is a sliding-window layer. It comes from the
enclosing ``if`` tests (``if forward_metadata.is_prefill:``, ``if self.sliding_window:``,
``attn_type == "SlidingWindow"``, either branch), from conditional expressions, from function
names (``forward_prefill``), and from the class (``...SlidingAttention`` or a constant
``self.attn_type = "SlidingWindow"``). ``None`` means "not known": rules only fire on what is known.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, replace

PREFILL, DECODE = "prefill", "decode"

_FUNC_TYPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
_SCOPE_TYPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.Module)


@dataclass(frozen=True)
class Ctx:
    phase: str | None = None
    sliding: bool | None = None
    graph: bool | None = None  # captured decode (exe_mode npugraph_ex / ge_graph), from the code's own tests

    def refine(self, cons: dict) -> Ctx | None:
        """Add constraints; None when they contradict what is already known."""
        out = self
        for dim, value in cons.items():
            current = getattr(out, dim)
            if current is not None and current != value:
                return None
            out = replace(out, **{dim: value})
        return out

    def override(self, cons: dict) -> Ctx:
        return replace(self, **cons)


def _negate(cons: dict) -> dict | None:
    """Constraint holding in the other branch; only a single boolean dimension negates exactly."""
    if len(cons) != 1:
        return None
    (dim, value), = cons.items()
    if dim == "phase":
        return {"phase": DECODE if value == PREFILL else PREFILL}
    return {dim: not value}


def _ident_text(node: ast.AST) -> str:
    """Identifiers of a test expression joined (``forward_metadata.is_prefill`` -> ``forward_metadata.is_prefill``)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_ident_text(node.value)}.{node.attr}"
    if isinstance(node, ast.Subscript):
        return _ident_text(node.value)
    if isinstance(node, ast.Call):
        return _ident_text(node.func)
    return ""


def _phase_of_ident(text: str) -> str | None:
    """Phase named by an identifier's words: ``is_prefill``, ``forward_decode`` (not ``decoder``)."""
    words = set(text.rsplit(".", 1)[-1].lower().split("_"))
    if words & {"prefill", "prefilling"}:
        return PREFILL
    if words & {"decode", "decoding"}:
        return DECODE
    return None


# Graph-mode flags as the upstream model files name them: enable_npugraph_ex, enable_gegraph,
# is_npugraph_ex_decode (exe_mode is "npugraph_ex" or "ge_graph"; "eager" runs uncaptured).
_GRAPH_WORDS = {"npugraph", "npugraphex", "gegraph"}
GRAPH_MODES = ("npugraph_ex", "ge_graph")


def _graph_of_ident(text: str) -> bool | None:
    words = set(text.rsplit(".", 1)[-1].lower().split("_"))
    return True if words & _GRAPH_WORDS else None


def _graph_compare(left: ast.AST, op: ast.cmpop, right: ast.AST) -> dict | None:
    """``exe_mode == "npugraph_ex"``, ``exe_mode != "eager"``, ``exe_mode in ("ge_graph", "npugraph_ex")``."""
    if not _ident_text(left).rsplit(".", 1)[-1].lower().endswith("exe_mode"):
        return None
    if isinstance(right, ast.Constant) and isinstance(right.value, str) and isinstance(op, (ast.Eq, ast.NotEq)):
        if right.value in GRAPH_MODES:
            return {"graph": True} if isinstance(op, ast.Eq) else None  # != one graph mode may be the other
        if right.value == "eager":
            return {"graph": isinstance(op, ast.NotEq)}
    if isinstance(right, (ast.Tuple, ast.List, ast.Set)) and isinstance(op, (ast.In, ast.NotIn)):
        values = {e.value for e in right.elts if isinstance(e, ast.Constant)}
        if values and values <= set(GRAPH_MODES):
            return {"graph": isinstance(op, ast.In)}
    return None


def _atomic_constraint(test: ast.AST) -> dict | None:
    """Constraint implied when ``test`` is true, or None if it says nothing we understand."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _atomic_constraint(test.operand)
        return _negate(inner) if inner else None
    if isinstance(test, (ast.Name, ast.Attribute)):
        text = _ident_text(test)
        phase, graph = _phase_of_ident(text), _graph_of_ident(text)
        if graph:  # is_npugraph_ex_decode: captured and decode
            return {"graph": True, **({"phase": phase} if phase else {})}
        if phase:
            return {"phase": phase}
        if "sliding" in text.rsplit(".", 1)[-1].lower():
            return {"sliding": True}
        return None
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        left, op, right = test.left, test.ops[0], test.comparators[0]
        graph = _graph_compare(left, op, right)
        if graph is not None:
            return graph
        # `x == "SlidingWindow"`, `layer_types[i] != "sliding_attention"`, `attn_type == "FullAttention"`
        for b in (right, left):
            if isinstance(b, ast.Constant) and isinstance(b.value, str) and isinstance(op, (ast.Eq, ast.NotEq)):
                low = b.value.lower()
                if "sliding" in low:
                    sliding = True
                elif "full" in low:
                    sliding = False
                else:
                    return None
                return {"sliding": sliding if isinstance(op, ast.Eq) else not sliding}
        text = _ident_text(left).rsplit(".", 1)[-1].lower()
        is_none = isinstance(right, ast.Constant) and right.value is None
        if "sliding" in text and is_none and isinstance(op, (ast.Is, ast.IsNot)):
            return {"sliding": isinstance(op, ast.IsNot)}
        if "sliding" in text and isinstance(op, ast.Gt) and isinstance(right, ast.Constant) and right.value == 0:
            return {"sliding": True}
        phase = _phase_of_ident(_ident_text(left))
        if phase and isinstance(right, ast.Constant) and isinstance(right.value, bool):
            truth = right.value if isinstance(op, (ast.Eq, ast.Is)) else not right.value
            if isinstance(op, (ast.Eq, ast.Is, ast.NotEq, ast.IsNot)):
                return {"phase": phase} if truth else _negate({"phase": phase})
    return None


def branch_constraints(test: ast.AST) -> tuple[dict | None, dict | None]:
    """(constraints in the body, constraints in the else branch); None = not understood."""
    if isinstance(test, ast.BoolOp):
        parts = [_atomic_constraint(v) for v in test.values]
        merged: dict = {}
        if isinstance(test.op, ast.And):
            # body: every conjunct holds (unknown ones add nothing); else: unknown
            for part in parts:
                if part:
                    for dim, value in part.items():
                        if merged.get(dim, value) != value:
                            return None, None
                        merged[dim] = value
            return (merged or None), None
        # Or: else branch has every disjunct false
        if all(parts):
            negs = [_negate(p) for p in parts]
            if all(negs):
                for neg in negs:
                    for dim, value in neg.items():
                        if merged.get(dim, value) != value:
                            return None, None
                        merged[dim] = value
                return None, merged
        return None, None
    cons = _atomic_constraint(test)
    if cons is None:
        return None, None
    return cons, _negate(cons)


_MTP_WORDS = re.compile(r"mtp|next_n|nextn|spec|q_len|seq_len|num_tokens|draft", re.IGNORECASE)


class ModuleInfo:
    """Per-file index: parents, enclosing scopes, assignments per function and per class."""

    def __init__(self, tree: ast.Module, path: str = "<string>") -> None:
        self.tree = tree
        self.path = path
        self.parents, self.nodes = _index(tree)
        self._func_defs: dict[ast.AST, dict[str, list[ast.stmt]]] = {}
        self._class_defs: dict[ast.ClassDef, dict[str, list[tuple[ast.AST, ast.stmt]]]] = {}
        self._class_ctx: dict[ast.ClassDef, Ctx] = {}
        self._module_defs: dict[str, list[ast.stmt]] | None = None
        self._calls_by_name: dict[str, list[ast.Call]] | None = None

    # ------------------------------------------------------------ scopes

    def enclosing(self, node: ast.AST, types) -> ast.AST | None:
        cur = self.parents.get(node)
        while cur is not None and not isinstance(cur, types):
            cur = self.parents.get(cur)
        return cur

    def function_of(self, node: ast.AST):
        return self.enclosing(node, _FUNC_TYPES)

    def scope_of(self, node: ast.AST):
        return self.enclosing(node, _SCOPE_TYPES)

    def class_of(self, node: ast.AST) -> ast.ClassDef | None:
        """Class whose method contains ``node`` (the nearest function's class)."""
        func = self.enclosing(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        while func is not None:
            parent = self.parents.get(func)
            if isinstance(parent, ast.ClassDef):
                return parent
            func = self.enclosing(func, (ast.FunctionDef, ast.AsyncFunctionDef))
        return None

    def function_names(self, node: ast.AST) -> list[str]:
        names = []
        cur = self.enclosing(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        while cur is not None:
            names.append(cur.name)
            cur = self.enclosing(cur, (ast.FunctionDef, ast.AsyncFunctionDef))
        return names

    def statement_of(self, node: ast.AST) -> ast.AST:
        cur = node
        while cur is not None and not isinstance(cur, ast.stmt):
            cur = self.parents.get(cur)
        return cur if cur is not None else node

    def branch_path(self, node: ast.AST) -> tuple[tuple[ast.AST, str], ...]:
        """Enclosing (If / IfExp, 'body'|'orelse') pairs from the scope down to ``node``."""
        path = []
        child, cur = node, self.parents.get(node)
        while cur is not None and not isinstance(cur, _SCOPE_TYPES):
            if isinstance(cur, ast.If):
                if any(child is s for s in cur.body):
                    path.append((cur, "body"))
                elif any(child is s for s in cur.orelse):
                    path.append((cur, "orelse"))
            elif isinstance(cur, ast.IfExp):
                if child is cur.body:
                    path.append((cur, "body"))
                elif child is cur.orelse:
                    path.append((cur, "orelse"))
            child, cur = cur, self.parents.get(cur)
        path.reverse()
        return tuple(path)

    def enclosing_tests(self, node: ast.AST) -> list[ast.AST]:
        return [item.test for item, _ in self.branch_path(node)]

    def in_mtp_branch(self, node: ast.AST) -> bool:
        """Inside a branch testing MTP / multi-token query length (q_len > 1 paths legitimately use mode 3)."""
        for test in self.enclosing_tests(node):
            if _MTP_WORDS.search(ast.unparse(test)):
                return True
        return any(_MTP_WORDS.search(name) for name in self.function_names(node))

    # ------------------------------------------------------------ contexts

    def class_ctx(self, cls: ast.ClassDef | None) -> Ctx:
        if cls is None:
            return Ctx()
        if cls in self._class_ctx:
            return self._class_ctx[cls]
        ctx = Ctx()
        if "sliding" in cls.name.lower():
            ctx = Ctx(sliding=True)
        else:
            values = set()
            for _, stmt in self.class_attr_defs(cls).get("attn_type", []):
                value = getattr(stmt, "value", None)
                if isinstance(value, ast.Constant) and isinstance(value.value, str) and \
                        not self.branch_path(stmt):
                    values.add(value.value)
                else:
                    values.add(None)
            if len(values) == 1 and None not in values:
                (only,) = values
                if "sliding" in only.lower():
                    ctx = Ctx(sliding=True)
                elif "full" in only.lower():
                    ctx = Ctx(sliding=False)
        self._class_ctx[cls] = ctx
        return ctx

    def ctx_of(self, node: ast.AST) -> Ctx:
        """What is certain where ``node`` runs: class, then function names, then branches (innermost wins)."""
        ctx = self.class_ctx(self.class_of(node))
        phases = {_phase_of_ident(name) for name in self.function_names(node)} - {None}
        if len(phases) == 1:
            ctx = ctx.override({"phase": phases.pop()})
        scopes = [node]
        scope = self.scope_of(node)
        # branches of enclosing scopes too (a nested helper defined inside `if is_prefill:`)
        while isinstance(scope, _FUNC_TYPES):
            scopes.append(scope)
            scope = self.scope_of(scope)
        for target in reversed(scopes):
            for cons in self._early_exit_constraints(target):
                ctx = ctx.override(cons)
            for item, branch in self.branch_path(target):
                body, orelse = branch_constraints(item.test)
                cons = body if branch == "body" else orelse
                if cons:
                    ctx = ctx.override(cons)
        return ctx

    def _early_exit_constraints(self, node: ast.AST) -> list[dict]:
        """``if is_prefill: ...; return x`` then code below it: that code runs only in the other branch."""
        out: list[dict] = []
        # walk up the blocks holding ``node``'s statement: earlier siblings that exit early
        stmt = self.statement_of(node)
        block_owner = self.parents.get(stmt)
        while stmt is not None and block_owner is not None:
            for field in ("body", "orelse", "finalbody"):
                block = getattr(block_owner, field, None)
                if isinstance(block, list) and any(s is stmt for s in block):
                    for sibling in block[:[i for i, s in enumerate(block) if s is stmt][0]]:
                        if isinstance(sibling, ast.If):
                            body, orelse = branch_constraints(sibling.test)
                            if _exits(sibling.body) and not _exits(sibling.orelse) and orelse:
                                out.append(orelse)
                            elif _exits(sibling.orelse) and not _exits(sibling.body) and body:
                                out.append(body)
            if isinstance(block_owner, _SCOPE_TYPES):
                break
            stmt, block_owner = block_owner, self.parents.get(block_owner)
        out.reverse()  # outermost first, the innermost block overrides
        return out

    # ------------------------------------------------------------ assignment indexes

    def local_defs(self, func: ast.AST) -> dict[str, list[ast.stmt]]:
        """Assignments to plain names inside ``func`` (not nested scopes), in source order."""
        if func in self._func_defs:
            return self._func_defs[func]
        defs: dict[str, list[ast.stmt]] = {}
        body = func.body if isinstance(func.body, list) else []
        stack = list(reversed(body))
        while stack:
            stmt = stack.pop()
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            for name in _assigned_names(stmt):
                defs.setdefault(name, []).append(stmt)
            for field in ("body", "orelse", "finalbody", "handlers"):
                children = getattr(stmt, field, None)
                if isinstance(children, list):
                    stack.extend(reversed(children))
            if isinstance(stmt, ast.Match):
                for case in stmt.cases:
                    stack.extend(reversed(case.body))
        for stmts in defs.values():
            stmts.sort(key=lambda s: (s.lineno, s.col_offset))
        self._func_defs[func] = defs
        return defs

    def module_defs(self) -> dict[str, list[ast.stmt]]:
        if self._module_defs is None:
            defs: dict[str, list[ast.stmt]] = {}
            for stmt in self.tree.body:
                for name in _assigned_names(stmt):
                    defs.setdefault(name, []).append(stmt)
            self._module_defs = defs
        return self._module_defs

    def class_attr_defs(self, cls: ast.ClassDef) -> dict[str, list[tuple[ast.AST, ast.stmt]]]:
        """``self.<attr> = ...`` assignments in the class's methods: attr -> [(method, stmt)].

        Class-body constants (``sparse_mode = 3`` under ``class``) are included with the class
        as their "method". Built for every class in one pass over the file.
        """
        if not self._class_defs:
            self._build_class_defs()
        return self._class_defs.get(cls, {})

    def _build_class_defs(self) -> None:
        index: dict[ast.ClassDef, dict[str, list[tuple[ast.AST, ast.stmt]]]] = {}
        for node in self.nodes:
            if isinstance(node, ast.ClassDef):
                defs = index.setdefault(node, {})
                for item in node.body:
                    if isinstance(item, ast.Assign):
                        for target in item.targets:
                            if isinstance(target, ast.Name):
                                defs.setdefault(target.id, []).append((node, item))
                continue
            if not isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            attrs = [sub.attr for target in targets for sub in _flatten_targets(target) if _is_self_attr(sub)]
            if not attrs:
                continue
            # the method: the function directly under a class, holding this statement
            cur, method, cls = self.parents.get(node), None, None
            while cur is not None:
                parent = self.parents.get(cur)
                if isinstance(cur, (ast.FunctionDef, ast.AsyncFunctionDef)) and isinstance(parent, ast.ClassDef):
                    method, cls = cur, parent
                    break
                cur = parent
            if cls is None:
                continue
            defs = index.setdefault(cls, {})
            for attr in attrs:
                defs.setdefault(attr, []).append((method, node))
        for defs in index.values():
            for stmts in defs.values():
                stmts.sort(key=lambda pair: (pair[1].lineno, pair[1].col_offset))
        index.setdefault(None, {})  # marks the index as built even for files without classes
        self._class_defs = index

    def calls_of(self, func: ast.AST) -> list[ast.Call]:
        """Calls of ``func`` in this file: ``self.f(...)`` within its class, ``f(...)`` for module functions."""
        self._index_calls()
        parent = self.parents.get(func)
        is_method = isinstance(parent, ast.ClassDef)
        key = ("self." if is_method else "") + func.name
        return [call for call in self._calls_by_name.get(key, [])
                if not is_method or self.class_of(call) is parent]

    def _index_calls(self) -> None:
        if self._calls_by_name is None:
            index: dict[str, list[ast.Call]] = {}
            for node in self.nodes:
                if isinstance(node, ast.Call):
                    f = node.func
                    if isinstance(f, ast.Name):
                        index.setdefault(f.id, []).append(node)
                    elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
                        index.setdefault("self." + f.attr, []).append(node)
            self._calls_by_name = index

    def call_site_args(self, func: ast.AST, param: str) -> list[tuple[ast.Call, ast.AST]]:
        """Calls of ``func`` in this file and the argument each passes for ``param``."""
        is_method = isinstance(self.parents.get(func), ast.ClassDef)
        params = [a.arg for a in func.args.posonlyargs + func.args.args]
        if is_method and params:
            params = params[1:]  # bound `self`
        position = params.index(param) if param in params else None
        out = []
        for call in self.calls_of(func):
            arg = next((kw.value for kw in call.keywords if kw.arg == param), None)
            if arg is None and position is not None and position < len(call.args) and \
                    not any(isinstance(a, ast.Starred) for a in call.args[:position + 1]):
                arg = call.args[position]
            if arg is not None:
                out.append((call, arg))
        return out

    def is_parameter(self, func: ast.AST, name: str) -> bool:
        if func is None or not isinstance(func, _FUNC_TYPES):
            return False
        args = func.args
        every = args.posonlyargs + args.args + args.kwonlyargs
        every += [a for a in (args.vararg, args.kwarg) if a is not None]
        return any(a.arg == name for a in every)

    def parameter(self, func: ast.AST, name: str) -> ast.arg | None:
        if func is None or not isinstance(func, _FUNC_TYPES):
            return None
        args = func.args
        for a in args.posonlyargs + args.args + args.kwonlyargs:
            if a.arg == name:
                return a
        return None


def _exits(block: list[ast.stmt]) -> bool:
    """A block that always leaves the function (its last statement returns or raises)."""
    return bool(block) and isinstance(block[-1], (ast.Return, ast.Raise))


def _index(tree: ast.AST) -> tuple[dict[ast.AST, ast.AST], list[ast.AST]]:
    """Parent of every node and a flat list of all nodes, in one traversal (the linter's hot path)."""
    parents: dict[ast.AST, ast.AST] = {}
    nodes: list[ast.AST] = []
    stack = [tree]
    skip = (ast.expr_context, ast.boolop, ast.operator, ast.unaryop, ast.cmpop)  # shared singletons
    while stack:
        node = stack.pop()
        nodes.append(node)
        for name in node._fields:
            value = getattr(node, name, None)
            if isinstance(value, ast.AST):
                if not isinstance(value, skip):
                    parents[value] = node
                    stack.append(value)
            elif isinstance(value, list):
                for item in value:
                    if isinstance(item, ast.AST) and not isinstance(item, skip):
                        parents[item] = node
                        stack.append(item)
    return parents, nodes


def _flatten_targets(target: ast.AST):
    if isinstance(target, (ast.Tuple, ast.List)):
        for elt in target.elts:
            yield from _flatten_targets(elt)
    elif isinstance(target, ast.Starred):
        yield from _flatten_targets(target.value)
    else:
        yield target


def _assigned_names(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, ast.Assign):
        targets = stmt.targets
    elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        targets = [stmt.target]
    elif isinstance(stmt, (ast.For, ast.AsyncFor)):
        targets = [stmt.target]
    elif isinstance(stmt, (ast.With, ast.AsyncWith)):
        targets = [item.optional_vars for item in stmt.items if item.optional_vars is not None]
    else:
        return []
    return [t.id for target in targets for t in _flatten_targets(target) if isinstance(t, ast.Name)]


def _is_self_attr(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"


def is_self_attr(node: ast.AST) -> bool:
    return _is_self_attr(node)
