"""`kvcache analyze` / `kvcache schema`: a thin layer over analyzer.build."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from model_infer_kvcache.analyzer.cli_paths import STDOUT, PathArg, check_paths, config_file
from model_infer_kvcache.analyzer.deploy_context import EXE_MODES
from model_infer_kvcache.analyzer.device_questions import QUESTIONS
from model_infer_kvcache.analyzer.errors import InputError, OneLineArgumentParser, guarded
from model_infer_kvcache.analyzer.files import atomic_write_text, check_writable, not_a_file, read_input_text
from model_infer_kvcache.analyzer.framework_checkout import RENDER_APIS
from model_infer_kvcache.analyzer.operators.fa_facts import VALID_BLOCK_SIZES
from model_infer_kvcache.analyzer.vocabulary import DEPLOY_MODES, FA_VERSIONS, KV_MODES, PLANNED_CACHE_DTYPES

# The manifest models (pydantic) and the analyzer are imported where a command runs, not for --help.

_FILE_LINE = re.compile(r":\d+$")

EXAMPLES = """examples:
  kvcache analyze --config examples/tiny_qwen3/config.json --dispatch "部署模式：框架部署"
  kvcache analyze --model-dir /models/Qwen3-8B --progress progress.md --attn-tp-size 4 --format md
  kvcache analyze --config config.json --hbm-gb 64 --max-concurrency 32 --max-len 8192 --out manifest.json
  kvcache analyze --config config.json --progress progress.md --write-progress progress.md
  kvcache analyze --config config.json --framework-root ~/cann-recipes-infer --dispatch-file dispatch.txt
  kvcache analyze --config config.json --device-readings device_readings.json   (from `kvcache probe`)
  kvcache analyze --config trocr/config.json --encoder-length 577   (a decoder over an encoder no field sizes)

