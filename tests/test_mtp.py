"""MTP (DeepSeek-V3 family, one next-n layer): verify-step decode, layer containers, memory plan.

The speculative-decode stream drives the golden DeepSeek-V3 renders through verify steps with
q_len = 2 (framework harness and standalone runner) on the emulated operators, against a causal
transformers forward; the same stream fails on the old decode (sparse_mode 0, no mask).
"""

from __future__ import annotations

import copy
import json
import shutil
import types
from pathlib import Path

import pytest
import torch
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.manifest_io import load_manifest
from model_infer_kvcache.validators.pipeline.report import Report
from model_infer_kvcache.validators.pipeline.request_stream import QUICK
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden" / "deepseek_v3"
CONFIG = ROOT / "tests" / "fixtures" / "configs" / "deepseek_v3.json"
# The verify branch the renderer adds for MTP manifests; removing it gives the old decode (0, no mask).
VERIFY_BRANCH = """        elif query.shape[0] > forward_metadata.actual_seq_lengths_kv.shape[0]:
            # MTP verify step: 1 + next_n query tokens per request need the causal mask (q_len 1 does not).
            sparse_mode = 3
            atten_mask = forward_metadata.attention_mask
            pre_tokens = 2147483647
            next_tokens = 0
"""


def _old_render(mode: str, tmp_path: Path) -> Path:
    folder = tmp_path / mode
    shutil.copytree(GOLDEN / mode, folder)
    path = folder / "kvcache_attention.py"
    text = path.read_text(encoding="utf-8")
    assert text.count(VERIFY_BRANCH) == 1
    path.write_text(text.replace(VERIFY_BRANCH, ""), encoding="utf-8")
    return folder


def _spec_stream(rendered: Path) -> Report:
    """Only the speculative-decode stream of `kvcache validate`, on the emulated backend."""
    from model_infer_kvcache.validators.npu_ops import install_emulation
    from model_infer_kvcache.validators.pipeline import spec_decode as spec_decode
    from model_infer_kvcache.validators.pipeline.host_model import HostModel, import_rendered
    from model_infer_kvcache.validators.pipeline.runtime_deps import preload_transformers
    from model_infer_kvcache.validators.pipeline.tiny_model import build_tiny_model
    from model_infer_kvcache.validators.pipeline.validate import ValidateRequest, _framework

    manifest = load_manifest(rendered / "manifest.json")
    preload_transformers()
    model, plan = build_tiny_model(json.loads(CONFIG.read_text()), manifest, seed=0)
    ref = copy.deepcopy(model)
    report = Report(backend="emulated", deploy_mode=manifest.deploy_mode.value, model_type="deepseek_v3",
                    manifest_hash=manifest.content_hash())
    req = ValidateRequest(manifest=str(rendered / "manifest.json"), rendered=str(rendered), config=str(CONFIG))
    with install_emulation(), _framework(manifest, req) as handle:
        host = HostModel(model, import_rendered(rendered), is_mla=True, window=plan.window,
                         block_size=manifest.block_size)
        if handle is not None:
            from model_infer_kvcache.validators.harness import FrameworkAPI, Scheduler

            sched = Scheduler(host.get_cache_info(), max_model_len=200, max_concurrency=4, api=FrameworkAPI.from_handle(handle),
                              generation=handle.generation)
            spec_decode.run_framework_stream(report, manifest, host, ref, sched, 0, 512, QUICK.watchdog("test"))
        else:
            from model_infer_kvcache.validators.pipeline.standalone_run import _poison_row

            runner = type("Runner", (host.rendered.runner_mixin(),), {})()
            runner._init_kvcache(host.attentions, 4, 200, cache_dtype=torch.float32)
            spec_decode.run_standalone_stream(report, manifest, host, ref, runner, 0, 512, _poison_row,
                                              QUICK.watchdog("test"))
    return report


def _check(report: Report, prefix: str):
    return next(c for c in report.checks if c.name.startswith(prefix))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["framework_g2", "standalone"])
def test_old_decode_fails_the_verify_steps(mode, tmp_path):
    """The rendered decode before MTP support (sparse_mode 0, no mask at any q_len) fails the stream.

    The current renders pass the same stream inside `kvcache validate` (test_validators_e2e,
    deepseek_v3 in every mode, and Kimi-K2)."""
    old = _spec_stream(_old_render(mode, tmp_path))
    failed = {c.name for c in old.failed()}
    assert _check(old, "speculative decode").name in failed
    assert _check(old, "speculative-decode verify steps").name in failed  # (0, no mask) where mtp says (3, mask)
    # not a rounding matter: the first row of each verify step attends to the draft after it
    assert _check(old, "speculative decode").measured["max_abs_diff"] > 0.1


# ----------------------------------------------------------------------------- layer containers


