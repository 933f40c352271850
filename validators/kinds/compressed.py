"""DeepSeek-V4 compressed attention: the window branch (win_kv) and a CSA / HCA layer's compressed entries (CSA: the
indexer's top-k of them), attended by ``custom.npu_sparse_attn_sharedkv`` in one call (no FA call). What every call must pass is stated here from the
manifest (V232), independently of the render.

The tiny model keeps the fused kernels' fixed shapes (custom-npu_sparse_attn_sharedkv.md: D 512, 64 query heads,
window 127 + 1; custom-npu_compressor.md: hidden 1024..10240, cmp_ratio 128 for HCA, rope 64): the emulated
operators refuse any other, so CPU streams of up to 300 tokens cross the 128-token window and two HCA groups at
the real sizes, nothing shrunk but CSA's selection: its index_topk (512 entries: 2048 tokens) is narrowed to
CPU_INDEX_TOPK so the indexer drops entries (the tiny config and the manifest the run is judged by both carry it).
"""

from __future__ import annotations

import math

import torch
from model_infer_kvcache.analyzer.kinds.compressed import state_ring_tokens

# the dtypes a run may compute in: custom.scatter_nd_update_asc / npu_sparse_attn_sharedkv / compressor take
# bfloat16, float16 (and float64, the CPU validation mode), no float32
RUN_DTYPES = ("float64", "bfloat16", "float16")
CALLS_CUSTOM_OPS = True  # the render calls the checkout's own operators (torch.ops.custom): CPU runs emulate them
HIDDEN_CAN_TIE_TO_HEADS = False  # heads x head_dim (32768) is not the model's hidden size
CHECK = "shared-KV attention: each layer's window branch, compressed branch and sinks as the manifest"
# custom-npu_compressor.md: 'H 取值范围 1K~10K, 512 对齐' (the smallest hidden size the compressor takes)
TINY_HIDDEN = 1024
SHAREDKV_OP = "npu_sparse_attn_sharedkv"
# CSA's indexer keeps this many entries per query on CPU: the stream's prompts (up to ~260 tokens, 65 entries of 4)
# then drop entries on every request past 64 tokens; the real index_topk (512 entries: 2048 tokens) keeps them all
CPU_INDEX_TOPK = 16


def tiny_attention_fields(d: dict, manifest, *, head_dim_from_hidden: bool) -> None:
    """The kernels' shapes (the manifest's: D, 64 query heads, one KV head), the compressor's smallest hidden size,
    and narrow low-rank query / output projections (q_lora_rank, o_lora_rank: widths inside the model, no cache)."""
    d["head_dim"] = manifest.model.head_dim
    d["num_key_value_heads"] = manifest.model.num_key_value_heads
    d["hidden_size"] = TINY_HIDDEN
    d["q_lora_rank"] = 64
    d["o_lora_rank"] = 32
    d["index_topk"] = manifest.compressed.index_topk  # CSA's selection width, as the run's manifest (cpu_narrowed)


def _narrows(manifest) -> bool:
    c = manifest.compressed
    return bool(c is not None and c.csa_layers and c.index_topk > CPU_INDEX_TOPK)


def cpu_narrowed(manifest) -> dict[str, dict]:
    """A CSA selection wider than CPU prompts is narrowed, so the indexer drops entries."""
    return {"compressed": {"index_topk": CPU_INDEX_TOPK}} if _narrows(manifest) else {}


def selection_width(manifest) -> int:
    """CSA's indexer top-k, the width ``cpu_narrowed`` narrows."""
    return manifest.compressed.index_topk


def cpu_size_changes(manifest, small) -> list[str]:
    top, narrow = manifest.compressed.index_topk, small.compressed.index_topk
    return [f"index_topk {top} -> {narrow}"] if top != narrow else []


def shrink_notes(manifest, short) -> list[str]:
    """What a CPU-sized copy of the manifest changed about this kind beyond the window: CSA's top-k."""
    if short.compressed is None or short.compressed.index_topk == manifest.compressed.index_topk:
        return []
    return [f"index_topk {manifest.compressed.index_topk} is wider than CPU prompts: the tiny config and the manifest "
            f"the run is judged by carry index_topk {short.compressed.index_topk}, so the indexer's selection drops "
            "entries"]


def expected_constants(manifest) -> dict[str, object]:
    c = manifest.compressed
    return {"HEAD_DIM": manifest.model.head_dim, "HCA_LAYERS": frozenset(c.hca_layers),
            "HCA_RATIO": c.compress_rates["hca"], "CSA_LAYERS": frozenset(c.csa_layers),
            "CSA_RATIO": c.compress_rates["csa"], "INDEX_TOPK": c.index_topk, "INDEX_N_HEADS": c.index_n_heads,
            "INDEX_HEAD_DIM": c.index_head_dim}


def attention_calls(probe) -> list[dict]:
    return probe.sharedkv_calls


def verify_expectation(manifest, plan) -> tuple[int, bool]:
    """(sparse_mode, mask) of a verify step's call: npu_sparse_attn_sharedkv takes neither (its causality is fixed,
    a request's queries being its last q_len tokens, rightDownCausal), so its calls record the defaults; each
    row's visible entries and its selection are judged by V232 and the verify logits."""
    return 0, False


