"""Facts from a cann-recipes-infer checkout, read as source text (never imported: it needs an NPU)."""

from __future__ import annotations

import ast
import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from model_infer_kvcache.analyzer.errors import InputError

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
    # Non-empty when the checkout can hold recurrent (linear-attention) state: MambaCacheEntry (G3).
    mamba_state_evidence: str = ""
    # The model file(s) the registry loads for this model (relative to the root), and the FA version they
    # already call: v1 / v2, or None when they call none or both (fa_evidence says which, with file:line).
    model_files: list[str] = field(default_factory=list)
    fa_version: str | None = None
    fa_evidence: str = ""


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


# Every cache_info API generation the detector knows, oldest first. G3 (HEAD era) frameworks take the
# model-side contract of G2 renders (``render_api``): a flag or a manifest may name any of them.
GENERATIONS = ("G0", "G1", "G2", "G3")

# Fields that mark the HEAD-era framework (G3): physical allocator, compressed rows and the
# tensor layout switch arrived together with the Mamba state entries and the sliding-window
# prefill layout that keeps max(0, L - 1 - W) onwards.
G3_ENTRY_FIELDS = ("allocator", "compress_ratio", "cache_layout")


def classify_generation(entry_fields, model_fields, class_names=()) -> tuple[str | None, str]:
    """The one generation rule (G0/G1/G2/G3 or None) from CacheEntry / ModelCacheInfo field names.

    Used by the analyzer (fields parsed from source) and by the harness installer (fields of
    imported classes), so both always agree. ``class_names``: other classes the module
    defines (evidence only). None when the fields fit no generation.
    """
    entry, model = list(entry_fields), list(model_fields)
    desc = f"CacheEntry({', '.join(entry)}); ModelCacheInfo({', '.join(model)})"
    if "block_size" in entry and "block_size" not in model:
        if "cache_layout" in entry:
            extra = [f for f in G3_ENTRY_FIELDS if f in entry]
            mamba = "; MambaCacheEntry defined" if "MambaCacheEntry" in class_names else ""
            return "G3", (f"G3 (HEAD era): per-entry block_size plus {', '.join(extra)}{mamba}; its model-side "
                          f"CacheEntry keywords are G2's, so renders follow the G2 contract: {desc}")
        return "G2", f"per-entry block_size, no model-level block_size: {desc}"
    if "block_size" in model and "block_size" in entry:
        return None, f"block_size on both CacheEntry and ModelCacheInfo: {desc}"
    if "block_size" in model and "is_mla_backend" in model:
        return "G1", f"model-level block_size + is_mla_backend: {desc}"
    if "block_size" in model:
        return "G0", f"model-level block_size, no is_mla_backend: {desc}"
    if "is_mla_backend" in model:
        return None, f"is_mla_backend without any block_size (neither G1 nor G2): {desc}"
    return None, f"unrecognised field set (no block_size anywhere): {desc}"


def render_api(generation: str | None) -> str | None:
    """The model-side contract a generation's renders follow (G3 frameworks take G2 renders)."""
    return "G2" if generation == "G3" else generation


# The generations a render can target: what --framework-api (analyze, render) and the manifest's
# framework_api take. Every one the detector knows; a G3 render is the G2 contract's code.
RENDER_APIS = GENERATIONS
# The model-side contracts the rendered code follows (render_api of each generation).
RENDER_CONTRACTS = tuple(g for g in GENERATIONS if render_api(g) == g)
# What a render follows when the manifest names no generation: the contract G2 and G3 frameworks take.
DEFAULT_RENDER_CONTRACT = "G2"


def frameworks_taking(contract: str) -> tuple[str, ...]:
    """The generations whose frameworks take ``contract``'s renders (G2: G2 and G3)."""
    return tuple(g for g in GENERATIONS if render_api(g) == contract)


def class_names(source: str) -> list[str]:
    return [node.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ClassDef)]


def detect_generation(source: str) -> tuple[str | None, str]:
    """G0/G1/G2/G3 from the CacheEntry / ModelCacheInfo fields of a cache_info.py text (never imported)."""
    entry = dataclass_fields(source, "CacheEntry")
    model = dataclass_fields(source, "ModelCacheInfo")
    if entry is None or model is None:
        return None, "cache_info.py defines no CacheEntry/ModelCacheInfo dataclass"
    return classify_generation(entry, model, class_names(source))


def _tokens(name: str) -> list[str]:
    return [t for t in re.split(r"[^a-z0-9]+", name.lower()) if t]


# Tokens a registry key or model directory may add after the model's own name without naming
# a different model: sizes (8b, 7b, a22b, 1.5b), tuning/deployment variants.
_VARIANT_TOKEN = re.compile(r"^(\d+(\.\d+)?[bmk]|a\d+b|instruct|chat|base|it|hf|pd|fp8|int8|w8a8)$")


