"""Bad input to every command: exit 2, one stderr line naming the file/flag/field, no traceback, nothing written.

Cases run in-process through `kvcache_cli.main` (the console entry) from a scratch cwd; the
scratch folder and the shared inputs are snapshotted byte for byte before and after each case.
A few run through a subprocess to prove no traceback reaches the terminal.
"""

from __future__ import annotations

import os
import subprocess
import json
import sys
from pathlib import Path

import pytest
from cli_support import invoke, snapshot
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.manifest import SCHEMA_VERSION
from model_infer_kvcache.analyzer.progress_writer import markers
from model_infer_kvcache.implementer.render import render_manifest, write_rendered
from model_infer_kvcache.validators.pipeline.report import SECTION_ID as REPORT_SECTION

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny_qwen3" / "config.json"
GOOD_PY = str(ROOT / "tests" / "fixtures" / "lint" / "kv201_prefill_no_mask_good.py")
# Folders no process can create files in, root included: procfs refuses new files (ENOENT), sysfs
# is read-only (EACCES). Both are there on every Linux host the suite runs on.
NO_ENTRY, READ_ONLY = Path("/proc"), Path("/sys")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """Valid inputs to break one at a time: the example's manifest and render, and broken files."""
    d = tmp_path_factory.mktemp("inputs")
    manifest = analyze(AnalyzeRequest(config=str(EXAMPLE)))
    (d / "manifest.json").write_text(manifest.to_json(), encoding="utf-8")
    write_rendered(render_manifest(manifest), d / "rendered")
    (d / "empty").mkdir()
    (d / "bad.json").write_text('{"schema_version": ', encoding="utf-8")
    (d / "not_manifest.json").write_text(f'{{"schema_version": "{SCHEMA_VERSION}"}}', encoding="utf-8")
    old = json.loads(manifest.to_json()) | {"schema_version": "1.0"}  # a manifest of the schema before 2.0
    (d / "old_manifest.json").write_text(json.dumps(old), encoding="utf-8")
    (d / "syntax.py").write_text("def broken(:\n", encoding="utf-8")
    begin, _ = markers(REPORT_SECTION)
    (d / "damaged.md").write_text(f"notes\n{begin}\n", encoding="utf-8")
    (d / "a_file").write_text("x\n", encoding="utf-8")
    return {p.name: p for p in d.iterdir()}


