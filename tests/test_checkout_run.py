"""The checkout mode: a cann-recipes-infer model file in the checkout's own engine, on CPU, vs transformers.

Runs against the pinned public snapshot (``tests/shared_dirs.upstream_head``; skipped with the reason
when it is absent). Each end-to-end test drives the checkout's registry, DefaultModelLoader + the
model's ``load_weights``, Scheduler and ExecutionEngine; the assertions read the report the CLI prints.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from checkout_support import ORACLE
from shared_dirs import ROOT, upstream_head

CONFIGS = ROOT / "tests" / "fixtures" / "configs"


def _validate(model: str, config: str, **kw):
    from model_infer_kvcache.validators.checkout_run import CheckoutRequest, validate_checkout

    # the transformers oracle alone: these tests are not about the recompute oracle (tests/checkout_support.py)
    return validate_checkout(CheckoutRequest(str(upstream_head()), model, str(CONFIGS / config),
                                             **{"oracle": ORACLE, **kw}))


def _check(report, prefix: str):
    return next(c for c in report.checks if c.name.startswith(prefix) or c.name.split(": ", 1)[-1].startswith(prefix))


def _assert_end_to_end(report, requests: int = 6):
    failed = [(c.name, c.detail or c.measured) for c in report.failed()]
    assert report.passed, failed
    for check in report.checks:
        name = check.name.split(": ", 1)[-1]
        if name.startswith("logits vs transformers"):
            assert check.measured["max_abs_diff"] <= 1e-4
            assert check.measured["steps"] >= 8 and check.measured["requests"] == requests
        if name.startswith("decode padded"):
            assert check.measured["padded_steps"] > 0  # the engine padded decode batches
    assert report.dtype == "float32" and report.tolerance == 1e-4


@pytest.fixture(scope="module")
def qwen3_report():
    return _validate("qwen3_8b", "qwen3_8b.json", sweep_readings=False)


@pytest.mark.slow
def test_qwen3_8b_in_the_real_engine(qwen3_report):
    _assert_end_to_end(qwen3_report)
    prov = qwen3_report.provenance
    assert prov["checkout"] == str(upstream_head().resolve())
    assert prov["api_generation"] == "G3"
    assert prov["model_file"].endswith("models/qwen/models/modeling_qwen.py")
    # The config.json has no use_qk_norm; the folder's Qwen3Config sets it (the model reads it with default False,
    # so read through transformers' class the q/k norms would be off and V301 would fail): the report says which.
    assert "use_qk_norm" not in (CONFIGS / "qwen3_8b.json").read_text(encoding="utf-8")
    assert prov["config_class"].startswith("models.qwen.models.configuration_qwen.Qwen3Config: ")
    # The engine, scheduler, loader and kv_cache are the checkout's, not the harness's.
    for module in ("executor.core.engine.execution_engine", "executor.core.scheduler.scheduler",
                   "executor.model_loader.default_loader", "executor.core.kv_cache.kv_cache_manager",
                   "models.qwen.models.modeling_qwen"):
        assert module in prov["from_checkout"]
    assert any("gloo" in s for s in prov["stand_ins"])
    assert "CPU 仿真算子 + 检出的真实框架与模型文件" in qwen3_report.to_markdown()  # not "our harness"
    assert not any("reads a config.json of model_type" in n for n in qwen3_report.notes)
    # The init link covers the real layer count (36), not only the tiny model's layers.
    assert _check(qwen3_report, "get_cache_info layer count").measured == {"expected": 36, "got": 36}
    assert _check(qwen3_report, "the checkout's loader filled every parameter").passed


@pytest.mark.slow
def test_scope_leaves_nothing_behind(qwen3_report):
    """After a run: no checkout module imported, no torch_npu, sys.path as before, nothing written."""
    import torch

    assert not [m for m in sys.modules if m.split(".")[0] in ("executor", "models", "module")]
    assert "torch_npu" not in sys.modules and "npu" not in torch.__dict__
    assert str(upstream_head().resolve()) not in sys.path
    assert not list(upstream_head().glob("models/qwen/**/__pycache__"))


@pytest.mark.slow
def test_qwen3_8b_attention_tp2():
    report = _validate("qwen3_8b", "qwen3_8b.json", attn_tp_size=2)
    _assert_end_to_end(report)
    assert {c.name.split(":")[0] for c in report.checks} == {"rank 0", "rank 1"}
    assert report.notes[0].startswith("layout: 2 gloo ranks (attention TP 2, MoE TP 2, MoE EP 1), --attn-tp-size; ")
    assert report.notes[1].startswith("attention TP 2: 16 query / 4 KV heads per rank")


def _short_stream():
    from dataclasses import replace

    from model_infer_kvcache.validators.checkout_run import ENGINE_QUICK

    return replace(ENGINE_QUICK, release_requests=1)


@pytest.mark.slow
def test_qwen25_7b_instruct():
    report = _validate("qwen25_7b_instruct", "qwen2_7b.json", sweep_readings=False, scenario=_short_stream())
    _assert_end_to_end(report, requests=4)
    assert "Qwen2Config" in report.provenance["model"]


@pytest.mark.slow
def test_qwen3_moe_runs_at_attention_tp2_because_its_code_refuses_one_rank():
    """Qwen3-MoE's MoE runs the TP path (moe_tp_size = attn TP); at one rank its EP path needs an EP group
    the model registers only for EP > 1. Left to kvcache (no --attn-tp-size), the layout is chosen from what the
    model's code refuses: the one-rank attempt stops at the model's own line, the judged run is TP 2 (both ranks
    compared), and the report says which layout ran, why, and what the folder's yamls serve."""
    report = _validate("qwen3_moe", "qwen3_30b_a3b.json")
    _assert_end_to_end(report)
    assert re.match(r"layout: 2 gloo ranks \(attention TP 2, MoE TP 2, MoE EP 1\), chosen by kvcache: at one rank "
                    r"the model refused, modeling_qwen3_moe\.py:\d+: KeyError: .*'moe_ep_group' not found.* \(the "
                    r"model registers that group only with more than one rank\); its \d+ yamls serve world_size ",
                    report.notes[0]), report.notes[0]
    layout = report.provenance["layout"]
    assert layout["attn_tp_size"] == 2 and layout["chosen_by"] == "kvcache"
    assert layout["one_rank_refused_at"].startswith("modeling_qwen3_moe.py:")
    assert _check(report, "the checkout's loader filled every parameter").passed  # per-expert checkpoint layout


