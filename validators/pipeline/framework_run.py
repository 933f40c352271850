"""Framework mode: drive the rendered code through the framework contract (harness or a real checkout).

Init link: get_cache_info() against the manifest, then allocation. Runtime link: what each
layer saw around the FA call. Numeric link: per-step logits against transformers with freed
blocks and null blocks poisoned between steps. Release link: the pool and the tensors after
the stream and after many sequential requests.
"""

from __future__ import annotations

import torch
from model_infer_kvcache.analyzer.kv_cache_spec import holds_state
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from model_infer_kvcache.validators.kinds import check_attention_calls, cross, kind_of
from model_infer_kvcache.validators.pipeline.graph_capture import decode_capture, graph_mode
from model_infer_kvcache.validators.pipeline.host_model import HostModel, decoder_layers
from model_infer_kvcache.validators.pipeline.numeric import NumericTracker
from model_infer_kvcache.validators.pipeline.report import Report
from model_infer_kvcache.validators.pipeline.request_stream import Scenario


def check_cache_info(report: Report, manifest: SelectionManifest, info, n_layers: int, api: str,
                     cache_dtype: torch.dtype, decoder_layers: int) -> None:
    """``n_layers``: the planned layers the model holds; ``decoder_layers``: its decoder blocks (the rendered run's
    tiny prefix, or a checkout's every block), whose cross-attention-only blocks (Mllama) each register a cache layer
    of their own, counted from the manifest."""
    # a KV-shared layer (kv_source_layer) registers no entry: the framework allocates caches for the owners only
    expected = [layer for layer in manifest.layers[:n_layers] if layer.kv_source_layer is None]
    n_cross_only = cross.only_blocks_within(manifest, decoder_layers)
    layer_infos, alone = cross.split_layer_infos(manifest, list(info.layer_infos))
    report.add("get_cache_info layer count", "init", (len(layer_infos), len(alone)) == (len(expected), n_cross_only),
               expected=len(expected) + n_cross_only, got=len(layer_infos) + len(alone))
    mismatches = []
    model_bs = getattr(info, "block_size", None)
    cross_problems = [p for i, layer in enumerate(alone) for p in cross.entry_problems(
        manifest, i, {e.cache_name: e for e in layer.caches}, cache_dtype, alone=True)]
    split_kind = getattr(kind_of(manifest), "split_entries", None)  # a kind's own entries beside the planned caches
    for plan, layer in zip(expected, layer_infos, strict=False):
        got, got_cross = cross.split_entries({e.cache_name: e for e in layer.caches})
        if split_kind is not None:
            got, kind_problems = split_kind(manifest, plan, got)
            mismatches += kind_problems
        cross_problems += cross.entry_problems(manifest, plan.index, got_cross, cache_dtype)
        if plan.is_state:
            mismatches += _state_entry_problems(plan, got, cache_dtype, manifest.linear_attention)
            continue
        want = {c.name: c for c in plan.caches}
        if set(got) != set(want):
            mismatches.append(f"layer {plan.index}: entries {sorted(got)} != {sorted(want)}")
            continue
        for name, entry in got.items():
            c = want[name]
            dims = (entry.attn_type, entry.dim, entry.num_head, entry.dtype, entry.sliding_window)
            wanted = (plan.registers_as[0], c.dim, c.num_head, cache_dtype, plan.registers_as[1])
            if dims != wanted:
                mismatches.append(f"layer {plan.index} {name}: (attn_type, dim, num_head, dtype, window) "
                                  f"{dims} != {wanted}")
            block_size = getattr(entry, "block_size", None) if api in ("G2", "G3") else model_bs
            if block_size != manifest.block_size:
                mismatches.append(f"layer {plan.index} {name}: block_size {block_size} != {manifest.block_size}")
    report.add("cache entries match the manifest", "init", not mismatches,
               detail="; ".join(mismatches[:4]), mismatches=len(mismatches))
    if manifest.cross_attention is not None:
        report.add(f"cross-attention slot entries match the manifest ({len(manifest.cross_attention.layers)} layers)",
                   "init", not cross_problems, detail="; ".join(cross_problems[:4]), mismatches=len(cross_problems))
    if api != "G0":
        want_mla = bool(manifest.mla.enabled)
        got_mla = bool(getattr(info, "is_mla_backend", False))
        report.add("is_mla_backend", "init", got_mla == want_mla, expected=want_mla, got=got_mla)