EX = str(EXAMPLE)
# id: (argv builder (tmp dir t, inputs i), words the one stderr line must contain)
CASES = {
    # ---- kvcache itself
    "kvcache no command": (lambda t, i: [], ["kvcache", "no command"]),
    "kvcache unknown command": (lambda t, i: ["analyse"], ["unknown command 'analyse'"]),
    # ---- analyze: numbers
    "analyze hbm nan": (lambda t, i: ["analyze", "--config", EX, "--hbm-gb", "nan"], ["--hbm-gb", "nan"]),
    "analyze hbm inf": (lambda t, i: ["analyze", "--config", EX, "--hbm-gb", "inf"], ["--hbm-gb", "inf"]),
    "analyze hbm -inf": (lambda t, i: ["analyze", "--config", EX, "--hbm-gb=-inf"], ["--hbm-gb", "-inf"]),
    "analyze hbm overflowing": (lambda t, i: ["analyze", "--config", EX, "--hbm-gb", "1e308"], ["--hbm-gb", "1e+308"]),
    "analyze hbm zero": (lambda t, i: ["analyze", "--config", EX, "--hbm-gb", "0"], ["--hbm-gb"]),
    "analyze hbm not a number": (lambda t, i: ["analyze", "--config", EX, "--hbm-gb", "lots"], ["--hbm-gb", "lots"]),
    "analyze ratio nan": (lambda t, i: ["analyze", "--config", EX, "--hbm-gb", "40", "--kv-mem-ratio", "nan"],
                          ["--kv-mem-ratio", "nan"]),
    "analyze ratio inf": (lambda t, i: ["analyze", "--config", EX, "--hbm-gb", "40", "--kv-mem-ratio", "inf"],
                          ["--kv-mem-ratio"]),
    "analyze ratio zero": (lambda t, i: ["analyze", "--config", EX, "--kv-mem-ratio", "0"], ["--kv-mem-ratio"]),
    "analyze max len negative": (lambda t, i: ["analyze", "--config", EX, "--max-len", "-1"], ["--max-len"]),
    "analyze tp not dividing heads": (lambda t, i: ["analyze", "--config", EX, "--attn-tp-size", "3"],
                                      ["--attn-tp-size", "num_attention_heads"]),
    "analyze block size": (lambda t, i: ["analyze", "--config", EX, "--block-size", "100"], ["--block-size"]),
    "analyze unknown flag": (lambda t, i: ["analyze", "--config", EX, "--bogus"], ["--bogus"]),
    "analyze bad format": (lambda t, i: ["analyze", "--config", EX, "--format", "xml"], ["--format", "xml"]),
    # ---- analyze: files
    "analyze missing config": (lambda t, i: ["analyze", "--config", t / "nope.json"], ["nope.json", "not found"]),
    "analyze broken config": (lambda t, i: ["analyze", "--config", i["bad.json"]], ["bad.json", "invalid JSON"]),
    "analyze out unwritable": (lambda t, i: ["analyze", "--config", EX, "--out", READ_ONLY / "m.json"],
                               ["/sys/m.json", "not writable"]),
    "analyze out in procfs": (lambda t, i: ["analyze", "--config", EX, "--out", NO_ENTRY / "m.json"],
                              ["/proc/m.json", "not writable"]),
    "analyze out under a file": (lambda t, i: ["analyze", "--config", EX, "--out", i["a_file"] / "m.json"],
                                 ["a_file/m.json", "directory does not exist"]),
    "analyze out is a directory": (lambda t, i: ["analyze", "--config", EX, "--out", t / "mine"], ["mine", "not a regular file"]),
    "analyze progress unwritable": (
        lambda t, i: ["analyze", "--config", EX, "--write-progress", READ_ONLY / "p.md"], ["/sys/p.md", "not writable"]),
    # ---- schema
    "schema out unwritable": (lambda t, i: ["schema", "--out", READ_ONLY / "s.json"], ["/sys/s.json", "not writable"]),
    "schema out in procfs": (lambda t, i: ["schema", "--out", NO_ENTRY / "s.json"], ["/proc/s.json"]),
    "schema out missing folder": (lambda t, i: ["schema", "--out", t / "no" / "s.json"],
                                  ["s.json", "directory does not exist"]),
    "schema unknown flag": (lambda t, i: ["schema", "--pretty"], ["kvcache schema", "--pretty"]),
    # ---- render
    "render missing manifest": (lambda t, i: ["render", "--manifest", t / "m.json", "--out", t / "r"],
                                ["m.json", "file not found"]),
    "render broken manifest": (lambda t, i: ["render", "--manifest", i["bad.json"], "--out", t / "r"],
                               ["bad.json", "not a valid selection manifest"]),
    "render incomplete manifest": (lambda t, i: ["render", "--manifest", i["not_manifest.json"], "--out", t / "r"],
                                   ["not_manifest.json", "generator"]),
    "render out unwritable": (lambda t, i: ["render", "--manifest", i["manifest.json"], "--out", READ_ONLY / "r"],
                              ["/sys/r", "--out", "not writable"]),
    "render out in procfs": (lambda t, i: ["render", "--manifest", i["manifest.json"], "--out", NO_ENTRY / "r"],
                             ["/proc/r", "--out"]),
    "render out is a file": (lambda t, i: ["render", "--manifest", i["manifest.json"], "--out", i["a_file"]],
                             ["a_file", "not a directory"]),
    "render no out": (lambda t, i: ["render", "--manifest", i["manifest.json"]], ["--out"]),
    "render bad class name": (lambda t, i: ["render", "--manifest", i["manifest.json"], "--out", t / "r",
                                            "--attention-class", "1Bad"], ["--attention-class"]),
    "render bad api": (lambda t, i: ["render", "--manifest", i["manifest.json"], "--out", t / "r",
                                     "--framework-api", "G9"], ["--framework-api", "G9"]),
    # ---- lint
    "lint no path": (lambda t, i: ["lint"], ["PATH"]),
    "lint missing file": (lambda t, i: ["lint", t / "nope.py"], ["nope.py"]),
    "lint syntax error": (lambda t, i: ["lint", i["syntax.py"]], ["syntax.py"]),
    "lint unknown rule": (lambda t, i: ["lint", GOOD_PY, "--select", "KV999"], ["KV999"]),
    "lint missing manifest": (lambda t, i: ["lint", GOOD_PY, "--manifest", t / "m.json"], ["m.json"]),
    "lint invalid manifest": (lambda t, i: ["lint", GOOD_PY, "--manifest", i["not_manifest.json"]],
                              ["not_manifest.json", "not a valid selection manifest"]),
    # a manifest of the schema before 2.0 (layer plans untagged): refused by its version, whatever else it holds
    "render old schema": (lambda t, i: ["render", "--manifest", i["old_manifest.json"], "--out", t / "r"],
                          ["old_manifest.json", "schema_version '1.0' is not the supported '2.0'", "re-run kvcache "
                           "analyze"]),
    "validate old schema": (lambda t, i: ["validate", "--manifest", i["old_manifest.json"], "--rendered",
                                          i["rendered"], "--config", EX], ["old_manifest.json", "schema_version"]),
    "lint bad format": (lambda t, i: ["lint", GOOD_PY, "--format", "xml"], ["--format", "xml"]),
    # ---- validate
    "validate missing manifest": (
        lambda t, i: ["validate", "--manifest", t / "m.json", "--rendered", i["rendered"], "--config", EX],
        ["m.json", "file not found"]),
    "validate empty rendered": (
        lambda t, i: ["validate", "--manifest", i["manifest.json"], "--rendered", i["empty"], "--config", EX],
        ["empty", "--rendered", "kvcache_attention.py"]),
    "validate missing config": (
        lambda t, i: ["validate", "--manifest", i["manifest.json"], "--rendered", i["rendered"], "--config", t / "c.json"],
        ["c.json", "not found"]),
    "validate report unwritable": (
        lambda t, i: ["validate", "--manifest", i["manifest.json"], "--rendered", i["rendered"], "--config", EX,
                      "--report", READ_ONLY / "r.json"], ["/sys/r.json", "--report", "not writable"]),
    "validate markdown missing folder": (
        lambda t, i: ["validate", "--manifest", i["manifest.json"], "--rendered", i["rendered"], "--config", EX,
                      "--markdown", t / "no" / "r.md"], ["r.md", "--markdown", "directory does not exist"]),
    "validate progress damaged": (
        lambda t, i: ["validate", "--manifest", i["manifest.json"], "--rendered", i["rendered"], "--config", EX,
                      "--write-progress", i["damaged.md"]], ["damaged.md", "damaged kvcache section markers"]),
    "validate tp differs": (
        lambda t, i: ["validate", "--manifest", i["manifest.json"], "--rendered", i["rendered"], "--config", EX,
                      "--attn-tp-size", "2"], ["--attn-tp-size", "differs from the manifest"]),
    "validate seed not a number": (
        lambda t, i: ["validate", "--manifest", i["manifest.json"], "--rendered", i["rendered"], "--config", EX,
                      "--seed", "x"], ["--seed"]),
    "validate no config": (lambda t, i: ["validate", "--manifest", i["manifest.json"], "--rendered", i["rendered"]],
                           ["--config"]),
    # ---- run (default --out is ./kvcache-out in the scratch cwd)
    "run out unwritable": (lambda t, i: ["run", "--out", READ_ONLY / "out"], ["/sys/out", "--out", "not writable"]),
    "run out is a file": (lambda t, i: ["run", "--out", i["a_file"]], ["a_file", "--out", "not a directory"]),
    "run out holds other files": (lambda t, i: ["run", "--out", t / "mine"],
                                  ["mine", "--out", "notes.txt was not written by kvcache run"]),
    "run missing config": (lambda t, i: ["run", "--config", t / "c.json"], ["c.json", "not found"]),
    "run tp not dividing heads": (lambda t, i: ["run", "--attn-tp-size", "3"], ["--attn-tp-size"]),
    "run unknown dispatch": (lambda t, i: ["run", "--dispatch", "部署模式: 混合部署"], ["--dispatch", "混合部署"]),
    "run flag it lacks": (lambda t, i: ["run", "--out-dir", "x"], ["kvcache run", "--out-dir"]),
    "run hbm nan": (lambda t, i: ["run", "--hbm-gb", "nan"], ["--hbm-gb"]),
    "run blocked config": (lambda t, i: ["run", "--config", ROOT / "tests" / "fixtures" / "configs" / "gemma2_9b.json"],
                           ["gemma2_9b.json: blockers:", "--allow-blocked"]),
    "run npu without npu": (lambda t, i: ["run", "--backend", "npu"], ["--backend", "npu requested but unavailable"]),
}


