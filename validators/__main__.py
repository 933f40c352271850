"""`python -m validators lint ...` runs the static linter; other commands go to `validators.cli`."""

from __future__ import annotations

import importlib
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "lint":
        from validators.lint.cli import main as lint_main

        return lint_main(argv[1:])
    try:
        # Imported lazily: `validate` pulls in torch and the harness, `lint` must not pay for it.
        cli = importlib.import_module("validators.cli")
    except ModuleNotFoundError as exc:
        if exc.name != "validators.cli":
            raise
        sys.stderr.write("python -m validators: only `lint` is available in this checkout "
                         "(validators.cli, which provides `validate`, is not installed yet)\n"
                         "usage: python -m validators lint PATH... [--manifest M] [--format text|json]\n")
        return 2
    return cli.main(argv) or 0


if __name__ == "__main__":
    sys.exit(main())
