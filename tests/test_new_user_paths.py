"""What a new user trips on (issue 45): hints that lead somewhere, a validation prefix that runs every layer plan,
reports that name the folders they are published in, and one MTP switch for every command that plans."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import transformers
from cli_support import invoke, saved_config
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.implementer.render import render_manifest
from model_infer_kvcache.validators.pipeline.tiny_model import tiny_config_dict
from shared_dirs import ROOT, shared_path

CONFIGS = ROOT / "tests" / "fixtures" / "configs"


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


# --- 1. a hint leads somewhere that works, and names the flags of the command the user ran -----------------------

@pytest.fixture(scope="module")
def llama4_text(tmp_path_factory) -> Path:
    """Llama-4-Scout's text model with a chunk of 8200 tokens, no multiple of the 128-token block: its chunked local
    attention is then a blocker (a chunk would start inside a block), and no template renders it on the Legacy path
    either (at the default 8192 it is planned paged and rendered: tests/test_chunked_attention.py)."""
    return saved_config(transformers.Llama4TextConfig(attention_chunk_size=8200), tmp_path_factory.mktemp("llama4"),
                        "llama4_text")


def test_run_gives_no_allow_blocked_hint_where_no_template_renders_the_model(llama4_text, tmp_path, capsys):
    rc, _, err = invoke(["run", "--config", llama4_text, "--out", tmp_path / "out"], capsys)
    line = _one_line(err)
    assert rc == 2 and "not supported by kvcache" in line and "chunked local attention" in line
    assert "--allow-blocked" not in line  # the old hint led to a render refusal
    assert not (tmp_path / "out").exists()


def test_run_with_allow_blocked_names_the_config_not_a_manifest_flag(llama4_text, tmp_path, capsys):
    rc, _, err = invoke(["run", "--config", llama4_text, "--out", tmp_path / "out", "--allow-blocked"], capsys)
    line = _one_line(err)
    assert rc == 2 and line.startswith(f"error: {llama4_text}:"), line
    assert "--manifest" not in line and "chunk" in line  # kvcache run takes no --manifest


def test_render_gives_no_allow_blocked_hint_where_no_template_renders_the_model(llama4_text, tmp_path, capsys):
    manifest = tmp_path / "manifest.json"
    assert invoke(["analyze", "--config", llama4_text, "--out", manifest], capsys)[0] == 0
    rc, _, err = invoke(["render", "--manifest", manifest, "--out", tmp_path / "r"], capsys)
    line = _one_line(err)
    assert rc == 2 and "not supported by kvcache" in line and "--allow-blocked" not in line


def test_the_hint_is_kept_where_it_works():
    """Gemma-2 (soft-cap) is blocked from the paged path; its Legacy render exists, so the hint stays and holds."""
    m = analyze(AnalyzeRequest(config=str(CONFIGS / "gemma2_9b.json")))
    with pytest.raises(InputError) as info:
        render_manifest(m)
    assert "--allow-blocked" in info.value.render()
    assert "kvcache_attention.py" in render_manifest(m, allow_blocked=True).files


# --- 2. the validation prefix holds one layer of every distinct plan ---------------------------------------------

def _tiny(config, tmp_path, name):
    path = saved_config(config, tmp_path, name)
    manifest = analyze(AnalyzeRequest(config=str(path)))
    return tiny_config_dict(json.loads(path.read_text(encoding="utf-8")), manifest)


def test_smollm3_prefix_runs_its_nope_layers(tmp_path):
    """SmolLM3 leaves RoPE out of every fourth layer (``no_rope_layers``); a 2-layer prefix never ran one."""
    d, plan = _tiny(transformers.SmolLM3Config(), tmp_path, "smollm3")
    assert 0 in d["no_rope_layers"] and 1 in d["no_rope_layers"], d["no_rope_layers"]
    assert plan.num_layers == d["no_rope_layers"].index(0) + 1 == 4
    note = next(n for n in plan.notes if "decoder layers" in n)
    assert "no_rope_layers=0" in note and "layer 3" in note  # the report says which plans ran


def test_a_late_nope_layer_lengthens_the_prefix_to_reach_it(tmp_path):
    """Negative control of the rule: a NoPE layer only at index 6 must be inside the prefix."""
    pattern = [1] * 6 + [0] + [1] * 29
    d, plan = _tiny(transformers.SmolLM3Config(no_rope_layers=pattern), tmp_path, "smollm3_late")
    assert plan.num_layers == 7 and d["no_rope_layers"] == pattern[:7]


def test_mlp_only_differences_do_not_lengthen_the_prefix(tmp_path):
    """DeepSeek-V3.2's dense-then-MoE list shapes no attention: the prefix stays the shortest one."""
    d, plan = _tiny(transformers.DeepseekV32Config(), tmp_path, "dsv32")
    assert plan.num_layers == 2


