"""Standalone mode: drive the rendered runner (static arange block table, runner-owned kv_len)."""

from __future__ import annotations

import contextlib

import torch
from model_infer_kvcache.analyzer.kinds import cross as cross_kind
from model_infer_kvcache.analyzer.kinds.invariants import DIFF_CACHES
from model_infer_kvcache.analyzer.kv_cache_spec import holds_state
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from model_infer_kvcache.validators.kinds import check_attention_calls, cross, kind_of, recurrent
from model_infer_kvcache.validators.npu_ops import paged_caches
from model_infer_kvcache.validators.pipeline.graph_capture import (
    PADDING_CHECK,
    check_runner_padding,
    decode_capture,
    graph_mode,
    runner_line,
)
from model_infer_kvcache.validators.pipeline.host_model import state_dtypes
from model_infer_kvcache.validators.pipeline.numeric import NumericTracker
from model_infer_kvcache.validators.pipeline.report import Report
from model_infer_kvcache.validators.pipeline.request_stream import Scenario, SimpleStep

CACHE_NAMES = ("k_cache", "v_cache", "nope_cache", "rope_cache", "win_kv", *DIFF_CACHES[2:])  # + DiffLlama's halves
# DeepSeek-V4 compressed layers: the compressed entries (the runner's cmp_block_table; a CSA layer's and its
# indexer's keys: csa_cmp_block_table) and the compressor state slots of each row (its state_block_table)
COMPRESSED_NAMES = (("sfa_cmp_kv", "cmp_block_table"), ("sfa_kv_state", "state_block_table"),
                    ("li_cmp_kv", "csa_cmp_block_table"), ("li_kv_state", "state_block_table"))
STATE_NAMES = ("conv_state", "recurrent_state")  # a linear layer's states: one slot per row


def _caches(host) -> list[torch.Tensor]:
    return [getattr(a, c) for a in host.attentions for c in (*CACHE_NAMES, *STATE_NAMES,
                                                             *(n for n, _ in COMPRESSED_NAMES)) if hasattr(a, c)]


CROSS_NAMES = (cross_kind.KEY, cross_kind.VALUE, cross_kind.LENGTH)


def _poison_row(host, runner, row: int) -> None:
    """A finished request's rows of every cache and its state slot become NaN: a new request there must not read
    them."""
    blocks = runner.block_table[row].long()
    with torch.no_grad():
        for a in host.attentions:
            for c in CACHE_NAMES:
                if hasattr(a, c):
                    getattr(a, c)[blocks] = float("nan")
            for c, table in COMPRESSED_NAMES:  # a compressed layer's entries and state slots of the row
                if getattr(a, c, None) is not None and getattr(a, c).numel():
                    if getattr(a, "is_csa", False) and table == "cmp_block_table":
                        table = "csa_cmp_block_table"  # a CSA layer's entries: the CSA table's blocks
                    getattr(a, c)[getattr(runner, table)[row].long().unique()] = float("nan")
            for c in (*STATE_NAMES, "state_anchor"):
                if hasattr(a, c):
                    t = getattr(a, c)
                    per_row = t.shape[0] // runner.batch_size  # 1 + next_n slots per row under speculative decoding
                    # the anchor is an index: a value no position has, so a prefill that leaves it unset fails
                    t[row * per_row:(row + 1) * per_row] = float("nan") if t.is_floating_point() else -2 ** 30
        for a in getattr(host, "cross_attentions", []):  # a row's cross slot: its next request's prefill rewrites it
            for c in CROSS_NAMES:
                t = getattr(a, c)
                t[row] = float("nan") if t.is_floating_point() else -2 ** 30


