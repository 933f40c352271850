"""A tiny transformers model of the same architecture as a real config (random weights, no hub).

What the rendered code hard-codes is kept (heads, KV heads, head_dim, MLA dims, scale inputs,
layer-kind pattern, the window and heads of the manifest given: ``cpu_sized`` gives validation a manifest
with a short window, or fewer heads where the hidden size ties to a wide heads x head_dim); what only
costs time shrinks (layers to the shortest prefix holding every distinct layer plan, hidden size, MLP,
experts, vocabulary).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
from model_infer_kvcache.analyzer.arch_check import transformers_ships
from model_infer_kvcache.analyzer.config_loader import HF_MODEL_TYPE, model_section
from model_infer_kvcache.analyzer.errors import InputError, NotSupportedByKvcache
from model_infer_kvcache.analyzer.kinds import holds_states
from model_infer_kvcache.analyzer.kinds.compressed import branch_kind as compressed_branch
from model_infer_kvcache.analyzer.linear_config import kvcache_reference
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from model_infer_kvcache.validators.kinds import cross, kind_of, loops, recurrent
from model_infer_kvcache.validators.pipeline import codebooks

# Families whose attention derives head_dim from hidden_size / heads (no head_dim field).
_HEAD_DIM_FROM_HIDDEN = {"falcon"}
# Fields of a published config that describe weights/packaging, not the architecture.
_DROP = ("architectures", "auto_map", "quantization_config", "torch_dtype", "dtype", "transformers_version",
         "_name_or_path", "text_config", "vision_config")
TINY_VOCAB = 512
# MLP widths besides intermediate_size (Falcon derives ffn_hidden_size = 4 x hidden when absent).
_DERIVED_MLP_WIDTHS = ("ffn_hidden_size", "n_inner", "ffn_dim")
MAX_CPU_WINDOW = 256  # windows above this are shrunk so test sequences can cross them
SHRUNK_WINDOW = 160
# A tiny model whose hidden size ties to heads x head_dim wider than this runs with fewer heads (cpu_sized): Ergo's
# 64 x 128 held 634M float64 parameters (15-22 min a mode), GPT-NeoX's 64 x 96 312M. At the untied hidden of 128 the
# same bound holds the K/V width (KV heads x head_dim): the rows every cache write, gather and FA block moves, and the
# K/V projections (Cohere-Compass' MHA 64 x 128 = 8192: 58 s a mode at every head, its time in the projections and the
# emulated FA's gathers). A whole-heads tied model never carries K/V rows wider than this either (KV <= heads).
MAX_CPU_TIED_WIDTH = 1024


@dataclass(frozen=True)
class TinyPlan:
    hf_model_type: str
    num_layers: int
    window: int | None  # the manifest's window: the tiny model runs the render as written
    notes: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)  # the fields the tiny config was built from


# Expert counts and widths, spelled each family's way, at sizes a CPU builds in a moment.
_MOE_SIZES = (("moe_intermediate_size", 64), ("n_routed_experts", 4), ("num_local_experts", 4),
              ("num_experts", 4), ("num_experts_per_tok", 2), ("n_group", 1), ("topk_group", 1),
              ("n_shared_experts", 1), ("first_k_dense_replace", 1),
              # LongCat-Flash spells them its own way: top-k, expert width, identity ("zero") experts
              ("moe_topk", 2), ("expert_ffn_hidden_size", 64), ("zero_expert_num", 2),
              ("top_k_experts", 2),  # Gemma-4
              ("moe_num_experts", 4), ("moe_top_k", 2),  # DBRX (in its nested ffn_config)
              ("moe_k", 2),  # Ernie-4.5-MoE's top-k (its moe_num_experts shrinks above: 6 of 4 experts cannot run)
              # transformers' bailing_hybrid spells them its own way too (attribute_map)
              ("num_expert_group", 1), ("num_experts_per_token", 2), ("num_shared_experts", 1),
              # Gemma-3n / Gemma-4: the per-layer input embeddings (a vocabulary x layers x width table)
              ("vocab_size_per_layer_input", TINY_VOCAB), ("laurel_rank", 8))


# Per-layer config lists that shape the MLP, not the attention or its cache: a plan difference there needs no layer
# of its own in the prefix (DeepSeek's dense-then-MoE list would otherwise lengthen every MLA run).
_MLP_WORDS = ("mlp", "moe", "expert", "ffn", "intermediate", "sparsity")


def _layer_plans(manifest: SelectionManifest, src: dict[str, Any]) -> list[tuple[tuple[str, str], ...]]:
    """Each decoder layer's plan as (what, value) pairs: what the manifest decides for it (attn type, kind, window,
    head dims, caches, states) and the attention's per-layer config entries the manifest does not carry (SmolLM3's
    and Llama-4's ``no_rope_layers``: RoPE or NoPE; cross-layer KV sources)."""
    n = manifest.model.num_layers
    per_layer = {k: v for k, v in src.items() if isinstance(v, list) and len(v) == n and "layer" in k
                 and not any(w in k.lower() for w in _MLP_WORDS)}
    plans: dict[int, dict[str, str]] = {}
    for layer in manifest.layers:
        sub = f"[{layer.sublayer}]" if layer.sublayer else ""
        plans.setdefault(layer.decoder_layer, {}).update({
            f"attn_type{sub}": layer.attn_type, f"kind{sub}": layer.layer_kind,
            f"window{sub}": str(layer.sliding_window), f"head_dim{sub}": str(layer.head_dim),
            f"kv_heads_per_rank{sub}": str(layer.num_kv_heads_per_rank),
            f"kv_source{sub}": str(layer.kv_source_layer),
            f"caches{sub}": ", ".join(f"{c.name} {c.num_head}x{c.dim} {c.dtype}" for c in layer.caches),
            f"states{sub}": ", ".join(st.name for st in layer.states),
            f"compressed{sub}": compressed_branch(layer)})
    for block in manifest.no_cache_layers or ():  # a block without a cache is a plan of its own (MLP, MoE)
        plans[block.decoder_layer] = {"attn_type": "none", "kind": f"no cache ({block.block})"}
    for i, plan in plans.items():
        plan.update({k: json.dumps(v[i], sort_keys=True) for k, v in sorted(per_layer.items())})
    return [tuple(plans[i].items()) for i in sorted(plans)]


