"""The one error type for bad input: the CLI turns it into one stderr line and exit code 2."""

from __future__ import annotations


class InputError(Exception):
    """Bad user input. ``where`` names the file (or flag) and ``field`` the offending field."""

    def __init__(self, where: str, message: str, field: str | None = None):
        self.where = where
        self.field = field
        self.message = message
        super().__init__(self.render())

    def render(self) -> str:
        location = f"{self.where}: {self.field}" if self.field else self.where
        # One line whatever the inputs hold: the CLI promises a single stderr line.
        return " ".join(f"{location}: {self.message}".splitlines())
