"""Facts from a cann-recipes-infer checkout, read as source text (never imported: it needs an NPU)."""

from __future__ import annotations

import ast
import re
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
    """Field names declared (annotated assignments) in ``class_name``, or None if absent."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return [
                stmt.target.id
                for stmt in node.body
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
            ]
    return None


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


def inspect_checkout(root: str | Path, model_type: str, family: str) -> CheckoutFacts:
    base = Path(root)
    if not base.is_dir():
        raise InputError(str(base), "framework root is not a directory", field="--framework-root")
    info = base / CACHE_INFO
    if not info.is_file():
        raise InputError(str(info), "not found: is --framework-root a cann-recipes-infer checkout?",
                         field="--framework-root")
    try:
        generation, evidence = detect_generation(info.read_text(encoding="utf-8"))
    except SyntaxError as exc:
        raise InputError(str(info), f"cannot parse: {exc.msg} (line {exc.lineno})") from None

    names = {_norm(model_type), _norm(family)}
    registered, reg_evidence = False, "support_models.py not found"
    for rel in SUPPORT_MODELS:
        sm = base / rel
        if sm.is_file():
            text = sm.read_text(encoding="utf-8", errors="replace")
            literals = {_norm(s) for s in re.findall(r"[\"']([^\"']+)[\"']", text)}
            hit = sorted(n for n in names if n and any(n in lit for lit in literals))
            registered = bool(hit)
            reg_evidence = f"{rel}: {'mentions ' + hit[0] if hit else 'no entry for ' + model_type}"
            break

    runners: list[str] = []
    standalone = False
    runner_evidence = ""
    models_dir = base / "models"
    if models_dir.is_dir():
        for d in sorted(p for p in models_dir.iterdir() if p.is_dir()):
            if not any(n and n in _norm(d.name) for n in names):
                continue
            for runner in sorted(d.rglob("runner_*.py")):
                runners.append(str(runner.relative_to(base)))
                own_loop, why = runner_is_standalone(runner.read_text(encoding="utf-8", errors="replace"))
                if own_loop:
                    standalone = True
                    runner_evidence = f"{runner.relative_to(base)}: {why}"
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


def runner_is_standalone(source: str) -> tuple[bool, str]:
    """A runner class not derived from a framework base (imported from ``executor``) = standalone."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False, "unparsable runner"
    framework_names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("executor"):
            framework_names.update(a.asname or a.name for a in node.names)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and "runner" in node.name.lower():
            bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
            if not bases & framework_names:
                return True, f"class {node.name} does not derive from a framework base"
    return False, "runner derives from a framework base"
