"""The runtime and release links on the checkout's real objects.

Inputs are observations only: the recorder's FA / writer calls (which cache storage, which table,
which slots, which kv lengths), each step's forward metadata as the engine built it, and the
real KVCacheManager. The FA arguments themselves are judged by the check the rendered mode uses
(``validators.pipeline.fa_args.check_fa_calls``).
"""

from __future__ import annotations

import torch
from model_infer_kvcache.analyzer.kv_cache_spec import holds_state
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from model_infer_kvcache.analyzer.operators.fa_facts import FA_OPS, value_passed
from model_infer_kvcache.validators.checkout_run import dsa_checks
from model_infer_kvcache.validators.checkout_run.engine_run import EngineRun, pool_usage
from model_infer_kvcache.validators.checkout_run.recorder import CacheMap, OpRecorder, lengths_of
from model_infer_kvcache.validators.harness.poison import check_pool_invariants, manager_key, null_block_of
from model_infer_kvcache.validators.pipeline import dsa_args
from model_infer_kvcache.validators.pipeline.fa_args import check_fa_calls
from model_infer_kvcache.validators.pipeline.report import Report


def _attribute(calls: list[dict], caches: CacheMap, is_prefill: bool, where: str) -> tuple[list[dict], list[str]]:
    """One forward's FA calls in call order, each with its layer (the k-th call is the k-th attention layer:
    layers run in order, one attention each; a hybrid's linear layers call none) and the cache it read (None:
    the fresh K/V of a prefill). Problems: a call reading another layer's cache, a decode reading no cache."""
    out, problems = [], []
    order = caches.attention_layers()
    for i, call in enumerate(calls):
        k = order[i] if i < len(order) else i
        slot = caches.slot(call["key_storage"]) or caches.slot(call["key_rope_storage"])
        if slot is not None and slot.layer != k:
            problems.append(f"{where}: layer {k} reads layer {slot.layer}'s {slot.cache_name}")
        if slot is None and not is_prefill:
            problems.append(f"{where} layer {k} (decode): FA key is no allocated cache tensor")
        out.append({**call, "at": where, "layer": k, "cache": slot, "group": slot.group if slot else None,
                    "is_prefill": is_prefill})
    return out, problems


def attention_calls(rec: OpRecorder, manifest: SelectionManifest) -> list[dict]:
    """The calls that attend over each layer's cache: FA, or DSA's sparse FA (dsa_checks)."""
    return dsa_checks.sparse_fa_calls(rec) if manifest.dsa is not None else rec.fa_calls


def attributed_fa_calls(rec: OpRecorder, caches: CacheMap, run: EngineRun,
                        n_layers: int, calls: list[dict] | None = None) -> tuple[list[dict], list[str]]:
    """FA calls (``calls``: ``rec.fa_calls`` by default) of the validation steps attributed to their layers
    (``_attribute``), plus a step with a call count other than the layer count as a problem."""
    steps = {s.index: s for s in run.steps}
    by_step: dict[int, list[dict]] = {}
    for call in rec.fa_calls if calls is None else calls:
        if call["step"] in steps:  # warm-up calls carry step -1
            by_step.setdefault(call["step"], []).append(call)
    out, problems = [], []
    for index, step in steps.items():
        calls = by_step.get(index, [])
        if len(calls) != n_layers:
            problems.append(f"step {index}: {len(calls)} FA calls for {n_layers} layers")
        attributed, wrong = _attribute(calls, caches, step.is_prefill, f"step {index}")
        out += attributed
        problems += wrong
    return out, problems


def fa_version_judged(report: Report, manifest: SelectionManifest, calls: list[dict]) -> SelectionManifest:
    """The manifest the FA calls are judged against. A version the analyzer took as the family default
    (``fa.is_default``: either works) is no requirement: when every call uses the other one, the calls
    are judged against that version (said in a note); a required version is judged as written."""
    ops = {c["op"] for c in calls}
    called = {op: version for version, op in FA_OPS.items()}
    if manifest.fa.is_default and len(ops) == 1 and called.get(next(iter(ops))) not in (None, manifest.fa.version):
        version = called[next(iter(ops))]
        report.notes.append(f"FA {manifest.fa.version} was the analyzer's family default (not a requirement); "
                            f"the model calls {version} in every layer: its calls are judged as {version} calls")
        return manifest.model_copy(update={"fa": manifest.fa.model_copy(update={"version": version})})
    return manifest


