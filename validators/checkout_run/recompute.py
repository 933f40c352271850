"""The recompute oracle of checkout mode: the same model, the same weights, no cache reuse.

For every (request, step) whose logits the judged stream produced, the oracle's logits are those of the
checkout's own model when the request's whole prefix up to that position is computed in one fresh prefill. Each
prefix is a new request (its exact token ids) of a fresh Scheduler on the same engine, prefilled (packed with
others as the checkout's Scheduler packs prompts) and dropped before it decodes: a prefill attends over the
step's fresh K/V, so nothing an earlier step cached is read, and the blocks no request owns are poisoned before
each forward as in the stream. It runs after the judged stream and after the release readings, so it changes no
judged check.

It needs no transformers class. It judges what the cache does (write position, slot, block table, window, reuse,
state reset, decode-only paths), not what the prefill and the decode path compute alike (softmax scale, RoPE,
weights layout): both sides run that code, only transformers can judge it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.vocabulary import ORACLES
from model_infer_kvcache.validators.checkout_run.engine_run import EngineRun, _tensors_by_group
from model_infer_kvcache.validators.harness.poison import poison_free_blocks
from model_infer_kvcache.validators.pipeline.report import Report
from model_infer_kvcache.validators.pipeline.request_stream import Watchdog

# CheckoutRequest.oracle: what the numeric link compares the cached run with.
GREEDY_CHECK = "greedy tokens identical to recompute"


def check_oracle(value: str) -> str:
    if value not in ORACLES:
        raise InputError("--oracle", f"{value!r} is not one of {', '.join(ORACLES)}")
    return value


@dataclass
class Recomputed:
    """The oracle's logits of one run: (request, position) -> next-token logits of the fresh prefill."""

    logits: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    prefills: int = 0  # prefixes recomputed
    forwards: int = 0  # engine forwards they took
    tokens: int = 0  # prompt tokens prefilled
    seconds: float = 0.0
    error: str = ""  # the oracle's own run stopped (file:line: exception): nothing is judged


def prefixes(run: EngineRun) -> list[tuple[int, int]]:
    """(request, position) of every row of the stream with logits, in step order, each once."""
    seen: dict[tuple[int, int], None] = {}
    for s in run.steps:
        for rid, pos in zip(s.request_ids, s.positions, strict=True):
            if rid in run.sequences and pos < len(run.sequences[rid]):
                seen.setdefault((rid, pos), None)
    return list(seen)


def rounds(wanted: list[tuple[int, int]], batch: int, budget: int,
           uniform: bool = False) -> list[list[tuple[int, int]]]:
    """Split the prefixes into Scheduler rounds that each fit one packed prefill: at most ``batch`` requests
    (the pool holds that many of the longest length, so ``allocate_slots`` never refuses: the checkout's
    Scheduler would spin on a refused head of queue) and at most ``budget`` (max_prefill_tokens) tokens;
    ``uniform``: one length per round (a model that refuses variable-length prefill batches, --uniform-prefill)."""
    # Similar lengths side by side: the emulated attention pads a packed batch to its longest request, so a round
    # of one 300-token and three 40-token prefixes costs as much as four of 300 (--uniform-prefill: equal ones).
    wanted = sorted(wanted, key=lambda row: row[1])
    out: list[list[tuple[int, int]]] = []
    tokens = 0
    for rid, pos in wanted:
        n = pos + 1
        if not out or len(out[-1]) >= batch or tokens + n > budget or (uniform and out[-1][-1][1] != pos):
            out.append([])
            tokens = 0
        out[-1].append((rid, pos))
        tokens += n
    return out