def _state_entry_problems(plan, got: dict, cache_dtype: torch.dtype, linear) -> list[str]:
    """A linear layer's Mamba entries: the planned names and shapes, attn_type Mamba, block size 1, the run's dtype
    (int32 for an index entry: the speculative anchor), and the planned speculative depth (``next_n``: the
    framework reserves 1 + next_n blocks per request)."""
    want = {s.name: s for s in plan.states}
    if set(got) != set(want):
        return [f"layer {plan.index}: state entries {sorted(got)} != {sorted(want)}"]
    out = []
    for name, entry in got.items():
        have = (entry.attn_type, list(getattr(entry, "shape", []) or []), entry.dtype, getattr(entry, "block_size", 1))
        dtype = torch.int32 if want[name].dtype == "int32" else cache_dtype
        wanted = (plan.attn_type, list(want[name].shape), dtype, 1)
        if have != wanted:
            out.append(f"layer {plan.index} {name}: (attn_type, shape, dtype, block_size) {have} != {wanted}")
        next_n = (linear.state_blocks_per_request if linear is not None else 1) - 1
        if int(getattr(entry, "next_n", 0) or 0) != next_n:
            out.append(f"layer {plan.index} {name}: next_n {getattr(entry, 'next_n', 0)} != {next_n} (the manifest's "
                       "1 + next_n state blocks per request)")
    return out


def check_allocation(report: Report, host: HostModel, sched, manifest: SelectionManifest | None = None) -> None:
    """V104: every placeholder replaced by a 4-D tensor; with the manifest, a K/V cache's [num_head, dim] are its
    layer's (a layer with its own shape, layers[i].head_dim, holds caches of that shape)."""
    problems = []
    for a in host.attentions:
        plan = manifest.plan_of_module(a.layer_idx) if manifest is not None and not holds_state(
            getattr(a, "attn_type", None)) else None
        # the K/V caches' per-token [num_head, dim] (an MLA latent's layout is its kind's to judge, V101 its entries)
        own = {c.name: (c.num_head, c.dim) for c in plan.caches if c.name in ("k_cache", "v_cache")} \
            if plan is not None else {}
        for c in ("conv_state", "recurrent_state", "state_anchor"):  # a linear layer's Mamba states: [blocks, *shape]
            t = getattr(a, c, None)
            if t is not None and t.numel() == 0:
                problems.append(f"layer {a.layer_idx} {c}: placeholder not replaced")
        for c in ("k_cache", "v_cache", "nope_cache", "rope_cache"):
            t = getattr(a, c, None)
            if t is None:
                continue
            if t.numel() == 0:
                problems.append(f"layer {a.layer_idx} {c}: placeholder not replaced")
            elif t.dim() != 4:
                problems.append(f"layer {a.layer_idx} {c}: shape {tuple(t.shape)} is not 4-D")
            elif c in own and tuple(t.shape[2:]) != own[c]:
                problems.append(f"layer {a.layer_idx} {c}: [num_head, dim] {list(t.shape[2:])} != the layer's "
                                f"{list(own[c])}")
    shapes = {f"{a.layer_idx}.{c}": tuple(getattr(a, c).shape) for a in host.attentions
              for c in ("k_cache", "v_cache", "nope_cache", "rope_cache") if hasattr(a, c)}
    report.add("placeholders replaced by [num_blocks, block_size, num_head, dim]", "init", not problems,
               detail="; ".join(problems[:4]), shapes=dict(list(shapes.items())[:4]),
               blocks=dict(sched.block_num_by_key))


