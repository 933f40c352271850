"""What the code cites lives in the repository.

Comments, docstrings and ``--help`` texts point readers to ``references/*.md`` or ``SKILL.md``
(optionally with a section heading, written ``references/<file>.md, '<heading>'``). Every such path must
exist and every cited heading must be a heading of that file; nothing may cite the design note
kept outside the repository.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXT_SUFFIXES = {".py", ".j2", ".md", ".json", ".toml", ".yaml", ".yml", ".txt", ".cfg", ".ini"}
# Spelled in pieces so this file does not match itself.
OUTSIDE_SPEC = ("DOMAIN" + " §", "DOMAIN" + ".md", "spec/" + "DOMAIN")
PATH_RE = re.compile(r"(?<![\w/.-])(references/[\w.-]+\.md)")
SECTION_RE = re.compile(r"(?<![\w/.-])(references/[\w.-]+\.md|SKILL\.md),\s+'([^'\n]+)'")


def _tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        names = out.splitlines()
    except (OSError, subprocess.CalledProcessError):
        # Not a git checkout (e.g. an unpacked sdist): every file outside hidden and build folders.
        names = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                 if p.is_file() and not any(part.startswith(".") or part in {"build", "dist", "__pycache__"}
                                            for part in p.relative_to(ROOT).parts)]
    files = []
    for name in names:
        if name.startswith("tests/golden/"):
            continue
        p = ROOT / name
        if p.suffix in TEXT_SUFFIXES and p.is_file():
            files.append(p)
    return files


def _headings(md: Path) -> set[str]:
    return {line.lstrip("#").strip() for line in md.read_text(encoding="utf-8").splitlines()
            if line.startswith("#")}


def test_the_file_walk_sees_the_citing_code():
    # Guards the walk itself: an empty or narrowed list would make the checks below pass vacuously.
    names = {str(p.relative_to(ROOT)) for p in _tracked_files()}
    assert {"analyzer/rules.py", "validators/npu_ops/readings.py", "SKILL.md", "README.md"} <= names


def test_nothing_cites_the_design_note_outside_the_repository():
    hits = []
    for p in _tracked_files():
        for i, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if any(s in line for s in OUTSIDE_SPEC):
                hits.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not hits, "cite references/*.md or a docstring instead:\n" + "\n".join(hits)


def test_every_cited_references_file_exists():
    missing, cited = [], 0
    for p in _tracked_files():
        if p.suffix not in {".py", ".j2"}:
            continue
        for m in PATH_RE.finditer(p.read_text(encoding="utf-8")):
            cited += 1
            if not (ROOT / m.group(1)).is_file():
                missing.append(f"{p.relative_to(ROOT)}: {m.group(1)}")
    assert cited > 0
    assert not missing, "\n".join(missing)


def test_every_cited_section_is_a_heading_of_its_file():
    wrong, cited = [], 0
    for p in _tracked_files():
        if p.suffix not in {".py", ".j2"}:
            continue
        for m in SECTION_RE.finditer(p.read_text(encoding="utf-8")):
            cited += 1
            target = ROOT / m.group(1)
            if not target.is_file() or m.group(2) not in _headings(target):
                wrong.append(f"{p.relative_to(ROOT)}: {m.group(1)}, '{m.group(2)}'")
    assert cited >= 5, cited
    assert not wrong, "no such file or heading:\n" + "\n".join(wrong)
