"""`python -m model_infer_kvcache.validators <command>`: the validators' commands without the `kvcache` entry point."""

from __future__ import annotations

import sys

from model_infer_kvcache.analyzer.errors import dispatch

USAGE = """usage: python -m model_infer_kvcache.validators <command> [options]

commands:
  lint      static check of modeling/runner files for silent KV-cache / FA failure patterns (= kvcache lint)
  validate  three-link checks + numeric equivalence against transformers (= kvcache validate)
  probe     measure the open device questions on an NPU host -> readings file (= kvcache probe)

Run `python -m model_infer_kvcache.validators <command> --help` for the options of each command.
Exit status as for `kvcache`: 0 ok, 1 checks failed, 2 bad input (one stderr line), 3 internal error.
"""


def _commands():
    # Imported lazily: `validate` pulls in torch and the harness, `lint` must not pay for it.
    def lint(argv):
        from model_infer_kvcache.validators.lint.cli import main

        return main(argv)

    def validate(argv):
        from model_infer_kvcache.validators.cli import main

        return main(argv)

    def probe(argv):
        from model_infer_kvcache.validators.probe.cli import main

        return main(argv)

    return {"lint": lint, "validate": validate, "probe": probe}


def main(argv: list[str] | None = None) -> int:
    return dispatch("python -m model_infer_kvcache.validators", _commands(), USAGE, list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
