"""Each shared fact has one home; the CLIs share one error format and list every subcommand.

The duplicate checks read the package sources (never the tests) and look for the fingerprints a
second copy of a fact leaves: the block/byte formulas outside analyzer/kv_cache_spec.py, the device
readings vocabulary outside analyzer/device_questions.py, a manifest loader outside
analyzer/manifest_io.py, a file writer outside analyzer/files.py, a generation tuple outside
analyzer/framework_checkout.py. Each checker is first shown the copies that used to exist, so a
checker that finds nothing cannot pass.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import model_infer_kvcache.validators.__main__ as validators_main
import pytest
from model_infer_kvcache.analyzer.device_questions import QUESTIONS
from model_infer_kvcache.analyzer.framework_checkout import GENERATIONS
from model_infer_kvcache.analyzer.manifest import SCHEMA_VERSION

from model_infer_kvcache import cli as kvcache_cli

ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("analyzer", "implementer", "validators")


def _sources() -> dict[str, ast.Module]:
    files = [p for d in SOURCE_DIRS for p in sorted((ROOT / d).rglob("*.py"))] + [ROOT / "model_infer_kvcache" / "cli.py"]
    trees = {p.relative_to(ROOT).as_posix(): ast.parse(p.read_text(encoding="utf-8")) for p in files}
    assert len(trees) > 50 and "analyzer/kv_cache_spec.py" in trees  # the walk really covered the packages
    return trees


SOURCES = _sources()


def _parse(snippet: str) -> ast.Module:
    return ast.parse(textwrap.dedent(snippet))


def copies_outside(home: str, finder) -> dict[str, list]:
    """What ``finder`` reports in every module but ``home``; the home must hold the fact (else the
    finder could be blind and the empty result would prove nothing)."""
    assert finder(SOURCES[home]), f"{finder.__name__} finds nothing in its home {home}"
    return {path: found for path, tree in SOURCES.items() if path != home and (found := finder(tree))}


def _name(node: ast.AST) -> str:
    """The identifier a node reads (``x``, ``self.x``, ``f(...)`` -> ``f``), '' for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call):
        return _name(node.func)
    if isinstance(node, ast.Subscript):
        return _name(node.value)
    return ""


def _names_in(node: ast.AST) -> set[str]:
    return {_name(n) for n in ast.walk(node)} - {""}


def _str_elements(node: ast.AST) -> list[str]:
    elts = getattr(node, "elts", None)
    if elts is None and isinstance(node, ast.Dict):
        elts = node.keys
    return [e.value for e in elts or [] if isinstance(e, ast.Constant) and isinstance(e.value, str)]


# --------------------------------------------------------------------------- block math


