"""Cross-attention-only decoder blocks (issue #40, Mllama): the blocks in text_config.cross_attention_layers attend
over the vision states only (transformers MllamaCrossAttentionDecoderLayer), planned as the cross kind's slots sized
by one image's vision states (vision_config), registered as cache layers of their own, the other blocks on the paged
self-attention cache. Analyzer at the published defaults; a CPU-sized composite config run in both modes, and the
render mistakes that must fail by name."""

from __future__ import annotations

import json

import pytest
import torch
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.kinds import cross as cross_kind
from model_infer_kvcache.implementer.render import render_manifest, write_rendered
from model_infer_kvcache.validators.pipeline.request_stream import Scenario
from validators_support import check, mutate, run_validate

transformers = pytest.importorskip("transformers")
FRAMEWORK, STANDALONE = "部署模式：框架部署", "部署模式：独立部署"
NUMERIC, CROSS_ENTRIES, LAYER_COUNT = "logits vs transformers", "cross-attention slot entries", "get_cache_info layer count"


def _published() -> dict:
    return transformers.MllamaConfig().to_dict()


def _write(tmp_path, data: dict, name: str = "config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data, default=str), encoding="utf-8")
    return path


def test_published_mllama_plans_its_cross_only_blocks_at_one_images_vision_length(tmp_path):
    m = analyze(AnalyzeRequest(config=str(_write(tmp_path, _published())), dispatch=FRAMEWORK))
    x = m.cross_attention
    assert x.layers == [3, 8, 13, 18, 23, 28, 33, 38] and not x.self_attention and x.module_attr == "cross_attn"
    # MllamaVisionModel.num_patches = (448 // 14) ** 2 + 1 = 1025 per tile, 4 tiles: 4100 vision positions
    assert x.max_encoder_len == 4 * ((448 // 14) ** 2 + 1) == 4100 and x.slot_tokens == 4224
    assert (x.num_heads, x.num_kv_heads, x.head_dim) == (32, 8, 128)  # GQA cross K/V (config.num_key_value_heads)
    assert len(m.layers) == 32 and {layer.decoder_layer for layer in m.layers}.isdisjoint(x.layers)
    assert [b.decoder_layer for b in m.no_cache_layers] == x.layers
    assert {b.block for b in m.no_cache_layers} == {cross_kind.ONLY_BLOCK}
    assert not m.blockers


def test_the_text_model_alone_is_blocked_by_name_or_sized_by_an_explicit_length(tmp_path):
    text = transformers.MllamaConfig().text_config.to_dict()
    m = analyze(AnalyzeRequest(config=str(_write(tmp_path, text)), dispatch=FRAMEWORK))
    assert m.cross_attention is None
    assert any("vision_config" in b.message and "max_source_positions" in b.message for b in m.blockers)
    sized = analyze(AnalyzeRequest(config=str(_write(tmp_path, {**text, "max_source_positions": 1601}, "t.json")),
                                   dispatch=FRAMEWORK))
    assert sized.cross_attention.max_encoder_len == 1601 and not sized.blockers


def test_bad_cross_attention_layers_are_refused_naming_the_field(tmp_path):
    data = _published()
    data["text_config"]["cross_attention_layers"] = [3, 40]
    with pytest.raises(InputError) as err:
        analyze(AnalyzeRequest(config=str(_write(tmp_path, data)), dispatch=FRAMEWORK))
    assert err.value.field == "text_config.cross_attention_layers"


def test_an_analyzer_planning_a_self_attention_cache_on_a_cross_block_is_refused_by_the_cross_check(
        tmp_path, monkeypatch):
    # the realistic mistake: the cross-only blocks read as ordinary self-attention layers (no only_layers)
    real = cross_kind.read_facts
    monkeypatch.setattr(cross_kind, "read_facts", lambda *a, **k: None if real(*a, **k).only_layers else real(*a, **k))
    with pytest.raises(InputError, match="MllamaTextCrossAttention at model.layers.3.cross_attn"):
        analyze(AnalyzeRequest(config=str(_write(tmp_path, _published())), dispatch=FRAMEWORK))


# A CPU-sized composite config: 4 blocks of 4 heads x 32 (2 KV heads), cross-only blocks 1 and 3; one image of 2 tiles
# of (112 // 14) ** 2 + 1 = 65 patches: 130 vision positions, a slot of two 128-token blocks.
def _small() -> dict:
    data = _published()
    data["text_config"].update(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
                               intermediate_size=256, vocab_size=512, cross_attention_layers=[1, 3],
                               bos_token_id=1, eos_token_id=2, pad_token_id=3)
    data["vision_config"].update(image_size=112, patch_size=14, max_num_tiles=2)
    data["image_token_index"] = 500
    return data


SHORT = Scenario(first=((120, 4), (40, 4)), late=((90, 4),), max_concurrency=2, release_requests=2)


def _case(tmp_path, dispatch: str):
    config = _write(tmp_path, _small())
    manifest = analyze(AnalyzeRequest(config=str(config), dispatch=dispatch))
    assert manifest.cross_attention.max_encoder_len == 130 and manifest.cross_attention.layers == [1, 3]
    manifest_path = tmp_path / "manifest.json"
    manifest_path.write_text(manifest.to_json(), encoding="utf-8")
    rendered = tmp_path / "rendered"
    write_rendered(render_manifest(manifest), rendered)
    return manifest_path, rendered, config


@pytest.mark.parametrize("dispatch", [FRAMEWORK, STANDALONE])
def test_small_mllama_validates_against_transformers_in_both_modes(tmp_path, dispatch):
    report = run_validate(*_case(tmp_path, dispatch), scenario=SHORT)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert check(report, NUMERIC).measured["max_abs_diff"] <= 1e-9
    reads = check(report, "cross-attention reads").measured
    # the stream holds the requests a chat serves: one without an image, one with text rows before its image token
    assert reads["calls"] > 0 and reads["requests_without_image"] >= 1 and reads["requests_with_rows_before_image"] >= 1
    if dispatch == FRAMEWORK:
        assert check(report, CROSS_ENTRIES).passed and check(report, LAYER_COUNT).measured["got"] == 3  # blocks 0, 1 (cross), 2


MISTAKES = [
    # (1) the slot's keys written from the wrong states (the value projection's): every read attends wrongly
    ("cross-keys-from-the-wrong-states", FRAMEWORK,
     r"encoder_key\.reshape\(-1, CROSS_NUM_KV_HEADS_PER_RANK, CROSS_HEAD_DIM\)\.to\(self\.cross_key\.dtype\)",
     "encoder_value.reshape(-1, CROSS_NUM_KV_HEADS_PER_RANK, CROSS_HEAD_DIM).to(self.cross_key.dtype)", NUMERIC),
    # (2) a cross-only block handed to the self-attention path (registered as a self-attention layer would be): its
    # slots never become a cache layer
    ("cross-block-given-the-self-attention-path", FRAMEWORK,
     r'if getattr\(cross_attn, "attn_type", None\) == "CrossAttention":',
     'if getattr(cross_attn, "attn_type", None) == "FullAttention":', LAYER_COUNT),
    # (3) the slot read past the request's own vision length (the reservation's length instead): the padding tiles
    ("cross-read-past-the-vision-length", STANDALONE,
     r"kv_lens = seg_kv\.clamp\(1, CROSS_MAX_ENCODER_LEN\)",
     "kv_lens = torch.full_like(seg_kv, CROSS_MAX_ENCODER_LEN)", NUMERIC),
    # (4) the text rows before the image token read like the rest (the image's valid length): transformers drops
    # their all-zero mask row and lets them attend over every vision position, padding tiles included
    ("rows-before-the-image-read-only-the-image", FRAMEWORK,
     r"before = torch\.minimum\(torch\.as_tensor\(text_starts, device=slots\.device\)\.long\(\), q_lens\) \* \(valid > 0\)",
     "before = torch.zeros_like(q_lens)", NUMERIC),
    # (5) a request without an image gets the attention over its slot's leftovers instead of nothing (transformers
    # skips the cross block for it)
    ("no-image-request-attends", FRAMEWORK,
     r"return torch\.where\(imaged, attn_output, torch\.zeros_like\(attn_output\)\)", "return attn_output", NUMERIC),
    # (6) the MLP row mask ignoring the image token's row: every row of a request with an image keeps its MLP output
    ("mlp-kept-before-the-image", FRAMEWORK,
     r"return has\[request\] & \(row >= starts\[request\]\)", "return has[request]", NUMERIC),
]


@pytest.mark.parametrize("case, dispatch, pattern, replacement, failing", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_cross_only_render_mistake_fails_by_name(tmp_path, case, dispatch, pattern, replacement, failing):
    manifest, rendered, config = _case(tmp_path, dispatch)
    mutate(rendered, pattern, replacement)
    report = run_validate(manifest, rendered, config, scenario=SHORT)
    assert not report.passed
    assert not check(report, failing).passed, [(c.name, c.detail) for c in report.failed()]


def test_the_reference_reads_padded_vision_states_through_transformers_mask(tmp_path, monkeypatch):
    """The reference gets each request's vision states padded to the reservation and transformers' own
    cross_attention_mask hiding the padding; the model under test reads the unpadded length from its slot. Without
    the mask the reference attends over the padding rows too, and the numeric check fails: the padding is real."""
    from model_infer_kvcache.validators.pipeline import host_model

    real = host_model.masked_vision_kwargs

    def unmasked(*args):
        out = real(*args)
        return {"cross_attention_states": out["cross_attention_states"]}

    monkeypatch.setattr(host_model, "masked_vision_kwargs", unmasked)
    report = run_validate(*_case(tmp_path, STANDALONE), scenario=SHORT)
    assert not check(report, NUMERIC).passed


def test_a_cpu_run_of_the_published_config_plans_its_cross_section_as_the_analyzer_plans_a_smaller_image(tmp_path):
    """The sweep's Mllama run (MllamaConfig() defaults) is CPU-sized: fewer heads (the tiny model's hidden size ties
    to heads x head_dim, 4096 -> 1024) and a smaller image of the same tiles and patch size (4100 -> 260 vision
    positions). The sized cross section is what the analyzer itself plans for that config, field for field."""
    from model_infer_kvcache.validators.pipeline.tiny_model import cpu_sized, cpu_sizes_note

    real = json.loads(json.dumps(_published(), default=str))  # as the validation reads config.json
    manifest = analyze(AnalyzeRequest(config=str(_write(tmp_path, real)), dispatch=FRAMEWORK))
    small = cpu_sized(manifest, real)
    assert "vision length 4100 -> 260" in cpu_sizes_note(manifest, small)
    x = small.cross_attention
    assert (x.max_encoder_len, x.slot_tokens, x.num_heads, x.num_kv_heads) == (4 * (8 ** 2 + 1), 384, 8, 2)
    shrunk = _published()
    shrunk["text_config"].update(num_attention_heads=8, num_key_value_heads=2, hidden_size=8 * 128)
    shrunk["vision_config"]["image_size"] = 8 * 14
    want = analyze(AnalyzeRequest(config=str(_write(tmp_path, shrunk, "s.json")), dispatch=FRAMEWORK)).cross_attention
    text = {"max_encoder_len_source", "fa", "reason", "source"}
    assert x.model_dump(exclude=text) == want.model_dump(exclude=text)


def _cache_infos(manifest, dtype) -> list:
    """get_cache_info of a checkout's Mllama model at every layer, as the render registers it: a self-attention info
    per planned layer (its planned entries), a slot info per cross-only block (MambaCacheEntry in CrossAttention)."""
    import types

    from model_infer_kvcache.analyzer.kv_cache_spec import CROSS_ATTENTION, MAMBA

    infos = [types.SimpleNamespace(caches=[types.SimpleNamespace(
        cache_name=c.name, attn_type=layer.registers_as[0], dim=c.dim, num_head=c.num_head, dtype=dtype,
        sliding_window=layer.registers_as[1], block_size=manifest.block_size) for c in layer.caches])
        for layer in manifest.layers]
    slot = [types.SimpleNamespace(cache_name=s.name, attn_type=MAMBA, manager_key=CROSS_ATTENTION, shape=list(s.shape),
                                  dtype=torch.int32 if s.dtype == "int32" else dtype, block_size=1, next_n=0)
            for s in manifest.cross_attention.states]
    return infos + [types.SimpleNamespace(caches=slot) for _ in manifest.cross_attention.layers]


def test_a_checkout_run_counts_the_cross_only_blocks_from_the_manifest(tmp_path, monkeypatch):
    """V102 of a checkout's model at every layer (validators/checkout_run/run.py calls check_cache_info with the real
    layer count): 32 self-attention layers and 8 cross-only blocks register 40 cache layers. The count comes from the
    manifest (validators/kinds/cross.only_blocks_within), not from a rendered run's host; a count of 0 (what the
    checkout run passed before) fails V102 by name."""
    import types

    from model_infer_kvcache.validators.kinds import cross as cross_checks
    from model_infer_kvcache.validators.pipeline import framework_run
    from model_infer_kvcache.validators.pipeline.report import Report

    manifest = analyze(AnalyzeRequest(config=str(_write(tmp_path, _published())), dispatch=FRAMEWORK))
    info = types.SimpleNamespace(layer_infos=_cache_infos(manifest, torch.bfloat16), is_mla_backend=False)

    def layer_count(report_name="get_cache_info layer count"):
        report = Report(backend="emulated", deploy_mode="framework", model_type="mllama", manifest_hash="h")
        framework_run.check_cache_info(report, manifest, info, manifest.model.num_layers, "G3", torch.bfloat16,
                                       manifest.model.num_layers)
        return check(report, report_name)

    got = layer_count()
    assert got.passed and got.measured == {"expected": 40, "got": 40}
    assert layer_count("cache entries match the manifest").passed and layer_count("cross-attention slot entries").passed
    # a tiny prefix of blocks 0..4 holds the cross-only block 3; blocks 0..2 none
    assert (cross_checks.only_blocks_within(manifest, 5), cross_checks.only_blocks_within(manifest, 3)) == (1, 0)
    monkeypatch.setattr(cross_checks, "only_blocks_within", lambda *a: 0)
    assert not layer_count().passed
