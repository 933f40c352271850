"""`kvcache render` on bad input (exit 2, one stderr line, nothing written), determinism, headers,
and the manifest checks that keep unrenderable designs out of generated code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from model_infer_kvcache.analyzer.manifest_io import load_manifest
from model_infer_kvcache.analyzer.version import __version__
from model_infer_kvcache.implementer import cli as render_cli
from model_infer_kvcache.implementer import render as render_mod
from model_infer_kvcache.implementer.render import Rendered, render_manifest, write_rendered
from model_infer_kvcache.implementer.template_context import Names, build_context

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
GPT_OSS = GOLDEN / "gpt_oss" / "framework_g2" / "manifest.json"
DEEPSEEK = GOLDEN / "deepseek_v3" / "standalone" / "manifest.json"
GEMMA_LEGACY = GOLDEN / "gemma2_legacy" / "framework_g2" / "manifest.json"


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = render_cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (hidden temp files included) with its bytes."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _assert_one_error_line(code: int, out: str, err: str, *needles: str) -> None:
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def _edited(tmp_path: Path, source: Path, edit) -> Path:
    data = json.loads(source.read_text(encoding="utf-8"))
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.pop("fa"), "fa"),
    (lambda d: d.update(block_size="big"), "block_size"),
    (lambda d: d["layers"][3]["sparse_mode"].update(decode="four"), "layers.3.sparse_mode.decode"),
    (lambda d: d.update(unexpected=1), "unexpected"),
    (lambda d: d["model"].update(dtype="float64"), "model.dtype"),
])
def test_schema_invalid_manifest_names_the_field_and_writes_nothing(tmp_path, capsys, edit, field):
    manifest = _edited(tmp_path, GPT_OSS, edit)
    out = tmp_path / "out"
    code, stdout, err = _run(capsys, "--manifest", manifest, "--out", out)
    _assert_one_error_line(code, stdout, err, str(manifest), field)
    assert not out.exists()


def test_unreadable_manifest_files(tmp_path, capsys):
    not_json = tmp_path / "m.json"
    not_json.write_text("{not json", encoding="utf-8")
    for path, needle in ((tmp_path / "missing.json", "file not found"), (not_json, "not a valid selection manifest")):
        code, stdout, err = _run(capsys, "--manifest", path, "--out", tmp_path / "out")
        _assert_one_error_line(code, stdout, err, needle)
    assert not (tmp_path / "out").exists()


def test_blocked_manifest_needs_allow_blocked(tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, err = _run(capsys, "--manifest", GEMMA_LEGACY, "--out", out)
    _assert_one_error_line(code, stdout, err, "blockers", "soft-capping", "--allow-blocked")
    assert not out.exists()
    code, stdout, _ = _run(capsys, "--manifest", GEMMA_LEGACY, "--out", out, "--allow-blocked")
    assert code == 0 and sorted(_snapshot(out)) == ["INTEGRATION.md", "kvcache_attention.py"]


@pytest.mark.parametrize("flag, value", [
    ("--attention-class", "1abc"), ("--attention-class", "class"), ("--model-class", "my-model"),
    ("--runner-class", "None"), ("--attn-attr", "self_attn; import os"), ("--attn-attr", "\ufb01le"),
])
def test_invalid_identifier_is_refused(tmp_path, capsys, flag, value):
    out = tmp_path / "out"
    code, stdout, err = _run(capsys, "--manifest", GPT_OSS, "--out", out, flag, value)
    _assert_one_error_line(code, stdout, err, flag, "not a valid Python identifier")
    assert not out.exists()


@pytest.mark.parametrize("argv, needle", [
    (("--attention-class", "torch"), "shadow"),
    (("--model-class", "CacheEntry"), "shadow"),
    (("--runner-class", "BLOCK_SIZE"), "shadow"),
    (("--attention-class", "Same", "--model-class", "Same"), "each class needs its own"),
])
def test_class_names_that_would_break_the_module_are_refused(tmp_path, capsys, argv, needle):
    out = tmp_path / "out"
    code, stdout, err = _run(capsys, "--manifest", GPT_OSS, "--out", out, *argv)
    _assert_one_error_line(code, stdout, err, needle)
    assert not out.exists()


def test_valid_names_reach_the_code(tmp_path, capsys):
    out = tmp_path / "out"
    code, _, _ = _run(capsys, "--manifest", DEEPSEEK, "--out", out, "--attention-class", "DeepseekKV",
                      "--runner-class", "DeepseekRunnerKV")
    assert code == 0
    assert "class DeepseekKV:" in (out / "kvcache_attention.py").read_text()
    assert "class DeepseekRunnerKV:" in (out / "kvcache_runner.py").read_text()


def _escaping(rendered: Rendered, rel: str) -> Rendered:
    return Rendered({**rendered.files, rel: "print('escaped')\n"}, rendered.context)


@pytest.mark.parametrize("rel", ["../evil.py", "sub/../../evil.py", "/tmp/kvcache_evil_abs.py"])
def test_output_path_outside_out_is_refused_before_any_write(tmp_path, rel):
    rendered = _escaping(render_manifest(load_manifest(GPT_OSS)), rel)
    out = tmp_path / "out"
    with pytest.raises(InputError, match="escapes --out"):
        write_rendered(rendered, out)
    assert not out.exists() and not (tmp_path / "evil.py").exists()
    assert not Path("/tmp/kvcache_evil_abs.py").exists()


def test_symlink_pointing_outside_out_is_refused(tmp_path):
    outside = tmp_path / "outside.py"
    outside.write_text("keep me\n", encoding="utf-8")
    out = tmp_path / "out"
    out.mkdir()
    (out / "kvcache_attention.py").symlink_to(outside)
    with pytest.raises(InputError, match="escapes --out"):
        write_rendered(render_manifest(load_manifest(GPT_OSS)), out, force=True)
    assert outside.read_text() == "keep me\n" and sorted(p.name for p in out.iterdir()) == ["kvcache_attention.py"]


def test_escaping_path_through_the_cli_exits_2(tmp_path, capsys, monkeypatch):
    real = render_mod.render_manifest
    monkeypatch.setattr(render_mod, "render_manifest", lambda *a, **k: _escaping(real(*a, **k), "../evil.py"))
    out = tmp_path / "out"
    code, stdout, err = _run(capsys, "--manifest", GPT_OSS, "--out", out)
    _assert_one_error_line(code, stdout, err, "escapes --out")
    assert not out.exists() and not (tmp_path / "evil.py").exists()


def test_existing_file_without_force_leaves_everything_unchanged(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    # Only the last file in write order exists: the earlier ones must not be written either.
    (out / "kvcache_runner.py").write_text("user code\n", encoding="utf-8")
    before = _snapshot(out)
    code, stdout, err = _run(capsys, "--manifest", DEEPSEEK, "--out", out)
    _assert_one_error_line(code, stdout, err, "kvcache_runner.py", "--force")
    assert _snapshot(out) == before
    code, stdout, _ = _run(capsys, "--manifest", DEEPSEEK, "--out", out, "--force")
    assert code == 0 and len(stdout.splitlines()) == 3
    assert (out / "kvcache_runner.py").read_text() != "user code\n"


def test_failed_write_restores_replaced_files_and_removes_new_ones(tmp_path, monkeypatch):
    out = tmp_path / "deep" / "out"
    out.mkdir(parents=True)
    (out / "kvcache_attention.py").write_text("old attention\n", encoding="utf-8")
    before = _snapshot(tmp_path)
    calls = []

    def failing_write(path, text):
        calls.append(path.name)
        if len(calls) == 3:
            raise OSError("disk full")
        real_write(path, text)

    real_write = render_mod.atomic_write_text
    monkeypatch.setattr(render_mod, "atomic_write_text", failing_write)
    with pytest.raises(OSError, match="disk full"):
        write_rendered(render_manifest(load_manifest(DEEPSEEK)), out, force=True)
    assert calls == ["INTEGRATION.md", "kvcache_attention.py", "kvcache_runner.py"]
    assert _snapshot(tmp_path) == before  # the replaced file has its old bytes, the new one is gone


def test_failed_write_removes_directories_it_created(tmp_path, monkeypatch):
    def boom(path, text):
        raise OSError("read-only")

    monkeypatch.setattr(render_mod, "atomic_write_text", boom)
    with pytest.raises(OSError):
        write_rendered(render_manifest(load_manifest(GPT_OSS)), tmp_path / "a" / "b")
    assert list(tmp_path.iterdir()) == []


def test_out_that_is_a_file_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    out.write_text("x", encoding="utf-8")
    code, stdout, err = _run(capsys, "--manifest", GPT_OSS, "--out", out)
    _assert_one_error_line(code, stdout, err, "not a directory")
    assert out.read_text() == "x"


# ----------------------------------------------------------------------------- manifests no template renders


def _manifest_with(source: Path, edit) -> SelectionManifest:
    data = json.loads(source.read_text(encoding="utf-8"))
    edit(data)
    return SelectionManifest.model_validate(data)


def test_linear_attention_layers_get_a_clear_message():
    """Gated-delta-net, KDA and lightning states render (templates/kinds/recurrent_state.py.j2; lightning: one recurrent
    state, no conv); states of a Legacy (contiguous-cache) plan are refused naming the state field and the family;
    Kimi-Linear's NoPE MLA renders position-free."""
    from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze

    configs = ROOT / "tests" / "fixtures" / "configs"
    rendered = render_manifest(analyze(AnalyzeRequest(config=str(configs / "qwen3_next.json"))))
    assert "npu_recurrent_gated_delta_rule" in rendered.files["kvcache_attention.py"]
    ling = render_manifest(analyze(AnalyzeRequest(config=str(configs / "ling_2_5.json")))).files["kvcache_attention.py"]
    assert "def lightning_recurrence(" in ling and 'cache_name="recurrent_state"' in ling
    assert "conv_state" not in ling and "CONV_KERNEL" not in ling
    m = analyze(AnalyzeRequest(config=str(configs / "ling_2_5.json"), kv_mode="legacy"))
    with pytest.raises(InputError) as info:
        render_manifest(m, allow_blocked=True)
    text = info.value.render()
    assert "recurrent state" in text and "lightning_attention, Legacy" in text and "layers[0].states" in text
    assert "references/hybrid_linear.md" in text
    # Kimi-Linear's position-free MLA renders (tests/test_position_free_mla.py): no cos/sin in its attention call
    kimi = render_manifest(analyze(AnalyzeRequest(config=str(configs / "kimi_linear.json")))).files
    assert "def kv_cache_attention(self, q_nope, q_pe, compressed_kv, forward_metadata):" in kimi["kvcache_attention.py"]


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d["fa"].update(input_layout='TND", evil="1'), "fa.input_layout"),
    (lambda d: d["fa"].update(softmax_scale=float("inf")), "fa.softmax_scale"),
    (lambda d: d.update(block_size=100), "block_size"),
    (lambda d: [layer["caches"][0].update(name="k_cache = None; import os") for layer in d["layers"]],
     "layers[0].caches"),
    (lambda d: d["layers"][1].update(group_key="full_group"), "layers[1].group_key"),
    (lambda d: d["layers"][0]["sparse_mode"].update(decode=7), "layers[0].sparse_mode.decode"),
    (lambda d: d["layers"][1]["mask"].update(prefill="none"), "layers[1].mask.prefill"),
    (lambda d: d["layers"][0].update(pre_tokens=500), "layers[0].pre_tokens"),
    (lambda d: d["layers"][2].update(layer_kind="chunked"), "layers[2].layer_kind"),
    (lambda d: d["layers"][4]["caches"][1].update(dim=32), "layers[4].caches"),
    (lambda d: d["model"].update(model_type='x"""\nimport os'), "model.model_type"),
])
def test_manifest_values_that_would_reach_code_are_validated(edit, needle, tmp_path):
    # Refused on load (the manifest's own invariants) or by the render context: either way named.
    data = json.loads(GPT_OSS.read_text(encoding="utf-8"))
    edit(data)
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(InputError) as info:
        render_manifest(load_manifest(path))
    assert needle in info.value.render()


