"""Follow a value to where it was set, per branch, and read what is certain about it.

``Resolver.variants(expr, at, ctx)`` returns the values ``expr`` may have at ``at``, each with
the context under which it holds and whether that is certain. It follows local names (reaching
assignments in the function, split by ``if is_prefill`` / sliding branches), ``self.<attr>``
assignments in the class's methods, module constants, and conditional expressions. Anything it
cannot see through (a parameter, an unknown attribute) comes back as the expression itself.
"""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass, replace

from model_infer_kvcache.validators.lint.scope import (
    Ctx,
    ModuleInfo,
    _negate,
    branch_constraints,
    is_self_attr,
)

MAX_DEPTH = 8


@dataclass(frozen=True)
class Variant:
    ctx: Ctx
    node: ast.AST
    certain: bool
    at: ast.AST  # position used to resolve names inside ``node``
    site: ast.AST | None = None  # outermost assignment the value came through (None: used directly)
    via: ast.Call | None = None  # the helper call site a parameter's value came from (None: not a parameter)

    @property
    def origin(self) -> ast.AST | None:
        """Where to fix the value: a literal/expression where it is written, else the assignment."""
        if hasattr(self.node, "lineno") and not isinstance(self.node, (ast.Name, ast.Attribute)):
            return self.node
        return self.site


def as_int(node: ast.AST | None) -> int | None:
    value = as_number(node)
    return value if isinstance(value, int) else None


def as_number(node: ast.AST | None) -> int | float | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = as_number(node.operand)
        if inner is not None:
            return -inner if isinstance(node.op, ast.USub) else inner
    return None