def names_match(model_name: str, key: str) -> bool:
    """``key`` (a registry key or model dir) names the model itself, not a sibling model.

    The key's tokens equal the model's, or add only size/variant tokens: ``qwen3_moe`` matches
    ``qwen3-moe`` and ``qwen3_moe_pd``; ``qwen3`` matches ``qwen3_8b`` but not ``qwen3-moe``;
    ``deepseek_v3`` does not match ``deepseek_v3_2_exp``; ``llama`` does not match ``llama4``.
    """
    want, have = _tokens(model_name), _tokens(key)
    if not want or have[: len(want)] != want:
        return False
    return all(_VARIANT_TOKEN.match(t) for t in have[len(want):])


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise InputError(str(path), f"cannot read: {exc}") from None


def _class_names_in(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]  # pkg.mod.XForCausalLM: the class, not the package
    if isinstance(node, ast.Constant):
        # ("models.x.modeling_x", "XForCausalLM"): the class part (module paths contain dots)
        return [node.value] if isinstance(node.value, str) and node.value.isidentifier() else []
    return [name for child in ast.iter_child_nodes(node) for name in _class_names_in(child)]


def read_registry(source: str) -> dict[str, list[str]]:
    """Registry key -> class names, read the way the checkout's loader reads it.

    Handles ``model_dict = {"key": (ClassA, ClassB)}`` (imported classes) and the lazy
    ``_specs = {"key": [("module.path", "ClassName"), ...]}`` (class names as strings).
    """
    tree = ast.parse(source)
    registry: dict[str, list[str]] = {}
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if not isinstance(value, ast.Dict):
            continue
        for key, item in zip(value.keys, value.values, strict=False):
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                continue
            registry[key.value] = _class_names_in(item)
    return registry


def config_class_name(model_type: str) -> str | None:
    """transformers' config class for a model_type (e.g. ``qwen3`` -> ``Qwen3Config``), if known."""
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except Exception:  # transformers missing or broken: name and class matching still work
        return None
    return CONFIG_MAPPING_NAMES.get(model_type)


def registration(source: str, names: Sequence[str], architectures: Sequence[str],
                 config_class: str | None = None) -> tuple[bool, str]:
    """Is the model registered under a key of its own in support_models.py.

    A key is the model's when its entry names the model's config class (the lazy registry
    pairs each key with one), or, for an entry that names no config class, its ForCausalLM
    class is one of the config's architectures, or the key itself names the model
    (``names_match``). A sibling that reuses the modeling class under another config
    (``deepseek_v3_2_exp``: DeepseekV3ForCausalLM with DeepseekV3IndexConfig) is not the model's key.
    """
    registered, why, _ = registered_keys(source, names, architectures, config_class)
    return registered, why


def registered_keys(source: str, names: Sequence[str], architectures: Sequence[str],
                    config_class: str | None = None) -> tuple[bool, str, list[str]]:
    """``registration`` plus the registry keys that are the model's own (see there)."""
    try:
        registry = read_registry(source)
    except SyntaxError as exc:
        return False, f"cannot parse the registry: {exc.msg} (line {exc.lineno})", []
    if not registry:
        return False, "no registry dict (model_dict / _specs) found", []
    hits, keys = [], []
    for key, classes in registry.items():
        configs = [c for c in classes if c.endswith("Config")]
        if config_class and config_class in configs:
            hits.append(f"key {key!r} pairs its classes with {config_class}")
        elif not configs and (arch := next((a for a in architectures if a in classes), None)):
            hits.append(f"key {key!r} registers class {arch} (config architectures)")
        elif (name := next((n for n in names if names_match(n, key)), None)) and (
                not configs or not config_class or config_class in configs):
            hits.append(f"key {key!r} names {name}")
        else:
            continue
        keys.append(key)
    if hits:
        return True, "; ".join(hits), keys
    return False, (f"no key of its own for {'/'.join(names)} (config class {config_class or '?'}, "
                   f"architectures {list(architectures)}) among {sorted(registry)}"), []


def registry_modules(source: str, key: str) -> list[str]:
    """Dotted modules of the model classes (not the Config) a registry key loads.

    The lazy ``_specs`` form names them (``("models.qwen.models.modeling_qwen", "Qwen3ForCausalLM")``); the
    eager ``model_dict`` form names imported classes, resolved through the module's ``from X import Y``.
    """
    tree = ast.parse(source)
    imported = {alias.asname or alias.name: node.module for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module for alias in node.names}
    out: list[str] = []
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if not isinstance(value, ast.Dict):
            continue
        for k, item in zip(value.keys, value.values, strict=False):
            if not (isinstance(k, ast.Constant) and k.value == key):
                continue
            for sub in ast.walk(item):
                if (isinstance(sub, ast.Tuple) and len(sub.elts) == 2
                        and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in sub.elts)):
                    module, cls = sub.elts[0].value, sub.elts[1].value
                    if not cls.endswith("Config"):
                        out.append(module)
                elif isinstance(sub, ast.Name) and not sub.id.endswith("Config") and sub.id in imported:
                    out.append(imported[sub.id])
    return list(dict.fromkeys(out))


