"""`kvcache lint` / `python -m model_infer_kvcache.validators lint`: static check for silent KV-cache and FA failures."""

from __future__ import annotations

import argparse
import json
import sys

from model_infer_kvcache.analyzer.errors import OneLineArgumentParser, guarded
from model_infer_kvcache.analyzer.operators.schemas import RELEASES
from model_infer_kvcache.validators.lint.deploy_mode import AUTO, CHOICES
from model_infer_kvcache.validators.lint.engine import lint_paths
from model_infer_kvcache.validators.lint.registry import RULES, parse_id_list

EPILOG = "exit status: 0 clean, 1 findings, 2 usage error or a file that cannot be read or parsed,\n" \
         "3 internal error of kvcache itself (rerun with KVCACHE_DEBUG=1 for the traceback).\n" \
         "silence one line with `# kvcache: ignore[KV201]` (or ignore[KV201,KV204]).\n" \
         "rules: `kvcache lint --list-rules`."


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
        prog="kvcache lint",
        description="Find the KV-cache / fused-attention mistakes that raise no error on Ascend "
                    "(wrong FA argument names, missing causal mask, dict block tables, kv_len mutation...).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("paths", nargs="*", metavar="PATH",
                        help="Python files or directories (e.g. models/qwen3/modeling_qwen3.py)")
    parser.add_argument("--manifest", metavar="M",
                        help="selection manifest (JSON or YAML) from `kvcache analyze`: also check the code against it "
                             "(FA version, layout, sparse modes, pre_tokens, block size, scale)")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format (default text)")
    parser.add_argument("--select", metavar="IDS", help="only these rules, comma-separated (e.g. KV101,KV201)")
    parser.add_argument("--ignore", metavar="IDS", help="skip these rules, comma-separated (e.g. KV701)")
    parser.add_argument("--torch-npu", metavar="RELEASE", choices=RELEASES,
                        help="judge operator keywords (KV103) against this torch-npu release's schemas "
                             f"({' or '.join(RELEASES)}); default: the release the file's folder names in its "
                             "README.md / requirements*.txt, else the newest")
    parser.add_argument("--mode", choices=CHOICES, default=AUTO,
                        help="deployment mode of the files: framework (registers with cann-recipes-infer's executor) "
                             "or standalone (a runner of its own owns the cache); default auto: per file, from the "
                             "manifest, the file and its folder. Framework-only rules (KV301/302, KV501, KV701...) "
                             "are silent on standalone files, KV9xx on framework files")
    parser.add_argument("--show-mode", action="store_true",
                        help="print each file's deployment mode and why on stderr")
    parser.add_argument("--list-rules", action="store_true",
                        help="print every rule (ID, name, title; all fields with --format json) and exit")
    return parser


def _list_rules() -> str:
    lines = []
    for rule in RULES.values():
        extra = " [needs --manifest]" if rule.needs_manifest else ""
        extra += f" [{rule.deploy} only]" if rule.deploy else ""
        lines.append(f"{rule.id}  {rule.name:<32} {rule.title}{extra}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return guarded(_main, argv)


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    try:
        return _run(parser, parser.parse_args(argv))
    except SystemExit as exc:  # usage errors (one line, exit 2) and --help (0) return their code
        return int(exc.code or 0)


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.list_rules:
        if args.format == "json":
            rows = [{"id": r.id, "name": r.name, "title": r.title, "message": r.message, "hint": r.hint,
                     "severity": r.severity, "needs_manifest": r.needs_manifest, "deploy": r.deploy}
                    for r in RULES.values()]
            sys.stdout.write(json.dumps(rows, indent=2, ensure_ascii=False) + "\n")
        else:
            sys.stdout.write(_list_rules())
        return 0
    if not args.paths:
        parser.error("give at least one PATH")
    for flag, value in (("--select", args.select), ("--ignore", args.ignore)):
        try:
            parse_id_list(value)
        except ValueError as exc:
            parser.error(f"{flag}: {exc}")
    report = lint_paths(args.paths, manifest=args.manifest, select=args.select, ignore=args.ignore,
                        torch_npu=args.torch_npu, mode=args.mode)
    if args.format == "json":
        sys.stdout.write(report.to_json())
    else:
        for finding in report.findings:
            sys.stdout.write(finding.to_text() + "\n")
    if args.show_mode:
        for path, decision in report.modes.items():
            sys.stderr.write(f"{path}: mode {decision.mode} ({decision.reason})\n")
    for error in report.errors:
        sys.stderr.write(f"error: {error.to_text()}\n")
    if args.format == "text" and not report.findings and not report.errors:
        sys.stderr.write(f"kvcache lint: {len(report.files)} file(s) clean\n")
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
