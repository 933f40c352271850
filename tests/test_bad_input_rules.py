"""The rules every command follows for bad input (issue: outputs never clobber inputs, malformed values
never become defaults, interruptions leave no debris).

1. Path clashes: every (input flag, output flag) pair and every pair of outputs of every command,
   each spelled so the clash is only visible after resolving (`..`, a symbolic link).
2. Config values read at every depth: a wrong type, a value out of its domain or of an unknown
   form is exit 2 naming its JSON path; a property-based sweep over real configs checks it too.
3. Weak cases: each with its own test.

Cases run in-process through the `kvcache` entry from a scratch cwd whose bytes are snapshotted
before and after: an exit-2 case must leave every file as it was.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import pytest
from cli_support import invoke, snapshot
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.cli import build_parser as analyze_parser
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.implementer.cli import build_parser as render_parser
from model_infer_kvcache.validators.cli import build_parser as validate_parser
from model_infer_kvcache.validators.end_to_end import build_parser as run_parser
from model_infer_kvcache.validators.probe.cli import build_parser as probe_parser

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny_qwen3" / "config.json"
CONFIGS = ROOT / "tests" / "fixtures" / "configs"


def _assert_refused(argv, words, scratch: Path, capsys) -> str:
    before = snapshot(scratch)
    rc, out, err = invoke(argv, capsys)
    assert rc == 2, (argv, rc, err)
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)
    assert snapshot(scratch) == before, "a refused command changed a file"
    return err


@pytest.fixture(scope="module")
def manifest_text() -> str:
    return analyze(AnalyzeRequest(config=str(EXAMPLE))).to_json()


@pytest.fixture
def scratch(tmp_path, monkeypatch, manifest_text) -> Path:
    """One valid file (or folder) per input flag, in the cwd."""
    d = tmp_path / "cwd"
    d.mkdir()
    shutil.copy(EXAMPLE, d / "config.json")
    (d / "model").mkdir()
    shutil.copy(EXAMPLE, d / "model" / "config.json")
    (d / "progress.md").write_text("# progress\n部署模式: 框架部署\n", encoding="utf-8")
    (d / "dispatch.txt").write_text("部署模式: 框架部署\n", encoding="utf-8")
    (d / "readings.json").write_text('{"kind": "x"}\n', encoding="utf-8")
    (d / "checkout").mkdir()
    (d / "checkout" / "README.md").write_text("a checkout\n", encoding="utf-8")
    (d / "model_file.py").write_text("x = 1\n", encoding="utf-8")
    (d / "manifest.json").write_text(manifest_text, encoding="utf-8")
    (d / "rendered").mkdir()
    (d / "rendered" / "kvcache_attention.py").write_text("# rendered\n", encoding="utf-8")
    monkeypatch.chdir(d)
    return d


# ---------------------------------------------------------------- 1. path clashes

# Each command's path flags: inputs -> the scratch entry they read, outputs (file or directory).
INPUTS = {
    "analyze": {"--config": "config.json", "--model-dir": "model", "--progress": "progress.md",
                "--dispatch-file": "dispatch.txt", "--device-readings": "readings.json",
                "--framework-root": "checkout"},
    "render": {"--manifest": "manifest.json"},
    "validate": {"--manifest": "manifest.json", "--rendered": "rendered", "--model-file": "model_file.py",
                 "--config": "config.json", "--device-readings": "readings.json", "--framework-root": "checkout",
                 "--runner-file": "model_file.py", "--yaml": "progress.md", "--configs": "checkout"},
    "run": {"--config": "config.json", "--model-dir": "model", "--progress": "progress.md",
            "--dispatch-file": "dispatch.txt", "--device-readings": "readings.json", "--framework-root": "checkout",
            "--model-file": "model_file.py"},
    "probe": {},
}
OUTPUTS = {"analyze": ("--out", "--write-progress"), "render": ("--out",),
           "validate": ("--report", "--markdown", "--write-progress"), "run": ("--out",),
           "probe": ("--out", "--markdown")}
PARSERS = {"analyze": analyze_parser, "render": render_parser, "validate": validate_parser, "run": run_parser,
           "probe": probe_parser}
# The minimal argv each command needs besides the flags under test (required flags point at valid inputs).
BASE = {
    "analyze": {"--config": "config.json"},
    "render": {"--manifest": "manifest.json", "--out": "out"},
    "validate": {"--manifest": "manifest.json", "--rendered": "rendered", "--config": "config.json"},
    "run": {"--out": "out"},
    "probe": {"--backend": "emulated"},
}
ALLOWED = {("analyze", "--progress", "--write-progress")}  # updating the progress.md it reads is the point
EXCLUSIVE = {"--config": "--model-dir", "--model-dir": "--config"}


def _path_flags(parser) -> set[str]:
    """Every flag of a parser that takes a file or folder (by its metavar)."""
    return {a.option_strings[-1] for a in parser._actions
            if a.option_strings and a.metavar in ("FILE", "DIR", "M")}


def test_every_path_flag_of_every_command_is_in_the_matrix():
    for command, parser in PARSERS.items():
        assert _path_flags(parser()) == set(INPUTS[command]) | set(OUTPUTS[command]), command


def _argv(command: str, flags: dict[str, str]) -> list[str]:
    merged = dict(BASE[command])
    for flag in flags:
        merged.pop(EXCLUSIVE.get(flag, ""), None)
    merged.update(flags)
    return [command, *(x for kv in merged.items() for x in kv)]


def _spellings(name: str, scratch: Path) -> list[str]:
    """The same path as the input, written three ways: verbatim, through `..`, through a symlink."""
    (scratch / "sub").mkdir(exist_ok=True)
    link = scratch / f"link_to_{name.replace('/', '_')}"
    if not link.exists():
        link.symlink_to(scratch / name)
    return [name, f"sub/../{name}", link.name]


PAIRS = [(c, i, o) for c in INPUTS for i in INPUTS[c] for o in OUTPUTS[c]]
OUTPUT_PAIRS = [(c, a, b) for c in OUTPUTS for n, a in enumerate(OUTPUTS[c]) for b in OUTPUTS[c][n + 1:]]


@pytest.mark.parametrize("command,inp,out", PAIRS, ids=[f"{c} {i} vs {o}" for c, i, o in PAIRS])
def test_an_output_never_replaces_an_input(command, inp, out, scratch, capsys):
    name = INPUTS[command][inp]
    if (command, inp, out) in ALLOWED:
        return  # test_write_progress_may_update_the_progress_it_reads
    target = name
    if inp == "--model-dir":
        target = f"{name}/config.json"  # the file a model directory stands for
    for spelled in _spellings(target, scratch):
        argv = _argv(command, {inp: name, out: spelled})
        err = _assert_refused(argv, [out, inp], scratch, capsys)
        assert "would overwrite" in err


@pytest.mark.parametrize("command,first,second", OUTPUT_PAIRS, ids=[f"{c} {a} vs {b}" for c, a, b in OUTPUT_PAIRS])
def test_two_outputs_never_name_one_file(command, first, second, scratch, capsys):
    for spelled in _spellings("result.txt", scratch)[:2]:  # a new file: verbatim and through `..`
        argv = _argv(command, {first: "result.txt", second: spelled})
        _assert_refused(argv, [first, second, "same file"], scratch, capsys)


def test_write_progress_may_update_the_progress_it_reads(scratch, capsys):
    (scratch / "sub").mkdir()
    rc, _, err = invoke(["analyze", "--config", "config.json", "--progress", "progress.md",
                          "--write-progress", "sub/../progress.md"], capsys)
    assert rc == 0, err
    text = (scratch / "progress.md").read_text(encoding="utf-8")
    assert text.startswith("# progress\n部署模式: 框架部署\n") and "kvcache" in text


def test_render_may_write_beside_its_manifest(scratch, capsys):
    """A dir output clashes only through the files it writes: a manifest kept in --out is not one."""
    (scratch / "out").mkdir()
    shutil.copy(scratch / "manifest.json", scratch / "out" / "manifest.json")
    rc, _, err = invoke(["render", "--manifest", "out/manifest.json", "--out", "out"], capsys)
    assert rc == 0, err
    assert (scratch / "out" / "manifest.json").read_bytes() == (scratch / "manifest.json").read_bytes()


def test_run_refuses_an_input_inside_the_entries_it_replaces(scratch, capsys):
    (scratch / "out").mkdir()
    shutil.copy(EXAMPLE, scratch / "out" / "manifest.json")
    _assert_refused(["run", "--config", "out/manifest.json", "--out", "out"], ["--out", "--config"], scratch, capsys)


# ---------------------------------------------------------------- stdout and empty paths


def test_dash_means_stdout_where_offered(scratch, capsys):
    rc, out, err = invoke(["analyze", "--config", "config.json", "--out", "-"], capsys)
    assert rc == 0 and json.loads(out)["model"]["model_type"] == "qwen3", err
    assert not (scratch / "-").exists()
    rc, out, _ = invoke(["schema", "--out", "-"], capsys)
    assert rc == 0 and "properties" in json.loads(out) and not (scratch / "-").exists()


DASH_REFUSED = [
    (["render", "--manifest", "manifest.json", "--out", "-"], ["--out", "stdout"]),
    (["run", "--out", "-"], ["--out", "stdout"]),
    (["validate", "--manifest", "manifest.json", "--rendered", "rendered", "--config", "config.json",
      "--report", "-"], ["--report", "stdout"]),
    (["analyze", "--config", "config.json", "--write-progress", "-"], ["--write-progress", "stdout"]),
    (["probe", "--backend", "emulated", "--out", "-", "--markdown", "-"], ["--markdown", "--out", "stdout"]),
]
EMPTY = [
    (["analyze", "--config", "config.json", "--out", ""], ["--out", "empty path"]),
    (["analyze", "--config", ""], ["--config", "empty path"]),
    (["analyze", "--config", "config.json", "--progress", ""], ["--progress", "empty path"]),
    (["schema", "--out", ""], ["--out", "empty path"]),
    (["render", "--manifest", "manifest.json", "--out", ""], ["--out", "empty path"]),
    (["render", "--manifest", "", "--out", "r"], ["--manifest", "empty path"]),
    (["run", "--out", ""], ["--out", "empty path"]),
    (["validate", "--manifest", "manifest.json", "--rendered", "rendered", "--config", "config.json",
      "--markdown", ""], ["--markdown", "empty path"]),
    (["probe", "--backend", "emulated", "--out", ""], ["--out", "empty path"]),
]


@pytest.mark.parametrize("argv,words", DASH_REFUSED + EMPTY, ids=[" ".join(a) for a, _ in DASH_REFUSED + EMPTY])
def test_dash_and_empty_paths_name_the_flag(argv, words, scratch, capsys):
    _assert_refused(argv, words, scratch, capsys)


# ---------------------------------------------------------------- 2. values at every depth

DEEPSEEK = json.loads((CONFIGS / "deepseek_v3.json").read_text(encoding="utf-8"))


def _with(base: dict, path: tuple, value) -> dict:
    cfg = copy.deepcopy(base)
    node = cfg
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return cfg


ROPE = DEEPSEEK["rope_scaling"]
# (name, base config, JSON path, value, words the one line must hold)
VALUE_CASES = [
    ("rope_scaling wrapped in a list", DEEPSEEK, ("rope_scaling",), [ROPE], ["rope_scaling", "JSON object"]),
    ("rope factor as a string", DEEPSEEK, ("rope_scaling", "factor"), "40", ["rope_scaling.factor", "number"]),
    ("rope_scaling a bare string", DEEPSEEK, ("rope_scaling",), "yarn", ["rope_scaling", "JSON object"]),
    ("rope factor negative", DEEPSEEK, ("rope_scaling", "factor"), -40, ["rope_scaling.factor", "> 0"]),
    ("rope factor zero", DEEPSEEK, ("rope_scaling", "factor"), 0, ["rope_scaling.factor", "> 0"]),
    ("rope factor below one", DEEPSEEK, ("rope_scaling", "factor"), 0.5, ["rope_scaling.factor", ">= 1"]),
    ("rope factor missing", DEEPSEEK, ("rope_scaling", "factor"), None, ["rope_scaling.factor", "missing"]),
    ("rope factor infinite", DEEPSEEK, ("rope_scaling", "factor"), float("inf"), ["rope_scaling.factor"]),
    ("rope type unknown", DEEPSEEK, ("rope_scaling", "type"), "yarn2", ["rope_scaling.type", "unknown rope type"]),
    ("rope type a number", DEEPSEEK, ("rope_scaling", "type"), 3, ["rope_scaling.type", "unknown rope type"]),
    ("mscale_all_dim a string", DEEPSEEK, ("rope_scaling", "mscale_all_dim"), "1.0",
     ["rope_scaling.mscale_all_dim", "number"]),
    ("mscale negative", DEEPSEEK, ("rope_scaling", "mscale"), -1, ["rope_scaling.mscale", ">= 0"]),
    ("original positions a string", DEEPSEEK, ("rope_scaling", "original_max_position_embeddings"), "4096",
     ["rope_scaling.original_max_position_embeddings", "integer"]),
    ("beta_fast a list", DEEPSEEK, ("rope_scaling", "beta_fast"), [32], ["rope_scaling.beta_fast", "number"]),
    ("model_type a number", DEEPSEEK, ("model_type",), 42, ["model_type", "string"]),
    ("model_type empty", DEEPSEEK, ("model_type",), "", ["model_type", "string"]),
    ("2**64 heads", DEEPSEEK, ("num_attention_heads",), 2 ** 64, ["num_attention_heads", "at most"]),
    ("1e12 layers", DEEPSEEK, ("num_hidden_layers",), 10 ** 12, ["num_hidden_layers", "at most"]),
    ("1e9 MTP layers", DEEPSEEK, ("num_nextn_predict_layers",), 10 ** 9, ["num_nextn_predict_layers", "at most"]),
    ("huge kv_lora_rank", DEEPSEEK, ("kv_lora_rank",), 2 ** 40, ["kv_lora_rank", "at most"]),
    ("huge vocab", DEEPSEEK, ("vocab_size",), 2 ** 40, ["vocab_size", "at most"]),
    ("heads as a string", DEEPSEEK, ("num_attention_heads",), "128", ["num_attention_heads", "positive integer"]),
    ("dtype a number", DEEPSEEK, ("torch_dtype",), 16, ["torch_dtype", "dtype name"]),
    ("dtype a typo", DEEPSEEK, ("torch_dtype",), "bfloat61", ["torch_dtype", "unknown dtype"]),
    ("architectures of numbers", DEEPSEEK, ("architectures",), [1], ["architectures[0]", "class name"]),
    ("text_config a string", DEEPSEEK, ("text_config",), "llama", ["text_config", "JSON object"]),
]
QWEN3 = json.loads((CONFIGS / "qwen3_8b.json").read_text(encoding="utf-8"))
GEMMA3 = json.loads((CONFIGS / "gemma3_27b.json").read_text(encoding="utf-8"))
LLAMA31 = json.loads((CONFIGS / "llama31_8b.json").read_text(encoding="utf-8"))
LLAMA4 = json.loads((CONFIGS / "llama4_scout.json").read_text(encoding="utf-8"))
VALUE_CASES += [
    ("use_sliding_window as a string", QWEN3, ("use_sliding_window",), "true", ["use_sliding_window", "true or false"]),
    ("use_sliding_window as 1", QWEN3, ("use_sliding_window",), 1, ["use_sliding_window", "true or false"]),
    ("layer_types of numbers", QWEN3, ("layer_types",), [0] * QWEN3["num_hidden_layers"],
     ["layer_types[0]", "unknown layer type"]),
    ("full_attention_interval a string", QWEN3, ("full_attention_interval",), "4",
     ["full_attention_interval", "positive integer"]),
    ("sliding_window_pattern a string", GEMMA3, ("text_config", "sliding_window_pattern"), "6",
     ["sliding_window_pattern", "positive integer"]),
    ("sliding_window negative", GEMMA3, ("text_config", "sliding_window"), -1, ["sliding_window"]),
    ("llama3 low_freq_factor a string", LLAMA31, ("rope_scaling", "low_freq_factor"), "1",
     ["rope_scaling.low_freq_factor", "number"]),
    ("llama3 factor missing", LLAMA31, ("rope_scaling", "factor"), None, ["rope_scaling.factor", "missing"]),
    ("alibi as a string", QWEN3, ("alibi",), "yes", ["alibi", "true or false"]),
    ("multi_query as 1", QWEN3, ("multi_query",), 1, ["multi_query", "true or false"]),
    ("attn_config a list", QWEN3, ("attn_config",), ["alibi"], ["attn_config", "JSON object"]),
    ("partial_rotary_factor above one", LLAMA31, ("rope_scaling", "partial_rotary_factor"), 2,
     ["rope_scaling.partial_rotary_factor", "at most"]),
    ("mrope_section of strings", QWEN3, ("rope_scaling",), {"type": "mrope", "mrope_section": ["a"]},
     ["rope_scaling.mrope_section[0]", "integer"]),
    ("per-layer-type rope a string", QWEN3, ("rope_parameters",), {"full_attention": "yarn"},
     ["rope_parameters.full_attention", "JSON object"]),
    ("no_rope_layers of strings", LLAMA4, ("text_config", "no_rope_layers"), ["1"] * 48,
     ["text_config.no_rope_layers[0]", "0 or 1"]),
    ("no_rope_layers a number", LLAMA4, ("text_config", "no_rope_layers"), 4,
     ["text_config.no_rope_layers", "list"]),
]


@pytest.mark.parametrize("name,base,path,value,words", VALUE_CASES, ids=[c[0] for c in VALUE_CASES])
def test_a_malformed_value_is_refused_naming_its_json_path(name, base, path, value, words, scratch, capsys):
    cfg = _with(base, path, value)
    if value is None:
        del _with_node(cfg, path)[path[-1]]
    (scratch / "c.json").write_text(json.dumps(cfg), encoding="utf-8")
    _assert_refused(["analyze", "--config", "c.json", "--out", "m.json"], ["c.json", *words], scratch, capsys)


def _with_node(cfg: dict, path: tuple) -> dict:
    node = cfg
    for key in path[:-1]:
        node = node[key]
    return node


def test_deepseek_v3_mangled_rope_is_refused_never_scaled_by_0_0722(tmp_path):
    """The issue's case: the well-formed config gives 0.1352 (YaRN mscale); every mangled form is refused."""
    good = tmp_path / "good.json"
    good.write_text(json.dumps(DEEPSEEK), encoding="utf-8")
    assert analyze(AnalyzeRequest(config=str(good))).fa.softmax_scale == pytest.approx(0.1352, abs=5e-5)
    for mangled in ([ROPE], {**ROPE, "factor": "40"}, "yarn", {**ROPE, "factor": -40}):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(_with(DEEPSEEK, ("rope_scaling",), mangled)), encoding="utf-8")
        with pytest.raises(InputError) as info:
            analyze(AnalyzeRequest(config=str(bad)))
        assert "rope_scaling" in info.value.render()


