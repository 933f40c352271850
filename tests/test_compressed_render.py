"""DeepSeek-V4 compressed attention rendered and validated against transformers (issue 38, steps 3-4): window-only
and HCA layers in both deployment modes, at the fused kernels' real shapes (D 512, 64 heads, window 128, HCA rate 128:
the emulated operators take no other), through a stream whose prompts cross the window and two HCA groups, with
early finishes and a late admit into a freed (poisoned) row; the realistic mistakes of a V4 port, each failing by
name. Framework mode too: the engine's SlidingWindow manager leaves a prompt's leading win_kv blocks without storage,
so a prefill attends over a temporary K=V cache of its own rows. CSA layers: tests/test_csa_render.py; MTP verify
steps: tests/test_v4_mtp.py."""

from __future__ import annotations

import pytest
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.validators.pipeline.request_stream import Scenario
from validators_support import check, mistaken_report, mutate, render_case, run_validate

CONFIG = "deepseek_v4_hca"
ATTN, RUNNER = "kvcache_attention.py", "kvcache_runner.py"
NUMERIC, SHAREDKV, OPS = "logits vs transformers", "shared-KV attention:", "rendered code runs without operator errors"
INIT = "_init_kvcache caches are"
# a prompt over two HCA groups and past the window; one whose decode completes its first group (the compressor reads
# the group's earlier tokens back from the state slot its prefill wrote); a late admit into the first finished
# request's row (its state slot poisoned) whose decode completes a group too; decode steps of two rows at different
# positions
STREAM = Scenario(first=((262, 3), (126, 4)), late=((125, 5),), max_concurrency=2, release_requests=1)


def _case(tmp_path, mode: str = "standalone", **overrides):
    return render_case(tmp_path, CONFIG, overrides or None, deploy_mode=mode)


@pytest.mark.parametrize("mode", ["standalone", "framework"])
def test_window_and_hca_layers_render_and_match_transformers(tmp_path, mode):
    manifest, rendered, cfg = _case(tmp_path, mode)
    text = (rendered / ATTN).read_text(encoding="utf-8")
    for op in ("compressor(", "npu_sparse_attn_sharedkv(", "npu_sparse_attn_sharedkv_metadata(",
               "scatter_nd_update_asc(", "inplace_partial_rotary_mul("):
        assert f"torch.ops.custom.{op}" in text, op
    report = run_validate(manifest, rendered, cfg, scenario=STREAM)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert check(report, NUMERIC).measured["max_abs_diff"] <= 1e-9
    assert check(report, SHAREDKV).measured["calls"] > 0
    if mode == "framework":  # the three managers upstream deepseek_v4 keys its entries by
        assert set(check(report, "all blocks back in the pool").measured["usage"]) == {
            "win_kv", "c128a_cmp_kv", "c128a_cmp_state"}


# (id, file, pattern, replacement, the check that names the mistake): standalone mode
MISTAKES = [
    # the unfinished group pooled as an entry: the op's pad rows (NaN) taken for entries, a request's entries
    # shifted onto the next request's
    ("partial-group-written-as-an-entry", ATTN, r"first, last = starts // ratio, ends // ratio",
     "first, last = starts // ratio, (ends + ratio - 1) // ratio", NUMERIC),
    # a reused row's compressor position not reset: the late request's prefill is pooled as if it continued the
    # finished request (its groups read the finished request's state back); the compressor refuses it, naming the
    # state table its positions run past
    ("compressor-state-not-reset-on-reuse", RUNNER, r"            self\.kv_len\[index\] = 0  # a reused row starts "
                                                    r"empty\n", "", OPS),
    # the state slots counted from 0 (slot 0 is the compressor's "not stored"): the last row has no slot
    ("state-slot-zero-taken-by-a-row", RUNNER, r"attn\.sfa_kv_state = torch\.zeros\(batch_size \+ 1,",
     "attn.sfa_kv_state = torch.zeros(batch_size,", INIT),
    # the window branch one token wider than the model's (ori_win_left = W instead of W - 1): the kernel's band is
    # fixed (custom-npu_sparse_attn_sharedkv.md: ori_win_left 仅支持默认值127), its emulation refuses it by name
    ("window-one-token-too-many", ATTN, r"ori_win_left=SLIDING_WINDOW - 1", "ori_win_left=SLIDING_WINDOW", OPS),
]


# framework mode: the engine's sliding manager leaves a prompt's leading win_kv blocks without storage
FRAMEWORK_MISTAKES = [
    # a prefill's window read back from win_kv (its leading blocks: the poisoned null block)
    ("prefill-reads-its-window-from-win-kv", ATTN,
     r"window_kv, window_table = self\.prefill_full_kv\(kv, forward_metadata\)", "pass  # read back, as at decode",
     NUMERIC),
    # the null block's slots written (a prompt's slid-out tokens, padded decode rows): one row written many times
    ("null-block-slots-written", ATTN,
     r"        slot_mapping = torch\.where\(slot_mapping // BLOCK_SIZE == NULL_BLOCK, torch\.full_like\(slot_mapping, "
     r"-1\),\n\s+slot_mapping\)\n", "", OPS),
    # the compressed entries registered with the window branch's manager (one group, one block size)
    ("entries-under-the-window-manager", ATTN, r"manager_key=cmp_manager", "manager_key=WINDOW_MANAGER",
     "cache entries match the manifest"),
]


@pytest.mark.parametrize("case, name, pattern, replacement, failing", FRAMEWORK_MISTAKES,
                         ids=[m[0] for m in FRAMEWORK_MISTAKES])
def test_a_v4_framework_render_mistake_fails_by_name(tmp_path, monkeypatch, case, name, pattern, replacement, failing):
    from model_infer_kvcache.validators.pipeline import validate

    # the check that fails is the point here, not the sub-module localisation's replay of it
    monkeypatch.setattr(validate, "_localise", lambda *args, **kwargs: None)
    manifest, rendered, cfg = _case(tmp_path, "framework")
    mutate(rendered, pattern, replacement, name=name)
    report = run_validate(manifest, rendered, cfg, scenario=STREAM)
    assert not report.passed
    assert not check(report, failing).passed, [(c.name, c.detail) for c in report.failed()]


@pytest.mark.parametrize("case, name, pattern, replacement, failing", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_v4_render_mistake_fails_by_name(tmp_path, case, name, pattern, replacement, failing):
    report = mistaken_report(_case(tmp_path), pattern, replacement, STREAM, name=name)
    assert not check(report, failing).passed, [(c.name, c.detail) for c in report.failed()]
    if failing == OPS:  # the operator refuses the call, naming the argument
        assert {"window-one-token-too-many": "ori_win_left",
                "compressor-state-not-reset-on-reuse": "custom.compressor"}[case] in check(report, OPS).detail


def test_a_float32_run_is_refused_naming_the_dtype(tmp_path):
    """The custom operators take no float32 (their docs): a float32 run is refused at its input, not reported as an
    operator failure of the render."""
    from model_infer_kvcache.validators.pipeline.validate import ValidateRequest, validate

    manifest, rendered, cfg = _case(tmp_path)
    with pytest.raises(InputError) as info:
        validate(ValidateRequest(manifest=str(manifest), rendered=str(rendered), config=str(cfg), backend="emulated",
                                 dtype="float32"))
    assert "float32" in str(info.value) and "compressed" in str(info.value), info.value
