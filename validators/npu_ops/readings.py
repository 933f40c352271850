"""Explicit switches for the device behaviours the documentation leaves open.

See references/device_questions.md. Each open question that is an emulator switch
(``analyzer.device_questions``: the names, readings and defaults) is a field of
:class:`DeviceReadings`; the defaults are the readings the documented band rule and the upstream
code rely on. How the emulator implements each reading: The
validators run the affected cases under every reading and report which ones the rendered
code survives; only an NPU run can settle which reading the hardware implements.

``band_at_single_query``
    ``"honoured"`` (default): a request whose query length is 1 is masked like any other
    request: causal modes 2/3, the band of mode 4, and the pre/next window of mode 0 with a
    mask all apply. The upstream gpt-oss code relies on this (``sparse_mode=4`` plus
    ``pre_tokens`` at decode over a paged cache whose out-of-window blocks are the null block).
    ``"ignored"``: the op documents that ``sparse_mode`` (without rope inputs) and
    ``pre_tokens``/``next_tokens`` have no effect when the query length is 1; under this
    reading a single-token query sees every key up to its KV length (an explicit mode-0/1
    mask is still applied). For the batch layouts the query length is the tensor's S axis;
    for the packed (TND-like) layouts it is each request's own length.

``window_pre_tokens``
    ``"exclusive"`` (default, the documented band rule): ``pre_tokens`` counts keys strictly
    before the query. Key ``j`` is visible to query ``i`` iff
    ``i' - pre_tokens <= j <= i' + next_tokens`` with ``i' = i + kv_len - q_len`` (mode 4) or
    ``i' = i`` (mode 0 with a mask); ``pre_tokens=W`` admits W+1 keys when ``next_tokens=0``.
    ``"inclusive"``: ``pre_tokens`` counts the query itself, the lower bound becomes
    ``i' - pre_tokens + 1`` and ``pre_tokens=W`` admits W keys (the Hugging Face / vLLM meaning
    of a window of W).

``repeated_slots``
    The real engine pads decode batches; every padded row maps to the null block's slot 0, so
    the cache writers (``npu_scatter_nd_update(_)``, ``npu_kv_rmsnorm_rope_cache(_v2)`` in the
    PA modes) receive the same slot several times. The docs only say repeats are "not
    guaranteed correct"; upstream relies on the device accepting them. ``"last_wins"``
    (default): the slot holds the last row written to it; ``"first_wins"``: the first row;
    ``"error"``: the writer rejects any repeated slot. Repeats outside the null block are a race
    between live tokens and are refused under every reading. Which rows are in the null block is
    declared, not guessed: the validation driver declares its caches with
    ``validators.npu_ops.paged_caches`` (the framework's null block is block 0 of every pool,
    ``NULL_BLOCK_ID``), and after every write into a declared null block the emulator fills that
    block with NaN: the device leaves its content undefined, so under ``last_wins`` and
    ``first_wins`` a validation run sees the same poisoned block (the two readings differ only in
    what the probe reads back from an undeclared cache). Undeclared caches: the fused MLA writer
    reads the block size off its ``[block_num, block_size, 1, D]`` caches and uses block 0;
    ``npu_scatter_nd_update`` cannot tell blocks apart in a flat cache and lets every repeat
    follow the reading.

``finalize_skip1_alone``
    ``npu_moe_finalize_routing(skip1=x, skip2=None)``: the torch-npu 2.9.0 doc says skip1 must be
    None when skip2 is; upstream DeepSeek's prefill MoE passes the shared experts' output as skip1
    alone and needs it added. ``"added"`` (default, the upstream reliance): ``out = skip1 + ...``;
    ``"ignored"``: skip1 is dropped; ``"rejected"``: the call fails (the doc's rule). An operator
    question, not a design one: the emulator notes it as consulted (:func:`consult`) when a call
    passes skip1 alone, and the checkout mode sweeps the questions a run consulted.

``mla_decode_sparse_mode3``
    MLA absorb decode (``query_rope`` given, Q_S 1) with ``sparse_mode=3`` and the 2048x2048 mask: the op
    docs support only mode 0 without a mask or mode 4 with one there; upstream kimi_k2_thinking passes mode 3
    with the mask at decode, and the seed skill reports a large deviation for it. ``"same_as_mode0"``
    (default, the upstream reliance: rightDownCausal masks nothing at q_len 1); ``"deviates"``: emulated as
    the mask read from its top-left corner (the query sees key 0 only), one concrete deviation, so that a
    model relying on mode 3 fails the comparison; ``"rejected"``: the call fails (the doc's rule). An
    operator question: consulted only by such a call, swept like ``finalize_skip1_alone``.

``gdr_state_writes``, ``gdr_accepted_start``, ``gdr_head_grouping``
    The gated delta rule operators (``gated_delta``): which ``ssm_state_indices`` slots
    ``npu_recurrent_gated_delta_rule`` writes (``"every_token"``, default: the state after token i goes to
    ``state[ssm_state_indices[i]]``, the doc's per-token wording and vLLM's kernel; ``"last_only"``: only the
    request's final state, to its last token's slot), which slot a request starts from when
    ``num_accepted_tokens`` is given (``"accepted_slot"``, default: the slot of token ``num_accepted - 1``, vLLM's
    kernel; ``"first_slot"``: its first token's), and which key head serves value head h when Nv > Nk
    (``"consecutive"``, default: ``h // (Nv/Nk)``, transformers / FLA / upstream qwen3_5; ``"strided"``:
    ``h % Nk``). Operator questions, consulted only by calls whose result depends on them.

``value_head_dim``
    FA with value heads narrower than key heads over packed (TND / NTD_TND) queries: the op docs list Q_D = K_D =
    192 with V_D 128 (2.14.0 ``_op_plugin_docs.py:8730``) and also say key and value shapes must be identical
    (:8685). ``"documented_pairs"`` (default, what MiMo-V2-Flash's plan rests on): the listed pairs run;
    ``"equal_only"``: the call fails. Consulted only by a call whose value head dim differs from its key's.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import ClassVar

from model_infer_kvcache.analyzer.device_questions import QUESTIONS, SWITCH_QUESTIONS
from model_infer_kvcache.validators.npu_ops.null_block import NULL_BLOCK_ID

_ALLOWED = {name: QUESTIONS[name].readings for name in SWITCH_QUESTIONS}


@dataclass(frozen=True)
class DeviceReadings:
    """One choice for every open device question (defaults: the documented/upstream reading)."""

    band_at_single_query: str = QUESTIONS["band_at_single_query"].default
    window_pre_tokens: str = QUESTIONS["window_pre_tokens"].default
    repeated_slots: str = QUESTIONS["repeated_slots"].default
    finalize_skip1_alone: str = QUESTIONS["finalize_skip1_alone"].default
    mla_decode_sparse_mode3: str = QUESTIONS["mla_decode_sparse_mode3"].default
    gdr_state_writes: str = QUESTIONS["gdr_state_writes"].default
    gdr_accepted_start: str = QUESTIONS["gdr_accepted_start"].default
    gdr_head_grouping: str = QUESTIONS["gdr_head_grouping"].default
    value_head_dim: str = QUESTIONS["value_head_dim"].default

    # Fixed rules, not switches (no sweep, no probe question): padded decode rows may repeat slots
    # only inside the null block (block NULL_BLOCK_ID of every cache declared with
    # ``null_block.paged_caches``), and that block holds NaN after every write into it.
    null_block_id: ClassVar[int] = NULL_BLOCK_ID
    null_block_after_write: ClassVar[str] = "poisoned"

    @classmethod
    def fixed_rules(cls) -> dict[str, object]:
        """The fixed null-block rules, for reports next to the switches."""
        return {"null_block_id": cls.null_block_id, "null_block_after_write": cls.null_block_after_write,
                "repeats_outside_null_block": "error"}

    def __post_init__(self) -> None:
        if {f.name for f in fields(self)} != set(_ALLOWED):  # a switch question without a field, or the reverse
            raise TypeError(f"DeviceReadings fields {[f.name for f in fields(self)]} != switch questions {SWITCH_QUESTIONS}")
        for field in fields(self):
            value = getattr(self, field.name)
            if value not in _ALLOWED[field.name]:
                raise ValueError(f"{field.name} must be one of {_ALLOWED[field.name]}, got {value!r}")

    @classmethod
    def from_settled(cls, settled: dict[str, str]) -> DeviceReadings:
        """The switches set to the readings a probe settled (``ReadingsFile.settled()``); questions that
        are no emulator switch are ignored, an unsettled switch keeps its default."""
        return cls(**{q: r for q, r in settled.items() if q in _ALLOWED})

    @classmethod
    def all(cls) -> list[DeviceReadings]:
        """Every combination of readings, default first."""
        names = list(_ALLOWED)
        return [cls(**dict(zip(names, combo, strict=True))) for combo in itertools.product(*(_ALLOWED[n] for n in names))]

    def label(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))


DEFAULT_READINGS = DeviceReadings()
_active: DeviceReadings = DEFAULT_READINGS


_collectors: list[set[str]] = []  # one live set per open consulted_questions() block


def consult(question: str) -> str:
    """The active reading of ``question``, noted as consulted: the calling operator's result depends on it."""
    for seen in _collectors:
        seen.add(question)
    return getattr(_active, question)


@contextmanager
def consulted_questions() -> Iterator[set[str]]:
    """A set that collects the switch questions consulted while the block runs (blocks may nest)."""
    seen: set[str] = set()
    _collectors.append(seen)
    try:
        yield seen
    finally:
        # By identity: nested sets holding the same questions are equal, and list.remove would drop the outer one.
        del _collectors[next(i for i, c in enumerate(_collectors) if c is seen)]


def active_readings() -> DeviceReadings:
    """The readings the emulated attention operators use right now."""
    return _active


def set_readings(readings: DeviceReadings) -> DeviceReadings:
    """Make ``readings`` active; returns the previous value (prefer :func:`device_readings`)."""
    global _active
    if not isinstance(readings, DeviceReadings):
        raise TypeError(f"expected DeviceReadings, got {type(readings).__name__}")
    previous, _active = _active, readings
    return previous


@contextmanager
def device_readings(readings: DeviceReadings) -> Iterator[DeviceReadings]:
    """Run the enclosed code with ``readings`` active (module-level state, not thread-safe)."""
    previous = set_readings(readings)
    try:
        yield readings
    finally:
        set_readings(previous)
