"""Chunked local attention (Llama-4): planned as a kind of its own, rendered in both deployment modes, validated against
transformers' own Llama4ForCausalLM, and the realistic mistakes named by the numeric check.

A query at position p attends the keys in [floor(p / C) * C, p]. The fixture is Llama-4 Scout with its chunk cut to
one block (128), so the QUICK stream crosses chunks in prefill (prompts of 150 and 300: virtual requests 128 + 22 and
128 + 128 + 44) and on decode (the late requests sit on the boundaries: Scenario.crossing_chunks_of).
"""

from __future__ import annotations

import json

import pytest
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from model_infer_kvcache.implementer.render import render_manifest
from model_infer_kvcache.validators.pipeline.request_stream import QUICK, Scenario
from model_infer_kvcache.validators.pipeline.tiny_model import cpu_sized
from validators_support import CONFIGS, check, mutate, render_case, run_validate

SCOUT = json.loads((CONFIGS / "llama4_scout.json").read_text(encoding="utf-8"))
CHUNK = 128
NUMERIC = "logits vs transformers"
# the negative controls' stream: one prompt of three chunks and an early finish; the late requests on the boundaries
# (crossing_chunks_of) decode across 2 x chunk and from a chunk's first position
SHORT = Scenario(first=((300, 2), (40, 2)), late=(), max_concurrency=2, release_requests=0)


def _small_chunk(**text) -> dict:
    return {"text_config": {**SCOUT["text_config"], "attention_chunk_size": CHUNK, **text}}


def _render(tmp_path, **analyze_kw):
    return render_case(tmp_path, "llama4_scout", _small_chunk(), framework_api="G2", **analyze_kw)


def _manifest(path) -> SelectionManifest:
    return SelectionManifest.model_validate_json(path.read_text(encoding="utf-8"))


def test_the_stream_crosses_chunk_boundaries_on_both_paths(tmp_path):
    manifest, _, _ = _render(tmp_path)
    m = _manifest(manifest)
    scenario = QUICK.crossing_chunks_of(m)
    assert max(n for n, _ in scenario.first) > 2 * CHUNK  # a prefill of three virtual requests
    # a late request decodes across 2 x chunk, one starts decoding on a chunk's first position
    assert any(n < 2 * CHUNK <= n + new - 1 for n, new in scenario.late)
    assert any(n % CHUNK == 0 for n, _ in scenario.late)
    assert cpu_sized(m) is None  # already CPU-sized: the render under test runs as written


def test_the_real_chunk_is_shrunk_to_one_block_for_cpu(tmp_path):
    manifest, _, _ = render_case(tmp_path, "llama4_scout")
    small = cpu_sized(_manifest(manifest))
    assert small.attention_chunk_size() == small.block_size == 128
    assert {layer.attention_chunk_size for layer in small.layers if layer.is_chunked} == {128}


@pytest.mark.parametrize("edit, field", [
    (lambda m: m["layers"][0].update(attention_chunk_size=None), "layers[0].attention_chunk_size"),
    (lambda m: m["layers"][3].update(attention_chunk_size=128), "layers[3].attention_chunk_size"),
    (lambda m: m["layers"][0].update(group_key="FullAttention"), "layers[0].group_key"),
    (lambda m: [layer.update(attention_chunk_size=192) for layer in m["layers"] if layer.get("attention_chunk_size")],
     "layers[0].attention_chunk_size"),
])
def test_a_chunk_the_render_cannot_read_is_refused_by_name(tmp_path, edit, field):
    manifest, _, _ = _render(tmp_path)
    data = json.loads(manifest.read_text(encoding="utf-8"))
    edit(data)
    with pytest.raises((InputError, ValueError)) as info:
        render_manifest(SelectionManifest.model_validate(data))
    assert field in str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_llama4_passes_against_transformers(tmp_path, mode):
    manifest, rendered, cfg = _render(tmp_path, **({"deploy_mode": mode} if mode == "standalone" else {}))
    report = run_validate(manifest, rendered, cfg)
    assert report.passed, [(c.id, c.name, c.detail) for c in report.checks if not c.passed]
    numeric = check(report, NUMERIC)
    assert numeric.measured["longest_prefill"] > 2 * CHUNK and numeric.measured["longest_decode"] > 2 * CHUNK


