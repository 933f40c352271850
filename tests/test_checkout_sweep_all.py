"""`kvcache validate --framework-root ROOT --all` (issue 43 step 4): every model of a checkout, one row each.

The whole snapshot's sweep is measured by benchmarks/sweep_checkout.py (README); here: which models it finds,
which config stands for each, how an outcome is read, bad input, and one cheap end-to-end run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from model_infer_kvcache.validators.checkout_run import sweep_all
from shared_dirs import upstream_head

ROOT = Path(__file__).resolve().parent.parent


def test_every_registered_key_and_every_unregistered_model_folder_is_a_row():
    root = upstream_head()
    names = sweep_all.checkout_models(root)
    assert names[:2] == ["bailing_2_5", "deepseek_r1"]  # the registry's order
    assert {"kimi_k2", "deepseek_v2_lite", "glm_5", "qwen3.5", "longcat_flash_ffn"} <= set(names)
    assert names[-1] == "pangu_7b"  # a folder no key registers (standalone), after the keys
    folders = {p.parent.name for p in (root / "models").glob("*/models")}
    from model_infer_kvcache.validators.checkout_run.registry import model_folders

    assert folders <= {f for n in names for f in model_folders(root, n)}  # no folder left out


@pytest.mark.parametrize(("name", "model_type"), [
    ("deepseek_v4", "deepseek_v4"),  # transformers knows the key; the folder's class says deepseek_v3
    ("deepseek_v2_lite", "deepseek_v3"),  # the registered class's own model_type
    ("kimi_k2", "deepseek_v3"),
    ("qwen25_7b_instruct", "qwen2"),  # the registered class of a folder declaring qwen2 and qwen3
    ("qwen3_8b", "qwen3"),
    ("qwen3.5", "qwen3_5_moe_text"),
    ("gemma_4", "gemma4_text"),
    ("hy3", "hy_v3"),
    ("pangu_7b", "PanguEmbedded"),  # transformers has none: the folder's own
])
def test_the_config_standing_for_a_model_is_its_own_type(name, model_type):
    assert sweep_all.model_type_for(upstream_head(), name) == model_type


def test_class_defaults_are_written_with_the_token_ids_a_saved_config_carries(tmp_path):
    path, source = sweep_all.config_for(upstream_head(), "hy3", None, tmp_path)
    data = json.loads(path.read_text())
    assert data["model_type"] == "hy_v3" and (data["pad_token_id"], data["bos_token_id"]) == (0, 1)
    assert source == "transformers HYV3Config() defaults (+ pad_token_id, bos_token_id, eos_token_id)"
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "hy3.json").write_text("{}")
    assert sweep_all.config_for(upstream_head(), "hy3", tmp_path / "mine", tmp_path)[0] == tmp_path / "mine" / "hy3.json"
    missing, why = sweep_all.config_for(upstream_head(), "pangu_7b", None, tmp_path)  # as a framework model
    assert missing is None and why.startswith("not supported by kvcache: a standalone folder (its own "
                                              "runner_openpangu_dense.py); transformers has no class for model_type "
                                              "'PanguEmbedded'")
    missing, why = sweep_all.config_for(upstream_head(), "bailing_2_5", None, tmp_path)
    assert missing is None and why == ("no config: transformers has no config class for its config class (which "
                                       "declares no model_type) to take defaults from: give --configs DIR with "
                                       "bailing_2_5.json (the model's published config.json)")


def test_an_outcome_is_read_from_the_exit_status_and_the_one_line():
    passed = {"provenance": {"layout": {"attn_tp_size": 2, "one_rank_refused_at": "m.py:3: KeyError"}}}
    assert sweep_all._outcome(0, "", passed) == ("passed", "attention TP 2 (chosen by kvcache: one rank refused)")
    assert sweep_all._outcome(1, "noise\nFAILED [numeric] logits: first failure\nFAILED [release] x", None) == \
        ("failed", "[numeric] logits: first failure")
    gpt_oss = {"notes": ["the model depends on the device reading window_pre_tokens: it passes under inclusive and "
                         "fails under exclusive (references/device_questions.md)"]}
    assert sweep_all._outcome(1, "FAILED [numeric] logits: first failure at step 2", gpt_oss) == \
        ("failed", "[numeric] logits: first failure at step 2 (device question window_pre_tokens: passes under inclusive)")
    localised = {"localisation": {"headline": "first diverging layer 0, sub-module cache write; look at m.py:352"}}
    assert sweep_all._outcome(1, "FAILED [numeric] logits: first failure", localised)[1] == \
        "[numeric] logits: first failure; localised: first diverging layer 0, sub-module cache write; look at m.py:352"
    assert sweep_all._outcome(2, "error: cfg.json: layer_types[0]: not supported by kvcache\n", None) == \
        ("refused", "cfg.json: layer_types[0]: not supported by kvcache")
    assert sweep_all._outcome(3, "Traceback...\nRuntimeError: boom\n", None) == ("internal", "exit 3: RuntimeError: boom")


def _cli(*args: str):
    return subprocess.run([sys.executable, "-m", "model_infer_kvcache", "validate", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)


@pytest.mark.parametrize(("args", "flag"), [
    (["--all"], "--all"),
    (["--all", "--framework-root", "{root}", "--model", "qwen3_8b"], "--model"),
    (["--all", "--framework-root", "{root}", "--config", "c.json"], "--config"),
    (["--framework-root", "{root}", "--model", "qwen3_8b", "--config", "c.json", "--only", "x"], "--only"),
    (["--all", "--framework-root", "{root}", "--only", "no_such_model"], "--only"),
    (["--manifest", "m.json", "--rendered", "r", "--config", "c.json", "--oracle", "recompute"], "--oracle"),
])
def test_bad_all_input_is_one_line_exit_2(args, flag):
    out = _cli(*[a.format(root=upstream_head()) for a in args])
    errors = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2 and len(errors) == 1 and flag in errors[0], out.stderr[-1500:]


def test_a_sweep_lists_refused_absent_and_standalone_rows(tmp_path):
    """Three models, none of which runs the engine: DeepSeek-V4 (its compressed attention refused by name), a
    registered key whose folder the snapshot lacks, and the standalone pangu_7b folder, driven through its own
    runner (`--runner-root`: the recompute oracle, no transformers class needed)."""
    table = tmp_path / "all.md"
    out = _cli("--framework-root", str(upstream_head()), "--all", "--only", "deepseek_v4,glm_5,pangu_7b",
               "--no-sweep", "--markdown", str(table), "--report", str(tmp_path / "all.json"))
    assert out.returncode == 0, out.stderr[-2000:]  # nothing failed: the rows name gaps
    rows = {r["model"]: r for r in json.loads((tmp_path / "all.json").read_text())}
    assert [rows[n]["outcome"] for n in ("deepseek_v4", "glm_5", "pangu_7b")] == ["refused", "absent", "passed"]
    assert rows["pangu_7b"]["detail"] == "standalone: its own runner, judged by the recompute oracle (--runner-root)"
    assert "DeepSeek-V4 compressed attention in the engine" in rows["deepseek_v4"]["detail"] \
        and rows["deepseek_v4"]["exit_code"] == 2
    assert rows["glm_5"]["detail"] == "registered, but models/glm_5/ is not in the checkout"
    assert table.read_text().startswith(f"kvcache validate --all: 3 models of {upstream_head()} (1 passed, 1 refused, "
                                        "1 absent)")