def mla_decode_mode_judged(report: Report, manifest: SelectionManifest, calls: list[dict]) -> SelectionManifest:
    """An MLA model whose every decode call passes ``sparse_mode=3`` with the mask (upstream Kimi-K2) where the
    manifest plans the documented mode 0 without one: at q_len 1 the two differ only through the device
    question ``mla_decode_sparse_mode3``, which the emulator consults on each such call (so the sweep reruns the
    model under its other readings, and the numeric link judges each). The calls are judged as mode 3 calls,
    said in a note; a model that mixes the two is judged as written."""
    decode = [c for c in calls if not c["is_prefill"]]
    if not (manifest.mla.enabled and decode and all(value_passed(c["op"], c, "sparse_mode") == 3 and c["has_mask"]
                                                                for c in decode)):
        return manifest
    layers = [layer.model_copy(update={"sparse_mode": layer.sparse_mode.model_copy(update={"decode": 3}),
                                       "mask": layer.mask.model_copy(update={"decode": "causal_2048"})})
              if not layer.is_state and layer.sparse_mode.decode == 0 and layer.mask.decode == "none" else layer
              for layer in manifest.layers]
    if layers == list(manifest.layers):
        return manifest
    report.notes.append("the model's MLA decode passes sparse_mode 3 with the mask at q_len 1 (the op docs support "
                        "mode 0 without one, the manifest's plan): its decode calls are judged as mode 3 calls, and "
                        "its result rests on the device question mla_decode_sparse_mode3 (references/"
                        "device_questions.md), swept with the model's other operator questions")
    return manifest.model_copy(update={"layers": layers})


def full_decode_mode_judged(report: Report, manifest: SelectionManifest, calls: list[dict]) -> SelectionManifest:
    """A layer without a window or rope inputs whose every decode call passes ``sparse_mode=0`` without a mask
    where the manifest plans mode 3 with the mask (upstream gemma_4's full layers): at one query token per
    request (no MTP) the op docs make sparse_mode ineffective without rope, and rightDownCausal masks nothing
    there, so the two calls see the same keys under every reading. Judged as mode 0 calls, said in a note."""
    if manifest.mla.enabled or manifest.mtp is not None:
        return manifest
    by_layer: dict[int, list[dict]] = {}
    for c in calls:
        if not c["is_prefill"]:
            by_layer.setdefault(c["layer"], []).append(c)
    eligible = {i for i, cs in by_layer.items()
                if not manifest.layers[i].is_sliding and manifest.layers[i].sparse_mode.decode == 3
                and manifest.layers[i].mask.decode != "none"
                and all(value_passed(c["op"], c, "sparse_mode") == 0 and not c["has_mask"] for c in cs)}
    if not eligible:
        return manifest
    layers = [layer.model_copy(update={"sparse_mode": layer.sparse_mode.model_copy(update={"decode": 0}),
                                       "mask": layer.mask.model_copy(update={"decode": "none"})})
              if layer.index in eligible else layer for layer in manifest.layers]
    report.notes.append(f"{len(eligible)} full-attention layer(s) decode with sparse_mode 0 and no mask where the "
                        "manifest plans 3 with the mask: equivalent at one query token without rope (no MTP), "
                        "judged as mode 0 calls")
    return manifest.model_copy(update={"layers": layers})


# Query layouts that are TND_NTD itself when every request has one query token: [B, 1, N, D] (BSND) / [B, 1, N * D]
# (BSH) are the T = B packed rows of TND, and the NBSD output [N, B, 1, D] is NTD's [N, T, D], in the same order.
ONE_TOKEN_TND_NTD = ("BSND_NBSD", "BSH_NBSD")


def mla_decode_layout_judged(report: Report, manifest: SelectionManifest, calls: list[dict]) -> SelectionManifest:
    """An MLA model whose every FA call on the cache is a decode call with one query token per request, laid out
    BSND_NBSD or BSH_NBSD where the manifest plans TND_NTD (upstream bailing_2_5's eager path; its npugraph_ex path
    calls TND_NTD): at one token the two are the same query rows and the same output order, and the keys are read
    through the block table and KV lengths either way (the op docs list BSH/BSND for the MLA rope path, with ND or NZ
    caches). Judged as that layout, said in a note; mixed layouts, or a longer query, are judged as written."""
    if not (manifest.mla.enabled and manifest.mtp is None and manifest.fa.input_layout == "TND_NTD" and calls):
        return manifest
    layouts = {value_passed(c["op"], c, "input_layout") for c in calls}
    layout = next(iter(layouts))
    if (len(layouts) != 1 or layout not in ONE_TOKEN_TND_NTD
            or any(c["is_prefill"] or len(c["q_shape"]) < 2 or c["q_shape"][1] != 1 for c in calls)):
        return manifest
    report.notes.append(f"the model's MLA decode lays its FA calls out {layout} (one query token per request) where "
                        "the manifest plans TND_NTD: the same query rows and output order at one token; judged as "
                        f"{layout} calls")
    return manifest.model_copy(update={"fa": manifest.fa.model_copy(update={"input_layout": layout})})


