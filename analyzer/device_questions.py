"""The open device questions the probe answers, and the readings each one can have (torch-free).

Questions whose reading is an emulator switch (``validators.npu_ops.DeviceReadings``) use the
same names and values; ``tests/test_probe.py`` checks that the two lists agree.
"""

from __future__ import annotations

from dataclasses import dataclass

UNKNOWN = "unknown"


@dataclass(frozen=True)
class Question:
    name: str
    readings: tuple[str, ...]
    switch: bool  # an emulator switch: validate can run the emulator under the measured reading
    asks: str


QUESTIONS: dict[str, Question] = {q.name: q for q in (
    Question("band_at_single_query", ("honoured", "ignored"), True,
             "is the sparse_mode 4 band (pre_tokens) applied to a query of length 1 (paged TND decode)?"),
    Question("window_pre_tokens", ("exclusive", "inclusive"), True,
             "does pre_tokens count only the keys before the query (W+1 visible) or the query too (W)?"),
    Question("null_block_contents", ("zeros", "stale", "poisoned"), False,
             "what does a never-written block of a cache allocated like the framework's (torch.empty) hold?"),
    Question("repeated_slots", ("last_wins", "first_wins", "error"), True,
             "do the cache writers accept padded decode rows that all write the null block's slot 0?"),
    Question("mla_decode_sparse_mode3", ("same_as_mode0", "deviates", "rejected"), False,
             "MLA absorb decode (q_len 1, rope inputs) with sparse_mode 3: same as mode 0, different, or refused?"),
)}


def reading_ok(question: str, reading: str) -> bool:
    return reading == UNKNOWN or reading in QUESTIONS[question].readings
