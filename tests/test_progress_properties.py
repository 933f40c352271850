"""Properties of the progress.md reader and writer over generated files (issue 12, point 2).

Generated files mix foreign content (headings, prose, other tables, YAML, HTML comments), the
facts in any of the styles migrator output uses, and optionally our own sections from an earlier
run (with hostile statements in them). The properties:
- the facts read do not depend on bullet style, colon width, table or bullet form;
- two different values for one fact are a conflict, never a silent pick;
- `analyze --write-progress` twice gives the bytes of once, whatever the start, and every foreign byte
  survives; what we wrote is never read back.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_infer_kvcache.analyzer import cli
from model_infer_kvcache.analyzer.deploy_context import FACT_LABELS, parse_progress
from model_infer_kvcache.analyzer.progress_writer import markers

ROOT = Path(__file__).resolve().parents[1]
QWEN3 = str(ROOT / "tests" / "fixtures" / "configs" / "qwen3_8b.json")
PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BEGIN, END = markers("analyze")
SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None  # fsync is cheap there

KEYS = {
    "deploy_mode": ["部署模式", "deploy_mode", "部署方式"],
    "attn_tp_size": ["attn_tp_size", "attn TP", "注意力 TP", "TP", "attention_tp_size"],
    "num_cards": ["部署卡数", "world_size", "卡数"],
    "hbm_gb": ["单卡 HBM", "HBM", "单卡显存"],
    "npu_model": ["NPU 型号", "硬件"],
}
VALUES = {
    "deploy_mode": st.sampled_from(["framework", "standalone"]),
    "attn_tp_size": st.sampled_from([1, 2, 4, 8]),  # each splits Qwen3-8B's 32 / 8 heads
    "num_cards": st.integers(1, 64),
    "hbm_gb": st.sampled_from([32.0, 64.0, 96.0, 64.5]),
    "npu_model": st.sampled_from(["Atlas 800I A2", "Atlas 800T A3"]),
}
MODE_WORDS = {"framework": ["框架部署", "framework", "框架模式"], "standalone": ["独立部署", "standalone", "独立模式"]}
MODE_PROSE = {"framework": ["本模型接入框架，注册到 support_models。", "该模型不使用独立部署。"],
              "standalone": ["自管推理循环，不接入框架（独立部署）", "Runs in standalone mode."]}
KEY_LINES = ["- {k}: {v}", "* {k}：{v}", "{k}: {v}", "{k}：{v}", "- **{k}**: {v}", "1. {k}: {v}", "  {k}: {v}",
             "| 项 | 值 |\n|---|---|\n| {k} | {v} |", "| 阶段 | {k} | 状态 |\n|:---|---|---|\n| 迁移 | {v} | 完成 |"]

NOISE = st.one_of(
    st.sampled_from([
        "# Qwen3-8B 迁移进度", "## 迁移阶段", "- 模型名称: Qwen3-8B", "- CANN 版本: 8.2.RC1", "  moe_tp_size: 1",
        "  lmhead_tp_size: 8", "| 阶段 | 状态 |\n|---|---|\n| 模型迁移 | 完成 |", "（待补充）", "<!-- 人工备注 -->",
        "> 与 GPU 基线精度对齐", "```bash\npython infer.py --model qwen3\n```", "- 起点: Legacy",
    ]),
    # free text that cannot spell a fact (no digits, no 't'/'p'/'w', no 框/独)
    st.text(st.sampled_from(list("abcdefghijklmnoqrsuvxyz 中文迁移进度备注完成,.()#*-")), max_size=30),
)


@st.composite
def fact_block(draw, name: str, value) -> str:
    """One statement of ``name = value`` in a style drawn at random."""
    if name == "deploy_mode" and draw(st.booleans()):
        return draw(st.sampled_from(MODE_PROSE[value]))
    if name == "attn_tp_size" and draw(st.booleans()):
        inline = draw(st.sampled_from(["8 卡，TP={v}，DP=1", "attention TP {v}", "attn TP: {v}",
                                       "| 阶段 | 并行 |\n|---|---|\n| KVCache | attn_tp_size={v} |"]))
        return inline.format(v=value)
    if name == "deploy_mode":
        text = draw(st.sampled_from(MODE_WORDS[value]))
    elif name == "hbm_gb":
        text = f"{value:g}" + draw(st.sampled_from(["GB", " GB", "G", " GiB"]))
    elif name == "num_cards":
        text = str(value) + draw(st.sampled_from(["", " 张", "（单机）"]))
    else:
        text = str(value)
    if name in ("attn_tp_size", "num_cards") and draw(st.booleans()):
        text = text.translate(str.maketrans("0123456789", "０１２３４５６７８９"))  # full-width digits
    key = draw(st.sampled_from(KEYS[name]))
    return draw(st.sampled_from(KEY_LINES)).format(k=key, v=text)


@st.composite
def document(draw, facts: dict) -> str:
    blocks = [draw(fact_block(name, value)) for name, value in facts.items()]
    blocks += draw(st.lists(NOISE, max_size=6))
    blocks = draw(st.permutations(blocks))
    return "\n\n".join(blocks) + "\n"  # a blank line ends a Markdown table


FACTS = st.fixed_dictionaries({}, optional={name: values for name, values in VALUES.items()})


def values_of(p) -> dict:
    return {name: getattr(p, name).value for name in FACT_LABELS if getattr(p, name) is not None}


@PROPS
@given(st.data(), FACTS)
def test_facts_do_not_depend_on_the_style(data, facts):
    text = data.draw(document(facts))
    p = parse_progress(text, "p.md")
    assert p.conflicts == {}
    assert values_of(p) == facts
    for name in facts:  # the line reported states the fact
        stated = getattr(p, name)
        assert text.split("\n")[stated.line - 1].strip() != ""


@PROPS
@given(st.data(), st.sampled_from(sorted(VALUES)), FACTS)
def test_two_values_for_one_fact_are_a_conflict(data, name, others):
    first, second = data.draw(st.lists(VALUES[name], min_size=2, max_size=2, unique=True))
    text = data.draw(document({k: v for k, v in others.items() if k != name}))
    text += "\n" + data.draw(fact_block(name, first)) + "\n\n" + data.draw(fact_block(name, second)) + "\n"
    p = parse_progress(text, "p.md")
    assert getattr(p, name) is None  # no value picked silently
    assert sorted(str(s.value) for s in p.conflicts[name]) == sorted([str(first), str(second)])
    assert all(s.line >= 1 for s in p.conflicts[name])


HOSTILE = "\n".join(["- 部署卡数: -8", "- attn_tp_size: 3", "- 单卡 HBM: lots", "部署模式: 独立部署",
                     "| 部署模式 | framework | source default |", "runner_mine.py block_table"])


def _analyze_write(path: Path) -> None:
    args = cli.build_parser().parse_args(["--config", QWEN3, "--progress", str(path), "--format", "md",
                                          "--write-progress", str(path)])
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.run(args) == 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), FACTS, FACTS, st.sampled_from(["none", "analyze", "both"]), st.booleans())
def test_write_progress_twice_equals_once_and_keeps_foreign_bytes(data, before_facts, after_facts, own, crlf):
    # One statement per fact in the whole file (facts the 'after' part repeats take the 'before' value).
    after_facts = {k: before_facts.get(k, v) for k, v in after_facts.items() if k not in before_facts}
    before = data.draw(document(before_facts)) if data.draw(st.booleans()) or before_facts else ""
    after = data.draw(document(after_facts)) if after_facts or data.draw(st.booleans()) else ""
    section = ""
    if own != "none":
        section = f"{BEGIN}\n{HOSTILE}\n{END}\n"
        if own == "both":
            section += f"<!-- kvcache:begin validate -->\n{HOSTILE}\n<!-- kvcache:end validate -->\n"
    original = before + section + after
    if crlf:
        original = original.replace("\n", "\r\n")
    with tempfile.TemporaryDirectory(dir=SCRATCH) as tmp:
        path = Path(tmp) / "progress.md"
        path.write_bytes(original.encode("utf-8"))
        _analyze_write(path)
        once = path.read_bytes()
        _analyze_write(path)
        assert path.read_bytes() == once  # byte-stable on repeat
        _analyze_write(path)
        assert path.read_bytes() == once
    text = once.decode("utf-8")
    assert text.count(BEGIN) == 1 and text.count(END) == 1 and "\\|" not in text
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    if own == "none":  # appended after a separating newline; nothing before it moved
        assert text.startswith(original) and text[len(original):].lstrip("\r\n").startswith(BEGIN)
        assert text[stop:] in ("\n", "\r\n")
    else:  # replaced in place: every byte on both sides kept
        assert text[:start] == original[:original.index(BEGIN)]
        assert text[stop:] == original[original.index(END) + len(END):]
    # what we wrote is invisible to the reader: the facts are those of the foreign text alone
    assert values_of(parse_progress(text, "p.md")) == {**before_facts, **after_facts}
