"""A tiny model tied to a wide heads x head_dim runs with fewer heads on CPU (tiny_model.cpu_sized, gqa.cpu_heads).

The rule keeps what the checks read (head_dim, the query/KV group, the attention TP, two KV heads per rank) and
applies where the tiny model's hidden size ties to heads x head_dim above MAX_CPU_TIED_WIDTH (Falcon derives head_dim
from hidden_size, so its tiny model is heads x head_dim wide), or, at the untied hidden of 128, where its K/V rows
(KV heads x head_dim) are wider than that (Cohere-Compass' MHA 64 x 128); Qwen3-8B's 8 x 128 at hidden 128 keeps every
head. The given render is still judged at the real heads: a wrong per-rank head constant fails by name.
"""

from __future__ import annotations

import json

import pytest
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.config_loader import read_config_file
from model_infer_kvcache.validators.kinds import gqa
from model_infer_kvcache.validators.pipeline.tiny_model import MAX_CPU_TIED_WIDTH, cpu_sized, cpu_sizes_note
from validators_support import CONFIGS, check, mutate, render_case, run_validate

# Falcon-2-11B's architecture (GQA 32 / 8, head_dim 128) narrowed so the as-written run at the real heads stays
# quick: 12 query / 4 KV heads, tied width 1536
SMALL_FALCON = {"hidden_size": 1536, "num_attention_heads": 12, "num_kv_heads": 4, "num_hidden_layers": 4}


def _manifest(config: str, **kw):
    return analyze(AnalyzeRequest(config=str(CONFIGS / f"{config}.json"), **kw))


@pytest.mark.parametrize(("config", "tp", "want"), [
    ("falcon2_11b", 1, (8, 2)),  # GQA 32 / 8: two KV heads, the group of 4 kept
    ("falcon2_11b", 2, (16, 4)),  # two KV heads per rank on each of 2 ranks
    ("falcon2_11b", 4, None),  # already two KV heads per rank
    ("falcon2_11b", 8, None),  # one KV head per rank: nothing to shrink
    ("falcon_7b", 1, None),  # MQA: one KV head, its group of 71 kept whole
])
def test_rule_keeps_head_dim_group_and_tp(config, tp, want):
    m = _manifest(config, attn_tp_size=tp)
    got = gqa.cpu_heads(m)
    assert got == want
    if got:
        heads, kv = got
        assert heads // kv == m.model.num_attention_heads // m.model.num_key_value_heads and heads % kv == 0
        assert kv % tp == 0 and kv // tp == min(m.parallel.num_kv_heads_per_rank, gqa.CPU_KV_HEADS_PER_RANK)


def test_heads_shrink_only_where_the_tiny_model_ties_wide():
    qwen = _manifest("qwen3_8b")  # GQA 32 / 8 x 128, but its tiny model runs at hidden 128
    assert gqa.cpu_heads(qwen) == (8, 2)
    assert cpu_sized(qwen, read_config_file(str(CONFIGS / "qwen3_8b.json"))[1]) is None

    falcon = _manifest("falcon2_11b")
    assert falcon.model.num_attention_heads * falcon.model.head_dim > MAX_CPU_TIED_WIDTH
    small = cpu_sized(falcon, read_config_file(str(CONFIGS / "falcon2_11b.json"))[1])
    assert (small.model.num_attention_heads, small.model.num_key_value_heads) == (8, 2)
    assert (small.parallel.num_q_heads_per_rank, small.parallel.num_kv_heads_per_rank) == (8, 2)
    assert {c.num_head for layer in small.layers for c in layer.caches} == {2}
    assert small.model.head_dim == falcon.model.head_dim and small.fa.softmax_scale == falcon.fa.softmax_scale
    assert cpu_sized(falcon) is None  # without the config (the checkout run): the heads stay
    assert "heads 32 -> 8 and KV heads 8 -> 2" in cpu_sizes_note(falcon, small)


# Qwen3-8B's architecture with 16 KV heads (K/V rows 16 x 128 = 2048, above the bound) at its hidden 128: untied
QWEN3_WIDE_KV = {"num_key_value_heads": 16, "num_hidden_layers": 2}