# ---------------------------------------------------------------- dispatch lines in any wording


@pytest.mark.parametrize("line,mode", [
    ("Deployment mode: standalone", "standalone"),
    ("deploy_mode: framework", "framework"),
    ("**Deployment Mode**：standalone deployment", "standalone"),
    ("部署方式: 独立部署", "standalone"),
])
def test_a_dispatch_line_in_another_wording_is_read(line, mode, scratch, capsys):
    rc, out, err = invoke(["analyze", "--config", "config.json", "--dispatch", f"Please migrate.\n{line}\n"], capsys)
    assert rc == 0, err
    decision = json.loads(out)["deploy_mode"]
    assert (decision["value"], decision["source"]) == (mode, "dispatch")


@pytest.mark.parametrize("line", ["Deployment mode: hybrid", "deploy mode: both", "部署方式: 混合"])
def test_a_dispatch_line_that_cannot_be_mapped_is_refused(line, scratch, capsys):
    _assert_refused(["analyze", "--config", "config.json", "--dispatch", line], ["--dispatch", "unknown deployment"],
                    scratch, capsys)


def test_contradicting_progress_lines_reach_stderr(scratch, capsys):
    (scratch / "p.md").write_text("部署模式: 框架部署\n\n部署模式: 独立部署\n", encoding="utf-8")
    rc, _, err = invoke(["analyze", "--config", "config.json", "--progress", "p.md"], capsys)
    assert rc == 0
    line = next(x for x in err.splitlines() if x.startswith("open question:"))
    assert "p.md:1" in line and "p.md:3" in line and "部署模式" in line