def fa_calls(source: str) -> list[tuple[str, int, str]]:
    """(version, line, operator) of every FA call in a model file (``torch.ops.npu.X(...)``, ``ops.X(...)``, ``X(...)``)."""
    # Here, not at module level: `kvcache validate --help` imports this module for GENERATIONS.
    from model_infer_kvcache.analyzer.operators.fa_facts import FA_OP_NAMES, version_of

    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in FA_OP_NAMES:
                out.append((version_of(name), node.lineno, name))
    return sorted(out, key=lambda c: c[1])


def relative_imports(source: str, rel: str) -> list[str]:
    """Files (relative to the checkout, as ``rel`` is) of the modules a model file imports relatively: ``from .X
    import ...``, ``from . import X``, ``from ..pkg.X import ...``. A migrated model calls FA from the rendered
    ``kvcache_attention.py`` it imports this way (INTEGRATION.md), so its version is read there too."""
    here = Path(rel).parent
    out: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom) or node.level == 0:
            continue
        package = here
        for _ in range(node.level - 1):
            package = package.parent
        if node.module:
            out.append(str(package.joinpath(*node.module.split(".")).with_suffix(".py")))
        else:
            out += [str((package / alias.name).with_suffix(".py")) for alias in node.names]
    return list(dict.fromkeys(out))


def checkout_fa_version(base: Path, files: Sequence[str]) -> tuple[str | None, str]:
    """(the FA version the checkout's model file(s) already call, evidence naming file:line); None with the
    reason when they call no FA operator, both versions, or cannot be parsed. The modules a model file imports
    relatively (one level: the rendered kvcache_attention.py of a migrated model) count as the model's."""
    seen: dict[str, list[str]] = {}
    files = list(files)
    for rel in list(files):
        try:
            files += [f for f in relative_imports(_read(base / rel), rel)
                      if f not in files and (base / f).is_file()]
        except SyntaxError:
            pass  # reported below, where the file is read for its calls
    for rel in files:
        try:
            calls = fa_calls(_read(base / rel))
        except SyntaxError as exc:
            return None, f"{rel}: cannot parse ({exc.msg}, line {exc.lineno})"
        for version, line, op in calls:
            seen.setdefault(version, []).append(f"{rel}:{line} ({op})")
    if not seen:
        return None, f"{', '.join(files)}: no FA call" if files else "no model file found in the registry"
    if len(seen) > 1:
        return None, "the checkout's model calls both versions: " + "; ".join(
            f"{v} at {', '.join(where[:2])}" for v, where in sorted(seen.items()))
    (version, where), = seen.items()
    more = f" and {len(where) - 1} more" if len(where) > 1 else ""
    return version, f"the checkout's model already calls FA {version}: {where[0]}{more}"


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
        info_source = _read(info)
        generation, evidence = detect_generation(info_source)
        mamba = "MambaCacheEntry" in class_names(info_source)
    except SyntaxError as exc:
        raise InputError(str(info), f"cannot parse: {exc.msg} (line {exc.lineno})") from None

    names = list(dict.fromkeys(n for n in (model_type, family) if n))
    registered, reg_evidence = False, "support_models.py not found"
    model_files: list[str] = []
    for rel in SUPPORT_MODELS:
        sm = base / rel
        if sm.is_file():
            sm_source = _read(sm)
            registered, why, keys = registered_keys(sm_source, names, architectures, config_class_name(model_type))
            reg_evidence = f"{rel}: {why}"
            for key in keys:
                for module in registry_modules(sm_source, key):
                    path = Path(*module.split(".")).with_suffix(".py")
                    if (base / path).is_file() and str(path) not in model_files:
                        model_files.append(str(path))
            break
    fa_version, fa_evidence = checkout_fa_version(base, model_files) if model_files else (None, "")

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
        mamba_state_evidence=f"{CACHE_INFO}: defines MambaCacheEntry" if mamba else "",
        model_files=model_files,
        fa_version=fa_version,
        fa_evidence=fa_evidence,
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
    that runs its own generation loop (SKILL.md, '开始前:部署模式与必要输入', point 3). Either half alone
    is not conclusive."""
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


def checkout_commit(root: Path) -> str | None:
    """HEAD commit when ``root`` is inside a git work tree, else None."""
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None
