"""What a new user trips on: messages that read as sentences, files saved by other editors, --out vs --format,
and the README's CPU-wheel note.

Bad input keeps the CLI's promise (exit 2, one stderr line naming the file or flag, nothing written); the
files a Windows editor saves (UTF-16 with a byte-order mark) read as the UTF-8 ones do.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from cli_support import invoke, snapshot
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.progress_writer import markers

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny_qwen3" / "config.json"
PROGRESS = ROOT / "tests" / "fixtures" / "progress" / "qwen3_framework.md"
DISPATCH = ROOT / "tests" / "fixtures" / "dispatch" / "standalone.txt"
# Encodings an editor saves text in, each with its byte-order mark.
BOM_ENCODINGS = ["utf-8-sig", "utf-16", "utf-16-le-bom", "utf-16-be-bom", "utf-32"]


def _encoded(text: str, encoding: str) -> bytes:
    if encoding.endswith("-bom"):  # an explicit byte order, the mark written by hand as editors do
        return "\ufeff".encode(encoding.removesuffix("-bom")) + text.encode(encoding.removesuffix("-bom"))
    return text.encode(encoding)


def _refused(argv: list, capsys, *folders: Path) -> str:
    """The one stderr line of a refused call (exit 2, nothing on stdout, the folders unchanged)."""
    before = snapshot(*folders)
    rc, out, err = invoke(argv, capsys)
    assert rc == 2 and out == "", (rc, err)
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    assert snapshot(*folders) == before
    return err.rstrip("\n")


# ---------------------------------------------------------------- item 5a: a truncated JSON file


def _truncated_manifest(tmp: Path) -> Path:
    text = analyze(AnalyzeRequest(config=str(EXAMPLE))).to_json()
    path = tmp / "manifest.json"
    path.write_text(text[: len(text) // 2], encoding="utf-8")  # a copy cut short
    return path


TRUNCATED = {
    # id: (file name, content, argv builder (tmp dir, file))
    "config cut after a value": ("config.json", '{"model_type": "qwen3", "hidden_size": 40',
                                 lambda t, f: ["analyze", "--config", f]),
    "config cut inside a string": ("config.json", '{"model_type": "qwe',
                                   lambda t, f: ["analyze", "--config", f]),
    "readings cut short": ("readings.json", '{"kind": "kvcache-device-readings", "probe_version": ',
                           lambda t, f: ["analyze", "--config", EXAMPLE, "--device-readings", f]),
}


@pytest.mark.parametrize("case", sorted(TRUNCATED))
def test_a_truncated_json_file_is_named_in_a_whole_sentence(case, tmp_path, capsys):
    name, content, build = TRUNCATED[case]
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    err = _refused(build(tmp_path, path), capsys, tmp_path)
    assert err.startswith(f"error: {path}: ") and "invalid JSON at line 1 column " in err, err
    # json's own fragment ("Unterminated string starting at") stopped mid-sentence; the line now says why.
    assert not err.endswith(" at") and err.endswith("(is it truncated?)"), err


def test_a_truncated_manifest_is_named_in_a_whole_sentence(tmp_path, capsys):
    manifest = _truncated_manifest(tmp_path)
    err = _refused(["render", "--manifest", manifest, "--out", tmp_path / "rendered"], capsys, tmp_path)
    assert err.startswith(f"error: {manifest}: not a valid selection manifest: invalid JSON at line "), err
    assert err.endswith("(is it truncated?)") and "EOF while parsing" not in err, err


def test_a_json_syntax_error_mid_file_names_line_and_column(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text('{\n  "model_type": "qwen3",\n  "hidden_size" 40\n}\n', encoding="utf-8")
    err = _refused(["analyze", "--config", path], capsys, tmp_path)
    assert err == f"error: {path}: invalid JSON at line 3 column 17: expected ':' delimiter"


# ---------------------------------------------------------------- item 5b: non-finite numbers


@pytest.mark.parametrize("field, value, shown", [
    ("rope_scaling", {"rope_type": "linear", "factor": float("nan")}, "rope_scaling.factor: must be a finite number, got nan"),
    ("rms_norm_eps", float("inf"), "rms_norm_eps: must be a finite number, got inf"),
    ("vocab_size", float("-inf"), "vocab_size: must be a finite number, got -inf"),
])
def test_a_non_finite_config_number_is_called_non_finite(field, value, shown, tmp_path, capsys):
    config = json.loads(EXAMPLE.read_text(encoding="utf-8"))
    config[field] = value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config), encoding="utf-8")  # json writes NaN / Infinity, as transformers may
    err = _refused(["analyze", "--config", path], capsys, tmp_path)
    assert err == f"error: {path}: {shown}"  # not "must be a number, got a number nan"


@pytest.mark.parametrize("flag", ["--hbm-gb", "--kv-mem-ratio"])
def test_a_non_finite_flag_is_called_non_finite(flag, tmp_path, capsys):
    argv = ["analyze", "--config", EXAMPLE, "--hbm-gb", "40", flag, "nan"]
    err = _refused(argv, capsys, tmp_path)
    assert err == f"error: {flag}: must be a positive finite number, got nan"


# ---------------------------------------------------------------- item 5c: byte-order marks


def _analyze_in(folder: Path, argv: list, capsys, monkeypatch) -> tuple[int, str, str]:
    monkeypatch.chdir(folder)  # relative paths: the manifest quotes them, so runs compare byte for byte
    return invoke(argv, capsys)


@pytest.mark.parametrize("encoding", BOM_ENCODINGS)
def test_a_progress_md_saved_with_a_byte_order_mark_reads_as_utf8(encoding, tmp_path, capsys, monkeypatch):
    text = PROGRESS.read_text(encoding="utf-8")
    assert "部署模式" in text
    argv = ["analyze", "--config", EXAMPLE, "--progress", "p.md"]
    (tmp_path / "p.md").write_text(text, encoding="utf-8")
    want = _analyze_in(tmp_path, argv, capsys, monkeypatch)
    assert want[0] == 0 and json.loads(want[1])["deploy_mode"]["value"] == "framework"
    (tmp_path / "p.md").write_bytes(_encoded(text, encoding))
    assert _analyze_in(tmp_path, argv, capsys, monkeypatch) == want


@pytest.mark.parametrize("encoding", BOM_ENCODINGS)
def test_a_config_and_dispatch_file_saved_with_a_byte_order_mark_read_as_utf8(encoding, tmp_path, capsys,
                                                                              monkeypatch):
    config, dispatch = EXAMPLE.read_text(encoding="utf-8"), DISPATCH.read_text(encoding="utf-8")
    argv = ["analyze", "--config", "config.json", "--dispatch-file", "dispatch.txt"]
    (tmp_path / "config.json").write_text(config, encoding="utf-8")
    (tmp_path / "dispatch.txt").write_text(dispatch, encoding="utf-8")
    want = _analyze_in(tmp_path, argv, capsys, monkeypatch)
    assert want[0] == 0 and json.loads(want[1])["deploy_mode"]["value"] == "standalone"
    (tmp_path / "config.json").write_bytes(_encoded(config, encoding))
    (tmp_path / "dispatch.txt").write_bytes(_encoded(dispatch, encoding))
    assert _analyze_in(tmp_path, argv, capsys, monkeypatch) == want


def test_write_progress_into_a_utf16_progress_md_keeps_its_text(tmp_path, capsys, monkeypatch):
    text = PROGRESS.read_text(encoding="utf-8")
    target = tmp_path / "p.md"
    target.write_bytes(_encoded(text, "utf-16"))
    rc, _, err = _analyze_in(tmp_path, ["analyze", "--config", EXAMPLE, "--progress", "p.md",
                                        "--write-progress", "p.md"], capsys, monkeypatch)
    assert rc == 0, err
    written = target.read_bytes().decode("utf-8")  # rewritten as UTF-8, the mark kept
    begin, end = markers("analyze")
    assert written.startswith("\ufeff" + text) and begin in written and end in written


@pytest.mark.parametrize("flag, name", [("--progress", "p.md"), ("--config", "config.json"),
                                        ("--dispatch-file", "dispatch.txt")])
def test_a_file_that_is_not_utf8_is_refused_without_codec_jargon(flag, name, tmp_path, capsys):
    path = tmp_path / name
    path.write_bytes("部署模式: 框架部署\n".encode() + "attn_tp_size: 4 (café)\n".encode("latin-1"))
    argv = ["analyze", "--config", EXAMPLE, flag, path] if flag != "--config" else ["analyze", flag, path]
    err = _refused(argv, capsys, tmp_path)
    assert err == f"error: {path}: not UTF-8 text at line 2: save it as UTF-8"


# ---------------------------------------------------------------- item 8: --out suffix vs --format


@pytest.mark.parametrize("fmt, name", [("md", "manifest.json"), ("yaml", "manifest.json"), ("json", "manifest.yaml"),
                                       ("json", "m.yml"), ("md", "M.YAML"), (None, "decisions.md")])
def test_an_out_suffix_naming_another_format_is_refused(fmt, name, tmp_path, capsys):
    argv = ["analyze", "--config", EXAMPLE, "--out", tmp_path / name] + (["--format", fmt] if fmt else [])
    err = _refused(argv, capsys, tmp_path)
    assert err.startswith(f"error: {tmp_path / name}: --out: ") and f"--format is {fmt or 'json'}" in err, err
    assert not (tmp_path / name).exists()


@pytest.mark.parametrize("fmt, name", [("md", "decisions.md"), ("yaml", "manifest.yml"), ("yaml", "m.YAML"),
                                       ("json", "manifest.json"), (None, "manifest.json"), ("md", "notes.txt"),
                                       ("yaml", "manifest")])
def test_an_out_suffix_agreeing_with_format_or_unknown_is_written(fmt, name, tmp_path, capsys):
    argv = ["analyze", "--config", EXAMPLE, "--out", tmp_path / name] + (["--format", fmt] if fmt else [])
    rc, out, err = invoke(argv, capsys)
    assert rc == 0 and out == "", err
    written = (tmp_path / name).read_text(encoding="utf-8")
    if fmt in (None, "json"):
        assert json.loads(written)["schema_version"]
    elif fmt == "yaml":
        assert written.startswith("schema_version:")
    else:
        assert written.startswith("### ") and "\n| 决策项 | 选择 | 理由 |\n" in written  # the decisions table


# ---------------------------------------------------------------- item 6: README's CPU wheel


def test_readme_says_how_to_get_the_cpu_torch_wheel_under_each_install_block():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = list(re.finditer(r"```bash\n(.*?)```\n", text, re.S))
    installs = [b for b in blocks if "pip install torch==2.13.0" in b.group(1)]
    assert len(installs) == 2
    cpu = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    for block in installs:
        after = text[block.end():].lstrip("\n").split("\n\n", 1)[0]  # the paragraph right under the block
        assert cpu in " ".join(after.split()), after
