"""Issue #26 item 3: the Legacy path keeps the model's own attention where FA cannot express it.

Gemma-2 (``attn_logit_softcapping``) is blocked from paged FA. ``kvcache render --allow-blocked`` then
renders the model's own eager attention over the contiguous cache (scale, tanh soft-cap, causal mask,
each sliding layer's window) with no FA call, and the bundle's own ``kvcache validate`` passes it
against transformers' Gemma2 in framework and standalone mode. The negative controls drop the
soft-cap from the render (validate fails on the logits) or put an FA call back (V220 fails).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from model_infer_kvcache import cli as kvcache_cli

SOFTCAP = 50.0
WINDOW = 64  # shrunk so the Legacy stream (prompts of 150+) crosses it on prefill and decode


def _gemma2_config(path: Path) -> Path:
    """transformers' own Gemma2Config (its defaults: soft-cap 50, alternating sliding/full layers), shrunk."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma2Config(
        num_hidden_layers=4, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, query_pre_attn_scalar=64, sliding_window=WINDOW, vocab_size=512, max_position_embeddings=2048)
    assert config.attn_logit_softcapping == SOFTCAP
    path.write_text(json.dumps(config.to_dict(), indent=1), encoding="utf-8")
    return path


def _kvcache(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = kvcache_cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _analyze_and_render(tmp_path: Path, capsys, mode: str) -> tuple[Path, Path, Path]:
    config = _gemma2_config(tmp_path / "config.json")
    manifest, rendered = tmp_path / f"manifest_{mode}.json", tmp_path / f"rendered_{mode}"
    flags = ["--deploy-mode", mode] + (["--framework-api", "G2"] if mode == "framework" else [])
    rc, _, err = _kvcache(capsys, "analyze", "--config", config, *flags, "--out", manifest)
    assert rc == 0, err
    decided = json.loads(manifest.read_text(encoding="utf-8"))
    assert decided["kv_mode"]["value"] == "legacy" and decided["blockers"]
    assert decided["legacy_attention"]["kernel"] == "model" and decided["legacy_attention"]["softcap"] == SOFTCAP
    rc, _, err = _kvcache(capsys, "render", "--manifest", manifest, "--out", rendered, "--allow-blocked")
    assert rc == 0, err
    return config, manifest, rendered


def _validate(tmp_path: Path, capsys, config: Path, manifest: Path, rendered: Path) -> tuple[int, dict]:
    report = tmp_path / f"report_{rendered.name}.json"
    rc, _, _ = _kvcache(capsys, "validate", "--manifest", manifest, "--rendered", rendered, "--config", config,
                        "--report", report, "--no-sweep")
    return rc, json.loads(report.read_text(encoding="utf-8"))


def _checks(report: dict) -> dict[str, dict]:
    return {c["id"]: c for c in report["checks"]}


@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_gemma2_legacy_render_keeps_the_soft_cap_and_validates(tmp_path, capsys, mode):
    config, manifest, rendered = _analyze_and_render(tmp_path, capsys, mode)
    code = (rendered / "kvcache_attention.py").read_text(encoding="utf-8")
    assert "npu_fused_infer_attention_score" not in code and f"ATTN_LOGIT_SOFTCAPPING = {SOFTCAP}" in code
    rc, report = _validate(tmp_path, capsys, config, manifest, rendered)
    failed = [(c["name"], c.get("detail")) for c in report["checks"] if not c["passed"]]
    assert rc == 0 and report["passed"], failed
    checks = _checks(report)
    assert checks["V220"]["measured"]["fa_calls"] == 0  # the model's own attention: no FA call
    assert "V209" not in checks  # no FA arguments to judge
    assert "ATTN_LOGIT_SOFTCAPPING" in checks["V108"]["measured"]["checked"]
    numeric = checks["V301"]["measured"]
    assert numeric["max_abs_diff"] <= report["tolerance"] == 1e-9
    # Both paths ran past the window, so the sliding layers' window was exercised too.
    assert min(numeric["longest_prefill"], numeric["longest_decode"]) > WINDOW
    assert checks["V303"]["passed"]


@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_gemma2_legacy_render_without_the_soft_cap_fails_validate(tmp_path, capsys, mode):
    """Negative control: the render with the tanh dropped (constants untouched) is caught on the logits."""
    config, manifest, rendered = _analyze_and_render(tmp_path, capsys, mode)
    path = rendered / "kvcache_attention.py"
    text, n = re.subn(r"scores = torch\.tanh\(scores / ATTN_LOGIT_SOFTCAPPING\) \* ATTN_LOGIT_SOFTCAPPING",
                      "scores = scores", path.read_text(encoding="utf-8"))
    assert n == 1
    path.write_text(text, encoding="utf-8")
    rc, report = _validate(tmp_path, capsys, config, manifest, rendered)
    checks = _checks(report)
    assert rc == 1 and not report["passed"]
    assert not checks["V301"]["passed"] and checks["V301"]["measured"]["max_abs_diff"] > 1e-3
    assert checks["V108"]["passed"] and checks["V220"]["passed"]  # only the numbers show the missing cap


def test_gemma2_legacy_render_with_the_cap_constant_off_fails_twice(tmp_path, capsys):
    """Negative control: ATTN_LOGIT_SOFTCAPPING edited to None is named by the constants check and the logits."""
    config, manifest, rendered = _analyze_and_render(tmp_path, capsys, "standalone")
    path = rendered / "kvcache_attention.py"
    path.write_text(path.read_text(encoding="utf-8").replace(f"ATTN_LOGIT_SOFTCAPPING = {SOFTCAP}",
                                                             "ATTN_LOGIT_SOFTCAPPING = None"), encoding="utf-8")
    rc, report = _validate(tmp_path, capsys, config, manifest, rendered)
    checks = _checks(report)
    assert rc == 1
    assert not checks["V108"]["passed"] and "ATTN_LOGIT_SOFTCAPPING = None (manifest 50.0)" in checks["V108"]["detail"]
    assert not checks["V301"]["passed"]


def test_an_fa_call_in_an_own_attention_render_is_named():
    """V220 fails on any FA call, naming the operator, step and layer (an FA call would drop the soft-cap)."""
    from model_infer_kvcache.validators.pipeline.legacy_run import check_no_fa_call
    from model_infer_kvcache.validators.pipeline.report import Report

    report = Report(backend="emulated", deploy_mode="standalone", model_type="gemma2", manifest_hash="-")
    check_no_fa_call(report, [])
    check_no_fa_call(report, [{"op": "npu_fused_infer_attention_score", "step": 0, "layer": 1}])
    ok, bad = report.checks
    assert ok.id == bad.id == "V220" and ok.passed and not bad.passed
    assert bad.detail == "npu_fused_infer_attention_score called at step 0 layer 1"


def test_the_analyzer_keeps_fa_only_where_fa_expresses_the_attention():
    """Legacy on request (no blocker): one BSH FA call; a blocker: the model's own attention; paged: none."""
    from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze

    configs = Path(__file__).resolve().parent / "fixtures" / "configs"
    requested = analyze(AnalyzeRequest(config=str(configs / "qwen3_8b.json"), kv_mode="legacy"))
    blocked = analyze(AnalyzeRequest(config=str(configs / "gemma2_9b.json")))
    paged = analyze(AnalyzeRequest(config=str(configs / "qwen3_8b.json")))
    assert requested.legacy_attention.kernel == "fa" and requested.legacy_attention.softcap is None
    assert blocked.legacy_attention.kernel == "model" and blocked.legacy_attention.softcap == SOFTCAP
    assert "soft-capping" in blocked.legacy_attention.reason
    assert paged.legacy_attention is None


def test_manifest_refuses_an_fa_kernel_with_a_soft_cap():
    """A hand edit that asks FA to apply the soft-cap contradicts the manifest (FA has none)."""
    from model_infer_kvcache.analyzer.manifest import ManifestInvariantError, SelectionManifest

    golden = Path(__file__).resolve().parent / "golden" / "gemma2_legacy" / "standalone" / "manifest.json"
    data = json.loads(golden.read_text(encoding="utf-8"))
    data["legacy_attention"]["kernel"] = "fa"
    with pytest.raises(ValueError, match="legacy_attention.kernel: fa cannot apply a soft-cap"):
        SelectionManifest.model_validate(data)
    data["legacy_attention"]["kernel"] = "model"
    assert SelectionManifest.model_validate(data).legacy_attention.kernel == "model"
    assert issubclass(ManifestInvariantError, ValueError)


def test_alibi_legacy_render_is_refused_not_rendered_as_fa():
    """ALiBi's bias convention is the family's own: no template renders it, and an FA call would drop it."""
    from model_infer_kvcache.analyzer.errors import InputError
    from model_infer_kvcache.implementer.render import render_manifest
    from model_infer_kvcache.validators.docgen.doc_tables import kind_manifest

    m = kind_manifest("alibi")
    assert m.legacy_attention.kernel == "model" and m.legacy_attention.alibi
    with pytest.raises(InputError, match="ALiBi"):
        render_manifest(m, allow_blocked=True)
