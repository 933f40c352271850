"""The decisions table for progress.md (`| 决策项 | 选择 | 理由 |`), derived from a manifest."""

from __future__ import annotations

from model_infer_kvcache.analyzer.framework_checkout import (
    DEFAULT_RENDER_CONTRACT,
    frameworks_taking,
    render_api,
)
from model_infer_kvcache.analyzer.kinds import byte_patch_section
from model_infer_kvcache.analyzer.kinds import cross as cross_kind
from model_infer_kvcache.analyzer.kinds import drafter as drafter_kind
from model_infer_kvcache.analyzer.kinds.formats import format_of_manifest
from model_infer_kvcache.analyzer.kv_cache_spec import ChunkedLocalSpec, serves_layer_kind
from model_infer_kvcache.analyzer.manifest import LayerPlan, SelectionManifest
from model_infer_kvcache.analyzer.operators.fa_facts import SPARSE_FA

SECTION_ID = "analyze"
SECTION_TITLE = "### KVCache 选型决策"


# Reasons are English in every table (like the manifest's own reasons); labels stay in the
# progress.md section's Chinese.
_LAYOUT_REASON = {
    "TND": "paged: packed TND (the variable-length batch as one token axis, like the framework's 1-D inputs)",
    "TND_NTD": "MLA absorb: query packed TND, output NTD for the W_UV projection",
    "BSH": "Legacy contiguous cache [batch, seq, heads*dim]",
}
# What a default-sourced decision tells the agent: nothing stated it, so ask before building on it.
YES_NO = {True: "是", False: "否"}  # a yes/no cell of the tables (SKILL.md's too)
CONFIRM_DEFAULT = "DEFAULT, nothing stated it: read progress.md yourself and confirm with the user"


def _ranges(indices: list[int]) -> str:
    out, start, prev = [], None, None
    for i in indices:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            out.append(f"{start}-{prev}" if start != prev else str(start))
            start = prev = i
    if start is not None:
        out.append(f"{start}-{prev}" if start != prev else str(start))
    return ",".join(out)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _layer_groups(m: SelectionManifest) -> list[tuple[LayerPlan, list[int]]]:
    groups: dict[tuple, tuple[LayerPlan, list[int]]] = {}
    for layer in m.layers:
        # a state layer has no FA fields: its kind and attn_type group it
        key = (layer.attn_type, layer.layer_kind) + (() if layer.is_state else (
            layer.sliding_window, layer.sparse_mode, layer.pre_tokens, layer.mask))
        groups.setdefault(key, (layer, []))[1].append(layer.index)
    return list(groups.values())


def _deploy_reason(m: SelectionManifest) -> str:
    d = m.deploy_mode
    reason = f"source {d.source}: " + "; ".join(d.evidence)
    if d.source == "default":
        reason += f" — {CONFIRM_DEFAULT} (then pass --deploy-mode, or a dispatch line '部署模式: 框架部署' or '部署模式: 独立部署')"
    return reason