def spec_prompts(manifest, default: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """The speculative-decode stream's (prompt length, verify steps), placed so that verify steps cross group ends.

    Request 0's first verify step accepts every draft, request 1's rejects every one (spec_decode.SpecStream's
    planned acceptance). Request 0: a short prompt whose first step's last draft completes a group of the smallest
    rate (CSA: 4), with few entries visible (fewer than CPU_INDEX_TOPK): a row that saw the entry a later draft of
    the same step completes would list it. Request 1: a prompt past the window whose first step's last draft completes
    a group of every rate (HCA's too) and is rejected: the next step puts another token there and completes the group
    again, so a compressor state or an entry the rejected draft left behind would change the logits.
    """
    next_n = manifest.mtp.speculative_tokens if manifest.mtp is not None else 0
    rates = sorted({int(r) for kind, r in manifest.compressed.compress_rates.items()
                    if getattr(manifest.compressed, f"{kind}_layers")})
    if not next_n or not rates:
        return default
    steps = max(n for _, n in default)

    def ending_at_group_end(m: int, at_least: int) -> int:  # the smallest n >= at_least with n + next_n = k*m - 1
        return at_least + (-(at_least + next_n + 1)) % m

    span = math.lcm(*rates)
    return ((ending_at_group_end(rates[0], rates[0]), steps),
            (ending_at_group_end(span, manifest.compressed.sliding_window + 1), steps))


def poison_rejected_drafts(manifest, host, runner, rows, kept, ends) -> int:
    """After a standalone verify step, NaN into what its rejected drafts (positions ``kept[i] .. ends[i] - 1`` of row
    ``rows[i]``) wrote in the compressed branches: their compressor state (the row's ring slot ``p % ring``) and any
    entry one of them completed (group w ending at p: the row's entry w through its compressed table). The next step
    must rewrite each before reading it (the ring must not alias a token it still reads); returns how many entries
    rejected drafts had completed (the stream's evidence that it exercised them)."""
    completed = 0
    with torch.no_grad():
        for a in host.attentions:
            branch = manifest.plan_of_module(a.layer_idx).compressed
            if branch is None:
                continue
            m = branch.compress_ratio
            table = runner.csa_cmp_block_table if branch.kind == "csa" else runner.cmp_block_table
            states = [t for t in (a.sfa_kv_state, a.li_kv_state) if t.numel()]
            entries = [t for t in (a.sfa_cmp_kv, a.li_cmp_kv) if t.numel()]
            for row, lo, hi in zip(rows, kept, ends, strict=True):
                slot = int(runner.state_block_table[row, 0])
                for p in range(lo, hi):
                    for t in states:
                        t[slot, p % t.shape[1]] = float("nan")
                    if (p + 1) % m:
                        continue
                    w = p // m
                    for t in entries:
                        t[int(table[row, w // t.shape[1]]), w % t.shape[1]] = float("nan")
                    completed += 1
    return completed


def shard_attention(attn, model, heads: slice, rank: int, tp: int) -> int:
    raise NotImplementedError("attention TP of DeepSeek-V4 compressed attention is not rendered (64 query heads "
                              "per rank: the kernel's N1)")


def split_entries(manifest, plan, got: dict) -> tuple[dict, list[str]]:
    """A layer's registered entries (framework mode, V101): the window branch's, left to the shared comparison, and
    what is wrong with an HCA layer's compressed entries against the manifest's (name, manager, block span in
    tokens, compress ratio, window, per-token shape)."""
    planned = {e.name: e for e in (plan.compressed.entries if plan.compressed else [])}
    window = {name: e for name, e in got.items() if name not in planned}
    problems = []
    if set(planned) - set(got):
        problems.append(f"layer {plan.index}: compressed entries {sorted(set(got) - set(window))} != {sorted(planned)}")
    for name, want in planned.items():
        entry = got.get(name)
        if entry is None:
            continue
        dim = entry.dim if isinstance(entry.dim, list) else [entry.dim]
        have = (entry.manager_key, entry.block_size, int(getattr(entry, "compress_ratio", 1) or 1),
                entry.sliding_window, dim, entry.num_head)
        wanted = (want.manager_key, want.block_size, want.compress_ratio, want.sliding_window, want.dim, want.num_head)
        if have != wanted:
            problems.append(f"layer {plan.index} {name}: (manager_key, block_size, compress_ratio, window, dim, "
                            f"num_head) {have} != {wanted}")
    return window, problems


def runner_cache_problems(manifest, host, runner, rows: int) -> list[str]:
    """The standalone runner's compressed caches against the manifest's entries (V110): per compressed layer each
    entry of compressed rows (sfa_cmp_kv; a CSA layer's li_cmp_kv too) in blocks of BLOCK_SIZE rows, enough for
    every row's ``max_seq_len // m`` entries, and each state (sfa_kv_state; li_kv_state) one slot of ``coff x m``
    tokens x ``[kv | score]`` per row plus slot 0 (the compressor's "not stored"), grown by next_n - 1 tokens when
    speculative verify steps run (analyzer ``state_ring_tokens``: a rejected draft must not overwrite a token the next
    step reads back)."""
    problems = []
    next_n = manifest.mtp.speculative_tokens if manifest.mtp is not None else 0
    for a in host.attentions:
        plan = manifest.plan_of_module(a.layer_idx)
        branch = plan.compressed
        if branch is None:
            for name in ("sfa_cmp_kv", "li_cmp_kv"):
                if getattr(a, name, None) is not None and getattr(a, name).numel():
                    problems.append(f"layer {a.layer_idx}: a window-only layer holds compressed entries ({name})")
            continue
        m = branch.compress_ratio
        per_row = max(1, -(-(runner.max_seq_len // m) // manifest.block_size))
        want = {}
        for e in branch.entries:
            if e.sliding_window is None:  # compressed rows
                want[e.name] = (rows * per_row, e.block_size // m, e.num_head, *e.dim)
            else:  # a state slot per row, plus slot 0
                want[e.name] = (rows + 1, state_ring_tokens(e.sliding_window, next_n), e.num_head * math.prod(e.dim))
        for name, shape in want.items():
            t = getattr(a, name, None)
            if t is None or tuple(t.shape) != shape:
                problems.append(f"layer {a.layer_idx} {name}: {None if t is None else tuple(t.shape)} != {shape}")
    return problems


def check_attention_calls(report, manifest, host, *, before_failure: bool = False) -> None:
    """V232: every layer calls the shared-KV attention once per step, with the window the manifest plans
    (ori_win_left = window - 1), its compressed branch exactly where the manifest plans one (cmp_kv at the layer's
    rate; none on a window-only layer), the manifest's softmax scale and the sinks; a CSA layer (only) passes a
    top-k selection listing ``min(index_topk, visible)`` entries per query (``entries_dropped``: the share of the
    visible entries its selections left out)."""
    calls = [c for c in host.probe.sharedkv_calls if c.get("layer") is not None]
    if before_failure and (not calls or any(c.name == CHECK for c in report.checks)):
        return
    problems = []
    visible_n = selected_n = 0  # CSA layers' visible and selected entries, over every query
    for call in calls:
        plan = manifest.plan_of_module(call["layer"])
        where = f"layer {call['layer']} step {call['step']}"
        want = plan.compressed.compress_ratio if plan.compressed else None
        got = call["cmp_ratio"] if call["has_cmp_kv"] else None
        if got != want:
            problems.append(f"{where}: compressed branch {got or 'none'} (manifest {want or 'none'})")
        if call["ori_win_left"] + 1 != plan.sliding_window:
            problems.append(f"{where}: window {call['ori_win_left'] + 1} (manifest {plan.sliding_window})")
        if abs(call["softmax_scale"] - manifest.fa.softmax_scale) > 1e-12 * manifest.fa.softmax_scale:
            problems.append(f"{where}: softmax_scale {call['softmax_scale']} (manifest {manifest.fa.softmax_scale})")
        if manifest.model.has_sinks and not call["sinks"]:
            problems.append(f"{where}: no sinks (the model's attention has them)")
        csa = plan.compressed is not None and plan.compressed.kind == "csa"
        if csa != ("selected" in call):
            problems.append(f"{where}: {'no' if csa else 'a'} top-k selection (cmp_sparse_indices) on a "
                            f"{plan.compressed.kind if plan.compressed else 'window-only'} layer")
        elif csa:
            topk = manifest.compressed.index_topk
            wrong = [i for i, (n, v) in enumerate(zip(call["selected"], call["visible"], strict=True)) if n != min(topk, v)]
            if wrong:
                i = wrong[0]
                problems.append(f"{where}: query {i} selects {call['selected'][i]} entries (index_topk {topk}, "
                                f"{call['visible'][i]} visible)")
            visible_n += sum(call["visible"])
            selected_n += sum(call["selected"])
    layers = {a.layer_idx for a in host.attentions}  # the tiny model's layers (a prefix of the manifest's)
    steps: dict[int, list[int]] = {}
    for call in calls:
        steps.setdefault(call["step"], []).append(call["layer"])
    for step, seen in sorted(steps.items()):
        if not before_failure and sorted(seen) != sorted(layers):
            problems.append(f"step {step}: layers called {sorted(seen)} (each of {sorted(layers)} once)")
    if not calls:
        problems.append("no shared-KV attention call")
    report.add(CHECK, "runtime", not problems, detail="; ".join(problems[:4]), calls=len(calls),
               entries_dropped=(1 - selected_n / visible_n) if visible_n else None)


__all__ = ["CHECK", "CPU_INDEX_TOPK", "HIDDEN_CAN_TIE_TO_HEADS", "attention_calls", "check_attention_calls",
           "cpu_narrowed", "cpu_size_changes", "expected_constants", "poison_rejected_drafts", "runner_cache_problems",
           "selection_width", "shard_attention", "shrink_notes", "spec_prompts", "split_entries", "tiny_attention_fields", "verify_expectation"]
