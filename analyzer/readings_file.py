"""The readings file `kvcache probe` writes and `kvcache analyze|validate --device-readings` read.

Versioned by ``probe_version`` (the experiments' version: a newer file may hold questions or
readings this checkout does not know, so it is refused rather than half-read). Loading never
fills a gap with a default: a malformed file, a file from a newer probe, an unknown question,
a missing question or a reading outside the question's list is one ``InputError`` naming the
file and the field. A question measured as ``"unknown"`` is kept as such: it settles nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from model_infer_kvcache.analyzer.device_questions import OP_BACKENDS, QUESTIONS, UNKNOWN, reading_ok
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.files import json_syntax_problem, not_a_file, read_input_text
from pydantic import BaseModel, ConfigDict, Field, ValidationError

PROBE_VERSION = 4  # 2: finalize_skip1_alone; 3: the gated delta rule questions (gdr_*); 4: value_head_dim
FILE_KIND = "kvcache-device-readings"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class QuestionReading(_Model):
    reading: str = Field(description="one of the question's readings, or 'unknown' (matched none)")
    summary: str = Field(description="one line: what was measured and why it is this reading")
    evidence: dict[str, Any] = Field(default_factory=dict, description="raw measurements per variant")


class ReadingsFile(_Model):
    kind: Literal["kvcache-device-readings"] = FILE_KIND
    probe_version: int
    created_utc: str
    backend: Literal[OP_BACKENDS]
    device_index: int | None = None
    soc: str | None = Field(default=None, description="SoC / device name as torch_npu reports it")
    torch_version: str
    torch_npu_version: str | None = None
    cann_version: str | None = None
    emulated_readings: dict[str, str] | None = Field(
        default=None, description="emulated backend only: the emulator switches that were active")
    questions: dict[str, QuestionReading]

    def settled(self) -> dict[str, str]:
        """Question -> measured reading, for the questions the measurement settled (not 'unknown')."""
        return {q: r.reading for q, r in self.questions.items() if r.reading != UNKNOWN}

    def where(self) -> str:
        """Provenance in one line: file-independent (the caller adds the path)."""
        parts = [f"backend {self.backend}", f"soc {self.soc or '?'}", f"torch_npu {self.torch_npu_version or '-'}",
                 f"CANN {self.cann_version or '?'}", f"probe v{self.probe_version}"]
        return ", ".join(parts)

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2, ensure_ascii=False) + "\n"


def check_readings(data: ReadingsFile, where: str) -> ReadingsFile:
    """Refuse what this checkout cannot read faithfully (see the module docstring)."""
    if data.probe_version > PROBE_VERSION:
        raise InputError(where, f"written by probe v{data.probe_version}, newer than this checkout's "
                                f"v{PROBE_VERSION}: update the bundle or re-run `kvcache probe`",
                         field="probe_version")
    if data.probe_version < 1:
        raise InputError(where, f"must be >= 1, got {data.probe_version}", field="probe_version")
    for name, answer in data.questions.items():
        if name not in QUESTIONS:
            raise InputError(where, f"unknown question (known: {', '.join(QUESTIONS)})", field=f"questions.{name}")
        if not reading_ok(name, answer.reading):
            raise InputError(where, f"reading {answer.reading!r} is not one of "
                                    f"{QUESTIONS[name].readings + (UNKNOWN,)}", field=f"questions.{name}.reading")
    missing = [q for q in QUESTIONS if q not in data.questions]
    if missing:
        raise InputError(where, "missing: re-run `kvcache probe` (a question is never assumed)",
                         field=f"questions.{missing[0]}")
    return data


def load_readings(path: str, flag: str = "--device-readings") -> ReadingsFile:
    """Read and check a readings file; every problem is an ``InputError`` naming the file and field."""
    p = Path(path)
    problem = not_a_file(p)
    if problem:
        raise InputError(path, problem, field=flag)
    try:
        raw = json.loads(read_input_text(p))
    except json.JSONDecodeError as exc:
        raise InputError(path, f"not a readings JSON file: {json_syntax_problem(exc)}") from None
    if not isinstance(raw, dict):
        raise InputError(path, "not a readings file: top level must be a JSON object")
    if raw.get("kind") != FILE_KIND:
        raise InputError(path, f"must be {FILE_KIND!r} (written by `kvcache probe`)", field="kind")
    version = raw.get("probe_version")
    if isinstance(version, int) and not isinstance(version, bool) and version > PROBE_VERSION:
        # Before the schema: a newer file may carry fields this checkout does not know.
        raise InputError(path, f"written by probe v{version}, newer than this checkout's v{PROBE_VERSION}: "
                               "update the bundle or re-run `kvcache probe`", field="probe_version")
    try:
        data = ReadingsFile.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or "(top level)"
        raise InputError(path, err["msg"], field=field) from None
    return check_readings(data, path)