def _plan_label(plan: tuple[tuple[str, str], ...], first: tuple[tuple[str, str], ...]) -> str:
    """A short name for a layer plan: its attn type and kind, then what sets it apart from the first layer's."""
    values = dict(plan)
    differs = [f"{k}={v}" for k, v in plan if k not in ("attn_type", "kind") and (k, v) not in first]
    return f"{values['attn_type']}/{values['kind']}" + (f" ({', '.join(differs)})" if differs else "")


def _layer_prefix(manifest: SelectionManifest, src: dict[str, Any]) -> tuple[int, list[str]]:
    """Shortest decoder-layer prefix (>= 2) that holds one layer of every distinct layer plan, and the plans
    (first layer of each) it holds."""
    plans = _layer_plans(manifest, src)
    needed = set(plans)
    seen: dict[tuple, int] = {}
    n = len(plans)
    for i, plan in enumerate(plans):
        seen.setdefault(plan, i)
        if len(seen) == len(needed) and i + 1 >= 2:
            n = i + 1
            break
    return n, [f"layer {i}: {_plan_label(plan, plans[0])}" for plan, i in seen.items()]


def tiny_config_dict(real: dict[str, Any], manifest: SelectionManifest) -> tuple[dict[str, Any], TinyPlan]:
    src, section = model_section(real)
    # a composite's decoder section is its causal LM's whole config (MusicgenForCausalLM(config.decoder)); the outer
    # config holds the other stacks' sections (text_encoder, audio_encoder), which that class does not take
    d = {k: v for k, v in ({**src} if section == "decoder." else {**real, **src}).items() if k not in _DROP}
    model_type = manifest.model.model_type
    hf_type = HF_MODEL_TYPE.get(model_type, model_type)
    d["model_type"] = hf_type
    notes = []
    n, held = _layer_prefix(manifest, src)
    shortest = n
    n, reused = recurrent.shared_block_prefix(manifest, src, n)  # Zamba2: a hybrid layer reusing a shared block
    if reused:
        notes.append(reused)
    n, after_cross = cross.tiny_prefix(manifest, n)  # Mllama: a self-attention block after the cross-only one
    if after_cross:
        notes.append(after_cross)
    m = manifest.model
    d["num_hidden_layers"] = n
    if m.sublayers_per_layer > 1 and not manifest.parallel_hybrid():  # Falcon-H1: one layer, two plans  # transformers counts attention sublayers (LongCat-Flash: 2 per layer)
        d["num_hidden_layers"] = n * m.sublayers_per_layer
        if "num_layers" in d:
            d["num_layers"] = n
    _trim_per_layer_fields(d, m.num_layers, n)
    n = loops.tiny_loop_fields(d, manifest) or n  # a looped section (Dory): the tiny manifest's layers, every one
    if isinstance(d.get("attention_types"), list):
        # GPT-Neo's grouped spelling ([[types...], repeats] pairs), which its config expands into attention_layers and
        # checks against the layer count: one group per kept layer (the analyzer read the same expansion)
        kept = [t for group, repeats in d["attention_types"] for _ in range(repeats) for t in group][:n]
        d["attention_types"], d["attention_layers"] = [[[t], 1] for t in kept], kept
    if isinstance(d.get("hybrid_override_pattern"), str):  # Nemotron-H's legacy block string, one char a block
        d["hybrid_override_pattern"] = d["hybrid_override_pattern"][:n]
    if d.get("num_kv_shared_layers"):
        # the prefix keeps the real first shared layer (and so every source): the shared ones are its tail
        first_shared = next(layer.decoder_layer for layer in manifest.layers if layer.kv_source_layer is not None)
        d["num_kv_shared_layers"] = max(n - first_shared, 0)
    kind = kind_of(manifest)
    from_hidden = hf_type in _HEAD_DIM_FROM_HIDDEN
    d["hidden_size"] = m.num_attention_heads * m.head_dim if from_hidden else 128
    if m.num_attention_heads:  # a pure state stack has none (Mamba2Config's num_heads are its mixer's)
        d["num_attention_heads"] = m.num_attention_heads
    if manifest.attention_layers:  # a pure state stack has no attention to size (Mamba2Config's head_dim is its mixer's)
        kind.tiny_attention_fields(d, manifest, head_dim_from_hidden=from_hidden)  # its heads / dims (validators/kinds)
        _head_sources(d, m)
    cross.tiny_cross_fields(d, manifest, n)  # an encoder-decoder's decoder fields (validators/kinds/cross)
    d["intermediate_size"] = 128
    rescaled = recurrent.tiny_state_fields(d, manifest)  # a state family's widths (validators/kinds/recurrent)
    if rescaled:
        notes.append(rescaled)
    d["vocab_size"] = TINY_VOCAB
    for key, value in _MOE_SIZES:
        if key in d:
            # a published top-k of 1 stays 1: a router built for one expert (ZayaConfig.validate_architecture
            # refuses num_experts_per_tok != 1)
            d[key] = 1 if key == "num_experts_per_tok" and d[key] == 1 else value
    if d.get("hidden_size_per_layer_input"):
        d["hidden_size_per_layer_input"] = 16
    _dense_prefix_types(d, src)
    for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
        if d.get(key) and not m.num_mtp_layers:  # --next-n 0: a checkout model must not build its MTP layers,
            notes.append(f"{key} {d[key]} set to 0 (--next-n 0: served without speculative decoding)")
            d[key] = 0  # nor take its config class's default (Ling-2.5's refuses any)
        else:
            d.pop(key, None)
    d["tie_word_embeddings"] = bool(d.get("tie_word_embeddings", False))
    # The window of the manifest given: validate passes the tiny-window manifest (cpu_sized)
    # when the real window is too long for CPU sequences to cross, and renders that manifest too.
    window = manifest.sliding_window()
    if window:
        d["sliding_window"] = window
    if manifest.attention_chunk_size():  # the manifest's chunk, like its window (cpu_sized shrinks both)
        d["attention_chunk_size"] = manifest.attention_chunk_size()
    if m.num_mtp_layers:
        notes.append(f"{m.num_mtp_layers} MTP layer(s) not built (transformers has no MTP head)")
    grown = f"is {shortest} " if n != shortest else ""  # grown to a reused shared block (noted above)
    notes.append(f"{n} of {m.num_layers} decoder layers: the shortest prefix holding every distinct layer plan "
                 f"{grown}({len(held)}: {'; '.join(held)})")
    return d, TinyPlan(hf_type, n, window, notes)