def decision_rows(m: SelectionManifest) -> list[tuple[str, str, str]]:
    rows = [
        ("部署模式", m.deploy_mode.value, _deploy_reason(m)),
        ("KV 模式", m.kv_mode.value, m.kv_mode.reason),
    ]
    legacy = m.legacy_attention
    if legacy is not None:
        value = ("模型自身的 eager 注意力(不调用 FA" + (f",soft-cap {legacy.softcap:g}" if legacy.softcap is not None
                                                        else "") + ")") if legacy.kernel == "model" else "BSH FA 调用"
        rows.append(("Legacy 注意力", value, legacy.reason))
    if m.deploy_mode.value == "framework":
        rows.append(("框架 API 代际", _generation_value(m.framework_api), m.framework_api_evidence))
    # Which attention call the layers make: FA (its version, layout and path table), DSA's sparse FA over the
    # indexer's selection, or none (a Legacy model keeping its own eager attention).
    fmt = format_of_manifest(m)
    own_attention = legacy is not None and legacy.kernel == "model"
    for layer, idx in _layer_groups(m):
        window = f", sliding_window={layer.sliding_window}" if layer.sliding_window else ""
        if layer.is_state:
            rows.append((f"attn_type (层 {_ranges(idx)})", f"{layer.attn_type} (config: linear,循环状态)",
                         f"group_key={layer.group_key}; states "
                         + ", ".join(f"{s.name} {s.shape} {s.dtype}" for s in layer.states)))
            continue
        kind = "" if serves_layer_kind(layer.attn_type, layer.layer_kind) else f" (config: {layer.layer_kind},见阻塞项)"
        rows.append((f"attn_type (层 {_ranges(idx)})", f"{layer.attn_type}{window}{kind}",
                     f"group_key={layer.group_key}"))
        if not fmt.fa_call or own_attention:  # the FA path table's sparse_mode / band apply to no call of theirs
            continue
        rows.append((f"sparse_mode / mask (层 {_ranges(idx)})",
                     f"prefill {layer.sparse_mode.prefill}/{layer.mask.prefill}, "
                     f"decode {layer.sparse_mode.decode}/{layer.mask.decode}",
                     layer.window_derivation or "per the FA path table"))
        if layer.attention_chunk_size:
            rows.append((f"chunk (层 {_ranges(idx)})", f"attention_chunk_size={layer.attention_chunk_size}, manager "
                         f"{layer.registers_as[0]} (window {layer.registers_as[1]})", ChunkedLocalSpec.manager_reason))
        if layer.sliding_window:
            rows.append((f"pre_tokens / next_tokens (层 {_ranges(idx)})",
                         f"{layer.pre_tokens} / {layer.next_tokens}", layer.window_derivation or ""))
    # the model's shape: the first cached layer without a shape of its own (layers[i].head_dim / num_kv_heads_per_rank)
    def own_shape(layer) -> bool:  # Gemma-4's full layers (head_dim / KV heads), Dots3-Note's sliding MLA layers
        return layer.head_dim is not None or layer.num_kv_heads_per_rank is not None or layer.mla_dims is not None

    cached = next((layer for layer in m.layers if layer.caches and not own_shape(layer)),
                  next((layer for layer in m.layers if layer.caches), None))
    shaped: dict[tuple, list[int]] = {}  # a per-layer shape's entries -> its layers
    for layer in m.layers:
        if layer.caches and layer is not cached and own_shape(layer):
            shaped.setdefault(tuple((c.name, c.dim, c.num_head, c.dtype) for c in layer.caches), []).append(layer.index)
    # an MLA layer's own query heads per rank and softmax scale (per_layer_config) -> its layers
    own_heads: dict[int, list[int]] = {}
    own_scale: dict[float, list[int]] = {}
    for layer in m.attention_layers:
        if layer.num_q_heads_per_rank is not None:
            own_heads.setdefault(layer.num_q_heads_per_rank, []).append(layer.index)
        if layer.softmax_scale is not None:
            own_scale.setdefault(layer.softmax_scale, []).append(layer.index)
    rows.append(("混合 attn_type", "是" if m.mixed_attn_types else "否", "each layer sets its attn_type from its "
                 "index in __init__" if m.mixed_attn_types else "every layer has the same attn_type"))
    if not m.attention_layers:  # a pure state stack: no attention call, cache entry, head split or KV block to decide
        rows.append(("注意力", "无(纯状态栈)", "no layer attends: no KV cache, no FA call, no softmax scale; every "
                     "layer keeps a fixed-size state per request (row 线性注意力 below)"))
    elif not fmt.fa_call:
        rows.append(fmt.call_row(m))
    elif own_attention:
        rows.append(("cache 布局", m.fa.input_layout, _LAYOUT_REASON.get(m.fa.input_layout, "")
                     + "; the model's own attention reads it (no FA call: no FA version, sparse_mode or band)"))
    else:
        rows += [("FA 版本", m.fa.version, m.fa.reason),
                 ("input_layout", m.fa.input_layout, _LAYOUT_REASON.get(m.fa.input_layout, ""))]
    rows += [] if not m.attention_layers else [
        ("softmax scale", f"{m.fa.softmax_scale:.8g}" + "".join(f"; 层 {_ranges(idx)}: {scale:.8g}"
                                                                for scale, idx in own_scale.items()),
         m.fa.scale_derivation + ("; layers with their own MLA head dims (per_layer_config) take their own "
                                  "(qk_nope_head_dim + qk_rope_head_dim)^-0.5" if own_scale else "")),
        ("MLA absorb", YES_NO[m.mla.absorb], m.mla.reason),
        ("写入算子", "-", "a drafter writes nothing: it reads its target's cache") if m.drafter is not None else
        ("写入算子", m.attention_layers[0].write_op if m.attention_layers else "-", "writes addressed by slot_mapping"
         if m.kv_mode.value == "paged" else "writes addressed by kv_len"),
        ("cache_entries", ", ".join(f"{c.name}: {c.dim}x{c.num_head} {c.dtype}" for c in cached.caches)
         + "".join(f"; 层 {_ranges(idx)}: " + ", ".join(f"{n}: {d}x{h} {t}" for n, d, h, t in entries)
                   for entries, idx in shaped.items())
         if cached else "-", "the latent is not split by attention TP" if fmt.latent
         else "num_head = KV heads per rank" + ("; layers with their own head_dim / KV heads (per-layer "
                                                "attention shapes) hold caches of that shape" if shaped else "")),
        ("每卡 heads", f"Q {m.parallel.num_q_heads_per_rank} / KV {m.parallel.num_kv_heads_per_rank}"
         + "".join(f"; 层 {_ranges(idx)}: Q {q}" for q, idx in own_heads.items()),
         f"attn_tp_size={m.parallel.attn_tp_size} ({m.parallel.attn_tp_source})"
         + ("; KV heads replicated" if m.parallel.kv_heads_replicated else "")
         + (f" — {CONFIRM_DEFAULT} (then pass --attn-tp-size)" if m.parallel.attn_tp_source.startswith("default")
            else "")),
        ("block_size", str(m.block_size), "the paged FA path needs 128..512, a multiple of 128"),
        ("每 token KV 字节(单卡)", str(m.memory.per_token_bytes), m.memory.derivation[0] if m.memory.derivation
         else ""),
    ]
    if m.mtp:
        mode = (f"decode sparse_mode {m.mtp.decode_sparse_mode}" if fmt.fa_call
                else f"verify 步同样经稀疏 FA,sparse_mode {SPARSE_FA.sparse_mode}")
        rows.append(("MTP", f"{m.mtp.num_layers} 层, {mode}", m.mtp.reason))
    if m.memory.blocks:
        rows.append(("block 数", ", ".join(f"{k}={v}" for k, v in m.memory.blocks.items()),
                     "; ".join(m.memory.derivation[1:])))
    if m.drafter is not None:
        rows.append(drafter_kind.decision_row(m))
    if m.byte_patches is not None:
        rows.append(byte_patch_section.decision_row(m.byte_patches))
    if m.cross_attention is not None:
        rows.append(cross_kind.decision_row(m))
    if m.cache_dtype is not None:
        rows.append(("cache dtype", f"{m.cache_dtype.value}(config: {m.cache_dtype.config_dtype})",
                     m.cache_dtype.reason))
    lin = m.linear_attention
    if lin is not None:
        conv = f"conv kernel {lin.conv_kernel}, " if lin.conv_kernel else "无 short conv, "
        heads = (f"每卡 heads K {lin.num_k_heads_per_rank} / V {lin.num_v_heads_per_rank}" if lin.num_v_heads_per_rank
                 else "只有 conv 状态(无循环状态)")
        rows.append(("线性注意力(循环状态)", f"{lin.family}, {len(lin.layers)} 层, {conv}{heads}, 每层每请求 "
                     f"{lin.state_bytes_per_layer} B", f"{lin.reason}; registered as {lin.framework_entry}; prefill: "
                     f"{lin.operators['prefill']}; decode: {lin.operators['decode']}; reference: "
                     f"{lin.reference or 'none (transformers implements no such architecture)'}"))
    rows += fmt.decision_rows(m)  # the format's own section (analyzer/kinds/<format>.py)
    return rows


