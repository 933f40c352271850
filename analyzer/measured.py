"""Device readings measured by `kvcache probe` -> the design's assumptions (facts in, value + reason out)."""

from __future__ import annotations

from model_infer_kvcache.analyzer.device_questions import QUESTIONS, UNKNOWN
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.manifest import DeviceDependency, DeviceReadingsSource, Finding
from model_infer_kvcache.analyzer.readings_file import ReadingsFile

DEFAULT_WINDOW_READING = QUESTIONS["window_pre_tokens"].default


def device_settled(readings: ReadingsFile | None) -> dict[str, str]:
    """Question -> reading a device measured: a file from the NPU backend settles its known readings; a dry
    run on the emulated backend (``kvcache probe --backend emulated``) settles none, whatever it read."""
    return readings.settled() if readings is not None and readings.backend == "npu" else {}


def readings_label(readings: ReadingsFile, file: str | None) -> str:
    """How a readings file's readings are named in reasons and reports: measured on a device, or read by a
    dry run of the emulator (never called measured)."""
    if readings.backend == "npu":
        return f"measured ({file})"
    return f"dry-run reading of the emulated backend ({file}; not a device measurement)"


def resolve_window_reading(stated: str | None, readings: ReadingsFile | None, file: str | None) -> tuple[str, str]:
    """(reading, where it came from): the file's reading wins over the default (a dry run's too, so that
    validate, which runs the emulator under the same file, agrees); a stated one must agree."""
    read = readings.questions["window_pre_tokens"].reading if readings else None
    if read and read != UNKNOWN:
        label = readings_label(readings, file)
        if stated and stated != read:
            what = (f"the reading {read!r} measured in {file}" if readings.backend == "npu"
                    else f"the dry-run reading {read!r} of the emulated backend in {file}")
            raise InputError("--window-reading", f"{stated} contradicts {what} (drop the flag or re-run "
                                                 "`kvcache probe`)")
        return read, label
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
        # A dry run reads the emulator's own switches: every dependency stays an assumption (status
        # 'assumed', nothing 'measured'), and the source settles nothing.
        warnings.append(Finding(message=f"device readings from {file} come from the emulated backend "
                                        "(a CPU dry run): they settle nothing about a device and every dependency "
                                        "stays assumed; run `kvcache probe` on the NPU host",
                                fields=["--device-readings"]))
        return list(deps), _source(readings, file, settled={}, unknown=[])
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
    return out, _source(readings, file, settled=readings.settled(),
                        unknown=[q for q, a in readings.questions.items() if a.reading == UNKNOWN])


def _source(readings: ReadingsFile, file: str, settled: dict[str, str], unknown: list[str]) -> DeviceReadingsSource:
    return DeviceReadingsSource(
        file=file, backend=readings.backend, soc=readings.soc, torch_npu_version=readings.torch_npu_version,
        cann_version=readings.cann_version, probe_version=readings.probe_version, settled=settled, unknown=unknown)