def recompute(engine, run: EngineRun, step_seconds: float, uniform: bool = False) -> Recomputed:
    """Every prefix of ``run`` through a fresh prefill of ``engine``'s model (see the module docstring).
    Raises what the model raises; the blocks the oracle allocated are freed either way."""
    from executor.core.scheduler import Scheduler

    cfg = engine.infer_config.scheduler_config
    manager = engine.kvcache_manager
    groups = _tensors_by_group(manager.cache_info)
    wanted = prefixes(run)
    plan = rounds(wanted, cfg.batch_size_per_dp_rank, cfg.max_prefill_tokens, uniform)
    dog = Watchdog(max_steps=len(wanted), step_seconds=step_seconds, what="recompute oracle")
    out = Recomputed(prefills=len(wanted), tokens=sum(pos + 1 for _, pos in wanted))
    started = time.perf_counter()
    real_forward = engine.forward_batch
    asked: dict[int, tuple[int, int]] = {}  # this round's request id -> (request, position) of the stream

    def forward_batch(batch):
        poison_free_blocks(manager, groups)  # a prefill reading anything but its fresh K/V reads NaN
        result = real_forward(batch)
        logits = result["logits"].reshape(result["logits"].shape[0], -1)
        for i, r in enumerate(batch.requests):
            out.logits[asked[r.request_id]] = logits[i].detach().double().clone()
        out.forwards += 1
        return result

    engine.forward_batch = forward_batch
    try:
        for chunk in plan:
            # A fresh Scheduler per round: request ids and prefill offsets start as for a first batch.
            sched = Scheduler(tokenizer=None, config=cfg, input_truncated_len=engine.infer_config.data_config
                              .input_truncated_len)
            asked.clear()
            try:
                for rid, pos in chunk:
                    ids = torch.tensor(run.sequences[rid][:pos + 1], dtype=torch.long)
                    asked[sched.add_request(prompt="", input_ids=ids)] = (rid, pos)
                while sched.waiting_queue:  # prefill only: the requests are dropped before any decode
                    with dog.step(f"prefill of {len(sched.waiting_queue)} prefixes", [r for r, _ in chunk]):
                        if not sched.run_step(engine):
                            raise RuntimeError("the Scheduler had prefixes waiting but scheduled no prefill")
            finally:
                for request_id in asked:  # what the Scheduler would free when the request finishes
                    sched.running_requests.pop(request_id, None)
                    manager.free(request_id)
    finally:
        engine.forward_batch = real_forward
        out.seconds = time.perf_counter() - started
    return out


@dataclass
class _Rows:
    """The stream's rows against the oracle, sorted by what went wrong (each a ``where`` text, step order)."""

    checked: dict = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    beyond: dict = field(default_factory=lambda: {"prefill": [], "decode": []})  # finite, beyond tolerance
    cached_nonfinite: list = field(default_factory=list)  # the stream's own logits (V401 names the reads)
    oracle_nonfinite: list = field(default_factory=list)  # the fresh prefill's logits
    missing: list = field(default_factory=list)  # no recomputed logits (the Scheduler refused the prefix)
    greedy: list = field(default_factory=list)
    worst: float = 0.0
    worst_at: str = ""
    scale: float = 0.0

    def failed(self) -> bool:
        return bool(self.beyond["prefill"] or self.beyond["decode"] or self.cached_nonfinite
                    or self.oracle_nonfinite or self.missing)


def _compare(run: EngineRun, oracle: Recomputed, tolerance: float) -> _Rows:
    out = _Rows()
    for s in run.steps:
        path = "prefill" if s.is_prefill else "decode"
        for i, (rid, pos) in enumerate(zip(s.request_ids, s.positions, strict=True)):
            where = f"step {s.index} ({path}) request {rid} position {pos}"
            want, got = oracle.logits.get((rid, pos)), s.logits[i]
            if want is None:
                out.missing.append(where)
                continue
            out.checked[path] += 1
            if not torch.isfinite(want).all():  # the fresh prefill itself read a poisoned block
                out.oracle_nonfinite.append(where)
                continue
            if not torch.isfinite(got).all():
                out.cached_nonfinite.append(where)
                continue
            out.scale = max(out.scale, want.abs().max().item())
            diff = (got - want).abs().max().item()
            if diff > out.worst:
                out.worst, out.worst_at = diff, where
            if diff > tolerance:
                out.beyond[path].append(where)
            if int(got.argmax()) != int(want.argmax()):
                out.greedy.append(where)
    return out