def test_heads_shrink_at_hidden_128_where_the_kv_rows_are_wide(tmp_path):
    """Untied (explicit head_dim: the tiny model runs at hidden 128), the K/V width decides: 16 x 128 shrinks to two
    KV heads with the group of 2 kept, 8 x 128 (Qwen3-8B) keeps every head; MQA / replicated KV stay whole (the kind's
    rule). The note names the K/V width as the reason."""
    config = json.loads((CONFIGS / "qwen3_8b.json").read_text(encoding="utf-8")) | QWEN3_WIDE_KV
    path = tmp_path / "qwen3_wide_kv.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    m = analyze(AnalyzeRequest(config=str(path)))
    assert m.model.num_key_value_heads * m.model.head_dim > MAX_CPU_TIED_WIDTH
    small = cpu_sized(m, config)
    assert small is not None and (small.model.num_attention_heads, small.model.num_key_value_heads) == (4, 2)
    assert small.model.head_dim == m.model.head_dim and small.fa.softmax_scale == m.fa.softmax_scale
    note = cpu_sizes_note(m, small)
    assert "heads 32 -> 4 and KV heads 16 -> 2" in note and "the K/V rows are 16 x 128 = 2048 wide, above 1024" in note
    at_tp2 = analyze(AnalyzeRequest(config=str(path), attn_tp_size=2))
    assert (cpu_sized(at_tp2, config).model.num_key_value_heads, cpu_sized(at_tp2, config).parallel.attn_tp_size) == \
        (4, 2)  # two KV heads per rank on each of the 2 ranks


def test_wide_kv_render_passes_on_fewer_heads_and_a_wrong_head_constant_still_fails(tmp_path):
    """The untied route end to end: the clean render passes on the CPU run's fewer heads (byte for byte the
    implementer's); a render whose per-rank KV head constant is the CPU run's (2) instead of the manifest's (16) fails
    the constants check by name and its as-written run at the real heads."""
    manifest, rendered, config = render_case(tmp_path, "qwen3_8b", QWEN3_WIDE_KV)
    report = run_validate(manifest, rendered, config)
    assert report.passed, [c for c in report.checks if not c.passed]
    assert any("heads 32 -> 4 and KV heads 16 -> 2" in n and "byte for byte" in n for n in report.notes), report.notes
    mutate(rendered, r"(?m)^NUM_KV_HEADS_PER_RANK = 16$", "NUM_KV_HEADS_PER_RANK = 2", count=1)
    report = run_validate(manifest, rendered, config)
    constants = check(report, "rendered constants match the manifest")
    assert not report.passed and not constants.passed and "NUM_KV_HEADS_PER_RANK" in constants.detail
    assert [c for c in report.checks if c.name.startswith("as written: ") and not c.passed]


def test_clean_render_passes_on_fewer_heads_and_a_wrong_head_constant_still_fails(tmp_path):
    manifest, rendered, config = render_case(tmp_path, "falcon2_11b", SMALL_FALCON)
    report = run_validate(manifest, rendered, config)
    assert report.passed, [c for c in report.checks if not c.passed]
    assert any("heads 12 -> 6 and KV heads 4 -> 2" in n and "byte for byte" in n for n in report.notes), report.notes
    assert not [c for c in report.checks if c.name.startswith("as written: ")]

    # negative control: the render carries the CPU run's KV heads per rank (2) instead of the manifest's 4
    mutate(rendered, r"(?m)^NUM_KV_HEADS_PER_RANK = 4$", "NUM_KV_HEADS_PER_RANK = 2", count=1)
    report = run_validate(manifest, rendered, config)
    assert not report.passed
    constants = check(report, "rendered constants match the manifest")
    assert not constants.passed and "NUM_KV_HEADS_PER_RANK" in constants.detail
    written = [c for c in report.checks if c.name.startswith("as written: ") and not c.passed]
    assert written, [c.name for c in report.checks]  # the given render ran at the real heads and failed there too
    assert any("also ran as written at its real sizes" in n for n in report.notes), report.notes
    json.dumps(report.notes)


@pytest.mark.slow
def test_two_ranks_run_their_share_of_the_fewer_heads(tmp_path):
    """Helium (MHA 20 x 128, tied width 2560) at attention TP 2: each rank keeps two of the CPU run's four heads (the
    rule keeps the TP and two KV heads per rank), and the merged ranks pass."""
    from model_infer_kvcache.implementer.render import render_manifest, write_rendered
    from transformers import CONFIG_MAPPING

    config = tmp_path / "helium.json"
    config.write_text(json.dumps(CONFIG_MAPPING["helium"]().to_dict() | {"num_hidden_layers": 2}, default=str))
    m = analyze(AnalyzeRequest(config=str(config), deploy_mode="framework", attn_tp_size=2))
    (tmp_path / "m.json").write_text(m.to_json(), encoding="utf-8")
    write_rendered(render_manifest(m), tmp_path / "r")
    report = run_validate(tmp_path / "m.json", tmp_path / "r", config)
    assert report.passed, [(c.name, c.detail) for c in report.checks if not c.passed]
    assert any("heads 20 -> 4 and KV heads 20 -> 4" in n and "attention TP 2 kept" in n for n in report.notes)
