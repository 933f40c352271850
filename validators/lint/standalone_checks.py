"""KV9xx: what a standalone runner must get right itself (the framework does it for framework files).

* KV902 a class hands slots out of a free list (an attribute, or a serving loop's local list handed to its helpers
  by name) and takes them back, while a per-slot length attribute
  is only ever advanced (``+=``, ``add_``): nothing resets it, so a reused slot starts where the last
  request stopped. Any other write of the length (``= 0``, ``zero_()``, ``fill_``, a whole
  reassignment outside ``__init__`` and the methods only ``__init__`` calls, an alias or the whole
  tensor passed to a call) counts as a reset that lint cannot judge, and keeps the rule silent.
* KV903 a KV cache is allocated (``torch.zeros`` into a ``*cache*`` name, ``init_cache(...)``) in a
  function that runs once per step (``forward``, ``decode``, ``step``, ``..._step``,
  ``model_input_prepare``, ``prepare_inputs_for_generation``) or in a per-token loop of a ``generate``
  function (not a loop over the layers), with no enclosing ``if`` (``if self.k_cache is None:`` is a lazy first
  allocation, ``if is_prefill:`` once per batch).
* KV904 one call (or dict) passes ``actual_seq_lengths_kv=`` (or ``seq_lens=``...) built on the host
  (a Python list attribute, ``.tolist()``, ``.item()``) and ``slot_mapping=``, and the length counters
  the two read (``self.<..._len(s)>``) are different attributes. Reported only when both values are
  followed to their end; a parameter or a helper's result on the way leaves the call unjudged.
"""

from __future__ import annotations

import ast
import re

from model_infer_kvcache.analyzer.operators.fa_facts import FA_KEYWORDS
from model_infer_kvcache.validators.lint.hidden_layout import _name
from model_infer_kvcache.validators.lint.scope import is_self_attr

# Per-slot length counters, by name: kv_len, seq_lens, cache_lens, context_lens, cur_pos, lengths...
_LEN_ATTR = re.compile(r"^_?(kv|seq|cache|cached|ctx|context|past|cur|computed|filled|row|slot)_?"
                       r"(len|lens|length|lengths|pos|positions)$|^_?(lengths|positions|num_computed_tokens)$")
_POOL_TAKE = {"pop", "popleft"}
_POOL_GIVE = {"append", "appendleft", "add", "extend", "insert"}
_GROW_METHODS = {"add_", "index_add_", "__iadd__"}
_READ_METHODS = {"clone", "tolist", "item", "to", "cpu", "npu", "cuda", "max", "min", "sum", "float", "int", "long",
                 "numpy", "detach", "view", "reshape", "unsqueeze", "squeeze", "size", "dim", "numel", "index",
                 "count", "copy", "contiguous", "cumsum", "get", "__getitem__", "type", "expand", "repeat",
                 "gather", "index_select", "eq", "ne", "gt", "lt", "ge", "le", "all", "any", "argmax", "clamp"}

_FACTORIES = {"zeros", "empty", "ones", "full", "zeros_like", "empty_like", "ones_like", "full_like"}
_CACHE_BUILDER = re.compile(r"^_?(init|alloc|allocate|create|build|new|make)_?(kv_?)?caches?$|^(Dynamic|Static)Cache$")
_STEP_FUNC = re.compile(r"^(forward|decode|step|model_inference|model_input_prepare|prepare_inputs_for_generation)$"
                        r"|^_?(forward|decode|step)_(?!.*prefill)|_(decode|step)$")
_LAYER_LOOP = re.compile(r"layer|module|attn|attention|block|head|cache", re.IGNORECASE)
_NOT_KV = {"cos", "sin", "rotary", "freq", "freqs", "mask", "position", "pos", "emb", "inv"}
_SAME_VALUE_METHODS = {"to", "npu", "cuda", "contiguous"}

# FA's length keywords (every version's, from their one home) and the names runners keep lengths under
_HOST_LENGTH_KEYS = tuple(sorted({name for k in FA_KEYWORDS.values() for name in (k.q_lens, k.kv_lens)})) + (
    "seq_lens", "kv_lens", "context_lens", "seq_lengths")
_SLOT_KEYS = ("slot_mapping",)
_HOST_METHODS = {"tolist", "item", "cpu", "numpy"}
_MAX_DEPTH = 6




