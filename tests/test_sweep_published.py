"""The family sweep's published fields (benchmarks/sweep_families.py ``_PUBLISHED_FIELDS``, issue 40) and what kvcache
says about a config transformers' own code cannot build.

Cohere Compass (``cohere_compass_text``): CohereCompassRotaryEmbedding indexes ``rope_parameters`` by layer type, and
the class default ({}) has no entry, so transformers 5.25 cannot build its own class defaults (KeyError
'full_attention'). The sweep fills the released North-Micro-Vision text config's layer split and per-layer-type rope
(sliding layers roped, full layers NoPE). No network: the configs come from transformers' classes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.hf_models import causal_lm_from_config, where_transformers_failed

SWEEP = Path(__file__).resolve().parents[1] / "benchmarks" / "sweep_families.py"


def _sweep():
    spec = importlib.util.spec_from_file_location("sweep_families_under_test", SWEEP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _meta_model(data: dict):
    from transformers import AutoConfig

    config = AutoConfig.for_model(data["model_type"], **{k: v for k, v in data.items() if k != "model_type"})
    with torch.device("meta"):
        return config, causal_lm_from_config(config)


def _bare() -> dict:
    """The class defaults as the sweep writes them (through JSON: id2label's keys are strings)."""
    from transformers import CONFIG_MAPPING

    return json.loads(json.dumps(CONFIG_MAPPING["cohere_compass_text"]().to_dict()))


def test_cohere_compass_class_defaults_do_not_build_and_the_published_fill_does():
    with pytest.raises(KeyError, match="full_attention") as bare:  # the class defaults, as the sweep found them
        _meta_model(_bare())
    assert where_transformers_failed(bare.value).startswith("models/cohere_compass/modeling_cohere_compass.py:")

    filled = _sweep()._with_published(_bare())
    config, model = _meta_model(filled)
    rotary = model.model.rotary_emb
    # the released split: three sliding layers then one full, the full ones without rotation (NoPE)
    assert [i for i, t in enumerate(config.layer_types) if t == "full_attention"] == [3, 7, 11, 15, 19, 23, 27]
    assert config.rope_parameters["full_attention"] is None and not hasattr(rotary, "full_attention_inv_freq")
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 50000
    inv_freq, _ = type(rotary).compute_default_rope_parameters(config, layer_type="sliding_attention")
    assert inv_freq[1].item() == pytest.approx(50000 ** (-2 / config.head_dim))
    # only the named fields are filled: the rest stays the class's defaults
    assert {k for k in filled if filled[k] != _bare().get(k)} == {"num_hidden_layers", "layer_types",
                                                                     "rope_parameters"}


def test_cohere_compass_fill_is_planned_sliding_and_full_as_released(tmp_path):
    path = tmp_path / "cohere_compass_text.json"
    path.write_text(json.dumps(_sweep()._with_published(_bare())), encoding="utf-8")
    m = analyze(AnalyzeRequest(config=str(path)))
    assert not m.blockers and m.kv_mode.value == "paged"
    kinds = [layer.layer_kind for layer in m.layers]
    assert kinds.count("full") == 7 and kinds.count("sliding") == 21 and kinds[3] == "full"
    assert {layer.sliding_window for layer in m.layers if layer.layer_kind == "sliding"} == {4096}
    assert m.model.sources["rope"] == "rope_parameters.sliding_attention.rope_type"
    # built by transformers: the cross-check compared its layers and read every attention call, so the family is
    # known (the bare class defaults' warning says nothing was compared)
    assert not any("could not build" in w.message or "unknown model family" in w.message for w in m.warnings)


def test_a_config_transformers_cannot_build_is_refused_in_one_line_naming_transformers_line(tmp_path):
    """`kvcache run`'s refusal of the bare class defaults (tiny model stage): one line, the config's model_type,
    transformers' error and the line of its modeling file that raised it (a bare "KeyError: 'full_attention'" told
    the user nothing about where the key was missing)."""
    from model_infer_kvcache.validators.pipeline.tiny_model import build_tiny_model

    path = tmp_path / "bare.json"
    path.write_text(json.dumps(_bare()), encoding="utf-8")
    manifest = analyze(AnalyzeRequest(config=str(path)))
    # the analyzer plans it, warning that its cross-check could not build it, and where
    note = next(w.message for w in manifest.warnings if "could not build" in w.message)
    assert "KeyError: 'full_attention', raised at models/cohere_compass/modeling_cohere_compass.py:" in note
    # and its unknown-family warning does not claim the scale and windows were cross-checked (they were not)
    unknown = next(w.message for w in manifest.warnings if w.message.startswith("unknown model family"))
    assert "did not build this config, so nothing was cross-checked" in unknown and "were cross-checked" not in unknown
    with pytest.raises(InputError) as err:
        build_tiny_model(_bare(), manifest)
    line = err.value.render()
    assert "\n" not in line and err.value.field == "model_type"
    assert "cohere_compass_text does not build from this config as written (KeyError: 'full_attention', raised at " \
           "models/cohere_compass/modeling_cohere_compass.py:" in line
    assert "rope_parameters[layer_type]" in line


def test_where_transformers_failed_names_only_transformers_own_lines():
    try:
        {}["full_attention"]  # raised here, in the test: no transformers frame to name
    except KeyError as exc:
        assert where_transformers_failed(exc) == ""
    from transformers import AutoConfig

    with pytest.raises(ValueError) as err:  # raised inside transformers: its file, relative, and the line
        AutoConfig.for_model("no_such_model_type")
    where = where_transformers_failed(err.value)
    assert where.startswith("models/auto/configuration_auto.py:") and " (raise " in where


def test_where_transformers_failed_is_silent_when_kvcache_raised_below_transformers():
    """A frame under a transformers path that calls back into kvcache, which raises: the error is kvcache's, no
    transformers line is named (naming the caller's line would blame transformers); the same frame raising itself is
    named."""
    from model_infer_kvcache.analyzer.build import AnalyzeRequest as Request

    fake = "/venv/lib/python3.11/site-packages/transformers/models/fake/modeling_fake.py"
    scope = {"Request": Request, "analyze": analyze}
    exec(compile("def calls_back(path):\n    return analyze(Request(config=path))\n"
                 "def raises():\n    raise KeyError('full_attention')\n", fake, "exec"), scope)
    with pytest.raises(InputError) as kvcache_own:
        scope["calls_back"]("/no/such/config.json")
    assert where_transformers_failed(kvcache_own.value) == ""
    with pytest.raises(KeyError) as own:
        scope["raises"]()
    assert where_transformers_failed(own.value) == "models/fake/modeling_fake.py:4"
