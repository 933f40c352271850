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


class UnemulatedFeatureError(NpuOpError):
    """A feature (argument) of an emulated operator that the emulation does not implement (quantization,
    pse...); an operator that is not emulated at all is ``UnemulatedOperatorError``.

    Raised instead of silently ignoring the argument, so a validation run never reports a
    result computed without it.
    """


class NotStoodInError(RuntimeError, AttributeError):
    """An attribute of the device stack (``torch_npu``, ``torchair``, ``torch.npu``) that no CPU
    stand-in provides. The message is one line naming the attribute and its caller.

    Also an ``AttributeError``: feature probes answer like the real module answers for a name it
    lacks (``hasattr`` is False, ``getattr(mod, name, default)`` is the default), so a model's own
    fallback runs; code that uses the name unguarded still gets this one-line error."""


class UnemulatedOperatorError(NotStoodInError):
    """A ``torch_npu`` / ``torch.ops.npu`` operator that the CPU emulation does not provide.

    ``op`` is the qualified name (``torch_npu.npu_foo``), ``location`` the ``file:line`` of the
    model code that asked for it. One line, so a driver can print it as the whole failure.
    """

    def __init__(self, op: str, location: str) -> None:
        self.op = op
        self.location = location
        super().__init__(f"{op} is not emulated on CPU (called at {location}); "
                         f"emulated ops: references/emulated_ops.md")


_INTERNAL_PARTS = ("/torch/", "/validators/", "/importlib/", "/contextlib.py")


def _display_path(filename: str) -> str:
    """``filename`` relative to the checkout holding it (the folder with ``executor/core``), else as is."""
    from pathlib import Path

    path = Path(filename)
    for parent in path.parents:
        if (parent / "executor" / "core").is_dir():
            return path.relative_to(parent).as_posix()
    return filename


def caller_location(skip: int = 1) -> str:
    """``file:line`` of the first caller frame outside torch, validators and the import machinery."""
    import sys

    frame = sys._getframe(skip)
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if not (name.startswith("<") or any(part in name for part in _INTERNAL_PARTS)):
            return f"{_display_path(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"
