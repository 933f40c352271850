"""A runner serving requests over the rows of its own paged cache, judged request by request.

Which request a step's row serves is kvcache's own reading, not the runner's: a prefill's packed ids are split by
its prompt lengths and each segment is matched to the prompt it is (the request is then in the row the prefill
wrote); a decode row serves the live request its metadata row holds, unless the token it feeds is another live
request's last token (then it serves that one, and the row was the wrong one). Each request's tokens grow by the
argmax of its own logits row, as a greedy runner's do. From that reading: the positions every step feeds (a new
request from 0, a decode at its own length), the slots every paged write lands in (its row's blocks at those
positions), and, for the recompute oracle, the prefix behind every logits row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from model_infer_kvcache.validators.pipeline.report import Report
from model_infer_kvcache.validators.runner_run.drive import Drive


@dataclass
class Reading:
    served: list[list[int | None]] = field(default_factory=list)  # per step: the request of each batch row
    prefixes: list[list[list[int] | None]] = field(default_factory=list)  # per step and row: the tokens fed so far
    positions: list[list[list[int]]] = field(default_factory=list)  # per step and row: the positions it should feed
    home: dict[int, int] = field(default_factory=dict)  # request -> the row its prefill wrote
    row_problems: list[str] = field(default_factory=list)
    admitted_at: dict[int, int] = field(default_factory=dict)  # request -> step
    finished_at: dict[int, int] = field(default_factory=dict)


def judged_steps(drive: Drive) -> list:
    """The run's steps; the warm-up's when the runner stopped before the run began (the warm-up serves the same
    requests)."""
    return drive.steps or drive.warm_steps


def read_requests(drive: Drive) -> Reading:
    reading = Reading()
    tokens: dict[int, list[int]] = {}
    generated: dict[int, int] = {}
    occupant: dict[int, int] = {}  # row -> request last admitted there
    waiting = list(range(len(drive.prompts)))
    for s, step in enumerate(judged_steps(drive)):
        served: list[int | None] = []
        prefixes: list[list[int] | None] = []
        positions: list[list[int]] = []
        if step.is_prefill:
            offset = 0
            for row, n in zip(step.rows or [], step.prompt_lens or [], strict=False):
                segment = step.ids[offset:offset + n]
                offset += n
                q = next((q for q in waiting if drive.prompts[q] == segment), None)
                served.append(q)
                prefixes.append(list(segment) if q is not None else None)
                positions.append(list(range(n)))
                if q is None:
                    reading.row_problems.append(f"step {s} (prefill): the tokens packed for row {row} are no waiting "
                                                f"prompt ({step.site})")
                    continue
                waiting.remove(q)
                occupant[row], reading.home[q], reading.admitted_at[q] = q, row, s
                tokens[q], generated[q] = list(segment), 0
        else:
            live = {q for q in tokens if q not in reading.finished_at}
            for i, row in enumerate(step.rows or []):
                fed = step.ids[i] if i < len(step.ids) else None
                q = occupant.get(row)
                if q not in live or tokens[q][-1] != fed:
                    by_token = [p for p in live if tokens[p][-1] == fed and p not in served]
                    if len(by_token) == 1 or q not in live:
                        actual = by_token[0] if len(by_token) == 1 else None
                        held = (f"holds request {q}" if q in live else "is free") if actual is not None else \
                            f"holds no live request (the live ones are in rows {sorted(reading.home[p] for p in live)})"
                        whose = "" if actual is None else \
                            f"; the token it feeds is request {actual}'s, whose cache row is {reading.home[actual]}"
                        reading.row_problems.append(
                            f"decode step {s} batch row {i}: given the metadata of cache row {row}, which {held}{whose}"
                            + (": the batch row index was used as the cache row" if row == i else "")
                            + f" ({step.site})")
                        q = actual
                served.append(q)
                prefixes.append(list(tokens[q]) if q is not None else None)
                positions.append([len(tokens[q]) - 1] if q is not None else [])
        for i, q in enumerate(served):
            if q is not None and i < len(step.logits):
                tokens[q].append(int(step.logits[i].argmax()))
                generated[q] += 1
                if generated[q] >= drive.budgets[q]:
                    reading.finished_at[q] = s
        reading.served.append(served)
        reading.prefixes.append(prefixes)
        reading.positions.append(positions)
    return reading


def check_rows(report: Report, drive: Drive, reading: Reading) -> None:
    """Every step feeds each request its own tokens at its own positions, in the row it was admitted to."""
    wrong = list(reading.row_problems)
    steps = judged_steps(drive)
    used = {r for step in drive.warm_steps for r in step.rows or []} if drive.steps else set()  # held before
    for s, step in enumerate(steps):
        offset = 0
        for q, want in zip(reading.served[s], reading.positions[s], strict=True):
            n = len(want) if step.is_prefill else 1
            got = step.positions[offset:offset + n]
            offset += n
            if q is None or got == want:
                continue
            row = reading.home[q]
            if step.is_prefill:
                stale = f" (row {row} held an earlier request: the freed row was reused without clearing its " \
                        "length)" if row in used and got and got[0] > 0 else ""
                wrong.append(f"step {s} (prefill) request {q} admitted into row {row} at positions "
                             f"{got[0]}..{got[-1]}: a new request starts at 0{stale} ({step.site})")
            else:
                wrong.append(f"decode step {s} request {q} (row {row}) fed at position {got[0] if got else '?'}: its "
                             f"new token is at {want[0]} (prompt {len(drive.prompts[q])} + "
                             f"{want[0] - len(drive.prompts[q])} generated) ({step.site})")
        used |= set(step.rows or [])
    served = sum(1 for row in reading.served for q in row if q is not None)
    reused = sorted({r for q, r in reading.home.items() if reading.admitted_at[q] > 0 and
                     any(reading.home[p] == r and reading.admitted_at[p] < reading.admitted_at[q]
                         for p in reading.home)})
    detail = "" if not wrong else wrong[0] + (f" ({len(wrong)} problems in all)" if len(wrong) > 1 else "")
    report.add(f"each step feeds every request its own tokens at its own positions, in its own row ({served} rows "
               f"over {len(steps)} steps)", "runtime", not wrong, detail=detail,
               requests=len(drive.prompts), rows=drive.rows, reused_rows=reused,
               late_admissions=sum(1 for q, s in reading.admitted_at.items() if s > 0))


def _slot(drive: Drive, row: int, position: int) -> int:
    bs = drive.block_size
    return int(drive.block_table[row, position // bs]) * bs + position % bs


def _where(drive: Drive, slot: int | None) -> str:
    """``slot S (row R, position P)`` read back through the runner's block table."""
    if slot is None:
        return "no slot"
    hit = (drive.block_table == slot // drive.block_size).nonzero()
    if not len(hit):
        return f"slot {slot} (a block no row holds)"
    row, col = (int(x) for x in hit[0])
    return f"slot {slot} (row {row}, position {col * drive.block_size + slot % drive.block_size})"


def check_slots(report: Report, drive: Drive, reading: Reading, write_sites: list[str]) -> None:
    """Every paged write lands in the slots of the request it belongs to: its row's blocks, at its positions."""
    wrong = []
    steps = judged_steps(drive)
    for s, step in enumerate(steps):
        want: list[int] = []
        for q, positions in zip(reading.served[s], reading.positions[s], strict=True):
            if q is not None:
                want += [_slot(drive, reading.home[q], p) for p in positions]
        for call, got in enumerate(step.slots):
            if got != want:
                k = next((k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got),
                                                                                                     len(want)))
                wrong.append(f"step {s} ({'prefill' if step.is_prefill else 'decode'}) writer call {call}: token {k} "
                             f"written at {_where(drive, got[k] if k < len(got) else None)}, its request's is "
                             f"{_where(drive, want[k] if k < len(want) else None)}; metadata built at {step.site}")
                break
    detail = "" if not wrong else (wrong[0] + f"; the cache writes: {', '.join(write_sites) or '?'}" +
                                   (f" ({len(wrong)} steps wrong)" if len(wrong) > 1 else ""))
    report.add(f"each step writes every request's keys and values in its own row's blocks at its own positions "
               f"({len(steps)} steps)", "runtime", not wrong, detail=detail, write_sites=write_sites,
               block_size=drive.block_size)