def _head_sources(d: dict[str, Any], m) -> None:
    """The head counts also under the config fields the analyzer read them from (``model.sources``: Falcon's
    ``num_kv_heads``, CodeGen's ``n_head``), in place, where those hold another value: a CPU-sized manifest's fewer
    heads (cpu_sized) reach the config class whatever it names them. A no-op at the manifest's own sizes."""
    for common, value in (("num_attention_heads", m.num_attention_heads), ("num_key_value_heads", m.num_key_value_heads)):
        source = m.sources.get(common, "")
        field = source.rsplit(".", 1)[-1]
        if source and " " not in source and field != common and field in d and d[field] != value:
            d[field] = value


# The nested configs of encoder towers beside the text backbone (not a BLT / MusicGen sub-model the text runs through)
_TOWERS = ("vision_config", "audio_config")
# Depth fields of a nested tower config
_TOWER_DEPTHS = ("num_hidden_layers", "num_layers", "num_blocks", "depth", "encoder_layers")


def shrink_towers(d: dict[str, Any], class_defaults: dict[str, Any]) -> list[str]:
    """Each encoder tower's nested config (``_TOWERS``, a sub-config dict with its own ``model_type``: Phi-4-multimodal's
    ``vision_config`` / ``audio_config``, built with the causal LM though text-only input never runs them) cut to one
    layer, in place; the config's own tower when it has one, else its class's (what transformers would build).
    Phi-4-multimodal's towers at their defaults held 908M of the tiny model's 961M parameters: the float64 model
    under test and reference took ~19 GB (``kvcache run`` killed). Widths stay: a tower's own shape rules hold.
    Returns "field: depth n -> 1" for each one cut."""
    cut = []
    for key in sorted({*class_defaults, *d}):
        tower = d.get(key, class_defaults.get(key))
        if key not in _TOWERS or not (isinstance(tower, dict) and tower.get("model_type")):
            continue
        tower = dict(tower)
        for depth in _TOWER_DEPTHS:
            value = tower.get(depth)
            if isinstance(value, int) and not isinstance(value, bool) and value > 1:
                cut.append(f"{key}.{depth} {value} -> 1")
                tower[depth] = 1
        if tower != d.get(key, class_defaults.get(key)):
            d[key] = tower
    return cut


def _dense_prefix_types(d: dict[str, Any], src: dict[str, Any]) -> None:
    """A per-layer MLP list that spells out ``first_k_dense_replace`` (transformers' DeepSeek-V3.2 / GLM-5:
    ``mlp_layer_types``) follows the shrunk prefix, in place: transformers builds from the list, the checkout
    from the number, and the two must agree on which tiny layers are MoE."""
    types, real_k = src.get("mlp_layer_types"), src.get("first_k_dense_replace")
    if not (isinstance(types, list) and isinstance(real_k, int) and "first_k_dense_replace" in d):
        return
    if types == ["dense" if i < real_k else "sparse" for i in range(len(types))]:
        n = len(d.get("mlp_layer_types") or types)
        d["mlp_layer_types"] = ["dense" if i < d["first_k_dense_replace"] else "sparse" for i in range(n)]