# ---------------------------------------------------------------- 3. weak cases, each with a test


def test_unicode_class_names_are_identifiers(scratch, capsys):
    rc, _, err = invoke(["render", "--manifest", "manifest.json", "--out", "r", "--attention-class", "注意力Mixin"],
                         capsys)
    assert rc == 0, err
    assert "class 注意力Mixin" in (scratch / "r" / "kvcache_attention.py").read_text(encoding="utf-8")
    # a name Python would read as another (NFKC: the ligature 'ﬁ' is 'fi') is still refused
    _assert_refused(["render", "--manifest", "manifest.json", "--out", "r2", "--attention-class", "\ufb01leMixin"],
                    ["--attention-class", "NFKC"], scratch, capsys)


def test_input_file_problems_are_named_not_file_not_found(scratch, capsys):
    (scratch / "loop_a").symlink_to("loop_b")
    (scratch / "loop_b").symlink_to("loop_a")
    (scratch / "dangling.json").symlink_to("nowhere.json")
    os.mkfifo(scratch / "fifo.json")
    cases = [
        (["analyze", "--config", "loop_a"], ["loop_a", "symbolic link loop"]),
        (["analyze", "--config", "dangling.json"], ["dangling.json", "broken symbolic link"]),
        (["analyze", "--config", "fifo.json"], ["fifo.json", "not a regular file"]),
        (["analyze", "--config", "config.json", "--progress", "checkout"], ["checkout", "is a directory"]),
        (["analyze", "--config", "config.json", "--dispatch-file", "loop_a"], ["loop_a", "symbolic link loop"]),
        (["analyze", "--config", "config.json", "--device-readings", "checkout"], ["checkout", "is a directory"]),
        (["render", "--manifest", "fifo.json", "--out", "r"], ["fifo.json", "not a regular file"]),
        (["lint", "model_file.py", "--manifest", "dangling.json"], ["dangling.json", "broken symbolic link"]),
        # a loop on either side of the path rule (resolving it raised RuntimeError: exit 3 before)
        (["analyze", "--config", "config.json", "--out", "loop_a"], ["loop_a", "--out", "symbolic link loop"]),
        (["analyze", "--config", "loop_a", "--out", "m.json"], ["loop_a", "--config", "symbolic link loop"]),
        (["render", "--manifest", "manifest.json", "--out", "loop_a"], ["loop_a", "--out", "symbolic link loop"]),
        (["run", "--out", "loop_a"], ["loop_a", "--out", "symbolic link loop"]),
        (["validate", "--manifest", "manifest.json", "--rendered", "rendered", "--config", "config.json",
          "--framework-root", "loop_a", "--report", "r.json"], ["loop_a", "--framework-root", "symbolic link loop"]),
        (["probe", "--backend", "emulated", "--markdown", "loop_b"], ["loop_b", "--markdown", "symbolic link loop"]),
    ]
    for argv, words in cases:
        _assert_refused(argv, words, scratch, capsys)


