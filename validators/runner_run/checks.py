"""The three links and the recompute oracle, judged on a standalone runner's own tensors.

init: the caches the runner allocates hold every layer's keys and values for the longest sequence it serves.
runtime: the runner's own prefill and decode run; every decode step writes each row's cache at the new token's
position (the row's prompt length plus the tokens generated so far) and nowhere else. numeric: the recompute
oracle, each row's whole prefix through a fresh prefill of the same model and weights, against every step's
logits and greedy tokens. release: the caches are allocated once and every step of both ``model_generate`` calls (the entry script's warm-up,
then the run) keeps them: a runner re-allocating per step loses the cache, per call re-pays the memory (what lint's
KV903 reads statically). Whether the warm-up leaves anything the run reads is the oracle's to say: it recomputes
from fresh caches.
"""

from __future__ import annotations

import torch
from model_infer_kvcache.validators.pipeline.report import Report
from model_infer_kvcache.validators.runner_run.drive import Drive


def check_init(report: Report, drive: Drive, longest: int) -> None:
    """Contiguous caches ``[rows, positions, kv width]``, or paged ``[blocks, block size, kv heads, head dim]``
    holding every row's longest sequence."""
    config = drive.config
    layers = int(config.get("num_hidden_layers", 0))
    kv_width = int(config.get("num_key_value_heads", 0)) * int(config.get("head_dim", 0) or 0)
    shapes = [shape for _, shape, _ in drive.caches]
    rows = drive.rows if drive.serving else len(drive.prompts)

    def short(shape) -> bool:
        if len(shape) == 4:  # paged
            return shape[0] * shape[1] < rows * longest or (kv_width and shape[2] * shape[3] != kv_width)
        return len(shape) < 2 or shape[0] < rows or shape[1] < longest or bool(kv_width and shape[-1] != kv_width)

    small = [(name, shape) for name, shape, _ in drive.caches if short(shape)]
    passed = len(drive.caches) == 2 * layers and not small
    need = (f"[>= {rows} x {longest} slots over blocks x block size, {kv_width} per slot]" if small and
            len(small[0][1]) == 4 else f"[>= {rows} rows, >= {longest} positions, ..., {kv_width}]")
    detail = "" if passed else (f"{len(drive.caches)} cache tensors for {layers} layers (K and V each)" if
                                len(drive.caches) != 2 * layers else f"{small[0][0]} is {list(small[0][1])}: needs {need}")
    report.add(f"runner's own caches hold every layer's keys and values for the longest sequence ({layers} layers)", "init", passed, detail=detail, shapes=[list(s) for s in shapes[:2]],
               dtypes=sorted({d for *_, d in drive.caches}), longest=longest)


def expected_positions(drive: Drive, step_index: int) -> list[int]:
    """The position decode step ``step_index`` (1-based among the run's steps) writes in each row."""
    return [len(p) + step_index - 1 for p in drive.prompts]


def check_writes(report: Report, drive: Drive) -> None:
    decodes = [(i, s) for i, s in enumerate(drive.steps) if not s.is_prefill]
    wrong = []
    for i, s in decodes:
        want = expected_positions(drive, i)
        for r, got in enumerate(s.written or []):
            if r < len(want) and got != [want[r]]:
                wrong.append(f"decode step {i} row {r} wrote positions {got}, the new token's position is {want[r]} "
                             f"(prompt {len(drive.prompts[r])} + {i - 1} generated)")
    sites = ", ".join(sorted(drive.write_sites)) or "?"
    detail = "" if not wrong else (f"{wrong[0]}; the cache writes: {sites}; kv_len comes from "
                                   f"{drive.kv_len_source}" + (f" ({len(wrong)} wrong rows in all)" if len(wrong) > 1
                                                               else ""))
    report.add(f"each decode step writes every row's cache at the new token's position only ({len(decodes)} steps)",
               "runtime", not wrong, detail=detail, write_sites=sorted(drive.write_sites))


def recompute(runner, module, drive: Drive) -> list[torch.Tensor]:
    """Per step, the oracle's next-token logits of every row: the row's prefix (prompt + the tokens the run chose
    before that step) through the runner's own prepare and the model's prefill, on a fresh cache each time."""
    mask_fn = getattr(module, "get_init_attn_mask", None)
    seqs = [list(p) for p in drive.prompts]
    out = []
    for step in drive.steps:
        rows = []
        for seq in seqs:
            ids = torch.tensor([seq])
            inputs = {"input_ids": ids, "generate_ids": ids, "input_lens": len(seq), "kv_len": None,
                      "past_key_values": None, "attention_mask": torch.ones_like(ids), "is_prefill": True,
                      "share_mask_tril": mask_fn(2048, "cpu") if mask_fn else None}
            model_inputs = runner.model_input_prepare(inputs)  # past_key_values None: the runner allocates anew
            with torch.no_grad():
                logits = runner.model.prefill(**model_inputs)
            rows.append(logits.reshape(1, -1, logits.shape[-1])[0, -1].double())
        out.append(torch.stack(rows))
        chosen = step.logits.argmax(-1).tolist()
        for seq, token in zip(seqs, chosen, strict=True):
            seq.append(int(token))
    return out


def check_recompute(report: Report, drive: Drive, oracle: list[torch.Tensor], tolerance: float) -> None:
    worst, where, first = 0.0, "", ""
    mismatches = 0
    for i, (step, ref) in enumerate(zip(drive.steps, oracle, strict=True)):
        diff = (step.logits - ref).abs().amax(-1)
        r = int(diff.argmax())
        if float(diff[r]) > worst:
            worst, where = float(diff[r]), f"step {i} row {r}"
        if not first and float(diff.max()) > tolerance:
            first = f"first failure at step {i} ({'prefill' if step.is_prefill else 'decode'}) row {int(diff.argmax())}"
        mismatches += int((step.logits.argmax(-1) != ref.argmax(-1)).sum())
    scale = max(float(s.logits.abs().max()) for s in drive.steps)
    report.add(f"logits vs recompute (the model's own forward over the whole prefix, no cache) max |diff| <= {tolerance}",
               "numeric", worst <= tolerance, detail=first,
               max_abs_diff=f"{worst:.3g}", worst_at=where, logit_max_abs=f"{scale:.3g}", steps=len(drive.steps),
               rows=len(drive.prompts))
    report.add("greedy tokens identical to recompute", "numeric", mismatches == 0, mismatches=mismatches)


def check_allocated_once(report: Report, drive: Drive) -> None:
    steps = drive.warm_steps + drive.steps
    first = steps[0].cache_ptrs if steps else ()
    moved = next((i for i, s in enumerate(steps) if s.cache_ptrs != first), None)
    where = "" if moved is None else (f"step {moved} of {len(steps)} (warm-up {len(drive.warm_steps)} then the run) "
                                      "uses cache tensors other than the first step's: the runner allocated again "
                                      f"(its caches come from {drive.cache_source})")
    report.add(f"the runner's caches are allocated once and kept by every step and call ({len(steps)} steps)",
               "release", bool(first) and moved is None, detail=where,
               cache_tensors=len(first))
