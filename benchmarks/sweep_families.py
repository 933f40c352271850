"""Sweep: every causal-LM architecture the installed transformers ships, at its config class's defaults (the
published architectures), through `kvcache analyze`, and optionally through `kvcache run` (analyze -> render ->
validate, both deployment modes).

What it measures is how the bundle meets architectures it was not developed against: each one ends planned, blocked
(a manifest with blockers: `kvcache run` refuses it, render needs --allow-blocked), refused with a reason (exit 2: the
cross-check against transformers' own modules naming what kvcache does not plan, or a field it cannot read), or
crashes (a bug in kvcache). The run sweep adds PASSED / FAILED per mode. Exit 1 when anything crashed
(analyze raising anything but a one-line input error; run exiting 3). Nothing is downloaded: configs come from
transformers' own classes, written to a temporary folder.

Run: ``python benchmarks/sweep_families.py [--run llama,qwen3,...|--run all-planned|--keep T --run rest] [--only a,b] [--jobs 2]
[--table benchmarks/results/sweep_families.md] [--json]``. ``--jobs`` runs that many ``kvcache run`` processes at once
(each one single-threaded: the wall time is for that many cores); ``--table`` writes the run table (family, plan,
result and seconds per mode) as markdown.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# Fields a config class leaves unset although its modeling code cannot build the model without them (transformers
# refuses its own class defaults), or derives into a shape no released checkpoint has, filled with a released
# checkpoint's values: {model_type: {field: value}}, applied to the config and to any sub-config of that model_type
# (qwen4_exp's text_config). One entry per family, its source beside; the plan cell says which fields were filled.
_PUBLISHED_FIELDS: dict[str, dict] = {
    # source: zai-org/GLM-4.5-Air's config.json (head_dim 128), whose hidden 4096, 96 / 8 heads, 46 layers, 128
    # experts and partial rotary 0.5 the class defaults are; without head_dim the class derives 4096 / 96 = 42
    "glm4_moe": {"head_dim": 128},
    # source: databricks/dbrx-base's config.json (attn_config: rope_theta 500000, clip_qkv 8): DbrxAttentionConfig's
    # defaults carry no rope_theta, which DbrxAttention reads, and clip_qkv None, which its clamp cannot take
    "dbrx": {"attn_config": {"rope_theta": 500000, "clip_qkv": 8}},
    # source: LiquidAI/LFM2-8B-A1B's config.json (the checkpoint Lfm2MoeConfig's docstring names), as public ports quote
    # it in their test fixtures: 24 layers, attention at 2, 6, 10, 14, 18, 21 (18 conv + 6 GQA, its model card); the
    # class's num_hidden_layers default of 32 comes with no layer_types its decoder layers can index
    # (tests/fixtures/configs/lfm2_moe.json is the same config)
    "lfm2_moe": {"num_hidden_layers": 24,
                 "layer_types": ["full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv" for i in range(24)]},
    # source: CohereLabs/North-Micro-Vision-Instruct's config.json text_config (the checkpoint CohereCompassTextConfig's
    # docstring names), as two public ports quote it: SGLang's cohere_compass config (mmangkad-dev/sglang,
    # python/sglang/srt/configs/cohere_compass.py: 28 layers, its rope defaults) and lablup/mlxcel's cohere_compass
    # decoder (its PR #1735 report prints the rope_parameters block and the layer split: three sliding_attention then
    # one full_attention, full at 3, 7, ..., 27). rope_parameters is keyed by layer type: sliding rope_theta 50000 with
    # mrope_section [24, 20, 20] (all three position rows equal on text: a plain rotation), full_attention null (NoPE,
    # modeling_cohere_compass.py skips the rotation). The class default's {} has no entry CohereCompassRotaryEmbedding
    # can index (KeyError 'full_attention'), and its layer_types (all full_attention) come with no released rope.
    # The other fields stay the class's (hidden 8192, 64 heads; the release's are 2048, 16 / 8 heads of 128).
    "cohere_compass_text": {
        "num_hidden_layers": 28,
        "layer_types": ["full_attention" if i % 4 == 3 else "sliding_attention" for i in range(28)],
        "rope_parameters": {"full_attention": None,
                            "sliding_attention": {"rope_type": "default", "rope_theta": 50000,
                                                  "mrope_section": [24, 20, 20], "mrope_interleaved": True}}},
    # source: Qwen4-Exp's released text config as public ports spell it (no config.json published by Qwen was found):
    # steadfastgaze/MoEspresso's qwen4 loader test (_architecture(), the 48-layer 2560-hidden release) and an MLX
    # port's TextModelArgs defaults agree on the five QSA fields and the rope. The rope is needed with them:
    # configuration_qwen4_exp.py validate_architecture refuses a rotary span (head_dim 256 x partial_rotary_factor)
    # wider than indexer_head_dim, so the class default's full rotation cannot go with the released 128-wide QSA head.
    "qwen4_exp_text": {"indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 128, "indexer_budget": 2048,
                       "indexer_compress_ratio": 4,
                       "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                                           "partial_rotary_factor": 0.25}},
}


def _with_published(data: dict) -> dict:
    """``data`` with ``_PUBLISHED_FIELDS`` filled in wherever a (sub-)config's model_type has an entry (a section's
    fields merged into that section: DBRX's attn_config keeps its other fields)."""
    out = {k: _with_published(v) if isinstance(v, dict) else v for k, v in data.items()}
    return _merged(out, _PUBLISHED_FIELDS.get(out.get("model_type"), {}))


