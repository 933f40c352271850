"""A drafter over its target's cache (Gemma-4 assistants, analyzer/kinds/drafter.py): planned with no blocks of its
own, rendered in both modes, and validated at CPU sizes against transformers' forward given the same K/V dense;
plausible render mistakes fail by check ID."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from model_infer_kvcache.analyzer.operators.fa_facts import INT32_MAX
from model_infer_kvcache.implementer.render import render_manifest, write_rendered
from model_infer_kvcache.validators.npu_ops import install_emulation
from model_infer_kvcache.validators.pipeline.drafter_run import (
    CPU_WINDOW,
    build_drafter,
    check_drafter,
    cpu_config,
)
from model_infer_kvcache.validators.pipeline.precision import float64_upcasts
from model_infer_kvcache.validators.pipeline.report import Report
from model_infer_kvcache.validators.pipeline.runtime_deps import preload_transformers

pytest.importorskip("transformers")
MODEL_TYPE = "gemma4_unified_assistant"


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    """(the CPU-sized config path, its framework and standalone manifests) from transformers' class defaults."""
    preload_transformers()
    from transformers import CONFIG_MAPPING

    tmp = tmp_path_factory.mktemp("drafter")
    path = tmp / "config.json"
    path.write_text(json.dumps(cpu_config(CONFIG_MAPPING[MODEL_TYPE]().to_dict()), default=str), encoding="utf-8")
    return path, {mode: analyze(AnalyzeRequest(config=str(path), deploy_mode=mode))
                  for mode in ("framework", "standalone")}


def test_the_defaults_plan_no_blocks_and_name_the_target_layer_per_attn_type(tmp_path):
    from transformers import CONFIG_MAPPING

    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG_MAPPING[MODEL_TYPE]().to_dict(), default=str), encoding="utf-8")
    m = analyze(AnalyzeRequest(config=str(path), deploy_mode="framework"))
    assert not m.blockers and m.drafter is not None and m.drafter.blocks == 0
    assert set(m.drafter.target_layers) == {"FullAttention", "SlidingWindow"}
    assert m.drafter.shared_kv_keys == {"FullAttention": "full_attention", "SlidingWindow": "sliding_attention"}
    assert m.drafter.input_width == 2 * 3840  # 2 x backbone_hidden_size (Gemma4UnifiedAssistantConfig)
    assert all(layer.reads_target and not layer.caches for layer in m.layers)
    assert m.memory.per_token_bytes == 0 and m.memory.groups == []
    assert any("0 blocks of its own" in line for line in m.memory.derivation)
    sliding = next(layer for layer in m.layers if layer.sliding_window)
    full = next(layer for layer in m.layers if not layer.sliding_window)
    # the flipped window: W + 1 keys for drafted query 0 (|q - kv| <= W), under the 'exclusive' band reading
    assert (sliding.sparse_mode.decode, sliding.pre_tokens, sliding.next_tokens) == (4, 1024, INT32_MAX)
    assert (full.sparse_mode.decode, full.mask.decode, full.next_tokens) == (0, "none", INT32_MAX)
    from model_infer_kvcache.analyzer.decisions_table import decision_rows

    row = next(r for r in decision_rows(m) if r[0].startswith("草稿模型"))
    assert "自身 0 block" in row[1] and "sliding_attention" in row[1]


@pytest.mark.parametrize(("edit", "field"), [
    (lambda d: d["layers"][0].__setitem__("caches", [{"name": "k_cache", "dim": 256, "num_head": 4,
                                                      "dtype": "bfloat16"}]), "layers[0].caches"),
    (lambda d: d["layers"][0].__setitem__("next_tokens", 0), "layers[0].next_tokens"),
    (lambda d: d["layers"][0].pop("reads_target"), "layers[0].reads_target"),
])
def test_a_hand_edited_drafter_manifest_is_refused_naming_the_field(drafter, edit, field):
    data = drafter[1]["framework"].model_dump(mode="json")
    edit(data)
    with pytest.raises(ValueError, match=re.escape(f"{field}: ")):
        SelectionManifest.model_validate(data)


