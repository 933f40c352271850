"""Before anything runs: the manifest, the render and the config must belong together.

The render names the manifest it came from in its header (templates/header.j2); the manifest
states the model facts it was analyzed from, which the config must reproduce. A mismatch is bad
input (exit 2) naming which of the three does not fit, not a validation verdict.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from model_infer_kvcache.analyzer.config_loader import normalize_config
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.kinds import byte_patch_section, byte_patches
from model_infer_kvcache.analyzer.linear_config import sublayer_kinds
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from model_infer_kvcache.analyzer.rules import planned_layer_kind
from model_infer_kvcache.implementer.header import RenderHeader
from model_infer_kvcache.implementer.header import read_header as parse_header

RENDERED_FILES = ("kvcache_attention.py", "kvcache_runner.py")


def read_header(path: Path) -> RenderHeader | None:
    return parse_header(path.read_text(encoding="utf-8"))


def check_render_matches(manifest: SelectionManifest, rendered_dir: Path) -> RenderHeader:
    """Every rendered file names ``manifest``'s hash; returns the attention file's header."""
    want = manifest.content_hash()
    first = None
    for name in RENDERED_FILES:
        path = rendered_dir / name
        if not path.is_file():
            continue
        header = read_header(path)
        if header is None:
            raise InputError(str(path), "has no model-infer-kvcache header naming its manifest: validate judges "
                                        "renders against the manifest they were rendered from", field="--rendered")
        if header.manifest_hash != want:
            raise InputError(str(path), f"was rendered from manifest {header.manifest_hash}, but --manifest is "
                                        f"{want}: pass the manifest it came from, or re-render", field="--rendered")
        first = first or header
    return first


def byte_patch_mismatches(manifest: SelectionManifest, config: dict[str, Any], where: str) -> list[str]:
    """A BLT config against a manifest: each stack as the analyzer plans it from the config (its section, under the
    manifest's window reading) against the manifest's section."""
    if manifest.byte_patches is None or not byte_patches.is_blt(config):
        return [f"model_type {config.get('model_type')!r} (config) vs {manifest.model.model_type!r} (manifest): "
                "one is BLT's four stacks, the other not"]
    section = manifest.byte_patches
    planned = byte_patch_section.decide(byte_patches.read_facts(config, where), byte_patch_section.window_reading(section),
                                        section.open_patch_rows, where)
    mine = {s.section: s for s in section.stacks}
    out = [f"{s.section} {name} {getattr(s, name)!r} (config) vs {getattr(mine[s.section], name)!r} (manifest)"
           for s in planned.stacks if s.section in mine for name in type(s).model_fields
           if getattr(s, name) != getattr(mine[s.section], name)]
    if set(mine) != {s.section for s in planned.stacks}:
        out.append(f"stacks {sorted(s.section for s in planned.stacks)} (config) vs {sorted(mine)} (manifest)")
    for name in ("entropy_patching", "patching_threshold", "max_patch_length", "cross_attn_k", "decoder_cross_layers"):
        if getattr(planned, name) != getattr(section, name):
            out.append(f"{name} {getattr(planned, name)!r} (config) vs {getattr(section, name)!r} (manifest)")
    return out


def config_mismatches(manifest: SelectionManifest, config: dict[str, Any], where: str) -> list[str]:
    """Model facts of ``config`` that differ from the ones ``manifest`` was analyzed from."""
    if manifest.byte_patches is not None or byte_patches.is_blt(config):  # BLT: its stacks, not one decoder stack
        return byte_patch_mismatches(manifest, config, where)
    facts = normalize_config(config, where)
    m = manifest.model
    pairs = [
        ("model_type", facts.model_type, m.model_type),
        ("num_layers", facts.num_layers.value, m.num_layers),
        ("hidden_size", facts.hidden_size.value, m.hidden_size),
        ("num_attention_heads", facts.num_attention_heads.value, m.num_attention_heads),
        ("num_key_value_heads", facts.num_key_value_heads.value, m.num_key_value_heads),
        ("head_dim", facts.head_dim.value, m.head_dim),
        ("mla", facts.mla.value, m.mla),
        ("sublayers_per_layer", facts.sublayers_per_layer.value, m.sublayers_per_layer),
    ]
    out = [f"{name} {got!r} (config) vs {want!r} (manifest)" for name, got, want in pairs if got != want]
    if not out:  # the layer pattern and window as the analyzer plans them, decoder layer by decoder layer
        # a parallel hybrid's decoder layer: its attention sublayer (0) carries the window
        windows = {layer.decoder_layer: layer.sliding_window for layer in manifest.layers if not layer.sublayer}
        kinds = {layer.decoder_layer: layer.layer_kind for layer in manifest.layers if not layer.sublayer}
        for i, config_kind in enumerate(facts.layer_kinds.value):
            kind, window, _ = planned_layer_kind(sublayer_kinds(config_kind, 1)[0], facts.sliding_window.value,
                                                 facts.max_position_embeddings.value)
            if i in kinds and (kinds[i], windows[i]) != (kind, window):
                out.append(f"decoder layer {i}: config plans {kind} window {window}, manifest has {kinds[i]} "
                           f"window {windows[i]}")
                break
    return out


def check_inputs_belong(manifest: SelectionManifest, manifest_path: str, config: dict[str, Any], config_path: str,
                        rendered_dir: Path) -> RenderHeader:
    """Refuse (InputError, exit 2) a render, manifest or config that does not belong with the others."""
    header = check_render_matches(manifest, rendered_dir)
    bad = config_mismatches(manifest, config, config_path)
    if bad:
        raise InputError(config_path, f"does not describe the model of {manifest_path}: " + "; ".join(bad[:3]),
                         field="--config")
    return header


def rendered_provenance(rendered_dir: str, handle, backend: str) -> dict:
    """Where the code of a rendered-mode run came from (the report's provenance section)."""
    out: dict = {"code_under_test": f"the render in {Path(rendered_dir).resolve()}",
                 "operators": "validators.npu_ops emulation" if backend == "emulated" else "torch_npu (device)"}
    if handle is None:
        out["framework"] = "none (standalone mode: the host model drives the render)"
        return out
    out["api_generation"] = handle.generation
    if handle.real:
        from model_infer_kvcache.analyzer.framework_checkout import checkout_commit

        out["checkout"] = str(handle.root)
        out["commit"] = checkout_commit(handle.root) or "(not a git work tree)"
        out["from_checkout"] = sorted(set(handle.modules) - set(handle.fallbacks))
        out["harness"] = list(handle.fallbacks) + ["Scheduler and model host (validators.harness, validators.pipeline)"]
    else:
        out["harness"] = sorted(handle.modules) + ["Scheduler and model host (validators.harness, validators.pipeline)"]
    return out
