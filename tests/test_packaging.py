"""The wheel installs one package, model_infer_kvcache, plus the `kvcache` script: no generic top-level names.

`validators`, `analyzer` and `templates` are names other projects publish on the package index; installing
them at the top level would shadow or overwrite theirs. The wheel is built offline from a copy of the tree
(setuptools' PEP 517 backend in this interpreter, no build isolation) and its file list read.
"""

from __future__ import annotations

import ast
import configparser
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NS = "model_infer_kvcache"
PARTS = ("analyzer", "implementer", "templates", "validators")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    src = tmp_path_factory.mktemp("src")
    for name in (*PARTS, NS):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("dist")
    code = ("import sys, setuptools.build_meta as b; "
            f"print(b.build_wheel({str(out)!r}))")
    run = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return zipfile.ZipFile(out / run.stdout.strip().splitlines()[-1])


def test_the_wheel_has_one_top_level_package(wheel):
    tops = {name.split("/")[0] for name in wheel.namelist() if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {NS}, sorted(tops)
    assert not tops & set(PARTS)


def test_every_package_folder_and_data_file_is_in_the_wheel(wheel):
    names = set(wheel.namelist())
    for part in PARTS:
        for init in (ROOT / part).rglob("__init__.py"):
            assert f"{NS}/{init.relative_to(ROOT).as_posix()}" in names, init
    for data in [*(ROOT / "templates").glob("*.j2"), *(ROOT / "analyzer" / "operators").glob("*.json")]:
        assert f"{NS}/{data.relative_to(ROOT).as_posix()}" in names, data


def test_the_console_script_is_the_namespaced_cli(wheel):
    info = next(n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt"))
    entry = configparser.ConfigParser()
    entry.read_string(wheel.read(info).decode())
    assert entry["console_scripts"]["kvcache"] == f"{NS}.cli:main"


def test_no_module_imports_a_part_by_its_bare_name():
    """Inside the installed package only model_infer_kvcache.<part> exists: a bare `import analyzer` breaks it."""
    bad = []
    for folder in (*PARTS, NS):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
                bad += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] in PARTS]
    assert bad == []


def test_the_installed_package_imports_outside_the_checkout(tmp_path):
    run = subprocess.run([sys.executable, "-c", f"import {NS}.validators.lint as l, {NS}.analyzer.build as b; "
                          "print(l.__name__, b.__name__)"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [f"{NS}.validators.lint", f"{NS}.analyzer.build"]
    for part in PARTS:  # the bare names are not ours (absent, or another project's)
        probe = subprocess.run([sys.executable, "-c", f"import importlib.util as u; s = u.find_spec({part!r}); "
                                "print(s.origin if s else None)"], cwd=tmp_path, capture_output=True, text=True,
                               timeout=120)
        assert probe.returncode == 0, probe.stderr
        origin = probe.stdout.strip()
        assert origin == "None" or not Path(origin).resolve().is_relative_to(ROOT), (part, origin)