def test_lint_reads_only_regular_source_files(scratch, capsys):
    os.mkfifo(scratch / "pipe.py")
    (scratch / "empty").mkdir()
    (scratch / "deep.py").write_text("x = " + "+".join(["1"] * 30000) + "\n", encoding="utf-8")
    cases = [
        (["lint", "pipe.py"], ["pipe.py", "FIFO"]),
        (["lint", "/dev/zero"], ["/dev/zero", "device"]),
        (["lint", "empty"], ["empty", "no Python files"]),
        (["lint", "deep.py"], ["deep.py", "nested too deeply"]),
    ]
    for argv, words in cases:
        _assert_refused(argv, words, scratch, capsys)


def test_lint_reads_a_latin1_file_by_its_coding_line(scratch, capsys):
    (scratch / "old.py").write_bytes(b"# -*- coding: latin-1 -*-\nNAME = '\xe9t\xe9'\n")
    rc, _, err = invoke(["lint", "old.py"], capsys)
    assert rc == 0 and "1 file(s) clean" in err, err
    (scratch / "bad.py").write_bytes(b"NAME = '\xe9t\xe9'\n")  # no coding line: not UTF-8, refused
    _assert_refused(["lint", "bad.py"], ["bad.py", "cannot read"], scratch, capsys)


