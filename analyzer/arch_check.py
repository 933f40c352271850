"""Cross-check the analyzer's softmax scale and per-layer window against the architecture's own code.

When transformers is installed and ships the model type, the model is built on the meta device
(real config, no weights, no memory) and each attention module reports its own scale and window.
A disagreement means the analyzer's rules are wrong for this architecture: the caller refuses to
write the manifest. transformers stays optional: without it nothing is checked.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
from dataclasses import dataclass, field
from typing import Any

from model_infer_kvcache.analyzer.config_loader import HF_MODEL_TYPE, ModelFacts, model_section
from model_infer_kvcache.analyzer.manifest import LayerPlan

# Attributes transformers attention modules keep their softmax scale in (Falcon: inv_norm_factor).
SCALE_ATTRS = ("scaling", "softmax_scale", "inv_norm_factor")
_REL_TOL = 1e-9
# Configuration keys that would make transformers load remote code or are only bookkeeping.
_NOT_ARCH = ("model_type", "auto_map", "architectures", "transformers_version", "_name_or_path")


@dataclass(frozen=True)
class HfAttention:
    path: str
    cls: str | None  # None: the block has no attention module (linear / recurrent layer)
    scale: tuple[float, str] | None  # (value, attribute) or None when the module keeps none
    window: int | None  # sliding window the module applies (None: full)


@dataclass
class CheckResult:
    ships: bool | None  # None: transformers not installed
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checked_layers: int = 0


def transformers_ships(model_type: str) -> bool | None:
    """Whether the installed transformers implements ``model_type`` (None: transformers absent)."""
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:
        return None
    return HF_MODEL_TYPE.get(model_type, model_type) in CONFIG_MAPPING


def hf_attentions(config: dict[str, Any], model_type: str) -> list[HfAttention]:
    """Build the model on the meta device and read each attention module's scale and window."""
    section, _ = model_section(config)
    return list(_hf_attentions(HF_MODEL_TYPE.get(model_type, model_type),
                               json.dumps({k: v for k, v in section.items() if k not in _NOT_ARCH}, sort_keys=True)))


@functools.lru_cache(maxsize=32)
def _hf_attentions(hf_type: str, section_json: str) -> tuple[HfAttention, ...]:
    import torch
    from model_infer_kvcache.analyzer.hf_layout import attention_modules
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(hf_type, **json.loads(section_json))
    config._attn_implementation = "eager"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    out = []
    for path, module in attention_modules(model):
        if module is None:
            out.append(HfAttention(path, None, None, None))
            continue
        scale = next(((float(getattr(module, a)), a) for a in SCALE_ATTRS
                      if isinstance(getattr(module, a, None), (int, float))
                      and not isinstance(getattr(module, a), bool)), None)
        out.append(HfAttention(path, type(module).__name__, scale, _window_of(module, config)))
    return tuple(out)


def _window_of(module, config) -> int | None:
    """The window transformers applies on this module's layer.

    A module's own ``sliding_window`` attribute is per layer (Qwen2/3, Gemma, gpt-oss). Otherwise,
    when the modeling file uses sliding windows at all (Mistral, Phi-3, PhiMoE pass
    ``config.sliding_window`` to the attention call or build the model's mask with it), the
    config's window applies to every layer; a modeling file that never mentions one applies none.
    """
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    try:
        source = inspect.getsource(inspect.getmodule(type(module)))
    except (OSError, TypeError):
        return None
    if "sliding_window" in source:
        return getattr(getattr(module, "config", config), "sliding_window", None)
    return None


def cross_check(config: dict[str, Any], facts: ModelFacts, layers: list[LayerPlan], scale: float,
                scale_txt: str) -> CheckResult:
    """Compare the planned scale and per-layer window with the architecture's attention modules."""
    ships = transformers_ships(facts.model_type)
    result = CheckResult(ships=ships)
    if not ships:
        return result
    try:
        hf = hf_attentions(config, facts.model_type)
    except Exception as exc:  # noqa: BLE001 - a config transformers rejects: skip the check, say why
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        result.notes.append(f"architecture cross-check skipped: transformers could not build {facts.model_type!r} "
                            f"on the meta device ({type(exc).__name__}: {first})")
        return result
    if len(hf) != len(layers):
        result.errors.append(f"attention layers: analyzer plans {len(layers)}, transformers builds {len(hf)}")
        return result
    max_pos = facts.max_position_embeddings.value
    scale_off: list[tuple[LayerPlan, HfAttention]] = []
    window_off: list[tuple[LayerPlan, HfAttention, int | None]] = []
    for layer, mod in zip(layers, hf, strict=True):
        if mod.cls is None:
            if layer.layer_kind != "linear":
                result.errors.append(f"layer {layer.index}: analyzer plans {layer.attn_type}, transformers has no "
                                     f"attention module at {mod.path}")
            continue
        result.checked_layers += 1
        if layer.layer_kind == "linear":
            result.errors.append(f"layer {layer.index}: analyzer plans linear attention, transformers has "
                                 f"{mod.cls} at {mod.path}")
            continue
        if mod.scale is not None and not math.isclose(mod.scale[0], scale, rel_tol=_REL_TOL):
            scale_off.append((layer, mod))
        hf_window = mod.window if mod.window is not None and (max_pos is None or mod.window < max_pos) else None
        if hf_window != layer.sliding_window:
            window_off.append((layer, mod, hf_window))
    if scale_off:
        layer, mod = scale_off[0]
        result.errors.append(
            f"softmax scale: analyzer {scale:.9g} ({scale_txt}) vs transformers {mod.scale[0]:.9g} "
            f"({mod.cls}.{mod.scale[1]}) on {len(scale_off)} layer(s), first {mod.path}")
    if window_off:
        layer, mod, w = window_off[0]
        result.errors.append(
            f"sliding window: analyzer {layer.sliding_window} ({layer.attn_type}) vs transformers {w} "
            f"({mod.cls}.sliding_window) on {len(window_off)} layer(s), "
            f"first layer {layer.index} at {mod.path}")
    return result
