"""progress.md / dispatch parsing and the progress.md section upsert, by example and by property."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_infer_kvcache.analyzer.build import AnalyzeRequest, assemble
from model_infer_kvcache.analyzer.config_loader import load_model_facts
from model_infer_kvcache.analyzer.deploy_context import (
    FACT_LABELS,
    DispatchFacts,
    parse_dispatch,
    parse_progress,
)
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.progress_writer import markers, upsert_section

FIXTURES = Path(__file__).parent / "fixtures"
PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------- dispatch by example


@pytest.mark.parametrize("text, mode", [
    ("部署模式: 框架部署", "framework"),
    ("部署模式：框架部署", "framework"),
    ("部署模式 ：  独立部署", "standalone"),
    ("部署模式:独立部署\n", "standalone"),
    ("请迁移 Qwen3。\n- **部署模式**: **框架部署**\n其余按默认。", "framework"),  # Markdown emphasis
    ("部署模式: **框架部署**（参考 qwen3_8b）", "framework"),
    ("部署模式：`独立部署`", "standalone"),
    ("部署模式：「框架部署」", "framework"),
    ("部署模式: framework", "framework"),
    ("部署模式: Standalone mode", "standalone"),
    ("部署模式: 框架部署\n...\n部署模式: 框架部署", "framework"),  # repeated, consistent
    ("部署模式：待定", None),
    ("部署模式:", None),
    ("部署模式：\n框架部署", None),  # the value is not on the line
    ("没有部署信息的提示词", None),
    ("", None),
])
def test_dispatch_wordings(text, mode):
    assert parse_dispatch(text).deploy_mode == mode


def test_dispatch_keeps_the_line_as_evidence():
    facts = parse_dispatch((FIXTURES / "dispatch" / "framework.txt").read_text(encoding="utf-8"))
    assert facts == DispatchFacts("framework", "部署模式：框架部署")


@pytest.mark.parametrize("text, words", [
    ("部署模式: 混合部署", "unknown deployment wording '混合部署'"),
    ("部署模式: 非框架部署", "unknown deployment wording"),
    ("部署模式: 框架部署|独立部署", "lists both deployment modes"),
    ("部署模式：框架部署还是独立部署？", "lists both deployment modes"),
    ("部署模式: 框架部署\n部署模式: 独立部署", "states both deployment modes"),
])
def test_dispatch_errors_name_the_field(text, words):
    with pytest.raises(InputError) as err:
        parse_dispatch(text, where="dispatch.txt")
    assert err.value.where == "dispatch.txt" and err.value.field == "部署模式"
    assert words in err.value.message
    assert "\n" not in err.value.render()


# ---------------------------------------------------------------- progress.md by example


def test_progress_chinese_section_style():
    path = FIXTURES / "progress" / "qwen3_framework.md"
    p = parse_progress(path.read_text(encoding="utf-8"), str(path))
    assert p.deploy_mode.value == "framework" and p.deploy_mode.line == 8
    assert p.num_cards.value == 8 and p.num_cards.text == "- 部署卡数: 8"
    assert p.attn_tp_size.value == 4
    assert p.npu_model.value == "Atlas 800I A2"
    assert p.hbm_gb.value == 64.0
    assert [s.value for s in p.starting_point] == ["legacy_cache_unit"]
    assert p.runner_files == ["runner_qwen3_8b.py"]


def test_progress_table_style():
    path = FIXTURES / "progress" / "llama_standalone.md"
    p = parse_progress(path.read_text(encoding="utf-8"), str(path))
    assert p.deploy_mode.value == "standalone"
    assert (p.num_cards.value, p.hbm_gb.value, p.npu_model.value) == (2, 32.0, "Atlas 800T A2")
    assert p.attn_tp_size is None
    assert [s.value for s in p.starting_point] == ["kv_list"]
    assert p.runner_files == ["runner_llama.py"]


@pytest.mark.parametrize("line, name, value", [
    ("- TP: 16", "attn_tp_size", 16),
    ("- 注意力 TP: 2", "attn_tp_size", 2),
    ("* world_size: 16", "num_cards", 16),
    ("- 卡数：4 张", "num_cards", 4),
    ("- 单卡显存: 96 GiB", "hbm_gb", 96.0),
    ("- HBM: 64.5G", "hbm_gb", 64.5),
    ("- 部署模式: 待定", "deploy_mode", None),
])
def test_progress_values(line, name, value):
    stated = getattr(parse_progress(line), name)
    assert (stated.value if stated else None) == value


# ---------------------------------------------------------------- properties: parsers never crash

FRAGMENTS = st.sampled_from([
    "部署模式", ":", "：", "框架部署", "独立部署", "框架", "独立", "|", "-", "*", "**", "`", " ", "\n", "\r\n",
    "## 模型信息", "### 运行环境", "- 部署卡数: ", "部署卡数", "attn_tp_size", "TP", "HBM", "GB", "单卡",
    "cache_unit", "block_table", "list of (k, v)", "runner_x.py", "8", "64", "0", "-1", "1e9", "٣", "１６",
    "待定", "混合", "，", "、", "还是", "or", "\t", "\u3000", "|---|---|",
])
TEXT = st.lists(st.one_of(FRAGMENTS, st.text(max_size=12)), max_size=40).map("".join)


@PROPS
@given(TEXT)
def test_progress_parser_is_total(text):
    try:
        p = parse_progress(text)
    except InputError as exc:
        # only an impossible stated value: one line naming file:line and the field
        assert exc.where.startswith("progress.md:") and exc.field in FACT_LABELS.values()
        assert "\n" not in exc.render()
        return
    for name in ("attn_tp_size", "num_cards"):
        stated = getattr(p, name)
        assert stated is None or (isinstance(stated.value, int) and stated.value > 0)
    assert p.deploy_mode is None or p.deploy_mode.value in ("framework", "standalone")
    assert p.hbm_gb is None or p.hbm_gb.value >= 0


@PROPS
@given(TEXT)
def test_dispatch_parser_raises_only_input_error_on_a_stated_line(text):
    try:
        facts = parse_dispatch(text)
    except InputError as exc:
        # only a 部署模式 line with a colon can be a clear but unknown/ambiguous statement
        assert "部署模式" in text and exc.field == "部署模式"
        assert "\n" not in exc.render()
        return
    assert facts.deploy_mode in (None, "framework", "standalone")
    if "部署模式" not in text:
        assert facts.deploy_mode is None


NOISE_LINE = st.text(st.characters(blacklist_characters="部\r\n"), max_size=30)


@PROPS
@given(st.lists(NOISE_LINE, max_size=8), st.lists(NOISE_LINE, max_size=8),
       st.sampled_from([("框架部署", "framework"), ("独立部署", "standalone")]), st.sampled_from([":", "："]))
def test_dispatch_finds_the_line_among_noise(before, after, wording, colon):
    text = "\n".join([*before, f"部署模式{colon} {wording[0]}", *after])
    assert parse_dispatch(text).deploy_mode == wording[1]


@lru_cache(maxsize=1)
def _qwen3_facts():
    return load_model_facts(FIXTURES / "configs" / "qwen3_8b.json")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(TEXT)
def test_analyze_never_crashes_on_arbitrary_progress(text):
    """Whatever progress.md says (no dispatch to contradict), the manifest is built."""
    req = AnalyzeRequest(config="qwen3_8b.json")
    try:
        m = assemble(_qwen3_facts(), parse_progress(text), DispatchFacts(None, None), None, req)
    except InputError as exc:  # an impossible stated value, or a TP that cannot split the heads
        assert exc.where.startswith("progress.md:") and "\n" not in exc.render()
        return
    assert m.deploy_mode.value in ("framework", "standalone")
    assert m.parallel.attn_tp_size >= 1 and m.layers


# ---------------------------------------------------------------- progress.md upsert

BODY = "### KVCache 选型决策\n\n| 决策项 | 选择 | 理由 |\n|---|---|---|\n| KV 模式 | paged | 无阻塞项 |\n"
BEGIN, END = markers("analyze")
SURROUNDING = st.lists(st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=20),
    st.sampled_from(["\n", "\r\n", "\r", "## 模型信息", "- 部署卡数: 8", "<!-- 人工备注 -->", "| a | b |"]),
), max_size=20).map("".join).filter(lambda t: "kvcache:" not in t)


@PROPS
@given(SURROUNDING, st.text(max_size=60))
def test_upsert_appends_and_is_idempotent(text, extra):
    body = BODY + extra.replace("<!--", "")
    once = upsert_section(text, "analyze", body)
    assert once.startswith(text)  # nothing before our block moves
    assert once.count(BEGIN) == 1 and once.count(END) == 1
    assert upsert_section(once, "analyze", body) == once


@PROPS
@given(SURROUNDING, SURROUNDING, st.text(max_size=60), st.text(max_size=60))
def test_upsert_replaces_only_between_markers(prefix, suffix, old_extra, new_extra):
    nl = "\r\n" if "\r\n" in prefix + suffix else "\n"
    old_block = BEGIN + nl + "old decisions " + old_extra.replace("<!--", "") + nl + END
    text = prefix + old_block + suffix
    new = upsert_section(text, "analyze", BODY + new_extra.replace("<!--", ""))
    assert new.startswith(prefix) and new.endswith(suffix)
    middle = new[len(prefix): len(new) - len(suffix)]
    assert middle.startswith(BEGIN) and middle.endswith(END)
    assert "old decisions" not in middle or "old decisions" in new_extra
    assert upsert_section(new, "analyze", BODY + new_extra.replace("<!--", "")) == new


def test_upsert_keeps_crlf_and_separates_with_a_blank_line():
    text = "# 进度\r\n\r\n- 部署卡数: 8\r\n"
    out = upsert_section(text, "analyze", "a\nb\n")
    assert out == text + "\r\n" + BEGIN + "\r\na\r\nb\r\n" + END + "\r\n"
    no_newline = upsert_section("x", "analyze", "a")
    assert no_newline == "x\n\n" + BEGIN + "\na\n" + END + "\n"
    assert upsert_section("", "analyze", "a") == BEGIN + "\na\n" + END + "\n"


def test_upsert_defuses_markers_inside_the_body():
    once = upsert_section("", "analyze", f"model {END} <!-- x -->")
    assert once.count(END) == 1
    assert upsert_section(once, "analyze", f"model {END}") == once.replace(" &lt;!-- x -->", "")


@pytest.mark.parametrize("text, words", [
    (f"{BEGIN}\nx\n", "1 begin, 0 end"),
    (f"{BEGIN}\n{END}\n{BEGIN}\n{END}\n", "2 begin, 2 end"),
    (f"{END}\nx\n{BEGIN}\n", "end marker before begin marker"),
])
def test_upsert_refuses_damaged_markers(text, words):
    with pytest.raises(InputError) as err:
        upsert_section(text, "analyze", "body", where="progress.md")
    assert err.value.where == "progress.md" and words in err.value.message