def test_a_manifest_with_a_bom_is_read_and_yaml_errors_have_a_position(scratch, capsys):
    (scratch / "bom.json").write_bytes(b"\xef\xbb\xbf" + (scratch / "manifest.json").read_bytes())
    rc, _, err = invoke(["render", "--manifest", "bom.json", "--out", "r"], capsys)
    assert rc == 0, err
    (scratch / "bad.yaml").write_text("schema_version: '1.0'\nfa: [\n  x: 1\n", encoding="utf-8")
    _assert_refused(["render", "--manifest", "bad.yaml", "--out", "r2"], ["bad.yaml", "invalid YAML at line 4 column 1"],
                    scratch, capsys)


@pytest.mark.parametrize("field,value,words", [
    ("pre_tokens", -5, ["layers[0].pre_tokens", "-5"]),
    ("pre_tokens", 4096, ["layers[0].pre_tokens", "without a window"]),
    ("next_tokens", 3, ["layers[0].next_tokens", "must be 0"]),
])
def test_a_hand_edited_band_argument_the_render_would_ignore_is_refused(field, value, words, scratch, capsys):
    m = json.loads((scratch / "manifest.json").read_text(encoding="utf-8"))
    m["layers"][0][field] = value
    (scratch / "edited.json").write_text(json.dumps(m), encoding="utf-8")
    _assert_refused(["render", "--manifest", "edited.json", "--out", "r"], ["edited.json", *words], scratch, capsys)