def block_math_copies(tree: ast.Module) -> list[str]:
    """Fingerprints of the block-count / byte formulas of analyzer.kv_cache_spec."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.BinOp):
            continue
        names = _names_in(node)
        line = getattr(node, "lineno", 0)
        if (isinstance(node.op, ast.Add) and isinstance(node.left, ast.BinOp) and isinstance(node.left.op, ast.Mult)
                and any("concurrency" in n for n in _names_in(node.left))):
            found.append(f"{line}: requests x blocks + null block")
        elif (isinstance(node.op, ast.Mult) and any("next_n" in n for n in names)
              and any(isinstance(s, ast.Constant) and s.value == 2 for s in (node.left, node.right))):
            found.append(f"{line}: 2 x next_n sliding reservation")
        elif isinstance(node.op, (ast.Div, ast.FloorDiv)) and any("per_token" in n for n in _names_in(node.right)):
            found.append(f"{line}: budget / per-token bytes")
        elif (isinstance(node.op, ast.Mult) and "num_head" in names
              and any("itemsize" in n or n == "DTYPE_BYTES" for n in names)):
            found.append(f"{line}: dims x heads x itemsize")
    return found


OLD_BLOCK_MATH = {  # the copies that lived in memory.py, rules.py and the harness's cache_utils.py
    "offline": "def f(self, max_len, concurrency):\n    return math.ceil(max_len / self.block_size) * concurrency + 1",
    "sliding": "def f(self):\n    return math.ceil((self.window + 2 * self.next_n) / self.block_size) + 1",
    "mamba": "count = max_concurrency * (1 + int(entry.next_n)) + 1",
    "budget": "max_tokens = int(budget // per_token)",
    "bytes": "x = sum(c.dim * c.num_head * DTYPE_BYTES[c.dtype] for c in caches)",
    "entry bytes": "numel = math.prod(entry_dims(entry)) * entry.num_head * dtype_itemsize(entry.dtype)",
}


@pytest.mark.parametrize("kind", list(OLD_BLOCK_MATH))
def test_block_math_checker_finds_the_old_copies(kind):
    assert block_math_copies(_parse(OLD_BLOCK_MATH[kind]))


def test_block_math_has_one_home():
    assert copies_outside("analyzer/kv_cache_spec.py", block_math_copies) == {}


def test_analyzer_and_harness_size_pools_with_the_same_specs():
    from model_infer_kvcache.analyzer import kv_cache_spec, memory
    from model_infer_kvcache.validators.harness import cache_utils

    for module in (memory, cache_utils):
        imported = {alias.name for node in ast.walk(SOURCES[f"{module.__name__.removeprefix('model_infer_kvcache.').replace('.', '/')}.py"])
                    if isinstance(node, ast.ImportFrom) and node.module == "model_infer_kvcache.analyzer.kv_cache_spec"
                    for alias in node.names}
        assert {"FullAttentionSpec", "SlidingWindowSpec", "fixed_bytes", "max_tokens_in"} <= imported, module
    assert cache_utils.FIXED_BLOCK_ATTN_TYPES is kv_cache_spec.FIXED_BLOCK_ATTN_TYPES


# --------------------------------------------------------------------------- device readings vocabulary


def readings_copies(tree: ast.Module) -> list[str]:
    """Containers typing two readings of one question, or two question names (a second vocabulary).

    A dict keyed by questions counts when its values are typed lists (readings per question), not
    when it maps each question to the code that measures it.
    """
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
            continue
        values = set(_str_elements(node))
        tables = isinstance(node, ast.Dict) and any(isinstance(v, (ast.Tuple, ast.List, ast.Set)) for v in node.values)
        if len(values & set(QUESTIONS)) >= 2 and (tables or not isinstance(node, ast.Dict)):
            found.append(f"{node.lineno}: question names {sorted(values & set(QUESTIONS))}")
        for q in QUESTIONS.values():
            if len(values & set(q.readings)) >= 2:
                found.append(f"{node.lineno}: readings of {q.name} {sorted(values & set(q.readings))}")
    return found


OLD_READINGS = {  # the copies in npu_ops/readings.py, manifest.py, cli.py, measured.py
    "literal": 'BandAtSingleQuery = Literal["honoured", "ignored"]',
    "allowed": '_ALLOWED = {"band_at_single_query": ("honoured", "ignored"), "window_pre_tokens": ("x",)}',
    "manifest": 'question: Literal["band_at_single_query", "window_pre_tokens", "null_block_contents"]',
    "choices": 'p.add_argument("--window-reading", choices=("exclusive", "inclusive"))',
    "survives": 'survives = {"last_wins", "first_wins"}',
}


@pytest.mark.parametrize("kind", list(OLD_READINGS))
def test_readings_checker_finds_the_old_copies(kind):
    assert readings_copies(_parse(OLD_READINGS[kind]))


def test_readings_vocabulary_has_one_home():
    assert copies_outside("analyzer/device_questions.py", readings_copies) == {}


def test_readings_vocabulary_is_torch_free():
    tree = SOURCES["analyzer/device_questions.py"]
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names} | {node.module.split(".")[0] for node in ast.walk(tree)
                                            if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "dataclasses"}, imported


# --------------------------------------------------------------------------- manifest loader

_READS = {"read_text", "read_bytes", "open", "load", "loads", "safe_load"}


def manifest_loaders(tree: ast.Module) -> list[str]:
    """A ``load_manifest`` definition, or a function that reads a file and validates a manifest from it."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if node.name == "load_manifest":
            found.append(f"{node.lineno}: def load_manifest")
            continue
        calls = [c for c in ast.walk(node) if isinstance(c, ast.Call)]
        validates = any(isinstance(c.func, ast.Attribute) and c.func.attr.startswith("model_validate")
                        and _name(c.func.value) == "SelectionManifest" for c in calls)
        if validates and any(_name(c.func) in _READS for c in calls):
            found.append(f"{node.lineno}: {node.name} reads and validates a manifest")
    return found


OLD_LOADER = """
def _read(path):
    text = Path(path).read_text(encoding="utf-8")
    return SelectionManifest.model_validate_json(text)
"""


def test_manifest_loader_checker_finds_a_copy():
    assert manifest_loaders(_parse(OLD_LOADER))
    assert manifest_loaders(_parse("def load_manifest(path):\n    pass"))


def test_one_manifest_loader():
    assert copies_outside("analyzer/manifest_io.py", manifest_loaders) == {}


# --------------------------------------------------------------------------- file writers

