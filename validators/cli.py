"""`kvcache validate` (and `python -m model_infer_kvcache.validators validate`): thin layer over validators.pipeline.validate."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from model_infer_kvcache.analyzer.cli import add_encoder_length_argument, add_next_n_argument
from model_infer_kvcache.analyzer.cli_paths import PathArg, check_paths, config_file
from model_infer_kvcache.analyzer.deploy_context import EXE_MODES
from model_infer_kvcache.analyzer.device_questions import BACKEND_CHOICES
from model_infer_kvcache.analyzer.errors import InputError, OneLineArgumentParser, guarded
from model_infer_kvcache.analyzer.files import atomic_write_text, check_writable
from model_infer_kvcache.analyzer.framework_checkout import GENERATIONS
from model_infer_kvcache.analyzer.progress_writer import plan_section
from model_infer_kvcache.analyzer.vocabulary import ORACLES
from model_infer_kvcache.validators.pipeline.precision import TOLERANCE
from model_infer_kvcache.validators.pipeline.request_stream import STEP_SECONDS
from model_infer_kvcache.validators.pipeline.runtime_deps import require_validation_deps

# The pipeline (torch, transformers) is imported in run(), after the arguments parse: `--help` and bad flags
# answer in a bare interpreter's time (benchmarks/bench_cli_startup.py).

EXAMPLES = """examples:
  kvcache validate --manifest manifest.json --rendered rendered/ --config config.json
  kvcache validate --framework-root ~/cann-recipes-infer --model qwen3_8b --config Qwen3-8B/config.json
  kvcache validate --framework-root ~/cann-recipes-infer --model qwen3_8b --config config.json --attn-tp-size 2
  kvcache validate --manifest manifest.json --rendered rendered/ --config config.json \\
      --report report.json --markdown report.md
  kvcache validate ... --backend npu --framework-root /path/to/cann-recipes-infer
  kvcache validate --framework-root ~/cann-recipes-infer --all --markdown zoo.md
  kvcache validate --runner-root ~/cann-recipes-infer/models/pangu_7b

exit status: 0 every check passed, 1 a check failed, 2 bad input (one line naming the file or
flag; nothing written), 3 internal error of kvcache itself (rerun with KVCACHE_DEBUG=1).
With --all: 0 no model failed (refused or absent ones are named gaps), 1 some model failed or
hit an internal error.