def test_a_standalone_render_without_its_runner_is_bad_input(scratch, capsys):
    rc, _, err = invoke(["analyze", "--config", "config.json", "--dispatch", "部署模式: 独立部署", "--out", "sa.json"],
                         capsys)
    assert rc == 0, err
    assert invoke(["render", "--manifest", "sa.json", "--out", "sa"], capsys)[0] == 0
    (scratch / "sa" / "kvcache_runner.py").unlink()
    _assert_refused(["validate", "--manifest", "sa.json", "--rendered", "sa", "--config", "config.json"],
                    ["sa", "--rendered", "kvcache_runner.py"], scratch, capsys)


# ---------------------------------------------------------------- signals, locks, the environment


def _start_run(cwd: Path, *args: str):
    import signal
    import subprocess
    import sys

    def default_signals():
        # A run started from a terminal gets Ctrl-C; a test runner launched as a background job inherits SIGINT
        # ignored (POSIX shells ignore it for asynchronous commands), and so would the run, which then never sees it.
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    return subprocess.Popen([sys.executable, "-m", "model_infer_kvcache", "run", *args], cwd=cwd,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=default_signals)


def _wait_for_staging(cwd: Path, proc, timeout: float = 120) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.name.startswith(".out.kvcache-run.") for p in cwd.iterdir()):
            return
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    raise AssertionError("the run never started writing")