def test_at_least_forty_cases_over_every_command():
    commands = {name.split()[0] for name in CASES}
    assert {"analyze", "schema", "render", "lint", "validate", "run"} <= commands
    assert len(CASES) >= 40


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case, inputs, tmp_path, monkeypatch, capsys):
    build, words = CASES[case]
    scratch = tmp_path / "cwd"
    scratch.mkdir()
    (scratch / "mine").mkdir()
    (scratch / "mine" / "notes.txt").write_text("the user's own file\n", encoding="utf-8")
    monkeypatch.chdir(scratch)
    argv = build(scratch, inputs)
    before = snapshot(scratch, next(iter(inputs.values())).parent)
    rc, out, err = invoke(argv, capsys)
    assert rc == 2, (rc, err)
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err and "error" in err, err
    for word in words:
        assert word in err, (word, err)
    if argv and argv[0] == "run":
        assert "--manifest" not in err  # run has no --manifest flag to point at
    assert snapshot(scratch, next(iter(inputs.values())).parent) == before


def _kvcache(*args: str, cwd: Path, env: dict | None = None, prelude: str = "") -> subprocess.CompletedProcess:
    code = f"import sys; {prelude}from model_infer_kvcache import cli as kvcache_cli; sys.exit(kvcache_cli.main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


