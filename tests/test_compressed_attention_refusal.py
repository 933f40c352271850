"""DeepSeek-V4's compressed attention (CSA / HCA) is a cache kind kvcache does not plan yet (issue 38): every command
refuses it by name, as kvcache's gap, before any field is read as if the layers were dense MLA."""

from __future__ import annotations

import json

import pytest
import transformers
from cli_support import invoke
from shared_dirs import ROOT, shared_path


def _v4(tmp_path, legacy: bool = False):
    data = transformers.DeepseekV4Config().to_dict()
    data["torch_dtype"] = "bfloat16"
    if legacy:  # the upstream folder's spelling: one ratio per layer (0 none, 4 CSA, 128 HCA), no layer_types
        rates = data.pop("compress_rates")
        data["compress_ratios"] = [rates[t] for t in data.pop("layer_types")] + [0]
    path = tmp_path / ("v4_legacy.json" if legacy else "v4.json")
    path.write_text(json.dumps(data, default=str), encoding="utf-8")
    return path


@pytest.mark.parametrize("legacy, field", [(False, "layer_types[0]"), (True, "compress_ratios")])
def test_analyze_refuses_compressed_attention_by_name(tmp_path, capsys, legacy, field):
    rc, out, err = invoke(["analyze", "--config", _v4(tmp_path, legacy), "--out", tmp_path / "m.json"], capsys)
    assert rc == 2 and out == "" and not (tmp_path / "m.json").exists()
    line = err.strip()
    assert "\n" not in line and f": {field}: not supported by kvcache:" in line and "DeepSeek-V4" in line, line


def test_the_refusal_is_not_triggered_by_uncompressed_ratios(tmp_path, capsys):
    """Negative control: ratios of 0 / 1 compress nothing; such a config is planned as the model it otherwise is."""
    data = json.loads((ROOT / "tests" / "fixtures" / "configs" / "deepseek_v3.json").read_text(encoding="utf-8"))
    data["compress_ratios"] = [0] * data["num_hidden_layers"]
    path = tmp_path / "v3.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    assert invoke(["analyze", "--config", path, "--out", tmp_path / "m.json"], capsys)[0] == 0


def test_upstream_deepseek_v4_in_the_real_engine_is_a_named_gap_not_a_model_failure(tmp_path, capsys):
    root = shared_path("upstream", "cann-recipes-infer", "models", "deepseek_v4").parent.parent
    rc, out, err = invoke(["validate", "--framework-root", root, "--model", "deepseek_v4", "--config",
                           _v4(tmp_path), "--no-sweep"], capsys)
    assert rc == 2 and "not supported by kvcache" in err and "V202" not in out


def test_a_model_whose_blocks_hold_no_attention_is_refused_not_planned_as_attention(tmp_path, capsys):
    """xLSTM (mLSTM blocks, no attention module): the cross-check used to be 'skipped' with a warning and the model
    planned as FullAttention on every layer; transformers building it without attention now refuses the plan."""
    path = tmp_path / "xlstm.json"
    path.write_text(json.dumps(transformers.xLSTMConfig().to_dict(), default=str), encoding="utf-8")
    rc, out, err = invoke(["analyze", "--config", path], capsys)
    assert rc == 2 and out == "" and "no decoder block holding an attention module" in err and "xLSTMForCausalLM" in err
