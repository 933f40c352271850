"""Cross-layer KV sharing (issue 40, Gemma-3n): the last ``num_kv_shared_layers`` layers compute no K/V and read the
cache of the last earlier layer of their own type (transformers' Gemma3nTextConfig.kv_sharing_modes: the "store"
layer of each layer type, read by every "reuse" layer). The analyzer plans them with no cache of their own, the
render reads the source's cache through the same block table in both modes, and the realistic mistakes fail by name.
The config is transformers' Gemma3nTextConfig at 10 layers with 5 shared (the published model: 35 and 15).
"""

from __future__ import annotations

import json

import pytest
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from model_infer_kvcache.validators.pipeline.request_stream import Scenario
from validators_support import CONFIGS, check, mutate, render_case, run_validate  # noqa: F401

pytest.importorskip("transformers")

CONFIG = "gemma3n_text_10l"
NUMERIC, COUNT, STANDALONE_INIT = "logits vs transformers", "get_cache_info layer count", "_init_kvcache caches"
# The validations run a 5-layer cut of the same config, the smallest that still shares both ways: layers 0-2 own
# their caches (sliding, sliding, full), the last 2 share; layer 3 (sliding) reads layer 1, the last sliding owner
# (not layer 0), layer 4 (full) reads layer 2. A window of 32, under MAX_CPU_WINDOW, so the render under test is
# the one the checks run (a longer one is re-rendered at CPU size and the given render also runs as written).
SMALL_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]
SMALL = {"num_hidden_layers": 5, "layer_types": SMALL_TYPES, "num_kv_shared_layers": 2,
         "intermediate_size": [16384] * 5, "activation_sparsity_pattern": [0.0] * 5, "sliding_window": 32}
SOURCES = "KV_SOURCE_LAYERS = {3: 1, 4: 2}"
# two requests in the first batch, a late admit into freed blocks, the window crossed (the stream stretches the
# longest prompt past it by two blocks)
SHORT = Scenario(first=((40, 3), (20, 2)), late=((30, 2),), max_concurrency=2, release_requests=2)
# the negative controls: one request, its prefill past the window and two decode steps (every mistake below shows in
# the prefill or the first decode)
ONE = Scenario(first=((20, 2),), late=(), max_concurrency=1, release_requests=0)


def _manifest(tmp_path, **changes) -> SelectionManifest:
    data = {**json.loads((CONFIGS / f"{CONFIG}.json").read_text(encoding="utf-8")), **changes}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return analyze(AnalyzeRequest(config=str(path)))


def test_shared_layers_hold_no_cache_and_read_the_last_earlier_layer_of_their_type(tmp_path):
    m = _manifest(tmp_path)
    assert not m.blockers and m.kv_mode.value == "paged"
    assert [layer.kv_source_layer for layer in m.layers] == [None] * 5 + [3, 3, 3, 3, 4]
    assert [len(layer.caches) for layer in m.layers] == [2] * 5 + [0] * 5
    # memory: only the 5 owners count (4 sliding + 1 full, 2 KV heads x 256, bfloat16); the reason names the field
    assert m.memory.per_token_bytes == 5 * 2 * 2 * 256 * 2
    assert [(g.group_key, g.num_layers) for g in m.memory.groups] == [("FullAttention", 1), ("SlidingWindow", 4)]
    assert any("num_kv_shared_layers" in line and "hold no cache" in line for line in m.memory.derivation)
    # Gemma-3n's attention is unscaled (q/k RMS-normalised per head; transformers' scaling = 1.0)
    assert m.fa.softmax_scale == 1.0
    dumped = m.model_dump(mode="json")
    assert "kv_source_layer" not in dumped["layers"][0] and dumped["layers"][9]["kv_source_layer"] == 4
    assert SelectionManifest.model_validate(dumped) == m


def test_no_sharing_plans_every_layer_its_own_cache(tmp_path):
    m = _manifest(tmp_path, num_kv_shared_layers=0)
    assert all(layer.kv_source_layer is None and len(layer.caches) == 2 for layer in m.layers)


def test_every_layer_shared_is_refused_naming_the_field(tmp_path):
    with pytest.raises(InputError, match="num_kv_shared_layers"):
        _manifest(tmp_path, num_kv_shared_layers=10)


@pytest.mark.parametrize("source, why", [(4, "is FullAttention"), (5, "holds no K/V cache of its own"),
                                         (8, "is not an earlier layer")])
def test_a_hand_edited_source_breaks_the_manifest_invariants(tmp_path, source, why):
    data = _manifest(tmp_path).model_dump(mode="json")
    data["layers"][6]["kv_source_layer"] = source
    with pytest.raises(ValueError, match=rf"layers\[6\]\.kv_source_layer: .*{why}"):
        SelectionManifest.model_validate(data)