@pytest.mark.parametrize("argv", [
    ["analyze", "--config", EX, "--hbm-gb", "nan"],
    ["schema", "--out", str(READ_ONLY / "s.json")],
    ["run", "--out", str(NO_ENTRY / "out")],
])
def test_no_traceback_reaches_the_terminal(argv, tmp_path):
    proc = _kvcache(*argv, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []


# A missing transformers (the README's first command used to crash on it): simulated by
# blocking the import, not by uninstalling.
NO_TRANSFORMERS = "sys.modules['transformers'] = None; "


def test_validate_without_transformers_names_what_to_install(inputs, tmp_path):
    proc = _kvcache("validate", "--manifest", str(inputs["manifest.json"]), "--rendered", str(inputs["rendered"]),
                    "--config", EX, "--report", str(tmp_path / "r.json"), cwd=tmp_path, prelude=NO_TRANSFORMERS)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: transformers: not installed")
    assert "pip install 'transformers>=" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_run_without_transformers_writes_nothing(tmp_path):
    proc = _kvcache("run", cwd=tmp_path, prelude=NO_TRANSFORMERS)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "transformers" in proc.stderr and "pip install" in proc.stderr
    assert list(tmp_path.iterdir()) == []  # no kvcache-out, no staging folder


def test_minimum_transformers_matches_pyproject():
    from model_infer_kvcache.validators.pipeline.runtime_deps import MIN_TRANSFORMERS

    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    deps = text.split("dependencies = [", 1)[1].split("]", 1)[0]  # the runtime list, not the [test] extra
    assert f'"transformers>={MIN_TRANSFORMERS}"' in deps and '"numpy"' in deps


def test_too_old_transformers_is_named(monkeypatch):
    import transformers
    from model_infer_kvcache.validators.pipeline import runtime_deps as runtime_deps

    monkeypatch.setattr(transformers, "__version__", "4.40.0")
    why = runtime_deps.missing_dependency("transformers", runtime_deps.MIN_TRANSFORMERS)
    assert why == f"version 4.40.0 is older than the {runtime_deps.MIN_TRANSFORMERS} validation needs"
    monkeypatch.setattr(transformers, "__version__", "99.1.0.dev0")
    assert runtime_deps.missing_dependency("transformers", runtime_deps.MIN_TRANSFORMERS) is None
