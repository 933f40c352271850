"""What a transformers config class declares about its fields, read from its source file without importing
transformers (``kvcache analyze`` with a warm cache never imports it: benchmarks/bench_cli_startup.py).

``attribute_map`` (PretrainedConfig: a standard field name -> the field this class keeps it in, XLM's
``hidden_size`` -> ``emb_dim``) and which of those targets are properties the class computes (RecurrentGemma's
``layers_block_type``). The class is found by its ``model_type = "..."`` in the ``configuration_*.py`` files of
``transformers/models/<dir>/``, ``<dir>`` being the model type or its longest prefix (``inkling_text`` lives in
``inkling/``); a parent class in the same file lends its ``attribute_map`` when the class has none.
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
            return ConfigClassFacts(node.name, mapping, properties)
    return None


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