def test_free_text_reaches_comments_on_one_line():
    def edit(d):
        d["fa"]["scale_derivation"] = "64^-0.5\nimport os\r\nos.system('x')"
        for layer in d["layers"]:
            if layer["window_derivation"]:
                layer["window_derivation"] = "W=128\n\nraise SystemExit"

    rendered = render_manifest(_manifest_with(GPT_OSS, edit))
    code = rendered.files["kvcache_attention.py"]
    compile(code, "kvcache_attention.py", "exec")
    assert "\nimport os" not in code and "\nraise SystemExit" not in code
    assert "# 64^-0.5 import os os.system('x')" in code


def test_mla_manifest_checks():
    with pytest.raises(InputError, match="model.mla.kv_lora_rank"):
        render_manifest(_manifest_with(DEEPSEEK, lambda d: d["model"]["mla"].update(kv_lora_rank=500)))
    with pytest.raises(InputError, match="mla.absorb"):
        render_manifest(_manifest_with(DEEPSEEK, lambda d: d["mla"].update(absorb=False)))


def test_framework_api_flag_must_not_contradict_the_manifest():
    with pytest.raises(InputError, match="contradicts"):
        build_context(load_manifest(GPT_OSS), Names(), "G1")


# ----------------------------------------------------------------------------- determinism and headers


