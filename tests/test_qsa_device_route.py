"""Qwen4-Exp's QSA rendered on the pinned torch_npu ops and validated against transformers (issue 40).

transformers' Qwen4ExpTextQSAIndexer._select_tokens scores, per query, the complete blocks of
``indexer_compress_ratio`` raw indexer keys (their float mean, k_layernorm'd, RoPE'd at the block's first position)
by ``sum_h relu(q_h . k) / sqrt(indexer_head_dim)``, keeps the top ``indexer_budget / indexer_compress_ratio`` blocks
plus the incomplete tail block, and masks Qwen4ExpTextAttention's GQA softmax to those tokens. The render
(templates/kinds/qsa_attention.py.j2) does the same with kvcache's emulation of the ops as their docs state them
(torch_npu 2.14.0 ``_op_plugin_docs.py``): the raw indexer keys in a paged entry, each block pooled into a second
paged entry once its last token is written, ``npu_lightning_indexer`` (:1371) over the pooled keys with one query per
TND row and its own visible-block count, then ``npu_sparse_flash_attention`` (:1474) over the paged K/V with the
selected blocks' tokens and the tail, valid indices first (:1481). The released budget (2048 tokens) keeps every
block of a CPU prompt, so the run narrows it to 8 blocks (validators/kinds/qsa.py); the stream's prompts (61, 42, 37
tokens) are not multiples of the block, one request finishes early and a late one reuses its freed (poisoned)
blocks. The realistic mistakes of a QSA port fail by check ID (V301 numeric, V235 selection)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from model_infer_kvcache.validators.pipeline.request_stream import Scenario
from validators_support import check, mistaken_report, render_case, run_validate

ATTN = "kvcache_attention.py"
NUMERIC, SELECTION, AS_WRITTEN = "logits vs transformers", "QSA selection:", "as written: "
# the released QSA fields and rope (benchmarks/sweep_families.py _PUBLISHED_FIELDS), two attention layers
QSA = {"indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 128, "indexer_budget": 2048,
       "indexer_compress_ratio": 4,
       "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
       "num_hidden_layers": 2, "layer_types": ["indexed_attention"] * 2}
STREAM = Scenario(first=((61, 3), (42, 4)), late=((37, 3),), max_concurrency=2, release_requests=1)


def _case(tmp: Path, mode: str, **over) -> tuple[Path, Path, Path]:
    from transformers import CONFIG_MAPPING

    config = tmp / "qwen4_exp_text.json"
    config.write_text(json.dumps({**CONFIG_MAPPING["qwen4_exp_text"]().to_dict(), **QSA, **over}), encoding="utf-8")
    return render_case(tmp, config.stem, config_path=str(config), deploy_mode=mode)


@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_qsa_renders_on_the_pinned_ops_and_matches_transformers(tmp_path, mode):
    case = _case(tmp_path, mode)
    text = (case[1] / ATTN).read_text(encoding="utf-8")
    assert "torch_npu.npu_lightning_indexer(" in text and "torch_npu.npu_sparse_flash_attention(" in text
    report = run_validate(*case, scenario=STREAM)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert check(report, NUMERIC).measured["max_abs_diff"] <= 1e-9
    assert check(report, SELECTION).measured["calls"] > 0
    assert any("indexer_budget 2048 -> 32 (8 blocks)" in n for n in report.notes), report.notes


# (id, pattern, replacement, the check that names the mistake)
MISTAKES = [
    # the pooled key rotated at the block's last position (where the token completing it sits), not its first
    ("pooled-key-rope-at-last-token", r"block_rope\(last - QSA_RATIO \+ 1\)", "block_rope(last)", NUMERIC),
    # the incomplete tail block left out of the selection (only whole blocks attended)
    ("tail-block-dropped", r"torch\.cat\(\[tokens, tail\], dim=-1\)", "torch.cat([tokens, tail * 0 - 1], dim=-1)",
     SELECTION),
]


@pytest.mark.parametrize("case, pattern, replacement, failing", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_qsa_render_mistake_fails_by_name(tmp_path, case, pattern, replacement, failing):
    report = mistaken_report(_case(tmp_path, "framework"), pattern, replacement, STREAM)
    # the released budget is wider than CPU prompts: the given render runs as written with only its QSA_BLOCK_TOPK
    # narrowed, its checks named "as written: ..." (the implementer's own render passes: the tests above)
    assert any("with only its QSA_BLOCK_TOPK set to 8" in n for n in report.notes), report.notes
    assert not check(report, AS_WRITTEN + failing).passed, [(c.name, c.detail) for c in report.failed()]


def test_a_manifest_without_a_qsa_entry_is_refused_by_path(tmp_path):
    """A hand edit dropping an attention layer's pooled block-key entry would leave the indexer reading keys nobody
    wrote: the manifest's invariant refuses it naming the layer's caches."""
    from model_infer_kvcache.analyzer.manifest import SelectionManifest

    data = json.loads(_case(tmp_path, "framework")[0].read_text(encoding="utf-8"))
    layer = next(i for i, plan in enumerate(data["layers"]) if plan.get("caches"))
    data["layers"][layer]["caches"] = [c for c in data["layers"][layer]["caches"]
                                       if c["name"] != "indexer_block_key_cache"]
    with pytest.raises(ValueError, match=rf"layers\[{layer}\]\.caches: decoder layer \d+ lacks QSA's"):
        SelectionManifest.model_validate(data)


def test_the_cross_check_compares_the_plan_with_the_modules_indexer():
    """analyzer/arch_check.py's cross-check: a QSA plan's indexer entries against the transformers module's own
    indexer (Qwen4ExpTextAttention.indexer), and a GQA plan of a module holding one is another format's parts."""
    import types

    from model_infer_kvcache.analyzer.kinds import gqa, qsa
    from model_infer_kvcache.analyzer.manifest import CacheSpec

    module = types.SimpleNamespace(indexer=types.SimpleNamespace(index_qk_proj=None, compress_ratio=4,
                                                                 index_head_dim=128))
    facts = qsa.FORMAT.hf_facts(module)
    assert facts == {"qsa_indexer_head_dim": 128}
    kv = [CacheSpec(name=n, dim=256, num_head=2, dtype="bfloat16") for n in ("k_cache", "v_cache")]
    planned = types.SimpleNamespace(caches=kv + qsa.entries(qsa.QsaFacts(4, 128, 2048, 4, 64, ""), "bfloat16"))
    assert qsa.FORMAT.hf_off(planned, facts, "Qwen4ExpTextAttention") is None
    narrow = types.SimpleNamespace(caches=kv + qsa.entries(qsa.QsaFacts(4, 64, 2048, 4, 32, ""), "bfloat16"))
    assert "QSA indexer" in qsa.FORMAT.hf_off(narrow, facts, "Qwen4ExpTextAttention")
    assert "another format's parts" in gqa.FORMAT.hf_off(types.SimpleNamespace(caches=kv), facts, "Qwen4ExpTextAttention")
