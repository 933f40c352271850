"""ARCHITECTURE.md against the code: the import graph of every module, read with ast.

The two tables of ARCHITECTURE.md (parts with the parts each may import; the pipeline's layers)
are parsed from the document itself, so the page and the code cannot drift. Checked: no cycle
among modules (lazy imports inside functions count), every edge between parts allowed by the
table, the pipeline's modules importing only lower layers, every package folder in the table.
The checks are run on the real tree and on trees with an injected forbidden edge, an injected
cycle and an undocumented folder, which they must report.
"""

from __future__ import annotations

import ast
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "ARCHITECTURE.md"
PACKAGES = ("analyzer", "implementer", "validators", "model_infer_kvcache")
PIPELINE = "validators.pipeline"
# The installed name of the parts (pyproject's package-dir): imports read model_infer_kvcache.<part>.x,
# the graph names modules by their folder (<part>.x).
NAMESPACE = "model_infer_kvcache."


# ------------------------------------------------------------------ the import graph

def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the packages and the top-level modules."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def local_name(name: str) -> str:
    """``model_infer_kvcache.validators.x`` -> ``validators.x``; the namespace's own modules keep their name."""
    rest = name[len(NAMESPACE):] if name.startswith(NAMESPACE) else None
    return rest if rest is not None and rest.split(".")[0] in ("analyzer", "implementer", "validators", "templates") \
        else name


def import_edges(root: Path) -> dict[str, dict[str, int]]:
    """Module -> {imported module of ours: first line}; every import statement, wherever it is written."""
    mods = module_files(root)

    def ours(name: str | None) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, dict[str, int]] = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = local_name(node.module or "")
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in mods else source for a in node.names]
            else:
                continue
            targets = [local_name(t) for t in targets]
            for target in targets:
                found = ours(target)
                if found and found != mod:
                    edges.setdefault(mod, {}).setdefault(found, node.lineno)
    return edges


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    nodes = sorted(set(edges) | {b for bs in edges.values() for b in bs})
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, {}))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.append(member)
                    if member == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


# ------------------------------------------------------------------ the document's tables

@dataclass(frozen=True)
class Part:
    name: str
    paths: tuple[str, ...]  # folders end with "/", files end with ".py"
    may_import: frozenset[str]