def own_layout_layers(report: Report, manifest: SelectionManifest, calls: list[dict]) -> set[int]:
    """Layers whose FA layout is left to the operator's layout rules and the numeric link: those shaped unlike
    the model (``LayerPlan.head_dim``: the manifest's one layout was chosen for the model's head_dim) that the
    model lays out its own way (upstream gemma_4: BSH decode for its 512-wide full layers), said in a note.
    Every other layer's layout is compared as decided."""
    want = manifest.fa.input_layout
    other = {c["layer"]: (manifest.layers[c["layer"]].attn_type, "prefill" if c["is_prefill"] else "decode",
                          value_passed(c["op"], c, "input_layout")) for c in calls
             if manifest.layers[c["layer"]].head_dim is not None and value_passed(c["op"], c, "input_layout") != want}
    if other:
        report.notes.append(f"{len(other)} layer(s) shaped unlike the model lay out FA calls other than the manifest's "
                            f"{want} (judged by the operator's layout rules and the numeric link): "
                            + ", ".join(sorted({f"{a} {p} {lay} (head_dim {manifest.layers[i].head_dim})"
                                                for i, (a, p, lay) in other.items()})))
    return set(other)


def judged_manifest(report: Report, manifest: SelectionManifest, calls: list[dict]) -> SelectionManifest:
    """The manifest the checkout's FA calls are judged against: the analyzer's plan, with the choices the model
    may make differently without being wrong (each said in a note) taken from its calls."""
    manifest = mla_decode_layout_judged(report, fa_version_judged(report, manifest, calls), calls)
    return full_decode_mode_judged(report, mla_decode_mode_judged(report, manifest, calls), calls)


READS_OWN_CACHE = "each layer's FA (once per step) reads that layer's cache (prefill may read its fresh K/V)"


def _judge_calls(report: Report, manifest: SelectionManifest, rec: OpRecorder, caches: CacheMap,
                 calls: list[dict], problems: list[str], writes: list[dict], *, complete: bool) -> dict:
    """The runtime checks of attributed FA calls and of cache writes, each judged against the metadata
    of the forward it was made in. ``complete``: the calls of whole steps (a check without evidence
    fails); otherwise the calls up to an operator error (checks without evidence are left out).
    Returns the (layer, cache name) entries written per step."""
    # The manifest designs the attention over the paged cache. A prefill that attends over its own fresh
    # K/V (DeepSeek's decompressed-MHA prefill, gpt-oss's) is outside that design: the numeric link
    # judges it, and the note says what it called.
    on_cache = [c for c in calls if c["cache"] is not None]
    fresh = [c for c in calls if c["cache"] is None]
    if fresh and complete:
        kinds = sorted({(c["op"], c.get("input_layout", "BSH"), c.get("sparse_mode", 0)) for c in fresh})
        report.notes.append(f"{len(fresh)} prefill FA calls attend over the step's fresh K/V, not the cache "
                            f"(judged by the numeric link): " + ", ".join(f"{o} layout={lay} sparse_mode={m}"
                                                                       for o, lay, m in kinds))
    if manifest.dsa is not None:
        dsa_args.check_sparse_args(report, manifest, calls, complete=complete)
    elif on_cache or complete:
        check_fa_calls(report, judged_manifest(report, manifest, on_cache), on_cache,
                       reading_dependent=window_dependent_layers(manifest),
                       own_layout=own_layout_layers(report, manifest, on_cache))
    if calls or complete:
        report.add(READS_OWN_CACHE, "runtime", not problems and bool(calls), detail="; ".join(problems[:3]),
                   calls=len(calls), prefill_calls_on_fresh_kv=len(fresh))

    # kv lengths as the engine set them for the forward, in every layer (per request, or as the prefix
    # sums the packed TND layout takes).
    changed = []
    for c in calls:
        seen = rec.forwards[c["forward"]]
        if c["kv_lens"] is not None and not seen.engine_kv(c["kv_lens"]):
            changed.append(f"{c['at']} layer {c['layer']}: {lengths_of(c['kv_lens'])[:6]} != {seen.kv_lens[:6]}")
    if calls or complete:
        report.add("kv_len reaches every layer as the engine set it (never changed inside a layer)", "runtime",
                   not changed, detail="; ".join(changed[:3]), mismatches=len(changed))

    # Tables and slots: each layer uses its own group's (the one its cache entry was allocated in).
    wrong_table = []
    for c in on_cache:  # a prefill on its fresh K/V reads no table
        want = rec.forwards[c["forward"]].block_table.get(c["group"])
        got = c["block_table"]
        if want is None or got is None or got.shape != want.shape or not torch.equal(got.to(want.dtype), want):
            wrong_table.append(f"{c['at']} layer {c['layer']}: block_table is not {c['group']!r}'s")
    if on_cache or complete:
        report.add("FA block_table is the layer's own group's", "runtime", not wrong_table and bool(calls),
                   detail="; ".join(wrong_table[:3]), mismatches=len(wrong_table))

    written: dict[int, set[tuple[int, str]]] = {}
    wrong_slots = []
    for w in writes:
        slot = caches.slot(w["storage"])
        if slot is None:
            continue
        written.setdefault(w["step"], set()).add((slot.layer, slot.cache_name))
        want = rec.forwards[w["forward"]].slot_mapping.get(slot.group)
        got = w["index"]
        if want is None or got is None or got.numel() != want.numel() or not torch.equal(
                got.reshape(-1).to(want.dtype), want.reshape(-1)):
            at = f"step {w['step']}" if w["step"] >= 0 else "warm-up"
            wrong_slots.append(f"{at} layer {slot.layer} {slot.cache_name}: slots are not "
                               f"{slot.group!r}'s slot_mapping")
    if written or complete:
        report.add("cache writes use the layer's own group's slot_mapping", "runtime",
                   not wrong_slots and bool(written), detail="; ".join(wrong_slots[:3]), mismatches=len(wrong_slots))
    return written


