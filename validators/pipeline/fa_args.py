"""The runtime check that every FA call passes what the manifest decided for its layer and path.

Shared by rendered mode (the drivers judge their probe's calls) and checkout mode (the recorder's calls).
"""

from __future__ import annotations

from functools import partial

from model_infer_kvcache.analyzer.kinds import fa_kv_heads, fa_q_heads
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from model_infer_kvcache.analyzer.operators.fa_facts import BAND_MODE, FA_OPS, keywords_of, value_passed
from model_infer_kvcache.validators.pipeline.report import Report

FA_ARGS_CHECK = "FA call arguments match the manifest"


def check_fa_calls_before_failure(report: Report, manifest: SelectionManifest, fa_calls: list[dict]) -> None:
    """A rendered run an operator error stopped before its FA calls were judged: judge the calls made up
    to it (the probe records a call before the operator runs, so the refused call is judged too), so a
    mistake the operator refuses is also named by the argument check. Calls of a later stream (MTP
    verify steps, judged by their own check) come after the main stream's judgement: nothing to add."""
    calls = [c for c in fa_calls if c.get("layer") is not None]
    if not calls or any(c.name == FA_ARGS_CHECK for c in report.checks):
        return
    report.notes.append(f"the run stopped at an operator error; the FA argument check judges the {len(calls)} "
                        f"FA calls made up to it")
    check_fa_calls(report, manifest, calls)


def check_fa_calls(report: Report, manifest: SelectionManifest, fa_calls: list[dict],
                   reading_dependent: set[int] = frozenset(), own_layout: set[int] = frozenset()) -> None:
    """Every FA call passes what the manifest decided for its layer and path (the code runs as written).

    A call is a dict: ``op``, ``step`` (or ``at``, where it was made, e.g. ``warm-up``), ``layer``,
    ``is_prefill``, ``has_mask`` and the FA keywords it was given (sparse_mode, scale/softmax_scale,
    heads, input_layout, pre/next_tokens). Layers in ``reading_dependent`` keep their pre_tokens out of
    the comparison (the numeric link judges it under each reading of the open window question); layers in
    ``own_layout`` keep their layout out of it (a layer shaped unlike the model's, whose layout the manifest's
    one choice did not consider: the operator's layout rules and the numeric link judge it)."""
    bad = []
    for call in fa_calls:
        path = "prefill" if call["is_prefill"] else "decode"
        where = f"{call.get('at') or 'step ' + str(call['step'])} layer {call['layer']} ({path})"
        diff = fa_call_mismatches(manifest, call, reading_dependent, own_layout)
        if diff:
            bad.append(f"{where}: " + ", ".join(diff))
    report.add(FA_ARGS_CHECK, "runtime", bool(fa_calls) and not bad,
               detail="; ".join(bad[:3]), calls=len(fa_calls), mismatches=len(bad))


def fa_call_mismatches(manifest: SelectionManifest, call: dict, reading_dependent: set[int] = frozenset(),
                       own_layout: set[int] = frozenset()) -> list[str]:
    """The arguments of one FA call (a dict as ``check_fa_calls`` takes) that differ from what the manifest
    decided for its layer and path, each as ``name=value (manifest value)``."""
    plan = manifest.plan_of_module(call["layer"])
    path = "prefill" if call["is_prefill"] else "decode"
    mode = getattr(plan.sparse_mode, path)
    op, kw = call["op"], keywords_of(call["op"])
    # What the operator used: the recorded keyword, else its schema default.
    passed = partial(value_passed, op, call)
    got = {
        "op": op,
        "sparse_mode": passed("sparse_mode"),
        "mask": call["has_mask"],
        "layout": passed("input_layout"),
        "scale": passed(kw.scale),
        "q_heads": passed(kw.num_heads),
        "kv_heads": passed("num_key_value_heads"),
    }
    want = {
        "op": FA_OPS[manifest.fa.version],
        "sparse_mode": mode,
        "mask": getattr(plan.mask, path) != "none",
        "layout": manifest.fa.input_layout,
        "scale": manifest.fa.softmax_scale,
        "q_heads": fa_q_heads(manifest),
        "kv_heads": fa_kv_heads(manifest, plan),
    }
    if call["layer"] in own_layout:
        del got["layout"], want["layout"]
    if mode == BAND_MODE:
        if call["layer"] not in reading_dependent:
            got["pre_tokens"], want["pre_tokens"] = passed("pre_tokens"), plan.pre_tokens
        got["next_tokens"], want["next_tokens"] = passed("next_tokens"), plan.next_tokens
    return [f"{k}={got[k]!r} (manifest {want[k]!r})" for k in want
            if (abs(got[k] - want[k]) > 1e-12 * max(1.0, abs(want[k])) if k == "scale" else got[k] != want[k])]