@pytest.mark.slow
def test_gpt_oss_states_the_window_reading_it_depends_on():
    """Upstream gpt-oss passes pre_tokens = W: under the assumed (exclusive) reading it attends one key too
    many once a sequence crosses the window, and the report says it passes (every check of the sweep's
    run, numeric included) under the inclusive reading."""
    report = _validate("gpt_oss", "gpt_oss_20b.json")
    assert not report.passed
    numeric = _check(report, "logits vs transformers")
    assert not numeric.passed and numeric.measured["longest_prefill"] > 128 + 2 * 128  # crossed the window
    assert all(c.passed for c in report.checks if c.link == "init")
    assert "under window_pre_tokens=inclusive the model survives" in report.notes
    assert any("depends on the device reading window_pre_tokens: it passes under inclusive and fails under "
               "exclusive" in n for n in report.notes)


@pytest.mark.slow
def test_deepseek_r1_attention_tp2():
    """DeepSeek-V3 config at attention TP 2 (MoE TP path; at one rank its decode dispatch needs an HCCL
    name of an EP group registered only for EP > 1). Its MoE's device question is fixed at the reading the
    model needs; the sweep over it runs on the same file with DeepSeek-V2-Lite's 16 heads (below), at a
    fraction of 128 heads' cost."""
    report = _validate("deepseek_r1", "deepseek_v3.json", attn_tp_size=2, scenario=_short_stream(),
                       sweep_readings=False, readings=(("finalize_skip1_alone", "added"),))
    _assert_end_to_end(report, requests=4)
    assert report.consulted == ["finalize_skip1_alone"] and report.readings["finalize_skip1_alone"] == "added"


@pytest.fixture(scope="module")
def deepseek_v2_lite_report():
    """A registered key outside the acceptance list: support_models maps deepseek_v2_lite onto the
    deepseek_r1 model file with a DeepSeek-V2-Lite config (no q LoRA, 64 softmax-gated experts, no YaRN,
    no MTP); the reference is transformers' DeepseekV2. Attention TP 2, with the reading sweep over both ranks."""
    return _validate("deepseek_v2_lite", "deepseek_v2_lite.json", attn_tp_size=2, scenario=_short_stream())


