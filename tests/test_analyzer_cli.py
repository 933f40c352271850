"""`kvcache analyze` / `kvcache schema` end to end: outputs, --write-progress, bad input, schema, help."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from model_infer_kvcache.analyzer import cli
from model_infer_kvcache.analyzer.manifest import SelectionManifest, manifest_json_schema
from model_infer_kvcache.analyzer.progress_writer import markers

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures"
CONFIGS = FIX / "configs"
QWEN3 = str(CONFIGS / "qwen3_8b.json")
EXAMPLE = ROOT / "examples" / "tiny_qwen3" / "config.json"
SCHEMA = ROOT / "references" / "manifest.schema.json"
BEGIN, END = markers("analyze")


def invoke(argv: list[str], capsys) -> tuple[int, str, str]:
    """Run the CLI in-process; argparse usage errors arrive as SystemExit."""
    try:
        rc = cli.main([str(a) for a in argv])
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def kvcache(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "model_infer_kvcache", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=60)


# ---------------------------------------------------------------- outputs


def test_json_to_stdout_and_out_file_agree(tmp_path, capsys):
    rc, out, err = invoke(["--config", QWEN3, "--dispatch", "部署模式：框架部署"], capsys)
    assert rc == 0 and err == ""
    m = SelectionManifest.model_validate_json(out)
    assert (m.deploy_mode.value, m.deploy_mode.source) == ("framework", "dispatch")
    target = tmp_path / "manifest.json"
    rc, out2, _ = invoke(["--config", QWEN3, "--dispatch", "部署模式：框架部署", "--out", target], capsys)
    assert rc == 0 and out2 == ""
    assert target.read_text(encoding="utf-8") == out


def test_yaml_and_md_formats(capsys):
    rc, out, _ = invoke(["--config", str(CONFIGS / "gpt_oss_20b.json"), "--format", "yaml"], capsys)
    assert rc == 0
    as_yaml = yaml.safe_load(out)
    assert as_yaml["fa"]["version"] == "v2" and as_yaml["mixed_attn_types"] is True
    rc, md, _ = invoke(["--config", str(CONFIGS / "gpt_oss_20b.json"), "--format", "md"], capsys)
    assert rc == 0
    assert "| 决策项 | 选择 | 理由 |" in md
    assert "| attn_type (层 0,2,4,6,8,10,12,14,16,18,20,22) | SlidingWindow, sliding_window=128 |" in md
    assert "| FA 版本 | v2 | learnable sinks require FA v2 (learnable_sink) |" in md


def test_model_dir_and_yaml_config(tmp_path, capsys):
    model_dir = tmp_path / "Qwen3-8B"
    model_dir.mkdir()
    shutil.copy(QWEN3, model_dir / "config.json")
    rc, out, _ = invoke(["--model-dir", model_dir], capsys)
    assert rc == 0 and json.loads(out)["model"]["num_layers"] == 36
    as_yaml = tmp_path / "config.yaml"
    as_yaml.write_text(yaml.safe_dump(json.loads(Path(QWEN3).read_text())), encoding="utf-8")
    rc, out_yaml, _ = invoke(["--config", as_yaml], capsys)
    assert rc == 0 and json.loads(out_yaml)["layers"] == json.loads(out)["layers"]


def test_memory_plan_from_flags_and_from_progress(capsys):
    rc, out, _ = invoke(["--config", QWEN3, "--hbm-gb", "10", "--max-len", "8192"], capsys)
    mem = json.loads(out)["memory"]
    # 10 GiB x 0.9 / 147456 B per token = 65536 tokens = 512 blocks; (512 - 1) // 64 = 7 requests of 8192
    assert (mem["max_tokens"], mem["blocks"], mem["max_concurrency_at_max_len"]) == (65536, {"FullAttention": 512}, 7)
    assert mem["kv_mem_ratio"] == 0.9
    assert mem["max_concurrency"] == 7  # no --max-concurrency: the most requests of max_len that fit
    assert mem["per_layer_token_bytes"] == [2 * 128 * 8 * 2] * 36
    rc, out, _ = invoke(["--config", QWEN3, "--max-len", "8192", "--max-concurrency", "4"], capsys)
    mem = json.loads(out)["memory"]
    assert mem["blocks"] == {"FullAttention": 257} and mem["max_tokens"] is None
    assert mem["legacy_reservation_bytes"] == 147456 * 8192 * 4
    rc, out, _ = invoke(["--config", QWEN3, "--progress", FIX / "progress" / "qwen3_framework.md"], capsys)
    m = json.loads(out)
    # progress.md: attn_tp_size 4 (line 14), 单卡 HBM 64GB, 8 cards, Atlas 800I A2, Legacy cache_unit start
    assert m["parallel"]["attn_tp_size"] == 4 and m["parallel"]["attn_tp_source"].endswith("qwen3_framework.md:14")
    # budget 64 GiB x 0.9 = 61847529062.4 B over 147456 / 4 = 36864 B per token (TP 4):
    # max_tokens = floor(1677721.6) = 1677721, blocks = 1677721 // 128 = 13107;
    # no --max-len: max_position_embeddings 40960 -> (13107 - 1) // 320 = 40 requests
    mem = m["memory"]
    assert mem["hbm_gb"] == 64.0 and mem["per_token_bytes"] == 36864
    assert (mem["max_tokens"], mem["blocks"]) == (1677721, {"FullAttention": 13107})
    assert (mem["max_len"], mem["max_concurrency"], mem["max_concurrency_at_max_len"]) == (40960, 40, 40)
    assert m["inputs"]["npu_model"] == "Atlas 800I A2" and m["inputs"]["num_cards"] == 8
    assert m["inputs"]["starting_point"] == ["legacy_cache_unit"]
    assert any("HBM 64 GB taken from" in w["message"] and "upper bound" in w["message"] for w in m["warnings"])


def test_a_budget_with_no_usable_block_is_a_warning_in_the_manifest_and_on_stderr(capsys):
    rc, out, err = invoke(["--config", QWEN3, "--hbm-gb", "0.001"], capsys)
    assert rc == 0
    m = SelectionManifest.model_validate_json(out)
    assert max(m.memory.blocks.values()) <= 1  # block 0 is the null block: nothing can be served
    starved = [w.message for w in m.warnings if "no usable block" in w.message]
    assert len(starved) == 1 and "FullAttention" in starved[0]
    assert f"warning: {starved[0]}\n" in err
    rc, out, err = invoke(["--config", QWEN3, "--hbm-gb", "40"], capsys)
    assert rc == 0 and "no usable block" not in out + err


def test_fewer_fitting_requests_than_max_concurrency_is_a_warning(capsys):
    args = ["--config", QWEN3, "--hbm-gb", "20", "--max-len", "8192"]
    rc, out, err = invoke([*args, "--max-concurrency", "32"], capsys)
    fit = SelectionManifest.model_validate_json(out).memory.max_concurrency_at_max_len
    assert rc == 0 and 0 < fit < 32
    expected = f"only {fit} requests of 8192 tokens fit in the KV budget, fewer than --max-concurrency 32"
    assert expected in out and f"warning: {expected}\n" in err
    # At the edge: exactly what fits is no warning, one more is.
    rc, out, err = invoke([*args, "--max-concurrency", str(fit)], capsys)
    assert rc == 0 and "fit in the KV budget" not in out + err
    rc, out, err = invoke([*args, "--max-concurrency", str(fit + 1)], capsys)
    assert rc == 0 and f"only {fit} requests" in err


def test_tp_from_progress_and_cards_without_tp(tmp_path, capsys):
    p = tmp_path / "progress.md"
    p.write_text("## 模型信息\n\n### 运行环境\n\n- 部署卡数: 8\n- attn_tp_size: 3\n", encoding="utf-8")
    rc, out, err = invoke(["--config", QWEN3, "--progress", p], capsys)
    # a stated TP that cannot split 32 heads is refused like `--attn-tp-size 3`, naming file:line
    assert rc == 2 and out == ""
    assert err.startswith(f"error: {p}:6: attn_tp_size: 32 query heads are not divisible by attn_tp_size 3")
    assert err.count("\n") == 1
    p.write_text("### 运行环境\n\n- 部署卡数: 8\n", encoding="utf-8")
    rc, out, _ = invoke(["--config", QWEN3, "--progress", p], capsys)
    m = json.loads(out)
    assert m["parallel"]["attn_tp_size"] == 1 and m["parallel"]["attn_tp_source"].startswith("default")
    assert any("8 cards but no attention TP size" in w["message"] for w in m["warnings"])


# ---------------------------------------------------------------- --write-progress


def test_write_progress_is_idempotent_and_touches_no_other_byte(tmp_path, capsys):
    progress = tmp_path / "progress.md"
    original = (FIX / "progress" / "qwen3_framework.md").read_bytes()
    progress.write_bytes(original)
    os.chmod(progress, 0o640)
    args = ["--config", QWEN3, "--progress", progress, "--dispatch", "部署模式：框架部署", "--write-progress", progress]
    rc, out, err = invoke(args, capsys)
    assert rc == 0 and all(line.startswith("warning: ") for line in err.splitlines())
    first = progress.read_bytes()
    assert first.startswith(original)  # appended; nothing before moved
    added = first[len(original):].decode("utf-8")
    assert added.startswith("\n" + BEGIN) and added.endswith(END + "\n")
    assert "### KVCache 选型决策" in added and "| 部署模式 | framework | source dispatch" in added
    assert "| 每卡 heads | Q 8 / KV 2 |" in added  # attn_tp_size 4 from progress.md
    rc, _, _ = invoke(args, capsys)
    assert rc == 0 and progress.read_bytes() == first  # second run: identical file
    assert os.stat(progress).st_mode & 0o777 == 0o640

    # Someone edits the file around our section; a new run replaces only the section.
    head = "<!-- 上方人工备注 -->\n"
    tail = "\n## 自验证结果\n\n- 三链路: 待测\n"
    progress.write_bytes(head.encode() + first + tail.encode())
    rc, _, _ = invoke([*args, "--attn-tp-size", "8"], capsys)
    third = progress.read_text(encoding="utf-8")
    assert rc == 0 and third.count(BEGIN) == 1 and third.count(END) == 1
    assert third.startswith(head + original.decode("utf-8")) and third.endswith(END + "\n" + tail)
    assert "| 每卡 heads | Q 4 / KV 1 |" in third and "| 每卡 heads | Q 8 / KV 2 |" not in third
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_write_progress_creates_a_missing_file_and_keeps_crlf(tmp_path, capsys):
    fresh = tmp_path / "new_progress.md"
    rc, _, _ = invoke(["--config", QWEN3, "--write-progress", fresh], capsys)
    assert rc == 0 and fresh.read_text(encoding="utf-8").startswith(BEGIN)
    crlf = tmp_path / "crlf.md"
    crlf.write_bytes("## 模型信息\r\n- 部署卡数: 8\r\n".encode())
    rc, _, _ = invoke(["--config", QWEN3, "--write-progress", crlf], capsys)
    data = crlf.read_bytes()
    assert rc == 0 and data.startswith("## 模型信息\r\n- 部署卡数: 8\r\n".encode())
    assert data.count(b"\n") == data.count(b"\r\n")  # every line ending stays CRLF


def test_write_progress_is_atomic_when_the_rename_fails(tmp_path, capsys, monkeypatch):
    progress = tmp_path / "progress.md"
    progress.write_bytes((FIX / "progress" / "qwen3_framework.md").read_bytes())
    before = progress.read_bytes()

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr("model_infer_kvcache.analyzer.files.os.replace", failing_replace)
    rc, _, err = invoke(["--config", QWEN3, "--write-progress", progress], capsys)
    assert rc == 2 and "cannot write: disk full" in err and err.count("\n") == 1
    assert progress.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["progress.md"]  # temp file cleaned up


# ---------------------------------------------------------------- bad input: exit 2, one line, nothing written


def _bad(tmp_path: Path, name: str, content: str | bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return p


def _cfg(**over) -> str:
    base = json.loads(Path(QWEN3).read_text())
    base.update(over)
    return json.dumps({k: v for k, v in base.items() if v is not None})


BAD_CASES = {
    # id: (argv builder, substrings that must appear in the one stderr line)
    "missing config": (lambda t: ["--config", t / "nope.json"], ["nope.json", "file not found"]),
    "model dir without config": (lambda t: ["--model-dir", t], ["config.json", "file not found"]),
    "invalid json": (lambda t: ["--config", _bad(t, "c.json", '{"num_hidden_layers": 2,')],
                     ["c.json", "invalid JSON at line 1"]),
    "not utf-8": (lambda t: ["--config", _bad(t, "c.json", b'{"a": "\xe9"}')], ["c.json", "not UTF-8 text"]),
    "json not an object": (lambda t: ["--config", _bad(t, "c.json", "[1, 2]")], ["c.json", "JSON object"]),
    "invalid yaml": (lambda t: ["--config", _bad(t, "c.yaml", "num_hidden_layers: [2\n")],
                     ["c.yaml", "invalid YAML"]),
    "no layer count": (lambda t: ["--config", _bad(t, "c.json", _cfg(num_hidden_layers=None))],
                       ["c.json: num_hidden_layers: missing"]),
    "no head count": (lambda t: ["--config", _bad(t, "c.json", _cfg(num_attention_heads=None))],
                      ["c.json: num_attention_heads: missing"]),
    "zero heads": (lambda t: ["--config", _bad(t, "c.json", _cfg(num_attention_heads=0))],
                   ["c.json: num_attention_heads: must be a positive integer, got 0"]),
    "negative hidden": (lambda t: ["--config", _bad(t, "c.json", _cfg(hidden_size=-4096))],
                        ["c.json: hidden_size: must be a positive integer"]),
    "negative head_dim": (lambda t: ["--config", _bad(t, "c.json", _cfg(head_dim=-128))],
                          ["c.json: head_dim: must be a positive integer"]),
    "string eps": (lambda t: ["--config", _bad(t, "c.json", _cfg(rms_norm_eps="tiny"))],
                   ["c.json: rms_norm_eps: must be a number"]),
    "kv heads above heads": (lambda t: ["--config", _bad(t, "c.json", _cfg(num_key_value_heads=64))],
                             ["c.json: num_key_value_heads:"]),
    "zero window": (lambda t: ["--config", _bad(t, "c.json", _cfg(sliding_window=0, use_sliding_window=True))],
                    ["c.json: sliding_window: must be a positive integer or null"]),
    "tp does not divide heads": (lambda t: ["--config", QWEN3, "--attn-tp-size", "3"],
                                 ["--attn-tp-size: num_attention_heads:", "not divisible by attn_tp_size 3"]),
    "zero tp": (lambda t: ["--config", QWEN3, "--attn-tp-size", "0"], ["--attn-tp-size: must be a positive"]),
    "zero max len": (lambda t: ["--config", QWEN3, "--max-len", "0"], ["--max-len: must be a positive"]),
    "zero encoder length": (lambda t: ["--config", QWEN3, "--encoder-length", "0"],
                            ["--encoder-length: must be a positive integer, got 0"]),
    "encoder length not a number": (lambda t: ["--config", QWEN3, "--encoder-length", "577.5"],
                                    ["argument --encoder-length: invalid int value: '577.5'"]),
    "encoder length beyond any encoder": (lambda t: ["--config", QWEN3, "--encoder-length", str(1 << 40)],
                                          ["--encoder-length: 1099511627776 positions: above"]),
    "encoder length without cross-attention": (lambda t: ["--config", QWEN3, "--encoder-length", "64"],
                                               ["--encoder-length: 64: the decoder attends over no encoder",
                                                "model_type 'qwen3'"]),
    "encoder length below the config's": (lambda t: ["--config", CONFIGS / "bart_large.json", "--encoder-length", "512"],
                                          ["--encoder-length: 512 is below the 1024 encoder positions the config "
                                           "gives (max_position_embeddings"]),
    "negative concurrency": (lambda t: ["--config", QWEN3, "--max-concurrency", "-2"], ["--max-concurrency"]),
    "negative hbm": (lambda t: ["--config", QWEN3, "--hbm-gb", "-1"], ["--hbm-gb: must be a positive finite number"]),
    "ratio above one": (lambda t: ["--config", QWEN3, "--kv-mem-ratio", "1.5"], ["--kv-mem-ratio: must be in (0, 1]"]),
    "unknown dispatch": (lambda t: ["--config", QWEN3, "--dispatch", "部署模式: 混合部署"],
                         ["--dispatch: 部署模式: unknown deployment wording '混合部署'"]),
    "unknown dispatch file": (lambda t: ["--config", QWEN3, "--dispatch-file", FIX / "dispatch" / "unknown.txt"],
                              ["unknown.txt: 部署模式: unknown deployment wording"]),
    "missing dispatch file": (lambda t: ["--config", QWEN3, "--dispatch-file", t / "none.txt"],
                              ["none.txt: --dispatch-file: file not found"]),
    "progress contradicts dispatch": (
        lambda t: ["--config", QWEN3, "--progress", FIX / "progress" / "qwen3_framework.md",
                   "--dispatch-file", FIX / "dispatch" / "standalone.txt"],
        ["qwen3_framework.md: 部署模式: line 8 says framework", "says standalone"]),
    "missing progress": (lambda t: ["--config", QWEN3, "--progress", t / "p.md"], ["p.md: file not found"]),
    "block size not accepted": (lambda t: ["--config", QWEN3, "--block-size", "100"],
                                ["--block-size: block_size 100 rejected"]),
    "block size 16": (lambda t: ["--config", QWEN3, "--block-size", "16"], ["--block-size: block_size 16"]),
    "block size not a number": (lambda t: ["--config", QWEN3, "--block-size", "abc"],
                                ["argument --block-size: invalid int value: 'abc'"]),
    "no config flag": (lambda t: ["--format", "json"], ["one of the arguments --config --model-dir is required"]),
    "missing framework root": (lambda t: ["--config", QWEN3, "--framework-root", t / "nowhere"],
                               ["nowhere: --framework-root: framework root is not a directory"]),
    "damaged progress markers": (
        lambda t: ["--config", QWEN3, "--write-progress", _bad(t, "damaged.md", f"x\n{BEGIN}\n")],
        ["damaged.md", "damaged kvcache section markers"]),
    "out directory missing": (lambda t: ["--config", QWEN3, "--out", t / "no" / "m.json"],
                              ["m.json: directory does not exist"]),
    "out is progress": (lambda t: ["--config", QWEN3, "--out", t / "same.md", "--write-progress", t / "same.md"],
                        ["--write-progress", "names the same file as --out"]),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input_exits_2_with_one_line_and_writes_nothing(case, tmp_path, capsys):
    build, expected = BAD_CASES[case]
    out_file = tmp_path / "manifest.json"
    progress = tmp_path / "progress.md"
    out_file.write_bytes(b'{"previous": "manifest"}\n')
    progress.write_bytes((FIX / "progress" / "qwen3_framework.md").read_bytes())
    before = {p: p.read_bytes() for p in (out_file, progress)}
    argv = build(tmp_path)
    if "--out" not in argv:
        argv += ["--out", out_file]
    if "--write-progress" not in argv:
        argv += ["--write-progress", progress]
    listing = sorted(p.name for p in tmp_path.iterdir())
    rc, out, err = invoke(argv, capsys)
    assert rc == 2, err
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert "Traceback" not in err
    for word in expected:
        assert word in err, (word, err)
    for p, data in before.items():
        assert p.read_bytes() == data, p
    assert sorted(p.name for p in tmp_path.iterdir()) == listing  # no new or temp files


def test_bad_input_through_the_console_entry_has_no_traceback(tmp_path):
    bad = _bad(tmp_path, "config.json", '{"model_type": "llama", "hidden_size": 64}')
    proc = kvcache("analyze", "--config", str(bad))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"error: {bad}: num_hidden_layers: missing (looked for num_hidden_layers, n_layer, " \
                          "num_layers, n_layers, decoder_layers, num_decoder_layers)\n"
    usage = kvcache("analyze", "--config", QWEN3, "--block-size", "x")
    assert usage.returncode == 2 and usage.stderr.count("\n") == 1 and "Traceback" not in usage.stderr


# ---------------------------------------------------------------- the bundled example and the schema


def _committed_schema() -> dict:
    return json.loads(SCHEMA.read_text(encoding="utf-8"))


def test_committed_schema_equals_the_generated_one():
    generated = json.dumps(manifest_json_schema(), indent=2, ensure_ascii=False) + "\n"
    assert SCHEMA.read_text(encoding="utf-8") == generated, "run: kvcache schema --out references/manifest.schema.json"


def test_schema_command_prints_the_committed_schema(capsys):
    assert cli.guarded(cli.schema_main, []) == 0
    assert json.loads(capsys.readouterr().out) == _committed_schema()


def test_example_manifest_validates_against_the_exported_schema():
    proc = kvcache("analyze", "--config", str(EXAMPLE.relative_to(ROOT)), "--dispatch", "部署模式：框架部署")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    import jsonschema  # in the [test] extra

    jsonschema.validate(data, _committed_schema())
    m = SelectionManifest.model_validate_json(proc.stdout)
    assert m.model.model_type == "qwen3" and m.model.dtype == "bfloat16"
    assert (m.model.num_layers, m.model.hidden_size, m.model.head_dim) == (4, 128, 32)
    assert (m.model.num_attention_heads, m.model.num_key_value_heads) == (4, 2)
    assert m.kv_mode.value == "paged" and m.deploy_mode.source == "dispatch" and not m.blockers
    assert [c.num_head for c in m.layers[0].caches] == [2, 2]
    # python -m model_infer_kvcache.analyzer is the same command
    same = subprocess.run([sys.executable, "-m", "model_infer_kvcache.analyzer", "--config", str(EXAMPLE.relative_to(ROOT)),
                           "--dispatch", "部署模式：框架部署"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert same.returncode == 0 and same.stdout == proc.stdout


def test_a_manifest_breaking_the_schema_is_rejected(capsys):
    import jsonschema  # in the [test] extra
    rc, out, _ = invoke(["--config", EXAMPLE], capsys)
    data = json.loads(out)
    jsonschema.validate(data, _committed_schema())
    data["kv_mode"]["value"] = "contiguous"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, _committed_schema())


# ---------------------------------------------------------------- help


def test_help_explains_every_flag_with_an_example(capsys):
    parser = cli.build_parser()
    for action in parser._actions:
        if not action.option_strings or "-h" in action.option_strings:
            continue
        flag = action.option_strings[0]
        assert action.help and f"e.g. {flag}" in action.help, flag
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert 'kvcache analyze --config examples/tiny_qwen3/config.json --dispatch "部署模式：框架部署"' in text
    assert "exits 2" in text