"""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(
        prog="kvcache validate",
        description="Three-link checks (init/runtime/release) and numeric equivalence against transformers.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--manifest", metavar="FILE",
                   help="manifest the code was rendered from (with --model: the design to hold the model file to; "
                        "without it the checkout's model is analyzed on the fly)")
    p.add_argument("--rendered", metavar="DIR", help="directory written by `kvcache render` (rendered mode)")
    p.add_argument("--model", metavar="NAME",
                   help="checkout mode: validate the checkout's own model NAME (a key of executor/core/"
                        "support_models.py or a directory under models/) in the checkout's engine; needs "
                        "--framework-root")
    p.add_argument("--model-file", metavar="FILE",
                   help="checkout mode: a model file that replaces the registered one (e.g. your edited copy); a "
                        "file named like another module of the model's folder (indexer.py) replaces that module")
    p.add_argument("--config", metavar="FILE", help="the model's config.json (tiny model is built from it); required "
                                                  "but with --all")
    p.add_argument("--all", action="store_true",
                   help="checkout mode: validate every model of --framework-root (each key of executor/core/"
                        "support_models.py and each model folder no key registers), one process each, and print one "
                        "row per model: passed / failed (first failing check, file:line) / refused (what kvcache or "
                        "the inputs lack) / absent; configs from --configs, else transformers' config class of the "
                        "model's type at its defaults")
    p.add_argument("--oracle", choices=ORACLES, default="both",
                   help="checkout mode: what the numeric link compares with: transformers' model on the same weights, "
                        "the recompute oracle (the checkout's own model, every prefix prefilled from scratch: catches "
                        "what the cache does wrong, not an error prefill and decode share), or both (default)")
    p.add_argument("--configs", metavar="DIR", help="with --all: NAME.json files used instead of the defaults")
    p.add_argument("--runner-root", metavar="FOLDER",
                   help="standalone mode: a model folder with a runner of its own (models/pangu_7b: runner_*.py, "
                        "infer.py, config/*.yaml); its runner drives the tiny model on CPU as its entry script does, "
                        "judged by the recompute oracle (no transformers class needed); --config optional (default: "
                        "the folder's config class at its defaults)")
    p.add_argument("--runner-file", metavar="FILE", help="with --runner-root: an edited copy standing in for the "
                                                         "folder's runner_*.py")
    p.add_argument("--yaml", metavar="FILE", help="with --runner-root: the yaml to take the settings from (default: "
                                                  "the folder's eager, unquantized one)")
    p.add_argument("--only", metavar="NAMES", help="with --all: only these models, comma-separated")
    p.add_argument("--backend", choices=BACKEND_CHOICES, default="auto",
                   help="emulated = CPU reference ops; npu = real torch_npu (auto picks npu when present)")
    p.add_argument("--framework-root", metavar="DIR",
                   help="cann-recipes-infer checkout: use its executor.core.kv_cache instead of the harness "
                        "(rendered mode), or run its model and engine (with --model)")
    p.add_argument("--framework-api", choices=GENERATIONS,
                   help="harness generation (default: the manifest's; a G2 manifest runs the HEAD-era G3 "
                        "harness, --framework-api G2 the 48a59dc one)")
    p.add_argument("--attn-tp-size", type=int, metavar="N",
                   help="attention TP ranks to launch (must equal the manifest's attn_tp_size; gloo on CPU); with "
                        "--model and no --manifest: the TP the model is analyzed and run at")
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
    p.add_argument("--uniform-prefill", action="store_true",
                   help="checkout mode: every prompt of the request stream as long as the longest, for a model that "
                        "only supports equal-length prefill batches (its own check says so); the report notes that "
                        "variable-length prefill was not exercised")
    add_next_n_argument(p)
    add_encoder_length_argument(p)
    p.add_argument("--exe-mode", choices=list(EXE_MODES), default="eager",
                   help="checkout mode: the engine's decode mode. npugraph_ex / ge_graph compile decode as the engine "
                        "does (torch.compile, fullgraph; ge_graph static, through torchair's backend) and capture it "
                        "on CPU: graph breaks, host reads, recaptures after warm-up and host-shaped tensors are named "
                        "with their line (rendered mode: the manifest's exe_mode), e.g. --exe-mode ge_graph")
    p.add_argument("--static-graph", action="store_true",
                   help="checkout mode with --exe-mode npugraph_ex: the engine's enable_dynamic_graph False, decode "
                        "compiled static as such a yaml serves it, e.g. --static-graph (with --exe-mode npugraph_ex)")
    p.add_argument("--no-sweep", action="store_true",
                   help="skip re-running under the alternative device readings")
    p.add_argument("--step-timeout", type=_positive_seconds, default=STEP_SECONDS, metavar="SECONDS",
                   help=f"a forward step still running after this long fails the run (default {STEP_SECONDS:g}); "
                        "the number of steps is bounded by the request stream itself")
    return p


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not (value > 0 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _progress(msg: str) -> None:
    print(f"[kvcache validate] {msg}", file=sys.stderr, flush=True)


def _refuse(args: argparse.Namespace, flags: tuple[str, ...], why: str) -> None:
    """Bad input naming the first of ``flags`` the user set: it does not apply in this mode (``why``)."""
    for flag in flags:
        if getattr(args, flag):
            raise InputError(f"--{flag.replace('_', '-')}", why)


def check_mode(args: argparse.Namespace) -> None:
    """Rendered mode needs --manifest and --rendered; checkout mode --model and --framework-root."""
    if args.encoder_length is not None:  # analyze's own check of the value (imported here: --help stays light)
        from model_infer_kvcache.analyzer.config_loader import LIMITS
        from model_infer_kvcache.analyzer.kinds import cross as cross_kind

        cross_kind.check_length(args.encoder_length, LIMITS["positions"])
    if args.static_graph and args.exe_mode != "npugraph_ex":
        raise InputError("--static-graph", "applies with --exe-mode npugraph_ex (an eager decode compiles nothing; "
                                           "ge_graph is always static)")
    if args.exe_mode != "eager" and (args.runner_root or args.all):
        raise InputError("--exe-mode", "applies to one checkout model (--model), not with --runner-root or --all")
    if args.runner_root:
        _refuse(args, ("model", "model_file", "manifest", "rendered", "framework_root", "framework_api", "dtype",
                       "attn_tp_size", "all", "configs", "only", "device_readings", "uniform_prefill", "encoder_length"),
                "does not apply with --runner-root (the folder's own runner, one rank, float32, judged by the "
                "recompute oracle)")
        return
    for flag in ("runner_file", "yaml"):
        if getattr(args, flag):
            raise InputError(f"--{flag.replace('_', '-')}", "applies with --runner-root only")
    if args.oracle != "both" and not (args.model or args.all):
        raise InputError("--oracle", "applies to the checkout mode (--model or --all); the rendered mode compares "
                                     "with transformers")
    if args.all:
        if not args.framework_root:
            raise InputError("--all", "validates every model of a checkout: pass --framework-root CHECKOUT too")
        _refuse(args, ("model", "model_file", "manifest", "rendered", "config", "write_progress", "framework_api",
                       "dtype", "attn_tp_size", "encoder_length"),
                "does not apply with --all (each model is analyzed and run on its own; give configs with --configs DIR)")
        return
    for flag in ("configs", "only"):
        if getattr(args, flag):
            raise InputError(f"--{flag}", "applies with --all only")
    if not args.config:
        raise InputError("--config", "is required (the model's config.json)")
    if args.model:
        if not args.framework_root:
            raise InputError("--model", "validates a checkout's model: pass --framework-root CHECKOUT too")
        for flag in ("rendered", "framework_api", "dtype"):
            if getattr(args, flag):
                raise InputError(f"--{flag.replace('_', '-')}", "applies to the rendered mode, not with --model "
                                 "(the checkout's model runs in float32 in the checkout's own engine)")
        if args.backend == "npu":
            raise InputError("--backend", "the checkout mode runs on CPU (emulated operators); on an NPU run the "
                                          "checkout's own launcher")
        return
    for flag in ("model_file", "uniform_prefill"):
        if getattr(args, flag):
            raise InputError(f"--{flag.replace('_', '-')}", "applies to the checkout mode (--model)")
    if args.exe_mode != "eager":
        raise InputError("--exe-mode", "applies to the checkout mode (--model); a render is validated in its "
                                       "manifest's exe_mode")
    for flag in ("manifest", "rendered"):
        if not getattr(args, flag):
            raise InputError(f"--{flag}", "is required (or validate a checkout's model with --framework-root and "
                                          "--model)")


def _checkout_report(args: argparse.Namespace):
    from model_infer_kvcache.validators.checkout_run import CheckoutRequest, validate_checkout

    return validate_checkout(CheckoutRequest(
        framework_root=args.framework_root, model=args.model, config=args.config, manifest=args.manifest,
        attn_tp_size=args.attn_tp_size, model_file=args.model_file, seed=args.seed,
        sweep_readings=not args.no_sweep, device_readings=args.device_readings, step_seconds=args.step_timeout,
        uniform_prefill=args.uniform_prefill, next_n=args.next_n, oracle=args.oracle, exe_mode=args.exe_mode,
        static_graph=args.static_graph, encoder_length=args.encoder_length,
    ), progress=_progress)


def _check_writable(args: argparse.Namespace, flags: tuple[str, ...]) -> None:
    """Every output is checked before the (long) run, so bad paths cost nothing and write nothing."""
    for flag in flags:
        target = getattr(args, flag)
        if target:
            try:
                check_writable(target)
            except InputError as exc:
                raise InputError(target, exc.message, field=f"--{flag.replace('_', '-')}") from None


def _run_all(args: argparse.Namespace) -> int:
    """--all: one ``kvcache validate --model`` per model of the checkout, a table of the outcomes."""
    _check_writable(args, ("report", "markdown"))
    from model_infer_kvcache.validators.checkout_run.scope import require_checkout
    from model_infer_kvcache.validators.checkout_run.sweep_all import sweep, to_json, to_markdown

    root = require_checkout(args.framework_root)
    extra = (["--no-sweep"] if args.no_sweep else []) + ["--seed", str(args.seed), "--step-timeout",
                                                          str(args.step_timeout)]
    extra += ["--uniform-prefill"] if args.uniform_prefill else []
    extra += ["--device-readings", str(Path(args.device_readings).resolve())] if args.device_readings else []
    extra += ["--next-n", str(args.next_n)] if args.next_n is not None else []
    extra += ["--oracle", args.oracle] if args.oracle != "both" else []
    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else None
    rows = sweep(root, config_dir=Path(args.configs) if args.configs else None, extra=tuple(extra), only=only,
                 say=_progress)
    table = to_markdown(rows, root)
    if args.report:
        atomic_write_text(Path(args.report), to_json(rows))
    if args.markdown:
        atomic_write_text(Path(args.markdown), table)
    print(table)
    return 1 if any(r.outcome in ("failed", "internal") for r in rows) else 0


def _run_runner(args: argparse.Namespace) -> int:
    """--runner-root: a standalone folder's own runner (validators.runner_run)."""
    _check_writable(args, ("report", "markdown", "write_progress"))
    if args.write_progress:
        from model_infer_kvcache.validators.pipeline.report import SECTION_ID

        plan_section(args.write_progress, SECTION_ID, "")  # damaged markers are refused now, not after
    require_validation_deps()
    from model_infer_kvcache.validators.runner_run import RunnerRequest, validate_runner

    report = validate_runner(RunnerRequest(args.runner_root, args.runner_file, config_file(args.config), args.yaml),
                             progress=_progress)
    return _emit(args, report)