def test_same_manifest_gives_byte_identical_files(tmp_path, capsys):
    for folder in ("a", "b"):
        assert _run(capsys, "--manifest", DEEPSEEK, "--out", tmp_path / folder)[0] == 0
    assert _snapshot(tmp_path / "a") == _snapshot(tmp_path / "b")
    # Another process with another hash seed (set/dict order) gives the same bytes too.
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run([sys.executable, "-m", "model_infer_kvcache.implementer", "--manifest", str(GPT_OSS), "--out", str(tmp_path / "c")],
                   check=True, capture_output=True, cwd=ROOT, env=env, timeout=120)
    assert _run(capsys, "--manifest", GPT_OSS, "--out", tmp_path / "d")[0] == 0
    assert _snapshot(tmp_path / "c") == _snapshot(tmp_path / "d")


@pytest.mark.parametrize("source", [GPT_OSS, DEEPSEEK])
def test_every_file_starts_with_the_generated_header(source):
    manifest = load_manifest(source)
    for name, text in render_manifest(manifest).files.items():
        head = "\n".join(text.splitlines()[:3])
        assert f"Generated by model-infer-kvcache {__version__}" in head, name
        assert f"from selection manifest {manifest.content_hash()}" in head, name
        if name.endswith(".py"):
            assert text.startswith("# Generated by") and "Do not edit by hand" in head, name


