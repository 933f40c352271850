"""Per-layer attention shapes rendered and validated (issue 40, Gemma-4): the full-attention layers' own head_dim and
KV heads (``global_head_dim`` / ``num_global_key_value_heads``, K = V) in the render's LAYER_SHAPES, each layer's cache
entries, writes, FA calls and the standalone runner's allocation at its own shape, validated against transformers'
Gemma4ForCausalLM in both deployment modes; and the realistic mistakes of a per-layer port, each failing by name.

The config is the gemma4_26b_a4b fixture (sliding layers 8 KV heads of 256, full layers 2 K = V heads of 512) at
small widths: 4 query heads, sliding 2 KV heads of 64, full 1 KV head of 128, so the two shapes differ in both.
"""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pytest
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from model_infer_kvcache.validators.pipeline import validate
from model_infer_kvcache.validators.pipeline.request_stream import Scenario
from validators_support import check, mutate, render_case, run_validate

pytest.importorskip("transformers")

SMALL = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
         "global_head_dim": 128, "num_global_key_value_heads": 1, "sliding_window": 128, "num_hidden_layers": 6,
         "intermediate_size": 256, "moe_intermediate_size": 64, "num_experts": 8, "top_k_experts": 2}
# two prompts, one late admit into freed blocks, decode steps crossing the window
SHORT = Scenario(first=((120, 4), (40, 4)), late=((90, 4),), max_concurrency=2, release_requests=2)
ATTN, RUNNER = "kvcache_attention.py", "kvcache_runner.py"
NUMERIC, LAYERS, ENTRIES = "logits vs transformers", "every layer's attn_type", "cache entries match the manifest"
RUNNER_CACHES, FA_ARGS = "_init_kvcache caches are", "FA call arguments match the manifest"


def _case(tmp: Path, mode: str):
    return render_case(tmp, "gemma4_26b_a4b", SMALL, deploy_mode=mode)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_per_layer_shapes_render_and_validate(tmp_path, mode):
    manifest_path, rendered, cfg = _case(tmp_path, mode)
    m = SelectionManifest.model_validate(json.loads(manifest_path.read_text(encoding="utf-8")))
    assert [(layer.index, layer.head_dim, layer.num_kv_heads_per_rank) for layer in m.layers
            if layer.head_dim is not None] == [(5, 128, 1)]
    text = (rendered / ATTN).read_text(encoding="utf-8")
    assert "LAYER_SHAPES = {5: (128, 1)}" in text and "HEAD_DIM = 64" in text
    if mode == "standalone":
        assert "attn.kv_heads_per_rank, attn.kv_head_dim," in (rendered / RUNNER).read_text(encoding="utf-8")
    report = run_validate(manifest_path, rendered, cfg, scenario=SHORT)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert check(report, NUMERIC).measured["max_abs_diff"] <= 1e-9
    assert "LAYER_SHAPES" in check(report, "rendered constants match").measured["checked"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_kv_shared_layers_read_their_sources_cache_at_its_shape(tmp_path, mode):
    """Gemma-4 with num_kv_shared_layers (the E2B / E4B layout): the last 6 of 12 layers read the cache of the last
    earlier layer of their type; the shared full layer 11 reads layer 5's [.., 1, 128] cache at that shape."""
    manifest_path, rendered, cfg = render_case(tmp_path, "gemma4_26b_a4b", {**SMALL, "num_hidden_layers": 12,
                                                                            "num_kv_shared_layers": 6},
                                               deploy_mode=mode)
    m = SelectionManifest.model_validate(json.loads(manifest_path.read_text(encoding="utf-8")))
    assert (m.layers[11].kv_source_layer, m.layers[11].head_dim) == (5, 128)
    assert "LAYER_SHAPES = {5: (128, 1), 11: (128, 1)}" in (rendered / ATTN).read_text(encoding="utf-8")
    report = run_validate(manifest_path, rendered, cfg, scenario=SHORT)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert check(report, NUMERIC).measured["max_abs_diff"] <= 1e-9


@pytest.mark.slow
def test_per_layer_shapes_validate_on_two_attention_tp_ranks(tmp_path):
    """Attention TP 2: the sliding layers' 2 KV heads split (1 a rank), the full layer's single K = V head replicated
    (1 a rank at head_dim 128); each rank keeps its heads of each layer at that layer's own head_dim."""
    manifest_path, rendered, cfg = render_case(tmp_path, "gemma4_26b_a4b", SMALL, deploy_mode="framework",
                                               attn_tp_size=2)
    assert "LAYER_SHAPES = {5: (128, 1)}" in (rendered / ATTN).read_text(encoding="utf-8")
    report = run_validate(manifest_path, rendered, cfg, scenario=SHORT)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    for rank in (0, 1):
        assert check(report, f"rank {rank}: {NUMERIC}").measured["max_abs_diff"] <= 1e-9


INIT = r"self\.kv_head_dim, self\.kv_heads_per_rank = LAYER_SHAPES\.get\(layer_idx, \(HEAD_DIM, NUM_KV_HEADS_PER_RANK\)\)"
MISTAKES = [
    # every layer given the first layer's (the model's) head_dim and KV heads: the full layers' entries, caches,
    # writes and FA calls at the sliding layers' shape
    ("every-layer-at-the-first-layers-shape", "framework", ATTN, INIT,
     "self.kv_head_dim, self.kv_heads_per_rank = (HEAD_DIM, NUM_KV_HEADS_PER_RANK)", LAYERS),
    ("every-layer-at-the-first-layers-shape", "standalone", ATTN, INIT,
     "self.kv_head_dim, self.kv_heads_per_rank = (HEAD_DIM, NUM_KV_HEADS_PER_RANK)", RUNNER_CACHES),
    ("every-layer-at-the-first-layers-shape-named-per-layer", "standalone", ATTN, INIT,
     "self.kv_head_dim, self.kv_heads_per_rank = (HEAD_DIM, NUM_KV_HEADS_PER_RANK)", LAYERS),
    # the runner allocating every layer's cache at the model's shape while the layers write their own
    ("runner-allocates-the-models-shape", "standalone", RUNNER,
     r"attn\.kv_heads_per_rank, attn\.kv_head_dim,", "NUM_KV_HEADS_PER_RANK, HEAD_DIM,", RUNNER_CACHES),
    # the FA call told the model's KV head count on every layer (the cache and writes at the layer's own)
    ("fa-told-the-models-kv-heads", "framework", ATTN, r"num_key_value_heads=self\.kv_heads_per_rank",
     "num_key_value_heads=NUM_KV_HEADS_PER_RANK", FA_ARGS),
]


@pytest.mark.slow
@pytest.mark.parametrize("case, mode, name, pattern, replacement, failing", MISTAKES,
                         ids=[f"{m[0]}-{m[1]}" for m in MISTAKES])
def test_a_per_layer_shape_mistake_fails_by_name(tmp_path, case, mode, name, pattern, replacement, failing):
    manifest, rendered, cfg = _case(tmp_path, mode)
    mutate(rendered, pattern, replacement, name=name)
    with mock.patch.object(validate, "_localise", lambda *args, **kwargs: None):
        report = run_validate(manifest, rendered, cfg, scenario=SHORT)
    assert not report.passed
    assert not check(report, failing).passed, [(c.name, c.detail) for c in report.failed()]
    if failing == LAYERS:  # named at the full layer, with its own shape
        assert "layer 5" in check(report, LAYERS).detail and "128" in check(report, LAYERS).detail