def run_standalone(report: Report, manifest: SelectionManifest, host, ref_model, scenario: Scenario, seed: int,
                   cache_dtype: torch.dtype) -> None:
    runner_cls = host.rendered.runner_mixin()
    if runner_cls is None:
        report.add("rendered runner present", "init", False, detail="no kvcache_runner.py with _init_kvcache")
        return
    runner = type("ValidationRunner", (runner_cls,), {})()
    rows_n = scenario.max_concurrency
    # The run's dtype for the states too, as for the caches (the manifest's bfloat16 state is the device's).
    lin = manifest.linear_attention
    states = state_dtypes(cache_dtype, lin.conv_kernel is not None, recurrent=lin.num_v_heads is not None) if lin \
        else {}
    runner._init_kvcache(host.attentions + host.cross_attentions, rows_n, scenario.max_model_len, device=host.device, cache_dtype=cache_dtype,
                         **states)
    _check_init(report, manifest, host, runner, rows_n)
    if any(not c.passed for c in report.checks if c.link == "init"):
        report.notes.append("init link failed: runtime, numeric and release checks not run")
        return
    start_bytes = sum(t.numel() * t.element_size() for t in _caches(host))
    start_ids = [id(t) for t in _caches(host)]

    tracker = NumericTracker(ref_model, host, atol=host.atol)
    graph = graph_mode(manifest)
    capture = decode_capture(manifest, host)
    padding: list[str] = []  # graph mode: padded decode steps whose padded rows leave the null block
    # graph mode: the runner's null block takes the padded rows' repeated writes (npu_ops.paged_caches)
    regions = contextlib.ExitStack()
    if graph and getattr(runner, "null_block", None) is not None:
        regions.enter_context(paged_caches([getattr(a, c) for a in host.attentions for c in CACHE_NAMES
                                            if hasattr(a, c)], null_block=runner.null_block))
    with regions:
        dog = scenario.watchdog("standalone request stream")
        prompts = scenario.prompts(seed)
        first = len(scenario.first)
        waiting = list(range(first))
        late = list(range(first, len(prompts)))
        tokens = {rid: list(prompts[rid][0]) for rid in range(len(prompts))}
        budget = {rid: prompts[rid][1] for rid in range(len(prompts))}
        row_of: dict[int, int] = {}
        free_rows = list(range(rows_n))
        prompt_len: dict[int, int] = {}
        slot_errors: list[str] = []
        step_index = 0

        def run_step(rids, is_prefill):
            nonlocal step_index
            rows = [row_of[r] for r in rids]
            if is_prefill:
                lens = [len(tokens[r]) for r in rids]
                fm = runner._build_forward_metadata(rows, lens)
                ids = torch.tensor([t for r in rids for t in tokens[r]])
                pos = torch.cat([torch.arange(n) for n in lens])
            else:
                lens = [1] * len(rids)
                fm = runner._build_forward_metadata(rows)
                ids = torch.tensor([tokens[r][-1] for r in rids])
                pos = runner.kv_len[torch.tensor(rows)].clone()
            want_slots = torch.cat([row * runner.max_seq_len + p.view(-1) for row, p in
                                    zip(rows, torch.split(pos, lens), strict=True)])
            if not torch.equal(fm.slot_mapping.view(-1)[:want_slots.numel()].long(), want_slots.long()):
                slot_errors.append(f"step {step_index}")
            forward = host.forward
            if capture is not None and not is_prefill:  # graph mode: the runner padded the step to its batch
                check_runner_padding(report, runner, fm, len(rows), step_index, padding)
                pad = fm.slot_mapping.numel() - len(rows)
                ids, pos, forward = torch.cat([ids, ids.new_zeros(pad)]), torch.cat([pos, pos.new_zeros(pad)]), \
                    capture.forward
            step = SimpleStep(step_index, is_prefill, list(rids), ids, pos, lens)
            n_before = len(host.probe.records)
            with dog.step(step_index, rids):  # the runner's own step (forward and kv_len advance) is the render's
                logits = forward(ids, pos, fm)
                runner._advance_kv_len(rows, fm)
            tracker.record_step(step, logits, host.probe.records[n_before:])
            step_index += 1
            return logits[step.last_token_rows()].argmax(-1).tolist()

        running: list[int] = []
        while waiting or running or late:
            if late and len(running) + len(waiting) < first:  # someone finished: admit the late requests
                waiting += late
                late = []
            admit = []
            while waiting and free_rows:
                rid = waiting.pop(0)
                row_of[rid] = free_rows.pop(0)
                admit.append(rid)
            if admit:
                for rid in admit:
                    prompt_len[rid] = len(tokens[rid])
                new = run_step(admit, True)
                for rid, tok in zip(admit, new, strict=True):
                    tokens[rid].append(tok)
                    budget[rid] -= 1
                running += admit
            elif running:
                new = run_step(list(running), False)
                for rid, tok in zip(list(running), new, strict=True):
                    tokens[rid].append(tok)
                    budget[rid] -= 1
            for rid in [r for r in running if budget[r] <= 0]:
                running.remove(rid)
                _poison_row(host, runner, row_of[rid])
                free_rows.append(row_of[rid])
            if not admit and not running and not waiting and late:
                continue
        report.add("slot_mapping = row * max_seq_len + position", "runtime", not slot_errors,
                   detail="; ".join(slot_errors[:3]), steps=step_index)
        tracker.check_runtime(report, manifest, prompt_len)
        check_attention_calls(report, manifest, host)
        cross.check_cross_calls(report, manifest, host)
        sequences = {rid: tokens[rid][:-1] if budget[rid] <= 0 else tokens[rid] for rid in tokens}
        tracker.check_numeric(report, sequences)
        if manifest.mtp is not None:
            from model_infer_kvcache.validators.pipeline.spec_decode import run_standalone_stream

            run_standalone_stream(report, manifest, host, ref_model, runner, seed, scenario.vocab, _poison_row, dog,
                                  capture=capture, padding=padding)

        g = torch.Generator().manual_seed(seed + 1)
        for i in range(scenario.release_requests):
            rid = 10_000 + i
            tokens[rid] = torch.randint(0, scenario.vocab, (8 + i % 24,), generator=g).tolist()
            row_of[rid] = 0
            nxt = run_step([rid], True)
            tokens[rid].append(nxt[0])
            run_step([rid], False)
            _poison_row(host, runner, 0)
        end_bytes = sum(t.numel() * t.element_size() for t in _caches(host))
        if capture is not None:
            if not padding:
                report.add(PADDING_CHECK, "runtime", True, runner=runner_line(runner))
            capture.check(report, stream_steps=step_index)
        report.add(f"{scenario.release_requests} sequential requests leave memory unchanged", "release",
                   end_bytes == start_bytes and [id(t) for t in _caches(host)] == start_ids,
                   bytes_before=start_bytes, bytes_after=end_bytes)


