"""The device the probe measures: the real torch_npu operators on an NPU, or the CPU emulation.

Both backends run the same experiments through the same interface; only the operators, the
tensor placement and the allocation of never-written cache memory differ.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from model_infer_kvcache.validators.npu_ops import OpSet, active_readings, load, npu_available

# The designs' cache dtype on the device; the emulation computes in float32 anyway and its
# bfloat16 matmuls are slow on CPU, so the dry run keeps float32 (same calls otherwise).
NPU_DTYPE = torch.bfloat16


class NoDeviceError(RuntimeError):
    """The NPU backend was asked for but no NPU is usable here."""


@dataclass
class ProbeDevice:
    backend: str  # "npu" | "emulated"
    ops: OpSet
    device: torch.device
    index: int | None = None
    dtype: torch.dtype = torch.float32

    def put(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    def fetch(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", torch.float32)

    def never_written(self, shape: tuple[int, ...], dtype: torch.dtype, sentinel: float) -> torch.Tensor:
        """A cache allocated the way the framework does, in memory that held ``sentinel`` before.

        NPU: fill a same-sized tensor with ``sentinel``, free it, then ``torch.empty`` (the
        framework's allocation): the caching allocator decides what the new cache holds.
        Emulated: the emulation's never-written memory is NaN, as validation poisons it.
        """
        if self.backend == "emulated":
            return torch.full(shape, float("nan"), dtype=dtype)
        previous = torch.full(shape, sentinel, dtype=dtype, device=self.device)
        del previous
        return torch.empty(shape, dtype=dtype, device=self.device)

    def environment(self) -> dict[str, Any]:
        info: dict[str, Any] = {"torch_version": torch.__version__, "device_index": self.index}
        if self.backend == "emulated":
            info.update(soc="cpu-emulation", torch_npu_version=None, cann_version=None,
                        emulated_readings={k: str(v) for k, v in vars(active_readings()).items()})
            return info
        import torch_npu  # noqa: F401 - present: the npu backend loaded

        info.update(torch_npu_version=_safe(lambda: torch_npu.__version__),
                    soc=_safe(lambda: torch_npu.npu.get_device_name(self.index or 0)),
                    cann_version=cann_version())
        return info


def _safe(fn) -> str | None:
    try:
        value = fn()
    except Exception:  # noqa: BLE001 - version queries differ between releases; absent is fine
        return None
    return None if value is None else str(value)


def cann_version() -> str | None:
    """CANN toolkit version when it can be found (torch_npu's own record, then the toolkit's files)."""
    try:
        from torch_npu import version as npu_version  # type: ignore[attr-defined]

        value = getattr(npu_version, "cann", None)
        if value:
            return str(value)
    except Exception:  # noqa: BLE001
        pass
    for var in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"):
        root = os.environ.get(var)
        if not root:
            continue
        for name in ("version.cfg", "ascend_toolkit_install.info", "*/ascend_toolkit_install.info"):
            for path in Path(root).glob(name):
                for line in path.read_text(errors="replace").splitlines():
                    if "version" in line.lower() and "=" in line:
                        return line.split("=", 1)[1].strip().strip('"')
    return None


def open_device(backend: str, index: int | None) -> ProbeDevice:
    """The probe device; ``NoDeviceError`` (one line) when the NPU backend is unusable here."""
    if backend == "emulated":
        return ProbeDevice("emulated", load("emulated"), torch.device("cpu"), index, torch.float32)
    ok, why = npu_available()
    if not ok:
        raise NoDeviceError(why)
    import torch_npu

    idx = 0 if index is None else index
    count = int(torch_npu.npu.device_count())
    if not 0 <= idx < count:
        raise NoDeviceError(f"--device {idx} is not one of the {count} visible NPU(s)")
    torch_npu.npu.set_device(idx)
    return ProbeDevice("npu", load("npu"), torch.device(f"npu:{idx}"), idx, NPU_DTYPE)