def _is_cache_name(name: str) -> bool:
    words = set(name.lower().strip("_").split("_"))
    return (bool(words & {"cache", "caches"}) or name == "past_key_values") and not words & _NOT_KV


class StandaloneChecks:
    def __init__(self, checker) -> None:
        self.c = checker
        self.info = checker.info

    def run(self) -> None:
        for node in self.info.nodes:
            if isinstance(node, ast.ClassDef):
                self.recycled_slots(node)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.Expr)):
                self.per_step_cache(node)
            elif isinstance(node, ast.Call):
                self.length_sources(node, {kw.arg: kw for kw in node.keywords if kw.arg})
            elif isinstance(node, ast.Dict):
                self.length_sources(node, {k.value: v for k, v in zip(node.keys, node.values, strict=True)
                                           if isinstance(k, ast.Constant) and isinstance(k.value, str)})

    # ------------------------------------------------------------ KV902: recycled slots

    def recycled_slots(self, cls: ast.ClassDef) -> None:
        defs = self.info.class_attr_defs(cls)
        pools = {attr for attr, sites in defs.items() if any(_is_slot_pool(attr, stmt) for _, stmt in sites)}
        # a serving loop's own free list (``free_rows = list(range(self.batch_size))``), handed to its helpers
        # under the same name: taken from and given back to by that name anywhere in the class
        pools |= {t.id for node in ast.walk(cls) if isinstance(node, ast.Assign) for t in node.targets
                  if isinstance(t, ast.Name) and _is_slot_pool(t.id, node)}
        if not pools:
            return
        takes: dict[str, ast.Call] = {}
        given: set[str] = set()
        uses: dict[str, list[ast.Attribute]] = {}
        for node in ast.walk(cls):
            if isinstance(node, ast.Call):
                pool = _pool_of(node)
                if pool in pools:
                    method = _name(node.func)
                    if method in _POOL_TAKE or method == "heappop":
                        takes.setdefault(pool, node)
                    elif method in _POOL_GIVE or method == "heappush":
                        given.add(pool)
            if is_self_attr(node) and _LEN_ATTR.match(node.attr):
                uses.setdefault(node.attr, []).append(node)
        recycled = [pool for pool in pools if pool in takes and pool in given]
        if not recycled:
            return
        for attr, nodes in uses.items():
            grown = self._only_grown(nodes)
            if grown is not None:
                pool = recycled[0]
                named = pool if any(isinstance(n, ast.Name) and n.id == pool for n in ast.walk(takes[pool])) \
                    else f"self.{pool}"
                self.c.emit("KV902", takes[pool], pool=named, length=f"self.{attr}",
                            grow=ast.unparse(grown), line=grown.lineno)
                return

    def _only_grown(self, uses: list[ast.Attribute]) -> ast.stmt | None:
        """The first statement advancing the per-slot length, when every write of it only advances it."""
        grown = None
        indexed = False
        for node in uses:
            kind, stmt = self._use_kind(node)
            if kind in ("reset", "escape"):
                return None
            indexed |= isinstance(self.info.parents.get(node), ast.Subscript)
            if kind == "grow" and grown is None:
                grown = stmt
        return grown if indexed else None  # per slot: indexed somewhere

    def _use_kind(self, node: ast.Attribute) -> tuple[str, ast.AST | None]:
        """'grow', 'reset' (another write), 'escape' (aliased / handed to a call whole), 'init' or 'read'."""
        parents = self.info.parents
        expr: ast.AST = node
        parent = parents.get(node)
        if isinstance(parent, ast.Subscript) and parent.value is node:
            expr, parent = parent, parents.get(parent)
        while isinstance(parent, (ast.Tuple, ast.List, ast.Starred)) and isinstance(getattr(parent, "ctx", None),
                                                                                     ast.Store):
            parent = parents.get(parent)  # a tuple target: `self.kv_len[i], x = ...`
        if isinstance(parent, ast.AugAssign) and parent.target is expr:
            return ("grow" if isinstance(parent.op, ast.Add) else "reset"), parent
        if isinstance(parent, (ast.Assign, ast.AnnAssign)) and getattr(parent, "value", None) is not None and \
                any(expr is t or _contains(t, expr) for t in (parent.targets if isinstance(parent, ast.Assign)
                                                              else [parent.target])):
            if expr is node:  # the whole attribute: set up once, else replaced (a reset)
                method = self.info.enclosing(parent, (ast.FunctionDef, ast.AsyncFunctionDef))
                return ("init" if method is not None and self._runs_once(method) else "reset"), parent
            refers = any(is_self_attr(n) and n.attr == node.attr for n in ast.walk(parent.value))
            return ("grow" if refers and isinstance(parent.value, ast.BinOp) and isinstance(parent.value.op, ast.Add)
                    else "reset"), parent
        if isinstance(parent, ast.Delete):
            return "reset", parent
        if isinstance(parent, ast.Attribute) and parent.value is expr:
            call = parents.get(parent)
            if isinstance(call, ast.Call) and call.func is parent:
                if parent.attr in _GROW_METHODS:
                    return "grow", self.info.statement_of(call)
                return ("read" if parent.attr in _READ_METHODS else "reset"), call
            return "read", None
        if expr is node:
            # the whole tensor / list handed on: whatever the receiver does to it is not visible here
            if isinstance(parent, ast.Call) or isinstance(parent, ast.keyword) or \
                    isinstance(parent, (ast.Assign, ast.AnnAssign, ast.NamedExpr, ast.Return, ast.Yield)) or \
                    isinstance(parent, (ast.Tuple, ast.List, ast.Dict)):
                return "escape", parent
        return "read", None

    def _runs_once(self, method: ast.AST) -> bool:
        """``__init__``, or a method this file calls only from ``__init__`` (``self._init_kvcache(...)``).
        A method called elsewhere, or from outside the file, may run per batch: what it assigns is a reset."""
        if method.name == "__init__":
            return True
        calls = self.info.calls_of(method)
        return bool(calls) and all(getattr(self.info.enclosing(call, (ast.FunctionDef, ast.AsyncFunctionDef)),
                                           "name", None) == "__init__" for call in calls)

    # ------------------------------------------------------------ KV903: per-step allocation

    def per_step_cache(self, stmt: ast.stmt) -> None:
        value = stmt.value
        if not isinstance(value, ast.Call):
            return
        call = value
        while isinstance(call.func, ast.Attribute) and call.func.attr in _SAME_VALUE_METHODS and \
                isinstance(call.func.value, ast.Call):
            call = call.func.value  # torch.zeros(...).to(device)
        fname = _name(call.func)
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) \
            else []
        targets = [t for target in targets for t in ast.walk(target) if isinstance(t, (ast.Name, ast.Attribute))]
        allocates = bool(_CACHE_BUILDER.match(fname)) or (
            fname in _FACTORIES and _torch_call(call) and any(_is_cache_name(_name(t)) for t in targets))
        if not allocates:
            return
        if self.info.branch_path(stmt):
            return  # allocated behind a test: lazily once, or once per batch at prefill
        func = self.info.enclosing(stmt, (ast.FunctionDef, ast.AsyncFunctionDef))
        if func is None:
            return
        where = self._qualified(func)
        if _STEP_FUNC.search(func.name):
            why = "runs once per step"
        else:
            loop = self._token_loop(stmt, func) if "generate" in func.name.lower() else None
            if loop is None:
                return
            why = f"runs once per token (the loop at line {loop.lineno})"
        target = f"{ast.unparse(stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target)} = " \
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)) else ""
        self.c.emit("KV903", stmt, expr=f"{target}{ast.unparse(call.func)}(...)", where=f"`{where}`", why=why)

    def _token_loop(self, stmt: ast.stmt, func: ast.AST) -> ast.AST | None:
        """The enclosing loop of a generate function that runs per token: a ``while``, or a ``for`` that is
        not over the layers (allocating each layer's cache in a loop before decoding is allocating once)."""
        cur = self.info.parents.get(stmt)
        while cur is not None and cur is not func:
            if isinstance(cur, ast.While):
                return cur
            if isinstance(cur, (ast.For, ast.AsyncFor)) and not _LAYER_LOOP.search(ast.unparse(cur.iter)) and \
                    not _LAYER_LOOP.search(ast.unparse(cur.target)):
                return cur
            cur = self.info.parents.get(cur)
        return None

    def _qualified(self, func: ast.AST) -> str:
        cls = self.info.parents.get(func)
        return f"{cls.name}.{func.name}" if isinstance(cls, ast.ClassDef) else func.name

    # ------------------------------------------------------------ KV904: two length counters

    def length_sources(self, node: ast.AST, named: dict[str, ast.AST]) -> None:
        length_kw = next((k for k in _HOST_LENGTH_KEYS if k in named), None)
        slot_kw = next((k for k in _SLOT_KEYS if k in named), None)
        if length_kw is None or slot_kw is None:
            return
        length_at, slot_at = named[length_kw], named[slot_kw]
        length_value = length_at.value if isinstance(length_at, ast.keyword) else length_at
        slot_value = slot_at.value if isinstance(slot_at, ast.keyword) else slot_at
        length = _Sources(self.info, node)
        slot = _Sources(self.info, node)
        length.visit(length_value, node, 0)
        slot.visit(slot_value, node, 0)
        if not (length.complete and slot.complete and length.host):
            return
        length_counters = {r for r in length.roots if _LEN_ATTR.match(r)}
        slot_counters = {r for r in slot.roots if _LEN_ATTR.match(r)}
        if length_counters and slot_counters and not length_counters & slot_counters:
            self.c.emit("KV904", length_at, length_kw=length_kw, slot_kw=slot_kw,
                        length_src=", ".join(f"self.{r}" for r in sorted(length_counters)),
                        slot_src=", ".join(f"self.{r}" for r in sorted(slot_counters)))


