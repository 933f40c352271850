"""The cross-attention kind (issue #40): the decoder of an encoder-decoder model keeps one slot per request for the
K/V of its encoder states (analyzer/kinds/cross.py, kv_cache_spec.CrossAttentionSpec, templates/kinds/
cross_attention.py.j2, validators/kinds/cross.py). Analyzer tests at published sizes; the render of both modes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.decisions_table import decisions_markdown
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.kinds import cross as cross_kind
from model_infer_kvcache.analyzer.kv_cache_spec import CROSS_ATTENTION, MAMBA, CrossAttentionSpec
from model_infer_kvcache.implementer.render import render_manifest
from model_infer_kvcache.validators.pipeline.request_stream import Scenario
from validators_support import CONFIGS, check, mutate, render_case, run_validate

FRAMEWORK, STANDALONE = "部署模式：框架部署", "部署模式：独立部署"


def _plan(config: str, dispatch: str = FRAMEWORK, **over):
    return analyze(AnalyzeRequest(config=str(CONFIGS / config), dispatch=dispatch, **over))


def test_bart_plans_a_slot_per_request_sized_by_the_shared_position_table():
    m = _plan("bart_large.json")
    x = m.cross_attention
    assert x.layers == list(range(12)) and x.module_attr == "encoder_attn"
    assert x.max_encoder_len == 1024 and x.max_encoder_len_source.startswith("max_position_embeddings")
    assert (x.num_kv_heads_per_rank, x.head_dim, x.slot_tokens, x.slot_block_size) == (16, 64, 1024, 128)
    # K and V of 1024 positions x 16 heads x 64 in bfloat16, plus the int32 length, per layer
    assert x.slot_bytes_per_layer == 2 * 1024 * 16 * 64 * 2 + 4 and x.slot_bytes == 12 * x.slot_bytes_per_layer
    group = next(g for g in m.memory.groups if g.group_key == CROSS_ATTENTION)
    assert group.fixed_blocks and group.state_bytes == x.slot_bytes
    assert all(layer.attn_type == "FullAttention" for layer in m.layers)  # the self-attention keeps the paged cache


def test_whisper_sizes_the_slot_by_max_source_positions():
    x = _plan("whisper_tiny.json").cross_attention
    assert x.max_encoder_len == 1500 and x.max_encoder_len_source.startswith("max_source_positions")
    assert x.slot_tokens == 1536 and len(x.layers) == 4


def test_trocr_without_an_encoder_length_is_blocked_by_name():
    m = _plan("trocr_large.json")
    assert m.cross_attention is None
    assert any("max_source_positions" in b.message and "cross-attention slot" in b.message for b in m.blockers)


def test_the_spec_reserves_one_slot_per_request_in_the_mamba_manager():
    spec = CrossAttentionSpec(CROSS_ATTENTION, 1000, 0, 12, slot_tokens=1024)
    assert spec.manager == MAMBA and spec.fixed and spec.state and spec.per_token_bytes == 0
    assert spec.fixed_blocks(4) == 5 and spec.blocks_per_request(10 ** 6) == 1
    assert "5 cross-attention slots" in spec.fixed_formula(4)


def test_an_analyzer_that_ignores_the_cross_attention_is_refused_by_the_cross_check(monkeypatch):
    # the realistic mistake: the encoder-decoder config read as decoder-only (no cross facts)
    monkeypatch.setattr(cross_kind, "read_facts", lambda *args, **kwargs: None)
    with pytest.raises(InputError, match="hold a cross-attention module .* and the analyzer plans none"):
        _plan("bart_large.json")


@pytest.mark.parametrize("dispatch", [FRAMEWORK, STANDALONE])
def test_both_modes_render_the_slot(dispatch):
    files = render_manifest(_plan("bart_large.json", dispatch)).files
    attention = files["kvcache_attention.py"]
    assert "def init_cross_cache(" in attention and "sparse_mode=0" in attention and "atten_mask=None" in attention
    if dispatch == FRAMEWORK:
        assert 'manager_key=self.attn_type' in attention and 'block_table[self.attn_type][:rows, 0]' in attention
    else:
        assert "cross_slots=index.to(torch.int32)" in files["kvcache_runner.py"]


# ---------------------------------------------------------------- validation (reduced sizes, short stream)
# BART's decoder at reduced sizes (2 layers of 2 heads of 64, a 512-position table): the slot and its reads are the
# published ones' in shape (whole 128-token blocks, several per slot), the run takes seconds.
SMALL_BART = {"d_model": 128, "decoder_attention_heads": 2, "encoder_attention_heads": 2, "decoder_ffn_dim": 256,
              "encoder_ffn_dim": 256, "decoder_layers": 2, "encoder_layers": 1, "vocab_size": 512,
              "max_position_embeddings": 512}
# prompts in two blocks and one, a late admit into the first finished request's freed slot
SHORT = Scenario(first=((120, 4), (40, 4)), late=((90, 4),), max_concurrency=2, release_requests=2)
NUMERIC, CROSS_ENTRIES, CROSS_CALLS = "logits vs transformers", "cross-attention slot entries", "cross-attention reads"


def _case(tmp_path, mode: str):
    return render_case(tmp_path, "bart_large", SMALL_BART, dispatch=FRAMEWORK if mode == "framework" else STANDALONE)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_bart_validates_against_transformers_in_both_modes(tmp_path, mode):
    manifest, rendered, cfg = _case(tmp_path, mode)
    report = run_validate(manifest, rendered, cfg, scenario=SHORT)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert check(report, NUMERIC).measured["max_abs_diff"] <= 1e-9
    assert check(report, CROSS_CALLS).measured["calls"] > 0
    if mode == "framework":
        assert check(report, CROSS_ENTRIES).passed
        usage = check(report, "all blocks back in the pool").measured["usage"]
        assert usage[CROSS_ATTENTION]["total"] == SHORT.max_concurrency + 1  # a slot per request + the null block


MISTAKES = [
    # (1) the slot not rewritten on reuse: a late request reads what the previous request (or the poison) left
    ("slot-not-rewritten-on-reuse", "framework", r"        if forward_metadata\.is_prefill:\n"
     r"            self\.write_cross\(encoder_key, encoder_value, encoder_lens, slots\)",
     "        if forward_metadata.is_prefill and not bool((self.cross_len[slots] > 0).all()):\n"
     "            self.write_cross(encoder_key, encoder_value, encoder_lens, slots)", NUMERIC),
    # (2) a causal mask over the cross-attention (the self-attention's sparse_mode 3 copied)
    ("causal-mask-on-cross-attention", "standalone", r"            atten_mask=None,\n            sparse_mode=0,",
     "            atten_mask=forward_metadata.attention_mask,\n            sparse_mode=3,", CROSS_CALLS),
    # (3) the slot index mixed up: every request reads the first request's slot (another request's encoder K/V)
    ("slot-of-another-request", "framework", r"return forward_metadata\.block_table\[self\.attn_type\]\[:rows, 0\]"
     r"\.long\(\)", "return forward_metadata.block_table[self.attn_type][:1, 0].long().expand(rows)", NUMERIC),
]


@pytest.mark.slow
@pytest.mark.parametrize("case, mode, pattern, replacement, failing", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_cross_attention_render_mistake_fails_by_name(tmp_path, case, mode, pattern, replacement, failing):
    manifest, rendered, cfg = _case(tmp_path, mode)
    mutate(rendered, pattern, replacement)
    report = run_validate(manifest, rendered, cfg, scenario=SHORT)
    assert not report.passed
    assert not check(report, failing).passed, [(c.name, c.detail) for c in report.failed()]


# ---------------------------------------------------------------- the encoder length stated by the user
# TrOCR's and MusicGen's decoder configs name no encoder length (TrOCR's ViT patches, MusicGen's T5 text tokens):
# blocked at their class defaults, planned with --encoder-length (the manifest saying it is user input), or, for
# TrOCR, from a composite VisionEncoderDecoderConfig's encoder section (transformers' own encoder at its image_size).


def _class_config(tmp_path, model_type: str, **over) -> str:
    from transformers import CONFIG_MAPPING

    path = tmp_path / f"{model_type}.json"
    path.write_text(json.dumps(CONFIG_MAPPING[model_type](**over).to_dict()), encoding="utf-8")
    return str(path)


def _ved_config(tmp_path, encoder: str, **encoder_over) -> str:
    """A TrOCR checkpoint's composite config: VisionEncoderDecoderConfig over a vision encoder and TrOCR's decoder."""
    from transformers import CONFIG_MAPPING, TrOCRConfig, VisionEncoderDecoderConfig

    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(CONFIG_MAPPING[encoder](**encoder_over),
                                                                     TrOCRConfig())
    path = tmp_path / f"ved_{encoder}.json"
    path.write_text(json.dumps(config.to_dict()), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("family", ["trocr", "musicgen"])
def test_class_defaults_stay_blocked_naming_the_flag_and_plan_with_it(tmp_path, family):
    config = str(CONFIGS / "trocr_large.json") if family == "trocr" else _class_config(tmp_path, "musicgen")
    blocked = analyze(AnalyzeRequest(config=config, dispatch=FRAMEWORK))
    assert blocked.cross_attention is None and blocked.kv_mode.value == "legacy"
    assert [b.fields for b in blocked.blockers] == [[cross_kind.FLAG, "max_source_positions"]]
    assert "pass --encoder-length N" in blocked.blockers[0].message
    m = analyze(AnalyzeRequest(config=config, dispatch=FRAMEWORK, encoder_length=577))
    assert not m.blockers and m.kv_mode.value == "paged"
    x = m.cross_attention
    assert (x.max_encoder_len, x.slot_tokens, x.max_encoder_len_from) == (577, 640, "user input")
    assert x.max_encoder_len_source.startswith("--encoder-length 577 (user input")
    stated = "CROSS_MAX_ENCODER_LEN = 577  # the longest encoder output a request may bring (stated by the user"
    assert stated in render_manifest(m).files["kvcache_attention.py"]
    # the decisions table the user confirms says the length is theirs
    assert "编码器最长 577 位置(用户给出 --encoder-length)" in decisions_markdown(m)
    assert "编码器最长 1024 位置(来自配置)" in decisions_markdown(_plan("bart_large.json"))


def test_a_composite_trocr_config_sizes_the_slot_by_its_vision_encoder(tmp_path):
    """transformers' ViTModel at image_size 384 / patch_size 16 outputs 24 x 24 patches + the class token, DeiTModel
    one more (its distillation token): read from the encoder on the meta device, not a patch formula (the plausible
    mistake, (384 // 16) ** 2 = 576 positions, would make a slot one position short)."""
    for encoder, want in (("vit", 577), ("deit", 578)):
        m = analyze(AnalyzeRequest(config=_ved_config(tmp_path, encoder, image_size=384, patch_size=16)))
        x = m.cross_attention
        assert m.model.model_type == "trocr" and m.model.sources["num_layers"].startswith("decoder.decoder_layers")
        assert not m.blockers and (x.max_encoder_len, x.max_encoder_len_from) == (want, "config"), x
        assert x.max_encoder_len_source.startswith(f"encoder.image_size 384 ({encoder})")
    # a larger statement is kept as the user's (a ViT run on bigger images); a smaller one is refused by name
    wide = analyze(AnalyzeRequest(config=_ved_config(tmp_path, "vit"), encoder_length=1000)).cross_attention
    assert (wide.max_encoder_len, wide.max_encoder_len_from) == (1000, "user input")
    assert "the config gives 197" in wide.max_encoder_len_source  # ViTConfig's defaults: 224 / 16 -> 196 + 1
    with pytest.raises(InputError, match="100 is below the 577 encoder positions the config gives") as err:
        analyze(AnalyzeRequest(config=_ved_config(tmp_path, "vit", image_size=384), encoder_length=100))
    assert err.value.where == cross_kind.FLAG
    # an encoder section transformers cannot run stays blocked saying why; a malformed image size is bad input
    bad = json.loads(Path(_ved_config(tmp_path, "vit")).read_text())
    path = tmp_path / "unknown_encoder.json"
    path.write_text(json.dumps(bad | {"encoder": bad["encoder"] | {"model_type": "no_such_vit"}}), encoding="utf-8")
    blocked = analyze(AnalyzeRequest(config=str(path)))
    assert blocked.cross_attention is None and "encoder.image_size 224 (no_such_vit) gives no length: transformers " \
        "could not run that encoder on the meta device (ValueError: Unrecognized model" in blocked.blockers[0].message
    path.write_text(json.dumps(bad | {"encoder": bad["encoder"] | {"image_size": 0}}), encoding="utf-8")
    with pytest.raises(InputError, match="must be a positive integer .* got image_size 0") as err:
        analyze(AnalyzeRequest(config=str(path)))
    assert err.value.field == "encoder.image_size"


def test_the_flag_is_refused_where_nothing_cross_attends_or_below_a_config_field():
    with pytest.raises(InputError, match="the decoder attends over no encoder"):
        analyze(AnalyzeRequest(config=str(CONFIGS.parent.parent.parent / "examples/tiny_qwen3/config.json"),
                               encoder_length=64))
    with pytest.raises(InputError, match="below the 1024 encoder positions .*max_position_embeddings"):
        _plan("bart_large.json", encoder_length=512)


@pytest.mark.parametrize("family, mode", [("trocr", "framework"), ("trocr", "standalone"), ("musicgen", "framework"),
                                          ("musicgen", "standalone"), ("trocr-composite", "framework")])
def test_with_the_flag_trocr_and_musicgen_validate_in_both_modes(tmp_path, family, mode):
    """The class-default configs with --encoder-length (a composite TrOCR config without it: its ViT's 197
    positions), through `kvcache run`'s chain (analyze -> render -> validate) on a short stream: the per-request
    encoder states (up to the slot's length) written into each slot and read back match transformers' decoder."""
    config = {"trocr": lambda: str(CONFIGS / "trocr_large.json"), "musicgen": lambda: _class_config(tmp_path, "musicgen"),
              "trocr-composite": lambda: _ved_config(tmp_path, "vit")}[family]()
    case = render_case(tmp_path, "", None, config_path=config, encoder_length=None if "composite" in family else 200,
                       dispatch=FRAMEWORK if mode == "framework" else STANDALONE)
    report = run_validate(*case, scenario=SHORT)
    assert report.passed, [(c.id, c.detail) for c in report.failed()]
    assert check(report, NUMERIC).measured["max_abs_diff"] <= 1e-9 and check(report, CROSS_CALLS).passed


def test_an_encoder_longer_than_the_stated_length_fails_the_run_by_check_id(tmp_path, monkeypatch):
    """Negative control: the user states --encoder-length 64 and the encoder brings more (the host's encoder states
    drawn up to 3 x 64): the render's slot write refuses the request naming its reservation, V201 fails."""
    from model_infer_kvcache.validators.pipeline import host_model

    case = render_case(tmp_path, "", None, config_path=str(CONFIGS / "trocr_large.json"), encoder_length=64,
                       dispatch=FRAMEWORK)

    class LongerEncoder(host_model.EncoderStates):
        def __init__(self, hidden: int, max_len: int, seed: int):
            super().__init__(hidden, 3 * max_len, seed)

    monkeypatch.setattr(host_model, "EncoderStates", LongerEncoder)
    report = run_validate(*case, scenario=SHORT)
    failed = {c.id: c.detail for c in report.failed()}
    assert "V201" in failed and "outside 1..64 (the slot's reservation)" in failed["V201"], failed


def test_kvcache_run_refuses_the_class_default_trocr_naming_the_flag(tmp_path, capsys):
    """`kvcache run` without --encoder-length: the blocker's one line tells the user the flag; nothing is written."""
    from cli_support import invoke

    rc, _, err = invoke(["run", "--config", CONFIGS / "trocr_large.json", "--out", tmp_path / "out"], capsys)
    line = [t for t in err.splitlines() if t.startswith("error: ")]
    assert rc == 2 and len(line) == 1 and "pass --encoder-length N" in line[0], err
    assert not (tmp_path / "out").exists()


def test_the_encoder_run_is_kept_in_the_user_cache_and_a_damaged_entry_is_run_again(tmp_path, monkeypatch):
    """A composite's encoder length costs transformers' import and a meta build (seconds): kept like the cross-check's
    reports, keyed by the installed transformers and the encoder section; a damaged entry is not believed."""
    from model_infer_kvcache.analyzer import arch_check

    monkeypatch.setenv("KVCACHE_CACHE_DIR", str(tmp_path / "cache"))
    enc = json.loads(Path(_ved_config(tmp_path, "vit", image_size=384)).read_text())["encoder"]
    assert arch_check.encoder_positions(enc, 3, [384, 384]) == (577, "ViTModel")
    (entry,) = (tmp_path / "cache").rglob("*.json")
    runs = []
    monkeypatch.setattr(arch_check, "_encoder_run", lambda *a: (runs.append(a), ((1, "Stub"), False))[1])
    assert arch_check.encoder_positions(enc, 3, [384, 384]) == (577, "ViTModel") and not runs  # from the cache
    data = json.loads(entry.read_text())
    entry.write_text(json.dumps(data | {"answer": [576, "ViTModel"]}), encoding="utf-8")  # digest no longer matches
    assert arch_check.encoder_positions(enc, 3, [384, 384]) == (1, "Stub") and len(runs) == 1