def run(args: argparse.Namespace) -> int:
    # Every path named, whatever the mode: an output never replaces any input of the command line.
    check_paths([PathArg("--manifest", args.manifest), PathArg("--rendered", args.rendered, is_dir=True),
                 PathArg("--model-file", args.model_file), PathArg("--config", config_file(args.config)),
                 PathArg("--device-readings", args.device_readings),
                 PathArg("--framework-root", args.framework_root, is_dir=True, whole=False),
                 PathArg("--configs", args.configs, is_dir=True, whole=False),
                 PathArg("--runner-root", args.runner_root, is_dir=True, whole=False),
                 PathArg("--runner-file", args.runner_file), PathArg("--yaml", args.yaml)],
                [PathArg("--report", args.report), PathArg("--markdown", args.markdown),
                 PathArg("--write-progress", args.write_progress)])
    if args.runner_root:
        check_mode(args)
        return _run_runner(args)
    if args.all:
        check_mode(args)
        return _run_all(args)
    check_mode(args)
    _check_writable(args, ("report", "markdown", "write_progress"))
    if args.write_progress:
        from model_infer_kvcache.validators.pipeline.report import SECTION_ID

        plan_section(args.write_progress, SECTION_ID, "")  # damaged markers are refused now, not after
    require_validation_deps()
    from model_infer_kvcache.validators.pipeline.validate import ValidateRequest, validate

    report = _checkout_report(args) if args.model else validate(ValidateRequest(
        manifest=args.manifest, rendered=args.rendered, config=args.config, backend=args.backend,
        framework_root=args.framework_root, seed=args.seed, sweep_readings=not args.no_sweep,
        framework_api=args.framework_api, attn_tp_size=args.attn_tp_size, device_readings=args.device_readings,
        dtype=args.dtype, step_seconds=args.step_timeout, next_n=args.next_n, encoder_length=args.encoder_length,
    ), progress=_progress)
    return _emit(args, report)


def _emit(args: argparse.Namespace, report) -> int:
    """The report where the flags ask for it, the failures on stderr, the exit status."""
    if args.report:
        atomic_write_text(Path(args.report), report.to_json())
    if args.markdown:
        atomic_write_text(Path(args.markdown), report.to_markdown())
    if args.write_progress:
        from model_infer_kvcache.analyzer.progress_writer import write_section
        from model_infer_kvcache.validators.pipeline.report import SECTION_ID

        write_section(args.write_progress, SECTION_ID, report.to_markdown())
    print(report.to_markdown())
    for check in report.failed():
        print(f"FAILED [{check.link}] {check.name}: {check.detail or check.measured}", file=sys.stderr)
    return 0 if report.passed else 1


def main(argv: list[str] | None = None) -> int:
    return guarded(run, build_parser().parse_args(argv))