def _merged(data: dict, fill: dict) -> dict:
    return data | {k: _merged(data[k], v) if isinstance(v, dict) and isinstance(data.get(k), dict) else v
                   for k, v in fill.items()}


def _configs(folder: Path, only: list[str] | None) -> dict[str, Path]:
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = {}
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        if only and model_type not in only:
            continue
        try:
            data = _with_published(CONFIG_MAPPING[model_type]().to_dict())
        except Exception:  # noqa: BLE001 - a config class without usable defaults is not an architecture to sweep
            continue
        path = folder / f"{model_type}.json"
        path.write_text(json.dumps(data, default=str), encoding="utf-8")
        out[model_type] = path
    print(f"transformers {transformers.__version__}: {len(out)} causal-LM config classes", file=sys.stderr)
    return out


def _plan_summary(m) -> str:
    """What the manifest plans, in one cell: the KV mode and the layers per attn_type (and the branch kinds)."""
    kinds = Counter(layer.attn_type.value if hasattr(layer.attn_type, "value") else str(layer.attn_type)
                    for layer in m.layers)
    cross = m.cross_attention
    extra = [name for name, on in (
        ("MLA", m.mla.enabled), ("DSA", m.dsa is not None), ("compressed", m.compressed is not None),
        ("cross-attention" + (f" ({len(m.no_cache_layers or ())} cross-only blocks)" if cross is not None
                              and not cross.self_attention else ""), cross is not None),
        ("drafter (reads its target's cache)", m.drafter is not None),
        ("recurrent loops", m.recurrent_loops is not None)) if on]
    return " ".join([m.kv_mode.value, ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))] + extra)


def _analyze(path: Path) -> tuple[str, str, str]:
    from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
    from model_infer_kvcache.analyzer.errors import InputError

    try:
        with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = analyze(AnalyzeRequest(config=str(path), dispatch="部署模式：框架部署"))
    except InputError as exc:
        flag = exc.field
        if flag in ("is_decoder", "causal") and not json.loads(path.read_text(encoding="utf-8")).get(flag):
            # a class whose defaults build an encoder (the refusal names the flag, arch_check.encoder_flag): a BERT-era
            # class's causal LM is the same config with is_decoder true (what transformers' own warning asks for), XLM's
            # with causal true (its CLM checkpoints); the sweep plans that, and the plan cell says so
            data = json.loads(path.read_text(encoding="utf-8")) | {flag: True}
            path.write_text(json.dumps(data, default=str), encoding="utf-8")
            verdict, detail, plan = _analyze(path)
            return verdict, f"{detail} ({flag}: true)", f"{plan} ({flag}: true)" if plan else ""
        why = exc.render().split(": ", 1)[-1].replace(
            "architecture cross-check against transformers' own attention modules (meta device) failed", "cross-check")
        return "refused", why[:240], ""
    except Exception as exc:  # noqa: BLE001 - what the sweep is for: report it
        return "crash", f"{type(exc).__name__}: {exc}"[:160], ""
    filled = _PUBLISHED_FIELDS.get(path.stem)
    if filled:  # the cells say the config is not the class's bare defaults
        verdict, detail, plan = _analyze_manifest(m)
        note = f" (published: {', '.join(filled)})"
        return verdict, detail + note, plan + note if plan else ""
    return _analyze_manifest(m)


