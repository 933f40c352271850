"""`kvcache run`: analyze -> render -> validate in one command (default: the bundled example)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from analyzer.build import AnalyzeRequest, analyze
from analyzer.cli import guarded
from analyzer.errors import InputError
from analyzer.progress_writer import atomic_write_text
from implementer.render import render_manifest, write_rendered

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiny_qwen3" / "config.json"
EXAMPLES = """examples:
  kvcache run                                   # the bundled tiny Qwen3 example, results in ./kvcache-out
  kvcache run --config Qwen3-8B/config.json --dispatch "部署模式: 框架部署" --out out/
  kvcache run --model-dir /models/gpt-oss-20b --deploy-mode standalone --out out/
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvcache run", description="analyze -> render -> validate in one go.",
                                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", metavar="FILE", help=f"config.json (default: {EXAMPLE.relative_to(EXAMPLE.parents[2])})")
    src.add_argument("--model-dir", metavar="DIR", help="model directory holding config.json")
    p.add_argument("--progress", metavar="FILE", help="progress.md of the migration")
    p.add_argument("--dispatch", metavar="TEXT", help='dispatch prompt, e.g. "部署模式: 框架部署"')
    p.add_argument("--deploy-mode", choices=("framework", "standalone"), help="deployment mode from the user")
    p.add_argument("--framework-api", choices=("G0", "G1", "G2"), help="framework API generation (default G2)")
    p.add_argument("--attn-tp-size", type=int, metavar="N", help="attention tensor-parallel size (e.g. 2)")
    p.add_argument("--backend", choices=("auto", "emulated", "npu"), default="auto", help="validation backend")
    p.add_argument("--out", default="kvcache-out", metavar="DIR",
                   help="directory for manifest.json, rendered/, report.json, report.md (default kvcache-out)")
    p.add_argument("--force", action="store_true", help="overwrite an earlier run in --out")
    p.add_argument("--allow-blocked", action="store_true",
                   help="render and validate even when the manifest lists blockers (Legacy path)")
    return p


def _say(msg: str, t0: float) -> None:
    print(f"[kvcache run {time.perf_counter() - t0:5.1f}s] {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    out = Path(args.out)
    if (out / "manifest.json").exists() and not args.force:
        raise InputError(str(out), "holds an earlier run: pass --force or another --out", field="--out")
    config = args.config or args.model_dir or str(EXAMPLE)
    _say(f"analyze {config}", t0)
    manifest = analyze(AnalyzeRequest(config=config, progress=args.progress, dispatch=args.dispatch,
                                      deploy_mode=args.deploy_mode, framework_api=args.framework_api,
                                      attn_tp_size=args.attn_tp_size))
    rendered = render_manifest(manifest, framework_api=args.framework_api, allow_blocked=args.allow_blocked)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "manifest.json", manifest.to_json())
    write_rendered(rendered, out / "rendered", force=args.force)
    _say(f"rendered {len(rendered.files)} files into {out / 'rendered'}", t0)

    from validators.validate import ValidateRequest, validate

    config_file = str(Path(config) / "config.json") if Path(config).is_dir() else config
    report = validate(ValidateRequest(manifest=str(out / "manifest.json"), rendered=str(out / "rendered"),
                                      config=config_file, backend=args.backend, framework_api=args.framework_api,
                                      attn_tp_size=args.attn_tp_size),
                      progress=lambda m: _say(m, t0))
    atomic_write_text(out / "report.json", report.to_json())
    atomic_write_text(out / "report.md", report.to_markdown())
    print(report.to_markdown())
    _say(f"{'PASSED' if report.passed else 'FAILED'}: report in {out / 'report.md'}", t0)
    return 0 if report.passed else 1


def main(argv: list[str] | None = None) -> int:
    return guarded(run, build_parser().parse_args(argv))