_WRITE_CALLS = {"write_text", "write_bytes", "replace", "rename", "mkstemp", "move", "fdopen"}
# Writers allowed outside analyzer/files.py, with why: `kvcache run` publishes a finished staging
# directory into --out (directories moved whole; every file in them was written by atomic_write_text).
DIRECTORY_PUBLISHERS = {"validators/end_to_end.py": {"replace"}}


def file_writers(tree: ast.Module) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _name(node.func)
        owner = _name(node.func.value) if isinstance(node.func, ast.Attribute) else ""
        if name in {"replace", "rename", "fdopen"} and owner != "os":
            continue  # str.replace & co.
        if name in {"mkstemp", "move"} and owner not in {"tempfile", "shutil"}:
            continue
        mode = node.args[1] if name == "open" and len(node.args) > 1 else None
        mode = mode or next((k.value for k in node.keywords if k.arg == "mode"), None) if name == "open" else None
        if name in _WRITE_CALLS or (isinstance(mode, ast.Constant) and set(str(mode.value)) & set("wax")):
            found.append(name)
    return found


OLD_WRITERS = {
    "write_text": 'path.write_text(new, encoding="utf-8")',
    "replace": "os.replace(tmp, p)",
    "open": 'with open(path, "w") as fh:\n    fh.write(text)',
}


@pytest.mark.parametrize("kind", list(OLD_WRITERS))
def test_writer_checker_finds_the_old_copies(kind):
    assert file_writers(_parse(OLD_WRITERS[kind]))
    assert not file_writers(_parse("x = s.replace('a', 'b')\nwith open(p) as fh:\n    fh.read()"))


def test_every_file_is_written_through_analyzer_files():
    assert {"mkstemp", "replace", "fdopen"} <= set(file_writers(SOURCES["analyzer/files.py"]))
    copies = {path: set(found) - DIRECTORY_PUBLISHERS.get(path, set()) for path, tree in SOURCES.items()
              if path != "analyzer/files.py" and (found := file_writers(tree))}
    assert {path: found for path, found in copies.items() if found} == {}
    progress_writer = SOURCES["analyzer/progress_writer.py"]
    assert not [n for n in ast.walk(progress_writer) if isinstance(n, ast.FunctionDef)
                and n.name in {"atomic_write_text", "check_writable", "check_out_dir", "same_file"}]


# --------------------------------------------------------------------------- generations and CLI choices


def generation_tuples(tree: ast.Module) -> list[int]:
    """Generation lists typed in place; ``gen in ("G2", "G3")`` (a property of some generations) is not one."""
    tested = {id(c) for node in ast.walk(tree) if isinstance(node, ast.Compare)
              for op, c in zip(node.ops, node.comparators, strict=True) if isinstance(op, (ast.In, ast.NotIn))}
    return [node.lineno for node in ast.walk(tree) if isinstance(node, (ast.Tuple, ast.List, ast.Set))
            and id(node) not in tested and len(set(_str_elements(node)) & set(GENERATIONS)) >= 2]


