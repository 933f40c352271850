"""The device-reading sweep, shared by both validation modes (rendered code, checkout model).

The emulator runs under one reading of every open device question (references/device_questions.md);
the sweep reruns the quick stream under every other reading of each question the code meets (the
design's dependencies the manifest lists, and the operator questions a run consulted) and writes
one note per rerun plus, when the verdict changes with the reading, which readings the code needs.
Questions a probe measured on a device, or the caller fixed, are not swept: the reading is known. A listed
dependency the sweep cannot tell apart (``Question.unswept``) gets a note saying why instead of a verdict.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace

from model_infer_kvcache.analyzer.device_questions import QUESTIONS
from model_infer_kvcache.validators.pipeline.report import Report


def sweep_readings(report: Report, questions: Iterable[str], base, rerun: Callable[[object], Report], *,
                   settled: dict[str, str], caller: Iterable[str] = (), subject: str = "the render",
                   say: Callable[[str], None] = lambda msg: None) -> None:
    """``rerun(readings) -> Report`` runs the quick stream under ``readings`` (a ``DeviceReadings``);
    ``report`` is the full run under ``base`` and receives the notes."""
    caller = set(caller)
    for question in dict.fromkeys(questions):  # ordered, once each
        if not QUESTIONS[question].swept:
            if QUESTIONS[question].unswept:
                report.notes.append(f"{question} not swept: {QUESTIONS[question].unswept}")
            continue
        if question in settled or question in caller:
            how = f"settled by measurement ({settled[question]})" if question in settled else "set by the caller"
            report.notes.append(f"{question} {how}: sweep skipped")
            continue
        assumed = getattr(base, question)
        ok, bad = ([assumed], []) if report.passed else ([], [assumed])
        for alternative in QUESTIONS[question].alternatives(assumed):
            say(f"device reading sweep: {question}={alternative}")
            try:
                swept = rerun(replace(base, **{question: alternative}))
                verdict = "survives" if swept.passed else "fails: " + ", ".join(
                    f"{c.name} ({c.detail or c.measured})"[:200] for c in swept.failed()[:2])
                passed = swept.passed
            except Exception as exc:  # an operator refusing a call under that reading is a result too
                verdict, passed = f"fails: {type(exc).__name__}: {exc}"[:300], False
            report.notes.append(f"under {question}={alternative} {subject} {verdict}")
            (ok if passed else bad).append(alternative)
        if ok and bad:
            report.notes.append(f"{subject} depends on the device reading {question}: it passes under "
                                f"{', '.join(ok)} and fails under {', '.join(bad)} (references/device_questions.md)")
