"""Facts from a cann-recipes-infer checkout, read as source text (never imported: it needs an NPU)."""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from analyzer.errors import InputError

CACHE_INFO = Path("executor/core/kv_cache/cache_info.py")
SUPPORT_MODELS = (Path("executor/core/support_models.py"), Path("executor/core/entrypoints/support_models.py"))


@dataclass(frozen=True)
class CheckoutFacts:
    root: str
    generation: str | None
    generation_evidence: str
    registered: bool
    registered_evidence: str
    runner_files: list[str] = field(default_factory=list)
    standalone_runner: bool = False
    runner_evidence: str = ""


def dataclass_fields(source: str, class_name: str) -> list[str] | None:
    """Field names declared (annotated assignments) in ``class_name``, or None if absent.

    Fields of base classes defined in the same module come first, as dataclasses order them.
    """
    tree = ast.parse(source)
    classes = {node.name: node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}

    def collect(name: str, seen: frozenset[str]) -> list[str]:
        node = classes[name]
        out: list[str] = []
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes and base.id not in seen:
                out += [f for f in collect(base.id, seen | {base.id}) if f not in out]
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id not in out:
                out.append(stmt.target.id)
        return out

    return collect(class_name, frozenset({class_name})) if class_name in classes else None


def detect_generation(source: str) -> tuple[str | None, str]:
    """G0/G1/G2 from the CacheEntry / ModelCacheInfo fields (DOMAIN.md §5)."""
    entry = dataclass_fields(source, "CacheEntry")
    model = dataclass_fields(source, "ModelCacheInfo")
    if entry is None or model is None:
        return None, "cache_info.py defines no CacheEntry/ModelCacheInfo dataclass"
    desc = f"CacheEntry({', '.join(entry)}); ModelCacheInfo({', '.join(model)})"
    if "block_size" in entry and "block_size" not in model:
        return "G2", f"per-entry block_size, no model-level block_size: {desc}"
    if "block_size" in model and "is_mla_backend" in model:
        return "G1", f"model-level block_size + is_mla_backend: {desc}"
    if "block_size" in model:
        return "G0", f"model-level block_size, no is_mla_backend: {desc}"
    return None, f"unrecognised field set: {desc}"


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _tokens(name: str) -> list[str]:
    return [t for t in re.split(r"[^a-z0-9]+", name.lower()) if t]


def names_match(model_name: str, key: str) -> bool:
    """``key`` (a registry key or model dir) names the model: its leading tokens equal the model's.

    ``qwen3_moe`` matches ``qwen3-moe`` and ``qwen3_moe_pd``; ``qwen3`` matches ``qwen3_8b``;
    ``llama`` does not match ``llama4`` (tokens compare whole).
    """
    want, have = _tokens(model_name), _tokens(key)
    return bool(want) and have[: len(want)] == want


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise InputError(str(path), f"cannot read: {exc}") from None


def registration(source: str, names: Sequence[str], architectures: Sequence[str]) -> tuple[bool, str]:
    """Is the model registered in support_models.py: a string key naming it, or its class imported/used."""
    try:
        tree = ast.parse(source)
        literals = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        identifiers = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        identifiers |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    except SyntaxError:
        literals = re.findall(r"[\"']([^\"'\n]+)[\"']", source)
        identifiers = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", source))
    for arch in architectures:
        if arch in identifiers:
            return True, f"class {arch} (config architectures) is registered"
    for name in names:
        for lit in literals:
            if names_match(name, lit):
                return True, f"key {lit!r} names {name}"
    return False, f"no key for {'/'.join(names)} and no class of {list(architectures)}"


def inspect_checkout(
    root: str | Path, model_type: str, family: str, architectures: Sequence[str] = ()
) -> CheckoutFacts:
    base = Path(root)
    if not base.is_dir():
        raise InputError(str(base), "framework root is not a directory", field="--framework-root")
    info = base / CACHE_INFO
    if not info.is_file():
        raise InputError(str(info), "not found: is --framework-root a cann-recipes-infer checkout?",
                         field="--framework-root")
    try:
        generation, evidence = detect_generation(_read(info))
    except SyntaxError as exc:
        raise InputError(str(info), f"cannot parse: {exc.msg} (line {exc.lineno})") from None

    names = list(dict.fromkeys(n for n in (model_type, family) if n))
    registered, reg_evidence = False, "support_models.py not found"
    for rel in SUPPORT_MODELS:
        sm = base / rel
        if sm.is_file():
            registered, why = registration(_read(sm), names, architectures)
            reg_evidence = f"{rel}: {why}"
            break

    runners: list[str] = []
    standalone = False
    runner_evidence = ""
    models_dir = base / "models"
    if models_dir.is_dir():
        for d in sorted(p for p in models_dir.iterdir() if p.is_dir()):
            if not any(names_match(n, d.name) for n in names):
                continue
            for runner in sorted(d.rglob("runner_*.py")):
                rel_runner = str(runner.relative_to(base))
                runners.append(rel_runner)
                own_loop, why = runner_is_standalone(_read(runner))
                if own_loop and not standalone:
                    standalone = True
                    runner_evidence = f"{rel_runner}: {why}"
                elif not runner_evidence:
                    runner_evidence = f"{rel_runner}: {why}"
    return CheckoutFacts(
        root=str(base),
        generation=generation,
        generation_evidence=f"{CACHE_INFO}: {evidence}",
        registered=registered,
        registered_evidence=reg_evidence,
        runner_files=runners,
        standalone_runner=standalone,
        runner_evidence=runner_evidence,
    )


def _has_generation_loop(node: ast.AST) -> bool:
    """A ``while`` loop, or a ``for`` loop whose body calls the model (forward/generate/inference)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.While):
            return True
        if isinstance(sub, ast.For):
            for call in ast.walk(sub):
                if isinstance(call, ast.Call):
                    fn = call.func
                    name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                    if re.search(r"forward|generate|inference|decode|prefill", name):
                        return True
    return False


def runner_is_standalone(source: str) -> tuple[bool, str]:
    """Standalone = a runner class not derived from a framework base (imported from ``executor``)
    that runs its own generation loop (DOMAIN §1). Either half alone is not conclusive."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False, "unparsable runner"
    framework_names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("executor"):
            framework_names.update(a.asname or a.name for a in node.names)
        if isinstance(node, ast.Import):
            framework_names.update(a.asname or a.name.split(".")[0] for a in node.names
                                   if a.name.split(".")[0] == "executor")
    runner_classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and "runner" in n.name.lower()]
    if not runner_classes:
        return False, "no runner class"
    for node in runner_classes:
        bases = set()
        for b in node.bases:
            if isinstance(b, ast.Name):
                bases.add(b.id)
            elif isinstance(b, ast.Attribute):
                root = b
                while isinstance(root, ast.Attribute):
                    root = root.value
                bases.add(getattr(root, "id", ""))  # executor.xxx.Base -> "executor"
        if bases & framework_names:
            return False, f"class {node.name} derives from a framework base ({', '.join(sorted(bases))})"
        if _has_generation_loop(node):
            return True, f"class {node.name} does not derive from a framework base and runs its own loop"
    return False, "runner class neither derives from the framework nor runs its own loop (inconclusive)"
