"""Device readings measured by `kvcache probe` -> the design's assumptions (facts in, value + reason out)."""

from __future__ import annotations

from model_infer_kvcache.analyzer.device_questions import QUESTIONS, UNKNOWN
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.manifest import DeviceDependency, DeviceReadingsSource, Finding
from model_infer_kvcache.analyzer.readings_file import ReadingsFile

DEFAULT_WINDOW_READING = QUESTIONS["window_pre_tokens"].default


def resolve_window_reading(stated: str | None, readings: ReadingsFile | None, file: str | None) -> tuple[str, str]:
    """(reading, where it came from): the measured reading wins over the default; a stated one must agree."""
    measured = readings.questions["window_pre_tokens"].reading if readings else None
    if measured and measured != UNKNOWN:
        if stated and stated != measured:
            raise InputError("--window-reading", f"{stated} contradicts the reading {measured!r} measured in {file} "
                                                 "(drop the flag or re-run `kvcache probe`)")
        return measured, f"measured ({file})"
    if stated:
        return stated, "--window-reading"
    return DEFAULT_WINDOW_READING, "default (documented band rule)"


def _survives(dep: DeviceDependency) -> set[str]:
    """Readings under which the design stays correct."""
    if dep.question == "null_block_contents":  # the design never reads the null block: any contents do
        return set(QUESTIONS[dep.question].readings)
    if dep.question == "repeated_slots":  # padded rows are identical: whichever wins is the same row
        return set(QUESTIONS[dep.question].alternatives("error"))
    return {dep.assumed}


def apply_readings(deps: list[DeviceDependency], readings: ReadingsFile, file: str,
                   warnings: list[Finding], questions: list[Finding]) -> tuple[list[DeviceDependency],
                                                                             DeviceReadingsSource]:
    """Mark each dependency confirmed / contradicted / unknown by the measurement; say what it means."""
    where = f"{file} ({readings.where()})"
    if readings.backend == "emulated":
        warnings.append(Finding(message=f"device readings from {file} were measured on the emulated backend "
                                        "(a CPU dry run): they settle nothing about a device; run `kvcache probe` "
                                        "on the NPU host", fields=["--device-readings"]))
    out = []
    for dep in deps:
        measured = readings.questions[dep.question].reading
        if measured == UNKNOWN:
            status = "unknown"
            questions.append(Finding(message=f"{dep.question}: the probe's output matched no known reading ({where}: "
                                             f"{readings.questions[dep.question].summary}); the design rests on "
                                             f"the assumed reading {dep.assumed!r}", fields=["--device-readings"]))
        elif measured in _survives(dep):
            status = "confirmed"
        else:
            status = "contradicted"
            warnings.append(Finding(message=f"{dep.question}: measured {measured!r} on {where}, the design assumes "
                                            f"{dep.assumed!r}: {dep.consequence}", fields=["--device-readings"]))
        out.append(dep.model_copy(update={"status": status, "measured": measured}))
    source = DeviceReadingsSource(
        file=file, backend=readings.backend, soc=readings.soc, torch_npu_version=readings.torch_npu_version,
        cann_version=readings.cann_version, probe_version=readings.probe_version, settled=readings.settled(),
        unknown=[q for q, a in readings.questions.items() if a.reading == UNKNOWN])
    return out, source
