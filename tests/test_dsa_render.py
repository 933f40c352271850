"""DeepSeek sparse attention rendered and validated against transformers' deepseek_v32 and glm_moe_dsa, in both
deployment modes, with index_topk narrowed below the stream's prompts so the selection really drops keys; and the
realistic mistakes of a DSA port, each failing by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from model_infer_kvcache.implementer.render import render_manifest, write_rendered
from model_infer_kvcache.validators.pipeline.request_stream import DEFAULT, QUICK, Scenario
from validators_support import check, mutate, run_validate


def _config(tmp: Path, family: str, **changes) -> Path:
    data = {**transformers.AutoConfig.for_model(family).to_dict(), **changes}
    path = tmp / f"{family}.json"
    path.write_text(json.dumps(data, default=str), encoding="utf-8")
    return path


def _case(tmp: Path, family: str, mode: str, manifest_edit=None, **changes):
    config = _config(tmp, family, **changes)
    manifest = analyze(AnalyzeRequest(config=str(config), deploy_mode=mode))
    if manifest_edit:
        manifest = manifest_edit(manifest)
    path = tmp / "manifest.json"
    path.write_text(manifest.to_json(), encoding="utf-8")
    rendered = tmp / "rendered"
    write_rendered(render_manifest(manifest), rendered)
    return path, rendered, config


# 16 query heads instead of 128 (DeepSeek-V3.2) / 64 (GLM-5), a sixth of the float64 time or less: the indexer keeps
# its own heads, and MLA's latent cache and the sparse selection do not depend on the attention's head count. The
# published counts run in the real engine (tests/test_checkout_dsa.py, DeepSeek-V3.2's 128) and in
# benchmarks/bench_dsa.py (all four pairs, full stream).
NARROW_HEADS = {"num_attention_heads": 16, "num_key_value_heads": 16}


@pytest.mark.slow
@pytest.mark.parametrize("family, mode, changes, full", [
    # the published DeepSeek-V3.2 carries one MTP layer: the verify steps (q_len 2) run through the same selection
    ("deepseek_v32", "framework", {"num_nextn_predict_layers": 1, **NARROW_HEADS}, True),
    ("glm_moe_dsa", "standalone", NARROW_HEADS, True),
    # the other two pairs on the shorter stream
    ("deepseek_v32", "standalone", NARROW_HEADS, False),
    ("glm_moe_dsa", "framework", NARROW_HEADS, False),
])
def test_dsa_renders_and_validates(tmp_path, family, mode, changes, full):
    manifest, rendered, config = _case(tmp_path, family, mode, **changes)
    report = run_validate(manifest, rendered, config, scenario=DEFAULT if full else QUICK)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert check(report, "logits vs transformers").measured["max_abs_diff"] <= 1e-9
    indexer = check(report, "each indexer layer's lightning indexer")
    assert indexer.measured["calls"] > 0 and indexer.measured["keys_dropped"] > 0.3
    assert check(report, "sparse attention: scale").measured["index_topk"] == 64
    assert any("index_topk 2048 -> 64" in n for n in report.notes)
    if "num_nextn_predict_layers" in changes:
        assert check(report, "speculative-decode verify steps").measured["calls"] > 0
        assert check(report, "speculative decode (next_n=1)").passed


def _narrow(manifest: SelectionManifest) -> SelectionManifest:
    """The CPU-size manifest itself (index_topk 64): the mistake runs once, as written."""
    from model_infer_kvcache.validators.pipeline.tiny_model import cpu_sized

    return cpu_sized(manifest)


# prompts past index_topk (64) and one within it, a late admit into freed blocks, decode steps
SHORT = Scenario(first=((120, 4), (40, 4)), late=((90, 4),), max_concurrency=2, release_requests=2)
ATTN, RUNNER = "kvcache_attention.py", "kvcache_runner.py"
NUMERIC, INDEXER, SPARSE = "logits vs transformers", "each indexer layer's lightning indexer", "sparse attention:"
ROPE_K = r"        k = torch\.cat\(\[self\.index_rope\(k\[\.\.\., :QK_ROPE_HEAD_DIM\], cos, sin\), "
MISTAKES = [
    # the indexer keys never written: the indexer scores poisoned (never-written) blocks
    ("indexer-cache-never-written", "framework", ATTN, r"        torch_npu\.npu_scatter_nd_update_\(\n            "
     r"self\.indexer_key_cache", "        (lambda *a: None)(\n            self.indexer_key_cache", NUMERIC),
    # every layer's indexer keys in layer 0's cache (the runner allocates it once): layers overwrite each other
    ("indexer-cache-of-another-layer", "standalone", RUNNER, r"(            attn\.indexer_key_cache = )torch\.zeros\(",
     r"\1attention_modules[0].indexer_key_cache if attn is not attention_modules[0] else torch.zeros(", NUMERIC),
    # indexer keys cached before their RoPE (the rotation dropped from the key)
    ("keys-cached-before-rope", "framework", ATTN, ROPE_K + r"k\[\.\.\., QK_ROPE_HEAD_DIM:\]\], dim=-1\)\n", "",
     NUMERIC),
    # the selection over the whole cache: prefix-sum key lengths run each request into the next one's keys
    ("topk-over-other-requests-keys", "framework", ATTN,
     r"actual_seq_lengths_key=as_int32\(forward_metadata\.actual_seq_lengths_kv\)",
     "actual_seq_lengths_key=as_int32(forward_metadata.actual_seq_lengths_cu_kv)", INDEXER),
    # dense attention: every key kept (the selection width of the real model, not the manifest's)
    ("dense-instead-of-selected", "standalone", ATTN, r"sparse_count=INDEX_TOPK,", "sparse_count=2048,", INDEXER),
    ("index-topk-off-by-one", "framework", ATTN, r"sparse_count=INDEX_TOPK,", "sparse_count=INDEX_TOPK - 1,",
     SPARSE),
    # the RoPE layout of the other family (GLM-5's indexer rotates interleaved pairs)
    ("indexer-rope-layout", "framework", ATTN, r"torch_npu\.npu_rotary_mul\(x\.reshape\(t, n, 1, r\), cos, sin\)",
     "torch_npu.npu_interleave_rope(x.reshape(t, n, 1, r).contiguous(), cos, sin)", NUMERIC),
]


def _fails_by_name(manifest, rendered, config, failing: str):
    """Validate a broken DSA render: it fails, by the named check; a numeric failure with the indexer and sparse
    arguments right (the mistake is in the arithmetic, not the calls)."""
    report = run_validate(manifest, rendered, config, scenario=SHORT)
    assert not report.passed
    assert not check(report, failing).passed, [(c.name, c.detail) for c in report.failed()]
    if failing == NUMERIC:
        assert all(c.passed for c in report.checks if c.name.startswith((INDEXER, SPARSE)))  # arguments are right
    return report


@pytest.mark.slow
@pytest.mark.parametrize("case, mode, name, pattern, replacement, failing", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_dsa_render_mistake_fails_by_name(tmp_path, case, mode, name, pattern, replacement, failing):
    manifest, rendered, config = _case(tmp_path, "deepseek_v32", mode, _narrow, **NARROW_HEADS)
    mutate(rendered, pattern, replacement, name=name)
    report = _fails_by_name(manifest, rendered, config, failing)
    if case == "index-topk-off-by-one":
        assert "sparse_indices hold 63 keys per query, index_topk is 64" in check(report, SPARSE).detail
        assert "sparse_count 63 != index_topk 64" in check(report, INDEXER).detail


@pytest.mark.slow
def test_a_users_render_runs_as_written_with_only_its_selection_narrowed(tmp_path):
    """A render that differs from the implementer's (here: keys cached before RoPE) at the real index_topk 2048:
    a CPU stream would select every key there, so the mistake is exercised with only INDEX_TOPK narrowed."""
    manifest, rendered, config = _case(tmp_path, "deepseek_v32", "framework", **NARROW_HEADS)
    mutate(rendered, ROPE_K + r"k\[\.\.\., QK_ROPE_HEAD_DIM:\]\], dim=-1\)\n", "")
    report = run_validate(manifest, rendered, config, scenario=SHORT)
    assert any("ran as written with only its INDEX_TOPK set to 64" in n for n in report.notes)
    assert check(report, "logits vs transformers").passed  # the implementer's render at CPU size
    assert not check(report, "as written: logits vs transformers").passed


# A.X-K2 (transformers axk2): DeepSeek-V3.2's indexer unchanged behind a fused query/gate projection (q_gate_proj) and
# a sigmoid output gate, both the model's own code around kv_cache_attention (the host runs them as AXK2Attention
# does). At rope 64 (its class default 32 is held to MLA's FA dims, a blocker) and 16 of its 32 query heads; its
# latent 128 and its indexer (16 heads x 128, top 2048 -> 64 on CPU) as published.
AXK2 = {"qk_rope_head_dim": 64, **NARROW_HEADS}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_axk2_renders_and_validates(tmp_path, mode):
    manifest, rendered, config = _case(tmp_path, "axk2", mode, **AXK2)
    assert "npu_rotary_mul(x.reshape(t, n, 1, r), cos, sin)" in (rendered / ATTN).read_text()  # half-split, as V3.2
    report = run_validate(manifest, rendered, config, scenario=SHORT)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert check(report, NUMERIC).measured["max_abs_diff"] <= 1e-9
    assert check(report, INDEXER).measured["keys_dropped"] > 0.1


def _axk2_interleaved(monkeypatch):
    """A mutated analyzer: A.X-K2's indexer row given GLM-5's interleaved RoPE (the other family's layout)."""
    from dataclasses import replace

    from model_infer_kvcache.analyzer import config_loader

    families = dict(config_loader.INDEXER_FAMILIES)
    families["axk2"] = replace(families["axk2"], rope="interleave")
    monkeypatch.setattr(config_loader, "INDEXER_FAMILIES", families)


AXK2_MISTAKES = [
    # the indexer's RoPE layout swapped in the analyzer's family table: the render rotates interleaved pairs
    ("analyzer-rope-layout-swapped", "framework", None, None, None, NUMERIC),
    # the same swap in a hand-edited render
    ("render-rope-layout-swapped", "standalone", ATTN,
     r"torch_npu\.npu_rotary_mul\(x\.reshape\(t, n, 1, r\), cos, sin\)",
     "torch_npu.npu_interleave_rope(x.reshape(t, n, 1, r).contiguous(), cos, sin)", NUMERIC),
    # the top-k over the next request's keys too (prefix-sum key lengths)
    ("topk-over-other-requests-keys", "standalone", ATTN,
     r"actual_seq_lengths_key=as_int32\(forward_metadata\.actual_seq_lengths_kv\)",
     "actual_seq_lengths_key=as_int32(forward_metadata.actual_seq_lengths_cu_kv)", INDEXER),
    # the wrong top-k
    ("wrong-index-topk", "framework", ATTN, r"sparse_count=INDEX_TOPK,", "sparse_count=INDEX_TOPK // 2,", SPARSE),
]


@pytest.mark.slow
@pytest.mark.parametrize("case, mode, name, pattern, replacement, failing", AXK2_MISTAKES,
                         ids=[m[0] for m in AXK2_MISTAKES])
def test_an_axk2_mistake_fails_by_name(tmp_path, monkeypatch, case, mode, name, pattern, replacement, failing):
    if name is None:
        _axk2_interleaved(monkeypatch)
    manifest, rendered, config = _case(tmp_path, "axk2", mode, _narrow, **AXK2)
    if name is None:
        assert SelectionManifest.model_validate_json(manifest.read_text()).dsa.index_rope == "interleave"
        monkeypatch.undo()  # judged against transformers' AXK2Indexer, which rotates half-split pairs
    else:
        mutate(rendered, pattern, replacement, name=name)
    report = _fails_by_name(manifest, rendered, config, failing)
    if case == "wrong-index-topk":
        assert "sparse_count 32 != index_topk 64" in check(report, INDEXER).detail