@pytest.mark.slow
def test_deepseek_v2_lite_through_the_deepseek_file(deepseek_v2_lite_report):
    """Same file as deepseek_r1, other config: it validates too."""
    report = deepseek_v2_lite_report
    _assert_end_to_end(report, requests=4)
    assert report.readings["finalize_skip1_alone"] == "added"
    assert report.provenance["model_file"].endswith("models/deepseek_r1/models/modeling_deepseek.py")
    assert report.model_type == "deepseek_v2"  # the transformers reference is DeepseekV2
    # legitimate here, and said: the registered config class reads another model type's config.json
    assert "the checkout's DeepseekV3Config (model_type 'deepseek_v3') reads a config.json of model_type " \
           "'deepseek_v2': check --model and --config belong together" in report.notes


@pytest.mark.slow
def test_the_deepseek_file_states_the_finalize_reading_it_depends_on(deepseek_v2_lite_report):
    """Upstream's three MoE paths call npu_moe_finalize_routing(skip1=shared experts, skip2=None)
    (modeling_deepseek.py:565, 640, 712), which the torch-npu 2.9.0 doc forbids: the run consults that device
    question, the sweep reruns both ranks under its other readings, and the report says the model needs
    "added" (dropping skip1 loses the shared experts; refusing it stops the prefill)."""
    report = deepseek_v2_lite_report
    assert report.consulted == ["finalize_skip1_alone"]
    notes = report.notes
    ignored = next(n for n in notes if n.startswith("under finalize_skip1_alone=ignored"))
    assert "the model fails" in ignored and "logits vs transformers" in ignored
    rejected = next(n for n in notes if n.startswith("under finalize_skip1_alone=rejected"))
    # the TP path (attention TP 2) is the one that runs: named by the model's own file:line
    assert re.search(r"modeling_deepseek\.py:640: NpuOpError: npu_moe_finalize_routing: argument 'skip2'", rejected)
    assert ("the model depends on the device reading finalize_skip1_alone: it passes under added and fails "
            "under ignored, rejected (references/device_questions.md)") in notes


def _edited_copy(tmp_path: Path, old: str, new: str) -> Path:
    src = upstream_head() / "models" / "qwen" / "models" / "modeling_qwen.py"
    text = src.read_text(encoding="utf-8")
    assert old in text
    copy = tmp_path / "modeling_qwen.py"
    copy.write_text(text.replace(old, new, 1), encoding="utf-8")
    return copy


