"""Per-step logits of the model under test against transformers, plus what the layers saw."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import partial

import torch
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from model_infer_kvcache.analyzer.operators.fa_facts import BAND_MODE, FA_OPS, keywords_of, value_passed
from model_infer_kvcache.validators.pipeline.host_model import reference_layer_outputs, reference_logits
from model_infer_kvcache.validators.pipeline.report import Report

# Logit tolerance per compute dtype of the model under test (the reference runs in float64 for
# float64, else float32). float64 is the CPU default: honest code then differs by rounding only
# (measured max 3e-13 over the validation matrix, see references/validation.md), so a limit
# thousands of times above that still sits orders of magnitude below any real defect.
# float32/bfloat16/float16 are the device's dtypes (NPU runs, or emulating them on CPU).
TOLERANCE = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 5e-2, "float16": 5e-2}


@contextlib.contextmanager
def float64_upcasts():
    """Keep float64 tensors float64 where transformers upcasts "to at least float32".

    Its eager attention asks softmax for ``dtype=torch.float32``, its RMSNorms compute in
    ``.to(torch.float32)``, DeepSeek-V2's RoPE in ``.float()``, the DeepSeek MoE router in
    ``.type(torch.float32)`` and ``.softmax(dtype=torch.float32)``: upcasts meant for half
    precision, downcasts on float64 inputs. They put float32 rounding (~1e-6) into the float64
    comparison wherever the rendered path computes the same thing in the operator's precision
    (the fused MLA writer's RMSNorm, the FA softmax) or a 1e-14 difference crosses a float32
    rounding boundary (router scores), and rounding could no longer be told from a defect.
    Inside this context float64 stays float64; tensors of other dtypes are untouched.
    """
    softmax, to, to_float = torch.nn.functional.softmax, torch.Tensor.to, torch.Tensor.float
    tensor_softmax, to_type = torch.Tensor.softmax, torch.Tensor.type

    def softmax64(input, dim=None, _stacklevel=3, dtype=None):
        if dtype is not None and isinstance(input, torch.Tensor) and input.dtype == torch.float64:
            dtype = torch.float64
        return softmax(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)

    def to64(self, *args, **kwargs):
        if self.dtype == torch.float64:
            if args and args[0] is torch.float32:
                args = (torch.float64, *args[1:])
            elif kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
        return to(self, *args, **kwargs)

    def float64(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else to_float(self, *args, **kwargs)

    def tensor_softmax64(self, dim, dtype=None):
        return tensor_softmax(self, dim, dtype=torch.float64 if dtype is not None and self.dtype == torch.float64
                              else dtype)

    def type64(self, dtype=None, *args, **kwargs):
        if dtype is torch.float32 and self.dtype == torch.float64:
            return self
        return to_type(self, dtype, *args, **kwargs) if dtype is not None else to_type(self)

    patched = {"softmax": tensor_softmax64, "to": to64, "float": float64, "type": type64}
    saved = {name: getattr(torch.Tensor, name) for name in patched}
    torch.nn.functional.softmax = softmax64
    for name, fn in patched.items():
        setattr(torch.Tensor, name, fn)
    try:
        yield
    finally:
        torch.nn.functional.softmax = softmax
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


@dataclass
class _Rows:
    step: int
    is_prefill: bool
    positions: list[int]
    logits: torch.Tensor
    layers: list[torch.Tensor]  # each decoder layer's output rows of this request in this step


@dataclass
class NumericTracker:
    ref_model: object
    host: object
    atol: float = TOLERANCE["float32"]
    rows: dict[int, list[_Rows]] = field(default_factory=dict)
    probes: list[tuple[int, bool, list[int], list[dict]]] = field(default_factory=list)

    def record_step(self, step, logits: torch.Tensor, probe_records: list[dict]) -> None:
        slices = step.token_slices()
        flat = [o.reshape(-1, o.shape[-1]).double().cpu() for o in self.host.layer_outputs]
        for rid in step.request_ids:
            sl = slices[rid]
            pos = step.position_ids[sl].tolist()
            self.rows.setdefault(rid, []).append(
                _Rows(step.index, step.is_prefill, pos, logits[sl].clone(), [o[sl].clone() for o in flat]))
        self.probes.append((step.index, step.is_prefill, list(step.request_ids), probe_records))

    def add_rows(self, rid: int, step: int, is_prefill: bool, positions: list[int], logits: torch.Tensor) -> None:
        """Logits of one request in one step from a model whose layers are not observed (a checkout's
        own model): the numeric check compares them like any other rows."""
        self.rows.setdefault(rid, []).append(_Rows(step, is_prefill, list(positions), logits, []))

    # ------------------------------------------------------------------ runtime link
    def check_runtime(self, report: Report, manifest: SelectionManifest, prompt_len: dict[int, int]) -> None:
        n_q = manifest.parallel.num_q_heads_per_rank
        mla = manifest.model.mla
        bad_shapes, bad_scale = [], []
        want_scale = getattr(self.host.rendered.attention, "SOFTMAX_SCALE", None)
        for index, _, _, records in self.probes:
            for r in records:
                if mla:
                    want_q, want_k = (n_q, mla.qk_nope_head_dim), (mla.kv_lora_rank + mla.qk_rope_head_dim,)
                else:
                    want_q = (n_q, manifest.model.head_dim)
                    want_k = (manifest.parallel.num_kv_heads_per_rank, manifest.model.head_dim)
                if tuple(r["q"][1:]) != want_q or tuple(r["k"][1:]) != want_k:
                    bad_shapes.append(f"step {index} layer {r['layer']}: q {r['q']} k {r['k']}")
                hf = r.get("hf_scaling")
                if hf is not None and want_scale is not None and abs(hf - want_scale) > 1e-9 * max(1.0, hf):
                    bad_scale.append(f"layer {r['layer']}: rendered {want_scale:.8g} vs model {hf:.8g}")
        report.add("shapes around the FA call match the entries", "runtime", not bad_shapes,
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

    def check_fa_calls(self, report: Report, manifest: SelectionManifest) -> None:
        check_fa_calls(report, manifest, self.host.probe.fa_calls)

    # ------------------------------------------------------------------ numeric link
    def _first_bad_layer(self, sequence: list[int], chunk: _Rows) -> str:
        """Name the first decoder layer whose output leaves the reference on this chunk."""
        ref = reference_layer_outputs(self.ref_model, sequence)
        for i, (got, want) in enumerate(zip(chunk.layers, ref, strict=False)):
            want = want[chunk.positions]
            if not torch.isfinite(got).all() or (got - want).abs().max().item() > self.atol:
                return f", first diverging layer {i}"
        return ""

    def check_numeric(self, report: Report, sequences: dict[int, list[int]]) -> None:
        worst, worst_at, nonfinite, greedy_bad, steps = 0.0, "", [], [], set()
        first_bad: tuple[int, _Rows] | None = None
        ref_max, ref_sq, ref_n = 0.0, 0.0, 0
        longest = {"prefill": 0, "decode": 0}
        for rid, chunks in self.rows.items():
            ref = reference_logits(self.ref_model, sequences[rid])
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
                    where = f"step {chunk.step} request {rid}"
                    if not nonfinite:
                        where += self._first_bad_layer(sequences[rid], chunk)
                    nonfinite.append(where)
                    continue
                diff = (got - want).abs().max().item()
                if diff > self.atol and (first_bad is None or chunk.step < first_bad[1].step):
                    first_bad = (rid, chunk)
                if diff > worst:
                    worst, worst_at = diff, f"step {chunk.step} request {rid} position {chunk.positions[-1]}"
                last = chunk.positions[-1]
                if last + 1 < len(sequences[rid]) and int(got[-1].argmax()) != int(want[-1].argmax()):
                    greedy_bad.append(f"step {chunk.step} request {rid}")
        report.add("outputs finite with unowned cache (freed, null, unwritten) poisoned (NaN)", "release", not nonfinite,
                   detail="; ".join(nonfinite[:3]), nonfinite_chunks=len(nonfinite))
        first = ""
        if first_bad is not None:
            rid, chunk = first_bad
            first = (f"first failure at step {chunk.step} request {rid}"
                     + self._first_bad_layer(sequences[rid], chunk))
        # The logit scale next to the difference: a diff means little without the size of what differs.
        rms = (ref_sq / ref_n) ** 0.5 if ref_n else 0.0
        report.add(f"logits vs transformers max |diff| <= {self.atol:g}", "numeric",
                   not nonfinite and worst <= self.atol, detail=first, max_abs_diff=worst, worst_at=worst_at,
                   logit_max_abs=ref_max, logit_rms=rms, rel_diff=worst / ref_max if ref_max else 0.0,
                   steps=len(steps), requests=len(self.rows), longest_prefill=longest["prefill"],
                   longest_decode=longest["decode"])
        report.add("greedy tokens identical to transformers", "numeric", not nonfinite and not greedy_bad,
                   detail="; ".join(greedy_bad[:3]), mismatches=len(greedy_bad))


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
                   reading_dependent: set[int] = frozenset()) -> None:
    """Every FA call passes what the manifest decided for its layer and path (the code runs as written).

    A call is a dict: ``op``, ``step`` (or ``at``, where it was made, e.g. ``warm-up``), ``layer``,
    ``is_prefill``, ``has_mask`` and the FA keywords it was given (sparse_mode, scale/softmax_scale,
    heads, input_layout, pre/next_tokens). Layers in ``reading_dependent`` keep their pre_tokens out of
    the comparison (the numeric link judges it under each reading of the open window question)."""
    bad = []
    for call in fa_calls:
        plan = manifest.layers[call["layer"]]
        path = "prefill" if call["is_prefill"] else "decode"
        where = f"{call.get('at') or 'step ' + str(call['step'])} layer {call['layer']} ({path})"
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
            "q_heads": manifest.parallel.num_q_heads_per_rank,
            "kv_heads": 1 if manifest.mla.enabled else manifest.parallel.num_kv_heads_per_rank,
        }
        if mode == BAND_MODE:
            if call["layer"] not in reading_dependent:
                got["pre_tokens"], want["pre_tokens"] = passed("pre_tokens"), plan.pre_tokens
            got["next_tokens"], want["next_tokens"] = passed("next_tokens"), plan.next_tokens
        diff = [f"{k}={got[k]!r} (manifest {want[k]!r})" for k in want
                if (abs(got[k] - want[k]) > 1e-12 * max(1.0, abs(want[k])) if k == "scale" else got[k] != want[k])]
        if diff:
            bad.append(f"{where}: " + ", ".join(diff))
    report.add(FA_ARGS_CHECK, "runtime", bool(fa_calls) and not bad,
               detail="; ".join(bad[:3]), calls=len(fa_calls), mismatches=len(bad))

