"""progress.md as migrator output really writes it (issue 12, point 2), by example.

Each case under the issue's "Why" is reproduced here: wordings that were ignored, values that were
misread or vanished, contradictions that were settled silently, and our own section read back.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from model_infer_kvcache.analyzer.deploy_context import parse_progress
from model_infer_kvcache.analyzer.progress_writer import markers
from test_analyzer_cli import invoke

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures"
QWEN3 = str(FIX / "configs" / "qwen3_8b.json")
BEGIN, END = markers("analyze")


def analyze(tmp_path: Path, progress_text: str, capsys, *flags) -> dict:
    p = tmp_path / "progress.md"
    p.write_text(progress_text, encoding="utf-8")
    rc, out, err = invoke(["--config", QWEN3, "--progress", p, *flags], capsys)
    assert rc == 0, err
    return json.loads(out)


# ---------------------------------------------------------------- wordings


@pytest.mark.parametrize("text, mode", [
    ("部署模式: 独立部署", "standalone"),  # no bullet
    ("部署模式：独立部署", "standalone"),  # full-width colon
    ("**部署模式**：框架部署", "framework"),
    ("### 部署模式: 独立部署", "standalone"),
    ("本模型自管推理循环，不接入框架（独立部署）", "standalone"),  # prose with a negation of the other mode
    ("- 备注: 自管推理循环，不接入框架（独立部署）", "standalone"),
    ("部署模式: 自管推理循环，不接入框架（独立部署）", "standalone"),  # a key whose value is a sentence
    ("该模型不使用独立部署。", "framework"),  # a negated mode is not that mode
    ("接入框架，注册到 support_models", "framework"),
    ("Runs in standalone mode with its own loop", "standalone"),
    ("Runs standalone.", "standalone"),
    ("见 references/standalone.md 与 runner_standalone.py", None),  # file names state nothing
    ("| 阶段 | 部署模式 | 状态 |\n|---|---|---|\n| 模型迁移 | 独立部署 | 完成 |", "standalone"),
    ("| 项 | 值 |\n|---|---|\n| 部署模式 | 框架部署 |", "framework"),
    ("## 框架部署与独立部署的区别", None),  # a heading names topics, it states nothing
    ("```\n# 不接入框架（独立部署）\n```", None),  # code is not prose
    ("部署模式: 待定", None),
])
def test_deployment_mode_wordings(text, mode):
    stated = parse_progress(text, "p.md").deploy_mode
    assert (stated.value if stated else None) == mode


@pytest.mark.parametrize("text, tp", [
    ("- attn_tp_size: 4", 4),
    ("attn_tp_size: 4", 4),
    ("attn_tp_size：４", 4),  # full-width colon and digit
    ("| 阶段 | 并行 |\n|---|---|\n| KVCache 改造 | attn_tp_size=4 |", 4),  # a stage-table cell
    ("| 阶段 | attn_tp_size |\n|---|---|\n| KVCache 改造 | 4 |", 4),  # a header naming the column
    ("| 参数 | 值 |\n|---|---|\n| attn TP | 4 |", 4),  # key column + value column
    ("8 卡部署，TP=4，DP=2", 4),
    ("attention TP 4", 4),
    ("attn TP: 4", 4),
    ("parallel_config:\n  world_size: 8\n  attn_tp_size: 4\n  moe_tp_size: 8\n  lmhead_tp_size: 8", 4),
    ("MoE TP=8, embed TP 8", None),  # other modules' TP is not the attention TP
    ("qwen3_8b_2tp.yaml", None),
])
def test_attention_tp_wordings(text, tp):
    stated = parse_progress(text, "p.md").attn_tp_size
    assert (stated.value if stated else None) == tp


def test_every_value_used_is_reported_with_file_and_line(tmp_path, capsys):
    text = ("# 进度\n\n部署模式：独立部署\n\n| 阶段 | 并行 |\n|---|---|\n| KVCache | attn_tp_size=4 |\n\n"
            "- 部署卡数: 8\n- NPU 型号: Atlas 800I A2\n- 单卡 HBM: 64GB\n")
    m = analyze(tmp_path, text, capsys)
    p = str(tmp_path / "progress.md")
    assert m["inputs"]["progress_sources"] == {
        "部署模式": f"{p}:3: 部署模式：独立部署",
        "attn_tp_size": f"{p}:7: attn_tp_size=4",
        "部署卡数": f"{p}:9: - 部署卡数: 8",
        "NPU 型号": f"{p}:10: - NPU 型号: Atlas 800I A2",
        "单卡 HBM": f"{p}:11: - 单卡 HBM: 64GB",
    }
    assert (m["deploy_mode"]["value"], m["deploy_mode"]["source"]) == ("standalone", "self_check")
    assert m["deploy_mode"]["evidence"] == [f"{p}:3: '部署模式：独立部署'"]
    assert (m["parallel"]["attn_tp_size"], m["parallel"]["attn_tp_source"]) == (4, f"{p}:7")
    assert (m["inputs"]["num_cards"], m["memory"]["hbm_gb"]) == (8, 64.0)
    # a flag wins, and the progress.md value it replaced is not reported as used
    m = analyze(tmp_path, text, capsys, "--attn-tp-size", "2", "--hbm-gb", "40")
    assert "attn_tp_size" not in m["inputs"]["progress_sources"] and "单卡 HBM" not in m["inputs"]["progress_sources"]


# ---------------------------------------------------------------- impossible values: exit 2 like the flags


@pytest.mark.parametrize("line, field, words", [
    ("- 部署卡数: -8", "部署卡数", "got -8"),  # was read as 8
    ("- attn_tp_size: abc", "attn_tp_size", "got 'abc'"),  # vanished silently
    ("- 单卡 HBM: lots", "单卡 HBM", "'lots'"),  # vanished silently
    ("- 部署卡数: 0", "部署卡数", "got 0"),
    ("- attn_tp_size: 2.5", "attn_tp_size", "got 2.5"),
    ("- 部署卡数: 12345678901234567890", "部署卡数", "at most"),
    ("| 阶段 | 并行 |\n|---|---|\n| KV | attn_tp_size=-4 |", "attn_tp_size", "got -4"),
    ("- 单卡 HBM: 64 PB", "单卡 HBM", "unknown unit 'pb'"),
    ("- 部署模式: 混合部署", "部署模式", "unknown deployment wording"),
    ("- 部署模式: 框架部署 / 独立部署", "部署模式", "lists both deployment modes"),
])
def test_impossible_values_exit_2_naming_file_line_and_field(line, field, words, tmp_path, capsys):
    p = tmp_path / "progress.md"
    text = "# 进度\n\n" + line + "\n"
    p.write_text(text, encoding="utf-8")
    out_file = tmp_path / "m.json"
    rc, out, err = invoke(["--config", QWEN3, "--progress", p, "--out", out_file, "--write-progress", p], capsys)
    assert rc == 2 and out == ""
    bad_line = len(text.splitlines())  # the last line of the case states the value
    assert err.startswith(f"error: {p}:{bad_line}: {field}: ") and words in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert p.read_text(encoding="utf-8") == text and not out_file.exists()


def test_tp_that_cannot_split_the_heads_is_refused_like_the_flag(tmp_path, capsys):
    p = tmp_path / "progress.md"
    p.write_text("- attn_tp_size: 3\n", encoding="utf-8")
    rc_file, _, err_file = invoke(["--config", QWEN3, "--progress", p], capsys)
    rc_flag, _, err_flag = invoke(["--config", QWEN3, "--attn-tp-size", "3"], capsys)
    assert rc_file == rc_flag == 2  # was: a Legacy manifest and exit 0 from progress.md
    reason = "32 query heads are not divisible by attn_tp_size 3"
    assert err_file.startswith(f"error: {p}:1: attn_tp_size: {reason}") and reason in err_flag


def test_undecided_values_state_nothing():
    p = parse_progress("- 部署卡数: 待定\n- attn_tp_size: -\n- 单卡 HBM: TBD\n- 部署模式:\n", "p.md")
    assert (p.num_cards, p.attn_tp_size, p.hbm_gb, p.deploy_mode) == (None, None, None, None)


# ---------------------------------------------------------------- contradictions: an open question, no pick


def test_contradicting_tp_is_an_open_question_naming_both_lines(tmp_path, capsys):
    m = analyze(tmp_path, "- attn_tp_size: 4\n\n中间文字\n\n8 卡，TP=2\n", capsys)
    p = str(tmp_path / "progress.md")
    assert m["parallel"]["attn_tp_size"] == 1 and m["parallel"]["attn_tp_source"].startswith("default")
    q = [f for f in m["open_questions"] if "attn_tp_size in contradicting ways" in f["message"]]
    assert len(q) == 1
    assert f"{p}:1 '- attn_tp_size: 4' (4)" in q[0]["message"] and f"{p}:5 'TP=2' (2)" in q[0]["message"]
    assert "none of them is used, attn_tp_size from default" in q[0]["message"]
    assert q[0]["fields"] == ["attn_tp_size", f"{p}:1", f"{p}:5"]
    assert "attn_tp_size" not in m["inputs"]["progress_sources"]


def test_contradicting_deployment_mode_falls_back_and_says_so(tmp_path, capsys):
    text = "- 部署模式: 框架部署\n\n## 说明\n\n自管推理循环，不接入框架（独立部署）\n"
    m = analyze(tmp_path, text, capsys)
    assert (m["deploy_mode"]["value"], m["deploy_mode"]["source"]) == ("framework", "default")
    q = [f["message"] for f in m["open_questions"] if "部署模式 in contradicting ways" in f["message"]]
    assert len(q) == 1 and ":1 " in q[0] and ":5 " in q[0]
    assert "deployment mode framework from default instead" in q[0]
    # a flag settles it: the contradiction is then a warning, not a question
    m = analyze(tmp_path, text, capsys, "--deploy-mode", "standalone")
    assert m["deploy_mode"]["value"] == "standalone"
    assert not [f for f in m["open_questions"] if "contradicting" in f["message"]]
    assert [f for f in m["warnings"] if "部署模式 in contradicting ways" in f["message"]]


def test_the_same_value_stated_twice_is_no_contradiction():
    p = parse_progress("- attn_tp_size: 4\n| 阶段 | 并行 |\n|---|---|\n| x | TP=4 |\n部署模式: 独立部署\n"
                       "不接入框架（独立部署）\n", "p.md")
    assert p.conflicts == {}
    assert (p.attn_tp_size.value, p.attn_tp_size.line, p.deploy_mode.value) == (4, 1, "standalone")


# ---------------------------------------------------------------- our own section is never evidence


def test_repeated_write_progress_on_a_touched_file_is_byte_stable(tmp_path, capsys, monkeypatch):
    """The issue's repro: `touch p.md`, then the same analyze --write-progress three times."""
    monkeypatch.chdir(tmp_path)
    Path("p.md").touch()
    sizes = []
    for _ in range(3):
        rc, _, err = invoke(["--config", QWEN3, "--progress", "p.md", "--format", "md", "--write-progress", "p.md"],
                            capsys)
        assert rc == 0, err
        sizes.append(Path("p.md").stat().st_size)
    assert sizes[0] == sizes[1] == sizes[2]  # was 2057 -> 2138 -> 2223 -> 2312
    text = Path("p.md").read_text(encoding="utf-8")
    assert text.count(BEGIN) == 1 and "\\|" not in text  # nothing nested, no escaped pipes
    assert "| 部署模式 | framework | source default:" in text