def check_calls_before_failure(report: Report, manifest: SelectionManifest, rec: OpRecorder,
                               caches: CacheMap) -> None:
    """A run an operator error stopped: judge the calls made up to it (warm-up included; a rejected
    call is recorded before the operator runs) with the runtime checks that need no finished step, so
    a mistake the operator refuses is also named by the check for it (a dropped mask, a packed layout
    passed as BSND, unsplit heads, a decode on fresh keys, lengths changed in a layer). MTP forwards
    are left out: their layers are not the decoder's."""
    by_forward: dict[int, list[dict]] = {}
    for call in attention_calls(rec, manifest):
        if call["forward"] >= 0 and not rec.forwards[call["forward"]].is_mtp:
            by_forward.setdefault(call["forward"], []).append(call)
    calls, problems = [], []
    for forward, group in by_forward.items():
        at = f"step {group[0]['step']}" if group[0]["step"] >= 0 else "warm-up"
        attributed, wrong = _attribute(group, caches, rec.forwards[forward].is_prefill, at)
        calls += attributed
        problems += wrong
    writes = [w for w in rec.writes if w["forward"] >= 0 and not rec.forwards[w["forward"]].is_mtp]
    if not calls and not writes:
        return
    report.notes.append(f"the run stopped at an operator error; the runtime checks judge what was called up to "
                        f"it, warm-up included (FA calls: {len(calls)}, cache writes: {len(writes)})")
    _judge_calls(report, manifest, rec, caches, calls, problems, writes, complete=False)
    if manifest.dsa is not None:
        dsa_checks.check_indexer_calls(report, manifest, rec, caches, None, len(caches.layers()))


def check_runtime(report: Report, manifest: SelectionManifest, rec: OpRecorder, caches: CacheMap,
                  run: EngineRun, n_layers: int) -> None:
    calls, problems = attributed_fa_calls(rec, caches, run, len(caches.attention_layers()) or n_layers,
                                          attention_calls(rec, manifest))
    steps = {s.index: s for s in run.steps}
    written = _judge_calls(report, manifest, rec, caches, calls, problems,
                           [w for w in rec.writes if w["step"] in steps], complete=True)
    if manifest.dsa is not None:
        dsa_checks.check_indexer_calls(report, manifest, rec, caches, set(steps), n_layers)
    if manifest.linear_attention is not None:
        check_state_blocks(report, run)
    # recurrent states are no written K/V (check_state_blocks judges them)
    entries = {(s.layer, s.cache_name) for s in caches.by_storage.values() if not holds_state(s.attn_type)}
    unwritten = [f"step {i}: {sorted(entries - written.get(i, set()))[:4]}" for i in steps
                 if entries - written.get(i, set())]
    report.add("every cache entry is written every step", "runtime", not unwritten, detail="; ".join(unwritten[:3]),
               entries=len(entries))

    # First decode after a prefill of L reads L + 1 keys (from the engine's kv lengths).
    seen, wrong = set(), []
    for s in run.steps:
        if s.is_prefill:
            continue
        for i, rid in enumerate(s.request_ids):
            if rid in seen:
                continue
            seen.add(rid)
            if s.kv_lens[i] != run.prompt_len[rid] + 1:
                wrong.append(f"request {rid} step {s.index}: {s.kv_lens[i]} != {run.prompt_len[rid]} + 1")
    report.add("first decode reads prompt length + 1", "runtime", not wrong and bool(seen), detail="; ".join(wrong[:3]),
               requests=len(seen))