def as_str(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def is_none(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Pow: operator.pow, ast.Mod: operator.mod}
_MATH_FUNCS = {"sqrt": math.sqrt, "log": math.log, "exp": math.exp}


class Resolver:
    def __init__(self, info: ModuleInfo) -> None:
        self.info = info

    # ------------------------------------------------------------ variants

    def variants(self, expr: ast.AST, at: ast.AST, ctx: Ctx, depth: int = 0) -> list[Variant]:
        if depth > MAX_DEPTH:
            return [Variant(ctx, expr, False, at)]
        if isinstance(expr, ast.IfExp):
            return self._ifexp(expr, at, ctx, depth)
        if isinstance(expr, ast.NamedExpr):
            return self.variants(expr.value, at, ctx, depth + 1)
        if isinstance(expr, ast.Name):
            return self._name(expr, at, ctx, depth)
        if is_self_attr(expr):
            return self._self_attr(expr, at, ctx, depth)
        if dict_item_key(expr) is not None:
            return self._dict_item(expr, at, ctx, depth)
        return [Variant(ctx, expr, True, at)]

    def certain_variants(self, expr: ast.AST, at: ast.AST, ctx: Ctx) -> list[Variant]:
        return [v for v in self.variants(expr, at, ctx) if v.certain]

    def single(self, expr: ast.AST, at: ast.AST, ctx: Ctx) -> Variant | None:
        """The one certain value of ``expr``, or None when it has several or is uncertain."""
        found = self.variants(expr, at, ctx)
        if len(found) == 1 and found[0].certain:
            return found[0]
        return None

    def _ifexp(self, expr: ast.IfExp, at: ast.AST, ctx: Ctx, depth: int) -> list[Variant]:
        body, orelse = branch_constraints(expr.test)
        out: list[Variant] = []
        for branch, cons in ((expr.body, body), (expr.orelse, orelse)):
            if cons is None:
                out += [replace(v, certain=False) for v in self.variants(branch, at, ctx, depth + 1)]
                continue
            refined = ctx.refine(cons)
            if refined is not None:
                out += self.variants(branch, at, refined, depth + 1)
        return out

    def _name(self, expr: ast.Name, at: ast.AST, ctx: Ctx, depth: int) -> list[Variant]:
        info = self.info
        func = info.function_of(at)
        if func is not None:
            defs = info.local_defs(func).get(expr.id, [])
            use_stmt = info.statement_of(at)
            before = [d for d in defs if _precedes(d, use_stmt, info)]
            if before:
                return self._reaching(expr, before, info.branch_path(at), ctx, depth)
            if info.is_parameter(func, expr.id):
                return self._parameter(expr, func, at, ctx, depth)
            # a name from an enclosing function or the module
            outer = info.function_of(func)
            if outer is not None and info.local_defs(outer).get(expr.id):
                return self.variants(expr, func, ctx, depth + 1)
        module_defs = info.module_defs().get(expr.id, [])
        if len(module_defs) == 1 and isinstance(module_defs[0], ast.Assign) and len(module_defs[0].targets) == 1 \
                and isinstance(module_defs[0].targets[0], ast.Name):
            return self.variants(module_defs[0].value, module_defs[0], ctx, depth + 1)
        return [Variant(ctx, expr, True, at)]

    def _parameter(self, expr: ast.Name, func: ast.AST, at: ast.AST, ctx: Ctx, depth: int) -> list[Variant]:
        """A helper's parameter: the argument each call site in this file passes (or the default).

        Without call sites in the file (a ``forward`` the framework calls) the value is unknown.
        Each value keeps its call site (``via``) so that values of two arguments are only combined
        when they come from the same call.
        """
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return [Variant(ctx, expr, True, at)]
        passed = {id(call): arg for call, arg in self.info.call_site_args(func, expr.id)}
        calls = self.info.calls_of(func)
        if not calls:
            return [Variant(ctx, expr, True, at)]
        default = _default_of(func, expr.id)
        out: list[Variant] = []
        for call in calls:
            call_ctx = self.info.ctx_of(call)
            refined = ctx.refine({d: getattr(call_ctx, d) for d in ("phase", "sliding")
                                  if getattr(call_ctx, d) is not None})
            if refined is None:
                continue  # this call site never reaches the code at hand
            arg = passed.get(id(call))
            if arg is None and (default is None or any(kw.arg is None for kw in call.keywords) or
                                any(isinstance(a, ast.Starred) for a in call.args)):
                out.append(Variant(refined, expr, False, at, via=call))  # passed in a way not seen
                continue
            value, where = (arg, call) if arg is not None else (default, func)
            for v in self.variants(value, where, refined, depth + 1):
                out.append(v if v.via is not None else replace(v, via=call))
        return out

    def _dict_item(self, expr: ast.Subscript, at: ast.AST, ctx: Ctx, depth: int) -> list[Variant]:
        """``kw["sparse_mode"]`` of a local dict: the literal's entry or a later ``kw["..."] = v``, per branch."""
        info = self.info
        func = info.function_of(at)
        name, key = expr.value.id, dict_item_key(expr)
        if func is None:
            return [Variant(ctx, expr, False, at)]
        use_stmt = info.statement_of(at)
        defs = [d for d in info.local_defs(func).get(name, []) if _precedes(d, use_stmt, info)]
        for node in ast.walk(func):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Name) and node.func.value.id == name and \
                    node.func.attr in ("update", "pop", "setdefault", "clear", "popitem"):
                return [Variant(ctx, expr, False, at)]  # changed in ways not followed
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                    isinstance(node.targets[0], ast.Subscript) and isinstance(node.targets[0].value, ast.Name) and \
                    node.targets[0].value.id == name and _precedes(node, use_stmt, info):
                written = as_str(node.targets[0].slice)
                if written is None:
                    return [Variant(ctx, expr, False, at)]  # a computed key may be this one
                if written == key:
                    defs.append(node)
        if not defs:
            return [Variant(ctx, expr, True, at)]  # not a local dict: the expression itself
        defs.sort(key=lambda d: (d.lineno, d.col_offset))
        return self._reaching(expr, defs, info.branch_path(at), ctx, depth)

    def _self_attr(self, expr: ast.Attribute, at: ast.AST, ctx: Ctx, depth: int) -> list[Variant]:
        info = self.info
        cls = info.class_of(at)
        if cls is None:
            return [Variant(ctx, expr, True, at)]
        defs = info.class_attr_defs(cls).get(expr.attr, [])
        if not defs:
            return [Variant(ctx, expr, True, at)]
        method = _method_of(info, at, cls)
        same = [stmt for m, stmt in defs if m is method and _precedes(stmt, info.statement_of(at), info)]
        if same:
            return self._reaching(expr, same, info.branch_path(at), ctx, depth)
        methods = {id(m) for m, _ in defs}
        if len(methods) == 1:
            return self._reaching(expr, [stmt for _, stmt in defs], (), ctx, depth)
        # set in several methods: any of them may be current
        out: list[Variant] = []
        for _, stmt in defs:
            for v in self._def_value(stmt, expr, ctx, depth):
                out.append(replace(v, certain=False))
        return out

    def _reaching(self, expr, defs, use_path, ctx: Ctx, depth: int) -> list[Variant]:
        """Reaching definitions of ``expr`` at a use whose branch path is ``use_path``."""
        info = self.info
        # (constraints, certain, stmt or None for the value on entry)
        reaching: list[tuple[dict, bool, ast.stmt | None]] = [({}, True, None)]
        for stmt in defs:
            def_path = info.branch_path(stmt)
            common = 0
            while common < len(def_path) and common < len(use_path) and def_path[common] == use_path[common]:
                common += 1
            if common == len(def_path):
                reaching = [({}, True, stmt)]
                continue
            if common < len(use_path) and def_path[common][0] is use_path[common][0]:
                continue  # the other branch of an `if` that leads to the use: never reaches it
            cons: dict = {}
            understood = True
            for item, branch in def_path[common:]:
                body, orelse = branch_constraints(item.test)
                part = body if branch == "body" else orelse
                if part is None:
                    understood = False
                    break
                for dim, value in part.items():
                    if cons.get(dim, value) != value:
                        understood = False
                    cons[dim] = value
            updated = []
            for r_cons, r_certain, r_stmt in reaching:
                if not understood:
                    updated.append((r_cons, False, r_stmt))  # may or may not be overwritten
                    continue
                if any(r_cons.get(d, v) != v for d, v in cons.items()):
                    updated.append((r_cons, r_certain, r_stmt))  # the new value never happens there
                    continue
                residual = {d: v for d, v in cons.items() if d not in r_cons}
                if not residual:
                    continue  # always overwritten where this value held
                neg = _negate(residual)
                if neg is None:
                    updated.append((r_cons, False, r_stmt))
                else:
                    updated.append(({**r_cons, **neg}, r_certain, r_stmt))
            reaching = updated + [(cons if understood else {}, understood, stmt)]
        out: list[Variant] = []
        for cons, certain, stmt in reaching:
            refined = ctx.refine(cons)
            if refined is None:
                continue
            if stmt is None:
                out.append(Variant(refined, expr, certain, expr))
                continue
            for v in self._def_value(stmt, expr, refined, depth):
                out.append(replace(v, certain=v.certain and certain))
        return out

    def _def_value(self, stmt: ast.stmt, expr: ast.AST, ctx: Ctx, depth: int) -> list[Variant]:
        """Value a definition statement gives ``expr`` (its target), resolved further."""
        key = dict_item_key(expr)
        if key is not None:  # one entry of a local dict: from its literal or a `d["key"] = v` write
            value = stmt.value if isinstance(stmt, ast.Assign) else None
            if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
                value = dict(dict_literal_items(stmt.value) or ()).get(key)
            if value is None:
                return [Variant(ctx, expr, False, stmt, stmt)]
            return [replace(v, site=stmt) for v in self.variants(value, stmt, ctx, depth + 1)]
        if isinstance(stmt, ast.Assign) and all(isinstance(t, (ast.Name, ast.Attribute)) for t in stmt.targets):
            # also chained `a = b = value`
            return [replace(v, site=stmt) for v in self.variants(stmt.value, stmt, ctx, depth + 1)]
        if isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            return [replace(v, site=stmt) for v in self.variants(stmt.value, stmt, ctx, depth + 1)]
        if isinstance(stmt, ast.AugAssign):
            # `x *= m` -> `x * m`, with `x` read before this statement
            synth = ast.BinOp(left=stmt.target, op=stmt.op, right=stmt.value)
            ast.copy_location(synth, stmt)
            return [Variant(ctx, synth, True, stmt, stmt)]
        return [Variant(ctx, expr, False, stmt, stmt)]

    # ------------------------------------------------------------ literal evaluation

    def number(self, expr: ast.AST, at: ast.AST, ctx: Ctx, depth: int = 0) -> float | int | None:
        """Value of a literal-only arithmetic expression (names followed), else None."""
        if depth > MAX_DEPTH:
            return None
        value = as_number(expr)
        if value is not None:
            return value
        if isinstance(expr, (ast.Name, ast.Attribute, ast.IfExp)):
            v = self.single(expr, at, ctx)
            if v is None or v.node is expr:
                return None
            return self.number(v.node, v.at, v.ctx, depth + 1)
        if isinstance(expr, ast.BinOp) and type(expr.op) in _BINOPS:
            left = self.number(expr.left, at, ctx, depth + 1)
            right = self.number(expr.right, at, ctx, depth + 1)
            if left is None or right is None:
                return None
            try:
                return _BINOPS[type(expr.op)](left, right)
            except (ArithmeticError, ValueError, OverflowError):
                return None
        if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.USub):
            inner = self.number(expr.operand, at, ctx, depth + 1)
            return -inner if inner is not None else None
        if isinstance(expr, ast.Call) and len(expr.args) == 1 and not expr.keywords:
            name = expr.func.attr if isinstance(expr.func, ast.Attribute) else getattr(expr.func, "id", None)
            if name in _MATH_FUNCS or name in ("float", "int"):
                arg = self.number(expr.args[0], at, ctx, depth + 1)
                if arg is None:
                    return None
                try:
                    return {"float": float, "int": int, **_MATH_FUNCS}[name](arg)
                except (ArithmeticError, ValueError):
                    return None
        return None


