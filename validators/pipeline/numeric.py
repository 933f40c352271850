"""The numeric link: per-step logits of the model under test against transformers, plus the runtime checks
read from what the layers saw (shapes, scale, first decode length). The FA-argument check lives in
``fa_args``; the tolerances and the float64 mode in ``precision``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from model_infer_kvcache.validators.pipeline.host_model import (
    reference_dtype_drift,
    reference_layer_outputs,
    reference_logits,
    reference_logits_and_layers,
    reference_sensitivity,
)
from model_infer_kvcache.validators.pipeline.precision import (
    CONDITIONED_CEILING,
    DRIFT_CEILING,
    TOLERANCE,
    conditioned_bound,
)
from model_infer_kvcache.validators.pipeline.report import Report


@dataclass
class _Rows:
    step: int
    is_prefill: bool
    positions: list[int]
    logits: torch.Tensor
    layers: list[torch.Tensor]  # each decoder layer's output rows of this request in this step
    rows: tuple[int, int] | None = None  # this request's rows [start, stop) in the step's tokens (None: unknown)


@dataclass
class NumericTracker:
    ref_model: object
    host: object
    atol: float = TOLERANCE["float32"]
    rows: dict[int, list[_Rows]] = field(default_factory=dict)
    probes: list[tuple[int, bool, list[int], list[dict]]] = field(default_factory=list)
    reference: Callable[[list[int]], torch.Tensor] | None = None  # the logits oracle (host_model.ReferenceMemo)

    def record_step(self, step, logits: torch.Tensor, probe_records: list[dict]) -> None:
        slices = step.token_slices()
        flat = [o.reshape(-1, o.shape[-1]).double().cpu() for o in self.host.layer_outputs]
        for rid in step.request_ids:
            sl = slices[rid]
            pos = step.position_ids[sl].tolist()
            self.rows.setdefault(rid, []).append(
                _Rows(step.index, step.is_prefill, pos, logits[sl].clone(), [o[sl].clone() for o in flat],
                      (sl.start, sl.stop)))
        self.probes.append((step.index, step.is_prefill, list(step.request_ids), probe_records))

    def add_rows(self, rid: int, step: int, is_prefill: bool, positions: list[int], logits: torch.Tensor) -> None:
        """Logits of one request in one step from a model whose layers are not observed (a checkout's
        own model): the numeric check compares them like any other rows."""
        self.rows.setdefault(rid, []).append(_Rows(step, is_prefill, list(positions), logits, []))

    # ------------------------------------------------------------------ runtime link
    def check_runtime(self, report: Report, manifest: SelectionManifest, prompt_len: dict[int, int]) -> None:
        if not manifest.attention_layers:
            report.notes.append("no layer attends (a pure state stack): the attention-call checks (shapes, scale, "
                                "the first decode's KV length, FA arguments) have no call to judge; the states are "
                                "judged by the init checks and the logits")
            return
        n_q = manifest.parallel.num_q_heads_per_rank
        mla = manifest.model.mla
        bad_shapes, bad_scale = [], []
        want_scale = getattr(self.host.rendered.attention, "SOFTMAX_SCALE", None)
        for index, _, _, records in self.probes:
            for r in records:
                if mla:
                    want_q, want_k = (n_q, mla.qk_nope_head_dim), (mla.kv_lora_rank + mla.qk_rope_head_dim,)
                else:  # the layer's own shape (layers[i].head_dim / num_kv_heads_per_rank), else the model's
                    plan = manifest.plan_of_module(r["layer"]) if r.get("layer") is not None else None
                    dim = (plan.head_dim if plan is not None else None) or manifest.model.head_dim
                    kv = (plan.num_kv_heads_per_rank if plan is not None else None) or \
                        manifest.parallel.num_kv_heads_per_rank
                    want_q, want_k = (n_q, dim), (kv, dim)
                if tuple(r["q"][1:]) != want_q or tuple(r["k"][1:]) != want_k:
                    bad_shapes.append(f"step {index} layer {r['layer']}: q {r['q']} k {r['k']}")
                hf = r.get("hf_scaling")
                if hf is not None and want_scale is not None and abs(hf - want_scale) > 1e-9 * max(1.0, hf):
                    bad_scale.append(f"layer {r['layer']}: rendered {want_scale:.8g} vs model {hf:.8g}")
        report.add("shapes around the attention call (FA or sparse FA) match the entries", "runtime", not bad_shapes,
                   detail="; ".join(bad_shapes[:3]), mismatches=len(bad_shapes))
        report.add("softmax scale equals the model's attention scaling", "runtime", not bad_scale,
                   detail="; ".join(sorted(set(bad_scale))[:2]), rendered=want_scale)
        # First decode after a prefill of L reads L + 1 keys.
        seen_decode, wrong = set(), []
        for index, is_prefill, rids, records in self.probes:
            if is_prefill or not records:
                continue
            kv = records[0]["kv_lens"]
            for i, rid in enumerate(rids):
                if rid in seen_decode or rid not in prompt_len or kv is None or i >= len(kv):
                    continue
                seen_decode.add(rid)
                if kv[i] != prompt_len[rid] + 1:
                    wrong.append(f"request {rid} step {index}: {kv[i]} != {prompt_len[rid]} + 1")
        report.add("first decode reads prompt length + 1", "runtime", not wrong and bool(seen_decode),
                   detail="; ".join(wrong[:3]), requests=len(seen_decode))

    # ------------------------------------------------------------------ numeric link
    def _first_bad_layer(self, sequence: list[int], chunk: _Rows, ref: list[torch.Tensor] | None = None) -> str:
        """Name the first decoder layer whose output leaves the reference on this chunk (``ref``: the reference's
        layer outputs over ``sequence`` when the comparison's forward kept them)."""
        if not chunk.layers:  # a checkout's own model: its layers are not observed
            return ""
        ref = ref if ref is not None else reference_layer_outputs(self.ref_model, sequence)
        for i, (got, want) in enumerate(zip(chunk.layers, ref, strict=False)):
            want = want[chunk.positions]
            if not torch.isfinite(got).all() or (got - want).abs().max().item() > self.atol:
                return f", first diverging layer {i}"
        return ""

    def _reference(self, sequence: list[int], observed: bool) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """The reference's logits over ``sequence`` and, where the host's layers are observed, its layer outputs
        from the same forward (a failing request's first diverging layer then needs no second forward). A model
        whose layers the hooks cannot read gives its logits alone: _first_bad_layer asks again, as it always did."""
        if observed:
            try:
                return reference_logits_and_layers(self.ref_model, sequence)
            except Exception:  # noqa: BLE001 - the plain forward below is the comparison's; a real error shows there
                pass
        return (self.reference or (lambda seq: reference_logits(self.ref_model, seq)))(sequence), None

    def check_numeric(self, report: Report, sequences: dict[int, list[int]]) -> None:
        worst, worst_at, nonfinite, greedy_bad, steps = 0.0, "", [], [], set()
        worst_rid = None
        first_bad: tuple[int, _Rows] | None = None
        first_any: tuple[int, _Rows] | None = None  # the earliest failing chunk, non-finite ones included
        ref_max, ref_sq, ref_n = 0.0, 0.0, 0
        longest = {"prefill": 0, "decode": 0}
        failed_layers: dict[int, list[torch.Tensor] | None] = {}  # the reference's layers of requests that failed
        for rid, chunks in self.rows.items():
            ref, layers = self._reference(sequences[rid], observed=any(chunk.layers for chunk in chunks))
            ref_max = max(ref_max, ref.abs().max().item())
            ref_sq, ref_n = ref_sq + (ref * ref).sum().item(), ref_n + ref.numel()
            for chunk in chunks:
                path = "prefill" if chunk.is_prefill else "decode"
                longest[path] = max(longest[path], chunk.positions[-1] + 1)
            for chunk in chunks:
                steps.add(chunk.step)
                got = chunk.logits
                want = ref[chunk.positions]
                if not torch.isfinite(got).all():
                    if first_any is None or chunk.step < first_any[1].step:
                        first_any = (rid, chunk)
                    where = f"step {chunk.step} request {rid}"
                    if not nonfinite:
                        where += self._first_bad_layer(sequences[rid], chunk, layers)
                    nonfinite.append(where)
                    continue
                diff = (got - want).abs().max().item()
                if diff > self.atol:
                    failed_layers[rid] = layers
                if diff > self.atol and (first_bad is None or chunk.step < first_bad[1].step):
                    first_bad = (rid, chunk)
                if diff > self.atol and (first_any is None or chunk.step < first_any[1].step):
                    first_any = (rid, chunk)
                if diff > worst:
                    worst, worst_at = diff, f"step {chunk.step} request {rid} position {chunk.positions[-1]}"
                    worst_rid = rid
                last = chunk.positions[-1]
                if last + 1 < len(sequences[rid]) and int(got[-1].argmax()) != int(want[-1].argmax()):
                    # the reference's margin of its own choice over the token the model picked
                    margin = (want[-1].max() - want[-1][int(got[-1].argmax())]).item()
                    greedy_bad.append((f"step {chunk.step} request {rid}", margin))
        report.add("outputs finite with unowned cache (freed, null, unwritten) poisoned (NaN)", "release", not nonfinite,
                   detail="; ".join(nonfinite[:3]), nonfinite_chunks=len(nonfinite))
        if first_any is not None:  # what localisation replays
            rid, chunk = first_any
            report.first_failure = {"step": chunk.step, "request": rid, "is_prefill": chunk.is_prefill,
                                    "rows": chunk.rows, "positions": list(chunk.positions),
                                    "tokens": list(sequences[rid][:chunk.positions[-1] + 1])}
        first = ""
        if first_bad is not None:
            rid, chunk = first_bad
            first = (f"first failure at step {chunk.step} request {rid}"
                     + self._first_bad_layer(sequences[rid], chunk, failed_layers.get(rid)))
        # The logit scale next to the difference: a diff means little without the size of what differs.
        rms = (ref_sq / ref_n) ** 0.5 if ref_n else 0.0
        bound, extra = self.atol, {}
        dtype = str(getattr(self.host, "cache_dtype", "")).removeprefix("torch.")
        ceiling = CONDITIONED_CEILING if dtype == "float64" else DRIFT_CEILING
        # (a float32 run's reference is float32 itself: no drift to measure)
        if not nonfinite and self.atol < worst <= ceiling and worst_rid is not None and dtype in TOLERANCE \
                and dtype != "float32":
            # over the bound by a rounding-sized amount: is transformers' own model that far off at this precision?
            if dtype == "float64":
                own, what = reference_sensitivity(self.ref_model, sequences[worst_rid]), "one-ulp sensitivity"
                extra = {"reference_one_ulp_sensitivity": own}
            else:
                own = reference_dtype_drift(self.ref_model, sequences[worst_rid], getattr(torch, dtype))
                what = f"{dtype} drift from its float32 run"
                extra = {f"reference_{dtype}_drift": own}
            bound = conditioned_bound(self.atol, own, dtype)
            if bound != self.atol:
                first = (f"bound {bound:.3g} = {bound / own:g} x the reference's own {what} {own:.3g} "
                         f"(transformers itself is off by more than {self.atol:g} on this model)"
                         + (f"; {first}" if first else ""))
        report.add(f"logits vs transformers max |diff| <= {bound:.3g}", "numeric",
                   not nonfinite and worst <= bound, detail=first, max_abs_diff=worst, worst_at=worst_at,
                   logit_max_abs=ref_max, logit_rms=rms, rel_diff=worst / ref_max if ref_max else 0.0,
                   steps=len(steps), requests=len(self.rows), longest_prefill=longest["prefill"],
                   longest_decode=longest["decode"], **extra)
        # logits within ``bound`` of the reference can flip a choice whose margin is at most 2 x bound: such a tie is
        # the accepted precision (a bfloat16 run), not a different token
        tie = 2 * min(worst, bound)
        ties = [where for where, margin in greedy_bad if margin <= tie]
        flips = [where for where, margin in greedy_bad if margin > tie]
        report.add("greedy tokens identical to transformers", "numeric", not nonfinite and not flips,
                   detail="; ".join(flips[:3] + ([f"{len(ties)} near-tie(s) within 2 x the logit difference: "
                                                  + ", ".join(ties[:3])] if ties else [])),
                   mismatches=len(flips), near_ties=len(ties))
