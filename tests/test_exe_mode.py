"""The framework's execution mode for decode (issue 39): stated by --exe-mode or progress.md, planned with what a
captured decode step must do (each with its source). npugraph_ex decode is rendered for GQA/MHA and MLA (its capture
is validated in test_graph_capture.py); everything the templates cannot capture is refused by name at render: a
graph-mode user never receives eager code that would break the capture or replay one step's lengths for every later
step."""

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


@pytest.mark.parametrize("config,options,why", [
    ("qwen3_next", {"exe_mode": "ge_graph"}, "linear-attention states"),
    ("deepseek_v32", {"exe_mode": "npugraph_ex"}, "DSA layers"),
    ("qwen3_next", {"exe_mode": "npugraph_ex"}, "linear-attention states"),
    ("qwen3_8b", {"exe_mode": "npugraph_ex", "kv_mode": "legacy"}, "Legacy"),
])
def test_render_refuses_what_it_cannot_capture_by_name(config, options, why):
    with pytest.raises(InputError) as err:
        render_manifest(analyze(AnalyzeRequest(config=str(CONFIGS / f"{config}.json"), **options)),
                        allow_blocked=True)
    assert err.value.field == "exe_mode" and f"{options['exe_mode']} decode" in err.value.render()
    assert why in err.value.render() and "not supported by kvcache" in err.value.render()


def test_graph_modes_render_gqa_and_mla_in_both_modes():
    for config in ("qwen3_8b", "deepseek_v2_lite"):
        for mode in ("framework", "standalone"):
            for exe_mode in ("npugraph_ex", "ge_graph"):
                files = render_manifest(analyze(AnalyzeRequest(config=str(CONFIGS / f"{config}.json"),
                                                               exe_mode=exe_mode, deploy_mode=mode))).files
                code = files["kvcache_attention.py"]
                # npugraph_ex: host-list lengths through torch_npu; ge_graph: torchair.ops with the length tensors
                assert ("def fa_lengths(forward_metadata):" in code) == (exe_mode == "npugraph_ex")
                assert ("import torchair" in code and "= fa_ops(forward_metadata).npu_fused_infer_attention_score"
                        in code) == (exe_mode == "ge_graph")
                if mode == "standalone":
                    runner = files["kvcache_runner.py"]
                    assert "def _padded_decode_metadata(" in runner
                    assert ("actual_seq_lengths_list_kv=kv_lens.tolist()" in runner) == (exe_mode == "npugraph_ex")


def test_run_of_a_graph_mode_it_cannot_capture_exits_2_in_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    hybrid = CONFIGS / "qwen3_next.json"
    proc = _cli("run", "--config", str(hybrid), "--exe-mode", "ge_graph", "--out", str(out))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and not out.exists(), proc.stderr
    assert lines[-1].startswith("error: ") and "not supported by kvcache: ge_graph decode" in lines[-1]
    manifest = tmp_path / "m.json"
    assert _cli("analyze", "--config", str(hybrid), "--exe-mode", "ge_graph", "--out", str(manifest)).returncode == 0
    assert json.loads(manifest.read_text(encoding="utf-8"))["exe_mode"]["value"] == "ge_graph"


def test_enable_dynamic_graph_is_read_and_a_static_npugraph_ex_is_refused_by_name(tmp_path):
    default = analyze(AnalyzeRequest(config=str(QWEN3), exe_mode="npugraph_ex")).exe_mode
    assert default.dynamic_graph is True and default.dynamic_graph_source == ""  # the framework's default
    assert analyze(AnalyzeRequest(config=str(QWEN3), exe_mode="ge_graph")).exe_mode.dynamic_graph is False
    progress = tmp_path / "progress.md"
    progress.write_text("- exe_mode: npugraph_ex\n- enable_dynamic_graph: False\n", encoding="utf-8")
    stated = analyze(AnalyzeRequest(config=str(QWEN3), progress=str(progress))).exe_mode
    assert stated.dynamic_graph is False and stated.dynamic_graph_source.endswith("progress.md:2")
    assert any("enable_dynamic_graph False" in c for c in stated.consequences)
    flag = analyze(AnalyzeRequest(config=str(QWEN3), exe_mode="npugraph_ex", static_graph=True)).exe_mode
    assert flag.dynamic_graph is False and flag.dynamic_graph_source == "--static-graph"
    with pytest.raises(InputError) as err:
        render_manifest(analyze(AnalyzeRequest(config=str(QWEN3), progress=str(progress))))
    assert "enable_dynamic_graph False" in err.value.render() and "progress.md:2" in err.value.render()
    progress.write_text("- enable_dynamic_graph: sometimes\n", encoding="utf-8")
    with pytest.raises(InputError) as err:
        analyze(AnalyzeRequest(config=str(QWEN3), progress=str(progress)))
    assert "progress.md:1" in err.value.render() and "not true or false" in err.value.render()
