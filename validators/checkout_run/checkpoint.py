"""The tiny transformers model as a checkpoint the checkout's own loader reads.

The layout is the published one: ``config.json`` (the real config with the sizes the tiny model
shrank, and ``torch_dtype`` float32) beside ``model.safetensors`` holding transformers' own
parameter names (``model.layers.N.self_attn.q_proj.weight`` ...), which is what the checkout's
``load_weights`` maps (q/k/v into its merged projections, TP shards by rank).

Every weight is rounded to a bfloat16-representable value first (in the reference model too):
the checkout creates some parameters in bfloat16 explicitly (``VocabParallelEmbedding(...,
torch.bfloat16)``), and a value that survives that storage exactly keeps the comparison a
comparison of code, not of storage precision.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from model_infer_kvcache.analyzer.config_loader import model_section
from model_infer_kvcache.analyzer.files import atomic_write_text


def round_to_bfloat16(model: torch.nn.Module) -> None:
    """Make every floating parameter exactly representable in bfloat16 (in place). Buffers (rotary
    frequencies) are derived, not stored: they stay as the model computes them."""
    with torch.no_grad():
        for t in model.parameters():
            if t.is_floating_point() and t.dtype != torch.bfloat16:
                t.copy_(t.to(torch.bfloat16).to(t.dtype))


def checkpoint_config(real: dict[str, Any], tiny: dict[str, Any]) -> dict[str, Any]:
    """config.json of the checkpoint: the real config's fields, the tiny sizes, float32 weights."""
    src = model_section(real)[0]
    out = {**real, **src}
    out.update({k: v for k, v in tiny.items() if k != "model_type"})
    out.pop("quantization_config", None)  # the tiny weights are not quantized
    out["torch_dtype"] = "float32"
    return out


def save_checkpoint(model: torch.nn.Module, config: dict[str, Any], directory: Path) -> Path:
    """Write the weights with transformers' own ``save_pretrained`` (which writes the published layout:
    it reverts its in-memory fusions, e.g. per-expert ``experts.E.gate_proj.weight`` of Qwen3-MoE) and
    ``config.json`` from the real config (``checkpoint_config``) into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    # Each TP rank writes its own copy into its own folder: transformers would write on rank 0 only.
    model.should_save_on_this_rank = lambda is_main_process: True
    try:
        model.save_pretrained(str(directory), safe_serialization=True)
    finally:
        del model.should_save_on_this_rank
    if not config.get("architectures"):  # a config class's defaults carry none; a published file names its class
        config = {**config, "architectures": [type(model).__name__]}
    atomic_write_text(directory / "config.json", json.dumps(config, indent=2, default=str) + "\n")
    # Offline scheduling ignores EOS; without this file the engine takes EOS from the config alone.
    (directory / "generation_config.json").unlink(missing_ok=True)
    return directory