class _Layer(nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.self_attn = attention


@pytest.mark.parametrize("container", ["ModuleDict", "ModuleList", "list", "dict"])
def test_get_cache_info_walks_every_layer_container(container):
    """Upstream's MTP model keeps its layers in nn.ModuleDict (keys "61", ...); iterating it yields keys."""
    from model_infer_kvcache.validators.harness import install_framework
    from model_infer_kvcache.validators.npu_ops import install_emulation
    from model_infer_kvcache.validators.pipeline.host_model import import_rendered

    with install_emulation(), install_framework("G2", None) as handle:
        rendered = import_rendered(GOLDEN / "framework_g2")
        attention_cls = type("Attention", (rendered.attention_mixin(), nn.Module), {})
        layers = []
        for idx in (61, 62):
            attention = attention_cls()
            nn.Module.__init__(attention)
            attention.init_kv_cache(idx)
            layers.append(_Layer(attention))
        held = {"ModuleDict": nn.ModuleDict({"61": layers[0], "62": layers[1]}), "ModuleList": nn.ModuleList(layers),
                "list": list(layers), "dict": {"61": layers[0], "62": layers[1]}}[container]
        model = types.SimpleNamespace(model=types.SimpleNamespace(layers=held))
        info = rendered.model_mixin().get_cache_info(model)
        assert info.num_layers == 2 and [li.layer_idx for li in info.layer_infos] == [0, 1]
        assert [[e.cache_name for e in li.caches] for li in info.layer_infos] == [["nope_cache", "rope_cache"]] * 2
        assert info.layer_infos[1].caches[0] is layers[1].self_attn.cache_entries[0]
        assert handle.generation == "G2"


# ----------------------------------------------------------------------------- memory plan


def test_memory_plan_counts_the_mtp_layer():
    m = analyze(AnalyzeRequest(config=str(CONFIG), max_len=8192, max_concurrency=16))
    no_mtp = json.loads(CONFIG.read_text())
    no_mtp["num_nextn_predict_layers"] = 0
    plain = analyze(AnalyzeRequest(config=_write(no_mtp), max_len=8192, max_concurrency=16))
    per_layer = (512 + 64) * 2  # latent + rope, bf16, one head
    assert [g.num_layers for g in m.memory.groups] == [61 + 1]
    assert [g.num_layers for g in plain.memory.groups] == [61]
    assert m.memory.per_token_bytes - plain.memory.per_token_bytes == per_layer
    assert any("MTP" in line for line in m.memory.derivation)


def _write(config: dict) -> str:
    import tempfile

    handle = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump(config, handle)
    handle.close()
    return handle.name


# ----------------------------------------------------------------------------- harness verify steps


def test_scheduler_verify_step_conventions_and_rollback():
    from model_infer_kvcache.validators.harness import Scheduler
    from model_infer_kvcache.validators.harness.toy_model import ToyLayerSpec, ToyModel

    model = ToyModel([ToyLayerSpec("FullAttention", block_size=4)], generation="G2")
    sched = Scheduler(model.get_cache_info(), max_model_len=40, max_concurrency=2)
    a = sched.add_request([1, 2, 3, 4, 5])
    b = sched.add_request([6, 7])
    sched.complete_step(sched.next_step(), [11, 12])  # prefill: computed_len 4 and 1
    step = sched.verify_step({a: [21], b: [22]})
    fm = step.forward_metadata
    # last accepted token + draft per request, at positions computed + 1 and computed + 2
    assert step.input_ids.tolist() == [11, 21, 12, 22] and step.position_ids.tolist() == [5, 6, 2, 3]
    assert fm.actual_seq_lengths_q.tolist() == [2, 2] and fm.actual_seq_lengths_cu_q.tolist() == [2, 4]
    assert fm.kv_len.tolist() == [6, 3] and fm.actual_seq_lengths_kv.tolist() == [7, 4]
    assert not fm.is_prefill and step.q_lens == [2, 2]
    slots = fm.slot_mapping["FullAttention"].tolist()
    # a: draft accepted (+ bonus token 31); b: draft rejected, the model's token 32 instead
    sched.complete_verify(step, [[21, 31], [32]])
    assert sched.requests[a].computed_len == 6 and sched.requests[b].computed_len == 2
    assert sched.requests[b].output_ids == [12, 32]
    step = sched.verify_step({a: [41], b: [42]})
    assert step.position_ids.tolist() == [7, 8, 3, 4]
    # b's rejected draft (position 3) is overwritten by its new last token
    assert step.forward_metadata.slot_mapping["FullAttention"].tolist()[2] == slots[3]
    with pytest.raises(ValueError, match="1..q_len"):
        sched.complete_verify(step, [[1, 2, 3], [4]])


# ----------------------------------------------------------------------------- lint


@pytest.mark.parametrize("mode", ["framework_g1", "framework_g2", "standalone"])
def test_lint_flags_the_old_decode_and_passes_the_render(mode, tmp_path):
    from model_infer_kvcache.validators.lint import lint_paths

    manifest = load_manifest(GOLDEN / mode / "manifest.json")
    assert manifest.mtp is not None
    assert not lint_paths([GOLDEN / mode], manifest=manifest).findings
    old = lint_paths([_old_render(mode, tmp_path) / "kvcache_attention.py"], manifest=manifest).findings
    assert [f.rule for f in old] == ["KV811"]
    # without MTP in the manifest the same decode is right (q_len is always 1)
    assert not lint_paths([_old_render(mode, tmp_path / "again") / "kvcache_attention.py"],
                          manifest=manifest.model_copy(update={"mtp": None})).findings


def test_render_refuses_an_mtp_plan_it_cannot_render():
    from model_infer_kvcache.analyzer.errors import InputError
    from model_infer_kvcache.implementer.render import render_manifest

    manifest = load_manifest(GOLDEN / "framework_g2" / "manifest.json")
    unmasked = manifest.model_copy(update={"mtp": manifest.mtp.model_copy(update={"decode_mask": "none"})})
    with pytest.raises(InputError, match="sparse_mode 3 needs the 2048x2048 causal mask") as err:
        render_manifest(unmasked)
    assert err.value.field == "mtp.decode_mask"
