"""What an agent reads (issue 12, point 7): the decisions table and INTEGRATION.md.

- a decision whose source is the default tells the agent to read progress.md and confirm with the user;
- reasons are English in every table (quoted inputs aside), and a reason quotes only the matched
  dispatch phrase, never the whole prompt;
- the standalone INTEGRATION.md states the runner's packed inputs, and the rendered runner keeps
  exactly that contract;
- writing progress.md quotes the line numbers of the file as written, even when our section's new
  length moves the foreign lines after it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
from pathlib import Path

import pytest
import torch
from model_infer_kvcache.analyzer import cli
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.decisions_table import CONFIRM_DEFAULT, decision_rows, decisions_markdown
from model_infer_kvcache.analyzer.progress_writer import markers
from model_infer_kvcache.implementer.render import (
    INTEGRATION_FILE,
    RUNNER_FILE,
    render_manifest,
    write_rendered,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "fixtures" / "configs"
QWEN3 = str(CONFIGS / "qwen3_8b.json")
CJK = re.compile(r"[\u3000-\u303f\u4e00-\u9fff\uff00-\uffef]")
BEGIN, END = markers("analyze")


def _row(m, label: str) -> tuple[str, str, str]:
    return next(r for r in decision_rows(m) if r[0] == label)


def test_default_sourced_decisions_ask_the_agent_to_confirm(tmp_path):
    m = analyze(AnalyzeRequest(config=QWEN3))
    assert (m.deploy_mode.source, m.parallel.attn_tp_source.startswith("default")) == ("default", True)
    for label, flag in (("部署模式", "--deploy-mode"), ("每卡 heads", "--attn-tp-size")):
        reason = _row(m, label)[2]
        assert CONFIRM_DEFAULT in reason and flag in reason and "read progress.md yourself" in reason
    stated = analyze(AnalyzeRequest(config=QWEN3, deploy_mode="standalone", attn_tp_size=2))
    assert not any(CONFIRM_DEFAULT in r[2] for r in decision_rows(stated))
    p = tmp_path / "progress.md"
    p.write_text("部署模式：框架部署\nattention TP 4\n", encoding="utf-8")
    from_file = analyze(AnalyzeRequest(config=QWEN3, progress=str(p)))
    assert not any(CONFIRM_DEFAULT in r[2] for r in decision_rows(from_file))


@pytest.mark.parametrize("config, kwargs", [
    ("qwen3_8b.json", {}),
    ("qwen3_8b.json", {"kv_mode": "legacy", "hbm_gb": 64.0}),
    ("gemma2_9b.json", {"deploy_mode": "standalone"}),
    ("deepseek_v3.json", {"attn_tp_size": 8, "hbm_gb": 64.0}),
    ("gpt_oss_20b.json", {"framework_api": "G1"}),
    ("qwen3_next.json", {}),
    ("llama4_scout.json", {"dispatch": "部署模式：独立部署"}),
])
def test_reasons_are_english_apart_from_quoted_inputs(config, kwargs):
    m = analyze(AnalyzeRequest(config=str(CONFIGS / config), **kwargs))
    for label, _value, reason in decision_rows(m):
        unquoted = re.sub(r"'[^']*'", "", reason)
        assert not CJK.search(unquoted), (label, reason)


def test_a_reason_quotes_the_dispatch_phrase_not_the_prompt():
    prompt = ("你是迁移助手。请把 Qwen3-8B 迁移到昇腾，" * 20 + "部署模式：独立部署，卡数 8，精度对齐后提交。"
              + "其余要求见附件。" * 20)  # one long line
    m = analyze(AnalyzeRequest(config=QWEN3, dispatch=prompt))
    reason = _row(m, "部署模式")[2]
    assert m.deploy_mode.value == "standalone"
    assert reason == "source dispatch: dispatch line '部署模式：独立部署'"
    assert m.inputs.dispatch == "部署模式：独立部署"
    long_value = "部署模式: 独立部署" + "（说明）" * 40
    quoted = analyze(AnalyzeRequest(config=QWEN3, dispatch=long_value)).inputs.dispatch
    assert len(quoted) <= 40 and quoted.startswith("部署模式: 独立部署")


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"rendered_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_standalone_integration_states_the_packed_inputs_the_runner_expects(tmp_path):
    m = analyze(AnalyzeRequest(config=str(ROOT / "examples" / "tiny_qwen3" / "config.json"),
                               deploy_mode="standalone"))
    rendered = render_manifest(m)
    doc = rendered.files[INTEGRATION_FILE]
    assert "`ForwardMetaData` carries no token ids and no positions" in doc
    assert "`position_ids = forward_metadata.kv_len[row] + offset`" in doc
    assert "1-D `[T]`" in doc and "`position_ids = cat(arange(prompt_len) for each row)`" in doc
    assert "`position_ids = self.kv_len[rows]` read before `_advance_kv_len`" in doc

    write_rendered(rendered, tmp_path)
    runner_cls = _load(tmp_path / RUNNER_FILE).KVCacheRunnerMixin
    runner = type("Runner", (runner_cls,), {})()
    attn = [type("A", (), {})() for _ in range(2)]
    runner._init_kvcache(attn, batch_size=3, max_seq_len=300)

    def check(rows, fm, position_ids):
        # the documented positions are the ones the runner's slots were built from, token by token
        want = torch.cat([row * runner.max_seq_len + p for row, p in
                          zip(rows, torch.split(position_ids, fm.actual_seq_lengths_q.tolist()), strict=True)])
        assert torch.equal(fm.slot_mapping.long(), want.long())
        offsets = torch.cat([torch.arange(int(n)) for n in fm.actual_seq_lengths_q])
        assert torch.equal(torch.repeat_interleave(fm.kv_len, fm.actual_seq_lengths_q) + offsets, position_ids)

    rows, lens = [2, 0], [5, 3]
    fm = runner._build_forward_metadata(rows, lens)
    prefill_pos = torch.cat([torch.arange(n) for n in lens])  # 1-D [T], T = sum(prompt_lens)
    assert prefill_pos.shape == (sum(lens),)
    check(rows, fm, prefill_pos)
    runner._advance_kv_len(rows, fm)
    for _ in range(3):
        fm = runner._build_forward_metadata(rows)
        decode_pos = runner.kv_len[torch.tensor(rows)].clone()  # read before _advance_kv_len
        check(rows, fm, decode_pos)
        runner._advance_kv_len(rows, fm)
    assert runner.kv_len[torch.tensor(rows)].tolist() == [8, 6]


def _write(path: Path, *flags: str) -> str:
    args = cli.build_parser().parse_args(["--config", QWEN3, "--progress", str(path), "--format", "json",
                                          "--write-progress", str(path), *flags])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.run(args) == 0
    return out.getvalue()


def test_line_numbers_after_our_section_are_those_of_the_file_as_written(tmp_path):
    """A stale one-line section above the facts: the new, longer section moves them down."""
    import json

    p = tmp_path / "progress.md"
    p.write_text(f"# 进度\n\n{BEGIN}\nold\n{END}\n\n部署模式：独立部署\n- attn_tp_size: 2\n", encoding="utf-8")
    manifest = json.loads(_write(p))
    once = p.read_bytes()
    lines = once.decode("utf-8").split("\n")
    sources = manifest["inputs"]["progress_sources"]
    for label, phrase in (("部署模式", "部署模式：独立部署"), ("attn_tp_size", "- attn_tp_size: 2")):
        where, quoted = sources[label].split(": ", 1)
        line = int(where.rsplit(":", 1)[1])
        assert lines[line - 1] == phrase == quoted  # the line named is the line in the file as written
    assert json.loads(_write(p)) == manifest and p.read_bytes() == once
    assert decisions_markdown(analyze(AnalyzeRequest(config=QWEN3, progress=str(p)))) in once.decode("utf-8")
