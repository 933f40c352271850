"""A tiny model tied to a wide heads x head_dim runs with fewer heads on CPU (tiny_model.cpu_sized, gqa.cpu_heads).

The rule keeps what the checks read (head_dim, the query/KV group, the attention TP, two KV heads per rank) and
applies only where the tiny model's hidden size ties to heads x head_dim above MAX_CPU_TIED_WIDTH: Falcon derives
head_dim from hidden_size, so its tiny model is heads x head_dim wide; Qwen3's runs at hidden 128 and keeps every
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
