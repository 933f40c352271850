"""The error raised for a call the device would reject (or whose result is undefined there)."""

from __future__ import annotations


class NpuOpError(RuntimeError):
    """A rejected operator call; ``argument`` names the offending argument.

    Subclasses ``RuntimeError`` because that is what ``torch_npu`` raises for a bad
    parameter (``TORCH_CHECK`` failures surface as ``RuntimeError``).
    """

    def __init__(self, op: str, argument: str, message: str) -> None:
        self.op = op
        self.argument = argument
        super().__init__(f"{op}: argument '{argument}': {message}")


class NotEmulatedError(NpuOpError):
    """A feature the real operator has but this emulation does not implement (quantization, pse...).

    Raised instead of silently ignoring the argument, so a validation run never reports a
    result computed without it.
    """
