"""Hybrid gated-delta-net models (Qwen3-Next, Qwen3.5-MoE) rendered and validated against transformers in both
deployment modes: conv and recurrent states by each request's state block beside paged full-attention layers,
through a stream with early finishes, late admits into freed (poisoned) blocks and padded decode rows; and the
realistic mistakes of a state port, each failing by name."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
from model_infer_kvcache.validators.pipeline import validate
from model_infer_kvcache.validators.pipeline.request_stream import QUICK, Scenario
from validators_support import check, mutate, render_case, run_validate

NUMERIC, LAYERS = "logits vs transformers", "every layer's attn_type"
# prompts in two blocks and one, a late admit into the first finished request's freed state block, decode steps
# with a padding row once one request is left
SHORT = Scenario(first=((120, 4), (40, 4)), late=((90, 4),), max_concurrency=2, release_requests=2)


def _case(tmp: Path, config: str, mode: str, tp: int = 1):
    return render_case(tmp, config, deploy_mode=mode, attn_tp_size=tp)


# Qwen3-Next at 4 key / 8 value linear heads and 8 query heads (16 / 32 / 16 published; head dims unchanged, the
# gated delta rule operators fix them at 128): the negative controls' failures do not depend on the head count.
SMALL_QWEN3_NEXT = {"linear_num_key_heads": 4, "linear_num_value_heads": 8, "num_attention_heads": 8}


@pytest.mark.slow
@pytest.mark.parametrize("config, mode", [("qwen3_next", "framework"), ("qwen3_5_moe", "standalone")])
def test_gated_delta_net_hybrids_render_and_validate(tmp_path, config, mode):
    manifest, rendered, cfg = _case(tmp_path, config, mode)
    text = (rendered / "kvcache_attention.py").read_text(encoding="utf-8")
    assert ("MambaCacheEntry(" in text) == (mode == "framework") and "npu_recurrent_gated_delta_rule(" in text
    report = run_validate(manifest, rendered, cfg, scenario=QUICK)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert check(report, NUMERIC).measured["max_abs_diff"] <= 1e-9
    assert check(report, LAYERS).measured["layers"] == (48 if config == "qwen3_next" else 40)
    if mode == "framework":
        usage = check(report, "all blocks back in the pool").measured["usage"]
        assert usage["Mamba"]["total"] == QUICK.max_concurrency + 1  # one state block per request + the null block


ATTN, RUNNER = "kvcache_attention.py", "kvcache_runner.py"
ZEROS = (r"initial = query\.new_zeros\(len\(lengths\), LINEAR_NUM_V_HEADS_PER_RANK, LINEAR_HEAD_V_DIM,\n"
         r"\s+LINEAR_HEAD_K_DIM\)\.to\(self\.recurrent_state\.dtype\)")
MISTAKES = [
    # prefill continues from what the state block holds (a reused block: the finished request's state)
    ("prefill-reads-the-recurrent-state", "framework", ZEROS, "initial = self.recurrent_state[slots.long()]", NUMERIC),
    # the conv history read on prefill too: a row's first request finds zeros, the next one its predecessor's inputs
    ("prefill-reads-the-conv-state", "standalone",
     r"            if is_prefill:\n                history = x\.new_zeros\(CONV_KERNEL - 1, CONV_CHANNELS_PER_RANK\)\n"
     r"            else:\n                history", "            history", NUMERIC),
    # the state written back before the step's update (the prefill's starting state, not its final one)
    ("state-written-before-the-update", "framework", r"index_copy_\(0, slots\.long\(\), final\.",
     "index_copy_(0, slots.long(), initial.", NUMERIC),
    # the conv state keeps the oldest inputs of the window instead of the newest
    ("conv-state-shifted-the-wrong-way", "standalone", r"window\[-\(CONV_KERNEL - 1\):\]", "window[:CONV_KERNEL - 1]",
     NUMERIC),
    # the row number used as the state block (a standalone habit in framework mode): another request's block
    ("state-block-of-another-request", "framework",
     r"return forward_metadata\.block_table\[self\.attn_type\]\[:, 0\]\.to\(torch\.int32\)",
     "return torch.arange(forward_metadata.block_table[self.attn_type].shape[0], dtype=torch.int32)", NUMERIC),
    # a linear layer registered as a full-attention layer
    ("linear-layer-as-full-attention", "framework", r'        self\.attn_type = "Mamba"',
     '        self.attn_type = "FullAttention"', LAYERS),
    # the full-attention layers registered as state layers (Mamba group: a block per request, no token slots)
    ("full-layer-as-state", "framework", r'        self\.attn_type = "FullAttention"',
     '        self.attn_type = "Mamba"', LAYERS),
]


def mistake_fails_by_name(case: tuple[Path, Path, Path], pattern: str, replacement: str, failing: str):
    """A state port's mistake written into a render (``case``: render_case's paths) fails the check named
    ``failing`` on the short stream; a numeric failure leaves the registration check passing (the numbers name
    it). Returns the report."""
    manifest, rendered, cfg = case
    mutate(rendered, pattern, replacement, name=ATTN)
    # the check that fails is the point here, not the sub-module localisation's replay of the stream (twice the
    # run; tests/test_localisation.py covers it)
    with mock.patch.object(validate, "_localise", lambda *args, **kwargs: None):
        report = run_validate(manifest, rendered, cfg, scenario=SHORT)
    assert not report.passed
    assert not check(report, failing).passed, [(c.name, c.detail) for c in report.failed()]
    if failing == NUMERIC:
        assert check(report, LAYERS).passed
    return report


@pytest.mark.slow
@pytest.mark.parametrize("case, mode, pattern, replacement, failing", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_state_render_mistake_fails_by_name(tmp_path, case, mode, pattern, replacement, failing):
    report = mistake_fails_by_name(render_case(tmp_path, "qwen3_next", SMALL_QWEN3_NEXT, deploy_mode=mode), pattern,
                                   replacement, failing)
    if case == "full-layer-as-state":
        assert "'Mamba'" in check(report, LAYERS).detail and "'FullAttention'" in check(report, LAYERS).detail
    if case == "linear-layer-as-full-attention":
        assert "('FullAttention', None) != ('Mamba'" in check(report, LAYERS).detail \
            or "attn_type 'FullAttention' != 'Mamba'" in check(report, LAYERS).detail


@pytest.mark.slow
def test_the_short_stream_reuses_a_freed_state_block_with_padded_rows(tmp_path):
    """The negative controls' stream really exercises reuse: without the fix the prefill-reads-state mistake would
    pass a stream whose blocks are all fresh. Here the clean render passes it, and its late request lands on a
    block a finished request freed (the harness hands blocks out FIFO after the null block)."""
    manifest, rendered, cfg = _case(tmp_path, "qwen3_next", "framework")
    report = run_validate(manifest, rendered, cfg, scenario=SHORT)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    usage = check(report, "all blocks back in the pool").measured["usage"]["Mamba"]
    assert usage["total"] == SHORT.max_concurrency + 1 < len(SHORT.first) + len(SHORT.late) + 1


@pytest.mark.slow
@pytest.mark.parametrize("config, mode", [("qwen3_next", "framework"), ("qwen3_5_moe", "standalone")])
def test_attention_tp_splits_the_linear_heads_and_their_states(tmp_path, config, mode):
    """At attention TP 2 each rank keeps its key heads, the value heads they serve and so half of every state
    (16 -> 8 key, 32 -> 16 value heads); the gated full attention keeps its [query | gate] rows per head. Both
    fused projection layouts (Qwen3-Next per key head, Qwen3.5 [q | k | v]) are cut per rank by the host."""
    from model_infer_kvcache.validators.pipeline.validate import ValidateRequest, validate

    manifest, rendered, cfg = _case(tmp_path, config, mode, tp=2)
    text = (rendered / "kvcache_attention.py").read_text(encoding="utf-8")
    assert "LINEAR_NUM_K_HEADS_PER_RANK = 8" in text and "CONV_CHANNELS_PER_RANK = 4096" in text
    report = validate(ValidateRequest(manifest=str(manifest), rendered=str(rendered), config=str(cfg),
                                      backend="emulated", scenario=SHORT, sweep_readings=False, attn_tp_size=2))
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    for rank in (0, 1):
        assert check(report, f"rank {rank}: {NUMERIC}").measured["max_abs_diff"] <= 1e-9


def _ling3_case(tmp: Path, mode: str):
    """Ling-3.0 (transformers' bailing_hybrid: KDA linear layers, gated MLA full layers) without its MTP layer (with
    it: tests/test_hybrid_mtp.py), at 8 heads of 64: the torch recurrence has no operator
    limit on its sizes, and transformers' float64 reference at the published 32 x 128 takes a minute a stream
    (benchmarks/bench_hybrid.py's figure in references/hybrid_linear.md)."""
    import json

    from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
    from model_infer_kvcache.implementer.render import render_manifest, write_rendered

    cfg = json.loads((Path(__file__).resolve().parent / "fixtures" / "configs" / "bailing_hybrid_kda.json").read_text())
    cfg.update(num_nextn_predict_layers=0, num_attention_heads=8, num_key_value_heads=8, head_dim=64)
    config = tmp / "config.json"
    config.write_text(json.dumps(cfg), encoding="utf-8")
    manifest = analyze(AnalyzeRequest(config=str(config), deploy_mode=mode))
    path = tmp / "manifest.json"
    path.write_text(manifest.to_json(), encoding="utf-8")
    write_rendered(render_manifest(manifest), tmp / "rendered")
    return path, tmp / "rendered", config


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["framework"])  # the standalone runner's state slots: the GDN tests above
def test_kda_hybrid_renders_and_validates(tmp_path, mode):
    """Kimi delta attention has no torch-npu operator (npu_recurrent_gated_delta_rule's per-channel gk is
    unsupported): the render runs the recurrence in torch, float32 state [H, Dk, Dv], by each request's block."""
    manifest, rendered, cfg = _ling3_case(tmp_path, mode)
    text = (rendered / "kvcache_attention.py").read_text(encoding="utf-8")
    assert "def kda_recurrence(" in text and "torch_npu.npu_recurrent_gated_delta_rule(" not in text
    report = run_validate(manifest, rendered, cfg, scenario=SHORT)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert check(report, NUMERIC).measured["max_abs_diff"] <= 1e-9