def check_recompute(report: Report, run: EngineRun, oracle: Recomputed, tolerance: float) -> bool:
    """V305/V306: every row of the stream against the oracle's logits of the same prefix; True when V305 passed."""
    if oracle.error:
        detail = f"the recompute oracle's own prefills did not run: {oracle.error}"
        report.add(f"logits vs recompute (the model's own forward over the whole prefix, no cache) max |diff| <= "
                   f"{tolerance:g}", "numeric", False, detail=detail, prefills=oracle.prefills)
        report.add(GREEDY_CHECK, "numeric", False, detail=detail)
        return False
    rows = _compare(run, oracle, tolerance)
    report.add(f"logits vs recompute (the model's own forward over the whole prefix, no cache) max |diff| <= "
               f"{tolerance:g}", "numeric", not rows.failed(), detail=_detail(rows),
               max_abs_diff=rows.worst, worst_at=rows.worst_at, logit_max_abs=rows.scale,
               rows_prefill=rows.checked["prefill"], rows_decode=rows.checked["decode"], prefills=oracle.prefills,
               forwards=oracle.forwards, tokens=oracle.tokens, seconds=round(oracle.seconds, 2))
    # like V302: compared on finite rows; a row with nothing to compare fails it too
    unjudged = rows.cached_nonfinite or rows.oracle_nonfinite or rows.missing
    report.add(GREEDY_CHECK, "numeric", not rows.greedy and not unjudged, detail="; ".join(rows.greedy[:3]),
               mismatches=len(rows.greedy))
    return not rows.failed()


def _step(where: str) -> int:
    return int(where.split()[1])


def _detail(rows: _Rows) -> str:
    """Which rows differ, and on which path: decode rows alone point at what the cache holds or how it is read."""
    parts = []
    if rows.oracle_nonfinite:
        parts.append(f"the oracle's own prefill logits are not finite at {rows.oracle_nonfinite[0]} "
                     f"({len(rows.oracle_nonfinite)} rows): a fresh prefill read a poisoned block or state, so the "
                     "prefill path itself reads cache it did not write")
    if rows.missing:
        parts.append(f"no recomputed logits for {rows.missing[0]} ({len(rows.missing)} rows): the Scheduler refused "
                     "the prefix")
    failing = rows.beyond["prefill"] + rows.beyond["decode"] + rows.cached_nonfinite
    if failing:
        parts.append(f"first failure at {min(failing, key=_step)}; beyond tolerance: {len(rows.beyond['decode'])} "
                     f"of {rows.checked['decode']} decode rows, {len(rows.beyond['prefill'])} of "
                     f"{rows.checked['prefill']} prefill rows"
                     + (f"; {len(rows.cached_nonfinite)} rows of the stream not finite" if rows.cached_nonfinite
                        else ""))
    return "; ".join(parts)


def disagreement_note(transformers_passed: bool, recompute_passed: bool) -> str | None:
    """The note naming which oracle failed, and what that says about where the error is (None: both passed)."""
    if transformers_passed and recompute_passed:
        return None
    head = (f"transformers oracle: {'passed' if transformers_passed else 'failed'} / recompute oracle: "
            f"{'passed' if recompute_passed else 'failed'}: ")
    if recompute_passed:
        return head + ("the cached run equals the model's own no-cache forward over every prefix, so the error is in "
                       "code both the cached and the recomputed path run (prefill and decode alike: softmax scale, "
                       "RoPE, weights layout or loading, an operator keyword used on both paths), not in what the "
                       "cache holds or how it is read")
    if transformers_passed:
        return head + ("the cached run matches transformers but the model's own fresh prefill of the same prefix does "
                       "not: the error is in a prefill the stream did not exercise (a prefix longer than every "
                       "prompt, or packed beside other prefixes), not in the cached run")
    return head + ("the cached run differs from the model's own no-cache forward too: the error is (at least) in what "
                   "the cache holds or how it is read (write position, slot, block table, window, reuse, state "
                   "reset, a decode-only path)")
