"""Attention tensor parallelism on CPU: N gloo ranks, each with its share of heads and its own cache."""

from __future__ import annotations

import re

import pytest
import torch
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.implementer.render import render_manifest, write_rendered
from model_infer_kvcache.validators.kinds.sharding import kv_head_of_rank
from model_infer_kvcache.validators.pipeline.request_stream import Scenario
from model_infer_kvcache.validators.pipeline.validate import ValidateRequest, validate
from validators_support import ROOT, mutate, render_case

# A short stream keeps N processes on 2 cores inside CI's time; it still crosses a block.
TP_SCENARIO = Scenario(first=((140, 4), (40, 3)), late=((60, 2),), max_concurrency=2, release_requests=3)


def _validate(manifest, rendered, cfg, tp):
    return validate(ValidateRequest(manifest=str(manifest), rendered=str(rendered), config=str(cfg),
                                    backend="emulated", scenario=TP_SCENARIO, sweep_readings=False,
                                    attn_tp_size=tp))


def _ranks_passed(report, tp):
    failed = [(c.name, c.detail or c.measured) for c in report.failed()]
    assert report.passed, failed
    for r in range(tp):
        names = [c.name for c in report.checks if c.name.startswith(f"rank {r}: ")]
        assert any("logits vs transformers" in n for n in names), f"rank {r} reported no numeric check"
        assert any("cache entries match the manifest" in n for n in names)
        assert any("all blocks back in the pool" in n for n in names)


def test_kv_heads_per_rank_split_and_replication():
    assert [kv_head_of_rank(r, 2, 8) for r in range(2)] == [(0, 4), (4, 8)]
    assert [kv_head_of_rank(r, 4, 2) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_head_of_rank(r, 16, 8) for r in (0, 1, 2, 15)] == [(0, 1), (0, 1), (1, 2), (7, 8)]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_qwen3_like_eight_kv_heads(tmp_path, tp):
    manifest, rendered, cfg = render_case(tmp_path, "qwen3_8b", framework_api="G2", attn_tp_size=tp)
    report = _validate(manifest, rendered, cfg, tp)
    _ranks_passed(report, tp)
    assert f"{32 // tp} query / {8 // tp} KV heads per rank" in report.notes[0]


@pytest.mark.slow
def test_two_kv_heads_at_tp4_are_replicated(tmp_path):
    cfg = ROOT / "examples" / "tiny_qwen3" / "config.json"
    m = analyze(AnalyzeRequest(config=str(cfg), framework_api="G2", attn_tp_size=4))
    assert m.parallel.num_kv_heads_per_rank == 1 and m.parallel.kv_heads_replicated
    manifest = tmp_path / "manifest.json"
    manifest.write_text(m.to_json())
    write_rendered(render_manifest(m), tmp_path / "rendered")
    report = _validate(manifest, tmp_path / "rendered", cfg, 4)
    _ranks_passed(report, 4)
    assert "KV heads replicated" in report.notes[0]


@pytest.mark.slow
def test_mla_latent_is_replicated(tmp_path):
    manifest, rendered, cfg = render_case(tmp_path, "deepseek_v2_lite", framework_api="G2", attn_tp_size=2)
    report = _validate(manifest, rendered, cfg, 2)
    _ranks_passed(report, 2)
    assert "MLA latent replicated" in report.notes[0]
    assert all(c.passed for c in report.checks if c.name.endswith("is_mla_backend"))


@pytest.mark.slow
def test_unsplit_kv_head_count_is_named(tmp_path):
    manifest, rendered, cfg = render_case(tmp_path, "qwen3_8b", framework_api="G2", attn_tp_size=2)
    mutate(rendered, r"NUM_KV_HEADS_PER_RANK = 4", "NUM_KV_HEADS_PER_RANK = 8")  # forgot to divide by TP
    report = _validate(manifest, rendered, cfg, 2)
    assert not report.passed
    bad = [c for c in report.failed() if "cache entries match the manifest" in c.name]
    assert {c.name.split(":")[0] for c in bad} == {"rank 0", "rank 1"}
    # the detail names the entry's num_head (8, un-split) against the manifest's per-rank count (4)
    found = re.search(r"\(([\w, ]+)\) \(([^)]*)\) != \(([^)]*)\)", bad[0].detail)
    assert found, bad[0].detail
    names = [n.strip() for n in found.group(1).split(",")]
    got = dict(zip(names, (v.strip() for v in found.group(2).split(",")), strict=True))
    want = dict(zip(names, (v.strip() for v in found.group(3).split(",")), strict=True))
    assert (got["num_head"], want["num_head"]) == ("8", "4") and got["dim"] == want["dim"], bad[0].detail


@pytest.mark.slow
def test_latent_divided_by_tp_is_named(tmp_path):
    manifest, rendered, cfg = render_case(tmp_path, "deepseek_v2_lite", framework_api="G2", attn_tp_size=2)
    mutate(rendered, r"dim=KV_LORA_RANK,", "dim=KV_LORA_RANK // 2,")  # split the latent across ranks
    report = _validate(manifest, rendered, cfg, 2)
    assert not report.passed
    bad = [c for c in report.failed() if "cache entries match the manifest" in c.name]
    assert bad and "256" in bad[0].detail


def test_tp_flag_must_match_the_manifest(tmp_path):
    from model_infer_kvcache.analyzer.errors import InputError

    manifest, rendered, cfg = render_case(tmp_path, "qwen3_8b", framework_api="G2")
    with pytest.raises(InputError, match="attn_tp_size"):
        _validate(manifest, rendered, cfg, 2)


def test_torch_distributed_available():
    assert torch.distributed.is_available() and torch.distributed.is_gloo_available()


@pytest.mark.slow
def test_a_hung_peer_times_out_with_its_rank_named(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHE_TP_HANG_RANK", "1")
    monkeypatch.setenv("KVCACHE_TP_COLLECTIVE_TIMEOUT_S", "5")
    monkeypatch.setenv("KVCACHE_TP_RANK_TIMEOUT_S", "12")
    manifest, rendered, cfg = render_case(tmp_path, "qwen3_8b", framework_api="G2", attn_tp_size=2)
    report = _validate(manifest, rendered, cfg, 2)
    assert not report.passed
    failed = {c.name: c.detail for c in report.failed()}
    assert "no result within 12s" in failed["rank 1: finished"]
    assert "rank 0: finished" in failed  # its collective timed out instead of blocking
