"""NAME -> the checkout's model and config classes, the way its launcher finds them.

A key of ``executor/core/support_models.py`` resolves through the checkout's own
``load_model_classes``; a directory under ``models/`` resolves to the ``*ForCausalLM`` class of its
``models/modeling_*.py`` and the config class (``configuration_*.py``) whose ``model_type`` is the
config's. ``--model-file`` replaces the registered model module by another file (an edited copy),
imported under the registered module name so its relative imports still reach the checkout; a file named like
another module of the model's folder (DeepSeek-V3.2's ``indexer.py``) replaces that module instead.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path

from model_infer_kvcache.analyzer.errors import InputError


@dataclass(frozen=True)
class ModelClasses:
    name: str
    model_cls: type
    config_cls: type
    model_module: str
    model_file: Path
    registered: bool  # found in support_models (else: a directory under models/)


def _registry_modules() -> dict[str, list[tuple[str, str]]]:
    import executor.core.support_models as support_models

    return dict(getattr(support_models, "_specs", {}))


def check_model_name(root: Path, name: str) -> None:
    """Bad input (exit 2) before any work when NAME is neither registered nor a directory under models/.
    Reads the registry's literal ``_specs`` keys without importing the checkout."""
    specs = _spec_modules(root)
    keys = list(specs)
    if name in keys:
        # A registry lists models a checkout may not carry (the public snapshot has five folders).
        missing = sorted({m.split(".")[1] for m in specs[name] if not (root / "models" / m.split(".")[1]).is_dir()})
        if missing:
            raise InputError(name, f"is registered in executor/core/support_models.py but its code "
                                   f"(models/{missing[0]}/) is not in the checkout {root}", field="--model")
        return
    if (root / "models" / name / "models").is_dir() or not keys:
        return
    raise InputError(name, f"is neither a key of {root}/executor/core/support_models.py "
                           f"({', '.join(sorted(keys)[:8])}, ...) nor a directory under {root}/models/",
                     field="--model")


def _load_override(module_name: str, path: Path) -> None:
    """Import ``path`` as ``module_name`` (its package is the checkout's) before anyone imports the original."""
    package = module_name.rpartition(".")[0]
    importlib.import_module(package)
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = package
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise


def resolve(root: Path, name: str, model_type: str, model_file: str | None = None) -> ModelClasses:
    """The classes for NAME (inside ``checkout_scope``); bad input (exit 2) names --model / --model-file."""
    specs = _registry_modules()
    if name in specs:
        modeling = next(m for m, a in specs[name] if "ForCausalLM" in a or a.endswith("LM"))
        if model_file:
            _load_override(_override_target(modeling, model_file), _existing(model_file))
        from executor.core.support_models import load_model_classes

        classes = load_model_classes(name)
        model_cls, config_cls = classes[0], classes[-1]
        path = Path(model_file).resolve() if model_file else Path(inspect.getfile(model_cls)).resolve()
        return ModelClasses(name, model_cls, config_cls, modeling, path, True)
    directory = root / "models" / name / "models"
    if not directory.is_dir():
        raise InputError(name, f"is neither a key of {root}/executor/core/support_models.py "
                               f"({', '.join(sorted(specs)[:8])}, ...) nor a directory under {root}/models/",
                         field="--model")
    modeling_files = sorted(directory.glob("modeling_*.py"))
    config_files = sorted(directory.glob("configuration_*.py"))
    if not modeling_files or not config_files:
        raise InputError(str(directory), "holds no modeling_*.py / configuration_*.py", field="--model")
    package = f"models.{name}.models"
    modeling = f"{package}.{modeling_files[0].stem}"
    if model_file:
        _load_override(_override_target(modeling, model_file), _existing(model_file))
    module = importlib.import_module(modeling)
    model_cls = next((c for n, c in vars(module).items() if n.endswith("ForCausalLM") and inspect.isclass(c)
                      and c.__module__ == modeling), None)
    config_cls = None
    for f in config_files:
        cmod = importlib.import_module(f"{package}.{f.stem}")
        config_cls = next((c for c in vars(cmod).values() if inspect.isclass(c)
                           and getattr(c, "model_type", None) == model_type), None) or config_cls
    if model_cls is None or config_cls is None:
        raise InputError(str(directory), f"no *ForCausalLM class in {modeling_files[0].name} or no config class "
                                         f"with model_type {model_type!r}", field="--model")
    path = Path(model_file).resolve() if model_file else modeling_files[0].resolve()
    return ModelClasses(name, model_cls, config_cls, modeling, path, False)


