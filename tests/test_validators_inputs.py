"""validate trusts nothing: manifests are checked against their own invariants on load, and the
manifest, the render and the config must belong together before anything runs (exit 2, one line)."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest
import torch
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from model_infer_kvcache.analyzer.manifest_io import load_manifest
from model_infer_kvcache.validators.pipeline.report import Report
from model_infer_kvcache.validators.pipeline.validate import ValidateRequest, resolve_dtype, validate
from validators_support import CONFIGS, ROOT, render_case


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "model_infer_kvcache", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qwen3")
    manifest, rendered, config = render_case(tmp, "qwen3_8b", framework_api="G2")
    return manifest, rendered, config


# The hand edits of the issue: each breaks one invariant, and the field to fix is named.
HAND_EDITS = {
    "cache num_head 5": (lambda d: d["layers"][3]["caches"][0].update(num_head=5), "layers[3].caches[0].num_head"),
    "a layer dropped": (lambda d: d["layers"].pop(20), "layers"),
    "schema_version 9.9": (lambda d: d.update(schema_version="9.9"), "schema_version"),
    "scale 1.0 next to head_dim^-0.5": (lambda d: d["fa"].update(softmax_scale=1.0), "fa.softmax_scale"),
    "per-rank heads": (lambda d: d["parallel"].update(num_q_heads_per_rank=16), "parallel.num_q_heads_per_rank"),
}


@pytest.mark.parametrize("edit", sorted(HAND_EDITS))
def test_hand_edited_manifest_is_refused_with_the_field_named(tmp_path, qwen3, edit):
    change, field = HAND_EDITS[edit]
    data = json.loads(qwen3[0].read_text())
    change(data)
    bad = tmp_path / "manifest.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(InputError) as err:
        load_manifest(bad)
    assert err.value.field == field
    for args in (("render", "--manifest", str(bad), "--out", str(tmp_path / "out")),
                 ("validate", "--manifest", str(bad), "--rendered", str(qwen3[1]), "--config", str(qwen3[2]))):
        done = _cli(*args)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and field in lines[0] and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


def test_analyzer_manifests_hold_their_invariants():
    """Every fixture config analyzes into a manifest that passes its own invariants (TP 1 and 2, Legacy)."""
    from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze

    for name in ("qwen3_8b", "deepseek_v3", "gpt_oss_20b", "gemma3_27b", "longcat_flash"):
        for extra in ({}, {"attn_tp_size": 2}, {"kv_mode": "legacy"}):
            m = analyze(AnalyzeRequest(config=str(CONFIGS / f"{name}.json"), **extra))
            SelectionManifest.model_validate_json(m.to_json())  # re-validated from its JSON


def test_render_of_another_manifest_is_refused(tmp_path, qwen3):
    """A Qwen3-8B render validated with a Llama-3.1-8B manifest: the render names another manifest."""
    llama_manifest, _, llama_config = render_case(tmp_path, "llama31_8b", framework_api="G2")
    with pytest.raises(InputError, match="rendered from manifest") as err:
        validate(ValidateRequest(manifest=str(llama_manifest), rendered=str(qwen3[1]), config=str(llama_config),
                                 backend="emulated"))
    assert err.value.field == "--rendered"


def test_config_of_another_model_is_refused(qwen3):
    """The issue's case: a Qwen3-8B manifest + render validated against a Llama-3.1-8B config (passed 15/15)."""
    manifest, rendered, _ = qwen3
    done = _cli("validate", "--manifest", str(manifest), "--rendered", str(rendered),
                "--config", str(CONFIGS / "llama31_8b.json"))
    assert done.returncode == 2
    line = done.stderr.strip()
    assert len(line.splitlines()) == 1 and "--config" in line and "model_type 'llama' (config)" in line


def test_render_without_header_is_refused(tmp_path, qwen3):
    manifest, rendered, config = qwen3
    copy = tmp_path / "rendered"
    copy.mkdir()
    text = (rendered / "kvcache_attention.py").read_text()
    (copy / "kvcache_attention.py").write_text("\n".join(text.splitlines()[3:]))
    with pytest.raises(InputError, match="no model-infer-kvcache header"):
        validate(ValidateRequest(manifest=str(manifest), rendered=str(copy), config=str(config), backend="emulated"))


def test_dtype_defaults_and_device_limits(qwen3):
    manifest = load_manifest(qwen3[0])
    assert resolve_dtype(None, "emulated", manifest) == "float64"
    assert resolve_dtype(None, "npu", manifest) == manifest.model.dtype
    assert resolve_dtype("float32", "emulated", manifest) == "float32"
    with pytest.raises(InputError, match="CPU emulation mode"):
        resolve_dtype("float64", "npu", manifest)


def test_cache_info_check_compares_the_window_with_the_manifest(qwen3, tmp_path):
    """framework_run's init check compared the entry's window with itself: now a wrong window fails it."""
    from model_infer_kvcache.validators.pipeline.framework_run import check_cache_info

    manifest, _, _ = render_case(tmp_path, "gpt_oss_20b", framework_api="G2")
    m = load_manifest(manifest)

    def info(window):
        layers = []
        for plan in m.layers[:2]:
            w = window if plan.attn_type == "SlidingWindow" else None
            entries = [types.SimpleNamespace(cache_name=c.name, attn_type=plan.attn_type, dim=c.dim,
                                             num_head=c.num_head, dtype=torch.float64, sliding_window=w,
                                             block_size=m.block_size) for c in plan.caches]
            layers.append(types.SimpleNamespace(caches=entries))
        return types.SimpleNamespace(layer_infos=layers, block_size=m.block_size, is_mla_backend=False)

    for window, ok in ((128, True), (4096, False)):
        report = Report("emulated", "framework", "gpt_oss", "")
        check_cache_info(report, m, info(window), 2, "G2", torch.float64, 2)
        entries = next(c for c in report.checks if c.name == "cache entries match the manifest")
        assert entries.passed is ok, entries.detail
