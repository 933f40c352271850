"""Upstream model folders' npugraph_ex decode in the real engine on CPU (issue 39, step 5): the checkout's engine
compiles decode as it does on the device (executor/utils/graph_utils.py, backend "npugraph_ex"), the compile reaches
kvcache's capture recorder, and the run reports what the capture found: a pass, a named finding with the model's
line, or (exit 2) the operator kvcache cannot capture yet."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from checkout_support import ORACLE
from shared_dirs import ROOT, upstream_head

pytestmark = pytest.mark.slow

QWEN3 = ROOT / "tests" / "fixtures" / "configs" / "qwen3_8b.json"


def _validate(model: str, config, **kw):
    from model_infer_kvcache.validators.checkout_run import CheckoutRequest, validate_checkout

    return validate_checkout(CheckoutRequest(str(upstream_head()), model, str(config),
                                             **{"exe_mode": "npugraph_ex", "sweep_readings": False, "oracle": ORACLE,
                                                **kw}))


def _by_id(report, check_id: str) -> list:
    return [c for c in report.checks if c.id == check_id]


def test_qwen_npugraph_ex_branch_captures_once_and_replays_the_stream():
    report = _validate("qwen", QWEN3)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    capture, again = _by_id(report, "V228")[0], _by_id(report, "V229")[0]
    assert capture.measured["captures"] == 1 and "npugraph_ex" in capture.name
    replays = int(again.name.split(" over ")[1].split()[0])
    assert replays >= 40, again.name  # the stream and the release run replay the warm-up's capture


def test_qwen_ge_graph_branch_captures_static_with_torchair_attention():
    """ge_graph, as qwen's yamls serve it: decode compiled static through torchair's backend, FA from torchair.ops
    with its lengths as tensors (read on the device: nothing host-side changes between replays)."""
    report = _validate("qwen", QWEN3, exe_mode="ge_graph")
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    capture, again = _by_id(report, "V228")[0], _by_id(report, "V229")[0]
    assert capture.measured["captures"] == 1 and "ge_graph, dynamic=False" in capture.name
    assert int(again.name.split(" over ")[1].split()[0]) >= 40, again.name


def test_torch_npu_attention_left_in_the_ge_graph_branch_is_named_at_its_line(tmp_path):
    """qwen's ge_graph decode switched back to torch.ops.npu: its FA takes host ints, the branch hands it the length
    tensors: read back on the host inside the static graph."""
    src = (upstream_head() / "models/qwen/models/modeling_qwen.py").read_text(encoding="utf-8")
    old = "            fa_ops = torchair.ops\n"
    assert src.count(old) == 1
    copy = tmp_path / "modeling_qwen.py"
    copy.write_text(src.replace(old, "            fa_ops = torch.ops.npu\n"), encoding="utf-8")
    lines = copy.read_text(encoding="utf-8").splitlines()
    line = next(i for i, text in enumerate(lines, 1) if "attn_output, _ = fa_ops.npu_fused_infer_attention" in text)
    capture = _by_id(_validate("qwen", QWEN3, exe_mode="ge_graph", model_file=str(copy)), "V228")[0]
    assert not capture.passed and f"modeling_qwen.py:{line}" in capture.detail, capture.detail
    assert "a device tensor given for host ints: actual_seq_qlen=" in capture.detail


def test_qwen3_moe_at_attention_tp_2_captures_its_moe_decode(tmp_path):
    import transformers

    config = tmp_path / "config.json"
    config.write_text(transformers.Qwen3MoeConfig().to_json_string(), encoding="utf-8")
    report = _validate("qwen3_moe", config)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert [c.name.split(":")[0] for c in _by_id(report, "V228")] == ["rank 0", "rank 1"]


def test_a_host_read_in_the_models_graph_branch_is_named_at_its_line(tmp_path):
    """The npugraph_ex branch reading the KV lengths back from the device tensor (.tolist()) instead of taking the
    engine's host list: right in eager, a sync the captured graph cannot replay."""
    src = (upstream_head() / "models/qwen/models/modeling_qwen.py").read_text(encoding="utf-8")
    old = "            actual_seq_kvlen = forward_metadata.actual_seq_lengths_list_kv\n"
    assert src.count(old) == 1
    new = "            actual_seq_kvlen = forward_metadata.actual_seq_lengths_kv.tolist()\n"
    copy = tmp_path / "modeling_qwen.py"
    copy.write_text(src.replace(old, new), encoding="utf-8")
    line = next(i for i, text in enumerate(copy.read_text(encoding="utf-8").splitlines(), 1) if new.strip() in text)
    report = _validate("qwen", QWEN3, model_file=str(copy))
    capture = _by_id(report, "V228")[0]
    assert not capture.passed and f"modeling_qwen.py:{line}" in capture.detail, capture.detail
    assert "reads a device value on the host" in capture.detail