# Lists a transformers config class requires one entry per decoder layer of, under names without "layer"
# (BailingHybridConfig: "`swiglu_limits` must contain one limit per decoder layer"; its saved config.json spells them
# expert_swiglu_limit_list / share_expert_swiglu_limit_list, the attribute_map's keys)
PER_LAYER_LISTS = frozenset({"swiglu_limits", "swiglu_limits_shared", "expert_swiglu_limit_list",
                             "share_expert_swiglu_limit_list",
                             # Gemma3nTextConfig: "activation_sparsity_pattern must have an explicit activation
                             # sparsity value for every layer"
                             "activation_sparsity_pattern"})


def _trim_per_layer_fields(d: dict[str, Any], real_layers: int, n: int) -> None:
    """Every per-layer field cut to the first ``n`` layers, in place: lists with one entry per layer whose
    name says so (``layer_types``, ``mlp_layer_types``, ...) or that a config class requires one per layer under
    another name (``PER_LAYER_LISTS``), and dicts keyed by layer index (transformers' ``per_layer_config``:
    ``{"05": {...}}``)."""
    for key, value in list(d.items()):
        if "layer" not in key and key not in PER_LAYER_LISTS:
            continue
        if isinstance(value, list) and len(value) == real_layers:
            d[key] = value[:n]
        elif isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
            d[key] = {k: v for k, v in value.items() if int(k) < n}


def cpu_sized(manifest: SelectionManifest, real: dict[str, Any] | None = None) -> SelectionManifest | None:
    """The manifest of the same model with the sizes CPU sequences can exercise (None: already small enough):
    a window they can cross, and a DSA selection (``dsa.index_topk``) narrower than their prompts; with the
    config (``real``), fewer heads where the tiny model's hidden size ties to a wide heads x head_dim
    (``cpu_heads``), and RWKV's token shift and wkv at a narrower hidden size (``recurrent.cpu_widths``).

    Each band keeps its distance to the window (pre_tokens = window - offset), so the tiny render
    has the same reading of the band as the real one; the implementer renders it like any manifest.
    """
    long_window = any(layer.sliding_window and layer.sliding_window > MAX_CPU_WINDOW for layer in manifest.layers)
    narrowed = kind_of(manifest).cpu_narrowed(manifest)  # a kind's own width CPU prompts cannot exercise
    # a chunk CPU prompts cross several times: one block (the chunk stays a multiple of the block size)
    long_chunk = (manifest.attention_chunk_size() or 0) > manifest.block_size
    heads = cpu_heads(manifest, real) if real is not None else None
    looped = loops.cuts(manifest)  # Dory: fewer layers in and around its looped section
    crossed = cross.cpu_section(manifest, real, heads)  # Mllama: a smaller image, the cross heads with the model's
    data = manifest.model_dump(mode="json")
    narrower_states = recurrent.cpu_widths(data, manifest, real)  # RWKV: its token shift and wkv at CPU widths
    if not (long_window or narrowed or long_chunk or heads or looped or crossed or narrower_states):
        return None
    loops.cpu_loops(data, manifest)
    if heads:
        _set_heads(data, manifest, *heads)
    if crossed:
        data["cross_attention"] = crossed
    if long_chunk:
        for layer in data["layers"]:
            if layer.get("attention_chunk_size"):
                layer["attention_chunk_size"] = manifest.block_size
    if long_window:
        for layer in data["layers"]:
            if layer.get("sliding_window"):  # a state layer (StateLayerPlan) has no window field
                layer["pre_tokens"] = SHRUNK_WINDOW - (layer["sliding_window"] - layer["pre_tokens"])
                layer["sliding_window"] = SHRUNK_WINDOW
    for section, fields in narrowed.items():
        data[section].update(fields)
    small = SelectionManifest.model_validate(data)
    if heads and _config_heads(real, small) != heads:  # the config class keeps its heads elsewhere: shrink none
        return cpu_sized(manifest)
    return small


def cpu_heads(manifest: SelectionManifest, real: dict[str, Any]) -> tuple[int, int] | None:
    """(query heads, KV heads) of a CPU run with fewer heads (the kind's ``cpu_heads`` rule), where it pays: the tiny
    model's hidden size ties to heads x head_dim (``tied_width``) above ``MAX_CPU_TIED_WIDTH``, or, at any hidden size,
    its K/V width (KV heads x head_dim) is above it. None elsewhere: a model at hidden 128 whose K/V rows are at most
    that wide (Qwen3-8B's 8 x 128) runs with every head."""
    rule = getattr(kind_of(manifest), "cpu_heads", None)  # the kinds whose hidden size can tie to their heads
    heads = rule(manifest) if rule else None
    m = manifest.model
    if heads is None or holds_states(manifest) or m.num_attention_heads * m.head_dim <= MAX_CPU_TIED_WIDTH:
        return None
    if m.num_key_value_heads * m.head_dim > MAX_CPU_TIED_WIDTH:  # wide K/V rows, tied or not: no probe needed
        return heads
    width = tied_width(real, manifest)
    return heads if width is not None and width > MAX_CPU_TIED_WIDTH else None


