"""`kvcache probe` (and `python -m model_infer_kvcache.validators.probe`): measure the open device questions."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from model_infer_kvcache.analyzer.cli_paths import STDOUT, PathArg, check_paths
from model_infer_kvcache.analyzer.device_questions import OP_BACKENDS
from model_infer_kvcache.analyzer.errors import InputError, OneLineArgumentParser, guarded
from model_infer_kvcache.analyzer.files import atomic_write_text

EXAMPLES = """examples:
  kvcache probe --out device_readings.json --markdown device_readings.md   (on an NPU host)
  kvcache probe --device 1 --out device_readings.json
  kvcache probe --backend emulated                                         (dry run on CPU)

Then: kvcache analyze ... --device-readings device_readings.json
      kvcache validate ... --device-readings device_readings.json
Run it once per torch_npu / CANN version and keep the readings file with the checkout.
"""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="kvcache probe", description="Micro-experiments on the FA and cache-writer operators that "
                "settle the open device questions (references/device_questions.md).", epilog=EXAMPLES,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", metavar="FILE",
                   help="write the readings file (JSON) here ('-': stdout), e.g. --out readings.json")
    p.add_argument("--markdown", metavar="FILE",
                   help="write a Markdown report ready to paste into an issue ('-': stdout)")
    p.add_argument("--device", type=int, metavar="N", help="NPU index (default 0)")
    p.add_argument("--backend", choices=OP_BACKENDS, default=OP_BACKENDS[0],
                   help="npu (default): the real torch_npu operators; emulated: a dry run on the CPU emulation")
    return p


def run(args: argparse.Namespace) -> int:
    check_paths([], [PathArg("--out", args.out), PathArg("--markdown", args.markdown)],
                stdout_ok=frozenset({"--out", "--markdown"}))
    for flag in ("out", "markdown"):
        target = getattr(args, flag)
        if target and target != STDOUT and not Path(target).resolve().parent.is_dir():
            raise InputError(target, "directory does not exist", field=f"--{flag}")
    if args.device is not None and args.device < 0:
        raise InputError("--device", f"must be >= 0, got {args.device}")
    from model_infer_kvcache.validators.probe.device import NoDeviceError, open_device
    from model_infer_kvcache.validators.probe.run import markdown, probe, table_text

    try:
        dev = open_device(args.backend, args.device)
    except NoDeviceError as exc:
        raise InputError("--backend npu", f"no NPU here ({exc}); for a dry run on the CPU emulation use "
                                          "`kvcache probe --backend emulated`") from None
    data = probe(dev)
    for target, text in ((args.out, data.to_json), (args.markdown, lambda: markdown(data))):
        if target == STDOUT:
            sys.stdout.write(text())
        elif target:
            atomic_write_text(Path(target), text())
    if STDOUT not in (args.out, args.markdown):  # stdout carries the file asked for, nothing else
        sys.stdout.write(table_text(data))
    return 0


def main(argv: list[str] | None = None) -> int:
    return guarded(run, build_parser().parse_args(argv))