def test_a_shared_layer_with_cache_entries_breaks_the_manifest_invariants(tmp_path):
    data = _manifest(tmp_path).model_dump(mode="json")
    data["layers"][6]["caches"] = data["layers"][3]["caches"]
    with pytest.raises(ValueError, match=r"layers\[6\]\.caches: 2 entries on a KV-shared layer"):
        SelectionManifest.model_validate(data)


def test_the_cross_check_names_a_wrong_source_layer(tmp_path):
    """The analyzer reading the other type's layer (a wrong sharing rule) is refused against transformers'
    kv_sharing_modes, naming the layer and its source."""
    from model_infer_kvcache.analyzer import arch_check
    from model_infer_kvcache.analyzer.config_loader import normalize_config
    from model_infer_kvcache.analyzer.rules import decide_scale

    config = json.loads((CONFIGS / f"{CONFIG}.json").read_text(encoding="utf-8"))
    m = _manifest(tmp_path)
    facts = normalize_config(config)
    scale, txt = decide_scale(facts)
    assert not arch_check.cross_check(config, facts, list(m.layers), scale, txt).errors
    wrong = [layer.model_copy(update={"kv_source_layer": 4}) if layer.index == 5 else layer for layer in m.layers]
    errors = arch_check.cross_check(config, facts, wrong, scale, txt).errors
    assert any("KV sharing" in e and "layer 5 reading layer 4's cache" in e and "layer 3's K/V" in e
               for e in errors), errors
    own = [layer.model_copy(update={"kv_source_layer": None}) if layer.index == 9 else layer for layer in m.layers]
    errors = arch_check.cross_check(config, facts, own, scale, txt).errors
    assert any("layer 9 reading its own K/V cache" in e for e in errors), errors


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_kv_sharing_renders_and_validates_against_transformers(tmp_path, mode):
    manifest, rendered, cfg = render_case(tmp_path, CONFIG, SMALL, deploy_mode=mode)
    text = (rendered / "kvcache_attention.py").read_text(encoding="utf-8")
    assert SOURCES in text
    report = run_validate(manifest, rendered, cfg, scenario=SHORT)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert check(report, NUMERIC).measured["max_abs_diff"] <= 1e-9
    if mode == "framework":  # the framework allocates caches for the 3 owners only
        assert check(report, COUNT).measured == {"expected": 3, "got": 3}


OWN_CACHE_FRAMEWORK = [(r"        if self\.kv_source_layer is not None:\n            self\.cache_entries = \[\].*\n"
                        r"            return\n", ""),
                       (r"return self if self\.kv_source_layer is None else self\.kv_source", "return self")]
OWN_CACHE_STANDALONE = [(r"        if self\.kv_source_layer is not None:\n            return\n", ""),
                        (r"return self if self\.kv_source_layer is None else self\.kv_source", "return self")]
MISTAKES = [
    # the shared layers read the last owner of the other attention type
    ("source-of-the-other-type", "standalone", [(r"\{3: 1, 4: 2\}", "{3: 2, 4: 1}")], NUMERIC),
    # an earlier owner of the right type, not the last one (layer 0 for the sliding layer 3)
    ("source-one-layer-early", "framework", [(r"\{3: 1, 4: 2\}", "{3: 0, 4: 2}")], NUMERIC),
    # a shared layer given its own cache, never written: the framework allocates it, the count names it
    ("own-never-written-cache", "framework", OWN_CACHE_FRAMEWORK, COUNT),
    ("own-never-written-cache", "standalone", OWN_CACHE_STANDALONE, STANDALONE_INIT),
]


@pytest.mark.slow
@pytest.mark.parametrize("case, mode, edits, failing", MISTAKES, ids=[f"{m[0]}-{m[1]}" for m in MISTAKES])
def test_a_kv_sharing_mistake_fails_by_name(tmp_path, monkeypatch, case, mode, edits, failing):
    from model_infer_kvcache.validators.pipeline import validate

    # the check that fails is the point here, not the sub-module localisation's replay of it (twice the run)
    monkeypatch.setattr(validate, "_localise", lambda *args, **kwargs: None)
    manifest, rendered, cfg = render_case(tmp_path, CONFIG, SMALL, deploy_mode=mode)
    for pattern, replacement in edits:
        mutate(rendered, pattern, replacement)
    report = run_validate(manifest, rendered, cfg, scenario=ONE)
    assert not report.passed
    assert not check(report, failing).passed, [(c.name, c.detail) for c in report.failed()]
    if failing == NUMERIC:  # the first shared layer named (Gemma-3n's AltUp-stacked layer outputs read right)
        assert "first diverging layer 3" in check(report, NUMERIC).detail