def dict_item_key(node: ast.AST) -> str | None:
    """``"k"`` for ``name["k"]`` (a local dict's entry), else None."""
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        return as_str(node.slice)
    return None


def dict_literal_items(node: ast.AST) -> list[tuple[str, ast.AST]] | None:
    """(key, value) pairs of a dict literal / ``dict(k=v)`` call with only literal string keys."""
    if isinstance(node, ast.Dict):
        items = []
        for key, value in zip(node.keys, node.values, strict=True):
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                return None  # `**other` (key None) or a computed key
            items.append((key.value, value))
        return items
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict" and not node.args:
        if any(kw.arg is None for kw in node.keywords):
            return None
        return [(kw.arg, kw.value) for kw in node.keywords]
    return None


def _default_of(func: ast.FunctionDef | ast.AsyncFunctionDef, name: str) -> ast.AST | None:
    args = func.args
    positional = args.posonlyargs + args.args
    for arg, default in zip(positional[len(positional) - len(args.defaults):], args.defaults, strict=True):
        if arg.arg == name:
            return default
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        if arg.arg == name:
            return default
    return None


def _precedes(stmt: ast.AST, use_stmt: ast.AST, info: ModuleInfo) -> bool:
    if stmt is use_stmt:
        return False
    # a compound statement holding the use (e.g. a `for` whose target is the name) still precedes it
    return (stmt.lineno, stmt.col_offset) < (use_stmt.lineno, use_stmt.col_offset) or \
        _contains(stmt, use_stmt, info)


def _contains(outer: ast.AST, inner: ast.AST, info: ModuleInfo) -> bool:
    cur = info.parents.get(inner)
    while cur is not None:
        if cur is outer:
            return True
        cur = info.parents.get(cur)
    return False


def _method_of(info: ModuleInfo, node: ast.AST, cls: ast.ClassDef):
    cur = info.enclosing(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    while cur is not None and info.parents.get(cur) is not cls:
        cur = info.enclosing(cur, (ast.FunctionDef, ast.AsyncFunctionDef))
    return cur
