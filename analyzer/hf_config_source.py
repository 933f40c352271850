"""What a transformers config class declares about its fields, read from its source file without importing
transformers (``kvcache analyze`` with a warm cache never imports it: benchmarks/bench_cli_startup.py).

``attribute_map`` (PretrainedConfig: a standard field name -> the field this class keeps it in, XLM's
``hidden_size`` -> ``emb_dim``) and which of those targets are properties the class computes (RecurrentGemma's
``layers_block_type``). The class is found by its ``model_type = "..."`` in the ``configuration_*.py`` files of
``transformers/models/<dir>/``, ``<dir>`` being the model type or its longest prefix (``inkling_text`` lives in
``inkling/``); a parent class in the same file lends its ``attribute_map`` when the class has none.

Also the fields its ``__post_init__`` computes (JetMoE's ``num_attention_heads = num_key_value_heads *
num_experts_per_tok``): an unconditional top-level assignment of arithmetic over its own fields, with the literal
defaults of the class's fields for the ones a config leaves out.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ConfigClassFacts:
    name: str  # the config class's name ("" when none was found)
    attribute_map: dict[str, str] = field(default_factory=dict)
    properties: frozenset[str] = frozenset()
    computed: dict[str, ast.expr] = field(default_factory=dict)  # field -> the expression __post_init__ assigns it
    defaults: dict[str, object] = field(default_factory=dict)  # field -> the class's literal default

    def compute(self, name: str, read) -> tuple[int, str] | None:
        """(value, the expression as written) of a field ``__post_init__`` computes, its operands read by ``read(field)
        -> value | None`` (the config's, else the class default); None when not computed or an operand is unknown;
        ``BadOperand`` naming an operand that is not an integer."""
        expr = self.computed.get(name)
        if expr is None:
            return None

        def operand(field_name: str):
            value = read(field_name)
            return self.defaults.get(field_name) if value is None else value

        try:
            return _evaluate(expr, operand), ast.unparse(expr).replace("self.", "")
        except (KeyError, ZeroDivisionError):
            return None


NONE = ConfigClassFacts("")


@functools.lru_cache(maxsize=64)
def config_class_facts(model_type: str) -> ConfigClassFacts:
    """The facts of the config class whose ``model_type`` is ``model_type``; NONE without transformers or a class."""
    models = _models_dir()
    if models is None or not model_type:
        return NONE
    wanted = model_type.replace("-", "_")
    parts = wanted.split("_")
    for n in range(len(parts), 0, -1):
        folder = models / "_".join(parts[:n])
        if folder.is_dir():
            for path in sorted(folder.glob("configuration_*.py")):
                facts = _facts_in(path, model_type)
                if facts is not None:
                    return facts
    return NONE


def _models_dir() -> Path | None:
    try:
        spec = importlib.util.find_spec("transformers")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0]) / "models"
    return folder if folder.is_dir() else None


def _facts_in(path: Path, model_type: str) -> ConfigClassFacts | None:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    for node in classes.values():
        if _assigned(node, "model_type") == model_type:
            mapping, cls = None, node
            seen: set[str] = set()
            while cls is not None and cls.name not in seen:  # a parent in the same file lends its attribute_map
                seen.add(cls.name)
                mapping = _assigned(cls, "attribute_map")
                if mapping is not None:
                    break
                cls = next((classes[b.id] for b in cls.bases if isinstance(b, ast.Name) and b.id in classes), None)
            mapping = {k: v for k, v in (mapping or {}).items() if isinstance(k, str) and isinstance(v, str)}
            properties = frozenset(item.name for item in node.body if isinstance(item, ast.FunctionDef)
                                   and any(isinstance(d, ast.Name) and d.id == "property" for d in item.decorator_list))
            return ConfigClassFacts(node.name, mapping, properties, _computed(node), _defaults(node))
    return None


_ARITH = {ast.Mult: lambda a, b: a * b, ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
          ast.FloorDiv: lambda a, b: a // b}


def _arithmetic(expr: ast.expr) -> bool:
    """Integer arithmetic over the instance's own fields (``self.a * self.b``), nothing else."""
    if isinstance(expr, ast.BinOp):
        return type(expr.op) in _ARITH and _arithmetic(expr.left) and _arithmetic(expr.right)
    if isinstance(expr, ast.Constant):
        return isinstance(expr.value, int) and not isinstance(expr.value, bool)
    return isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id == "self"


def _computed(cls: ast.ClassDef) -> dict[str, ast.expr]:
    """Fields ``__post_init__`` assigns unconditionally (a top-level statement) from arithmetic over other fields."""
    post = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__post_init__"), None)
    out: dict[str, ast.expr] = {}
    for stmt in post.body if post is not None else []:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Attribute) \
                and isinstance(stmt.targets[0].value, ast.Name) and stmt.targets[0].value.id == "self" \
                and _arithmetic(stmt.value) and not isinstance(stmt.value, ast.Constant):
            out[stmt.targets[0].attr] = stmt.value
    return out


def _defaults(cls: ast.ClassDef) -> dict[str, object]:
    """The class's annotated fields with a literal default (``num_experts_per_tok: int = 2``)."""
    out: dict[str, object] = {}
    for item in cls.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value is not None:
            try:
                out[item.target.id] = ast.literal_eval(item.value)
            except ValueError:
                continue
    return out


class BadOperand(ValueError):
    """An operand of a computed field that the config gives as something other than an integer (args: field, value)."""


def _evaluate(expr: ast.expr, read) -> int:
    if isinstance(expr, ast.BinOp):
        return _ARITH[type(expr.op)](_evaluate(expr.left, read), _evaluate(expr.right, read))
    if isinstance(expr, ast.Constant):
        return expr.value
    value = read(expr.attr)
    if value is None:
        raise KeyError(expr.attr)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadOperand(expr.attr, value)
    return value


def _assigned(cls: ast.ClassDef, name: str):
    """The literal a class body assigns to ``name`` (plain or annotated), None when none or not a literal."""
    for item in cls.body:
        targets = item.targets if isinstance(item, ast.Assign) else [item.target] \
            if isinstance(item, ast.AnnAssign) and item.value is not None else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            try:
                return ast.literal_eval(item.value)
            except ValueError:
                return None
    return None
