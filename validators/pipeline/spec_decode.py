"""Speculative decoding (MTP) through the rendered code: verify steps with q_len = 1 + next_n.

Manifests with MTP layers decode 1 + next_n query tokens per request when speculation is on (next_n: the
manifest's ``mtp.speculative_tokens``). The tiny transformers model has no MTP head, and none is needed: what the
rendered code must get right is the main model's verify step. Each verify step feeds, per request, its last
accepted token and next_n drafts built for a planned acceptance: all drafts the reference's greedy continuation
(all accepted), the first one wrong (none), or a greedy prefix then a wrong token (some, next_n >= 2), cycling
over steps and requests. Every row's logits are compared with a causal transformers forward over the request's
tokens + the drafts. After the step the cache keeps the accepted tokens only: kv_len advances by 1 + accepted,
and the slots of rejected drafts are overwritten by the next step.

The reference forwards are one per greedy draft (each draft extends the sequence the next one is chosen on) and
one per judged step; where a step accepts every draft, its judged forward runs over the tokens the next step
starts from (the drafts and the bonus token: the model is causal, so its rows before the last are the step's),
and that next step's first draft reads it again (host_model.ReferenceMemo) instead of running it twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from model_infer_kvcache.validators.kinds import kind_of
from model_infer_kvcache.validators.pipeline.graph_capture import check_runner_padding
from model_infer_kvcache.validators.pipeline.host_model import ReferenceMemo
from model_infer_kvcache.validators.pipeline.report import Report
from model_infer_kvcache.validators.pipeline.request_stream import Watchdog

# (prompt length, verify steps): one prompt past a 128-token block, one short; three steps each cycle every
# acceptance pattern over the two requests (two patterns at next_n 1, three from 2 on).
PROMPTS = ((137, 3), (21, 3))


@dataclass
class SpecStream:
    """Draft choice, acceptance and the numeric comparison of one speculative-decode stream."""

    ref_model: object
    vocab: int
    atol: float
    next_n: int = 1
    tokens: dict[int, list[int]] = field(default_factory=dict)  # accepted tokens; the last one is not cached yet
    planned: dict[int, int] = field(default_factory=dict)  # drafts each request's current step should accept
    patterns: set[str] = field(default_factory=set)  # all / none / some, as they happened
    worst: float = 0.0
    worst_at: str = ""
    nonfinite: list[str] = field(default_factory=list)
    wrong_verdicts: list[str] = field(default_factory=list)
    accepted: int = 0
    rejected: int = 0
    steps: list[int] = field(default_factory=list)  # host step indices of the verify steps
    rejected_entries: int = 0  # compressed entries rejected drafts completed (poisoned before the next step)
    reference: ReferenceMemo | None = None  # the reference's logits per sequence (built from ref_model)

    def __post_init__(self) -> None:
        self.reference = self.reference or ReferenceMemo(self.ref_model)

    def planned_accepts(self, i: int, verify_index: int) -> int:
        """Drafts request ``i`` of a step should accept: all, none, then (next_n >= 2) some, cycling."""
        cycle = [self.next_n, 0] + ([self.next_n // 2] if self.next_n > 1 else [])
        return cycle[(i + verify_index) % len(cycle)]

    def drafts(self, rids: list[int], verify_index: int) -> dict[int, list[int]]:
        """next_n drafts per request: the reference's greedy continuation up to the planned acceptance, then a
        token it would not pick (the tokens after a rejected one are never judged)."""
        out = {}
        for i, rid in enumerate(rids):
            keep = self.planned[rid] = self.planned_accepts(i, verify_index)
            seq, drafts = list(self.tokens[rid]), []
            for j in range(self.next_n):
                if j <= keep:
                    greedy = int(self.reference(seq)[-1].argmax())
                    token = greedy if j < keep else (greedy + 1) % self.vocab
                else:
                    token = (drafts[-1] + 1) % self.vocab
                drafts.append(token)
                seq.append(token)
            out[rid] = drafts
        return out

    def judge(self, step_index: int, rids: list[int], drafts: dict[int, list[int]], logits: torch.Tensor,
              slices: dict[int, slice]) -> list[list[int]]:
        """Compare the verify rows with transformers; per request the tokens the step emits."""
        self.steps.append(step_index)
        emitted = []
        for rid in rids:
            got = logits[slices[rid]]
            main = got.argmax(-1).tolist()
            took = 0
            while took < self.next_n and main[took] == drafts[rid][took]:
                took += 1
            if took == self.next_n:  # the next step starts from these tokens + the bonus: one forward for both
                want = self.reference(self.tokens[rid] + drafts[rid] + [main[took]])[-2 - self.next_n:-1]
            else:
                want = self.reference(self.tokens[rid] + drafts[rid])[-1 - self.next_n:]
            where = f"step {step_index} request {rid}"
            if not torch.isfinite(got).all():
                self.nonfinite.append(where)
            else:
                diff = (got - want).abs().max().item()
                if diff > self.worst:
                    self.worst, self.worst_at = diff, where
            if took != self.planned[rid]:
                self.wrong_verdicts.append(f"{where}: {took} draft(s) accepted, {self.planned[rid]} planned")
            self.accepted += took
            self.rejected += self.next_n - took
            self.patterns.add("all" if took == self.next_n else "none" if took == 0 else "some")
            step_tokens = drafts[rid][:took] + [main[took]]
            self.tokens[rid] += step_tokens
            emitted.append(step_tokens)
        return emitted

    def report(self, report: Report, manifest: SelectionManifest, fa_calls: list[dict]) -> None:
        verify = set(self.steps)
        bad = []
        for call in fa_calls:
            if call["step"] not in verify:
                continue
            want = kind_of(manifest).verify_expectation(manifest, manifest.plan_of_module(call["layer"]))
            got = (call.get("sparse_mode", 0), call.get("has_mask", False))
            if got != want:
                bad.append(f"step {call['step']} layer {call['layer']}: (sparse_mode, mask) {got} != {want}")
        judged = [c for c in fa_calls if c["step"] in verify]
        report.add(f"speculative-decode verify steps (q_len {1 + self.next_n}) pass the manifest's MTP "
                   "sparse_mode/mask",
                   "runtime", bool(verify) and bool(judged) and not bad, detail="; ".join(bad[:3]),
                   mismatches=len(bad), calls=len(judged))
        wanted = {"all", "none"} | ({"some"} if self.next_n > 1 else set())
        both = wanted <= self.patterns
        report.add(f"speculative decode (next_n={self.next_n}): verify logits vs transformers max |diff| <= "
                   f"{self.atol:g}",
                   "numeric", both and not self.nonfinite and self.worst <= self.atol and not self.wrong_verdicts,
                   detail="; ".join((self.nonfinite + self.wrong_verdicts)[:3])
                   or ("" if both else f"the stream needs {'/'.join(sorted(wanted))} acceptances, got "
                                       f"{'/'.join(sorted(self.patterns)) or 'none'}"),
                   max_abs_diff=self.worst, worst_at=self.worst_at, verify_steps=len(self.steps),
                   accepted=self.accepted, rejected=self.rejected, patterns=sorted(self.patterns),
                   **({"rejected_entries": self.rejected_entries} if self.rejected_entries else {}))


def attention_calls(host, manifest: SelectionManifest) -> list[dict]:
    """The recorded calls that attend: FA calls, or DSA's indexer and sparse-FA calls (no FA call there)."""
    return kind_of(manifest).attention_calls(host.probe)