def test_a_device_tensor_for_fa_host_lengths_is_named_at_the_models_line(tmp_path):
    """gpt_oss (served eager by its yamls) gives FA its lengths as device tensors on decode: the operator's SymInt[]
    reads them back on the host, fine in eager, a sync no captured graph replays. Named with the argument and the
    model's line, with the note that graph mode is not how the folder is served."""
    import transformers

    config = tmp_path / "config.json"
    config.write_text(transformers.GptOssConfig().to_json_string(), encoding="utf-8")
    report = _validate("gpt_oss", config)
    capture = _by_id(report, "V228")[0]
    src = (upstream_head() / "models/gpt_oss/models/modeling_gpt_oss.py").read_text(encoding="utf-8").splitlines()
    line = next(i for i, text in enumerate(src, 1) if "attn_output, attn_weights = torch.ops.npu.npu_fused_infer"
                "_attention_score_v2(" in text and i > next(j for j, t in enumerate(src, 1) if "# decode phase" in t))
    assert not capture.passed and f"modeling_gpt_oss.py:{line}" in capture.detail, capture.detail
    assert "a device tensor given for host ints: actual_seq_qlen= of torch_npu.npu_fused_infer_attention_score_v2" \
        in capture.detail
    assert any("serve exe_mode eager; npugraph_ex is not among them" in n for n in report.notes), report.notes


def test_an_operator_without_a_shape_rule_is_kvcache_s_gap_exit_2(tmp_path):
    """A capture that reaches an operator kvcache has no shape rule for stops with one line naming it (exit 2),
    never blamed on the model: here the model's decode calls npu_geglu, which the emulation has and the capture
    does not."""
    src = (upstream_head() / "models/qwen/models/modeling_qwen.py").read_text(encoding="utf-8")
    old = "        key_states, value_states = k_cache, v_cache\n"
    assert src.count(old) == 1
    copy = tmp_path / "modeling_qwen.py"
    copy.write_text(src.replace(old, old + "        if not is_prefill:\n"
                                          "            query_states = query_states + 0 * torch_npu.npu_geglu("
                                          "query_states.repeat(1, 1, 2))[0]\n"), encoding="utf-8")
    from model_infer_kvcache.analyzer.errors import NotSupportedByKvcache

    with pytest.raises(NotSupportedByKvcache) as err:  # exit 2 at the CLI, nothing written
        _validate("qwen", QWEN3, model_file=str(copy))
    line = err.value.render()
    assert "not supported by kvcache: capturing torch_npu.npu_geglu" in line and "modeling_qwen.py:" in line, line


def test_exe_mode_applies_to_one_checkout_model_only(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "model_infer_kvcache", "validate", *args],
                              capture_output=True, text=True, cwd=ROOT, timeout=300)

    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps({}), encoding="utf-8")
    rendered = run("--manifest", str(manifest), "--rendered", str(tmp_path), "--config", str(QWEN3),
                   "--exe-mode", "npugraph_ex")
    assert rendered.returncode == 2 and "--exe-mode" in rendered.stderr and "checkout mode" in rendered.stderr
    every = run("--framework-root", str(upstream_head()), "--all", "--exe-mode", "npugraph_ex")
    assert every.returncode == 2 and "--exe-mode" in every.stderr


def test_a_static_graph_bakes_the_host_lists_and_the_recapture_names_them():
    """The same qwen branch under a yaml's enable_dynamic_graph False: the compile takes the host-list lengths as
    constants, so the next step's lengths fail the first capture's guard (on the device, with the guards skipped by
    enable_cache_compile, the first step's lengths would be replayed): V229 names the list and the model's line."""
    report = _validate("qwen", QWEN3, static_graph=True)
    again = _by_id(report, "V229")[0]
    src = (upstream_head() / "models/qwen/models/modeling_qwen.py").read_text(encoding="utf-8").splitlines()
    assert not again.passed and "actual_seq_lengths_list_kv" in again.detail, again.detail
    line = int(again.detail.rsplit("modeling_qwen.py:", 1)[1].split()[0])
    assert "npu_fused_infer_attention_score" in src[line - 1], src[line - 1]  # where the captured list is consumed
    assert "dynamic=False" in _by_id(report, "V228")[0].name
