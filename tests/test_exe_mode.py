"""The framework's execution mode for decode (issue 39, step 1): stated by --exe-mode or progress.md, planned with
what a captured decode step must do (each with its source), and refused by name at render, whose templates write
eager decode only: a graph-mode user never receives eager code that would break the capture or replay one step's
lengths for every later step."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.implementer.render import render_manifest
from shared_dirs import ROOT

CONFIGS = ROOT / "tests" / "fixtures" / "configs"
QWEN3 = CONFIGS / "qwen3_8b.json"


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "model_infer_kvcache", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def test_graph_modes_are_planned_with_their_consequences_and_sources():
    ex = analyze(AnalyzeRequest(config=str(QWEN3), exe_mode="npugraph_ex")).exe_mode
    assert ex.value == "npugraph_ex" and ex.source == "--exe-mode"
    text = " ".join(ex.consequences)
    assert "actual_seq_lengths_list_kv" in text and "SymInt[]" in text and "_pad_batch" in text
    assert "torchair.ops" not in text
    ge = analyze(AnalyzeRequest(config=str(QWEN3), exe_mode="ge_graph")).exe_mode
    assert any("torchair.ops" in c for c in ge.consequences) and not any("SymInt[]" in c for c in ge.consequences)
    # a model served with MTP captures its verify steps at one width too
    mtp = analyze(AnalyzeRequest(config=str(CONFIGS / "deepseek_v3.json"), exe_mode="npugraph_ex", next_n=3))
    assert any("1 + 3 tokens" in c for c in mtp.exe_mode.consequences)


def test_progress_md_states_the_mode_and_a_wrong_one_is_named_by_line(tmp_path):
    progress = tmp_path / "progress.md"
    progress.write_text("# Qwen3 migration\n\n- 部署模式: 框架部署\n- exe_mode: ge_graph\n", encoding="utf-8")
    m = analyze(AnalyzeRequest(config=str(QWEN3), progress=str(progress)))
    assert m.exe_mode.value == "ge_graph" and m.exe_mode.source.endswith("progress.md:4")
    # the flag wins over progress.md
    assert analyze(AnalyzeRequest(config=str(QWEN3), progress=str(progress), exe_mode="eager")).exe_mode.value == "eager"
    progress.write_text("- exe_mode: graph\n", encoding="utf-8")
    with pytest.raises(InputError) as err:
        analyze(AnalyzeRequest(config=str(QWEN3), progress=str(progress)))
    assert "progress.md:1" in err.value.render() and "npugraph_ex" in err.value.render()


def test_an_unstated_mode_leaves_the_manifest_as_it_was_and_eager_renders():
    plain = analyze(AnalyzeRequest(config=str(QWEN3)))
    assert plain.exe_mode is None and '"exe_mode"' not in plain.to_json()
    eager = analyze(AnalyzeRequest(config=str(QWEN3), exe_mode="eager"))
    assert eager.exe_mode.consequences == []
    code = render_manifest(eager).files["kvcache_attention.py"].splitlines()[1:]
    assert code == render_manifest(plain).files["kvcache_attention.py"].splitlines()[1:]  # only the hash line differs


@pytest.mark.parametrize("mode", ["npugraph_ex", "ge_graph"])
def test_render_refuses_graph_mode_decode_by_name(mode):
    with pytest.raises(InputError) as err:
        render_manifest(analyze(AnalyzeRequest(config=str(QWEN3), exe_mode=mode)))
    assert err.value.field == "exe_mode" and f"{mode} decode" in err.value.render()
    assert "eager decode only" in err.value.render()


def test_run_with_a_graph_mode_exits_2_in_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    proc = _cli("run", "--config", str(QWEN3), "--exe-mode", "npugraph_ex", "--out", str(out))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and not out.exists(), proc.stderr
    assert lines[-1].startswith("error: ") and "not supported by kvcache: npugraph_ex decode" in lines[-1]
    manifest = tmp_path / "m.json"
    assert _cli("analyze", "--config", str(QWEN3), "--exe-mode", "npugraph_ex", "--out", str(manifest)).returncode == 0
    assert json.loads(manifest.read_text(encoding="utf-8"))["exe_mode"]["value"] == "npugraph_ex"
