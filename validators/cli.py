"""`kvcache validate` (and `python -m validators validate`): thin layer over validators.pipeline.validate."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from analyzer.device_questions import BACKEND_CHOICES
from analyzer.errors import InputError, OneLineArgumentParser, guarded
from analyzer.files import atomic_write_text, check_writable
from analyzer.framework_checkout import GENERATIONS
from analyzer.progress_writer import plan_section
from validators.pipeline.numeric import TOLERANCE
from validators.pipeline.runtime_deps import require_validation_deps
from validators.pipeline.validate import ValidateRequest, validate

EXAMPLES = """examples:
  kvcache validate --manifest manifest.json --rendered rendered/ --config config.json
  kvcache validate --manifest manifest.json --rendered rendered/ --config config.json \\
      --report report.json --markdown report.md
  kvcache validate ... --backend npu --framework-root /path/to/cann-recipes-infer

exit status: 0 every check passed, 1 a check failed, 2 bad input (one line naming the file or
flag; nothing written), 3 internal error of kvcache itself (rerun with KVCACHE_DEBUG=1).
"""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(
        prog="kvcache validate",
        description="Three-link checks (init/runtime/release) and numeric equivalence against transformers.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--manifest", required=True, metavar="FILE", help="manifest the code was rendered from")
    p.add_argument("--rendered", required=True, metavar="DIR", help="directory written by `kvcache render`")
    p.add_argument("--config", required=True, metavar="FILE", help="the model's config.json (tiny model is built from it)")
    p.add_argument("--backend", choices=BACKEND_CHOICES, default="auto",
                   help="emulated = CPU reference ops; npu = real torch_npu (auto picks npu when present)")
    p.add_argument("--framework-root", metavar="DIR",
                   help="cann-recipes-infer checkout: use its executor.core.kv_cache instead of the harness")
    p.add_argument("--framework-api", choices=GENERATIONS,
                   help="harness generation (default: the manifest's; a G2 manifest runs the HEAD-era G3 "
                        "harness, --framework-api G2 the 48a59dc one)")
    p.add_argument("--attn-tp-size", type=int, metavar="N",
                   help="attention TP ranks to launch (must equal the manifest's attn_tp_size; gloo on CPU)")
    p.add_argument("--dtype", choices=tuple(TOLERANCE),
                   help="compute dtype of the comparison (default: float64 on the emulated backend, where honest "
                        "code differs by rounding only; the model's dtype on an NPU). Tolerances: float64 1e-9, "
                        "float32 1e-4, bfloat16/float16 5e-2")
    p.add_argument("--report", metavar="FILE", help="write the JSON report here")
    p.add_argument("--markdown", metavar="FILE", help="write the Markdown report (自验证结果) here")
    p.add_argument("--write-progress", metavar="FILE",
                   help="upsert the Markdown report as the 自验证结果 section of this progress.md (idempotent)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of weights and prompts (default 0)")
    p.add_argument("--device-readings", metavar="FILE",
                   help="readings file of `kvcache probe`: run the emulator under the measured readings and skip the "
                        "sweep for the questions it settles")
    p.add_argument("--no-sweep", action="store_true",
                   help="skip re-running under the alternative device readings")
    return p


def _progress(msg: str) -> None:
    print(f"[kvcache validate] {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    # Every output is checked before the (long) run, so bad paths cost nothing and write nothing.
    for flag in ("report", "markdown", "write_progress"):
        target = getattr(args, flag)
        if target:
            try:
                check_writable(target)
            except InputError as exc:
                raise InputError(target, exc.message, field=f"--{flag.replace('_', '-')}") from None
    if args.write_progress:
        from validators.pipeline.report import SECTION_ID

        plan_section(args.write_progress, SECTION_ID, "")  # damaged markers are refused now, not after
    require_validation_deps()
    report = validate(ValidateRequest(
        manifest=args.manifest, rendered=args.rendered, config=args.config, backend=args.backend,
        framework_root=args.framework_root, seed=args.seed, sweep_readings=not args.no_sweep,
        framework_api=args.framework_api, attn_tp_size=args.attn_tp_size, device_readings=args.device_readings,
        dtype=args.dtype,
    ), progress=_progress)
    if args.report:
        atomic_write_text(Path(args.report), report.to_json())
    if args.markdown:
        atomic_write_text(Path(args.markdown), report.to_markdown())
    if args.write_progress:
        from analyzer.progress_writer import write_section
        from validators.pipeline.report import SECTION_ID

        write_section(args.write_progress, SECTION_ID, report.to_markdown())
    print(report.to_markdown())
    for check in report.failed():
        print(f"FAILED [{check.link}] {check.name}: {check.detail or check.measured}", file=sys.stderr)
    return 0 if report.passed else 1


def main(argv: list[str] | None = None) -> int:
    return guarded(run, build_parser().parse_args(argv))
