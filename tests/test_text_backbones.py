"""Text backbones of multimodal families (issue 43): transformers maps their ``*TextConfig`` to no causal LM, so the
reference is built the way their ``*ForConditionalGeneration`` runs a text-only prompt (was exit 3)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from cli_support import invoke
from model_infer_kvcache.analyzer.hf_models import (
    TextBackboneForCausalLM,
    causal_lm_from_config,
    maps_to_causal_lm,
)


def _small_qwen3_vl(**text) -> transformers.Qwen3VLConfig:
    text = {"hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 300,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6],
                                "mrope_interleaved": True}, **text}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 128,
              "deepstack_visual_indexes": []}
    return transformers.Qwen3VLConfig(text_config=text, vision_config=vision)


@pytest.mark.parametrize("tied", [False, True])
def test_text_path_equals_the_conditional_generation_model_on_text_prompts(tied):
    """Same weights (the wrapper's keys are a subset of the multimodal checkpoint's), same logits."""
    config = _small_qwen3_vl(tie_word_embeddings=tied)
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    full = transformers.Qwen3VLForConditionalGeneration(config).eval()
    assert not maps_to_causal_lm(config.text_config)
    text = causal_lm_from_config(config.text_config)
    assert isinstance(text, TextBackboneForCausalLM)
    missing, unexpected = text.load_state_dict(full.state_dict(), strict=False)
    assert missing == [] and all(k.startswith("model.visual.") for k in unexpected), (missing, unexpected)
    assert (text.lm_head.weight is text.model.language_model.embed_tokens.weight) == tied
    ids = torch.randint(0, 300, (2, 9))
    positions = torch.arange(9)[None].expand(2, -1)
    with torch.no_grad():
        want = full(input_ids=ids, position_ids=positions).logits
        got = text.eval()(input_ids=ids, position_ids=positions).logits
    assert torch.equal(got, want)


def test_a_causal_lm_config_is_built_by_automodelforcausallm():
    model = causal_lm_from_config(transformers.Qwen3Config(num_hidden_layers=1, hidden_size=64, intermediate_size=64,
                                                           num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                                           vocab_size=100))
    assert type(model).__name__ == "Qwen3ForCausalLM"


def test_saved_weights_use_the_multimodal_layout(tmp_path):
    from safetensors.torch import load_file

    text = causal_lm_from_config(_small_qwen3_vl(tie_word_embeddings=True).text_config)
    text.save_pretrained(tmp_path)
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert "model.language_model.embed_tokens.weight" in keys and "lm_head.weight" not in keys  # tied: left out
    assert json.loads((tmp_path / "config.json").read_text(encoding="utf-8"))["model_type"] == "qwen3_vl_text"


def test_kvcache_run_validates_a_multimodal_config_s_text_backbone(tmp_path, capsys):
    """Was: exit 3, 'Unrecognized configuration class Qwen3VLTextConfig for AutoModelForCausalLM'."""
    data = _small_qwen3_vl().to_dict()
    data["torch_dtype"] = "bfloat16"
    config = tmp_path / "config.json"
    config.write_text(json.dumps(data, default=str), encoding="utf-8")
    rc, out, err = invoke(["run", "--config", config, "--out", tmp_path / "out"], capsys)
    assert rc == 0, err[-2000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text(encoding="utf-8"))
    assert report["passed"] and report["model_type"] == "qwen3_vl_text"


def test_a_reference_that_cannot_run_is_refused_not_blamed_on_the_render(tmp_path, capsys):
    """GLM-4V's default text config carries an M-RoPE section for another rotary width: transformers' own model
    fails its first forward. Was: V201 'rendered code runs without operator errors' failed (exit 1)."""
    data = transformers.Glm4vConfig().to_dict()
    data["torch_dtype"] = "bfloat16"
    config = tmp_path / "config.json"
    config.write_text(json.dumps(data, default=str), encoding="utf-8")
    rc, _, err = invoke(["run", "--config", config, "--out", tmp_path / "out"], capsys)
    line = err.strip().splitlines()[-1]
    assert rc == 2 and "not supported by kvcache" in line and "Glm4vTextModel + lm_head" in line, line
    assert "does not run one forward" in line and not (tmp_path / "out").exists()