def _generation_value(generation: str | None) -> str:
    """The framework generation as the table shows it: G3 says the contract its renders follow; unknown says what
    the default render fits."""
    if generation is None:
        return (f"未知(按 {DEFAULT_RENDER_CONTRACT} 契约渲染,"
                f"{'/'.join(frameworks_taking(DEFAULT_RENDER_CONTRACT))} 框架都接受)")
    contract = render_api(generation)
    return generation if contract == generation else f"{generation}(渲染按 {contract} 契约)"


def decisions_markdown(m: SelectionManifest) -> str:
    lines = [SECTION_TITLE, "", f"模型 `{m.model.model_type}`,manifest schema {m.schema_version},"
             f"hash `{m.content_hash()}`", "", "| 决策项 | 选择 | 理由 |", "|---|---|---|"]
    lines += [f"| {_cell(a)} | {_cell(b)} | {_cell(c)} |" for a, b, c in decision_rows(m)]
    for title, items in (("阻塞项", m.blockers), ("待确认问题", m.open_questions), ("警告", m.warnings)):
        if items:
            lines += ["", f"**{title}**", ""]
            lines += [f"- {i.message}" + (f"(字段: {', '.join(i.fields)})" if i.fields else "") for i in items]
    if m.device_dependencies:
        src = m.device_readings
        # A dry run (emulated backend) measured nothing: its dependencies read as assumptions, whatever an
        # older manifest recorded as their status.
        dry = src is not None and src.backend != "npu"
        title = ("**依赖的设备行为(需 NPU 实测确认)**" if src is None
                 else "**依赖的设备行为(读法文件是 CPU 仿真 dry run,不算实测:仍需在 NPU 上跑 kvcache probe)**" if dry
                 else "**依赖的设备行为(读法文件实测)**")
        lines += ["", title, ""]
        if src is not None:
            lines.append(f"读法文件 `{src.file}`:backend {src.backend}"
                         + ("(CPU 仿真 dry run,不代表设备)" if dry else "")
                         + f",SoC {src.soc or '?'},torch_npu {src.torch_npu_version or '-'},"
                         f"CANN {src.cann_version or '?'},probe v{src.probe_version}")
            others = {q: r for q, r in src.settled.items() if q not in {d.question for d in m.device_dependencies}}
            if others and not dry:
                lines.append("设计不依赖、但已实测:" + ", ".join(f"{q}={r}" for q, r in others.items()))
            lines.append("")
        lines += [f"- {d.question}: {_dependency_status(d, dry)} — {d.consequence}" for d in m.device_dependencies]
    return "\n".join(lines) + "\n"


_STATUS = {"confirmed": "实测确认", "contradicted": "实测否定", "unknown": "实测输出不符合任何已知读法"}


def _dependency_status(d, dry_run: bool = False) -> str:
    if d.status == "assumed" or dry_run:
        return f"假设 {d.assumed}(未实测),另一读法 {d.alternative}"
    return f"{_STATUS[d.status]}:实测 {d.measured},设计按 {d.assumed}"