def _run(manifest, render_dir: Path, path: Path, edit=None) -> Report:
    """check_drafter on the render of ``manifest`` (``edit``: a mistake written into it), float64, emulated."""
    write_rendered(render_manifest(manifest), render_dir)
    if edit is not None:
        target = render_dir / "kvcache_attention.py"
        text = target.read_text(encoding="utf-8")
        edited = edit(text)
        assert edited != text
        target.write_text(edited, encoding="utf-8")
    report = Report(backend="emulated", deploy_mode=manifest.deploy_mode.value, model_type=MODEL_TYPE,
                    manifest_hash=manifest.content_hash(), dtype="float64", tolerance=1e-9)
    with install_emulation(), float64_upcasts():
        check_drafter(report, manifest, str(render_dir), build_drafter(path, 0), 0, torch.float64)
    return report


@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_the_render_reads_the_target_cache_as_transformers_reads_shared_kv_states(drafter, tmp_path, mode):
    path, manifests = drafter
    text = render_manifest(manifests[mode]).files["kvcache_attention.py"]
    table = 'forward_metadata.block_table[self.attn_type]' if mode == "framework" else 'forward_metadata.block_table  #'
    assert table in text
    report = _run(manifests[mode], tmp_path, path)
    assert [(c.id, c.passed) for c in report.checks] == [("V233", True), ("V308", True)]
    assert report.checks[1].measured["max_abs_diff"] < 1e-11


@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_the_render_says_how_to_integrate_the_drafter(drafter, mode):
    """Every render carries its INTEGRATION.md: for a drafter, the mixin, the binding to the target's modules, the
    call and the step metadata (the target's block table, the drafted tokens as queries, the prefix as KV length),
    and none of a cached model's steps (no cache class, no runner, no KV write)."""
    _, manifests = drafter
    files = render_manifest(manifests[mode]).files
    assert sorted(files) == ["INTEGRATION.md", "kvcache_attention.py"]
    text = files["INTEGRATION.md"]
    for words in ("KVCacheDrafterMixin", "init_drafter_cache(layer_idx)", "bind_target_caches(",
                  "self.drafter_attention(query_states, forward_metadata)", "actual_seq_lengths_kv` = each request's",
                  "block_table[attn_type]" if mode == "framework" else "the target runner's table"):
        assert words in text, words
    assert "init_kv_cache" not in text and "KVCacheRunnerMixin" not in text and "KVCacheAttentionMixin" not in text
    assert "| 写入算子 | - | a drafter writes nothing" in text  # not the target's scatter op quoted as its own


def _sliding_reads_full(text: str) -> str:
    # the plausible binding slip: every drafter layer pointed at the target's full-attention layer
    return text.replace('object.__setattr__(attn, "target", owners[attn.attn_type])',
                        'object.__setattr__(attn, "target", owners["FullAttention"])')


def _window_not_flipped(text: str) -> str:
    return re.sub(r'("SlidingWindow": dict\(.*)flipped=True', r"\1flipped=False", text)


def _drafted_tokens_causal(text: str) -> str:
    # the full layer's drafted block masked causally (sparse_mode 3, the normal prefill's) instead of bidirectionally
    text = re.sub(r'("FullAttention": dict\(.*)sparse_mode=0', r"\1sparse_mode=3", text)
    return text.replace('if reads["sparse_mode"] == 4 else None', 'if reads["sparse_mode"] in (3, 4) else None')


@pytest.mark.parametrize(("edit", "failing"), [
    (_sliding_reads_full, {"V233", "V201"}),  # reads the full layer's cache: its wider rows break the FA call too
    (_window_not_flipped, {"V308"}),
    (_drafted_tokens_causal, {"V308"}),
])
def test_a_render_mistake_fails_by_name(drafter, tmp_path, edit, failing):
    path, manifests = drafter
    report = _run(manifests["framework"], tmp_path, path, edit)
    assert {c.id for c in report.checks if not c.passed} == failing, report.to_markdown()


