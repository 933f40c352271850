"""Run the probe on a device and assemble the readings file; render it as a table or Markdown."""

from __future__ import annotations

import json
from datetime import datetime, timezone

from model_infer_kvcache.analyzer.device_questions import QUESTIONS, UNKNOWN
from model_infer_kvcache.analyzer.readings_file import PROBE_VERSION, QuestionReading, ReadingsFile
from model_infer_kvcache.validators.probe.device import ProbeDevice
from model_infer_kvcache.validators.probe.experiments import run_experiments


def probe(dev: ProbeDevice) -> ReadingsFile:
    outcomes = run_experiments(dev)
    env = dev.environment()
    return ReadingsFile(
        probe_version=PROBE_VERSION,
        created_utc=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        backend=dev.backend,
        device_index=env["device_index"],
        soc=env["soc"],
        torch_version=env["torch_version"],
        torch_npu_version=env["torch_npu_version"],
        cann_version=env["cann_version"],
        emulated_readings=env.get("emulated_readings"),
        questions={q: QuestionReading(reading=o.reading, summary=o.summary, evidence=_plain(o.evidence))
                   for q, o in outcomes.items()},
    )


def _plain(value):
    return json.loads(json.dumps(value, default=str))


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _reading_label(data: ReadingsFile) -> str:
    return "measured reading" if data.backend == "npu" else "dry-run reading"


def table_text(data: ReadingsFile) -> str:
    """Plain-text table for the terminal: question -> measured reading -> evidence (a dry run on the emulated
    backend says 'dry-run reading': it measured nothing about a device)."""
    rows = [("question", _reading_label(data), "evidence")]
    rows += [(q, a.reading, a.summary) for q, a in data.questions.items()]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"{a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows]
    lines.insert(1, f"{'-' * w0}  {'-' * w1}  {'-' * 8}")
    return "\n".join([f"kvcache probe v{data.probe_version}: {data.where()}", ""] + lines) + "\n"


def markdown(data: ReadingsFile) -> str:
    """Ready to paste into an upstream issue: environment, readings table, raw evidence."""
    unknown = [q for q, a in data.questions.items() if a.reading == UNKNOWN]
    lines = [
        "### Device readings measured by `kvcache probe`" if data.backend == "npu" else
        "### Dry-run readings of `kvcache probe --backend emulated` (CPU emulation, not a device measurement)",
        "",
        f"- SoC: `{data.soc or '?'}`" + (f" (device {data.device_index})" if data.device_index is not None else ""),
        f"- torch `{data.torch_version}`, torch_npu `{data.torch_npu_version or '-'}`, "
        f"CANN `{data.cann_version or 'unknown'}`",
        f"- backend: {data.backend}" + (" (CPU emulation: a dry run, it settles nothing about a device)"
                                        if data.backend == "emulated" else ""),
        f"- probe version {data.probe_version}, {data.created_utc}",
        "",
        f"| question | what was asked | {_reading_label(data)} | evidence |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{q}` | {_cell(QUESTIONS[q].asks)} | **{a.reading}** | {_cell(a.summary)} |"
              for q, a in data.questions.items()]
    if unknown:
        lines += ["", "Outputs matching no known reading (findings): " + ", ".join(f"`{q}`" for q in unknown)]
    lines += ["", "<details><summary>raw evidence</summary>", "", "```json", "{"]
    body = [f"  {json.dumps(q)}: {json.dumps(a.evidence, ensure_ascii=False)}" for q, a in data.questions.items()]
    lines += [",\n".join(body), "}", "```", "", "</details>"]
    return "\n".join(lines) + "\n"
