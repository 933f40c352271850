"""Gemma-4's scale rule (issue 23): transformers' Gemma4TextAttention normalises q and k per head (q_norm, k_norm)
and does not scale the scores (``self.scaling = 1.0``); the analyzer knows it instead of refusing the config as if
the input were wrong."""

from __future__ import annotations

import json


def test_gemma4_text_scale_is_one_and_transformers_agrees(tmp_path):
    import inspect

    import transformers
    from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
    from transformers.models.gemma4 import modeling_gemma4

    # the rule's source: transformers' own attention module
    assert "self.scaling = 1.0" in inspect.getsource(modeling_gemma4.Gemma4TextAttention.__init__)
    config = tmp_path / "gemma4.json"
    config.write_text(json.dumps(transformers.Gemma4TextConfig().to_dict(), default=str))
    manifest = analyze(AnalyzeRequest(config=str(config)))  # the meta-device cross-check runs and agrees
    assert manifest.fa.softmax_scale == 1.0
    assert "q/k RMS-normalised" in manifest.fa.scale_derivation


def test_other_gemma_families_keep_their_rules():
    """Negative control: Gemma 3 still scales by query_pre_attn_scalar^-0.5."""
    from pathlib import Path

    from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze

    cfg = Path(__file__).parent / "fixtures" / "configs" / "gemma3_27b.json"
    manifest = analyze(AnalyzeRequest(config=str(cfg)))
    assert abs(manifest.fa.softmax_scale - 168 ** -0.5) < 1e-12
