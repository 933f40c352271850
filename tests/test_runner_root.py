"""`kvcache validate --runner-root FOLDER` (issue 42 steps 1-2): a standalone folder's own runner, driven on CPU as
its entry script drives it, judged on its own tensors and by the recompute oracle. The folder is the snapshot's
models/pangu_7b (openPangu has no transformers class: the recompute oracle is the only one there is).

Runner mistakes, each in a copy of the unmodified runner: the decode write position off by one (both ways) and the
cache allocated again on every call.
The config the folder reads (step 5): a config.json lacking fields is read through the folder's own config class; a
field no class supplies is bad input naming the field and the model's file:line.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
from shared_dirs import ROOT, upstream_head

KV_LEN = 'kv_len = torch.max(model_inputs.get("position_ids"), axis=1)[0] + 1'
GUARD = ('        if past_key_values is None:\n            self.past_key_values = self.model.init_cache(input_ids)\n'
         '            input_dict["past_key_values"] = self.past_key_values\n')
UNGUARDED = ('        self.past_key_values = self.model.init_cache(input_ids)\n'
             '        input_dict["past_key_values"] = self.past_key_values\n')


def _folder():
    return upstream_head() / "models" / "pangu_7b"


def _copy(tmp_path, old: str, new: str):
    text = (_folder() / "runner_openpangu_dense.py").read_text(encoding="utf-8")
    assert old in text
    path = tmp_path / "runner_openpangu_dense.py"
    path.write_text(text.replace(old, new, 1), encoding="utf-8")
    return path


def _validate(runner_file=None):
    from model_infer_kvcache.validators.runner_run import RunnerRequest, validate_runner

    return validate_runner(RunnerRequest(str(_folder()), runner_file=str(runner_file) if runner_file else None))


def _by_id(report):
    return {c.id: c for c in report.checks}


def _def_line(name: str) -> int:
    text = (_folder() / "runner_openpangu_dense.py").read_text(encoding="utf-8").splitlines()
    return next(i for i, t in enumerate(text, 1) if t.strip().startswith(f"def {name}("))


def test_the_unmodified_pangu_runner_passes_and_the_report_says_what_was_driven():
    report = _validate()
    checks = _by_id(report)
    assert report.passed, [(c.id, c.detail) for c in report.failed()]
    assert set(checks) == {"V224", "V115", "V225", "V305", "V306", "V407"}
    assert checks["V225"].measured["write_sites"] == ["modeling_openpangu_dense.py:948", "modeling_openpangu_dense.py:949"]
    assert float(checks["V305"].measured["max_abs_diff"]) <= 1e-5 < float(checks["V305"].measured["logit_max_abs"])
    notes = "\n".join(report.notes)
    assert "one batch of 4 prompts (40, 17, 48, 29 tokens, padded by the runner), 6 steps" in notes
    assert "driven: models/model_setting.py check_vars(world_size=1, settings) (infer.py)" in notes
    assert "driven: PanguEmbeddedRunner.model_generate(prompts, warm_up=True), then model_generate(prompts)" in notes
    replaced = "\n".join(report.provenance["replaced"])
    assert "ModelRunner.init_device: the npu:N device is the CPU" in replaced
    assert "config: PanguEmbeddedConfig (configuration_openpangu_dense.py) at its defaults" in replaced
    assert report.provenance["yaml"].endswith("openpangu_v5_7b.yaml (the folder's eager, unquantized yaml)")


@pytest.mark.parametrize(("new", "written"), [
    ('kv_len = torch.max(model_inputs.get("position_ids"), axis=1)[0]', 39),  # forgot the +1: overwrites the last
])
def test_a_decode_position_off_by_one_fails_by_name_with_file_and_line(tmp_path, new, written):
    report = _validate(_copy(tmp_path, KV_LEN, new))
    checks = _by_id(report)
    assert not checks["V225"].passed and not checks["V305"].passed
    assert checks["V225"].detail.startswith(f"decode step 1 row 0 wrote positions [{written}], the new token's "
                                            "position is 40 (prompt 40 + 0 generated); the cache writes: "
                                            "modeling_openpangu_dense.py:948, modeling_openpangu_dense.py:949; kv_len "
                                            "comes from PanguEmbeddedRunner.model_output_process "
                                            f"(runner_openpangu_dense.py:{_def_line('model_output_process')})")
    assert checks["V305"].detail == "first failure at step 1 (decode) row 0"


def test_a_position_past_the_end_is_named_where_it_stops_and_where_it_wrote(tmp_path):
    """kv_len one too far: the rows write one position late, and the last decodes index past the RoPE table."""
    report = _validate(_copy(tmp_path, KV_LEN, KV_LEN.replace("+ 1", "+ 2")))
    checks = _by_id(report)
    assert re.match(r"modeling_openpangu_dense\.py:\d+: IndexError", checks["V224"].detail), checks["V224"].detail
    assert checks["V225"].detail.startswith("decode step 1 row 0 wrote positions [41], the new token's position is 40")


def test_caches_allocated_on_every_call_fail_the_release_link(tmp_path):
    report = _validate(_copy(tmp_path, GUARD, UNGUARDED))
    checks = _by_id(report)
    assert not checks["V407"].passed and not checks["V305"].passed
    assert checks["V407"].detail == ("step 1 of 8 (warm-up 2 then the run) uses cache tensors other than the first "
                                     "step's: the runner allocated again (its caches come from "
                                     "PanguEmbeddedRunner.model_input_prepare (runner_openpangu_dense.py:"
                                     f"{_def_line('model_input_prepare')}))")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "model_infer_kvcache", "validate", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=600)


def test_cli_exit_status_and_one_line_bad_input(tmp_path):
    wrong = _copy(tmp_path, KV_LEN, KV_LEN.replace("+ 1", ""))
    out = _cli("--runner-root", str(_folder()), "--runner-file", str(wrong), "--report", str(tmp_path / "r.json"))
    assert out.returncode == 1, out.stderr[-2000:]
    failed = [ln for ln in out.stderr.splitlines() if ln.startswith("FAILED")]
    assert failed[0].startswith("FAILED [runtime] each decode step writes every row's cache at the new token's position")
    for args, flag in ((["--runner-root", str(upstream_head() / "models" / "qwen")], "--runner-root"),
                       (["--runner-root", str(_folder()), "--model", "qwen3_8b"], "--model"),
                       (["--runner-file", str(wrong), "--config", "c.json"], "--runner-file")):
        bad = _cli(*args)
        lines = [ln for ln in bad.stderr.splitlines() if ln.strip()]
        assert bad.returncode == 2 and len(lines) == 1 and flag in lines[0], bad.stderr[-1000:]


def _pangu_config() -> dict:
    sys.path.insert(0, str(_folder()))
    try:
        from models.configuration_openpangu_dense import PanguEmbeddedConfig
    finally:
        sys.path.pop(0)
        for name in [n for n in sys.modules if n == "models" or n.startswith("models.")]:
            sys.modules.pop(name)
    return PanguEmbeddedConfig().to_dict()


def test_a_config_json_lacking_a_field_is_read_through_the_folders_config_class(tmp_path):
    """rms_norm_eps and rope_theta left out of config.json: the folder's PanguEmbeddedConfig supplies its defaults,
    and the report says which class read which file."""
    from model_infer_kvcache.validators.runner_run import RunnerRequest, validate_runner

    data = {k: v for k, v in _pangu_config().items() if k not in ("rms_norm_eps", "rope_theta")}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data, default=str), encoding="utf-8")
    report = validate_runner(RunnerRequest(str(_folder()), config=str(path)))
    assert report.passed, [(c.id, c.detail) for c in report.failed()]
    assert f"config: PanguEmbeddedConfig (configuration_openpangu_dense.py) reading {path}" in \
        report.provenance["replaced"]


def test_a_field_no_config_class_supplies_is_exit_2_naming_field_and_line(tmp_path):
    """The model reads config.qk_clip_threshold, which neither the config.json nor PanguEmbeddedConfig has: one
    bad-input line naming the field and the model's file:line, not the model's runtime failure."""
    root = tmp_path / "cann-recipes-infer"
    shutil.copytree(upstream_head(), root)
    model = root / "models" / "pangu_7b" / "models" / "modeling_openpangu_dense.py"
    lines = model.read_text(encoding="utf-8").splitlines()
    at = next(i for i, t in enumerate(lines) if t.strip() == "self.scale_fa = 1 / (self.head_dim ** 0.5)")
    lines.insert(at, "        self.qk_clip = config.qk_clip_threshold")
    model.write_text("\n".join(lines) + "\n", encoding="utf-8")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_pangu_config(), default=str), encoding="utf-8")
    out = _cli("--runner-root", str(root / "models" / "pangu_7b"), "--config", str(path))
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert out.returncode == 2 and len(errors) == 1, out.stderr[-2000:]
    assert "qk_clip_threshold" in errors[0] and f"modeling_openpangu_dense.py:{at + 1}" in errors[0], errors[0]