def heads_reason(manifest: SelectionManifest) -> str:
    """Why ``cpu_heads`` shrank the heads, for the notes: the K/V width where it is above the bound, else the tied
    hidden size."""
    m = manifest.model
    if m.num_key_value_heads * m.head_dim > MAX_CPU_TIED_WIDTH:
        return (f"the K/V rows are {m.num_key_value_heads} x {m.head_dim} = {m.num_key_value_heads * m.head_dim} wide, "
                f"above {MAX_CPU_TIED_WIDTH}")
    return f"the tiny model's hidden size ties to heads x head_dim ({m.num_attention_heads * m.head_dim})"


def tied_width(real: dict[str, Any], manifest: SelectionManifest) -> int | None:
    """The hidden size the tiny model ties to heads x head_dim, None where it runs at 128: Falcon's by construction,
    the others' found as ``build_tiny_model`` finds it (a model at 128 that fails to build, to run, or runs with
    another head_dim; the same cached probe)."""
    m = manifest.model
    if HF_MODEL_TYPE.get(m.model_type, m.model_type) in _HEAD_DIM_FROM_HIDDEN:
        return m.num_attention_heads * m.head_dim
    return _first_build(real, manifest, 0, None)[-1]


def _set_heads(data: dict[str, Any], manifest: SelectionManifest, heads: int, kv_heads: int) -> None:
    """A manifest dump with ``heads`` query and ``kv_heads`` KV heads (all ranks), in place: the model's counts, the
    per-rank counts and every cache row's shape (analyzer.kinds.cache_row_shape, the invariant's own rule)."""
    from model_infer_kvcache.analyzer.kinds import cache_row_shape

    tp = manifest.parallel.attn_tp_size
    data["model"].update(num_attention_heads=heads, num_key_value_heads=kv_heads)
    data["parallel"].update(num_q_heads_per_rank=heads // tp, num_kv_heads_per_rank=kv_heads // tp)
    rows, dim = cache_row_shape(manifest, kv_heads // tp, manifest.model.head_dim)
    for layer in data["layers"]:
        for cache in layer.get("caches") or ():
            cache["num_head"] = rows
            if dim is not None:
                cache["dim"] = dim


def _config_heads(real: dict[str, Any], small: SelectionManifest) -> tuple[int, int] | None:
    """(query heads, KV heads) transformers' config class holds for the tiny config of ``small`` at its tied hidden
    size (its text config; no KV-head field: MHA); None where the class refuses the config."""
    from transformers import AutoConfig

    d, _ = tiny_config_dict(real, small)
    hf_type = d.pop("model_type")
    d["hidden_size"] = small.model.num_attention_heads * small.model.head_dim
    try:
        config = AutoConfig.for_model(hf_type, **_with_aliases(d, hf_type)).get_text_config()
    except Exception:  # noqa: BLE001 - the config class's own validation (its error class varies): keep the heads
        return None
    heads = config.num_attention_heads
    return heads, getattr(config, "num_key_value_heads", None) or heads


def cpu_sizes_note(manifest: SelectionManifest, small: SelectionManifest) -> str:
    """What ``cpu_sized`` changed, for a report note ("window 4096 -> 160, index_topk 2048 -> 64")."""
    parts = []
    if manifest.sliding_window() != small.sliding_window():
        parts.append(f"window {manifest.sliding_window()} -> {small.sliding_window()}")
    if manifest.attention_chunk_size() != small.attention_chunk_size():
        parts.append(f"attention_chunk_size {manifest.attention_chunk_size()} -> {small.attention_chunk_size()}")
    m, s = manifest.model, small.model
    if (m.num_attention_heads, m.num_key_value_heads) != (s.num_attention_heads, s.num_key_value_heads):
        parts.append(f"heads {m.num_attention_heads} -> {s.num_attention_heads} and KV heads {m.num_key_value_heads} "
                     f"-> {s.num_key_value_heads} (head_dim {m.head_dim}, the query/KV group "
                     f"{m.num_attention_heads // m.num_key_value_heads}, attention TP {manifest.parallel.attn_tp_size} "
                     f"kept; {heads_reason(manifest)}: heads x head_dim {m.num_attention_heads * m.head_dim} "
                     f"-> {s.num_attention_heads * s.head_dim})")
    parts += kind_of(manifest).cpu_size_changes(manifest, small) + cross.cpu_size_changes(manifest, small)
    parts += recurrent.cpu_size_changes(manifest, small)
    return ", ".join(parts)


def require_transformers_type(model_type: str) -> None:
    """One-line refusal when transformers lacks the architecture (remote-code models: Baichuan...)."""
    hf_type = HF_MODEL_TYPE.get(model_type, model_type)
    if not transformers_ships(hf_type):
        import transformers

        raise InputError("--config", f"transformers {transformers.__version__} has no model type {hf_type!r}: validation "
                                     "builds the architecture from transformers' own code, so it cannot run for this "
                                     "model (analyze and render do not need it)", field="model_type")


def _first_build(real: dict[str, Any], manifest: SelectionManifest, seed: int,
                 fixed: dict[str, tuple[Any, str]] | None):
    """The tiny config and its model at hidden size 128: (the config as read, d, plan, hf_type, build, model or None,
    the build's error or None, the width to retry with tied to heads x head_dim or None)."""
    from model_infer_kvcache.analyzer.hf_models import causal_lm_from_config
    from transformers import AutoConfig

    lin = manifest.linear_attention
    lightning = kvcache_reference(lin)
    if lightning:  # the fields Ling-2.5's config omits mean its own class's defaults, not transformers' Ling-3.0's
        from model_infer_kvcache.validators.pipeline.ling_lightning import with_ling_2_5_defaults

        real = with_ling_2_5_defaults(real)
    d, plan = tiny_config_dict(real, manifest)
    keep_fixed(d, real, fixed or {}, plan.notes)
    hf_type = d.pop("model_type")
    require_transformers_type(hf_type)
    class_defaults = AutoConfig.for_model(hf_type).to_dict()
    for key in _DERIVED_MLP_WIDTHS:
        if key in class_defaults or key in d:
            d[key] = 128
    # Every other MLP width the family names (Ergo's first_dense_ / shared_intermediate_size 32768 / 8192, Qwen-MoE's
    # shared_expert_intermediate_size): at a tied hidden size of heads x head_dim its dense layers alone would take
    # gigabytes
    for key in sorted({*class_defaults, *d} - {"intermediate_size", "moe_intermediate_size"}):
        value = d.get(key, class_defaults.get(key))
        if key.endswith("intermediate_size") and isinstance(value, int) and not isinstance(value, bool) and value > 128:
            d[key] = 128
    for key, value in list(d.items()):  # a nested section (DBRX's ffn_config): the same widths and expert counts
        if isinstance(value, dict):
            d[key] = _shrunk_section(value)
    language = _default_language(d, class_defaults)
    if language:
        plan.notes.append(language)
    shrunk = shrink_towers(d, class_defaults)
    if shrunk:
        plan.notes.append("encoder towers the text stream never runs cut to one layer: " + ", ".join(shrunk))
    # MusicGen: a frame of num_codebooks codes per position, where the model embeds one stream per codebook (Moshi's
    # num_codebooks are its audio's: its causal LM embeds one text stream)
    if codebooks.names_codebooks(d) and codebooks.several_streams(
            lambda: causal_lm_from_config(AutoConfig.for_model(hf_type, **_with_aliases(d, hf_type)))):
        framed = codebooks.tiny_codebook_fields(d, TINY_VOCAB)
        if framed:
            plan.notes.append(framed)
    moved = fit_token_ids(d, class_defaults, d["vocab_size"])
    if moved:
        plan.notes.append("token ids moved into the tiny vocabulary: "
                          + ", ".join(f"{old} -> {new}" for old, new in sorted(moved.items())))
    def build(d: dict[str, Any]):
        config = AutoConfig.for_model(hf_type, **_with_aliases(d, hf_type))
        config._attn_implementation = "eager"
        # The eager experts loop: grouped_mm kernels take no float64 (the default comparison dtype).
        config._experts_implementation = "eager"
        torch.manual_seed(seed)
        if lightning:
            # transformers has no Ling-2.5: its Ling-family code with a plain-torch lightning attention
            from model_infer_kvcache.validators.pipeline.ling_lightning import build_ling_lightning

            return build_ling_lightning(config)
        # several token streams per position (MusicGen's codebooks): fed as frames, one stream token each
        return codebooks.bind_frames(causal_lm_from_config(config, dtype=torch.float32))

    try:
        model, failed = build(d), None
        width = _width_if_tied(model, d, manifest)
    except Exception as exc:  # noqa: BLE001 - GPT-2 / CWM refuse a hidden size their heads do not divide (the
        # config's own validation error class varies); re-raised below unless the tied width builds
        model, failed, width = None, exc, _tied_width(d, manifest)
    return real, d, plan, hf_type, build, model, failed, width


def build_tiny_model(real: dict[str, Any], manifest: SelectionManifest, seed: int = 0,
                     fixed: dict[str, tuple[Any, str]] | None = None):
    """(model, plan): a float32 eager transformers model with random weights. ``fixed``: fields the model
    under test fixes whatever its config says (``registry.config_class_constants``)."""
    real, d, plan, hf_type, build, model, failed, width = _first_build(real, manifest, seed, fixed)
    lin = manifest.linear_attention
    lightning = kvcache_reference(lin)
    if width is not None:
        try:
            tied = build({**d, "hidden_size": width})
            runs = _runs(tied)
        except Exception:  # noqa: BLE001 - the retry failing too: the first error is the one to report
            runs = False
        if runs:
            d["hidden_size"], model = width, tied
            plan.notes.append(f"hidden_size {width} (= heads x head_dim, not 128): transformers' {hf_type} "
                              "attention cannot run with the two apart (an output projection or q/k norm over "
                              "hidden_size, a head_dim derived from it)")
    if model is None:
        first = str(failed).splitlines()[0][:200] if str(failed) else ""
        as_given = _as_given_error(real, hf_type)
        if as_given is not None:
            # transformers' own code fails on the config as written (DBRX's class defaults: no attn_config.rope_theta,
            # clip_qkv None; Cohere Compass's: no rope_parameters entry per layer type): the reference cannot exist,
            # whatever kvcache shrinks. The message names that error and the line of transformers that raised it.
            import transformers
            from model_infer_kvcache.analyzer.hf_models import where_transformers_failed

            what = str(as_given).splitlines()[0][:200] if str(as_given) else ""
            where = where_transformers_failed(as_given)
            raise InputError("--config", f"transformers {transformers.__version__}'s {hf_type} does not build from "
                                         f"this config as written ({type(as_given).__name__}: {what}"
                                         + (f", raised at {where}" if where else "") + "): validation builds the "
                                         "architecture from transformers' own code", field="model_type") from as_given
        # transformers' own config class refuses the shrunk fields: kvcache's shrinking of this family, named, not a
        # crash and not the model's failure
        raise NotSupportedByKvcache("--config", f"a reference: transformers' {hf_type} does not build at the "
                                                f"validation's tiny config ({type(failed).__name__}: {first}); "
                                                "kvcache does not shrink this family's config yet",
                                    field="model_type") from failed
    _require_forward(model, hf_type, d)
    plan.config.update(model_type=hf_type, **_with_aliases(d, hf_type))
    if lightning:
        plan.notes.append(f"reference: {lin.reference}")
    _randomize(model, seed)
    model.eval()
    return model, plan


def _default_language(d: dict[str, Any], class_defaults: dict[str, Any]) -> str | None:
    """A config whose model routes by language (X-MOD's per-language adapters: ``languages``) and names no
    ``default_language`` refuses input without ``lang_ids`` (modeling_xmod.py: "Input language unknown"); the host
    and the reference feed token ids only, so the tiny config names the first of its languages, in place. Returns
    the note saying so, None where nothing changed."""
    languages = d.get("languages", class_defaults.get("languages"))
    if "default_language" not in {*d, *class_defaults} or d.get("default_language") or not languages:
        return None
    d["default_language"] = list(languages)[0]
    return (f"default_language {d['default_language']!r} (the first of its languages): the config names none, and "
            "its model refuses token ids without lang_ids; the attention under test does not read the language")


def _shrunk_section(section: dict[str, Any]) -> dict[str, Any]:
    out = dict(section)
    for key, value in section.items():
        if (key.endswith("intermediate_size") or key in _DERIVED_MLP_WIDTHS) and isinstance(value, int) \
                and not isinstance(value, bool) and value > 128:
            out[key] = 128
    out.update((key, value) for key, value in _MOE_SIZES if key in out)
    return out


def _with_aliases(d: dict[str, Any], hf_type: str) -> dict[str, Any]:
    """A field the tiny config sets by its common name (hidden_size) goes under the name the family's config class
    keeps (DBRX's d_model, through its attribute_map): passing both, the class keeps the published value. The map
    the analyzer reads too (analyzer/hf_config_source)."""
    from model_infer_kvcache.analyzer.hf_config_source import config_class_facts

    out = dict(d)
    for common, own in config_class_facts(hf_type).attribute_map.items():
        if common in out and own in out and common != own:
            out[own] = out.pop(common)
    return out


def _as_given_error(real: dict[str, Any], hf_type: str) -> Exception | None:
    """What transformers raises building the config as written (on the meta device: no memory, no weights); None
    when it builds."""
    from model_infer_kvcache.analyzer.hf_models import causal_lm_from_config
    from transformers import AutoConfig

    src = model_section(real)[0]
    fields = {k: v for k, v in {**real, **src}.items() if k not in _DROP and k != "model_type"}
    try:
        config = AutoConfig.for_model(hf_type, **fields)
        with torch.device("meta"):
            causal_lm_from_config(config)
    except Exception as exc:  # noqa: BLE001 - whichever error transformers raises, it is its own code failing
        return exc
    return None


def _forward_once(model) -> None:
    """One forward of two tokens, as the host and the reference call the model: eval, no grad, no transformers
    cache (Ling-2.5's reference refuses one)."""
    model.eval()
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 2, dtype=torch.long), use_cache=False)


