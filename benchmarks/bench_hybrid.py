"""Wall time of hybrid linear-attention validation per model and mode, in one run.

Rendered: the fixture configs (Qwen3-Next as published; Qwen3.5-MoE as transformers' Qwen3_5MoeConfig defaults;
Ling-2.5 as the upstream folder's config class writes it, against kvcache's Ling-2.5 reference)
-> analyze -> render -> `kvcache validate` as the CLI runs it (the full request stream, the reading sweep),
framework and standalone mode. The tiny model keeps the published linear sizes (16 key / 32 value heads of 128:
npu_chunk_gated_delta_rule takes head dims of 128 only), so each step runs 32 value heads of 128 x 128 states.
Target on 2 idle cores: <= 60 s per deployment mode (issue #25). Informational, no target: Ling-3.0 (transformers'
bailing_hybrid, KDA linear layers, its MTP layer dropped) in framework mode at its published 32 x 128 linear heads,
where transformers' own float64 reference (depthwise conv1d, chunk KDA) takes most of the time.

--mtp: the hybrids as published with their MTP layer (Qwen3.5-MoE `mtp_num_hidden_layers: 1`, Ling-2.5
`num_nextn_predict_layers: 1`), speculative state slots and the verify-step stream included (issue #41); same target.

Run: python benchmarks/bench_hybrid.py [--skip-kda] [--mtp]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_checkout import cpu_seconds  # noqa: E402

TARGET_S = 60.0  # per deployment mode
CONFIGS = {"qwen3_next": ROOT / "tests" / "fixtures" / "configs" / "qwen3_next.json",
           "qwen3_5_moe": ROOT / "tests" / "fixtures" / "configs" / "qwen3_5_moe.json",
           # Ling-2.5 (lightning attention, MLA full layers) against kvcache's Ling-2.5 reference
           "ling_2_5": ROOT / "tests" / "fixtures" / "configs" / "ling_2_5.json"}
MODES = ("framework", "standalone")


def rendered_case(config: Path, mode: str, tmp: Path):
    from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
    from model_infer_kvcache.implementer.render import render_manifest, write_rendered
    from model_infer_kvcache.validators.pipeline.validate import ValidateRequest, validate

    m = analyze(AnalyzeRequest(config=str(config), deploy_mode=mode))
    (tmp / "m.json").write_text(m.to_json())
    write_rendered(render_manifest(m), tmp / "r")
    return validate(ValidateRequest(manifest=str(tmp / "m.json"), rendered=str(tmp / "r"), config=str(config),
                                    backend="emulated"))


def _ling3_config(tmp: Path) -> Path:
    import json

    cfg = json.loads((ROOT / "tests" / "fixtures" / "configs" / "bailing_hybrid_kda.json").read_text())
    cfg["num_nextn_predict_layers"] = 0  # the figure without MTP, as measured before speculative state slots
    path = tmp / "ling3.json"
    path.write_text(json.dumps(cfg))
    return path


def _with_mtp(config: Path, tmp: Path) -> Path:
    """The config with its published MTP layer (one)."""
    import json

    cfg = json.loads(config.read_text())
    if "text_config" in cfg:
        cfg["text_config"]["mtp_num_hidden_layers"] = 1
    else:
        cfg["num_nextn_predict_layers"] = 1
    path = tmp / f"mtp_{config.name}"
    path.write_text(json.dumps(cfg))
    return path


def _max_diff(report) -> str:
    values = [c.measured.get("max_abs_diff") for c in report.checks if c.id == "V301"]
    return f"{values[0]:.2g}" if values and values[0] is not None else "-"


def main() -> int:
    import argparse

    import transformers  # noqa: F401  (import cost is paid once, outside the per-case timings)

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--skip-kda", action="store_true", help="the gated-delta-net cases only")
    p.add_argument("--mtp", action="store_true", help="Qwen3.5-MoE and Ling-2.5 with their MTP layer, both modes")
    args = p.parse_args()
    if args.mtp:
        cases = [(f"{model}+mtp {mode}", lambda tmp, c=CONFIGS[model]: _with_mtp(c, tmp), mode, TARGET_S)
                 for model in ("qwen3_5_moe", "ling_2_5") for mode in MODES]
    else:
        cases = [(f"{model} {mode}", lambda tmp, c=config, m=mode: c, mode, TARGET_S)
                 for model, config in CONFIGS.items() for mode in MODES]
    if not args.skip_kda and not args.mtp:
        cases.append(("ling3 (KDA) framework", _ling3_config, "framework", None))
    rows = []
    for name, config_of, mode, target in cases:
        with tempfile.TemporaryDirectory() as tmp:
            t0, c0 = time.perf_counter(), cpu_seconds()
            report = rendered_case(config_of(Path(tmp)), mode, Path(tmp))
            dt, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        rows.append((name, dt, cpu, report.passed, _max_diff(report), target))
        above = target is not None and dt > target
        print(f"{name:28s} {dt:6.1f} s (CPU {cpu:6.1f} s)  {'passed' if report.passed else 'FAILED'}"
              f"  max |diff| {rows[-1][4]}{'  ABOVE TARGET' if above else ''}", flush=True)
    print()
    print("| case | wall (s) | CPU (s) | max abs diff | result | target (s) |")
    print("|---|---|---|---|---|---|")
    for name, dt, cpu, ok, diff, target in rows:
        print(f"| {name} | {dt:.1f} | {cpu:.1f} | {diff} | {'passed' if ok else 'FAILED'} | "
              f"{'-' if target is None else f'{target:.0f}'} |")
    return 0 if all(r[3] and (r[5] is None or r[1] <= r[5]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