@pytest.mark.parametrize("window", [CPU_WINDOW, 512, 1024])
def test_the_window_is_crossed_over_a_block_boundary(window):
    from model_infer_kvcache.validators.pipeline.drafter_run import BLOCK_SIZE, DRAFTED, prefixes

    # every request's flipped window starts past its first key and spans a block boundary
    assert all(p - 1 - (t - 1) - window > 0 for p, t in zip(prefixes(window), DRAFTED, strict=True))
    assert all((p - 1 - window) // BLOCK_SIZE < (p - 1) // BLOCK_SIZE for p in prefixes(window))
    assert max(DRAFTED) <= window + 1


@pytest.mark.parametrize(("ask", "field"), [
    ({"attn_tp_size": 2}, "parallel.attn_tp_size"),
    ({"exe_mode": "npugraph_ex"}, "exe_mode"),
    ({"kv_mode": "legacy"}, "kv_mode"),
])
def test_a_drafter_the_render_does_not_serve_is_refused_naming_the_field(drafter, ask, field):
    from model_infer_kvcache.analyzer.errors import InputError

    path, _ = drafter
    m = analyze(AnalyzeRequest(config=str(path), deploy_mode="framework", **ask))
    with pytest.raises(InputError) as exc:
        render_manifest(m)
    assert exc.value.field == field and "drafter" in exc.value.message


def test_a_drafter_over_layers_other_than_full_and_sliding_or_without_a_target_is_refused_by_name():
    from model_infer_kvcache.analyzer.errors import NotSupportedByKvcache
    from model_infer_kvcache.analyzer.kinds.drafter import read_facts

    def target(*names):
        return (1536, "backbone_hidden_size") if "backbone_hidden_size" in names else None

    assert read_facts(target, (2, "num_kv_shared_layers"), 3, ("full", "sliding", "full"), "c") is None
    assert read_facts(target, (2, "num_kv_shared_layers"), 2, ("sliding", "full"), "c").input_width == 3072
    with pytest.raises(NotSupportedByKvcache) as exc:
        read_facts(target, (2, "num_kv_shared_layers"), 2, ("full", "linear"), "c.json")
    assert exc.value.field == "num_kv_shared_layers" and "linear" in exc.value.message
    # every layer shared and no target named (a Gemma-3n text config with all its layers shared): no drafter
    with pytest.raises(NotSupportedByKvcache) as exc:
        read_facts(lambda *names: None, (2, "num_kv_shared_layers"), 2, ("sliding", "full"), "c.json")
    assert exc.value.field == "num_kv_shared_layers" and "names no target model" in exc.value.message


def test_a_window_past_a_cpu_run_runs_the_implementers_render_at_cpu_size(drafter, tmp_path):
    import contextlib

    from model_infer_kvcache.validators.pipeline.drafter_run import run_drafter

    path, _ = drafter
    real = json.loads(path.read_text(encoding="utf-8"))
    real["text_config"]["sliding_window"] = 8192
    big = tmp_path / "config.json"
    big.write_text(json.dumps(real), encoding="utf-8")
    m = analyze(AnalyzeRequest(config=str(big), deploy_mode="framework"))
    write_rendered(render_manifest(m), tmp_path / "render")
    report = Report(backend="emulated", deploy_mode="framework", model_type=MODEL_TYPE,
                    manifest_hash=m.content_hash(), dtype="float64", tolerance=1e-9)
    run_drafter(report, m, str(tmp_path / "render"), real, 0, torch.float64, install_emulation(),
                contextlib.nullcontext())
    assert [(c.id, c.passed) for c in report.checks] == [("V233", True), ("V308", True)]
    assert report.checks[1].measured["prefixes"] == [CPU_WINDOW + 50, CPU_WINDOW + 150]
    assert any("window 8192 > 4096" in note for note in report.notes)
