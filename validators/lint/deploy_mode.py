"""The deployment mode of a linted file: framework, standalone, or unknown, with the reason.

Some rules are contracts of one mode only. In framework mode cann-recipes-infer's executor owns the
cache, the slots and the packed ``[TotalTokens, hidden]`` batch; the model file registers its caches
(``get_cache_info`` / ``CacheEntry``). In standalone mode a runner of the model's own owns them and may
keep ``[batch, seq, hidden]``. ``decide`` is the one place the mode is chosen: a pure function from the
facts ``file_facts`` (the file's own AST) and ``folder_facts`` (its folder on disk) gather.

Order of the evidence, strongest first: ``--mode``; the manifest's deploy_mode; the file registering
with the framework; the file being a runner; a runner (or an entry script that builds one) beside or
above the file in a folder where no file registers; an import of the ``executor`` package. Nothing of
these: unknown. Rules of either mode still run on an unknown file, each on its own evidence (KV701 and the
framework's per-group ``forward_metadata.block_table`` need the framework mode itself).
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass
from typing import NamedTuple

FRAMEWORK, STANDALONE, UNKNOWN = "framework", "standalone", "unknown"
AUTO = "auto"
CHOICES = (AUTO, FRAMEWORK, STANDALONE)  # what --mode / lint_paths(mode=) accept

# Names only the framework's cache registration uses (executor.core.kv_cache).
_REGISTRATION_NAMES = ("get_cache_info", "CacheEntry", "ModelCacheInfo", "LayerCacheInfo", "cache_entries")
_DICT_FIELDS = ("block_table", "slot_mapping")
_RUNNER_FILE = re.compile(r"^(runner\w*|\w+_runner)\.py$")
_ENTRY_SCRIPTS = ("infer.py", "model_infer.py")
# An entry script "builds the model itself" when it calls one of these (a runner or the model class).
_BUILDS = re.compile(r"Runner$|ForCausalLM$|^from_pretrained$")
# The same, searched in the text of a folder's other files (``cache_entries`` is too common a word there).
_REGISTRATION_TEXT = re.compile(r"\b(get_cache_info|CacheEntry|ModelCacheInfo|LayerCacheInfo)\b|executor\.core\.kv_cache")
# How far above the file's own folder a runner still counts as the model folder's (models/<m>/models/x.py
# has its runner in models/<m>/).
_LEVELS_UP = 2
_MAX_SCANNED = 400  # files read when checking a folder for registrations (model folders hold tens)
_SKIP_DIRS = {"__pycache__", ".git", ".venv", "venv", "node_modules", "build", "dist"}


class Decision(NamedTuple):
    mode: str  # FRAMEWORK, STANDALONE or UNKNOWN
    reason: str


@dataclass(frozen=True)
class FileFacts:
    """What the file itself shows; each field is the reason text (None: not shown)."""

    registration: str | None = None  # registers its caches with the framework
    runner: str | None = None  # is (or defines) a runner of its own
    framework_import: str | None = None  # imports the executor package for something else (weak)


@dataclass(frozen=True)
class FolderFacts:
    """The model folder around the file: its runner or entry script, and a file there that registers."""

    runner: str | None = None  # e.g. "runner_openpangu_dense.py"
    registration: str | None = None  # a file of that folder naming the framework's registration


def decide(forced: str, manifest_mode: str | None, file: FileFacts, folder: FolderFacts | None) -> Decision:
    """The file's mode and why. ``forced``: the --mode choice; ``manifest_mode``: the manifest's deploy_mode."""
    if forced not in CHOICES:
        raise ValueError(f"unknown mode {forced!r} (choose {', '.join(CHOICES)})")
    if forced != AUTO:
        return Decision(forced, f"--mode {forced}")
    if manifest_mode in (FRAMEWORK, STANDALONE):
        return Decision(manifest_mode, f"the manifest's deploy_mode is {manifest_mode}")
    if file.registration:
        return Decision(FRAMEWORK, f"registers with the framework: {file.registration}")
    if file.runner:
        return Decision(STANDALONE, f"runner of its own: {file.runner}")
    if folder is not None and folder.runner and not folder.registration:
        return Decision(STANDALONE, f"the model folder has a runner of its own ({folder.runner}) "
                                    "and no file there registers with the framework")
    if file.framework_import:
        return Decision(FRAMEWORK, f"imports the framework package ({file.framework_import}) and no runner "
                                   "of its own was found")
    return Decision(UNKNOWN, "no framework registration and no runner found")


def applies(rule_deploy: str | None, mode: str) -> bool:
    """A rule of one mode (``Rule.deploy``) stays silent on a file decided to be of the other mode."""
    return rule_deploy is None or mode == UNKNOWN or rule_deploy == mode


# ------------------------------------------------------------------ facts of the file


def file_facts(tree: ast.Module, path: str) -> FileFacts:
    registration = runner = framework_import = None
    local_meta = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "ForwardMetaData"),
                      None)
    if _RUNNER_FILE.match(os.path.basename(path)):
        runner = f"this file ({os.path.basename(path)})"
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        found = None
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "executor":
            if (node.module or "").startswith("executor.core.kv_cache"):
                found = f"imports {node.module} (line {line})"
            elif framework_import is None:
                framework_import = f"`{node.module}`, line {line}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("executor.core.kv_cache"):
                    found = f"imports {alias.name} (line {line})"
                elif alias.name.split(".")[0] == "executor" and framework_import is None:
                    framework_import = f"`{alias.name}`, line {line}"
        elif isinstance(node, ast.arg) and node.annotation is not None and local_meta is None and \
                "ForwardMetaData" in ast.unparse(node.annotation):
            # the framework's ForwardMetaData: block_table / slot_mapping are per-group dicts
            found = f"takes the framework's ForwardMetaData (line {line})"
        elif isinstance(node, ast.Name) and node.id in _REGISTRATION_NAMES:
            found = f"`{node.id}` (line {line})"
        elif isinstance(node, ast.Attribute) and node.attr in _REGISTRATION_NAMES:
            found = f"`{node.attr}` (line {line})"
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in _REGISTRATION_NAMES:
            found = f"defines `{node.name}` (line {line})"
        elif isinstance(node, ast.ClassDef) and runner is None and _is_runner_class(node):
            runner = f"defines the runner class {node.name} (line {line})"
        if found and registration is None:
            registration = found
    if local_meta is not None:
        if _dict_fields(local_meta):
            registration = registration or f"its ForwardMetaData holds per-group dicts (line {local_meta.lineno})"
        else:  # a runner-built metadata with plain tensors (what a standalone runner defines)
            runner = runner or f"defines its own ForwardMetaData (line {local_meta.lineno})"
    return FileFacts(registration, runner, framework_import)


def _is_runner_class(cls: ast.ClassDef) -> bool:
    return "Runner" in cls.name or any("Runner" in ast.unparse(base) for base in cls.bases)


def _dict_fields(cls: ast.ClassDef) -> bool:
    """block_table / slot_mapping annotated as dicts: the framework's per-group layout."""
    for item in cls.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and \
                item.target.id in _DICT_FIELDS and re.search(r"\b(dict|Dict|Mapping)\b", ast.unparse(item.annotation)):
            return True
    return False


