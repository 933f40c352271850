"""`python -m validators lint ...` runs the static linter; other commands go to `validators.cli`."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "lint":
        from validators.lint.cli import main as lint_main

        return lint_main(argv[1:])
    # Imported lazily: `validate` pulls in torch and the harness, `lint` must not pay for it.
    from validators.cli import main as cli_main

    return cli_main(argv) or 0


if __name__ == "__main__":
    sys.exit(main())