def _analyze_manifest(m) -> tuple[str, str, str]:
    if m.blockers:  # a manifest kvcache run refuses (render needs --allow-blocked): not a plan it serves
        return "blocked", f"{m.kv_mode.value}, {len(m.blockers)} blocker(s): {m.blockers[0].message}"[:240], ""
    return "planned", m.kv_mode.value, _plan_summary(m)


def _run(path: Path, mode: str, out: Path) -> tuple[str, str, float]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "model_infer_kvcache", "run", "--config", str(path),
                           "--dispatch", f"部署模式：{mode}", "--out", str(out), "--force"],
                          capture_output=True, text=True, timeout=1800, env=_run_env())
    last = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
    verdict = {0: "PASSED", 1: "FAILED", 2: "refused", 3: "crash"}.get(proc.returncode, f"exit {proc.returncode}")
    return verdict, last[0][:160], time.perf_counter() - start


_JOBS = [1]  # the --jobs of this sweep (set by main)


def _run_env() -> dict[str, str]:
    """The cores shared out between the runs at once: each run with torch's default of one thread per core would
    spin at OpenMP barriers beside the others (benchmarks/bench_threads.py: 5 s -> 30-40 s a run on 2 cores)."""
    threads = max(1, (os.cpu_count() or 1) // _JOBS[0])
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads))}


MODES = ("框架部署", "独立部署")


def _table(analyzed: dict, runs: dict, wall: float, jobs: int, pending: int = 0,
           kept: dict[str, tuple[str, list[str]]] | None = None, kept_from: str = "") -> str:
    """The run table: one row per family whose two modes have run, side by side; the failures listed first.
    ``pending``: runs not finished yet (the table is rewritten as runs finish, so a sweep cut short keeps its rows).
    ``kept``: rows of an earlier table (``--keep``) for planned families this sweep did not run, marked as such."""
    import transformers

    kept = {t: row for t, row in (kept or {}).items() if f"{t}/{MODES[0]}" not in runs}
    rows = sorted({k.split("/")[0] for k in runs if all(f"{k.split('/')[0]}/{m}" in runs for m in MODES)},
                  key=lambda t: (all(runs[f"{t}/{m}"][0] == "PASSED" for m in MODES), t))
    counts = Counter(v for v, _, _ in runs.values())
    kept_counts = Counter(v for _, verdicts in kept.values() for v in verdicts)
    lines = [f"# `kvcache run` over every planned family (transformers {transformers.__version__})", "",
             f"Written by `benchmarks/sweep_families.py --run ... --jobs {jobs} --table ...`: each family's config "
             "class at its defaults, `kvcache run` in framework mode (框架部署) and standalone mode (独立部署). "
             f"This run: {len(rows)} families, {len(runs)} runs: "
             + ", ".join(f"{n} {v}" for v, n in sorted(counts.items()))
             + f"; wall {wall / 60:.1f} min with {jobs} run(s) at a time"
             + (f"; {pending} run(s) not finished when this was written." if pending else ".")
             + (f" Kept from the earlier table {kept_from} (families this run did not rerun, marked *kept*): "
                f"{len(kept)} families, " + ", ".join(f"{n} {v}" for v, n in sorted(kept_counts.items())) + "."
                if kept else ""), "",
             "| family | plan | framework | s | standalone | s |", "|---|---|---|---:|---|---:|"]
    for t in rows:
        cells = []
        for mode in MODES:
            verdict, detail, seconds = runs[f"{t}/{mode}"]
            cells += [verdict if verdict == "PASSED" else f"{verdict}: {detail}".replace("|", "/"), f"{seconds:.1f}"]
        lines.append(f"| {t} | {analyzed[t][2] or analyzed[t][1]} | " + " | ".join(cells) + " |")
    lines += [row.replace(f"| {t} |", f"| {t} *kept* |", 1) for t, (row, _) in sorted(kept.items())]
    return "\n".join(lines) + "\n"