Bad input (missing/invalid file, missing or non-positive sizes, heads not divisible by
--attn-tp-size, unknown 部署模式 wording, progress.md contradicting the dispatch, bad
--block-size, non-finite --hbm-gb / --kv-mem-ratio, an --encoder-length below what the config gives
or on a decoder-only config, an unwritable --out, an --out whose .json/.yaml/.md suffix names
another --format) prints one line `error: <file or flag>: <field>: <why>` and exits 2; nothing is
written then. A memory plan that cannot serve the request is a `warning:` line (and in the
manifest's warnings), exit 0. Exit 3 is an internal error of kvcache itself (rerun with
KVCACHE_DEBUG=1 for the traceback).
"""


def _dtype_name(text: str) -> str:
    """--cache-dtype's short spellings (one function, so analyze and run share the flag's definition)."""
    return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(text, text)


def add_analyze_arguments(p: argparse.ArgumentParser, source_required: bool = True) -> None:
    """The analyze flags; `kvcache run` reuses them (its config source defaults to the bundled example)."""
    src = p.add_mutually_exclusive_group(required=source_required)
    src.add_argument("--config", metavar="FILE", help="Hugging Face config.json (e.g. --config Qwen3-8B/config.json)")
    src.add_argument("--model-dir", metavar="DIR", help="model directory holding config.json (e.g. --model-dir /models/Qwen3-8B)")
    p.add_argument("--progress", metavar="FILE",
                   help="progress.md of the migration (部署模式, 部署卡数, attn TP, NPU 型号, 单卡 HBM, starting "
                        "point), e.g. --progress models/qwen3/progress.md")
    d = p.add_mutually_exclusive_group()
    d.add_argument("--dispatch", metavar="TEXT",
                   help='dispatch prompt text; its 部署模式 line wins over every other source, '
                        'e.g. --dispatch "部署模式: 框架部署"')
    d.add_argument("--dispatch-file", metavar="FILE",
                   help="file holding the dispatch prompt, e.g. --dispatch-file dispatch.txt")
    p.add_argument("--deploy-mode", choices=DEPLOY_MODES,
                   help="deployment mode stated by the user (loses to the dispatch line), "
                        "e.g. --deploy-mode standalone")
    p.add_argument("--framework-root", metavar="DIR",
                   help="cann-recipes-infer checkout: detects the cache_info API generation (G0/G1/G2/G3), "
                        "support_models registration and runner_*.py, e.g. --framework-root ~/cann-recipes-infer")
    p.add_argument("--framework-api", choices=RENDER_APIS,
                   help="framework API generation when no checkout is at hand (e.g. --framework-api G1)")
    p.add_argument("--attn-tp-size", type=int, metavar="N", help="attention tensor-parallel size; must divide the query heads (e.g. --attn-tp-size 8)")
    p.add_argument("--block-size", type=int, default=128, metavar="N",
                   help=f"paged block size, one of {VALID_BLOCK_SIZES} (default 128), e.g. --block-size 256")
    p.add_argument("--hbm-gb", type=float, metavar="X",
                   help="HBM (GiB) available to the KV cache on one card, e.g. --hbm-gb 40")
    p.add_argument("--kv-mem-ratio", type=float, metavar="R",
                   help="fraction of --hbm-gb the KV cache may use, in (0, 1] (default 0.9 when --hbm-gb is given), "
                        "e.g. --kv-mem-ratio 0.8")
    p.add_argument("--max-concurrency", type=int, metavar="N", help="concurrent requests (batch per DP rank), e.g. --max-concurrency 32")
    p.add_argument("--max-len", type=int, metavar="N", help="max sequence length per request, e.g. --max-len 8192")
    p.add_argument("--kv-mode", choices=KV_MODES,
                   help="keep Legacy on purpose (offline only), e.g. --kv-mode legacy; a blocker forces Legacy anyway")
    p.add_argument("--fa-version", choices=FA_VERSIONS, help="override the FA version default (sinks force v2), e.g. --fa-version v2")
    p.add_argument("--window-reading", choices=QUESTIONS["window_pre_tokens"].readings,
                   help="device reading of pre_tokens for sliding windows: 'exclusive' = "
                        "pre_tokens counts keys before the query (default), 'inclusive' = counts the query too; "
                        "e.g. --window-reading inclusive")
    p.add_argument("--device-readings", metavar="FILE",
                   help="readings file written by `kvcache probe` on the NPU host: the design follows the measured "
                        "readings and the manifest records them, e.g. --device-readings device_readings.json")
    p.add_argument("--cache-dtype", choices=PLANNED_CACHE_DTYPES, metavar="DTYPE",
                   type=_dtype_name,
                   help="plan the cache (entries, memory) in this dtype instead of the config's torch_dtype: "
                        "bfloat16|float16|float32 (or bf16|fp16|fp32), e.g. --cache-dtype bf16 for a float32 config")
    add_encoder_length_argument(p)
    add_next_n_argument(p)
    p.add_argument("--exe-mode", choices=EXE_MODES,
                   help="the framework's execution mode for decode (the yaml's model_config.exe_mode; else "
                        "progress.md's exe_mode, else eager): planned with their consequences; npugraph_ex and ge_graph "
                        "are rendered for GQA/MHA and MLA and their decode captured by validate, "
                        "e.g. --exe-mode npugraph_ex")
    p.add_argument("--static-graph", action="store_true",
                   help="the yaml's model_config.enable_dynamic_graph is False (else progress.md's "
                        "enable_dynamic_graph, else the framework's default True): npugraph_ex then compiles decode "
                        "static, which bakes host-list FA lengths into the capture, e.g. --static-graph (with "
                        "--exe-mode npugraph_ex)")


def add_next_n_argument(p: argparse.ArgumentParser) -> None:
    """The one MTP switch of every command that plans (analyze, run, validate's on-the-fly analysis)."""
    p.add_argument("--next-n", type=int, metavar="N",
                   help="speculative tokens per decode step the deployment runs (the framework's next_n): 0 turns "
                        "speculative decoding off and leaves the config's MTP layers unused (in a checkout run the "
                        "model is built without them); more than the config's MTP layers: the MTP worker runs them "
                        "next_n times (upstream deepseek yamls: next_n 3, one MTP layer); default: the config's MTP "
                        "layer count, e.g. --next-n 0, --next-n 3")


def add_encoder_length_argument(p: argparse.ArgumentParser) -> None:
    """The one encoder-length flag of every command that plans (analyze, run) or checks a plan (validate)."""
    p.add_argument("--encoder-length", type=int, metavar="N",
                   help="the longest encoder output a request brings (positions its decoder's cross-attention reads: "
                        "a ViT encoder's patches + 1, a text encoder's longest prompt in tokens), where the config "
                        "gives none (TrOCR, MusicGen): sizes the cross-attention slot; the manifest records it as "
                        "user input; beside a manifest (validate) it must be the manifest's, e.g. --encoder-length 577")


def add_output_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=("json", "yaml", "md"), default="json",
                   help="json (default) or yaml manifest, or md decisions table (e.g. --format md)")
    p.add_argument("--out", metavar="FILE",
                   help="write the result here (atomically) instead of stdout ('-': stdout), e.g. --out manifest.json; "
                        "never one of the inputs")
    p.add_argument("--write-progress", metavar="FILE",
                   help="upsert the decisions table into this progress.md between kvcache markers (idempotent, "
                        "atomic, other bytes untouched), e.g. --write-progress progress.md")


