"""What a standalone model folder is made of, read statically: its runner, model, config class, yaml, entry script.

A standalone folder of cann-recipes-infer (``models/pangu_7b``) launches through an entry script of its own
(``infer.py``: read the yaml, ``check_vars`` / ``update_vars`` of ``models/model_setting.py``, build the runner,
``init_model``, ``model_generate`` for warm-up then for the run) and a runner class (``runner_*.py``, a subclass of
``executor.model_runner.ModelRunner``) that owns the caches. Nothing here imports the folder: discovery answers
bad input (exit 2, one line) before any work.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from model_infer_kvcache.analyzer.errors import InputError

_QUANTIZED = re.compile(r"mxfp|hif8|w8a8|a8w8|int8|fp8|w4a", re.IGNORECASE)


@dataclass(frozen=True)
class StandaloneFolder:
    root: Path  # the checkout (executor/, module/ beside models/)
    folder: Path  # models/<name>
    runner_file: Path  # the runner module as it ships (or --runner-file: an edited copy)
    runner_module: str  # the name the entry script imports it by
    runner_class: str
    model_class: str
    config_file: Path  # models/configuration_*.py
    config_class: str
    yaml: Path
    yaml_reason: str
    entry_script: Path | None
    settings_hooks: tuple[str, ...]  # functions of models/model_setting.py the entry script calls on the settings


def _tree(path: Path) -> ast.Module:
    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, SyntaxError) as exc:
        raise InputError(str(path), f"cannot be read as Python: {exc}", field="--runner-root") from None


def checkout_root(folder: Path) -> Path:
    for parent in folder.resolve().parents:
        if (parent / "executor").is_dir() and (parent / "models").is_dir():
            return parent
    raise InputError(str(folder), "is not inside a cann-recipes-infer checkout (no executor/ and models/ above it)",
                     field="--runner-root")


def _runner_class(tree: ast.Module) -> str | None:
    """The class deriving from a ``*Runner`` base (``ModelRunner``)."""
    return next((n.name for n in tree.body if isinstance(n, ast.ClassDef)
                 and any(ast.unparse(b).split(".")[-1].endswith("Runner") for b in n.bases)), None)


def _imported(tree: ast.Module, pattern: str) -> str | None:
    return next((a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names
                 if re.search(pattern, a.name)), None)


def _config_class(folder: Path, runner_tree: ast.Module) -> tuple[Path, str]:
    """The configuration class the runner passes to ``init_model`` (imported from ``models.configuration_*``)."""
    wanted = _imported(runner_tree, r"Config$")
    for path in sorted((folder / "models").glob("configuration_*.py")):
        classes = [n.name for n in _tree(path).body if isinstance(n, ast.ClassDef) and n.name.endswith("Config")]
        if wanted in classes or (wanted is None and classes):
            return path, wanted or classes[0]
    raise InputError(str(folder / "models"), "holds no configuration_*.py with the runner's config class",
                     field="--runner-root")


def choose_yaml(folder: Path, given: str | None) -> tuple[Path, str]:
    """``--yaml``, else the folder's eager, unquantized yaml (the CPU run emulates bfloat16/float32 operators, not
    the quantized matmuls an mxfp8 yaml selects)."""
    if given:
        path = Path(given)
        if not path.is_file():
            raise InputError(given, "does not exist", field="--yaml")
        return path, "--yaml"
    import yaml

    candidates = []
    for path in sorted((folder / "config").rglob("*.yaml")):
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue
        if isinstance(data, dict) and isinstance(data.get("model_config"), dict):
            quant = " ".join(str(v) for k, v in data["model_config"].items() if "quant" in k)
            score = (data.get("exe_mode", "eager") != "eager", bool(_QUANTIZED.search(path.name + quant)
                                                                  or re.search(r"A8|W8|W4", quant)))
            candidates.append((score, path))
    if not candidates:
        raise InputError(str(folder / "config"), "holds no yaml with a model_config section (pass --yaml)",
                         field="--runner-root")
    score, path = min(candidates)
    why = "the folder's " + ("eager, unquantized" if score == (False, False) else "closest to eager, unquantized") + \
          " yaml"
    return path, why


def discover(folder: str | Path, runner_file: str | None = None, yaml_file: str | None = None) -> StandaloneFolder:
    folder = Path(folder).resolve()
    if not folder.is_dir():
        raise InputError(str(folder), "is not a directory", field="--runner-root")
    root = checkout_root(folder)
    runners = sorted(folder.glob("runner*.py")) + sorted(p for p in folder.glob("*_runner.py"))
    if not runners:
        raise InputError(str(folder), "has no runner of its own (runner_*.py): a framework-mode folder validates "
                                      "with --framework-root ROOT --model NAME", field="--runner-root")
    shipped = runners[0]
    path = Path(runner_file).resolve() if runner_file else shipped
    if runner_file and not path.is_file():
        raise InputError(runner_file, "does not exist", field="--runner-file")
    tree = _tree(path)
    runner_class = _runner_class(tree)
    model_class = _imported(tree, r"ForCausalLM$")
    if runner_class is None or model_class is None:
        raise InputError(str(path), "defines no *Runner subclass importing a *ForCausalLM model class",
                         field="--runner-root")
    config_file, config_class = _config_class(folder, tree)
    yaml_path, yaml_reason = choose_yaml(folder, yaml_file)
    entry = next((folder / n for n in ("infer.py", "model_infer.py") if (folder / n).is_file()), None)
    hooks: tuple[str, ...] = ()
    if entry is not None:
        entry_tree = _tree(entry)
        hooks = tuple(a.name for n in ast.walk(entry_tree) if isinstance(n, ast.ImportFrom)
                      and (n.module or "").endswith("model_setting") for a in n.names
                      if a.name in ("check_vars", "update_vars"))
    return StandaloneFolder(root, folder, path, shipped.stem, runner_class, model_class, config_file, config_class,
                            yaml_path, yaml_reason, entry, hooks)