def _runs(model) -> bool:
    try:
        _forward_once(model)
    except RuntimeError:
        return False
    return True


def _width_if_tied(model, d: dict[str, Any], manifest: SelectionManifest) -> int | None:
    """heads x head_dim when the tiny model does not run with hidden_size 128 (Helium's o_proj maps hidden -> hidden,
    OLMoE's q_norm spans hidden_size) or runs with another head_dim than the manifest's (Persimmon, StableLM, GPT-NeoX
    derive it from hidden_size): the caller retries with the two equal and keeps that only if it runs. None when the
    model runs as planned (or the manifest is MLA / linear, sized otherwise)."""
    width = _tied_width(d, manifest)
    if width is None:
        return None
    key = json.dumps([manifest.model.model_type, manifest.model.head_dim, d], sort_keys=True, default=str)
    if key in _RUNS_AS_PLANNED:  # the same tiny config is built again and again (ranks, sweeps, tests)
        return None
    if _runs(model) and _head_dim_of(model) in (None, manifest.model.head_dim):
        _RUNS_AS_PLANNED.add(key)
        return None
    return width


_RUNS_AS_PLANNED: set[str] = set()  # tiny configs whose hidden-128 model ran with the manifest's head_dim
_REFERENCE_RUNS: set[str] = set()  # tiny configs whose reference ran one forward


