"""`kvcache`: one entry point routing to the bundle's commands (each also runs as `python -m <package>`)."""

from __future__ import annotations

import sys

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
"""


def _commands():
    # Imported lazily so `kvcache analyze` never pays for torch-heavy validators.
    def analyze(argv):
        from analyzer.cli import main

        return main(argv)

    def schema(argv):
        from analyzer.cli import guarded, schema_main

        return guarded(schema_main, argv)

    def render(argv):
        from implementer.cli import main

        return main(argv)

    def lint(argv):
        from validators.lint.cli import main

        return main(argv)

    def validate(argv):
        from validators.cli import main

        return main(argv)

    def run(argv):
        from validators.run_all import main

        return main(argv)

    def probe(argv):
        from validators.probe.cli import main

        return main(argv)

    return {"analyze": analyze, "schema": schema, "render": render, "lint": lint, "validate": validate, "run": run,
            "probe": probe}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = _commands()
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(USAGE)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in commands:
        sys.stderr.write(f"error: unknown command {name!r}\n{USAGE}")
        return 2
    return commands[name](rest) or 0


if __name__ == "__main__":
    sys.exit(main())
