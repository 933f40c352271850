"""Families the family sweep refused that transformers' own code shows kvcache can plan (issue 40).

Learnable sinks: gpt-oss, and the three transformers ships without a config field saying so (Flint, Granite-SWA,
GraniteMoE-SWA: their modeling code holds ``self.sinks``; Granite's ``sigmoid(logsumexp - sink)`` scaling is the same
extra softmax logit). They were refused by the cross-check ("attention sinks: analyzer none"); now planned with FA
v2's learnable_sink and validated. Gemma-4 Unified: Gemma-4's attention under another model_type."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from validators_support import check, mutate, run_validate

FAMILIES = ("flint", "granite_swa", "granitemoe_swa")


def _config(tmp: Path, model_type: str) -> Path:
    from transformers import CONFIG_MAPPING

    path = tmp / f"{model_type}.json"
    path.write_text(json.dumps(CONFIG_MAPPING[model_type]().to_dict()), encoding="utf-8")
    return path


@pytest.mark.parametrize("model_type", FAMILIES)
def test_sink_families_are_planned_with_their_sinks(tmp_path, model_type):
    m = analyze(AnalyzeRequest(config=str(_config(tmp_path, model_type))))
    assert m.model.has_sinks and m.fa.version == "v2" and not m.blockers
    assert "sinks" in m.model.sources["has_sinks"]


@pytest.mark.slow
def test_granite_swa_validates_with_its_sinks_and_fails_without_them(tmp_path):
    from model_infer_kvcache.implementer.render import render_manifest, write_rendered

    config = _config(tmp_path, "granite_swa")
    manifest = analyze(AnalyzeRequest(config=str(config), deploy_mode="framework"))
    (tmp_path / "m.json").write_text(manifest.to_json(), encoding="utf-8")
    for name, drop in (("clean", False), ("no_sink", True)):
        rendered = tmp_path / name
        write_rendered(render_manifest(manifest), rendered)
        if drop:  # the port that forgets the sinks: FA without learnable_sink
            mutate(rendered, r"\n\s+learnable_sink=self\.sinks,", "")
        report = run_validate(tmp_path / "m.json", rendered, config)
        numeric = check(report, "logits vs transformers")
        assert numeric.passed == (not drop), (name, [(c.name, c.detail) for c in report.failed()])


def test_gemma4_unified_is_planned_as_the_gemma4_family(tmp_path):
    """Gemma-4 Unified runs Gemma4's attention (q/k RMS-normed, scores unscaled: its module's scaling is 1, the
    per-layer global head_dim): planned as the gemma4 family, which the cross-check against transformers' own
    modules confirms (it refused the head_dim^-0.5 plan before); its per-layer shapes are recorded, and render
    refuses them by name as it does Gemma-4's."""
    from model_infer_kvcache.analyzer.errors import InputError
    from model_infer_kvcache.implementer.render import render_manifest

    for model_type in ("gemma4_unified", "gemma4_unified_text"):
        m = analyze(AnalyzeRequest(config=str(_config(tmp_path, model_type))))
        assert m.fa.softmax_scale == 1.0 and m.model.family == "gemma4"
        assert any(layer.head_dim for layer in m.layers)  # the global layers' own head_dim
        with pytest.raises(InputError, match="per-layer attention shapes"):
            render_manifest(m)
