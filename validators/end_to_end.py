"""`kvcache run`: analyze -> render -> validate in one command (default: the bundled example)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from model_infer_kvcache.analyzer.cli import (
    add_analyze_arguments,
    input_paths,
    print_warnings,
    request_from_args,
)
from model_infer_kvcache.analyzer.cli_paths import PathArg, check_paths
from model_infer_kvcache.analyzer.device_questions import BACKEND_CHOICES
from model_infer_kvcache.analyzer.errors import InputError, OneLineArgumentParser, guarded
from model_infer_kvcache.analyzer.files import (
    atomic_write_text,
    check_out_dir,
    exclusive_output,
    signals_held,
    umask,
)
from model_infer_kvcache.implementer.header import is_generated
from model_infer_kvcache.validators.pipeline.runtime_deps import require_validation_deps

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiny_qwen3" / "config.json"
EXAMPLES = """examples:
  kvcache run                                   # the bundled tiny Qwen3 example, results in ./kvcache-out
  kvcache run --config Qwen3-8B/config.json --dispatch "部署模式: 框架部署" --out out/
  kvcache run --model-dir /models/gpt-oss-20b --deploy-mode standalone --out out/
  kvcache run --config Qwen3-8B/config.json --framework-root ~/cann-recipes-infer --model qwen3_8b --out out/
                                                # validate the checkout's model file against the analysis

--out: everything is built in a temporary folder beside --out and moved into place only when the
run completes (checks passed or failed), so a run that stops early leaves --out as it was. An
--out that is missing, empty, or holds only an earlier run's output (manifest.json, rendered/,
report.json, report.md) is replaced; one holding anything else is refused unless --force.

