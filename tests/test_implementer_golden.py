"""Golden renders: a fresh analyze + render of every case must equal the committed files.

On a failure caused by an intended template (or analyzer) change, run
``python tests/golden/regenerate.py`` and review the diff before committing it.
"""

from __future__ import annotations

import difflib
import importlib.util
import sys
from pathlib import Path

import pytest
from model_infer_kvcache.analyzer.manifest_io import load_manifest

ROOT = Path(__file__).resolve().parent.parent
HINT = "if the change is intended, run `python tests/golden/regenerate.py` and review the diff"


def _golden_module():
    """tests/golden/regenerate.py (the case table), loaded once by path: tests/ is not a package."""
    if "golden_regenerate" not in sys.modules:
        spec = importlib.util.spec_from_file_location("golden_regenerate", ROOT / "tests" / "golden" / "regenerate.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["golden_regenerate"] = module
        spec.loader.exec_module(module)
    return sys.modules["golden_regenerate"]


golden = _golden_module()
IDS = [case.id for case in golden.CASES]


def _diff(name: str, stored: str, fresh: str) -> str:
    lines = difflib.unified_diff(stored.splitlines(), fresh.splitlines(), f"stored/{name}", f"fresh/{name}",
                                 lineterm="", n=1)
    return "\n".join(list(lines)[:40])


def _stored(case) -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(case.dir.iterdir()) if p.is_file()}


@pytest.mark.parametrize("case", golden.CASES, ids=IDS)
def test_rendering_the_stored_manifest_reproduces_the_golden_files(case):
    """Template drift: the stored manifest rendered now must give the stored files, byte for byte."""
    stored = _stored(case)
    assert golden.MANIFEST_FILE in stored, f"{case.dir}: no manifest; {HINT}"
    fresh = golden.render_case(case, load_manifest(case.dir / golden.MANIFEST_FILE))
    assert sorted(fresh) == sorted(n for n in stored if n != golden.MANIFEST_FILE), f"{case.id}: file set; {HINT}"
    for name, text in fresh.items():
        assert text == stored[name], f"{case.id}/{name} drifted from the templates; {HINT}\n" + \
            _diff(name, stored[name], text)


@pytest.mark.parametrize("case", golden.CASES, ids=IDS)
def test_stored_manifest_is_what_the_analyzer_produces_from_the_fixture(case):
    """Manifest drift: the analyzer, run on the fixture config with the case's flags, gives the stored manifest."""
    stored = (case.dir / golden.MANIFEST_FILE).read_text(encoding="utf-8")
    fresh = golden.analyze_case(case).to_json()
    assert fresh == stored, f"{case.id}/manifest.json differs from a fresh `kvcache analyze {' '.join(case.argv)}`;" \
        f" {HINT}\n" + _diff(golden.MANIFEST_FILE, stored, fresh)


def test_golden_directory_holds_exactly_the_cases():
    on_disk = {f"{p.parent.name}/{p.name}" for p in (ROOT / "tests" / "golden").glob("*/*") if p.is_dir()}
    assert on_disk == set(IDS), f"stale or missing case directories; {HINT}"


def test_cases_cover_the_acceptance_matrix():
    """Every design the issue names, in framework G1, framework G2 and standalone."""
    by_model = {}
    for case in golden.CASES:
        m = load_manifest(case.dir / golden.MANIFEST_FILE)
        by_model.setdefault(case.model.name, {})[case.mode] = m
        assert m.inputs.config == case.model.config and not Path(m.inputs.config).is_absolute()
        assert m.deploy_mode.value == ("standalone" if case.mode == "standalone" else "framework")
        if case.mode != "standalone":
            assert m.framework_api == case.mode[-2:].upper()
    assert all(set(modes) == set(golden.MODES) for modes in by_model.values())

    def one(name):
        return by_model[name]["framework_g2"]

    def kinds(m):
        return {layer.attn_type for layer in m.layers}

    assert one("qwen3_v1").fa.version == "v1" and one("qwen3_v2").fa.version == "v2"
    assert one("qwen3_v1").model.attention_kind == "gqa" and kinds(one("qwen3_v1")) == {"FullAttention"}
    gpt = one("gpt_oss")
    assert gpt.fa.version == "v2" and gpt.model.has_sinks and kinds(gpt) == {"FullAttention", "SlidingWindow"}
    assert kinds(one("mistral")) == {"SlidingWindow"}
    for name, q_lora in (("deepseek_v3", True), ("deepseek_v2_lite", False)):
        m = one(name)
        assert m.mla.enabled and m.mla.absorb and (m.model.mla.q_lora_rank is not None) == q_lora
    legacy = one("gemma2_legacy")
    assert legacy.kv_mode.value == "legacy" and legacy.blockers and kinds(legacy) == {"FullAttention", "SlidingWindow"}
    assert legacy.legacy_attention.kernel == "model" and legacy.legacy_attention.softcap == 50.0
    requested = one("gemma3_legacy")  # Legacy on the user's request: one BSH FA call
    assert requested.kv_mode.value == "legacy" and not requested.blockers and requested.legacy_attention.kernel == "fa"
    assert kinds(requested) == {"FullAttention", "SlidingWindow"}
    assert all(m.kv_mode.value == "paged" and not m.blockers and m.legacy_attention is None
               for n, modes in by_model.items() for m in modes.values() if not n.endswith("_legacy"))
