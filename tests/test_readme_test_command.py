"""The README's test command is plain ``pytest`` (``.ci/run`` calls it too); it must collect every test module.

Plain ``pytest`` does not put the repository root on ``sys.path`` (``python -m pytest`` does), so a test
that imports through the ``tests.`` package collects under one and breaks under the other: a new user
running the README's command would stop at collection errors while CI stayed green.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_test_command() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    command = next(b for b in blocks if "'.[test]'" in b).strip()
    return command.rsplit("&&", 1)[-1].strip()


def test_ci_runs_the_readme_test_command():
    command = _readme_test_command()
    assert command == "pytest"
    lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    assert lines[lines.index("# The README's test command:") + 1] == command


def test_plain_pytest_collects_every_test_module():
    exe = Path(sys.executable).parent / "pytest"
    pytest_bin = str(exe) if exe.is_file() else shutil.which("pytest")
    assert pytest_bin, "no pytest entry point next to this interpreter or on PATH"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as a new user's shell has it
    # What breaks here is an import under plain pytest's sys.path (rootdir conftest, prepend import mode). Neither
    # assertion rewriting nor hypothesis' scan of local modules for constants touches sys.path, and the suite itself
    # runs both on every module: skipped here, they were half of this collection's CPU time (21.5 -> 12.5 s user).
    out = subprocess.run([pytest_bin, "--collect-only", "-q", "-p", "no:cacheprovider", "--assert=plain",
                          "-p", "no:hypothesispytest"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    # addopts has -q, so this is -qq: one "tests/test_x.py: N" line per module
    collected = {m.group(1) for m in re.finditer(r"^(tests/test_\w+\.py)", out.stdout, re.M)}
    modules = {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")}
    assert modules <= collected, sorted(modules - collected)