def recompute(runner, drive: Drive, reading: Reading) -> list[torch.Tensor]:
    """Per step, the oracle's logits of each batch row: the prefix of the request it serves, prefilled alone into
    row 0 through the runner's own metadata builder (fresh: a prefill starts the row empty) and the model's prefill.
    A row serving no request keeps the run's own logits (check_rows has failed it already)."""
    done: dict[tuple[int, ...], torch.Tensor] = {}
    out = []
    for s, step in enumerate(drive.steps):
        rows = []
        for i, prefix in enumerate(reading.prefixes[s]):
            if prefix is None:
                rows.append(step.logits[i])
                continue
            key = tuple(prefix)
            if key not in done:
                meta = drive.build_metadata([0], [len(prefix)])
                inputs = {}
                for name, kind in drive.input_keys.items():
                    inputs[name] = (torch.tensor([prefix]) if kind == "ids" else
                                    torch.arange(len(prefix)).view(1, -1) if kind == "positions" else
                                    meta if kind == "metadata" else True if name == "is_prefill" else kind)
                with torch.no_grad():
                    logits = runner.model.prefill(**inputs)
                done[key] = logits.reshape(-1, logits.shape[-1])[-1].double()
            rows.append(done[key])
        out.append(torch.stack(rows) if rows else step.logits)
    return out