# --- 3. reports name the published paths ---------------------------------------------------------------------------

def _absolute_paths(text: str) -> set[str]:
    return {m.rstrip(".,;:)'\"`") for m in re.findall(r"(/[^\s'\",;`|)]+)", text)}


def test_run_report_names_the_published_render_and_no_gone_folder(tmp_path, capsys):
    """A window (1024) longer than CPU sequences: the checks run on a CPU-size render written to a temporary
    folder, and the run itself is staged beside --out; neither folder outlives the run."""
    data = json.loads((ROOT / "examples" / "tiny_qwen3" / "config.json").read_text(encoding="utf-8"))
    data.update(use_sliding_window=True, sliding_window=1024, max_window_layers=0, max_position_embeddings=8192)
    config = tmp_path / "windowed.json"
    config.write_text(json.dumps(data), encoding="utf-8")
    out = tmp_path / "out"
    rc, _, _ = invoke(["run", "--config", config, "--out", out], capsys)
    assert rc == 0
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    code = report["provenance"]["code_under_test"]
    assert str((out / "rendered").resolve()) in code and "removed after it" in code
    for name in ("report.json", "report.md"):
        text = (out / name).read_text(encoding="utf-8")
        assert "kvcache-run." not in text and "kvcache-validate-" not in text
        named = [p for p in _absolute_paths(text) if p.startswith(str(tmp_path))]
        assert named and all(Path(p).exists() for p in named), named


# --- 9. one MTP switch for every command that plans -----------------------------------------------------------------

@pytest.mark.parametrize("command", ["analyze", "run", "validate"])
def test_every_planning_command_takes_next_n(command, capsys):
    rc, out, _ = invoke([command, "--help"], capsys)
    assert rc == 0 and "--next-n N" in out and "speculative tokens per decode step" in out


def test_validate_refuses_a_next_n_the_manifest_was_not_analyzed_with(tmp_path, capsys):
    manifest, rendered = tmp_path / "m.json", tmp_path / "r"
    config = ROOT / "examples" / "tiny_qwen3" / "config.json"
    assert invoke(["analyze", "--config", config, "--out", manifest], capsys)[0] == 0
    assert invoke(["render", "--manifest", manifest, "--out", rendered], capsys)[0] == 0
    rc, _, err = invoke(["validate", "--manifest", manifest, "--rendered", rendered, "--config", config,
                         "--next-n", "1"], capsys)
    assert rc == 2 and _one_line(err).startswith("error: --next-n: 1 differs from the manifest's 0")


def test_next_n_0_builds_the_checkout_model_without_its_mtp_layers(tmp_path):
    """A published Ling-2.5 config has MTP layers, which the upstream folder refuses; --next-n 0 serves it without
    them: the tiny config the model reads says 0 (dropping the key let the config class's default decide)."""
    real = json.loads((CONFIGS / "ling_2_5.json").read_text(encoding="utf-8")) | {"num_nextn_predict_layers": 1}
    path = tmp_path / "ling_2_5_mtp.json"
    path.write_text(json.dumps(real), encoding="utf-8")
    d, plan = tiny_config_dict(real, analyze(AnalyzeRequest(config=str(path), next_n=0)))
    assert d["num_nextn_predict_layers"] == 0
    assert any("--next-n 0" in n for n in plan.notes)
    d, _ = tiny_config_dict(real, analyze(AnalyzeRequest(config=str(path))))  # MTP planned: the key is left out
    assert "num_nextn_predict_layers" not in d