STATE_BLOCKS = "each linear layer writes exactly its requests' state blocks every step (block_table Mamba)"


def check_state_blocks(report: Report, run: EngineRun) -> None:
    """Which blocks of each recurrent-state tensor a step changed (``StepRecord.state_writes``, observed around the
    forward) against the blocks the step's live requests own (``block_table[group][row, 0]``): a block of another
    request or a free one written (a wrong row, a stale slot), or a live request's state not updated (a prefill
    that keeps no final state, a decode that drops its update). Rows the engine padded may write the null block."""
    manager = run.engine.kvcache_manager
    nulls = {manager_key(m): null_block_of(m)
             for m in manager.single_type_managers if holds_state(m.attn_type)}
    problems, judged = [], 0
    for s in run.steps:
        for (layer, name, group), changed in s.state_writes.items():
            table = s.block_table.get(group)
            if table is None:
                problems.append(f"step {s.index}: no {group!r} block table")
                continue
            owned = {int(b) for b in table.reshape(table.shape[0], -1)[:len(s.request_ids), 0].tolist()}
            allowed = owned | ({nulls.get(group)} if s.padded_rows else set())
            judged += 1
            foreign = sorted(set(changed) - allowed)
            stale = sorted(owned - set(changed))
            if foreign:
                problems.append(f"step {s.index} layer {layer} {name}: wrote block(s) {foreign[:4]} no live request "
                                f"of the step owns (its requests own {sorted(owned)[:6]})")
            if stale:
                problems.append(f"step {s.index} layer {layer} {name}: left block(s) {stale[:4]} of live requests "
                                "unchanged")
    report.add(STATE_BLOCKS, "runtime", judged > 0 and not problems, detail="; ".join(problems[:3]),
               judged=judged, problems=len(problems))


def window_dependent_layers(manifest: SelectionManifest) -> set[int]:
    """Layers whose pre_tokens depends on the open window_pre_tokens reading: their value is judged by
    the numeric link under each reading (the sweep), not by equality with the assumed reading's."""
    return {i for dep in manifest.device_dependencies if dep.question == "window_pre_tokens" for i in dep.layers}


def check_padding(report: Report, run: EngineRun) -> None:
    """Decode rows the engine padded write only into their group's null block."""
    manager = run.engine.kvcache_manager
    nulls = {manager_key(m): null_block_of(m) for m in manager.single_type_managers}
    sizes = {manager_key(m): m.block_size for m in manager.single_type_managers}
    padded_steps, outside = 0, []
    for s in run.steps:
        if s.is_prefill or not s.padded_rows:
            continue
        padded_steps += 1
        live = len(s.request_ids)
        for group, slots in s.slot_mapping.items():
            if group not in nulls:
                continue
            pad = slots.reshape(-1)[live:]
            lo, hi = nulls[group] * sizes[group], (nulls[group] + 1) * sizes[group]
            if pad.numel() and not bool(((pad >= lo) & (pad < hi)).all()):
                outside.append(f"step {s.index} {group}: padded slots {pad.tolist()[:4]} outside null block")
    report.add("decode padded to the per-DP batch size; padded rows write only the null block", "runtime",
               padded_steps > 0 and not outside, detail="; ".join(outside[:3]), padded_steps=padded_steps)


def check_release(report: Report, run: EngineRun, start_usage: dict, start_bytes: int, cache_bytes) -> None:
    manager = run.engine.kvcache_manager
    usage = pool_usage(manager)
    problems = [f"{r.key}: {p}" for r in check_pool_invariants(manager) for p in r.problems]
    report.add("all blocks back in the pool after the stream", "release",
               all(u["used"] == 0 for u in usage.values()) and usage == start_usage and not problems,
               detail="; ".join(problems[:3]), usage=usage, usage_before=start_usage)
    report.add("cache tensors unchanged by the stream (bytes)", "release", cache_bytes == start_bytes,
               bytes_before=start_bytes, bytes_after=cache_bytes)
