"""MiniMax's lightning attention (transformers ``MiniMaxLightningAttention``, issue 40): the recurrence kvcache renders
for Ling-2.5 (S <- exp(-slope) S + k^T v, o = q S, no conv), with the query not scaled, planned as the lightning family
and validated against transformers' own module (not kvcache's Ling-2.5 reference), with the port mistakes that
matter failing by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.linear_config import LIGHTNING
from test_hybrid_render import LAYERS, NUMERIC, SHORT, mistake_fails_by_name
from validators_support import check, run_validate


def _config(tmp: Path, **over) -> Path:
    from transformers import MiniMaxConfig

    path = tmp / "minimax.json"
    path.write_text(json.dumps({**MiniMaxConfig().to_dict(), **over}, default=str), encoding="utf-8")
    return path


def test_minimax_is_planned_as_lightning_attention_with_unscaled_queries(tmp_path):
    """MiniMaxConfig's defaults: 32 heads of 4096 / 32 = 128, every other layer lightning; one recurrent state
    [H, D, D] per request, no conv; the query unscaled; transformers' own module is the reference, so the
    cross-check runs (Ling-2.5's is skipped: transformers has no such model)."""
    m = analyze(AnalyzeRequest(config=str(_config(tmp_path))))
    lin = m.linear_attention
    assert (lin.family, lin.num_v_heads, lin.head_k_dim, lin.conv_kernel) == (LIGHTNING, 32, 128, None)
    assert lin.layers == list(range(1, 32, 2)) and not m.blockers
    assert [(s.name, s.shape) for s in lin.states] == [("recurrent_state", [32, 128, 128])]
    assert lin.query_scale == 1.0 and lin.reference.startswith("transformers MiniMaxLightningAttention")
    assert not any("cross-check skipped" in w.message for w in m.warnings)


def _case(tmp: Path, mode: str):
    from model_infer_kvcache.implementer.render import render_manifest, write_rendered

    config = _config(tmp, num_hidden_layers=4, layer_types=["full_attention", "linear_attention"] * 2)
    manifest = analyze(AnalyzeRequest(config=str(config), deploy_mode=mode))
    (tmp / "manifest.json").write_text(manifest.to_json(), encoding="utf-8")
    write_rendered(render_manifest(manifest), tmp / "rendered")
    return tmp / "manifest.json", tmp / "rendered", config


@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_minimax_validates_against_transformers_lightning_attention(tmp_path, mode):
    manifest, rendered, cfg = _case(tmp_path, mode)
    text = (rendered / "kvcache_attention.py").read_text(encoding="utf-8")
    assert "def lightning_recurrence(" in text and "LINEAR_HEAD_K_DIM ** -0.5" not in text
    report = run_validate(manifest, rendered, cfg, scenario=SHORT)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert check(report, NUMERIC).measured["max_abs_diff"] <= 1e-9
    assert not any("Ling-2.5 reference" in n for n in report.notes)  # transformers' own model, not kvcache's


MINIMAX_MISTAKES = [
    # Ling-2.5's kernels scale the query by head_dim^-0.5; MiniMax's does not
    ("query-scaled-like-ling", r"(\n(\s+)decay = g\.exp\(\))", r"\n\2query = query * LINEAR_HEAD_K_DIM ** -0.5\1",
     NUMERIC),
    # prefill continues from the block (a reused one holds a finished request's state, poisoned once freed)
    ("prefill-reads-state", r"if forward_metadata\.is_prefill else self\.recurrent_state\[slot\]",
     "if False else self.recurrent_state[slot]", NUMERIC),
]


@pytest.mark.parametrize("case, pattern, replacement, failing", MINIMAX_MISTAKES, ids=[m[0] for m in MINIMAX_MISTAKES])
def test_a_minimax_port_mistake_fails_by_name(tmp_path, case, pattern, replacement, failing):
    report = mistake_fails_by_name(_case(tmp_path, "framework"), pattern, replacement, failing)
    assert check(report, LAYERS).passed