def _check_init(report: Report, manifest: SelectionManifest, host, runner, rows_n: int) -> None:
    problems = []
    # graph mode: one null block past the rows' blocks, for the padded decode rows
    blocks = runner.block_table.numel() + (1 if graph_mode(manifest) else 0)
    attending = manifest.attention_layers  # none in a pure state stack: states only
    want = {c.name: c for c in attending[0].caches} if attending else {}
    states = recurrent.states(manifest)
    # one state slot per row, 1 + next_n of them under speculative decoding (one per verify token)
    slots_n = rows_n * recurrent.state_slots_per_row(manifest)
    for a in host.attentions:
        if holds_state(getattr(a, "attn_type", None)):
            for name, s in states.items():
                t = getattr(a, name, None)
                if t is None or list(t.shape) != [slots_n, *s.shape]:
                    problems.append(f"layer {a.layer_idx} {name}: {None if t is None else tuple(t.shape)} != "
                                    f"{(slots_n, *s.shape)}")
            continue
        if manifest.plan_of_module(a.layer_idx).kv_source_layer is not None:  # by block index (Nemotron-H skips blocks)
            # a KV-shared layer reads its source layer's cache (linked by _init_kvcache) and allocates none
            problems += [f"layer {a.layer_idx} {name}: a KV-shared layer holds a cache of its own"
                         for name in want if name in vars(a)]
            continue
        # each layer's own entries: a layer with its own shape (layers[i].head_dim) holds caches of that shape
        own = {c.name: c for c in manifest.plan_of_module(a.layer_idx).caches} or want
        for name, c in own.items():
            t = getattr(a, name, None)
            shape = (blocks, manifest.block_size, c.num_head, c.dim)
            if t is None or tuple(t.shape) != shape:
                problems.append(f"layer {a.layer_idx} {name}: {None if t is None else tuple(t.shape)} != {shape}")
    kind_problems = getattr(kind_of(manifest), "runner_cache_problems", None)  # a kind's own caches (V4's HCA)
    if kind_problems is not None:
        problems += kind_problems(manifest, host, runner, rows_n)
    table_ok = torch.equal(runner.block_table.view(-1).long(), torch.arange(runner.block_table.numel()))
    report.add("_init_kvcache caches are [num_blocks, block_size, num_head, dim]", "init", not problems,
               detail="; ".join(problems[:3]), rows=rows_n, blocks=blocks)
    report.add("static block table is arange(batch * blocks_per_seq)", "init", table_ok,
               shape=tuple(runner.block_table.shape))