exit status: 0 every check passed, 1 a check failed (report written), 2 bad input (one line naming
the file or flag; nothing written), 3 internal error of kvcache itself (nothing written; rerun with
KVCACHE_DEBUG=1 for the traceback).
"""
# What one run writes into --out; a folder holding only these (generated) entries is ours to replace.
RUN_ENTRIES = ("manifest.json", "rendered", "report.json", "report.md")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="kvcache run", description="analyze -> render -> validate in one go.",
                              epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Every analyze flag, from analyze's own definitions; without --config/--model-dir: the bundled example.
    add_analyze_arguments(p, source_required=False)
    p.add_argument("--backend", choices=BACKEND_CHOICES, default="auto", help="validation backend")
    p.add_argument("--out", default="kvcache-out", metavar="DIR",
                   help="directory for manifest.json, rendered/, report.json, report.md (default kvcache-out); "
                        "an earlier run's output there is replaced, other content is refused (see --force)")
    p.add_argument("--force", action="store_true",
                   help="use an --out that holds other files too: replace only manifest.json, rendered/, "
                        "report.json and report.md there, keep the rest")
    p.add_argument("--allow-blocked", action="store_true",
                   help="render and validate even when the manifest lists blockers (Legacy path)")
    p.add_argument("--model", metavar="NAME",
                   help="with --framework-root: validate the checkout's model NAME (support_models key or models/ "
                        "directory) in the checkout's engine against this run's manifest, instead of the render")
    p.add_argument("--model-file", metavar="FILE",
                   help="with --model: a model file replacing the registered one (e.g. your edited copy)")
    return p


def _say(msg: str, t0: float) -> None:
    print(f"[kvcache run {time.perf_counter() - t0:5.1f}s] {msg}", file=sys.stderr, flush=True)


def _generated(path: Path) -> bool:
    try:
        with path.open("r", encoding="utf-8") as fh:
            return is_generated(fh.readline())
    except (OSError, UnicodeDecodeError):
        return False


def foreign_entry(out: Path) -> str | None:
    """The first thing in ``out`` that an earlier `kvcache run` did not write, or None.

    Ours: the RUN_ENTRIES, rendered/ holding only files with the generated header (and the
    __pycache__ that importing them during validation leaves).
    """
    if not out.exists():
        return None
    if out.is_symlink():
        return f"{out} is a symbolic link"
    if not out.is_dir():
        return f"{out} is not a directory"
    for entry in sorted(out.iterdir()):
        if entry.name not in RUN_ENTRIES or entry.is_symlink():
            return f"{entry} was not written by kvcache run"
        if entry.name == "rendered":
            if not entry.is_dir():
                return f"{entry} is not a directory"
            for f in sorted(entry.rglob("*")):
                if f.is_symlink() or (f.is_file() and not (f.parent.name == "__pycache__" and f.suffix == ".pyc")
                                      and not _generated(f)):
                    return f"{f} was not written by kvcache render"
        elif not entry.is_file():
            return f"{entry} is not a file"
    return None


def _publish(staging: Path, out: Path) -> None:
    """Move a finished run from ``staging`` into ``out``, entry by entry (other content is kept)."""
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging, out)
        return
    for name in RUN_ENTRIES:
        old, new = out / name, staging / name
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        elif old.exists() or old.is_symlink():
            old.unlink()
        if new.exists():
            os.replace(new, old)
    shutil.rmtree(staging)


def _staging_dir(out: Path) -> Path:
    """A fresh folder on the same file system as ``out`` (its nearest existing ancestor)."""
    base = out.absolute().parent
    while not base.exists():
        base = base.parent
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.kvcache-run.", dir=base))
    os.chmod(staging, 0o777 & ~umask())  # mkdtemp's 0700 would become --out's mode on the move
    return staging


def relocate_paths(report, staging: Path, out: Path) -> None:
    """Every path under ``staging`` the report names (the code under test, notes, details) rewritten to where
    ``_publish`` moves it, in place: a report must not point at a folder that is gone once the run is over."""
    moves = [(str(staging.resolve()), str(out.resolve())), (str(staging), str(out.resolve()))]

    def fix(value):
        if isinstance(value, str):
            for old, new in moves:
                value = value.replace(old, new)
            return value
        if isinstance(value, list):
            return [fix(v) for v in value]
        if isinstance(value, tuple):
            return tuple(fix(v) for v in value)
        if isinstance(value, dict):
            return {k: fix(v) for k, v in value.items()}
        return value

    report.notes, report.provenance, report.localisation = fix(report.notes), fix(report.provenance), \
        fix(report.localisation)
    for check in report.checks:
        check.detail, check.measured = fix(check.detail), fix(check.measured)


def run(args: argparse.Namespace) -> int:
    check_paths([*input_paths(args), PathArg("--model-file", args.model_file)],
                [PathArg("--out", args.out, is_dir=True, entries=RUN_ENTRIES)])
    with exclusive_output(args.out, "--out"):  # a second run into the same --out is refused, not raced
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    # Everything that can fail on input is checked before the first byte is written.
    out = Path(args.out)
    foreign = foreign_entry(out)
    if foreign and not (args.force and out.is_dir()):
        raise InputError(str(out), f"{foreign}: kvcache run replaces only an earlier run's own output; "
                                   "choose another --out, or pass --force to write beside the other files",
                         field="--out")
    check_out_dir(out)
    if args.model and not args.framework_root:
        raise InputError("--model", "validates a checkout's model: pass --framework-root CHECKOUT too")
    if args.model_file and not args.model:
        raise InputError("--model-file", "applies with --model")
    require_validation_deps()
    # Imported here, not at module level: `kvcache run --help` stays free of pydantic and torch.
    from model_infer_kvcache.analyzer.build import analyze
    from model_infer_kvcache.implementer.render import render_manifest, write_rendered
    from model_infer_kvcache.validators.pipeline.validate import ValidateRequest, resolve_backend, validate

    resolve_backend(args.backend)
    request = request_from_args(args)
    config = request.config or str(EXAMPLE)
    manifest = analyze(replace(request, config=config))
    # The manifest is this run's own: a render refusal names the config the user gave, not a --manifest flag.
    rendered = render_manifest(manifest, framework_api=args.framework_api, allow_blocked=args.allow_blocked,
                               source=config)
    # Bad input ends above with one stderr line; progress lines start once the run is under way.
    _say(f"analyzed {config}: {manifest.kv_mode.value}, {manifest.deploy_mode.value} mode", t0)
    print_warnings(manifest)
    staging = None
    try:
        with signals_held():  # created and named in one step: a signal in between would leave the folder behind
            staging = _staging_dir(out)
        atomic_write_text(staging / "manifest.json", manifest.to_json())
        write_rendered(rendered, staging / "rendered")
        _say(f"rendered {len(rendered.files)} files", t0)
        config_file = str(Path(config) / "config.json") if Path(config).is_dir() else config
        if args.model:
            from model_infer_kvcache.validators.checkout_run import CheckoutRequest, validate_checkout

            report = validate_checkout(CheckoutRequest(
                framework_root=args.framework_root, model=args.model, config=config_file,
                manifest=str(staging / "manifest.json"), attn_tp_size=args.attn_tp_size, model_file=args.model_file,
                device_readings=args.device_readings), progress=lambda m: _say(m, t0))
        else:
            report = validate(ValidateRequest(manifest=str(staging / "manifest.json"),
                                              rendered=str(staging / "rendered"), config=config_file,
                                              backend=args.backend, framework_root=args.framework_root,
                                              framework_api=args.framework_api, attn_tp_size=args.attn_tp_size,
                                              device_readings=args.device_readings),
                              progress=lambda m: _say(m, t0))
        relocate_paths(report, staging, out)  # the report names where its files are once published
        atomic_write_text(staging / "report.json", report.to_json())
        atomic_write_text(staging / "report.md", report.to_markdown())
        with signals_held():  # a SIGTERM/SIGINT mid-move would leave --out half old, half new
            _publish(staging, out)
    except BaseException:
        if staging is not None:
            with signals_held():  # a second signal must not cut the cleanup short either
                shutil.rmtree(staging, ignore_errors=True)  # a run that stops early leaves --out as it was
        raise
    print(report.to_markdown())
    _say(f"{'PASSED' if report.passed else 'FAILED'}: report in {out / 'report.md'}", t0)
    return 0 if report.passed else 1


def main(argv: list[str] | None = None) -> int:
    return guarded(run, build_parser().parse_args(argv))