@pytest.mark.slow
def test_a_kda_prefill_reading_the_state_block_fails(tmp_path):
    """The KDA render's prefill continuing from its block (a reused one holds a finished request's state)."""
    manifest, rendered, cfg = _ling3_case(tmp_path, "framework")
    mutate(rendered, r"if is_prefill else self\.recurrent_state\[slot\]", "if False else self.recurrent_state[slot]")
    report = run_validate(manifest, rendered, cfg, scenario=SHORT)
    assert not check(report, NUMERIC).passed and check(report, LAYERS).passed


def _ling25_case(tmp: Path, mode: str):
    """Ling-2.5 (lightning attention linear layers, ungated MLA full layers; the folder's config class saved as its
    hub config.json), validated against kvcache's Ling-2.5 reference (validators/pipeline/ling_lightning.py:
    transformers has no such model)."""
    return render_case(tmp, "ling_2_5", deploy_mode=mode)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_lightning_hybrid_renders_and_validates(tmp_path, mode):
    """One recurrent state per request (no conv), the torch recurrence S <- exp(g) S + k^T v by each request's block
    (framework) or row slot (standalone), beside MLA full layers."""
    manifest, rendered, cfg = _ling25_case(tmp_path, mode)
    text = (rendered / "kvcache_attention.py").read_text(encoding="utf-8")
    assert "def lightning_recurrence(" in text and "conv_state" not in text
    report = run_validate(manifest, rendered, cfg, scenario=SHORT)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert check(report, NUMERIC).measured["max_abs_diff"] <= 1e-9
    assert check(report, LAYERS).measured["layers"] == 20
    assert any(n.startswith("reference: kvcache's Ling-2.5 reference") for n in report.notes)  # said, not implied