@pytest.mark.parametrize("sig,code,word", [("SIGTERM", 143, "terminated"), ("SIGINT", 130, "interrupted")])
def test_a_signal_during_run_leaves_out_as_it_was(sig, code, word, tmp_path):
    import signal

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "report.md").write_text("an earlier run's report\n", encoding="utf-8")
    before = snapshot(tmp_path)
    proc = _start_run(tmp_path, "--out", "out")
    _wait_for_staging(tmp_path, proc)
    proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(word) and "Traceback" not in err, err
    assert snapshot(tmp_path) == before  # --out exactly as before, nothing beside it


def _signal_on_creation(monkeypatch, name: str, marker: str, sig: str) -> list[str]:
    """``tempfile.<name>`` sending this process ``sig`` the moment it has created a path whose name holds ``marker``:
    the signal lands in the window between the creation and the caller's line that names the path for cleanup (the
    one a signal sent from outside hits under load only by chance). Returns the paths so created."""
    import signal
    import tempfile

    made: list[str] = []
    real = getattr(tempfile, name)

    def creating(*args, **kwargs):
        result = real(*args, **kwargs)
        path = result[1] if isinstance(result, tuple) else result
        if marker in os.path.basename(path):
            made.append(path)
            os.kill(os.getpid(), getattr(signal, sig))
        return result

    monkeypatch.setattr(tempfile, name, creating)
    return made


def _signal_cases():
    import signal
    import threading

    # In-process, SIGINT raises only where the command installs its handler (the default one is current: not under a
    # runner that ignores it); SIGTERM always.
    sigint = threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGINT) is signal.default_int_handler
    return [("SIGTERM", 143)] + ([("SIGINT", 130)] if sigint else [])


@pytest.mark.parametrize("sig,code", _signal_cases())
def test_a_signal_right_after_the_staging_folder_is_made_leaves_out_as_it_was(sig, code, scratch, capsys,
                                                                              monkeypatch):
    (scratch / "out").mkdir()
    (scratch / "out" / "report.md").write_text("an earlier run's report\n", encoding="utf-8")
    before = snapshot(scratch)
    made = _signal_on_creation(monkeypatch, "mkdtemp", ".out.kvcache-run.", sig)
    rc, _, err = invoke(["run", "--out", "out"], capsys)
    assert made and rc == code, err  # the signal came with the staging folder made, and stopped the run
    assert snapshot(scratch) == before  # the staging folder removed: --out exactly as before, nothing beside it


@pytest.mark.parametrize("sig,code", _signal_cases())
def test_a_signal_right_after_the_temp_file_is_made_leaves_nothing(sig, code, scratch, capsys, monkeypatch):
    before = snapshot(scratch)
    made = _signal_on_creation(monkeypatch, "mkstemp", ".m.json.", sig)
    rc, _, err = invoke(["analyze", "--config", "config.json", "--out", "m.json"], capsys)
    assert made and rc == code, err
    assert snapshot(scratch) == before  # no m.json, no .m.json.*.tmp beside it


@pytest.mark.parametrize("sig,code", _signal_cases())
def test_a_signal_right_after_a_render_folder_is_made_leaves_nothing(sig, code, scratch, capsys, monkeypatch):
    """`kvcache render --out` into a folder it creates: a signal right after the mkdir (before the render lists the
    folder for its cleanup) leaves no folder behind."""
    import pathlib
    import signal

    before = snapshot(scratch)
    real, made = pathlib.Path.mkdir, []

    def mkdir(self, *args, **kwargs):
        real(self, *args, **kwargs)
        if self.name == "fresh":
            made.append(self)
            os.kill(os.getpid(), getattr(signal, sig))

    monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)
    rc, _, err = invoke(["render", "--manifest", "manifest.json", "--out", "fresh"], capsys)
    assert made and rc == code, err
    assert snapshot(scratch) == before


def test_a_second_run_into_the_same_out_is_refused(scratch, capsys):
    from model_infer_kvcache.analyzer.files import exclusive_output

    with exclusive_output(scratch / "sub" / ".." / "out", "--out"):  # another run holds it
        err = _assert_refused(["run", "--out", "out"], ["out", "--out", "another kvcache command", str(os.getpid())],
                              scratch, capsys)
        assert "wait for it" in err
        # Another folder is not held: the run gets past the lock to its own bad input (an analysis error,
        # raised inside the locked section) instead of the lock's refusal.
        rc, _, err = invoke(["run", "--out", "out2", "--attn-tp-size", "3"], capsys)
    assert rc == 2 and "--attn-tp-size" in err and "another kvcache" not in err