def test_header_hash_changes_with_the_manifest():
    base = load_manifest(GPT_OSS)
    other = _manifest_with(GPT_OSS, lambda d: d.update(block_size=256))
    a = render_manifest(base).files["kvcache_attention.py"].splitlines()[0]
    b = render_manifest(other).files["kvcache_attention.py"].splitlines()[0]
    assert a != b and other.content_hash() in b


def test_full_layers_planned_full_for_a_window_covering_the_context_share_the_full_plan(tmp_path):
    """Olmo3Config's defaults: sliding_window 4096 >= max_position_embeddings 2048, so its sliding layers are planned
    full attention with a reason (window_derivation) the true full layers lack. The reason is not the plan: they
    render as one kind. Layers whose plans really differ are still refused."""
    import transformers
    from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze

    config = tmp_path / "config.json"
    config.write_text(json.dumps(transformers.Olmo3Config(num_hidden_layers=8).to_dict(), default=str))
    m = analyze(AnalyzeRequest(config=str(config), deploy_mode="framework"))
    assert {layer.attn_type for layer in m.layers} == {"FullAttention"}
    assert len({layer.window_derivation for layer in m.layers}) == 2  # with and without the reason
    assert "kvcache_attention.py" in render_manifest(m).files
    layers = [layer.model_copy(update={"sparse_mode": layer.sparse_mode.model_copy(update={"decode": 0})})
              if layer.index == 3 else layer for layer in m.layers]
    with pytest.raises(InputError, match=r"layers\[3\]: FullAttention layers disagree"):
        render_manifest(m.model_copy(update={"layers": layers}))