@pytest.mark.slow
def test_unemulated_op_fails_in_one_line(tmp_path):
    """An edited copy calling an op the emulation lacks: the CLI exits 1 with one line naming the op and
    the model file:line, never a traceback."""
    copy = _edited_copy(tmp_path, "torch_npu.npu_rms_norm(", "torch_npu.npu_rms_norm_v9(")
    line = next(i for i, t in enumerate(copy.read_text().splitlines(), 1) if "npu_rms_norm_v9" in t)
    out = subprocess.run(
        [sys.executable, "-m", "model_infer_kvcache", "validate", "--framework-root", str(upstream_head()),
         "--model", "qwen3_8b", "--config", str(CONFIGS / "qwen3_8b.json"), "--model-file", str(copy),
         "--no-sweep"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    failed = [ln for ln in out.stderr.splitlines() if ln.startswith("FAILED")]
    assert len(failed) == 1
    assert "npu_rms_norm_v9" in failed[0] and f"modeling_qwen.py:{line}" in failed[0]


@pytest.mark.slow
def test_moe_model_at_one_rank_fails_naming_the_upstream_group_and_the_way_out():
    """Upstream Qwen3-MoE at world size 1 takes its expert-parallel MoE path, whose group it registers only
    for EP > 1 (on an NPU too): the report names the missing group, the model's line, and --attn-tp-size 2."""
    report = _validate("qwen3_moe", "qwen3_30b_a3b.json", sweep_readings=False, scenario=_short_stream(),
                       attn_tp_size=1)  # the user's layout: kept, and the way out named
    failed = report.failed()
    assert [c.name for c in failed] == ["checkout model runs in the engine without errors"]
    assert re.match(r"modeling_qwen3_moe\.py:\d+: KeyError: .*'moe_ep_group' not found", failed[0].detail)
    assert failed[0].detail.endswith("validate with --attn-tp-size 2, which runs its MoE tensor-parallel path)")


def test_a_model_file_that_does_not_parse_is_named_at_its_line(tmp_path):
    copy = _edited_copy(tmp_path, "class QwenAttention(", "class QwenAttention(:")
    line = next(i for i, t in enumerate(copy.read_text().splitlines(), 1) if "class QwenAttention(:" in t)
    report = _validate("qwen3_8b", "qwen3_8b.json", model_file=str(copy), sweep_readings=False)
    failed = report.failed()
    assert [c.name for c in failed] == ["checkout model runs in the engine without errors"]
    assert failed[0].detail.startswith(f"modeling_qwen.py:{line}: SyntaxError:"), failed[0].detail


def test_checkout_scope_restores_the_process():
    from model_infer_kvcache.validators.checkout_run.scope import checkout_scope

    root = upstream_head().resolve()
    path_before = list(sys.path)
    with checkout_scope(root) as scope:
        from executor.core.support_models import load_model_classes

        model_cls, config_cls = load_model_classes("qwen3_8b")
        assert model_cls.__module__ == "models.qwen.models.modeling_qwen"
        assert "executor.core.engine.execution_engine" in scope.modules_from_checkout()
        assert "torch_npu" in sys.modules
    assert sys.path == path_before
    assert not [m for m in sys.modules if m.split(".")[0] in ("executor", "models", "module")]
    assert "torch_npu" not in sys.modules


def test_model_resolves_by_directory_and_by_key():
    from model_infer_kvcache.validators.checkout_run.registry import resolve
    from model_infer_kvcache.validators.checkout_run.scope import checkout_scope

    root = upstream_head().resolve()
    with checkout_scope(root):
        by_key = resolve(root, "qwen25_7b_instruct", "qwen2")
        by_dir = resolve(root, "qwen", "qwen3")
        assert by_key.registered and not by_dir.registered
        assert by_key.model_cls is by_dir.model_cls  # the same QwenForCausalLM
        assert (by_key.config_cls.__name__, by_dir.config_cls.__name__) == ("Qwen2Config", "Qwen3Config")


@pytest.mark.parametrize("argv, flag", [
    (["--model", "qwen3_8b", "--config", "CFG"], "--model"),  # no --framework-root
    (["--model", "nope", "--framework-root", "ROOT", "--config", "CFG"], "--model"),
    # registered in support_models.py, but models/glm_5/ is not in the snapshot
    (["--model", "glm_5", "--framework-root", "ROOT", "--config", "CFG"], "--model"),
    (["--model", "qwen3_8b", "--framework-root", "ROOT", "--config", "CFG", "--rendered", "x"], "--rendered"),
    (["--model", "qwen3_8b", "--framework-root", "ROOT", "--config", "CFG", "--model-file", "/no/such.py"],
     "--model-file"),
    (["--config", "CFG", "--model-file", "x.py"], "--model-file"),
    (["--model", "qwen3_8b", "--framework-root", "/tmp", "--config", "CFG"], "--framework-root"),
])
def test_checkout_mode_bad_input_is_one_line_exit_2(argv, flag, tmp_path):
    argv = [a.replace("ROOT", str(upstream_head())).replace("CFG", str(CONFIGS / "qwen3_8b.json")) for a in argv]
    report = tmp_path / "r.json"
    out = subprocess.run([sys.executable, "-m", "model_infer_kvcache", "validate", *argv, "--report", str(report)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 2, out.stderr[-1500:]
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and flag in lines[0], out.stderr
    assert "Traceback" not in out.stderr and not report.exists()


def test_run_passes_model_through_and_refuses_it_alone(tmp_path):
    """`kvcache run --model` needs --framework-root (exit 2, one line, --out untouched)."""
    out_dir = tmp_path / "out"
    out = subprocess.run([sys.executable, "-m", "model_infer_kvcache", "run", "--model", "qwen3_8b", "--out", str(out_dir)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 2 and "--model" in out.stderr and "Traceback" not in out.stderr
    assert not out_dir.exists()
