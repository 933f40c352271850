"""A transformers causal LM for any config with a text decoder, built from transformers' own classes.

``AutoModelForCausalLM`` maps most text configs; the text backbones of multimodal families (Qwen2.5-VL,
Qwen3-VL, GLM-4V: ``*TextConfig``) it does not, because transformers only ever builds them inside their
``*ForConditionalGeneration``: the backbone (``AutoModel`` maps it) under ``model.language_model`` and an
``lm_head`` over its last hidden state. ``causal_lm_from_config`` builds that same text path, the images
left out (a text-only prompt never reaches the vision tower). Only torch and transformers are needed.
"""

from __future__ import annotations

from typing import Any

from torch import nn


class TextBackboneForCausalLM(nn.Module):
    """A multimodal family's text path as its ``*ForConditionalGeneration`` runs it for text-only prompts:
    ``model.language_model`` (the ``*TextModel``) then ``lm_head``; tied to the input embeddings when the config
    says so. Called like a causal LM; returns an object with ``logits``."""

    def __init__(self, config, backbone: nn.Module):
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.language_model = backbone
        embed = backbone.get_input_embeddings()
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=embed.weight.dtype,
                                 device=embed.weight.device)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = embed.weight

    @property
    def dtype(self):
        return self.lm_head.weight.dtype

    @property
    def reference_name(self) -> str:
        return f"{type(self.model.language_model).__name__} + lm_head"

    def save_pretrained(self, directory, safe_serialization: bool = True, **_: Any) -> None:
        """The text path's weights in the layout transformers' multimodal checkpoints use (``model.language_model.*``,
        ``lm_head.weight``; left out when tied, as published checkpoints do), and the config."""
        from pathlib import Path

        from safetensors.torch import save_file

        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        if self.lm_head.weight is self.model.language_model.get_input_embeddings().weight:
            state.pop("lm_head.weight")
        save_file(state, str(Path(directory) / "model.safetensors"), metadata={"format": "pt"})
        self.config.save_pretrained(directory)

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, use_cache: bool = False, **kwargs: Any):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        out = self.model.language_model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                                        use_cache=use_cache, **kwargs)
        return CausalLMOutputWithPast(logits=self.lm_head(out.last_hidden_state))


def maps_to_causal_lm(config) -> bool:
    """Whether ``AutoModelForCausalLM`` builds this config class itself."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return type(config) in MODEL_FOR_CAUSAL_LM_MAPPING


def causal_lm_from_config(config, **kwargs: Any) -> nn.Module:
    """``AutoModelForCausalLM.from_config(config)``, or for a text backbone that transformers builds only inside a
    multimodal model, that backbone with its ``lm_head`` (``TextBackboneForCausalLM``). LookupError (naming the
    config class) when transformers has neither."""
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    if maps_to_causal_lm(config):
        return AutoModelForCausalLM.from_config(config, **kwargs)
    own = _own_causal_lm(config)
    if own is not None:  # Emu3 / Mllama: a text-only causal LM class the auto mappings leave out
        return own._from_config(config, **kwargs)
    if type(config) not in MODEL_MAPPING:
        raise LookupError(f"transformers maps {type(config).__name__} to no causal LM and no backbone model")
    return TextBackboneForCausalLM(config, AutoModel.from_config(config, **kwargs))


def _own_causal_lm(config):
    """The ``*ForCausalLM`` class of the config's own modeling module built on exactly this config class, if any."""
    import importlib

    module_name = type(config).__module__.replace(".configuration_", ".modeling_")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    found = [cls for name, cls in vars(module).items()
             if name.endswith("ForCausalLM") and getattr(cls, "config_class", None) is type(config)]
    return found[0] if len(found) == 1 else None


def where_transformers_failed(exc: BaseException) -> str:
    """Where in transformers ``exc`` was raised, as a refusal names it: ``models/<family>/<file>.py:<line> (<code>)``
    for the innermost frame of a family's own code (the line that reads the config: a KeyError's bare key says
    nothing by itself), else the innermost transformers frame; '' when no frame of transformers is in its traceback
    or kvcache's own code ran below it (the error is then kvcache's, raised from a callback)."""
    import traceback
    from pathlib import Path

    own_root = str(Path(__file__).resolve().parents[1]).replace("\\", "/") + "/"
    frames = [(f.filename.replace("\\", "/"), f.lineno, (f.line or "").strip())
              for f in traceback.extract_tb(exc.__traceback__)]
    hf = [i for i, f in enumerate(frames) if "/transformers/" in f[0]]
    if not hf or any(f[0].startswith(own_root) and "/site-packages/" not in f[0] for f in frames[hf[-1]:]):
        return ""
    family = [i for i in hf if frames[i][0].rsplit("/transformers/", 1)[-1].startswith("models/")]
    path, line, code = frames[(family or hf)[-1]]
    return f"{path.rsplit('/transformers/', 1)[-1]}:{line}" + (f" ({code})" if code else "")