@pytest.mark.parametrize("errno_name", ["ENOSPC", "EACCES", "EROFS"])
def test_an_os_error_while_writing_is_exit_2_naming_the_path(errno_name, scratch, capsys, monkeypatch):
    import errno

    def full(*args, **kwargs):
        raise OSError(getattr(errno, errno_name), os.strerror(getattr(errno, errno_name)), "manifest.json.tmp")

    monkeypatch.setattr(os, "fsync", full)
    rc, _, err = invoke(["analyze", "--config", "config.json", "--out", "m.json"], capsys)
    assert rc == 2 and err.count("\n") == 1 and "m.json" in err and os.strerror(getattr(errno, errno_name)) in err
    assert not (scratch / "m.json").exists() and not list(scratch.glob(".m.json.*"))


def test_an_os_error_outside_our_writers_is_exit_2_not_a_bug(capsys, monkeypatch):
    from model_infer_kvcache.analyzer.errors import guarded

    def fails():
        raise OSError(28, "No space left on device")

    assert guarded(fails) == 2
    assert capsys.readouterr().err == "error: operating system: No space left on device\n"


# ---------------------------------------------------------------- property: mutations at every depth

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

REAL_CONFIGS = ("deepseek_v3.json", "qwen3_8b.json", "gemma3_27b.json", "gpt_oss_20b.json", "llama31_8b.json",
                "qwen3_next.json")


def _key_paths(node, prefix=()):
    """Every key path of a config at every depth (objects only; lists are values)."""
    for key, value in node.items():
        yield (*prefix, key)
        if isinstance(value, dict):
            yield from _key_paths(value, (*prefix, key))


def _wrong_forms(value):
    """What a careless edit or a broken export makes of a value: the number as a string, wrapped in a
    list or an object, negated, zero, enormous, a boolean."""
    forms = [[value], {"value": value}, True]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        forms += [str(value), -abs(value) - 1, 0, 2 ** 70]
    elif isinstance(value, str):
        forms += [42, value + "_typo"]
    return forms


def _baseline(name: str, tmp: Path):
    path = tmp / name
    path.write_text((CONFIGS / name).read_text(encoding="utf-8"), encoding="utf-8")
    return analyze(AnalyzeRequest(config=str(path))).model_dump(mode="json")


@pytest.fixture(scope="module")
def baselines(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("baselines")
    return {name: _baseline(name, tmp) for name in REAL_CONFIGS}


_PROSE_KEY = __import__("re").compile(r"source|evidence|reason|derivation|message|consequence|detail|note")


def _design(node):
    """The decisions of a manifest without its prose (sources, reasons, messages): a value is prose when it
    holds a space. The inputs section names the config's path, which differs; warnings and open questions
    explain, they decide nothing."""
    if isinstance(node, dict):
        return {k: _design(v) for k, v in node.items() if k not in ("inputs", "warnings", "open_questions") and not _PROSE_KEY.search(k)}
    if isinstance(node, list):
        return [_design(v) for v in node]
    return None if isinstance(node, str) and " " in node else node


def _comparable(manifest: dict) -> dict:
    return _design(manifest)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_mutation_at_any_depth_is_refused_by_path_or_changes_nothing_unexplained(data, baselines, tmp_path_factory):
    name = data.draw(st.sampled_from(REAL_CONFIGS), label="config")
    base = json.loads((CONFIGS / name).read_text(encoding="utf-8"))
    path = data.draw(st.sampled_from(sorted(_key_paths(base), key=str)), label="path")
    value = _with_node(base, path)[path[-1]]
    new = data.draw(st.sampled_from(_wrong_forms(value)), label="value")
    cfg = _with(base, path, new)
    target = tmp_path_factory.mktemp("mutated") / name
    target.write_text(json.dumps(cfg), encoding="utf-8")
    try:
        manifest = analyze(AnalyzeRequest(config=str(target))).model_dump(mode="json")
    except InputError as exc:
        assert path[-1] in exc.render() or ".".join(path[:-1]) in exc.render(), (path, new, exc.render())
        return
    if _comparable(manifest) == _comparable(baselines[name]):
        return  # a field the design does not read
    # The design changed: the manifest must say which field made it change.
    assert path[-1] in json.dumps(manifest, ensure_ascii=False), (path, new)
