"""BLT through the whole route: `kvcache run` (analyze -> render -> validate) of transformers' class-default BLT in
both deploy modes, and mistakes in the rendered file failing `kvcache validate` by check id.

The route runs the given render's code with the constants of the implementer's render of the CPU-sized section in
their place (validators/pipeline/byte_patch_run.run_manifest); its own constants are checked against the manifest
(V108). One `kvcache run` per mode, shared by the module (each ~10 s).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from model_infer_kvcache.analyzer.errors import InputError

MODES = {"framework": "部署模式：框架部署", "standalone": "部署模式：独立部署"}
ALL = {"V108", "V201", "V117", "V234", "V309", "V310", "V408"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """mode -> (config path, run folder) of `kvcache run` on the class-default BLT config."""
    from model_infer_kvcache.validators.end_to_end import main
    from transformers import CONFIG_MAPPING

    root = tmp_path_factory.mktemp("blt-route")
    config = root / "blt.json"
    config.write_text(json.dumps(CONFIG_MAPPING["blt"]().to_dict()), encoding="utf-8")
    out = {}
    for mode, dispatch in MODES.items():
        assert main(["--config", str(config), "--dispatch", dispatch, "--out", str(root / mode)]) == 0
        out[mode] = (config, root / mode)
    return out


@pytest.mark.parametrize("mode", list(MODES))
def test_kvcache_run_passes_in_both_modes(runs, mode):
    """Every check passes in each mode (logits within 1e-6 of transformers' full forward, float64); the render's
    header names the manifest's hash, and the modes' renders differ where the framework contract does: in framework
    mode the engine's per-manager tables and per-byte slots, the global stack's rows computed by the render from its
    own table and each row's patch index; in standalone mode the runner's own per stack. The device readings are
    swept (the window reading's dependency named in the notes). The render lints clean
    against its manifest (the decoder's cross-attention, sparse_mode 0 over a whole patch, silenced by its line)."""
    from model_infer_kvcache.validators.lint import lint_paths

    _, run = runs[mode]
    report = json.loads((run / "report.json").read_text(encoding="utf-8"))
    manifest = json.loads((run / "manifest.json").read_text(encoding="utf-8"))
    assert report["passed"] and {c["id"] for c in report["checks"]} == ALL, report["checks"]
    worst = next(c["measured"]["max_abs_diff"] for c in report["checks"] if c["id"] == "V309")
    assert worst < 1e-6 and report["dtype"] == "float64"
    # the device readings swept as for every kind: the byte stacks' band rests on the window reading (the CPU-sized
    # section planned under exclusive fails under inclusive: one key too many)
    assert any(n.startswith("the render depends on the device reading window_pre_tokens: it passes under exclusive")
               for n in report["notes"]), report["notes"]
    text = (run / "rendered" / "kvcache_attention.py").read_text(encoding="utf-8")
    assert text.splitlines()[0].endswith(f"from selection manifest {report['manifest_hash']}.")
    assert manifest["deploy_mode"]["value"] == mode and manifest["byte_patches"]["stacks"]
    framework = "forward_metadata.block_table[self.stack]" in text and "positions // block_size" in text
    assert framework == (mode == "framework"), text
    assert not (run / "rendered" / "kvcache_runner.py").exists()
    lint = lint_paths([str(run / "rendered" / "kvcache_attention.py")], manifest=str(run / "manifest.json"))
    assert not lint.findings and not lint.errors, lint.findings


def _validate_edited(runs, tmp_path, mode, edit):
    from model_infer_kvcache.validators.pipeline.validate import ValidateRequest, validate

    config, run = runs[mode]
    copy = tmp_path / mode
    shutil.copytree(run, copy)
    path = copy / "rendered" / "kvcache_attention.py"
    text = path.read_text(encoding="utf-8")
    assert edit(text) != text
    path.write_text(edit(text), encoding="utf-8")
    report = validate(ValidateRequest(manifest=str(copy / "manifest.json"), rendered=str(copy / "rendered"),
                                      config=str(config), backend="emulated", sweep_readings=False))
    return {c.id for c in report.checks if not c.passed}, report


@pytest.mark.parametrize("mode, edit, fails", [
    ("framework", lambda t: t.replace('if self.plan["rows_per"] == "patch":', "if False:"),
     {"V234", "V309", "V310"}),
    ("standalone", lambda t: t.replace("entropies[position] >", "entropies[position - 1] >"),
     {"V234", "V309", "V310"}),
    ("framework", lambda t: t.replace('"decoder_config": dict(num_heads=16, num_kv_heads=16, head_dim=64, '
                                      'scale=0.125', '"decoder_config": dict(num_heads=16, num_kv_heads=16, '
                                      'head_dim=64, scale=0.08838834764831845'), {"V108"}),
], ids=["framework-global-slots-from-the-byte-position", "standalone-boundary-a-byte-late",
        "decoder-constant-at-the-global-scale"])
def test_route_mistakes_fail_by_check_id(runs, tmp_path, mode, edit, fails):
    """Mistakes in a rendered file, through `kvcache validate`: in framework mode the global stack taking the engine's
    per-byte slot_mapping and kv lengths (a patch's row at its byte's slot: kv lengths off, logits NaN where unwritten
    rows are read), in standalone mode the boundary read on the previous byte's entropy (~2.0 off), and a constant
    edited away from the manifest (the decoder at the global stack's scale: V108 alone, the run using CPU-sized
    constants)."""
    failed, report = _validate_edited(runs, tmp_path, mode, edit)
    assert failed == fails, [(c.id, c.detail) for c in report.checks]


def test_a_config_or_render_that_does_not_belong_is_bad_input(runs, tmp_path):
    """`kvcache validate` refuses, before running, a BLT config whose stacks differ from the manifest's (naming the
    stack and field) and a render of the other mode's manifest (its header names another hash)."""
    from model_infer_kvcache.validators.pipeline.validate import ValidateRequest, validate

    config, run = runs["framework"]
    other = json.loads(config.read_text(encoding="utf-8"))
    other["decoder_config"]["num_key_value_heads"] = 8
    path = tmp_path / "other.json"
    path.write_text(json.dumps(other), encoding="utf-8")
    with pytest.raises(InputError) as err:
        validate(ValidateRequest(manifest=str(run / "manifest.json"), rendered=str(run / "rendered"), config=str(path),
                                 backend="emulated"))
    assert err.value.field == "--config" and "decoder_config num_kv_heads 8 (config) vs 16" in err.value.message
    with pytest.raises(InputError) as err:
        validate(ValidateRequest(manifest=str(run / "manifest.json"), rendered=str(Path(runs["standalone"][1]) /
                                                                                   "rendered"),
                                 config=str(config), backend="emulated"))
    assert err.value.field == "--rendered"