def _prompts(seed: int, vocab: int, manifest: SelectionManifest) -> list[tuple[list[int], int]]:
    """Random prompts of the kind's (length, verify steps): PROMPTS unless the kind needs its own positions."""
    g = torch.Generator().manual_seed(seed + 7)
    shape = kind_of(manifest).spec_prompts(manifest, PROMPTS)
    return [(torch.randint(0, vocab, (n,), generator=g).tolist(), steps) for n, steps in shape]


def _watchdog(prompts, main: Watchdog) -> Watchdog:
    """This stream's own step budget (a prefill per request, one verify step per round), the main one's time."""
    return Watchdog(len(prompts) + max(n for _, n in prompts) + 4, main.step_seconds, "speculative-decode stream")


def run_framework_stream(report: Report, manifest: SelectionManifest, host, ref_model, sched, seed: int,
                         vocab: int, main: Watchdog, capture=None) -> None:
    """Prefill, then verify steps through the harness scheduler (the framework's MTP conventions); in graph mode
    (``capture``: graph_capture.DecodeCapture) the verify steps are captured, a width of their own, and replayed."""
    verify = capture.forward if capture is not None else host.forward
    stream = SpecStream(ref_model, vocab, host.atol, manifest.mtp.speculative_tokens)
    prompts = _prompts(seed, vocab, manifest)
    dog = _watchdog(prompts, main)
    rids = [sched.add_request(ids) for ids, _ in prompts]
    steps_of = {rid: n for rid, (_, n) in zip(rids, prompts, strict=True)}
    fa_start = len(attention_calls(host, manifest))
    while sched.waiting_ids:
        sched.poison()
        step = sched.next_step()
        with dog.step(f"speculative prefill {step.index}", step.request_ids):
            logits = host.forward(step.input_ids, step.position_ids, step.forward_metadata)
        first = logits[step.last_token_rows()].argmax(-1)
        sched.complete_step(step, first)
        for rid, token in zip(step.request_ids, first.tolist(), strict=True):
            stream.tokens[rid] = sched.requests[rid].prompt_ids + [int(token)]
    for j in range(max(n for _, n in prompts)):
        live = [rid for rid in rids if j < steps_of[rid]]
        drafts = stream.drafts(live, j)
        sched.poison()  # freed and null blocks NaN; a rejected draft's slot keeps its stale K/V
        step = sched.verify_step(drafts)
        with dog.step(f"verify {j}", step.request_ids):
            logits = verify(step.input_ids, step.position_ids, step.forward_metadata)
        emitted = stream.judge(host.step_index, step.request_ids, drafts, logits, step.token_slices())
        sched.complete_verify(step, emitted)
        for rid in live:
            if j + 1 == steps_of[rid]:
                sched.finish(rid, "length")
    stream.report(report, manifest, attention_calls(host, manifest)[fa_start:])
    report.add("all blocks back in the pool after the speculative-decode stream", "release",
               all(u["used"] == 0 for u in sched.usage().values()), usage=sched.usage())


