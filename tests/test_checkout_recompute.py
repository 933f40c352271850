"""The recompute oracle of checkout mode (V305/V306): the checkout's own model over each whole prefix, no cache.

Every row of the judged stream is compared with a fresh prefill of the same prefix by the same model and weights
(validators/checkout_run/recompute.py). The end-to-end cases run against the pinned snapshot and reuse the negative
controls of tests/test_checkout_negatives.py: where the mistake is in what the cache holds or how it is read, the
recompute oracle fails exactly where the transformers comparison fails; where the prefill and the decode path share
the mistake, only transformers sees it, and the report's note says which oracle failed.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.validators.checkout_run.engine_run import EngineRun, StepRecord
from model_infer_kvcache.validators.checkout_run.recompute import (
    Recomputed,
    check_recompute,
    disagreement_note,
    rounds,
)
from model_infer_kvcache.validators.pipeline.report import Report
from shared_dirs import upstream_head
from test_checkout_negatives import CONFIGS, FAMILIES, MISTAKES, NEG_STREAM, _failures, _manifest, edited_copy

LOGITS = "logits vs recompute"
GREEDY = "greedy tokens identical to recompute"


# --------------------------------------------------------------------------- units (no checkout)
def _step(index: int, is_prefill: bool, rows: dict[int, int], logits: torch.Tensor) -> StepRecord:
    return StepRecord(index, is_prefill, list(rows), list(rows.values()), logits, 0, {}, {}, [])


def _run_and_oracle():
    """Two requests, a prefill and a decode step; the oracle's logits equal the stream's."""
    g = torch.Generator().manual_seed(0)
    prefill, decode = torch.randn(2, 8, generator=g, dtype=torch.float64), torch.randn(2, 8, generator=g,
                                                                                        dtype=torch.float64)
    run = EngineRun(None, None, [_step(0, True, {0: 4, 1: 2}, prefill), _step(1, False, {0: 5, 1: 3}, decode)],
                    {0: list(range(7)), 1: list(range(5))})
    rows = {(0, 4): prefill[0], (1, 2): prefill[1], (0, 5): decode[0], (1, 3): decode[1]}
    oracle = Recomputed({k: v.clone() for k, v in rows.items()}, prefills=4)
    return run, oracle


def _report() -> Report:
    return Report(backend="emulated", deploy_mode="framework", model_type="qwen3", manifest_hash="x")


def test_rounds_fit_the_batch_the_budget_and_one_length_when_uniform():
    wanted = [(0, 9), (1, 9), (2, 4), (0, 10), (1, 10), (2, 5)]  # (request, position): step order
    # similar lengths side by side (a packed batch costs as much as its longest request times its size)
    assert rounds(wanted, batch=2, budget=100) == [[(2, 4), (2, 5)], [(0, 9), (1, 9)], [(0, 10), (1, 10)]]
    assert rounds(wanted, batch=4, budget=25) == [[(2, 4), (2, 5), (0, 9)], [(1, 9), (0, 10)], [(1, 10)]]
    # --uniform-prefill: a model refusing variable-length prefill batches gets one length per round
    assert rounds(wanted, batch=4, budget=100, uniform=True) == [[(2, 4)], [(2, 5)], [(0, 9), (1, 9)],
                                                                  [(0, 10), (1, 10)]]


def test_equal_logits_pass_and_a_decode_row_off_fails_naming_it():
    run, oracle = _run_and_oracle()
    report = _report()
    assert check_recompute(report, run, oracle, 1e-4)
    assert [(c.id, c.passed) for c in report.checks] == [("V305", True), ("V306", True)]
    assert report.checks[0].measured["rows_decode"] == 2 and report.checks[0].measured["rows_prefill"] == 2

    oracle.logits[(1, 3)] = oracle.logits[(1, 3)] + 1e-3
    report = _report()
    assert not check_recompute(report, run, oracle, 1e-4)
    logits = report.checks[0]
    assert not logits.passed and math.isclose(logits.measured["max_abs_diff"], 1e-3, rel_tol=1e-6)
    assert logits.detail.startswith("first failure at step 1 (decode) request 1 position 3; beyond tolerance: "
                                    "1 of 2 decode rows, 0 of 2 prefill rows")
    assert report.checks[1].passed  # the argmax did not move


def test_nonfinite_and_missing_rows_fail_with_their_reason():
    run, oracle = _run_and_oracle()
    oracle.logits[(0, 5)] = torch.full((8,), float("nan"), dtype=torch.float64)  # the fresh prefill read a poison
    del oracle.logits[(1, 3)]
    run.steps[0].logits[1, 0] = float("nan")  # the stream's own row: V401 names the read, V305 counts it
    report = _report()
    assert not check_recompute(report, run, oracle, 1e-4)
    detail = report.checks[0].detail
    assert "the oracle's own prefill logits are not finite at step 1 (decode) request 0 position 5" in detail
    assert "no recomputed logits for step 1 (decode) request 1 position 3" in detail
    assert "1 rows of the stream not finite" in detail
    assert math.isfinite(report.checks[0].measured["max_abs_diff"])  # never inf in the JSON report
    assert not report.checks[1].passed


def test_oracle_error_fails_both_checks_with_its_line():
    run, _ = _run_and_oracle()
    report = _report()
    assert not check_recompute(report, run, Recomputed(prefills=4, error="modeling_x.py:12: ValueError: no"), 1e-4)
    assert [c.passed for c in report.checks] == [False, False]
    assert report.checks[0].detail == "the recompute oracle's own prefills did not run: modeling_x.py:12: ValueError: no"


def test_the_note_names_the_oracle_that_failed():
    assert disagreement_note(True, True) is None
    shared = disagreement_note(False, True)
    assert shared.startswith("transformers oracle: failed / recompute oracle: passed: ")
    assert "code both the cached and the recomputed path run" in shared
    assert "softmax scale" in shared and "RoPE" in shared
    assert disagreement_note(False, False).startswith("transformers oracle: failed / recompute oracle: failed: ")
    assert "write position, slot, block table" in disagreement_note(False, False)
    assert disagreement_note(True, False).startswith("transformers oracle: passed / recompute oracle: failed: ")


def test_oracle_value_is_checked_when_the_request_is_made():
    from model_infer_kvcache.validators.checkout_run import CheckoutRequest

    assert CheckoutRequest("r", "m", "c").oracle == "both"
    with pytest.raises(InputError, match=r"--oracle: 'hf' is not one of both, transformers, recompute"):
        CheckoutRequest("r", "m", "c", oracle="hf")


def test_without_a_reference_both_is_the_recompute_oracle_alone():
    from model_infer_kvcache.validators.checkout_run.run import _oracle_for

    report = _report()
    assert _oracle_for(report, "both", object(), True) == "both" and not report.notes
    assert _oracle_for(report, "recompute", None, True) == "recompute" and not report.notes
    assert _oracle_for(report, "both", None, True) == "recompute"
    assert report.notes == ["transformers oracle not run: no transformers reference for this architecture; the "
                            "recompute oracle judges the numeric link alone"]
    with pytest.raises(InputError, match="no transformers reference model"):
        _oracle_for(report, "transformers", None, True)


# --------------------------------------------------------------------------- end to end (the snapshot)
def _check(report, prefix: str):
    found = [c for c in report.checks if re.sub(r"^rank \d+: ", "", c.name).startswith(prefix)]
    assert found, f"no check {prefix!r}; failures: {_failures(report)}"
    return found


def _oracle_note(report) -> str | None:
    return next((n for n in report.notes if n.startswith("transformers oracle: ")), None)


@pytest.mark.slow
def test_qwen3_8b_passes_both_oracles():
    from dataclasses import replace

    from model_infer_kvcache.validators.checkout_run import ENGINE_QUICK, CheckoutRequest, validate_checkout

    report = validate_checkout(CheckoutRequest(str(upstream_head()), "qwen3_8b", str(CONFIGS / "qwen3_8b.json"),
                                               scenario=replace(ENGINE_QUICK, release_requests=1),
                                               sweep_readings=False))
    assert report.passed, _failures(report)
    logits, = _check(report, LOGITS)
    assert logits.id == "V305" and logits.name.endswith("<= 0.0001")
    # float32 both ways, the same code: rounding only (measured 4.6e-6 at logits of magnitude 4.7)
    assert logits.measured["max_abs_diff"] < 2e-5
    # every row of the stream, each a fresh prefill (ENGINE_QUICK: 4 requests, a prefill and 4 decodes each)
    assert logits.measured["prefills"] == logits.measured["rows_prefill"] + logits.measured["rows_decode"] == 20
    assert _check(report, GREEDY)[0].passed
    # the oracle runs after the release readings: the pool and the sequential release run are judged as before
    assert all(c.passed for c in _check(report, "all blocks back in the pool after the stream"))
    assert all(c.passed for c in _check(report, "1 sequential requests leave the pool and memory unchanged"))
    assert _oracle_note(report) is None


# Mistakes in what the cache holds or how it is read: both oracles fail.
CACHE_MISTAKES = ["cache-not-written", "old-cache-write-left-in-place", "kv-len-mutated-in-layer",
                  "block-table-of-the-other-group"]
# Mistakes the prefill and the decode path share: transformers fails, the recompute oracle cannot see them.
# qwen's prefill reads its K/V back from the cache it just wrote, so a cache holding un-rotated keys is shared too.
SHARED_MISTAKES = ["softmax-scale-without-sqrt", "rope-after-cache-write"]
BY_ID = {m.id: m for m in MISTAKES}


@pytest.fixture(scope="module")
def manifests(tmp_path_factory):
    """The manifest of each family, analyzed once (as the negative controls do)."""
    out = str(tmp_path_factory.mktemp("manifests"))
    return lambda family, tp=None: _manifest(family, tp, out)


def _validate(family: str, model_file, manifest: str, oracle: str = "both"):
    from model_infer_kvcache.validators.checkout_run import CheckoutRequest, validate_checkout

    fam = FAMILIES[family]
    return validate_checkout(CheckoutRequest(
        framework_root=str(upstream_head()), model=fam.model, config=str(CONFIGS / f"{fam.config}.json"),
        manifest=manifest, attn_tp_size=fam.tp, model_file=str(model_file), scenario=NEG_STREAM,
        sweep_readings=False, readings=fam.readings, oracle=oracle))


def _passed(report, prefix: str) -> bool:
    return all(c.passed for c in _check(report, prefix))


@pytest.mark.slow
@pytest.mark.parametrize("mistake_id", CACHE_MISTAKES + SHARED_MISTAKES)
def test_the_oracles_agree_on_cache_mistakes_and_only_transformers_sees_shared_ones(mistake_id, tmp_path, manifests):
    mistake = BY_ID[mistake_id]
    report = _validate(mistake.family, edited_copy(mistake.family, mistake.edits, tmp_path),
                       manifests(mistake.family, FAMILIES[mistake.family].tp))
    transformers = _passed(report, "logits vs transformers") and _passed(report, "greedy tokens identical to transformers")
    recompute = _passed(report, LOGITS) and _passed(report, GREEDY)
    assert not transformers, _failures(report)
    note = _oracle_note(report)
    if mistake_id in CACHE_MISTAKES:
        assert not recompute, _failures(report)
        assert not _passed(report, LOGITS), _failures(report)
        assert note.startswith("transformers oracle: failed / recompute oracle: failed: "), report.notes
        if mistake_id == "old-cache-write-left-in-place":  # finite logits, other tokens: V306's own control
            greedy, = _check(report, GREEDY)
            assert not greedy.passed and greedy.measured["mismatches"] > 0
    else:
        assert recompute, _failures(report)
        assert _check(report, LOGITS)[0].measured["max_abs_diff"] < 2e-5  # rounding: both paths compute alike
        assert note.startswith("transformers oracle: failed / recompute oracle: passed: "), report.notes
        assert "code both the cached and the recomputed path run" in note


@pytest.mark.slow
def test_recompute_alone_passes_the_unedited_model_and_fails_a_cache_mistake(tmp_path, manifests):
    manifest = manifests("qwen", None)
    clean = _validate("qwen", edited_copy("qwen", (), tmp_path / "clean"), manifest, oracle="recompute")
    assert clean.passed, _failures(clean)
    assert not [c for c in clean.checks if c.id in ("V301", "V302")]  # no transformers comparison
    assert [c.id for c in clean.checks if c.link == "numeric"] == ["V305", "V306"]
    assert any(c.id == "V401" and c.passed for c in clean.checks)  # the stream's logits are finite (poisoned pool)
    assert any(n.startswith("oracle: recompute only") for n in clean.notes)

    mistake = BY_ID["kv-len-mutated-in-layer"]
    broken = _validate("qwen", edited_copy("qwen", mistake.edits, tmp_path / "broken"), manifest, oracle="recompute")
    logits, = _check(broken, LOGITS)
    assert not logits.passed and "first failure at step 1 (decode)" in logits.detail
    assert not [c for c in broken.checks if c.id in ("V301", "V302")] and _oracle_note(broken) is None