# Negative controls: each a mistake a port of chunked attention makes, which only running the code shows.
MISTAKES = {
    # the chunk start of a decode query taken from p - 1: floor((p - 1) / C) * C, one chunk late on a chunk's first
    # position (the late request whose prompt is exactly one chunk decodes there first)
    "decode chunk start off by one": (r"torch\.div\(kv_lens - 1, ", "torch.div(kv_lens - 2, "),
    # decode passes the chunk's KV length but the unshifted table: it reads the prefix's first blocks
    "decode table not shifted": (r"chunk_table = torch\.gather\(block_table, 1, columns\.clamp\(max=width - 1\)\)",
                                 "chunk_table = block_table"),
    # prefill split one position late: the first chunk of every request is C + 1 tokens
    "prefill boundaries off by one": (r"bounds\.extend\(range\(start \+ chunk, end, chunk\)\)",
                                      "bounds.extend(range(start + chunk + 1, end, chunk))"),
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_the_negative_controls_stream_passes_unmutated(tmp_path, mode):
    """The twin of every negative control below: the same render and stream without the mistake pass."""
    manifest, rendered, cfg = _render(tmp_path, **({"deploy_mode": mode} if mode == "standalone" else {}))
    report = run_validate(manifest, rendered, cfg, scenario=SHORT)
    assert report.passed and check(report, NUMERIC).passed, [c.name for c in report.checks if not c.passed]


@pytest.mark.slow
def test_the_off_by_one_of_the_other_side_is_refused_by_the_operator(tmp_path):
    """floor((p + 1) / C) * C as the chunk start: at p = C - 1 the chunk's KV length is 0, which FA refuses (the
    named check is the operator error's, before any numeric comparison)."""
    manifest, rendered, cfg = _render(tmp_path, deploy_mode="standalone")
    mutate(rendered, r"torch\.div\(kv_lens - 1, ", "torch.div(kv_lens, ")
    report = run_validate(manifest, rendered, cfg, scenario=SHORT)
    assert not check(report, "rendered code runs without operator errors").passed


@pytest.mark.slow
@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_a_chunk_mistake_fails_the_numeric_check(tmp_path, mistake):
    # framework mode for the unshifted table (its released blocks are the poisoned null block), standalone for the
    # others (its static table keeps every block, so a wrong key is read as a value, not refused)
    framework = mistake == "decode table not shifted"
    manifest, rendered, cfg = _render(tmp_path, **({} if framework else {"deploy_mode": "standalone"}))
    mutate(rendered, *MISTAKES[mistake])
    report = run_validate(manifest, rendered, cfg, scenario=SHORT)
    assert not report.passed
    assert not check(report, NUMERIC).passed, check(report, NUMERIC)


def test_a_linear_layer_planned_full_is_no_chunk_question(tmp_path):
    """A linear layer of an unknown family is planned FullAttention (a blocker says why): the chunk invariant asks its
    layer kind's spec (Mamba, which has no chunk flag) and must not fail on it (the sweep's lara_mini / MiniMax)."""
    manifest, _, _ = _render(tmp_path)
    data = json.loads(manifest.read_text(encoding="utf-8"))
    data["layers"][3]["layer_kind"] = "linear"
    assert SelectionManifest.model_validate(data).layers[3].layer_kind == "linear"
    data["layers"][3]["layer_kind"] = "chunked"  # a chunked config layer planned FullAttention is refused
    with pytest.raises(ValueError, match=r"layers\[3\]\.layer_kind"):
        SelectionManifest.model_validate(data)


def test_legacy_on_chunked_layers_keeps_the_model_attention(tmp_path):
    """Planned paged, chunked layers carry no blocker; forced Legacy, one BSH FA call has one band for the batch and
    cannot follow a chunk start: the Legacy decision names the chunk and keeps the model's own attention (it said
    'kernel fa, no blocker' before)."""
    from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze

    m = analyze(AnalyzeRequest(config=str(CONFIGS / "llama4_scout.json"), kv_mode="legacy"))
    assert m.legacy_attention.kernel == "model"
    assert "chunked local attention on 36 layers" in m.legacy_attention.reason