def test_checkout_run_of_a_model_refusing_mtp_says_to_pass_next_n_0(tmp_path, capsys):
    root = shared_path("upstream", "cann-recipes-infer")
    config = tmp_path / "ling_2_5_mtp.json"
    data = json.loads((CONFIGS / "ling_2_5.json").read_text(encoding="utf-8")) | {"num_nextn_predict_layers": 1}
    config.write_text(json.dumps(data), encoding="utf-8")
    rc, out, _ = invoke(["validate", "--framework-root", root, "--model", "bailing_2_5", "--config", config,
                         "--attn-tp-size", "2", "--no-sweep"], capsys)
    assert rc == 1
    v202 = [line for line in out.splitlines() if "V202" in line and "❌" in line]
    assert v202 and all("NotImplementedError" in line and "--next-n 0" in line for line in v202), v202


# --- 10. one encoder-length flag for every command that plans or checks a plan ------------------------------------

@pytest.mark.parametrize("command", ["analyze", "run", "validate"])
def test_every_planning_command_takes_encoder_length(command, capsys):
    rc, out, _ = invoke([command, "--help"], capsys)
    assert rc == 0 and "--encoder-length N" in out and "sizes the cross-attention slot" in out


def test_validate_checks_encoder_length_as_analyze_does(tmp_path, capsys):
    """The checkout mode analyzes with the flag (analyze's own refusals, by the flag); a value analyze refuses is
    refused in every mode before any work, and --all (each model its own analysis) refuses the flag."""
    root = shared_path("upstream", "cann-recipes-infer")
    config = ROOT / "examples" / "tiny_qwen3" / "config.json"
    checkout = ["validate", "--framework-root", root, "--model", "qwen3_moe", "--config", config, "--no-sweep"]
    rc, _, err = invoke([*checkout, "--encoder-length", "64"], capsys)
    assert rc == 2 and _one_line(err).startswith("error: --encoder-length: 64: the decoder attends over no encoder "
                                                 "(model_type 'qwen3'")
    for value, said in (("0", "must be a positive integer, got 0"), (str(1 << 40), "positions: above")):
        rc, _, err = invoke([*checkout, "--encoder-length", value], capsys)
        assert rc == 2 and _one_line(err).startswith("error: --encoder-length: ") and said in err, err
    rc, _, err = invoke(["validate", "--framework-root", root, "--all", "--encoder-length", "64"], capsys)
    assert rc == 2 and _one_line(err).startswith("error: --encoder-length: does not apply with --all")
    assert not list(tmp_path.iterdir())


def test_validate_refuses_an_encoder_length_the_manifest_was_not_analyzed_with(tmp_path, capsys):
    """Beside a manifest (rendered mode, or a checkout run given --manifest) the slot is already sized: the flag must
    be the manifest's max_encoder_len, as --next-n must be its depth."""
    manifest, rendered, config = tmp_path / "m.json", tmp_path / "r", CONFIGS / "bart_large.json"
    assert invoke(["analyze", "--config", config, "--out", manifest], capsys)[0] == 0
    assert invoke(["render", "--manifest", manifest, "--out", rendered], capsys)[0] == 0
    rc, _, err = invoke(["validate", "--manifest", manifest, "--rendered", rendered, "--config", config,
                         "--encoder-length", "2048"], capsys)
    assert rc == 2 and _one_line(err).startswith("error: --encoder-length: 2048 differs from the manifest's "
                                                 "max_encoder_len 1024 (config: max_position_embeddings")
    assert "re-analyze with --encoder-length 2048" in err
    from model_infer_kvcache.validators.checkout_run.validate import CheckoutRequest, load_or_analyze

    with pytest.raises(InputError, match="2048 differs from the manifest's max_encoder_len 1024"):
        load_or_analyze(CheckoutRequest(framework_root="x", model="x", config=str(config), manifest=str(manifest),
                                        encoder_length=2048), Path("x"))
    load_or_analyze(CheckoutRequest(framework_root="x", model="x", config=str(config), manifest=str(manifest),
                                    encoder_length=1024), Path("x"))  # the manifest's own length: accepted
