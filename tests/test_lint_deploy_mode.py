"""Issue 42 step 3: lint knows each file's deployment mode, and the rules of one mode stay silent on the other.

The mode comes from ``--mode``, the manifest, the file (framework registration / a runner of its own) and
its folder (a runner or an entry script beside or above it); ``deploy_mode.decide`` is the one place that
chooses it. Framework-only rules (KV301/302, KV501, KV701, KV808-810) are silent on standalone files; the
standalone runner rules KV902-904 on framework files. The unmodified standalone folder of the upstream
snapshot (pangu_7b) stays clean and is recognised as standalone by its runner.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
from pathlib import Path

import pytest
from model_infer_kvcache.validators.lint import RULES, lint_paths, lint_source
from model_infer_kvcache.validators.lint.cli import main
from model_infer_kvcache.validators.lint.deploy_mode import (
    FRAMEWORK,
    STANDALONE,
    UNKNOWN,
    FileFacts,
    FolderFacts,
    decide,
    file_facts,
    folder_facts,
)
from shared_dirs import upstream_head

FIXTURES = Path(__file__).parent / "fixtures" / "lint"

# A standalone Llama decoder layer: its runner pads the batch to [batch, seq, hidden] and keeps it that way.
# Like pangu_7b it borrows the framework package's weight loader, which alone once made it "framework" code.
STANDALONE_LAYER = '''\
import torch
from torch import nn

from executor.model_loader.weight_utils import default_weight_loader


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)

    def forward(self, hidden_states, kv_len, is_prefill):
        bsz, q_len = kv_len.shape[0], hidden_states.shape[0] // kv_len.shape[0]
        hidden_states = hidden_states.view(bsz, q_len, self.hidden_size)
        hidden_states = self.self_attn(hidden_states, kv_len, is_prefill)
        return self.mlp(hidden_states)
'''
VIEW_LINE = 1 + STANDALONE_LAYER.splitlines().index(
    "        hidden_states = hidden_states.view(bsz, q_len, self.hidden_size)")
# The same layer in a model that registers its caches with the framework (packed [T, H] tokens).
FRAMEWORK_LAYER = STANDALONE_LAYER + '''

class LlamaForCausalLM(nn.Module):
    def get_cache_info(self):
        return ModelCacheInfo(num_layers=len(self.layers), layer_infos=self.layer_infos)
'''
RUNNER = '''\
from models.modeling_llama import LlamaForCausalLM


class LlamaRunner:
    def __init__(self, config, device):
        self.model = LlamaForCausalLM(config).to(device)
'''


def _standalone_folder(root: Path, model_source: str) -> Path:
    """models/llama/{runner_llama.py, models/modeling_llama.py}: a model folder with a runner of its own."""
    folder = root / "llama"
    (folder / "models").mkdir(parents=True)
    (folder / "runner_llama.py").write_text(RUNNER, encoding="utf-8")
    model = folder / "models" / "modeling_llama.py"
    model.write_text(model_source, encoding="utf-8")
    return model


# ---------------------------------------------------------------- the decision (pure)


def test_decide_order_of_evidence():
    registered = FileFacts(registration="`get_cache_info` (line 9)", runner="defines the runner class R (line 3)")
    runner_folder = FolderFacts(runner="../runner_x.py")
    assert decide("standalone", "framework", registered, None) == (STANDALONE, "--mode standalone")
    assert decide("auto", "standalone", registered, None).mode == STANDALONE  # the manifest says so
    assert decide("auto", None, registered, runner_folder).mode == FRAMEWORK
    assert decide("auto", None, FileFacts(runner="this file (runner_x.py)"), None).mode == STANDALONE
    only_import = FileFacts(framework_import="`executor.utils`, line 3")
    decision = decide("auto", None, only_import, runner_folder)
    assert decision.mode == STANDALONE and "../runner_x.py" in decision.reason
    # a folder whose runner sits beside a file that registers is no standalone folder
    assert decide("auto", None, only_import, FolderFacts("runner_x.py", "models/modeling_x.py")).mode == FRAMEWORK
    assert decide("auto", None, FileFacts(), FolderFacts("runner_x.py", "models/modeling_x.py")).mode == UNKNOWN
    assert decide("auto", None, FileFacts(), None).mode == UNKNOWN
    with pytest.raises(ValueError, match="bogus"):
        decide("bogus", None, FileFacts(), None)


@pytest.mark.parametrize("source, field, text", [
    ("from executor.core.kv_cache import CacheEntry\n", "registration", "executor.core.kv_cache"),
    ("def get_cache_info(self):\n    pass\n", "registration", "get_cache_info"),
    ("def forward(self, x, forward_metadata: ForwardMetaData):\n    pass\n", "registration", "ForwardMetaData"),
    ("class PanguRunner(ModelRunner):\n    pass\n", "runner", "PanguRunner"),
    ("class ForwardMetaData:\n    kv_len: torch.Tensor\n", "runner", "ForwardMetaData"),
    ("from executor.utils import read_yaml\n", "framework_import", "executor.utils"),
])
def test_file_facts(source, field, text):
    facts = file_facts(ast.parse(source), "modeling_x.py")
    assert text in getattr(facts, field)
    assert [f for f in ("registration", "runner", "framework_import") if getattr(facts, f)] == [field]


def test_folder_facts_find_a_runner_or_an_entry_script_above_the_file(tmp_path):
    model = tmp_path / "m" / "models" / "modeling_m.py"
    model.parent.mkdir(parents=True)
    model.write_text("x = 1\n", encoding="utf-8")
    assert folder_facts(str(model)) == FolderFacts()
    (tmp_path / "m" / "infer.py").write_text("from executor.offline import OfflineInference\n"
                                             "OfflineInference(cfg).run()\n", encoding="utf-8")
    assert folder_facts(str(model)) == FolderFacts()  # an entry script that builds the framework's engine
    (tmp_path / "m" / "infer.py").write_text("runner = MRunner(settings)\nrunner.init_model()\n", encoding="utf-8")
    assert folder_facts(str(model)) == FolderFacts(runner="../infer.py")
    (tmp_path / "m" / "m_runner.py").write_text("class MRunner:\n    pass\n", encoding="utf-8")
    assert folder_facts(str(model)) == FolderFacts(runner="../m_runner.py")
    model.write_text("from executor.core.kv_cache import CacheEntry\n", encoding="utf-8")
    assert folder_facts(str(model)).registration == "models/modeling_m.py"
    assert folder_facts("<string>") is None  # source text without a file: no folder to read


def test_a_runner_three_levels_up_is_not_the_model_folders(tmp_path):
    deep = tmp_path / "a" / "b" / "c" / "modeling_x.py"
    deep.parent.mkdir(parents=True)
    deep.write_text("x = 1\n", encoding="utf-8")
    (tmp_path / "runner_x.py").write_text("x = 1\n", encoding="utf-8")
    assert folder_facts(str(deep)) == FolderFacts()
    (tmp_path / "a" / "runner_x.py").write_text("x = 1\n", encoding="utf-8")
    assert folder_facts(str(deep)) == FolderFacts(runner="../../runner_x.py")


# ---------------------------------------------------------------- the upstream standalone folder


def _pangu() -> Path:
    folder = upstream_head() / "models" / "pangu_7b"
    if not folder.is_dir():
        pytest.skip(f"{folder} does not exist")
    return folder


def test_pangu_7b_is_clean_and_standalone_by_its_runner():
    folder = _pangu()
    report = lint_paths([folder])
    assert not report.errors, report.errors
    assert report.findings == [], [f.to_text() for f in report.findings]
    model = str(folder / "models" / "modeling_openpangu_dense.py")
    assert model in report.files and len(report.files) >= 2, report.files
    decision = report.modes[model]
    assert decision.mode == STANDALONE, decision
    assert "runner_openpangu_dense.py" in decision.reason
    assert {d.mode for d in report.modes.values()} == {STANDALONE}


def test_pangu_runner_allocating_its_cache_every_step_is_caught(tmp_path):
    """The real runner with its `if past_key_values is None:` guard removed: the cache is rebuilt per step."""
    copy = tmp_path / "pangu_7b"
    shutil.copytree(_pangu(), copy)
    runner = copy / "runner_openpangu_dense.py"
    text, count = re.subn(r"( +)if past_key_values is None:\n\1    (.*)\n\1    (.*)\n", r"\1\2\n\1\3\n",
                          runner.read_text(encoding="utf-8"))
    assert count == 1, "the snapshot's runner no longer has the guarded init_cache this test removes"
    runner.write_text(text, encoding="utf-8")
    report = lint_paths([copy])
    assert [(Path(f.path).name, f.rule) for f in report.findings] == [("runner_openpangu_dense.py", "KV903")]
    assert "model_input_prepare" in report.findings[0].message


# ---------------------------------------------------------------- KV701 by mode


def test_standalone_layer_keeping_batch_seq_hidden_is_not_kv701(tmp_path):
    model = _standalone_folder(tmp_path, STANDALONE_LAYER)
    report = lint_paths([model])
    assert report.findings == [], [f.to_text() for f in report.findings]
    assert report.modes[str(model)].mode == STANDALONE
    assert "runner_llama.py" in report.modes[str(model)].reason
    # without the runner beside it, the executor import is the only evidence: framework, and KV701 holds
    (model.parent.parent / "runner_llama.py").unlink()
    report = lint_paths([model])
    assert [(f.rule, f.line) for f in report.findings] == [("KV701", VIEW_LINE)]
    assert report.modes[str(model)].mode == FRAMEWORK and "executor.model_loader" in report.modes[str(model)].reason


def test_the_same_layer_registered_with_the_framework_is_kv701(tmp_path):
    model = _standalone_folder(tmp_path, FRAMEWORK_LAYER)  # the file's registration outweighs the folder
    report = lint_paths([model])
    assert [(f.rule, f.line) for f in report.findings] == [("KV701", VIEW_LINE)]
    assert report.modes[str(model)].mode == FRAMEWORK and "get_cache_info" in report.modes[str(model)].reason
    assert [(f.rule, f.line) for f in lint_source(FRAMEWORK_LAYER)] == [("KV701", VIEW_LINE)]


def test_mode_framework_forces_kv701_on_the_standalone_layer(tmp_path, capsys):
    model = _standalone_folder(tmp_path, STANDALONE_LAYER)
    assert [f.rule for f in lint_paths([model], mode="framework").findings] == ["KV701"]
    assert [f.rule for f in lint_source(STANDALONE_LAYER, mode="framework")] == ["KV701"]
    assert main([str(model), "--mode", "framework", "--format", "json"]) == 1
    (item,) = json.loads(capsys.readouterr().out)
    assert item["rule"] == "KV701" and item["mode"] == FRAMEWORK and item["mode_reason"] == "--mode framework"
    assert main([str(model)]) == 0  # auto: standalone
    assert main([str(FIXTURES / "kv701_hidden_3d_view_bad.py"), "--mode", "standalone"]) == 0


# ---------------------------------------------------------------- other rules by mode


def test_framework_only_rules_are_silent_on_standalone_files():
    framework_only = {rule_id for rule_id, rule in RULES.items() if rule.deploy == "framework"}
    assert framework_only == {"KV301", "KV302", "KV501", "KV701", "KV808", "KV809", "KV810"}
    for name in ("kv301_block_table_dict_bad.py", "kv302_slot_mapping_dict_bad.py", "kv501_num_head_unsplit_bad.py"):
        path = FIXTURES / name
        assert lint_paths([path]).findings, name
        assert [f.rule for f in lint_paths([path], mode="standalone").findings
                if f.rule in framework_only] == [], name


def test_standalone_runner_rules_are_silent_on_framework_files():
    assert {rule_id for rule_id, rule in RULES.items() if rule.deploy == "standalone"} == {"KV902", "KV903", "KV904"}
    for bad in sorted(FIXTURES.glob("kv90*_bad.py")):
        assert lint_paths([bad]).findings, bad.name
        assert lint_paths([bad], mode="framework").findings == [], bad.name


# ---------------------------------------------------------------- CLI and library surface


def test_bad_mode_is_one_line_exit_2(capsys):
    assert main([str(FIXTURES / "kv201_prefill_no_mask_good.py"), "--mode", "bogus"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "--mode" in err and "bogus" in err
    with pytest.raises(ValueError, match="mode"):
        lint_paths([FIXTURES / "kv201_prefill_no_mask_good.py"], mode="bogus")
    with pytest.raises(ValueError, match="mode"):
        lint_source("x = 1\n", mode="Framework")


def test_show_mode_names_every_file_and_json_keeps_its_keys(tmp_path, capsys):
    model = _standalone_folder(tmp_path, STANDALONE_LAYER)
    assert main([str(model.parent.parent), "--show-mode"]) == 0
    err = capsys.readouterr().err
    assert f"{model}: mode standalone (" in err and "runner_llama.py" in err
    assert f"{model.parent.parent / 'runner_llama.py'}: mode standalone (runner of its own: this file" in err
    assert main([str(FIXTURES / "kv902_slot_length_not_reset_bad.py"), "--format", "json"]) == 1
    (item,) = json.loads(capsys.readouterr().out)
    assert set(item) == {"rule", "path", "line", "col", "message", "hint", "severity", "mode", "mode_reason"}
    assert item["mode"] == STANDALONE and "Qwen3ServingRunner" in item["mode_reason"]


def test_list_rules_names_the_mode_of_mode_specific_rules(capsys):
    assert main(["--list-rules"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["KV701"].endswith("[framework only]") and lines["KV903"].endswith("[standalone only]")
    assert "only]" not in lines["KV401"]
    assert main(["--list-rules", "--format", "json"]) == 0
    rows = {row["id"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["KV301"]["deploy"] == "framework" and rows["KV904"]["deploy"] == "standalone"
    assert rows["KV201"]["deploy"] is None
