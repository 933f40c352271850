"""Hybrid models served with their MTP layers: speculative state slots over recurrent states (issue 41, step 1).

Each request holds 1 + next_n state blocks; token c of a verify step leaves its state in column c and the next step
resumes from the last accepted token's column, found through the anchor each request's first block keeps (the
framework's forward metadata names no accepted count). Validated with the verify-step stream of
validators/pipeline/spec_decode.py: every request alternates an accepted and a rejected draft, each verify step's
logits compared with transformers (Ling-2.5: kvcache's Ling-2.5 reference) over the accepted tokens. The three
realistic port mistakes each pass the ordinary decode steps and fail the speculative comparison by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from model_infer_kvcache.validators.pipeline.request_stream import Scenario
from shared_dirs import shared_path
from validators_support import check, mutate, render_case, run_validate

SPEC, NUMERIC = "speculative decode (next_n=1)", "logits vs transformers"
ATTN, RUNNER = "kvcache_attention.py", "kvcache_runner.py"
# two requests and a late admit into freed state blocks (one prompt past a block: the verify stream needs 146
# positions at next_n 2), then the verify stream that is judged
SHORT = Scenario(first=((150, 3), (20, 3)), late=((30, 2),), max_concurrency=2, release_requests=1)


def _qwen35_mtp(tmp: Path, mode: str, small: bool = True, **analyze_kw):
    """Qwen3.5-MoE at transformers' defaults plus its published MTP layer (``mtp_num_hidden_layers: 1``); ``small``:
    4 key / 8 value linear heads and 8 query heads instead of 16 / 32 / 16 (the head dims, which the gated delta
    rule operators fix at 128, and everything else as published), a quarter of the state to carry per token."""
    cfg = json.loads((Path(__file__).resolve().parent / "fixtures" / "configs" / "qwen3_5_moe.json").read_text())
    cfg["text_config"]["mtp_num_hidden_layers"] = 1
    if small:
        cfg["text_config"].update(linear_num_key_heads=4, linear_num_value_heads=8, num_attention_heads=8)
    return render_case(tmp, "qwen3_5_moe", overrides={"text_config": cfg["text_config"]}, deploy_mode=mode,
                       **analyze_kw)


def _ling25_mtp(tmp: Path, mode: str):
    """Ling-2.5 (lightning attention, MLA) with one MTP layer, as its published checkpoint has."""
    return render_case(tmp, "ling_2_5", overrides={"num_nextn_predict_layers": 1}, deploy_mode=mode)


def test_the_plan_keeps_one_state_block_per_verify_token_and_counts_them(tmp_path):
    from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
    from model_infer_kvcache.analyzer.manifest import SelectionManifest

    manifest, rendered, config = _qwen35_mtp(tmp_path, "framework", small=False)
    m = SelectionManifest.model_validate_json(manifest.read_text(encoding="utf-8"))
    lin = m.linear_attention
    assert m.mtp is not None and lin.state_blocks_per_request == 2
    assert "column of the last accepted token" in lin.speculative and "state_anchor" in lin.speculative
    anchor = next(s for s in lin.states if s.name == "state_anchor")
    assert (anchor.shape, anchor.dtype) == ([1], "int32")
    # conv [8192, 3] and recurrent [32, 128, 128] bfloat16 plus the int32 anchor, per linear layer and block
    assert lin.state_bytes_per_layer == 8192 * 3 * 2 + 32 * 128 * 128 * 2 + 4
    # the memory plan reserves 1 + next_n state blocks per request (MambaManager: concurrency x (1 + next_n) + 1)
    sized = analyze(AnalyzeRequest(config=str(config), max_concurrency=4, max_len=4096))
    assert sized.memory.blocks["Mamba"] == 4 * (1 + 1) + 1
    assert "Mamba: fixed 4 x (1 + 1) + 1 = 9 state blocks (offline too)" in sized.memory.derivation
    assert not any("--next-n 0" in w.message for w in m.warnings)
    text = (rendered / ATTN).read_text(encoding="utf-8")
    assert "NEXT_N = 1" in text and text.count("next_n=NEXT_N,") == 3  # conv, recurrent, anchor entries


def _ling3_mtp(tmp: Path, mode: str):
    """Ling-3.0 (transformers' bailing_hybrid: KDA linear layers) with its published MTP layer, at 8 heads of 64
    (transformers' float64 KDA reference at 32 x 128 takes a minute a stream)."""
    return render_case(tmp, "bailing_hybrid_kda", overrides=dict(num_attention_heads=8, num_key_value_heads=8,
                                                                 head_dim=64), deploy_mode=mode)


CASES = {"qwen3_5_moe": _qwen35_mtp, "ling_2_5": _ling25_mtp, "ling_3_kda": _ling3_mtp}


@pytest.mark.slow
@pytest.mark.parametrize("model, mode", [("qwen3_5_moe", "framework"),  # standalone: the next_n 2 test below
                                         ("ling_2_5", "framework"), ("ling_2_5", "standalone"),
                                         ("ling_3_kda", "framework")])
def test_hybrid_with_mtp_passes_accepted_and_rejected_drafts(tmp_path, model, mode):
    """Every recurrent kind: gated delta net (the operator, one token per call), lightning and KDA (torch)."""
    manifest, rendered, cfg = CASES[model](tmp_path, mode)
    if model == "ling_3_kda":
        assert json.loads(cfg.read_text())["num_nextn_predict_layers"] == 1  # the published MTP layer kept
    report = run_validate(manifest, rendered, cfg, scenario=SHORT)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    spec = check(report, SPEC)
    assert spec.measured["accepted"] > 0 and spec.measured["rejected"] > 0
    assert spec.measured["max_abs_diff"] <= 1e-9


GDN_RESUME = r"source = slots\.gather\(1, resume\.view\(-1, 1\)\)\.view\(-1\)\.long\(\)"
MISTAKES = [
    # one state per request updated through every drafted token (the pre-MTP decode): after a rejected draft the
    # next step starts from the state after the last drafted token
    ("state-after-the-last-draft", "framework",
     [(ATTN, GDN_RESUME, "source = slots[:, 0].long()"),
      (ATTN, r"target = slots\[rows, col\]\.long\(\)", "target = slots[rows, 0].long()")]),
    # the conv window left in every column shifted by all 1 + next_n drafted inputs, not by the accepted ones
    ("conv-shifted-by-the-drafted-count", "standalone",
     [(ATTN, r"window\[col \+ 1:col \+ CONV_KERNEL\]", "window[length:length + CONV_KERNEL - 1]")]),
    # the runner builds a verify step's state slots for its rows in another order than the batch: two requests
    # swap their speculative state slots (ordinary decode steps keep the right ones)
    ("speculative-slots-of-two-requests-swapped", "standalone",
     [(RUNNER, r"state_slots=\(index\.view\(-1, 1\)", "state_slots=((index.flip(0) if next_n else index).view(-1, 1)")]),
]


@pytest.mark.slow
@pytest.mark.parametrize("case, mode, edits", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_speculative_state_mistake_fails_by_name(tmp_path, case, mode, edits):
    manifest, rendered, cfg = _qwen35_mtp(tmp_path, mode)
    for name, pattern, replacement in edits:
        mutate(rendered, pattern, replacement, name=name)
    report = run_validate(manifest, rendered, cfg, scenario=SHORT)
    assert not check(report, SPEC).passed, [(c.name, c.detail) for c in report.failed()]
    # ordinary decode steps write and read column 0 only: the mistake is the speculative one
    assert check(report, NUMERIC).passed


def test_a_checkout_run_says_the_engine_runs_without_speculation_as_the_folders_yamls_serve(tmp_path):
    """Upstream serves qwen3_5 and bailing_2_5 without MTP (no yaml sets next_n: the framework's default 0), so a
    checkout run of a config with MTP layers judges no verify step, and says so with the yamls' figures."""
    from model_infer_kvcache.validators.checkout_run.layout import served_next_n, speculation_note

    root = shared_path("upstream", "cann-recipes-infer")
    served = served_next_n(root, ["qwen3_5", "bailing_2_5"])
    assert len(served) >= 5 and set(served.values()) == {0}
    note = speculation_note(served, 1)
    assert "engine runs at next_n 0" in note and f"its {len(served)} yaml(s) serve next_n 0" in note
    # a yaml that does set it is read
    folder = tmp_path / "models" / "m" / "config"
    folder.mkdir(parents=True)
    (folder / "a.yaml").write_text("model_config:\n  next_n: 2\n", encoding="utf-8")
    (folder / "b.yaml").write_text("model_config:\n  exe_mode: eager\n", encoding="utf-8")
    assert served_next_n(tmp_path, ["m"]) == {"models/m/config/a.yaml": 2, "models/m/config/b.yaml": 0}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_two_drafts_per_step_accept_all_none_and_some(tmp_path, mode):
    """--next-n 2 (the MTP layer run twice per step, as the framework's MTP worker does): three state columns, and
    per request and step all, none or one of the two drafts accepted."""
    manifest, rendered, cfg = _qwen35_mtp(tmp_path, mode, next_n=2)
    report = run_validate(manifest, rendered, cfg, scenario=SHORT)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    spec = check(report, "speculative decode (next_n=2)")
    assert spec.measured["patterns"] == ["all", "none", "some"] and spec.measured["max_abs_diff"] <= 1e-9