def table_rows(text: str, heading: str) -> list[list[str]]:
    """The cells of the first Markdown table whose header row starts with ``| heading |``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"\|\s*{re.escape(heading)}\s*\|", line))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def parse_parts(text: str) -> dict[str, Part]:
    parts = {}
    for name, folder, _role, may in table_rows(text, "Part"):
        paths = tuple(re.findall(r"`([^`]+)`", folder))
        allowed = frozenset() if may in ("—", "-", "") else frozenset(p.strip() for p in may.split(","))
        parts[name] = Part(name, paths, allowed)
    return parts


def parse_layers(text: str) -> dict[str, int]:
    """Pipeline module (short name) -> layer number."""
    return {mod: int(layer) for layer, _stage, modules in table_rows(text, "Layer")
            for mod in re.findall(r"`([^`]+)`", modules)}


def part_of(module: str, path: Path, root: Path, parts: dict[str, Part]) -> str | None:
    rel = path.relative_to(root).as_posix()
    best, best_len = None, -1
    for part in parts.values():
        for p in part.paths:
            hit = rel == p if p.endswith(".py") else rel.startswith(p)
            if hit and len(p) > best_len:
                best, best_len = part.name, len(p)
    return best


# ------------------------------------------------------------------ the checks (each returns its problems)

def check_cycles(root: Path) -> list[str]:
    edges = import_edges(root)
    out = []
    for comp in cycles(edges):
        members = set(comp)
        links = [f"{a}:{line} -> {b}" for a in comp for b, line in sorted(edges.get(a, {}).items()) if b in members]
        out.append("import cycle among " + ", ".join(comp) + " (" + "; ".join(links) + ")")
    return out


def check_part_edges(root: Path, doc_text: str) -> list[str]:
    parts = parse_parts(doc_text)
    files = module_files(root)
    out = [f"ARCHITECTURE.md: part {p.name} may import unknown part {other!r}"
           for p in parts.values() for other in sorted(p.may_import) if other not in parts]
    part_edges = {p.name: {o: 0 for o in p.may_import} for p in parts.values()}
    out += [f"ARCHITECTURE.md: the parts' table has a cycle among {', '.join(c)}" for c in cycles(part_edges)]
    for mod, targets in sorted(import_edges(root).items()):
        src = part_of(mod, files[mod], root, parts)
        if src is None:
            out.append(f"{files[mod].relative_to(root)}: in no part of ARCHITECTURE.md")
            continue
        for target, line in sorted(targets.items()):
            dst = part_of(target, files[target], root, parts)
            if dst is not None and dst != src and dst not in parts[src].may_import:
                out.append(f"{files[mod].relative_to(root)}:{line}: {mod} -> {target}: part {src} may not "
                           f"import part {dst} (ARCHITECTURE.md)")
    return out


def check_pipeline_layers(root: Path, doc_text: str) -> list[str]:
    layers = parse_layers(doc_text)
    files = module_files(root)
    prefix = PIPELINE + "."
    out = [f"{files[m].relative_to(root)}: not in the pipeline's layer table of ARCHITECTURE.md"
           for m in sorted(files) if m.startswith(prefix) and m[len(prefix):] not in layers]
    out += [f"ARCHITECTURE.md: pipeline layer table names {m!r}, which is no module of validators/pipeline/"
            for m in sorted(layers) if prefix + m not in files]
    for mod, targets in sorted(import_edges(root).items()):
        if not mod.startswith(prefix) or mod[len(prefix):] not in layers:
            continue
        for target, line in sorted(targets.items()):
            short = target[len(prefix):] if target.startswith(prefix) else None
            if short in layers and layers[short] >= layers[mod[len(prefix):]]:
                out.append(f"{files[mod].relative_to(root)}:{line}: {mod} (layer {layers[mod[len(prefix):]]}) "
                           f"imports {target} (layer {layers[short]}): only lower layers")
    return out


def check_folders_documented(root: Path, doc_text: str) -> list[str]:
    documented = {p for part in parse_parts(doc_text).values() for p in part.paths}
    out = []
    for pkg in PACKAGES:
        for init in sorted((root / pkg).rglob("__init__.py")):
            folder = init.parent.relative_to(root).as_posix() + "/"
            if folder not in documented:
                out.append(f"{folder}: package folder missing from the parts table of ARCHITECTURE.md")
    return out


# ------------------------------------------------------------------ the real tree

def test_no_import_cycles():
    assert check_cycles(ROOT) == []


def test_every_edge_between_parts_is_allowed_by_the_table():
    assert check_part_edges(ROOT, DOC.read_text(encoding="utf-8")) == []


def test_pipeline_modules_import_only_lower_layers():
    assert check_pipeline_layers(ROOT, DOC.read_text(encoding="utf-8")) == []


def test_every_package_folder_is_in_the_table():
    assert check_folders_documented(ROOT, DOC.read_text(encoding="utf-8")) == []


def test_the_tables_are_read():
    """A table the parser could not read would make every check above pass vacuously."""
    text = DOC.read_text(encoding="utf-8")
    parts = parse_parts(text)
    assert {"analyzer", "implementer", "npu_ops", "harness", "lint", "pipeline", "docgen"} <= set(parts)
    assert parts["analyzer"].may_import == frozenset() and "analyzer" in parts["implementer"].may_import
    assert parse_layers(text)["check_ids"] == 0 and parse_layers(text)["report"] == 1 and parse_layers(text)["validate"] == max(parse_layers(text).values())
    edges = import_edges(ROOT)
    assert "validators.pipeline.multi_rank" in edges["validators.pipeline.validate"]  # a lazy import, seen


# ------------------------------------------------------------------ the checks can fail

@pytest.fixture
def tree(tmp_path):
    """A copy of the packages and the document to inject faults into."""
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.json", "*.j2"))
    shutil.copy(DOC, tmp_path / "ARCHITECTURE.md")
    return tmp_path


def _append(path: Path, code: str) -> None:
    path.write_text(path.read_text(encoding="utf-8") + "\n\n" + code + "\n", encoding="utf-8")


def test_an_injected_forbidden_edge_is_reported(tree):
    # The analyzer is the bottom part: a lazy import of the validation pipeline inside it is forbidden.
    _append(tree / "analyzer" / "memory.py", "def _late():\n    from model_infer_kvcache.validators.pipeline.report import Report\n")
    problems = check_part_edges(tree, (tree / "ARCHITECTURE.md").read_text(encoding="utf-8"))
    assert len(problems) == 1
    assert "analyzer.memory -> validators.pipeline.report: part analyzer may not import part pipeline" in problems[0]


def test_an_edge_the_table_allows_is_not_reported(tree):
    _append(tree / "implementer" / "render.py", "from model_infer_kvcache.analyzer import memory as _memory\n")
    assert check_part_edges(tree, (tree / "ARCHITECTURE.md").read_text(encoding="utf-8")) == []


def test_an_injected_cycle_is_reported_with_its_lazy_edge(tree):
    # report is the pipeline's bottom; a function-level import back up into validate closes a cycle.
    _append(tree / "validators" / "pipeline" / "report.py",
            "def _late():\n    from .validate import validate\n    return validate\n")
    problems = check_cycles(tree)
    assert any("validators.pipeline.report" in p and "validators.pipeline.validate" in p for p in problems), problems
    layer_problems = check_pipeline_layers(tree, (tree / "ARCHITECTURE.md").read_text(encoding="utf-8"))
    assert any("report (layer 1) imports validators.pipeline.validate (layer 9)" in p for p in layer_problems)


def test_a_cycle_between_two_parts_in_the_table_is_reported(tree):
    doc = tree / "ARCHITECTURE.md"
    text = doc.read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if line.startswith("| analyzer |"))
    doc.write_text(text.replace(row, row.rsplit("|", 2)[0] + "| implementer |"), encoding="utf-8")
    problems = check_part_edges(tree, doc.read_text(encoding="utf-8"))
    assert any("cycle among analyzer, implementer" in p for p in problems), problems


def test_an_undocumented_package_folder_is_reported(tree):
    (tree / "validators" / "newpart").mkdir()
    (tree / "validators" / "newpart" / "__init__.py").write_text('"""A part nobody drew."""\n', encoding="utf-8")
    text = (tree / "ARCHITECTURE.md").read_text(encoding="utf-8")
    assert check_folders_documented(tree, text) == [
        "validators/newpart/: package folder missing from the parts table of ARCHITECTURE.md"]


def test_an_undocumented_pipeline_module_is_reported(tree):
    (tree / "validators" / "pipeline" / "extra_stage.py").write_text('"""Not in the table."""\n', encoding="utf-8")
    problems = check_pipeline_layers(tree, (tree / "ARCHITECTURE.md").read_text(encoding="utf-8"))
    assert problems == ["validators/pipeline/extra_stage.py: not in the pipeline's layer table of ARCHITECTURE.md"]


def test_relative_and_aliased_imports_are_edges(tree):
    _append(tree / "validators" / "harness" / "paged.py", "from ..lint import registry as _r\n")
    problems = check_part_edges(tree, (tree / "ARCHITECTURE.md").read_text(encoding="utf-8"))
    assert any("validators.harness.paged -> validators.lint.registry" in p for p in problems), problems