LIGHTNING_MISTAKES = [
    # prefill continues from the block (a reused one holds a finished request's state, poisoned once freed)
    ("prefill-reads-the-state-block", r"if forward_metadata\.is_prefill else self\.recurrent_state\[slot\]",
     "if False else self.recurrent_state[slot]"),
    # the decay applied after the step's k^T v instead of before it (the newest token decays once too often)
    ("decay-after-the-update", r"state = state \* decay \+ key\[i\]\.unsqueeze\(-1\) \* value\[i\]\.unsqueeze\(-2\)",
     "state = (state + key[i].unsqueeze(-1) * value[i].unsqueeze(-2)) * decay"),
    # the query scale dropped (MiniMax's lightning attention has none; the Ling-2.5 port's simple GLA has Dk^-0.5)
    ("query-scale-dropped", r"query = query \* LINEAR_HEAD_K_DIM \*\* -0\.5", "query = query"),
]


@pytest.mark.slow
@pytest.mark.parametrize("case, pattern, replacement", LIGHTNING_MISTAKES, ids=[m[0] for m in LIGHTNING_MISTAKES])
def test_a_lightning_render_mistake_fails_by_name(tmp_path, case, pattern, replacement):
    manifest, rendered, cfg = _ling25_case(tmp_path, "framework")
    mutate(rendered, pattern, replacement, name=ATTN)
    report = run_validate(manifest, rendered, cfg, scenario=SHORT)
    assert not check(report, NUMERIC).passed and check(report, LAYERS).passed