def _override_target(modeling: str, model_file: str) -> str:
    """The module an edited copy replaces: the folder's module of the same file name when there is one other
    than the modeling module (``indexer.py``), else the modeling module (any name: ``my_edit.py``)."""
    package = importlib.import_module(modeling.rpartition(".")[0])
    stem = Path(model_file).stem
    folders = [Path(p) for p in getattr(package, "__path__", [])]  # a namespace package has no __file__
    if stem != modeling.rpartition(".")[2] and any((f / f"{stem}.py").is_file() for f in folders):
        return f"{package.__name__}.{stem}"
    return modeling


def _existing(path: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise InputError(path, "does not exist", field="--model-file")
    return p.resolve()


def config_class_constants(root: Path, name: str, model_type: str) -> dict[str, tuple[object, str]]:
    """``{field: (value, "file:line")}`` for every field NAME's config class (the class of ``model_type`` in the
    folder's ``configuration_*.py``, and its bases defined there) fixes in an ``__init__``
    (``self.q_lora_rank = 1536`` where ``q_lora_rank`` is no parameter of that ``__init__``): whatever the
    checkpoint's config.json says, the checkout runs with that value. Read statically (no import): the tiny
    model has to be built before the checkout is imported."""
    import ast

    specs = _spec_modules(root)
    folders = {root.joinpath(*m.split(".")[:-1]) for m in specs.get(name, [])} or {root / "models" / name / "models"}
    classes: dict[str, tuple[ast.ClassDef, Path]] = {}
    for folder in sorted(f for f in folders if f.is_dir()):
        for path in sorted(folder.glob("configuration_*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef):
                    classes.setdefault(node.name, (node, path))

    def own_type(cls: ast.ClassDef):
        return next((s.value.value for s in cls.body if isinstance(s, ast.Assign) and len(s.targets) == 1
                     and isinstance(s.targets[0], ast.Name) and s.targets[0].id == "model_type"
                     and isinstance(s.value, ast.Constant)), None)

    chain: list[tuple[ast.ClassDef, Path]] = []
    todo = [c for c in classes.values() if own_type(c[0]) == model_type]
    while todo:
        cls, path = todo.pop()
        chain.append((cls, path))
        todo += [classes[b.id] for b in cls.bases if isinstance(b, ast.Name) and b.id in classes]
    found: dict[str, tuple[object, str]] = {}
    for cls, path in reversed(chain):  # bases first: the subclass's assignment wins
        for fn in cls.body:
            if not (isinstance(fn, ast.FunctionDef) and fn.name == "__init__"):
                continue
            params = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
            for node in ast.walk(fn):
                target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
                if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id == "self" and target.attr not in params
                        and isinstance(node.value, ast.Constant)):
                    found[target.attr] = (node.value.value, f"{path.name}:{node.lineno}")
    return found


def model_folders(root: Path, name: str) -> list[str]:
    """The ``models/<folder>`` directories NAME's code lives in (a registered key may reuse another's folder)."""
    folders = sorted({m.split(".")[1] for m in _spec_modules(root).get(name, []) if m.count(".") >= 2})
    return folders or [name]


def _spec_modules(root: Path) -> dict[str, list[str]]:
    """``executor/core/support_models.py``'s literal ``_specs``: name -> the ``models.*`` modules it lists (read
    without importing the checkout); {} when the file or the literal is absent."""
    import ast

    path = root / "executor" / "core" / "support_models.py"
    if not path.is_file():
        return {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id == "_specs" and isinstance(node.value, ast.Dict):
            return {k.value: [e.value for e in ast.walk(v) if isinstance(e, ast.Constant) and isinstance(e.value, str)
                              and e.value.startswith("models.")]
                    for k, v in zip(node.value.keys, node.value.values, strict=True) if isinstance(k, ast.Constant)}
    return {}