# ------------------------------------------------------------------ facts of the folder (reads the disk)


def folder_facts(path: str, memo: dict[str, FolderFacts] | None = None) -> FolderFacts | None:
    """The nearest folder at or up to two levels above ``path``'s that holds a runner file or an entry
    script building a runner / the model, and a file under it naming the framework's registration.
    None when ``path`` is not a file on disk (source text linted on its own). ``memo``: one run's cache
    (the files of one folder share the answer)."""
    if not os.path.isfile(path):
        return None
    start = os.path.dirname(os.path.abspath(path))
    if memo is not None and start in memo:
        return memo[start]
    facts = _folder_facts(start)
    if memo is not None:
        memo[start] = facts
    return facts


def _folder_facts(start: str) -> FolderFacts:
    folder = start
    for _ in range(_LEVELS_UP + 1):
        runner = _runner_in(folder)
        if runner:
            # named from the linted file's folder: "runner_x.py" beside it, "../runner_x.py" above it
            return FolderFacts(os.path.relpath(runner, start), _registration_under(folder))
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    return FolderFacts()


def _runner_in(folder: str) -> str | None:
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return None
    for name in names:
        if _RUNNER_FILE.match(name) and os.path.isfile(os.path.join(folder, name)):
            return os.path.join(folder, name)
    for name in _ENTRY_SCRIPTS:
        script = os.path.join(folder, name)
        if name in names and os.path.isfile(script) and _builds_model(script):
            return script
    return None


def _builds_model(script: str) -> bool:
    """The entry script constructs a runner or the model class itself (not the framework's engine)."""
    try:
        with open(script, encoding="utf-8", errors="replace") as handle:
            tree = ast.parse(handle.read(1024 * 1024))
    except (OSError, SyntaxError, ValueError, RecursionError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if _BUILDS.search(name):
                return True
    return False


def _registration_under(folder: str) -> str | None:
    """A .py file under ``folder`` that names the framework's cache registration (comments skipped)."""
    scanned = 0
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(names):
            if not name.endswith(".py"):
                continue
            scanned += 1
            if scanned > _MAX_SCANNED:  # too big to be one model's folder: not claimed standalone
                return f"(more than {_MAX_SCANNED} files, not all read)"
            file = os.path.join(root, name)
            try:
                with open(file, encoding="utf-8", errors="replace") as handle:
                    for line in handle:
                        if not line.lstrip().startswith("#") and _REGISTRATION_TEXT.search(line):
                            return os.path.relpath(file, folder)
            except OSError:
                continue
    return None