def literal_choices(tree: ast.Module) -> list[str]:
    """``add_argument(..., choices=("a", "b"))`` typed in place (output formats are the CLI's own)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _name(node.func) == "add_argument":
            flag = next((a.value for a in node.args if isinstance(a, ast.Constant)), "")
            choices = next((k.value for k in node.keywords if k.arg == "choices"), None)
            if isinstance(choices, (ast.Tuple, ast.List)) and _str_elements(choices) and flag != "--format":
                found.append(f"{node.lineno}: {flag}")
    return found


def test_generation_and_choice_checkers_find_the_old_copies():
    old = 'p.add_argument("--framework-api", choices=("G0", "G1", "G2"))'
    assert generation_tuples(_parse(old)) and literal_choices(_parse(old))
    assert generation_tuples(_parse('FrameworkApi = Literal["G0", "G1", "G2"]'))
    assert not generation_tuples(_parse('per_entry = gen in ("G2", "G3")'))
    assert literal_choices(_parse('p.add_argument("--backend", choices=("auto", "emulated", "npu"))'))


def test_generations_are_named_once_and_cli_choices_come_from_their_enums():
    homes = {"analyzer/framework_checkout.py"}
    assert generation_tuples(SOURCES["analyzer/framework_checkout.py"])
    assert {p: g for p, t in SOURCES.items() if p not in homes and (g := generation_tuples(t))} == {}
    assert {p: c for p, t in SOURCES.items() if (c := literal_choices(t))} == {}


# --------------------------------------------------------------------------- CLI: one error format, full --help


def _call(fn, argv, capsys) -> tuple[int, str, str]:
    try:
        code = fn(argv)
    except SystemExit as exc:  # argparse's usage errors and --help exit this way
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def _every_command():
    from model_infer_kvcache.analyzer.operators.extract_schemas import main as extract_main
    from model_infer_kvcache.validators.docgen.doc_tables import main as doc_tables_main

    out = [(f"kvcache {name}", lambda argv, name=name: kvcache_cli.main([name, *argv]))
           for name in kvcache_cli._commands()]
    out += [(f"python -m model_infer_kvcache.validators {name}", lambda argv, name=name: validators_main.main([name, *argv]))
            for name in validators_main._commands()]
    out += [("python -m model_infer_kvcache.validators.docgen.doc_tables", doc_tables_main),
            ("python -m model_infer_kvcache.analyzer.operators.extract_schemas", extract_main)]
    return out


@pytest.mark.parametrize("prog, main", _every_command(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_command_usage_error_is_one_line_exit_2(prog, main, capsys):
    code, out, err = _call(main, ["--no-such-flag"], capsys)
    assert code == 2 and out == "", (code, out)
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    code, out, err = _call(main, ["--help"], capsys)
    assert code == 0 and out.startswith("usage: ") and err == ""


@pytest.mark.parametrize("main, prog", [(kvcache_cli.main, "kvcache"), (validators_main.main, "python -m model_infer_kvcache.validators")])
def test_dispatchers_list_every_subcommand_and_refuse_unknown_ones(main, prog, capsys):
    commands = (kvcache_cli if prog == "kvcache" else validators_main)._commands()
    code, out, _ = _call(main, ["--help"], capsys)
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  ") and line.strip()]
    assert code == 0 and set(commands) <= set(listed), (commands, listed)
    for argv in ([], ["no-such-command"]):
        code, out, err = _call(main, argv, capsys)
        assert code == 2 and out == "" and err.count("\n") == 1
        assert err.startswith(f"error: {prog}: ") and ", ".join(commands) in err
    assert "lint" in validators_main._commands()


def test_lint_usage_errors_share_the_format(capsys):
    code, _, err = _call(kvcache_cli.main, ["lint"], capsys)
    assert (code, err) == (2, "error: kvcache lint: give at least one PATH (see --help)\n")
    code, _, err = _call(kvcache_cli.main, ["lint", "x.py", "--select", "KV999"], capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: kvcache lint: --select: unknown rule ID")


# --------------------------------------------------------------------------- lint --manifest YAML


def test_lint_reads_a_yaml_manifest_as_it_reads_json(tmp_path, capsys):
    """Code rendered for FA v2, linted against a v1 manifest: the YAML copy must find what the JSON one does."""
    import yaml
    from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
    from model_infer_kvcache.implementer.render import render_manifest, write_rendered

    config = str(ROOT / "tests" / "fixtures" / "configs" / "qwen3_8b.json")
    rendered_for = analyze(AnalyzeRequest(config=config, deploy_mode="framework", framework_api="G2",
                                          fa_version="v2"))
    other = analyze(AnalyzeRequest(config=config, deploy_mode="framework", framework_api="G2", fa_version="v1"))
    write_rendered(render_manifest(rendered_for), tmp_path / "out")
    code_file = str(tmp_path / "out" / "kvcache_attention.py")
    results = {}
    for name, manifest in (("same", rendered_for), ("other", other)):
        (tmp_path / f"{name}.json").write_text(manifest.to_json(), encoding="utf-8")
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(manifest.model_dump(mode="json")), encoding="utf-8")
        for suffix in ("json", "yaml"):
            code, out, err = _call(kvcache_cli.main, ["lint", code_file, "--manifest",
                                                      str(tmp_path / f"{name}.{suffix}")], capsys)
            results[name, suffix] = (code, out)
    assert results["same", "json"] == results["same", "yaml"] == (0, "")
    assert results["other", "yaml"] == results["other", "json"]
    code, out = results["other", "yaml"]
    assert code == 1 and "KV8" in out  # a manifest rule fired: the YAML manifest was read, not skipped


def test_lint_refuses_a_bad_yaml_manifest_in_one_line(tmp_path, capsys):
    bad = tmp_path / "m.yaml"
    bad.write_text(f"schema_version: '{SCHEMA_VERSION}'\n", encoding="utf-8")
    code, out, err = _call(kvcache_cli.main, ["lint", str(ROOT / "model_infer_kvcache" / "cli.py"), "--manifest", str(bad)], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"error: {bad}: ") and "not a valid selection manifest" in err