def _require_forward(model, hf_type: str, d: dict[str, Any]) -> None:
    """The reference must run before anything is judged against it: a transformers model that cannot run one
    forward at the tiny config (GLM-4V's default text config: an M-RoPE section for another rotary width) would
    otherwise surface as the render's operator error (V201). Exit 2 naming it, never the render's failure."""
    key = json.dumps([hf_type, d], sort_keys=True, default=str)
    if key in _REFERENCE_RUNS:
        return
    try:
        _forward_once(model)
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises, the reference is unusable
        raise NotSupportedByKvcache("--config", f"a reference: transformers' own "
                                    f"{getattr(model, 'reference_name', type(model).__name__)} ({hf_type}) "
                                    f"does not run one forward at the validation's tiny config "
                                    f"({type(exc).__name__}: {exc}); check the config's own consistency (transformers' "
                                    "class defaults included) before the render", field="model_type") from None
    _REFERENCE_RUNS.add(key)


def _head_dim_of(model) -> int | None:
    """The head_dim the first attention module keeps (Persimmon, StableLM and the BERT-era families derive it from
    hidden_size / heads, whatever the config's head_dim says), None where it keeps none."""
    from model_infer_kvcache.analyzer.hf_layout import LayoutError, attention_modules

    try:
        module = next((m for _, m in attention_modules(model) if m is not None), None)
    except LayoutError:
        return None
    # the BERT-era modules name it attention_head_size, GPT-NeoX-Japanese head_size
    for name in ("head_dim", "attention_head_size", "head_size"):
        d = getattr(module, name, None)
        if isinstance(d, int) and not isinstance(d, bool):
            return d
    split, heads = getattr(module, "split_size", None), getattr(module, "n_head", None)
    if all(isinstance(x, int) and not isinstance(x, bool) for x in (split, heads)) and heads:
        return split // heads  # GPT-1: its heads split split_size (n_embd) evenly
    return None


