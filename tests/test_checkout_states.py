"""check_state_blocks: which recurrent-state blocks a checkout step wrote, against the blocks its live requests own.

The observation (``engine_run.changed_blocks`` around each forward) and the judgement are exercised here on
hand-built steps; the real engine runs them in tests/test_checkout_hybrid.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from model_infer_kvcache.validators.checkout_run.checks import STATE_BLOCKS, check_state_blocks
from model_infer_kvcache.validators.checkout_run.engine_run import StepRecord, changed_blocks
from model_infer_kvcache.validators.pipeline.report import Report

NULL = 0


def _run(*steps):
    pool = SimpleNamespace(get_null_block=lambda: NULL)
    mamba = SimpleNamespace(attn_type="Mamba", manager_key="Mamba", block_pool=pool)
    full = SimpleNamespace(attn_type="FullAttention", manager_key="FullAttention", block_pool=pool)
    return SimpleNamespace(engine=SimpleNamespace(kvcache_manager=SimpleNamespace(single_type_managers=[full, mamba])),
                           steps=list(steps))


def _step(index, rows, writes, padded=0, prefill=False):
    """``rows``: each live request's state block; ``writes``: {layer: blocks the layer changed}."""
    table = torch.tensor([[b] for b in rows] + [[NULL]] * padded, dtype=torch.int32)
    return StepRecord(index, prefill, list(range(len(rows))), [0] * len(rows), torch.zeros(len(rows), 4), padded,
                      {"Mamba": table}, {}, [1] * len(rows),
                      state_writes={(layer, name, "Mamba"): blocks for layer, blocks in writes.items()
                                    for name in ("conv_state", "recurrent_state")})


def _judge(*steps):
    report = Report(backend="cpu", deploy_mode="framework", model_type="t", manifest_hash="h")
    check_state_blocks(report, _run(*steps))
    return next(c for c in report.checks if c.name == STATE_BLOCKS)


def test_every_request_writes_its_own_block_passes():
    check = _judge(_step(0, [3, 5], {0: [3, 5], 2: [3, 5]}, prefill=True),
                   _step(1, [3, 5], {0: [3, 5, NULL], 2: [3, 5, NULL]}, padded=2))  # padding writes the null block
    assert check.passed, check.detail
    assert check.measured["judged"] == 8


def test_another_requests_block_written_fails():
    """The state slot of another request: row 1 writes the block of a request that is not in the step."""
    check = _judge(_step(0, [3, 5], {0: [3, 5], 2: [3, 7]}))
    assert not check.passed
    assert "step 0 layer 2 conv_state: wrote block(s) [7] no live request of the step owns" in check.detail
    assert "left block(s) [5] of live requests unchanged" in check.detail


def test_a_live_requests_state_left_unchanged_fails():
    """A prefill that keeps no final state (or a decode that drops its update)."""
    check = _judge(_step(0, [3, 5], {0: [3]}, prefill=True))
    assert not check.passed and "step 0 layer 0 conv_state: left block(s) [5] of live requests unchanged" in \
        check.detail


def test_the_null_block_is_only_for_padded_rows():
    check = _judge(_step(0, [3, 5], {0: [3, 5, NULL]}))
    assert not check.passed and f"wrote block(s) [{NULL}]" in check.detail


def test_no_state_observed_is_no_pass():
    check = _judge(_step(0, [3], {}))
    assert not check.passed and check.measured["judged"] == 0


def test_changed_blocks_sees_writes_and_keeps_poison_unchanged():
    before = torch.zeros(4, 2, 3)
    before[2] = float("nan")  # a freed block, poisoned
    after = before.clone()
    after[1, 0, 0] = 1.0
    assert changed_blocks(before, after) == [1]
    after[2] = 0.0  # a poisoned block overwritten
    assert changed_blocks(before, after) == [1, 2]