class _Sources:
    """The ``self.<attr>`` values an expression is built from (through the function's locals), whether it
    is a host value (a Python list, ``.tolist()``, ``.item()``), and whether every part of it was seen."""

    def __init__(self, info, at: ast.AST) -> None:
        self.info = info
        self.func = info.enclosing(at, (ast.FunctionDef, ast.AsyncFunctionDef))
        self.cls = info.class_of(at)
        self.roots: set[str] = set()
        self.host = False
        self.complete = True
        self.index_vars: set[str] = set()
        self._seen: set[int] = set()

    def visit(self, node: ast.AST, at: ast.AST, depth: int, bound: frozenset[str] = frozenset()) -> None:
        if depth > _MAX_DEPTH:
            self.complete = False
            return
        if isinstance(node, ast.Constant):
            return
        if is_self_attr(node):
            self.roots.add(node.attr)
            self.host |= self._host_attr(node.attr)
        elif isinstance(node, ast.Attribute):
            self.visit(node.value, at, depth + 1, bound)
        elif isinstance(node, ast.Name):
            self._name(node, at, depth, bound)
        elif isinstance(node, ast.Subscript):
            self.visit(node.value, at, depth + 1, bound)  # the index picks rows; it is not a length
        elif isinstance(node, ast.Call):
            self._call(node, at, depth, bound)
        elif isinstance(node, (ast.List, ast.ListComp)):
            self.host = True
            self._children(node, at, depth, bound)
        elif isinstance(node, (ast.Tuple, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.IfExp,
                               ast.GeneratorExp, ast.SetComp, ast.Starred)):
            self._children(node, at, depth, bound)
        else:
            self.complete = False

    def _children(self, node: ast.AST, at: ast.AST, depth: int, bound: frozenset[str]) -> None:
        if isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.SetComp)):
            for gen in node.generators:
                names = frozenset(n.id for n in ast.walk(gen.target) if isinstance(n, ast.Name))
                if self._parameter_rows(gen.iter):
                    # `for r in rows` (a parameter): r picks rows, fine as an index, unknown as a value
                    self.index_vars |= names
                else:
                    self.visit(gen.iter, at, depth + 1, bound)
                    bound = bound | names
            self.visit(node.elt, at, depth + 1, bound)
            return
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr):
                self.visit(child, at, depth + 1, bound)

    def _parameter_rows(self, node: ast.AST) -> bool:
        """A comprehension over the function's parameters (``rows``, ``zip(rows, lens)``)."""
        parts = node.args if isinstance(node, ast.Call) and _name(node.func) in ("zip", "enumerate") else [node]
        return all(isinstance(p, ast.Name) and self.info.is_parameter(self.func, p.id) for p in parts)

    def _call(self, node: ast.Call, at: ast.AST, depth: int, bound: frozenset[str]) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and not is_self_attr(func):
            if func.attr in _HOST_METHODS:
                self.host = True
            self.visit(func.value, at, depth + 1, bound)  # x.tolist(), torch.tensor(...): the receiver / module
        elif isinstance(func, ast.Name):
            if func.id == "list":
                self.host = True
        elif is_self_attr(func):
            self._method_result(func.attr, depth)  # self.helper(rows): what the helper returns
            return
        else:
            self.complete = False
            return
        for arg in node.args:
            self.visit(arg, at, depth + 1, bound)
        for kw in node.keywords:
            if kw.arg not in ("dtype", "device"):
                self.visit(kw.value, at, depth + 1, bound)

    def _method_result(self, name: str, depth: int) -> None:
        method = next((m for m in (self.cls.body if self.cls is not None else [])
                       if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name == name), None)
        returns = [r for r in ast.walk(method) if isinstance(r, ast.Return) and r.value is not None
                   and self.info.enclosing(r, (ast.FunctionDef, ast.AsyncFunctionDef)) is method] if method else []
        if not returns:
            self.complete = False
            return
        saved, self.func = self.func, method
        for ret in returns:
            self.visit(ret.value, ret, depth + 1)
        self.func = saved

    def _name(self, node: ast.Name, at: ast.AST, depth: int, bound: frozenset[str]) -> None:
        if node.id in self.index_vars:
            self.complete = False  # a row index used as a value
            return
        if node.id in bound or node.id in ("torch", "np", "numpy", "math") or node.id.isupper():
            return
        if self.func is None or self.info.is_parameter(self.func, node.id):
            self.complete = False  # a parameter: what the caller passes is not followed
            return
        defs = self.info.local_defs(self.func).get(node.id)
        if not defs:
            if node.id not in self.info.module_defs():
                self.complete = False
            return
        for stmt in defs:
            if id(stmt) in self._seen:
                continue
            self._seen.add(id(stmt))
            value = getattr(stmt, "value", None)
            if not isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)) or value is None:
                self.complete = False  # a loop target, a with / import binding
                continue
            self.visit(value, stmt, depth + 1, bound)

    def _host_attr(self, attr: str) -> bool:
        """``self.<attr>`` is set to a Python list somewhere in the class (``[0] * n``, ``list(...)``, ``[...]``)."""
        if self.cls is None:
            return False
        for _, stmt in self.info.class_attr_defs(self.cls).get(attr, []):
            value = getattr(stmt, "value", None)
            if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult):
                value = value.left if isinstance(value.left, ast.List) else value.right
            if isinstance(value, (ast.List, ast.ListComp)) or \
                    (isinstance(value, ast.Call) and _name(value.func) == "list"):
                return True
        return False


