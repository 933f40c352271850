"""What can be known statically about an attention mask expression: its dtype and its shape."""

from __future__ import annotations

import ast

from model_infer_kvcache.validators.lint.scope import Ctx
from model_infer_kvcache.validators.lint.values import MAX_DEPTH, Resolver, as_number

_FLOAT_DTYPES = {"float16", "half", "bfloat16", "float32", "float", "float64", "double"}
_INT_DTYPES = {"int8", "uint8", "int16", "short", "int32", "int", "int64", "long"}
_CAST_METHODS = {"bool": "bool", "half": "float", "float": "float", "bfloat16": "float", "double": "float",
                 "int": "int", "long": "int", "byte": "int", "char": "int", "short": "int"}
# methods that keep dtype (and shape, unless listed in _RESHAPING)
_KEEP_METHODS = {"masked_fill", "masked_fill_", "clone", "contiguous", "detach", "npu", "cuda", "cpu",
                 "tril", "triu", "tril_", "triu_", "logical_not", "expand", "repeat", "unsqueeze", "squeeze",
                 "view", "reshape", "transpose", "permute", "flatten", "to", "type"}
_RESHAPING = {"expand", "repeat", "squeeze", "view", "reshape", "transpose", "permute", "flatten"}
_FACTORIES = {"ones", "zeros", "empty", "rand", "randn", "full"}


def _func_name(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return None


def _is_torch_func(call: ast.Call) -> bool:
    """``torch.ones(...)`` (a module function), as opposed to ``tensor.bool()`` (a method)."""
    func = call.func
    return isinstance(func, ast.Name) or (
        isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in ("torch", "th")
    )


def dtype_name_class(node: ast.AST | None) -> str | None:
    """'bool' / 'int' / 'float' for a dtype expression such as ``torch.bfloat16`` or ``bool``."""
    if node is None:
        return None
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
    if isinstance(node, ast.Attribute) and not (isinstance(node.value, ast.Name) and node.value.id == "torch"):
        return None
    if name == "bool":
        return "bool"
    if name in _FLOAT_DTYPES:
        return "float"
    if name in _INT_DTYPES:
        return "int"
    return None


def _kw(call: ast.Call, name: str) -> ast.AST | None:
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


class MaskFacts:
    def __init__(self, resolver: Resolver) -> None:
        self.resolver = resolver

    def _follow(self, node: ast.AST, at: ast.AST, ctx: Ctx):
        if isinstance(node, (ast.Name, ast.Attribute, ast.IfExp)):
            v = self.resolver.single(node, at, ctx)
            if v is None or v.node is node:
                return None
            return v
        return None

    # ------------------------------------------------------------ dtype

    def dtype(self, node: ast.AST, at: ast.AST, ctx: Ctx, depth: int = 0) -> str | None:
        if depth > MAX_DEPTH or node is None:
            return None
        followed = self._follow(node, at, ctx)
        if followed is not None:
            return self.dtype(followed.node, followed.at, followed.ctx, depth + 1)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Invert):
            return self.dtype(node.operand, at, ctx, depth + 1)
        if isinstance(node, ast.Compare):
            return "bool"
        if isinstance(node, ast.BinOp):
            for side in (node.left, node.right):
                if isinstance(as_number(side), float) or "inf" in ast.unparse(side) or "finfo" in ast.unparse(side):
                    return "float"
            return None
        if not isinstance(node, ast.Call):
            return None
        name = _func_name(node)
        if _is_torch_func(node):
            dtype_kw = _kw(node, "dtype")
            if dtype_kw is not None:
                return dtype_name_class(dtype_kw)
            if name in ("ones", "zeros", "empty", "rand", "randn"):
                return "float"  # torch's default dtype
            if name == "full" and len(node.args) >= 2:
                fill = node.args[1]
                if isinstance(fill, ast.Constant) and isinstance(fill.value, bool):
                    return "bool"
                value = as_number(fill)
                if isinstance(value, float) or (isinstance(fill, ast.Call) and _func_name(fill) == "float"):
                    return "float"
                return "int" if isinstance(value, int) else None
            if name in ("tril", "triu", "ones_like", "zeros_like", "empty_like", "clone") and node.args:
                return self.dtype(node.args[0], at, ctx, depth + 1)
            if name in ("logical_not", "logical_and", "logical_or", "eq", "ne", "gt", "lt", "ge", "le"):
                return "bool"
            return None
        receiver = node.func.value if isinstance(node.func, ast.Attribute) else None
        if receiver is None:
            return None
        if name in _CAST_METHODS and not node.args and not node.keywords:
            return _CAST_METHODS[name]
        if name in ("to", "type"):
            target = _kw(node, "dtype")
            if target is None:
                for arg in node.args:
                    if dtype_name_class(arg) is not None:
                        target = arg
                        break
            if target is not None:
                return dtype_name_class(target)
            # `.to(device)`: same dtype
            if all(isinstance(a, (ast.Name, ast.Attribute)) and "device" in ast.unparse(a) for a in node.args):
                return self.dtype(receiver, at, ctx, depth + 1)
            return None
        if name in _KEEP_METHODS:
            return self.dtype(receiver, at, ctx, depth + 1)
        return None

    # ------------------------------------------------------------ shape

    def _dims(self, nodes, at: ast.AST, ctx: Ctx) -> tuple[int, ...] | None:
        dims = []
        for node in nodes:
            value = self.resolver.number(node, at, ctx)
            if not isinstance(value, int) or value < 0:
                return None  # unknown, or -1 (inferred): not a literal shape
            dims.append(value)
        return tuple(dims)

    def shape(self, node: ast.AST, at: ast.AST, ctx: Ctx, depth: int = 0) -> tuple[int, ...] | None:
        if depth > MAX_DEPTH or node is None:
            return None
        followed = self._follow(node, at, ctx)
        if followed is not None:
            return self.shape(followed.node, followed.at, followed.ctx, depth + 1)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Invert):
            return self.shape(node.operand, at, ctx, depth + 1)
        if not isinstance(node, ast.Call):
            return None
        name = _func_name(node)
        if name == "get_init_attn_mask" and node.args:
            size = self.resolver.number(node.args[0], at, ctx)
            return (size, size) if isinstance(size, int) else None
        if _is_torch_func(node):
            if name in _FACTORIES and node.args:
                first = node.args[0]
                if isinstance(first, (ast.Tuple, ast.List)):
                    return self._dims(first.elts, at, ctx)
                if name == "full":
                    return None
                if any(isinstance(a, ast.Starred) for a in node.args):
                    return None
                return self._dims(node.args, at, ctx)
            if name in ("tril", "triu", "logical_not", "clone") and node.args:
                return self.shape(node.args[0], at, ctx, depth + 1)
            return None
        receiver = node.func.value if isinstance(node.func, ast.Attribute) else None
        if receiver is None:
            return None
        if name == "unsqueeze" and len(node.args) == 1 and as_number(node.args[0]) == 0:
            inner = self.shape(receiver, at, ctx, depth + 1)
            return (1, *inner) if inner is not None else None
        if name in ("view", "reshape") and node.args:
            args = node.args[0].elts if len(node.args) == 1 and isinstance(node.args[0], (ast.Tuple, ast.List)) \
                else node.args
            return self._dims(args, at, ctx)
        if name in _CAST_METHODS or (name in _KEEP_METHODS and name not in _RESHAPING):
            return self.shape(receiver, at, ctx, depth + 1)
        return None