def _kept_rows(path: Path, planned: set[str]) -> dict[str, tuple[str, list[str]]]:
    """The rows of an earlier table for families planned now: family -> (row, verdict per mode)."""
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 6 or cells[0] in ("family", "---"):
            continue
        family = cells[0].removesuffix(" *kept*")
        if family in planned:
            out[family] = (line.replace(f"| {cells[0]} |", f"| {family} |", 1),
                           [cells[2].split(":")[0], cells[4].split(":")[0]])
    return out


_TABLE_LOCK = threading.Lock()


def _write_table(path: Path, text: str) -> None:
    """Atomically (a killed sweep leaves the last table whole), one writer at a time."""
    with _TABLE_LOCK:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help="comma-separated model types (default: every causal-LM type)")
    p.add_argument("--run", help="comma-separated model types to also run end to end, 'all-planned', or 'rest' (with "
                                  "--keep: the planned families the kept table lacks or did not pass)")
    p.add_argument("--jobs", type=int, default=1, help="kvcache run processes at once (default 1)")
    p.add_argument("--table", type=Path, help="write the run table (markdown) to this file")
    p.add_argument("--keep", type=Path, help="an earlier run table: its rows for planned families this sweep does "
                                             "not run are kept (marked); with --run rest, only the planned families "
                                             "it lacks or did not pass in both modes run")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    _JOBS[0] = max(1, args.jobs)
    os.environ.setdefault("KVCACHE_CACHE_DIR", "")  # every analyze pays its own transformers build: no stale entry
    with tempfile.TemporaryDirectory(prefix="kvcache-sweep-") as tmp:
        folder = Path(tmp)
        configs = _configs(folder, args.only.split(",") if args.only else None)
        analyzed = {t: _analyze(path) for t, path in configs.items()}
        planned = [t for t, (v, _, _) in analyzed.items() if v == "planned"]
        kept = _kept_rows(args.keep, set(planned)) if args.keep else {}
        if args.run == "rest":
            wanted = [t for t in planned if t not in kept or kept[t][1] != ["PASSED", "PASSED"]]
        else:
            wanted = planned if args.run == "all-planned" else [t for t in (args.run or "").split(",") if t]
        keys = [(t, mode) for t in wanted if t in configs for mode in MODES]
        start = time.perf_counter()

        finished: dict[str, tuple[str, str, float]] = {}

        def one(key: tuple[str, str]) -> tuple[str, str, float]:
            r = _run(configs[key[0]], key[1], folder / f"out-{key[0]}-{key[1]}")
            print(f"run     {key[0]}/{key[1]} {r[0]} {r[2]:.1f}s {r[1]}", file=sys.stderr, flush=True)  # progress
            finished[f"{key[0]}/{key[1]}"] = r
            if args.table:
                _write_table(args.table, _table(analyzed, dict(finished), time.perf_counter() - start, args.jobs,
                                                len(keys) - len(finished), kept, str(args.keep)))
            return r

        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:  # threads: each run is its own process
            runs = {f"{t}/{mode}": r for (t, mode), r in zip(keys, pool.map(one, keys), strict=True)}
        wall = time.perf_counter() - start
    result = {"analyze": {t: {"verdict": v, "detail": d, "plan": plan} for t, (v, d, plan) in analyzed.items()},
              "analyze_counts": dict(Counter(v for v, _, _ in analyzed.values())),
              "run": {k: {"verdict": v, "detail": d, "seconds": round(s, 1)} for k, (v, d, s) in runs.items()},
              "run_counts": dict(Counter(v for v, _, _ in runs.values())), "run_wall_seconds": round(wall, 1)}
    if args.json:
        print(json.dumps(result, indent=2, ensure_ascii=False))
    else:
        for t, (v, d, _) in analyzed.items():
            print(f"analyze {t:28s} {v:8s} {d}")
        for k, (v, d, s) in runs.items():
            print(f"run     {k:28s} {v:8s} {s:6.1f}s {d}")
        print(f"analyze: {result['analyze_counts']}; run: {result['run_counts']} in {wall / 60:.1f} min")
    if args.table and runs:
        _write_table(args.table, _table(analyzed, runs, wall, args.jobs, kept=kept, kept_from=str(args.keep)))
    crashed = ([t for t, (v, _, _) in analyzed.items() if v == "crash"]
               + [k for k, (v, _, _) in runs.items() if v == "crash"])
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
