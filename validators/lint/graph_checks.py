"""KV95x: code that runs inside a captured decode step (exe_mode npugraph_ex / ge_graph) and breaks or bakes it.

The engine captures the decode forward once per batch size and replays it; inside that step the device cannot stop
to read a value back, and a tensor made from host values is copied once at capture. Only model code the file itself
puts in a graph-mode decode branch is judged (``if not is_prefill and self.enable_npugraph_ex:``,
``x if is_npugraph_ex_decode else y``, ``exe_mode == "ge_graph"``): eager and prefill code may read back freely, and
whatever cannot be placed stays silent. ``kvcache validate --exe-mode npugraph_ex`` finds the rest by capture
(V228-V230).
"""

from __future__ import annotations

import ast
import re

from model_infer_kvcache.analyzer.operators.fa_facts import keywords_of
from model_infer_kvcache.validators.lint import ops
from model_infer_kvcache.validators.lint.scope import DECODE, Ctx

# Device -> host reads: the value must leave the device mid-step.
HOST_READS = ("item", "tolist", "cpu", "numpy")
# Tensor constructors that copy their (host) data in.
FROM_HOST = ("tensor", "as_tensor")
# Reductions whose result, tested by Python, is a device value: the capture takes one branch for every replay.
TENSOR_TESTS = ("any", "all", "equal", "allclose", "count_nonzero", "is_nonzero")
# The framework metadata's length *tensors*; the host lists the engine fills for graph decode are the
# ``actual_seq_lengths_cu_list_q`` / ``actual_seq_lengths_list_kv`` fields.
_LENGTH_TENSOR = re.compile(r"^actual_seq_lengths(_cu)?_(q|kv)$")


# Classes that prepare a step rather than run inside it: the engine builds the host lists there, per step, before
# the captured forward (executor/core/engine/execution_engine.py, ``if self.exe_mode == "npugraph_ex":``).
_OUTSIDE_THE_STEP = re.compile(r"engine|worker|runner|scheduler", re.IGNORECASE)


def in_graph_decode(ctx: Ctx) -> bool:
    return ctx.graph is True and ctx.phase == DECODE


class GraphChecks:
    def __init__(self, checker) -> None:
        self.c = checker
        self.info = checker.info

    def run(self) -> None:
        for node in self.info.nodes:
            if isinstance(node, ast.Call):
                self.host_read(node)
                self.from_host(node)
            elif isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
                self.tensor_branch(node)
        for call, op in self.c.fa_calls:
            self.fa_lengths(call, op)

    def in_step(self, node: ast.AST) -> bool:
        """In a graph-mode decode branch of model code that runs per step: not a constructor, not module level, not
        an engine / worker / runner class (they build the step's inputs before it is replayed)."""
        names = self.info.function_names(node)
        if not names or "__init__" in names or self.c._is_runner_code(node):
            return False
        cls = self.info.class_of(node)
        if cls is not None and _OUTSIDE_THE_STEP.search(cls.name):
            return False
        return in_graph_decode(self.info.ctx_of(node))

    # ------------------------------------------------------------ KV951
    def host_read(self, call: ast.Call) -> None:
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr in HOST_READS and not call.args and self.in_step(call):
            self.c.emit("KV951", call, method=func.attr, expr=_short(func.value))

    # ------------------------------------------------------------ KV952
    def from_host(self, call: ast.Call) -> None:
        if ops.terminal_name(call.func) not in FROM_HOST or not call.args or _constant(call.args[0]):
            return
        if self.in_step(call):
            self.c.emit("KV952", call, fn=ops.terminal_name(call.func), expr=_short(call.args[0]))

    # ------------------------------------------------------------ KV954
    def tensor_branch(self, node: ast.AST) -> None:
        """``if (kv_len > 0).any():`` / ``while torch.any(...)``: Python control flow on a device value."""
        if not self.in_step(node):
            return
        for call in ast.walk(node.test):
            # x.any() / torch.any(x); the builtins any() / all() over host values are fine
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr in TENSOR_TESTS:
                self.c.emit("KV954", node.test, expr=_short(call), stmt=type(node).__name__.lower())
                return

    # ------------------------------------------------------------ KV953
    def fa_lengths(self, call: ast.Call, op: str) -> None:
        """A length keyword given a metadata length tensor in a graph decode branch: directly, or through a name
        the same function assigns there (``if not is_prefill and self.enable_npugraph_ex: kv = fm.<tensor>``)."""
        kw = keywords_of(op)
        func = self.info.function_of(call)
        for keyword in call.keywords:
            if keyword.arg not in (kw.q_lens, kw.kv_lens):
                continue
            sources = [keyword.value]
            if isinstance(keyword.value, ast.Name) and func is not None:
                sources += [stmt.value for stmt in self.info.local_defs(func).get(keyword.value.id, [])
                            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1]
            for value in sources:
                field = _length_tensor(value)
                if field and self.in_step(value):
                    self.c.emit("KV953", value, kw=keyword.arg, op=op, field=field)


def _length_tensor(node: ast.AST) -> str | None:
    """The metadata length tensor ``node`` is (through view/int/to), None otherwise (a host list, ``.tolist()``)."""
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
            node.func.attr in ("view", "reshape", "int", "long", "to", "contiguous"):
        node = node.func.value
    return node.attr if isinstance(node, ast.Attribute) and _LENGTH_TENSOR.match(node.attr) else None


def _constant(node: ast.AST) -> bool:
    """A literal (nested lists of numbers too): a constant of the graph, fine to capture."""
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def _short(node: ast.AST) -> str:
    text = ast.unparse(node)
    return text if len(text) <= 60 else text[:57] + "..."
