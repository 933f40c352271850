"""`kvcache render`: manifest -> KV-cache code (thin layer over implementer.render)."""

from __future__ import annotations

import argparse
import sys

from model_infer_kvcache.analyzer.cli_paths import PathArg, check_nonempty, check_paths
from model_infer_kvcache.analyzer.errors import InputError, OneLineArgumentParser, guarded
from model_infer_kvcache.analyzer.files import check_out_dir
from model_infer_kvcache.analyzer.framework_checkout import RENDER_APIS
from model_infer_kvcache.implementer.names import Names

# The manifest models (pydantic) and the templates are imported where the command runs, not for --help.

EXAMPLES = """examples:
  kvcache render --manifest manifest.json --out rendered/
  kvcache render --manifest manifest.json --out rendered/ --attention-class Qwen3KVCacheMixin --force
  kvcache render --manifest manifest.json --out rendered/ --framework-api G1

exit status: 0 rendered, 2 bad input (one line naming the file or flag; nothing written),
3 internal error of kvcache itself (rerun with KVCACHE_DEBUG=1 for the traceback).
"""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(
        prog="kvcache render",
        description="Render framework-mode or standalone-mode KV-cache code from a selection manifest.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--manifest", required=True, metavar="FILE", help="manifest from `kvcache analyze` (JSON or YAML)")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (created if missing)")
    p.add_argument("--force", action="store_true", help="overwrite files that already exist in --out")
    p.add_argument("--attention-class", default=Names.attention_mixin, metavar="NAME",
                   help=f"name of the attention mixin class (default {Names.attention_mixin})")
    p.add_argument("--model-class", default=Names.model_mixin, metavar="NAME",
                   help=f"name of the CausalLM mixin class with get_cache_info (default {Names.model_mixin})")
    p.add_argument("--runner-class", default=Names.runner_mixin, metavar="NAME",
                   help=f"name of the standalone runner mixin (default {Names.runner_mixin})")
    p.add_argument("--attn-attr", default=Names.attn_attr, metavar="NAME",
                   help=f"attribute of a decoder layer holding its attention (default {Names.attn_attr})")
    p.add_argument("--framework-api", choices=RENDER_APIS,
                   help="framework API generation when the manifest names none or names one with the same render "
                        "contract (default: the G2 contract, which G2 and G3 frameworks take; G3 renders the G2 code)")
    p.add_argument("--allow-blocked", action="store_true",
                   help="render even when the manifest lists blockers (Legacy path)")
    return p


def run(args: argparse.Namespace) -> int:
    from model_infer_kvcache.analyzer.manifest_io import load_manifest
    from model_infer_kvcache.implementer.render import render_manifest, write_rendered

    check_nonempty([PathArg("--manifest", args.manifest), PathArg("--out", args.out)])
    manifest = load_manifest(args.manifest)
    names = Names(args.attention_class, args.model_class, args.runner_class, args.attn_attr)
    rendered = render_manifest(manifest, names, args.framework_api, args.allow_blocked)
    # The files it writes are known now: a manifest kept beside them in --out is not among them.
    check_paths([PathArg("--manifest", args.manifest)],
                [PathArg("--out", args.out, is_dir=True, entries=tuple(rendered.files))])
    check_out_dir(args.out)
    try:
        written = write_rendered(rendered, args.out, args.force)  # all files or none
    except OSError as exc:
        raise InputError(args.out, f"cannot write: {exc}", field="--out") from None
    for path in written:
        print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    return guarded(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