def _is_slot_pool(attr: str, stmt: ast.stmt) -> bool:
    """``self.<attr> = list(range(n))`` / ``deque(range(n))`` / ``[i for i in range(n)]``, or a list / deque /
    set named ``free...``: a pool of slot indices."""
    value = getattr(stmt, "value", None)
    if isinstance(value, ast.Call) and _name(value.func) in ("list", "deque", "set", "SortedList") and value.args:
        inner = value.args[0]
        if isinstance(inner, ast.Call) and _name(inner.func) == "range":
            return True
    if isinstance(value, (ast.ListComp, ast.SetComp)) and any(
            isinstance(g.iter, ast.Call) and _name(g.iter.func) == "range" for g in value.generators):
        return True
    if "free" in attr.lower():
        return isinstance(value, (ast.List, ast.Set, ast.ListComp, ast.SetComp)) or (
            isinstance(value, ast.Call) and _name(value.func) in ("list", "deque", "set"))
    return False


def _pool_of(call: ast.Call) -> str | None:
    """The ``self.<pool>`` a call takes from or gives back to (``self.free.pop()``, ``heappush(self.free, s)``)."""
    func = call.func
    if isinstance(func, ast.Attribute) and is_self_attr(func.value):
        return func.value.attr
    if _name(func) in ("heappop", "heappush") and call.args and is_self_attr(call.args[0]):
        return call.args[0].attr
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):  # a method's own free list
        return func.value.id
    return None


def _torch_call(call: ast.Call) -> bool:
    func = call.func
    return isinstance(func, ast.Name) or (isinstance(func, ast.Attribute) and _name(func.value) == "torch")


def _contains(outer: ast.AST, inner: ast.AST) -> bool:
    return any(n is inner for n in ast.walk(outer))
