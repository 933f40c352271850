"""Reference semantics of the torch_npu attention and KV-cache operators, runnable on CPU.

Public API:

* :mod:`validators.npu_ops.emulated` - the emulated operators, with the real signatures.
* :func:`load` - ``load("auto" | "emulated" | "npu")`` -> an object with the ops as attributes.
* :func:`install_emulation` - context manager exposing the emulation as ``torch_npu.<op>``
  and ``torch.ops.npu.<op>`` inside a validation process.
* :class:`DeviceReadings`, :func:`device_readings`, :func:`active_readings` - the explicit
  switches for the open device questions (see references/device_questions.md).
* The pinned real schemas live with the other operator facts in :mod:`analyzer.operators`.
* :func:`nz_view` - view a ``[bn, bs, N, D]`` cache allocation in its NZ 5-D form.
* :func:`paged_caches` - declare the caches and their null block (padded decode rows may repeat
  slots there only; it is poisoned after every write into it).
* :class:`UnemulatedOperatorError` - a model called an operator the emulation lacks (one line, with
  the calling ``file:line``); a :class:`NotStoodInError`.
"""

from model_infer_kvcache.validators.npu_ops.backend import (
    OpSet,
    emulation_installed,
    install_emulation,
    load,
    npu_available,
)
from model_infer_kvcache.validators.npu_ops.errors import (
    NotStoodInError,
    NpuOpError,
    UnemulatedFeatureError,
    UnemulatedOperatorError,
)
from model_infer_kvcache.validators.npu_ops.null_block import NULL_BLOCK_ID, paged_caches
from model_infer_kvcache.validators.npu_ops.nz import nz_c0, nz_view
from model_infer_kvcache.validators.npu_ops.readings import (
    DEFAULT_READINGS,
    DeviceReadings,
    active_readings,
    consulted_questions,
    device_readings,
)

__all__ = [
    "DEFAULT_READINGS",
    "DeviceReadings",
    "NULL_BLOCK_ID",
    "UnemulatedFeatureError",
    "NotStoodInError",
    "NpuOpError",
    "UnemulatedOperatorError",
    "OpSet",
    "active_readings",
    "consulted_questions",
    "device_readings",
    "emulation_installed",
    "install_emulation",
    "load",
    "npu_available",
    "nz_c0",
    "nz_view",
    "paged_caches",
]