def run_standalone_stream(report: Report, manifest: SelectionManifest, host, ref_model, runner, seed: int,
                          vocab: int, poison_row, main: Watchdog, capture=None, padding: list | None = None) -> None:
    """Prefill, then verify steps through the rendered runner (``next_n`` / ``accepted`` arguments); in graph mode
    (``capture``) the runner pads each verify step to its batch, whose padded rows must stay in the null block
    (findings appended to ``padding``), and the step is captured and replayed."""
    next_n = manifest.mtp.speculative_tokens
    padding = [] if padding is None else padding
    stream = SpecStream(ref_model, vocab, host.atol, next_n)
    prompts = _prompts(seed, vocab, manifest)
    dog = _watchdog(prompts, main)
    rows = list(range(len(prompts)))
    fa_start = len(attention_calls(host, manifest))
    lens = [len(ids) for ids, _ in prompts]
    fm = runner._build_forward_metadata(rows, lens)
    with dog.step("speculative prefill", rows):
        logits = host.forward(torch.tensor([t for ids, _ in prompts for t in ids]),
                              torch.cat([torch.arange(n) for n in lens]), fm)
    runner._advance_kv_len(rows, fm)
    ends = torch.tensor(lens).cumsum(0) - 1
    for row, (ids, _) in enumerate(prompts):
        stream.tokens[row] = list(ids) + [int(logits[ends[row]].argmax())]
    slot_errors, kv_errors = [], []
    for j in range(max(n for _, n in prompts)):
        live = [row for row, (_, n) in zip(rows, prompts, strict=True) if j < n]
        drafts = stream.drafts(live, j)
        try:
            fm = runner._build_forward_metadata(live, next_n=next_n)
        except TypeError as exc:
            report.add("rendered runner builds speculative-decode verify steps", "init", False,
                       detail=f"_build_forward_metadata(rows, next_n={next_n}): {exc}")
            return
        start = runner.kv_len[torch.tensor(live)].clone()
        pos = (start.view(-1, 1) + torch.arange(1 + next_n)).view(-1)
        want_slots = (torch.tensor(live).view(-1, 1) * runner.max_seq_len + pos.view(len(live), -1)).view(-1)
        if not torch.equal(fm.slot_mapping.view(-1)[:want_slots.numel()].long(), want_slots.long()):
            slot_errors.append(f"verify {j}")
        ids = torch.tensor([t for row in live for t in (stream.tokens[row][-1], *drafts[row])])
        forward = host.forward
        if capture is not None:  # graph mode: padded rows of token 0 at positions 0 .. next_n
            check_runner_padding(report, runner, fm, len(live), host.step_index + 1, padding, 1 + next_n)
            pad = fm.block_table.shape[0] - len(live)
            ids = torch.cat([ids, ids.new_zeros(pad * (1 + next_n))])
            pos = torch.cat([pos, torch.arange(1 + next_n).repeat(pad)])
            forward = capture.forward
        with dog.step(f"verify {j}", live):
            logits = forward(ids, pos, fm)
        slices = {row: slice(i * (1 + next_n), (i + 1) * (1 + next_n)) for i, row in enumerate(live)}
        emitted = stream.judge(host.step_index, live, drafts, logits, slices)
        runner._advance_kv_len(live, fm, accepted=[len(e) - 1 for e in emitted])
        # what the rejected drafts wrote beyond their K/V slots (a kind's states, entries they completed) turns NaN
        stream.rejected_entries += kind_of(manifest).poison_rejected_drafts(
            manifest, host, runner, live, runner.kv_len[torch.tensor(live)].tolist(), (start + 1 + next_n).tolist())
        if runner.kv_len[torch.tensor(live)].tolist() != [s + len(e) for s, e in zip(start.tolist(), emitted,
                                                                                      strict=True)]:
            kv_errors.append(f"verify {j}")
    for row in rows:
        poison_row(host, runner, row)
    report.add("verify-step slot_mapping = row * max_seq_len + position (1 + next_n per row)", "runtime",
               not slot_errors, detail="; ".join(slot_errors[:3]))
    report.add("kv_len advances by 1 + accepted drafts after a verify step", "runtime", not kv_errors,
               detail="; ".join(kv_errors[:3]))
    stream.report(report, manifest, attention_calls(host, manifest)[fa_start:])
