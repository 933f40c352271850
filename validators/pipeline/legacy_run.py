"""Legacy (contiguous BSH cache written at kv_len): a static batch, prefill then decode.

Standalone mode uses the rendered runner (mode 1); framework mode preallocates
``[batch, max_seq_len, *cache_unit]`` per cache the way the framework does for Legacy layers.
Where FA cannot express the model's attention (``legacy_attention.kernel`` 'model') the render reads the
cache with the model's own attention: its calls are judged by the absence of FA, not by FA's arguments.
"""

from __future__ import annotations

import torch
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from model_infer_kvcache.validators.kinds import check_attention_calls
from model_infer_kvcache.validators.pipeline.numeric import NumericTracker
from model_infer_kvcache.validators.pipeline.report import Report
from model_infer_kvcache.validators.pipeline.request_stream import Scenario, SimpleStep

ROWS = 3
PROMPT = 150
NEW_TOKENS = 9


class _FrameworkLegacy:
    """What the framework does for Legacy layers: preallocate by cache_unit, own kv_len and metadata."""

    def __init__(self, attentions, batch: int, max_seq_len: int, cache_dtype, device):
        from executor.utils.common_utils import get_init_attn_mask
        from executor.utils.forward_metadata import ForwardMetaData

        self._meta = ForwardMetaData
        for a in attentions:
            for name in ("k_cache", "v_cache"):
                setattr(a, name, torch.zeros(batch, max_seq_len, *a.cache_unit, dtype=cache_dtype, device=device))
        self.kv_len = torch.zeros(batch, dtype=torch.int64, device=device)
        self.mask = get_init_attn_mask(2048, device)

    def _build_forward_metadata(self, prompt_len=None):
        is_prefill = prompt_len is not None
        if is_prefill:
            self.kv_len.zero_()
        q = torch.full_like(self.kv_len, prompt_len if is_prefill else 1)
        return self._meta(is_prefill=is_prefill, attention_mask=self.mask, kv_len=self.kv_len.clone(),
                          actual_seq_lengths_kv=self.kv_len + q, actual_seq_lengths_q=q)

    def _advance_kv_len(self, fm):
        self.kv_len.copy_(fm.actual_seq_lengths_kv)


MODEL_ATTENTION_CHECK = "the Legacy render keeps the model's own attention (no FA call)"


def check_no_fa_call(report: Report, fa_calls: list[dict]) -> None:
    """legacy_attention.kernel 'model': FA cannot express the model's attention (soft-cap, ...), so the render
    must read its cache with the model's own attention; an FA call there drops what blocks FA."""
    where = sorted({f"step {c['step']} layer {c['layer']}" for c in fa_calls})
    report.add(MODEL_ATTENTION_CHECK, "runtime", not fa_calls,
               detail=(f"{fa_calls[0]['op']} called at " + ", ".join(where[:3])) if fa_calls else "",
               fa_calls=len(fa_calls))


def prompt_length(scenario: Scenario) -> int:
    """The scenario's longest prompt: a window-crossing scenario (``Scenario.crossing``) has stretched it
    past the window by two blocks; a render run as written at a long real window keeps its short stream
    (QUICK), as the paged drivers do, instead of an O(window^2) reference at the real window."""
    return max(PROMPT, max(n for n, _ in scenario.first))


def run_legacy(report: Report, manifest: SelectionManifest, host, ref_model, seed: int, cache_dtype,
               framework: bool, scenario: Scenario) -> None:
    prompt = prompt_length(scenario)
    max_seq = prompt + NEW_TOKENS + 7
    if framework:
        units = {tuple(a.cache_unit) for a in host.attentions}
        want = {(c.dim,) for c in manifest.layers[0].caches}
        report.add("cache_unit matches the manifest", "init", units == want, got=sorted(units), expected=sorted(want))
        runner = _FrameworkLegacy(host.attentions, ROWS, max_seq, cache_dtype, host.device)
    else:
        runner = type("ValidationRunner", (host.rendered.runner_mixin(),), {})()
        runner._init_kvcache(host.attentions, ROWS, max_seq, device=host.device, cache_dtype=cache_dtype)
    caches = [t for a in host.attentions for t in (a.k_cache, a.v_cache)]
    shape = (ROWS, max_seq, manifest.layers[0].caches[0].dim)
    report.add("contiguous caches are [batch, max_seq_len, N_kv*D]", "init",
               all(tuple(t.shape) == shape for t in caches), expected=shape, got=tuple(caches[0].shape))
    with torch.no_grad():
        for t in caches:
            t.fill_(float("nan"))  # never-written positions must never be read

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 512, (ROWS, prompt), generator=g)
    tracker = NumericTracker(ref_model, host, atol=host.atol)
    dog = scenario.watchdog("Legacy request stream")
    fm = runner._build_forward_metadata(prompt)
    pos = torch.arange(prompt).expand(ROWS, -1)
    seqs = [row.tolist() for row in tokens]
    for step_index in range(NEW_TOKENS):
        n_before = len(host.probe.records)
        with dog.step(step_index, range(ROWS)):
            logits = host.forward_batch(tokens, pos, fm)  # [B, S, V]
            runner._advance_kv_len(fm)
        s = tokens.shape[1]
        step = SimpleStep(step_index, fm.is_prefill, list(range(ROWS)), tokens.reshape(-1), pos.reshape(-1),
                          [s] * ROWS)
        tracker.record_step(step, logits.reshape(ROWS * s, -1), host.probe.records[n_before:])
        nxt = logits[:, -1].argmax(-1)
        for b in range(ROWS):
            seqs[b].append(int(nxt[b]))
        tokens = nxt[:, None]
        pos = (runner.kv_len.clone())[:, None]
        fm = runner._build_forward_metadata()
    tracker.check_runtime(report, manifest, dict.fromkeys(range(ROWS), prompt))
    legacy = manifest.legacy_attention
    if legacy is not None and legacy.kernel == "model":
        check_no_fa_call(report, host.probe.fa_calls)
    else:
        check_attention_calls(report, manifest, host)
    tracker.check_numeric(report, {b: seqs[b][:-1] for b in range(ROWS)})
