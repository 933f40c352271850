"""The readings file: round trip, refusals, and its use by `kvcache analyze` / `kvcache validate`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.decisions_table import decisions_markdown
from model_infer_kvcache.analyzer.device_questions import QUESTIONS
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.readings_file import PROBE_VERSION, load_readings
from model_infer_kvcache.validators.npu_ops import DEFAULT_READINGS, DeviceReadings, device_readings
from model_infer_kvcache.validators.pipeline.validate import ValidateRequest, validate
from model_infer_kvcache.validators.probe.device import open_device
from model_infer_kvcache.validators.probe.run import probe
from validators_support import CONFIGS, render_case

from model_infer_kvcache import cli as kvcache_cli

GPT_OSS = str(CONFIGS / "gpt_oss_20b.json")
_CACHE: dict[DeviceReadings, dict] = {}


def measured(readings: DeviceReadings = DEFAULT_READINGS) -> dict:
    """A readings file (as JSON data) measured on the emulator set to ``readings``."""
    if readings not in _CACHE:
        with device_readings(readings):
            _CACHE[readings] = probe(open_device("emulated", None)).model_dump(mode="json")
    return json.loads(json.dumps(_CACHE[readings]))


def write(tmp_path: Path, data, name: str = "readings.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return str(path)


def as_device(data: dict) -> dict:
    """The same measurements as if an NPU host had produced them (the file format is the same)."""
    data.update(backend="npu", soc="Ascend910B3", torch_npu_version="2.9.0", cann_version="8.3.RC1",
                emulated_readings=None, device_index=0)
    return data


# --------------------------------------------------------------------------- file round trip / refusals
def test_round_trip_through_the_cli(tmp_path, capsys):
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    assert kvcache_cli.main(["probe", "--backend", "emulated", "--out", str(out), "--markdown", str(md)]) == 0
    table = capsys.readouterr().out
    data = load_readings(str(out))
    assert data.probe_version == PROBE_VERSION and data.backend == "emulated"
    assert list(data.questions) == list(QUESTIONS)
    for q, answer in data.questions.items():
        assert f"{q} " in table and answer.reading in table
        assert f"| `{q}` |" in md.read_text(encoding="utf-8")
    assert json.loads(out.read_text(encoding="utf-8")) == data.model_dump(mode="json")


def test_plain_probe_without_an_npu_says_so_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert kvcache_cli.main(["probe", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no NPU" in err[0] and "--backend emulated" in err[0]
    assert not out.exists()


def _break(data: dict, how: str):
    if how == "newer":
        data["probe_version"] = PROBE_VERSION + 1
        data["a_field_from_the_future"] = 1
    elif how == "missing":
        del data["questions"]["repeated_slots"]
    elif how == "unknown_question":
        data["questions"]["flux_capacitor"] = data["questions"]["repeated_slots"]
    elif how == "bad_reading":
        data["questions"]["window_pre_tokens"]["reading"] = "both"
    elif how == "bad_type":
        data["probe_version"] = "one"
    elif how == "no_reading":
        del data["questions"]["band_at_single_query"]["reading"]
    elif how == "kind":
        data["kind"] = "selection-manifest"
    return data


@pytest.mark.parametrize(("how", "field"), [
    ("newer", "probe_version"), ("missing", "questions.repeated_slots"),
    ("unknown_question", "questions.flux_capacitor"), ("bad_reading", "questions.window_pre_tokens.reading"),
    ("bad_type", "probe_version"), ("no_reading", "questions.band_at_single_query.reading"), ("kind", "kind"),
])
def test_a_bad_readings_file_is_refused_naming_the_field(tmp_path, how, field):
    path = write(tmp_path, _break(measured(), how))
    with pytest.raises(InputError) as info:
        load_readings(path)
    assert info.value.where == path and info.value.field == field


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", ""])
def test_a_malformed_file_is_refused(tmp_path, text):
    path = write(tmp_path, text)
    with pytest.raises(InputError) as info:
        load_readings(path)
    assert info.value.where == path


@pytest.mark.parametrize("command", ["analyze", "validate"])
def test_the_commands_refuse_a_bad_file_in_one_line(tmp_path, capsys, command):
    path = write(tmp_path, _break(measured(), "missing"))
    if command == "analyze":
        argv = ["analyze", "--config", GPT_OSS, "--device-readings", path, "--out", str(tmp_path / "m.json")]
    else:
        argv = ["validate", "--manifest", "m.json", "--rendered", "r", "--config", GPT_OSS, "--device-readings", path]
    assert kvcache_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {path}: questions.repeated_slots: missing: re-run `kvcache probe` (a question is never "
                   "assumed)"]
    assert not (tmp_path / "m.json").exists()


# --------------------------------------------------------------------------- analyze
def test_analyze_derives_pre_tokens_from_the_measured_window_reading(tmp_path):
    window = 128  # gpt-oss sliding_window
    inclusive = write(tmp_path, as_device(measured(DeviceReadings(window_pre_tokens="inclusive"))))
    m = analyze(AnalyzeRequest(config=GPT_OSS, framework_api="G2", deploy_mode="framework",
                               device_readings=inclusive))
    sliding = [layer for layer in m.layers if layer.attn_type == "SlidingWindow"]
    assert sliding and {layer.pre_tokens for layer in sliding} == {window}
    deps = {d.question: d for d in m.device_dependencies}
    assert deps["window_pre_tokens"].assumed == "inclusive" and deps["window_pre_tokens"].status == "confirmed"
    assert {d.status for d in deps.values()} == {"confirmed"} and set(deps) >= {"repeated_slots"}
    assert m.device_readings.file == inclusive and m.device_readings.soc == "Ascend910B3"
    # MLA decode (rope, Q_S 1) with sparse_mode 3 follows its switch: the default reading, measured as such
    assert m.device_readings.settled["mla_decode_sparse_mode3"] == "same_as_mode0"
    table = decisions_markdown(m)
    assert f"读法文件 `{inclusive}`" in table and "Ascend910B3" in table and "CANN 8.3.RC1" in table
    assert "- window_pre_tokens: 实测确认:实测 inclusive" in table
    assert "需 NPU 实测确认" not in table
    # without a readings file the same design is an assumption, and pre_tokens follows the default
    plain = analyze(AnalyzeRequest(config=GPT_OSS, framework_api="G2", deploy_mode="framework"))
    assert {d.status for d in plain.device_dependencies} == {"assumed"} and plain.device_readings is None
    assert {layer.pre_tokens for layer in plain.layers if layer.sliding_window} == {window - 1}
    assert "假设 honoured(未实测)" in decisions_markdown(plain)


def test_a_stated_window_reading_that_contradicts_the_measurement_is_refused(tmp_path, capsys):
    path = write(tmp_path, as_device(measured(DeviceReadings(window_pre_tokens="inclusive"))))
    argv = ["analyze", "--config", GPT_OSS, "--window-reading", "exclusive", "--device-readings", path]
    assert kvcache_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--window-reading: exclusive contradicts the reading 'inclusive'" in err


def test_a_contradicted_and_an_unknown_question_are_reported_per_question(tmp_path):
    data = as_device(measured(DeviceReadings(band_at_single_query="ignored", repeated_slots="error")))
    data["questions"]["window_pre_tokens"]["reading"] = "unknown"
    path = write(tmp_path, data)
    m = analyze(AnalyzeRequest(config=GPT_OSS, framework_api="G2", deploy_mode="framework", device_readings=path))
    deps = {d.question: d for d in m.device_dependencies}
    assert (deps["band_at_single_query"].status, deps["band_at_single_query"].measured) == ("contradicted", "ignored")
    assert deps["repeated_slots"].status == "contradicted"
    assert deps["window_pre_tokens"].status == "unknown" and deps["window_pre_tokens"].assumed == "exclusive"
    assert {layer.pre_tokens for layer in m.layers if layer.sliding_window} == {127}  # default, not measured
    assert m.device_readings.unknown == ["window_pre_tokens"]
    assert any("band_at_single_query: measured 'ignored'" in w.message for w in m.warnings)
    assert any(q.message.startswith("window_pre_tokens: the probe's output matched no known reading")
               for q in m.open_questions)
    table = decisions_markdown(m)
    assert "band_at_single_query: 实测否定:实测 ignored" in table and "实测输出不符合任何已知读法" in table


def test_an_emulated_readings_file_is_flagged_as_a_dry_run(tmp_path):
    path = write(tmp_path, measured())
    m = analyze(AnalyzeRequest(config=GPT_OSS, framework_api="G2", device_readings=path))
    assert m.device_readings.backend == "emulated"
    assert any("emulated backend" in w.message for w in m.warnings)
    assert "CPU 仿真 dry run" in decisions_markdown(m)


# Every way the table and the manifest can call a reading measured.
MEASURED_LABELS = ("实测确认", "实测否定", "读法文件实测", "已实测", "实测输出", "measured (")


def test_dry_run_readings_are_never_labelled_measured(tmp_path):
    """A dry run (`kvcache probe --backend emulated`) reads the emulator's own switches: the manifest keeps
    every dependency assumed and settles nothing, and no table line calls it measured (issue 26)."""
    data = measured()
    path = write(tmp_path, data)
    m = analyze(AnalyzeRequest(config=GPT_OSS, framework_api="G2", deploy_mode="framework", device_readings=path))
    deps = {d.question: d for d in m.device_dependencies}
    assert set(deps) >= {"band_at_single_query", "window_pre_tokens", "repeated_slots"}
    assert {(d.status, d.measured) for d in deps.values()} == {("assumed", None)}
    assert m.device_readings.backend == "emulated" and m.device_readings.settled == {}
    table, text = decisions_markdown(m), m.to_json()
    assert [label for label in MEASURED_LABELS if label in table or label in text] == []
    assert "不算实测" in table and "假设 honoured(未实测)" in table
    # an older manifest that recorded a dry run's readings as confirmed still reads as assumed
    old = m.model_copy(update={"device_dependencies": [d.model_copy(update={"status": "confirmed", "measured":
                                                                            d.assumed}) for d in m.device_dependencies]})
    assert not [label for label in MEASURED_LABELS if label in decisions_markdown(old)]
    # negative control: the same readings from an NPU host are measured, and said so
    device = analyze(AnalyzeRequest(config=GPT_OSS, framework_api="G2", deploy_mode="framework",
                                    device_readings=write(tmp_path, as_device(data), "npu.json")))
    assert {d.status for d in device.device_dependencies} == {"confirmed"}
    assert "实测确认" in decisions_markdown(device)


def test_a_dry_run_window_reading_is_named_a_dry_run(tmp_path, capsys):
    path = write(tmp_path, measured(DeviceReadings(window_pre_tokens="inclusive")))
    argv = ["analyze", "--config", GPT_OSS, "--window-reading", "exclusive", "--device-readings", path]
    assert kvcache_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "contradicts the dry-run reading 'inclusive' of the emulated backend" in err and "measured" not in err


def test_the_probe_report_of_a_dry_run_says_dry_run(tmp_path):
    from model_infer_kvcache.analyzer.readings_file import ReadingsFile
    from model_infer_kvcache.validators.probe.run import markdown, table_text

    dry = ReadingsFile.model_validate(measured())
    for text in (table_text(dry), markdown(dry)):
        assert "dry-run reading" in text and "measured" not in text.replace("not a device measurement", "")
    device = ReadingsFile.model_validate(as_device(measured()))  # negative control: an NPU file is measured
    assert "measured reading" in table_text(device) and "Device readings measured" in markdown(device)


def test_device_settled_is_empty_for_a_dry_run(tmp_path):
    from model_infer_kvcache.analyzer.measured import device_settled

    dry = load_readings(write(tmp_path, measured()))
    device = load_readings(write(tmp_path, as_device(measured()), "npu.json"))
    assert device_settled(dry) == {} and device_settled(None) == {}
    assert device_settled(device) == device.settled() and "window_pre_tokens" in device_settled(device)


# --------------------------------------------------------------------------- validate
@pytest.mark.slow
def test_validate_runs_under_the_measured_readings_and_skips_settled_sweeps(tmp_path):
    # Rendered for the inclusive reading: wrong under the emulator's default (exclusive), see
    # test_validators_negative.py::test_window_pre_tokens_off_by_one_is_caught; right on a device
    # measured to count the query inside pre_tokens.
    manifest, rendered, cfg = render_case(tmp_path, "gpt_oss_20b", framework_api="G2", window_reading="inclusive")
    path = write(tmp_path, as_device(measured(DeviceReadings(window_pre_tokens="inclusive"))))
    report = validate(ValidateRequest(manifest=str(manifest), rendered=str(rendered), config=str(cfg),
                                      backend="emulated", sweep_readings=True, device_readings=path))
    assert report.passed, [c for c in report.failed()]
    assert report.readings["window_pre_tokens"] == "inclusive"
    assert any("window_pre_tokens settled by measurement (inclusive): sweep skipped" in n for n in report.notes)
    assert any("band_at_single_query settled by measurement (honoured): sweep skipped" in n for n in report.notes)
    assert any(n.startswith(f"device readings measured in {path}") and "Ascend910B3" in n for n in report.notes)


def test_validate_calls_a_dry_run_a_dry_run_and_says_why_dependencies_are_not_swept(tmp_path):
    """A dry-run file settles nothing (no 'settled by measurement'), and the framework design's dependencies
    the sweep cannot tell apart (null block, padded rows' repeated slots) each get their reason."""
    from model_infer_kvcache.validators.pipeline.request_stream import QUICK

    manifest, rendered, cfg = render_case(tmp_path, "qwen3_8b", framework_api="G2", deploy_mode="framework")
    path = write(tmp_path, measured())
    report = validate(ValidateRequest(manifest=str(manifest), rendered=str(rendered), config=str(cfg),
                                      backend="emulated", scenario=QUICK, sweep_readings=True, device_readings=path))
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert any(n.startswith(f"dry-run readings of the emulated backend in {path}") for n in report.notes)
    assert not [n for n in report.notes if "measured" in n or "settled by measurement" in n]
    for question in ("repeated_slots", "null_block_contents"):
        assert f"{question} not swept: {QUESTIONS[question].unswept}" in report.notes


@pytest.mark.slow
def test_checkout_mode_runs_under_the_measured_readings(tmp_path):
    """The checkout mode takes --device-readings too: upstream gpt-oss (pre_tokens = W) passes on a device
    measured to count the query inside pre_tokens, and the settled question is not swept."""
    from checkout_support import ORACLE
    from model_infer_kvcache.validators.checkout_run import CheckoutRequest, validate_checkout
    from shared_dirs import upstream_head

    path = write(tmp_path, as_device(measured(DeviceReadings(window_pre_tokens="inclusive"))))
    # the transformers oracle alone: not a test of the recompute oracle (tests/checkout_support.py)
    report = validate_checkout(CheckoutRequest(str(upstream_head()), "gpt_oss", str(CONFIGS / "gpt_oss_20b.json"),
                                               device_readings=path, oracle=ORACLE))
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert report.readings["window_pre_tokens"] == "inclusive"
    assert any("window_pre_tokens settled by measurement (inclusive): sweep skipped" in n for n in report.notes)