def test_dispatch_after_a_framework_default_section_is_accepted(tmp_path, capsys, monkeypatch):
    """The issue's repro: the tool's own 'framework' row used to refute a correct dispatch line."""
    monkeypatch.chdir(tmp_path)
    Path("p.md").touch()
    base = ["--config", QWEN3, "--progress", "p.md", "--format", "md", "--write-progress", "p.md"]
    assert invoke(base, capsys)[0] == 0
    rc, out, err = invoke([*base, "--dispatch", "部署模式: 独立部署"], capsys)
    assert rc == 0 and err == ""
    assert "| 部署模式 | standalone | source dispatch: dispatch line '部署模式: 独立部署' |" in out


def test_hostile_statements_inside_our_sections_are_ignored():
    body = "- 部署卡数: -8\n- attn_tp_size: 3\n部署模式: 独立部署\n- 部署模式: 框架部署\nrunner_own.py block_table\n"
    text = ("- attn_tp_size: 4\n"
            + f"{BEGIN}\n{body}{END}\n"
            + "<!-- kvcache:begin validate -->\n" + body + "<!-- kvcache:end validate -->\n"
            + "- 部署卡数: 8\n")
    p = parse_progress(text, "p.md")
    assert (p.attn_tp_size.value, p.num_cards.value, p.num_cards.line) == (4, 8, 16)
    assert p.deploy_mode is None and p.conflicts == {} and p.runner_files == [] and p.starting_point == []


def test_a_section_that_never_ends_is_not_read_and_is_reported(tmp_path, capsys):
    m = analyze(tmp_path, f"- attn_tp_size: 2\n{BEGIN}\n- attn_tp_size: 3\n- 部署卡数: -8\n", capsys)
    assert m["parallel"]["attn_tp_size"] == 2
    assert any(":2 opens a kvcache section that never ends" in w["message"] for w in m["warnings"])
