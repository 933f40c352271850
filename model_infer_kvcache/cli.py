"""`kvcache`: one entry point routing to the bundle's commands (each also runs as `python -m <package>`)."""

from __future__ import annotations

import sys

from model_infer_kvcache.analyzer.errors import dispatch, guarded

USAGE = """usage: kvcache <command> [options]

commands:
  analyze   config.json + progress.md + dispatch prompt -> selection manifest (JSON/YAML/Markdown)
  schema    print the selection manifest's JSON Schema
  render    manifest -> framework-mode or standalone-mode KV-cache code (Jinja templates)
  lint      static check of modeling/runner files for silent KV-cache / FA failure patterns
  validate  three-link checks + numeric equivalence against transformers (emulated ops or NPU)
  run       analyze -> render -> validate in one go (default: the bundled example)
  probe     measure the open device questions on an NPU host -> readings file (--backend emulated: dry run)

Run `kvcache <command> --help` for the options of each command.

exit status (every command): 0 ok, 1 checks failed (lint findings, failed validation),
2 bad input or an OS error (one stderr line naming the file, flag or JSON path; nothing written),
3 internal error of kvcache itself (a bug: one stderr line; rerun with KVCACHE_DEBUG=1 for the
traceback), 130 / 143 interrupted by SIGINT / SIGTERM (nothing half-written left behind).
An output path never names an input or another output of the same call; '-' is stdout where
a command offers it.
"""


def _commands():
    # Imported lazily so `kvcache analyze` never pays for torch-heavy validators.
    def analyze(argv):
        from model_infer_kvcache.analyzer.cli import main

        return main(argv)

    def schema(argv):
        from model_infer_kvcache.analyzer.cli import schema_main

        return guarded(schema_main, argv)

    def render(argv):
        from model_infer_kvcache.implementer.cli import main

        return main(argv)

    def lint(argv):
        from model_infer_kvcache.validators.lint.cli import main

        return main(argv)

    def validate(argv):
        from model_infer_kvcache.validators.cli import main

        return main(argv)

    def run(argv):
        from model_infer_kvcache.validators.end_to_end import main

        return main(argv)

    def probe(argv):
        from model_infer_kvcache.validators.probe.cli import main

        return main(argv)

    return {"analyze": analyze, "schema": schema, "render": render, "lint": lint, "validate": validate, "run": run,
            "probe": probe}


def main(argv: list[str] | None = None) -> int:
    return dispatch("kvcache", _commands(), USAGE, list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