def run_framework(report: Report, manifest: SelectionManifest, host: HostModel, ref_model, api_module,
                  generation: str, scenario: Scenario, seed: int, cache_dtype: torch.dtype) -> None:
    from model_infer_kvcache.validators.harness import Scheduler

    info = host.get_cache_info()
    check_cache_info(report, manifest, info, len(host.attentions), generation, cache_dtype,
                     len(decoder_layers(host.hf_model, loops.stacks if (loops := manifest.recurrent_loops) else None)[1]))
    # the framework's next_n, as the manifest plans it (sliding groups reserve 2 * next_n more tokens)
    graph = graph_mode(manifest)
    sched = Scheduler(info, max_model_len=scenario.max_model_len, max_concurrency=scenario.max_concurrency,
                      api=api_module, generation=generation, device=host.device,
                      next_n=manifest.mtp.speculative_tokens if manifest.mtp is not None else 0,
                      graph_mode_lists=graph == "npugraph_ex")
    report.notes.append(provenance_note(api_module, generation, sched))
    check_allocation(report, host, sched, manifest)
    if any(not c.passed for c in report.checks if c.link == "init"):
        report.notes.append("init link failed: runtime, numeric and release checks not run")
        return
    start_usage = sched.usage()
    start_bytes = _cache_bytes(sched)

    tracker = NumericTracker(ref_model, host, atol=host.atol)
    capture = decode_capture(manifest, host)
    dog = scenario.watchdog("framework request stream")
    prompts = scenario.prompts(seed)
    first = len(scenario.first)
    for ids, new in prompts[:first]:
        sched.add_request(ids, max_new_tokens=new)
    late_pending = list(prompts[first:])
    keys_missing: list[str] = []
    prompt_len = {}
    while sched.has_work():
        if late_pending and any(r.status == "finished" for r in sched.requests.values()):
            for ids, new in late_pending:
                sched.add_request(ids, max_new_tokens=new)
            late_pending = []
        sched.poison()  # freed blocks + null blocks hold NaN before every step
        step = sched.next_step()
        fm = step.forward_metadata
        for a in host.attentions:
            # A Mamba group has a block table and no slot mapping (a state block per request, no token slots).
            for table in ("block_table",) if holds_state(a.attn_type) else ("block_table", "slot_mapping"):
                d = getattr(fm, table)
                # the layer's group: its attn_type, or the manager key it registers by (DeepSeek-V4's win_kv)
                key = a.attn_type if isinstance(d, dict) and a.attn_type in d else \
                    manifest.plan_of_module(a.layer_idx).group_key
                if not isinstance(d, dict) or key not in d:
                    keys_missing.append(f"step {step.index} layer {a.layer_idx}: {table}[{key!r}]")
        if step.is_prefill:
            for rid, q in zip(step.request_ids, step.q_lens, strict=False):
                prompt_len[rid] = q
        n_before = len(host.probe.records)
        forward = capture.forward if capture is not None and not step.is_prefill else host.forward
        with dog.step(step.index, step.request_ids):
            logits = forward(step.input_ids, step.position_ids, fm)
        tracker.record_step(step, logits, host.probe.records[n_before:])
        sched.complete_step(step, logits[step.last_token_rows()].argmax(-1))
    report.add("block_table/slot_mapping hold every layer's key", "runtime", not keys_missing,
               detail="; ".join(keys_missing[:3]), missing=len(keys_missing))
    tracker.check_runtime(report, manifest, prompt_len)
    check_attention_calls(report, manifest, host)
    cross.check_cross_calls(report, manifest, host)
    tracker.check_numeric(report, {rid: r.all_token_ids() for rid, r in sched.requests.items()})

    end_usage = sched.usage()
    report.add("all blocks back in the pool after the stream", "release",
               all(u["used"] == 0 for u in end_usage.values()), usage=end_usage)
    if manifest.mtp is not None:
        from model_infer_kvcache.validators.pipeline.spec_decode import run_framework_stream

        run_framework_stream(report, manifest, host, ref_model, sched, seed, scenario.vocab, dog, capture=capture)
    # Many sequential requests: the pool and the allocated tensors end where they started.
    g = torch.Generator().manual_seed(seed + 1)
    for i in range(scenario.release_requests):
        sched.add_request(torch.randint(0, scenario.vocab, (8 + i % 24,), generator=g).tolist(), max_new_tokens=2)
        while sched.has_work():
            step = sched.next_step()
            # graph mode: these decode steps replay the capture too (admission, release and block reuse)
            forward = capture.forward if capture is not None and not step.is_prefill else host.forward
            with dog.step(step.index, step.request_ids):
                logits = forward(step.input_ids, step.position_ids, step.forward_metadata)
            sched.complete_step(step, logits[step.last_token_rows()].argmax(-1))
    if capture is not None:
        capture.check(report, stream_steps=step.index + 1)
    report.add(f"{scenario.release_requests} sequential requests leave the pool and memory unchanged", "release",
               sched.usage() == start_usage and _cache_bytes(sched) == start_bytes,
               usage_before=start_usage, usage_after=sched.usage(), bytes_before=start_bytes,
               bytes_after=_cache_bytes(sched))


def provenance_note(api_module, generation: str, sched) -> str:
    """Which framework steps ran the checkout's code and which the harness's (one line)."""
    where = "checkout" if api_module.real else "harness"
    parts = [f"{name}={origin}" for name, origin in sched.provenance.items()]
    parts.append(f"forward_metadata={where if api_module.real else 'harness'}")
    return f"framework {generation} modules ({where}): " + ", ".join(parts)


def _cache_bytes(sched) -> int:
    return sum(t.numel() * t.element_size() for ts in sched.cache_tensors.values() for t in ts)