def build_parser(prog: str = "kvcache analyze") -> argparse.ArgumentParser:
    p = OneLineArgumentParser(
        prog=prog,
        description="Decide the KV-cache design of a model: a typed, explained selection manifest.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_analyze_arguments(p)
    add_output_arguments(p)
    return p


def request_from_args(args: argparse.Namespace):
    from model_infer_kvcache.analyzer.build import AnalyzeRequest

    dispatch, dispatch_source = args.dispatch, "--dispatch"
    if args.dispatch_file:
        path = Path(args.dispatch_file)
        problem = not_a_file(path)
        if problem:
            raise InputError(str(path), problem, field="--dispatch-file")
        dispatch = read_input_text(path)
        dispatch_source = str(path)
    return AnalyzeRequest(
        config=args.config or args.model_dir,
        progress=args.progress,
        dispatch=dispatch,
        dispatch_source=dispatch_source,
        deploy_mode=args.deploy_mode,
        framework_root=args.framework_root,
        framework_api=args.framework_api,
        attn_tp_size=args.attn_tp_size,
        block_size=args.block_size,
        hbm_gb=args.hbm_gb,
        kv_mem_ratio=args.kv_mem_ratio,
        max_concurrency=args.max_concurrency,
        max_len=args.max_len,
        fa_version=args.fa_version,
        kv_mode=args.kv_mode,
        window_reading=args.window_reading,
        device_readings=args.device_readings,
        cache_dtype=args.cache_dtype,
        next_n=args.next_n,
        exe_mode=args.exe_mode,
        static_graph=args.static_graph,
        encoder_length=args.encoder_length,
    )


def input_paths(args: argparse.Namespace) -> list[PathArg]:
    """The files and folders an analyze call reads (`kvcache run` shares them)."""
    return [
        PathArg("--config", config_file(args.config)),
        PathArg("--model-dir", config_file(args.model_dir)),
        PathArg("--progress", args.progress),
        PathArg("--dispatch-file", args.dispatch_file),
        PathArg("--device-readings", args.device_readings),
        PathArg("--framework-root", args.framework_root, is_dir=True, whole=False),
    ]


def format_manifest(manifest, fmt: str) -> str:
    from model_infer_kvcache.analyzer.decisions_table import decisions_markdown

    if fmt == "md":
        return decisions_markdown(manifest)
    if fmt == "yaml":
        import yaml

        return yaml.safe_dump(manifest.model_dump(mode="json"), allow_unicode=True, sort_keys=False)
    return manifest.to_json()


def write_output(text: str, out: str | None) -> None:
    if out is None or out == STDOUT:
        sys.stdout.write(text)
        return
    atomic_write_text(Path(out), text)


# What an --out name's suffix promises; a name without one of these may hold any format.
_FORMAT_OF_SUFFIX = {".json": "json", ".yaml": "yaml", ".yml": "yaml", ".md": "md"}


def check_out_format(out: str | None, fmt: str) -> None:
    """Refuse an --out whose suffix names another format than --format: `--format md --out manifest.json`
    would write a Markdown table that every reader of manifest.json then refuses (or worse, a user trusts)."""
    if not out or out == STDOUT:
        return
    suffix = Path(out).suffix.lower()
    named = _FORMAT_OF_SUFFIX.get(suffix)
    if named is not None and named != fmt:
        raise InputError(out, f"a {suffix} file but --format is {fmt}: pass --format {named} or name the file "
                              f"*.{fmt}", field="--out")


def run(args: argparse.Namespace) -> int:
    # Everything that can fail on input runs before the first byte is written.
    check_paths(input_paths(args), [PathArg("--out", args.out), PathArg("--write-progress", args.write_progress)],
                same_ok=frozenset({("--progress", "--write-progress")}), stdout_ok=frozenset({"--out"}))
    check_out_format(args.out, args.format)  # after: an --out that would replace an input says so first
    from model_infer_kvcache.analyzer.build import analyze, analyze_into_progress
    from model_infer_kvcache.analyzer.decisions_table import SECTION_ID, decisions_markdown

    progress_update = None
    if args.write_progress:
        manifest, old, new = analyze_into_progress(request_from_args(args), args.write_progress, SECTION_ID,
                                                   decisions_markdown)
        check_writable(args.write_progress)
        progress_update = None if new == old else new
    else:
        manifest = analyze(request_from_args(args))
    text = format_manifest(manifest, args.format)
    if args.out and args.out != STDOUT:
        check_writable(args.out)
    if progress_update is not None:
        atomic_write_text(args.write_progress, progress_update)
    write_output(text, args.out)
    print_warnings(manifest)
    return 0


def print_warnings(manifest) -> None:
    """The manifest's warnings, one stderr line each: a plan that cannot serve must not pass unseen. So are
    the open questions about what the user's own files say (a fact stated both ways at file:line): the
    value used instead must not hide inside the manifest."""
    for w in manifest.warnings:
        print(f"warning: {' '.join(w.message.split())}", file=sys.stderr)
    for q in manifest.open_questions:
        if any(_FILE_LINE.search(f) for f in q.fields):
            print(f"open question: {' '.join(q.message.split())}", file=sys.stderr)


def schema_main(argv: list[str] | None = None) -> int:
    p = OneLineArgumentParser(prog="kvcache schema", description="Print the SelectionManifest JSON Schema.",
                                epilog="example:\n  kvcache schema > manifest.schema.json\n\n"
                                       "exit status: 0 ok, 2 bad input (e.g. an unwritable --out; nothing "
                                       "written), 3 internal error",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", metavar="FILE", help="write here instead of stdout ('-': stdout)")
    args = p.parse_args(argv)
    check_paths([], [PathArg("--out", args.out)], stdout_ok=frozenset({"--out"}))
    from model_infer_kvcache.analyzer.manifest import manifest_json_schema

    write_output(json.dumps(manifest_json_schema(), indent=2, ensure_ascii=False) + "\n", args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return guarded(run, args)