def _tied_width(d: dict[str, Any], manifest: SelectionManifest) -> int | None:
    """heads x head_dim, the hidden size to retry with; None where it is already that, or for MLA / linear models."""
    m = manifest.model
    width = m.num_attention_heads * m.head_dim
    if not kind_of(manifest).HIDDEN_CAN_TIE_TO_HEADS or d.get("hidden_size") == width or holds_states(manifest):
        return None
    return width


def keep_fixed(d: dict[str, Any], real: dict[str, Any], fixed: dict[str, tuple[Any, str]], notes: list[str]) -> None:
    """A size the tiny config shrank but the model under test fixes (its config class assigns a constant) goes
    back to that constant, in place; when the real config itself disagrees with the constant the tiny config
    keeps the real meaning and a note says the model ignores the field (the comparison then shows it)."""
    src = model_section(real)[0]
    for name, (value, where) in sorted(fixed.items()):
        if name not in d or d[name] == value:
            continue
        if src.get(name) == value:
            d[name] = value
            notes.append(f"{name} kept at {value!r}: the checkout's config class fixes it ({where}), so the tiny "
                         "model does not shrink it")
        else:
            notes.append(f"the checkout's config class fixes {name} = {value!r} ({where}); the config says "
                         f"{src.get(name)!r}: the checkout ignores the config's value")


def fit_token_ids(d: dict[str, Any], class_defaults: dict[str, Any], vocab: int) -> dict[int, int]:
    """Put every token id field (pad/bos/eos..., ints or lists, from the config or the class
    defaults that come back when the config omits them) inside ``range(vocab)``, in place.

    Ids already inside stay; the others map, in sorted order, onto the top of the vocabulary, so
    ids that were equal stay equal and distinct ones stay distinct. Returns the mapping used.
    """
    fields = {k: d.get(k, class_defaults.get(k)) for k in {*class_defaults, *d}
              if k.endswith(("token_id", "token_ids"))}
    ids = {i for v in fields.values() for i in (v if isinstance(v, list) else [v])
           if isinstance(i, int) and not isinstance(i, bool)}
    outside = sorted(i for i in ids if not 0 <= i < vocab)
    free = [i for i in range(vocab - 1, -1, -1) if i not in ids][:len(outside)]
    moved = dict(zip(outside, free, strict=True))
    for key, value in fields.items():
        if isinstance(value, list):
            d[key] = [moved.get(i, i) if isinstance(i, int) else i for i in value]
        elif isinstance(value, int) and not isinstance(value, bool):
            d[key] = moved.get(value, value)
    return moved


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights big enough that attention patterns matter (default init is nearly uniform)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / p.shape[-1]) ** 0.5)
            elif name.endswith("sinks") or name.endswith(cross.GATE_PARAMS):
                p.copy_(torch.randn(p.shape, generator=g))
            elif "norm" in name or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
