"""Gather the facts, call the rules, assemble the SelectionManifest."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from model_infer_kvcache.analyzer import arch_check, kv_cache_spec, memory, rules
from model_infer_kvcache.analyzer.config_loader import (
    LIMITS,
    ModelFacts,
    Sourced,
    config_dtype,
    normalize_config,
    read_config_file,
)
from model_infer_kvcache.analyzer.deploy_context import (
    FACT_LABELS,
    DispatchFacts,
    ProgressFacts,
    load_progress,
    parse_dispatch,
    parse_progress,
)
from model_infer_kvcache.analyzer.device_questions import QUESTIONS
from model_infer_kvcache.analyzer.errors import InputError, NotSupportedByKvcache
from model_infer_kvcache.analyzer.files import same_file
from model_infer_kvcache.analyzer.framework_checkout import (
    DEFAULT_RENDER_CONTRACT,
    GENERATIONS,
    CheckoutFacts,
    frameworks_taking,
    inspect_checkout,
    render_api,
)
from model_infer_kvcache.analyzer.kinds import byte_patch_section
from model_infer_kvcache.analyzer.kinds import byte_patches as byte_patches_kind
from model_infer_kvcache.analyzer.kinds import cross as cross_kind
from model_infer_kvcache.analyzer.kinds import drafter as drafter_kind
from model_infer_kvcache.analyzer.kinds import loops as loops_kind
from model_infer_kvcache.analyzer.kinds.formats import format_of
from model_infer_kvcache.analyzer.kv_cache_spec import FULL_ATTENTION, MAMBA
from model_infer_kvcache.analyzer.linear_config import NO_CACHE, holds_state, sublayer_kinds
from model_infer_kvcache.analyzer.manifest import (
    AttentionLayerPlan,
    DeployModeDecision,
    DeviceDependency,
    Evidence,
    FaDecision,
    Finding,
    Generator,
    GroupMemory,
    Inputs,
    KvModeDecision,
    LayerPlan,
    MemoryPlan,
    MlaDecision,
    ModelInfo,
    NoCacheLayer,
    ParallelPlan,
    RecurrentLoopsDecision,
    RopeInfo,
    SelectionManifest,
    StateLayerPlan,
)
from model_infer_kvcache.analyzer.measured import apply_readings, resolve_window_reading
from model_infer_kvcache.analyzer.progress_writer import plan_section, upsert_section
from model_infer_kvcache.analyzer.version import __version__

DEFAULT_KV_MEM_RATIO = 0.9


@dataclass(frozen=True)
class AnalyzeRequest:
    config: str
    progress: str | None = None
    dispatch: str | None = None
    dispatch_source: str = "--dispatch"
    deploy_mode: str | None = None
    framework_root: str | None = None
    framework_api: str | None = None
    attn_tp_size: int | None = None
    block_size: int = rules.DEFAULT_BLOCK_SIZE
    hbm_gb: float | None = None
    kv_mem_ratio: float | None = None
    max_concurrency: int | None = None
    max_len: int | None = None
    fa_version: str | None = None
    kv_mode: str | None = None
    window_reading: str | None = None  # None: not stated (the measured reading, else "exclusive")
    device_readings: str | None = None  # readings file written by `kvcache probe`
    cache_dtype: str | None = None  # --cache-dtype: plan the cache in this dtype instead of the config's
    next_n: int | None = None  # --next-n: speculative tokens the deployment runs (0: off; None: the config's MTP)
    exe_mode: str | None = None  # --exe-mode: eager | npugraph_ex | ge_graph (None: progress.md's, else eager)
    static_graph: bool = False  # --static-graph: the yaml's enable_dynamic_graph is False (else progress.md's)
    encoder_length: int | None = None  # --encoder-length: the encoder's longest output (cross-attention slot size)


def analyze(req: AnalyzeRequest, progress_text: str | None = None) -> SelectionManifest:
    """The manifest; ``progress_text`` stands for the content of ``req.progress`` when given."""
    _check_numbers(req)
    readings = None
    if req.device_readings:
        from model_infer_kvcache.analyzer.readings_file import load_readings

        readings = load_readings(req.device_readings)
    where, config = read_config_file(req.config)
    if byte_patches_kind.is_blt(config):  # BLT's four stacks: a plan of their own (the byte_patches section)
        return _assemble_byte_patches(config, where, req, progress_text, readings)
    try:
        facts = normalize_config(config, where)
    except InputError as exc:
        # a field kvcache needs for attention is missing: where transformers' own code shows the model keeps no KV
        # cache at all (RWKV names no attention heads: a recurrence), that is the refusal's reason, not the field
        why = arch_check.why_no_kv_cache_of(config) if exc.message.startswith("missing") else None
        layer_type = re.fullmatch(r"unknown layer type '([^']*)'", exc.message)
        index = re.search(r"\[(\d+)\]$", exc.field or "")
        if layer_type and index:  # what transformers' block of that layer holds (a state beside the attention)
            why = arch_check.why_layer_type(config, int(index.group(1)), layer_type.group(1))
        if why is None:
            raise
        raise NotSupportedByKvcache(where, why, field=exc.field) from None
    if req.progress and progress_text is not None:
        progress = parse_progress(progress_text, req.progress)
    else:
        progress = load_progress(req.progress) if req.progress else ProgressFacts()
    dispatch = parse_dispatch(req.dispatch, req.dispatch_source)
    checkout = (inspect_checkout(req.framework_root, facts.model_type, facts.family, facts.architectures)
                if req.framework_root else None)
    return assemble(facts, progress, dispatch, checkout, req, readings, config=config)


def analyze_into_progress(req: AnalyzeRequest, target: str, section: str,
                          render: Callable[[SelectionManifest], str]) -> tuple[SelectionManifest, str, str]:
    """(manifest, current text, new text) of ``target`` with ``render(manifest)`` upserted as ``section``.

    When ``target`` is also the progress.md read, the manifest quotes line numbers of the file as
    written: our section's new length can shift the foreign lines after it, so a second pass reads
    the planned text. The body's line count does not depend on line numbers, so the second pass is
    a fixed point and a repeat run writes the same bytes.
    """
    manifest = analyze(req)
    old, new = plan_section(target, section, render(manifest))
    if req.progress and new != old and same_file(req.progress, target):
        again = analyze(req, progress_text=new)
        if again != manifest:
            manifest, new = again, upsert_section(old, section, render(again), target)
    return manifest, old, new


def _check_numbers(req: AnalyzeRequest) -> None:
    for flag, value in (("--attn-tp-size", req.attn_tp_size), ("--max-concurrency", req.max_concurrency),
                        ("--max-len", req.max_len)):
        if value is not None and value <= 0:
            raise InputError(flag, f"must be a positive integer, got {value}")
    cross_kind.check_length(req.encoder_length, LIMITS["positions"])
    for flag, value in (("--hbm-gb", req.hbm_gb), ("--kv-mem-ratio", req.kv_mem_ratio)):
        if value is not None and not (math.isfinite(value) and value > 0):  # nan/inf would reach the plan
            raise InputError(flag, f"must be a positive finite number, got {value}")
    if req.hbm_gb is not None and not math.isfinite(req.hbm_gb * memory.GIB):
        raise InputError("--hbm-gb", f"too large, got {req.hbm_gb}: give the GiB the KV cache may use")
    if req.kv_mem_ratio is not None and req.kv_mem_ratio > 1:
        raise InputError("--kv-mem-ratio", f"must be in (0, 1], got {req.kv_mem_ratio}")
    problem = rules.check_block_size(req.block_size)
    if problem:
        raise InputError("--block-size", problem)


def _speculation(facts: ModelFacts, req: AnalyzeRequest, warnings: list[Finding]) -> ModelFacts:
    """``--next-n``: the speculative tokens per decode step the deployment runs (the framework's
    ``model_config.next_n``). 0 turns speculative decoding off: the config's MTP layers are then left unused
    and planned as absent (no MTP caches, no verify steps, one state block per request). Any other depth needs MTP
    layers to draft with: the MTP worker runs them next_n times per step (upstream deepseek yamls serve next_n 3
    with one MTP layer), so the depth is not the layer count (``speculative_tokens``)."""
    n = req.next_n
    mtp = facts.num_mtp_layers
    if n is None or n == (mtp.value or 0):
        return facts
    if n < 0:
        raise InputError("--next-n", f"{n} speculative tokens: must be 0 (off) or more")
    if n > 0 and not mtp.value:
        raise InputError("--next-n", f"{n} speculative tokens: the config has no MTP layer to draft them "
                                     f"({mtp.source}: {mtp.value or 0})")
    if n > 0:
        return facts
    warnings.append(Finding(
        message=f"--next-n 0: speculative decoding off, the config's {mtp.value} MTP layer(s) unused: no MTP "
                "caches, no verify steps (run the framework with next_n 0; get_cache_info leaves the MTP layers out)",
        fields=[mtp.source, "--next-n"]))
    return replace(facts, num_mtp_layers=type(mtp)(0, f"--next-n 0 ({mtp.source}: {mtp.value}, unused)"))


def _encoder_length(facts: ModelFacts, req: AnalyzeRequest, config: dict[str, Any] | None) -> ModelFacts:
    """The cross-attention's encoder length where the decoder's fields give none: a composite config's encoder, then
    the user's --encoder-length (analyzer/kinds/cross.py)."""
    cross = cross_kind.with_composite_length(facts.cross.value, config, facts.path, arch_check.encoder_positions)
    cross = cross_kind.with_stated_length(cross, req.encoder_length, f"model_type {facts.model_type!r}")
    return facts if cross is facts.cross.value else replace(facts, cross=type(facts.cross)(cross, facts.cross.source))


def assemble(
    facts: ModelFacts,
    progress: ProgressFacts,
    dispatch: DispatchFacts,
    checkout: CheckoutFacts | None,
    req: AnalyzeRequest,
    readings=None,
    config: dict[str, Any] | None = None,
) -> SelectionManifest:
    """``config`` (the raw config.json) enables the meta-device cross-check against transformers."""
    warnings: list[Finding] = []
    questions: list[Finding] = []
    facts = _speculation(facts, req, warnings)
    facts = _encoder_length(facts, req, config)
    window_reading, _ = resolve_window_reading(req.window_reading, readings, req.device_readings)

    deploy = _deploy_mode(dispatch, req, progress, checkout, warnings)
    tp, tp_source = _tp_size(req, progress, warnings)
    blockers = rules.find_blockers(facts, req.block_size)
    if (unsized := cross_kind.blocker(facts)) is not None:
        blockers.append(unsized)
    problems = rules.tp_problems(facts, tp)
    if problems:
        # A size stated in progress.md is refused exactly like the same size given as the flag.
        stated = progress.attn_tp_size
        where = progress.where(stated) if req.attn_tp_size is None and stated else "--attn-tp-size"
        raise InputError(where, "; ".join(problems),
                         field="attn_tp_size" if where != "--attn-tp-size" else facts.num_attention_heads.source)
    parallel = rules.decide_parallel(facts, tp, tp_source)
    problem = rules.heads_problem(facts, parallel)
    if problem:
        blockers.append(problem)

    fa_version = rules.decide_fa_version(facts, req.fa_version, checkout.fa_version if checkout else None,
                                         checkout.fa_evidence if checkout else "")
    scale, scale_txt = rules.decide_scale(facts)

    framework_api, api_evidence = _framework_api(deploy.value, req, checkout, questions)
    _recurrent_state(facts, deploy.value, framework_api, checkout, blockers, questions)
    kv = rules.decide_kv_mode(blockers, [s.value for s in progress.starting_point], req.kv_mode)
    kv_mode = kv.value
    format_of(facts).check_kv_mode(kv_mode, kv.reason, "--kv-mode" if req.kv_mode else facts.path)
    layout = rules.decide_input_layout(facts, kv_mode)
    cache_dtype = rules.decide_cache_dtype(facts, req.cache_dtype)
    next_n = speculative_tokens(facts, req)
    layers = _layers(facts, parallel, kv_mode, window_reading, cache_dtype.value if cache_dtype else None, next_n,
                     req.block_size)
    # a window the context never outgrows plans the layer full (its derivation says so)
    full_by_context = [layer.index for layer in layers if not (layer.is_state or layer.is_sliding) and layer.window_derivation]
    if full_by_context:
        warnings.append(Finding(message=f"{len(full_by_context)} layer(s) planned as FullAttention: "
                                        f"{layers[full_by_context[0]].window_derivation}",
                                fields=[facts.sliding_window.source, facts.max_position_embeddings.source]))
    check = (arch_check.cross_check(config, facts, layers, scale, scale_txt, parallel.attn_tp_size,
                                    legacy=kv_mode == "legacy") if config is not None else None)
    if check and check.errors:
        raise InputError(facts.path, "architecture cross-check against transformers' own attention modules "
                                     "(meta device) failed: " + "; ".join(check.errors),
                         field=check.bidirectional or "model_type")
    if check and check.unsupported:
        raise NotSupportedByKvcache(facts.path, "; ".join(check.unsupported), field="model_type")
    warnings += [Finding(message=note, fields=["model_type"]) for note in (check.notes if check else [])]
    unknown = rules.unknown_family(facts, check.ships if check else arch_check.transformers_ships(facts.model_type),
                                   cross_checked=check is None or check.checked_layers > 0,
                                   unread=None if check is None else check.unread_scores)
    if unknown:
        warnings.append(unknown)
    mixed = len({layer.attn_type for layer in layers}) > 1
    cross = cross_kind.decide(facts, parallel, cache_dtype.value if cache_dtype else None)
    memory_plan, groups = _memory(facts, layers, req, progress, questions, warnings, cross)
    _progress_conflicts(progress, req, dispatch, deploy, tp_source, questions, warnings)

    mla = rules.decide_mla(facts, kv_mode)
    _notes(facts, progress, layers, kv_mode, warnings, questions)
    if facts.num_mtp_layers.value:
        warnings.append(Finding(
            message=f"{facts.num_mtp_layers.value} MTP layer(s) also hold caches when speculative decoding is on: "
                    "get_cache_info must walk them (model.layers may be a dict)",
            fields=[facts.num_mtp_layers.source],
        ))
    if kv_mode == "legacy":
        warnings.append(Finding(message="Legacy is offline only: online serving / PD / dataset evaluation "
                                        "need Paged", fields=[]))
    if facts.dtype.is_default and req.cache_dtype is None:
        questions.append(Finding(message="config states no dtype: cache dtype assumed bfloat16",
                                 fields=["torch_dtype", "dtype"]))
    legacy_attention = rules.decide_legacy_attention(facts, kv_mode, blockers)
    dependencies = _device_dependencies(layers, kv_mode, window_reading, deploy.value,
                                        legacy_fa=legacy_attention is not None and legacy_attention.kernel == "fa",
                                        fa_band=format_of(facts).fa_band)
    dependencies += _linear_dependencies(facts, layers)
    dependencies += _value_dim_dependencies(facts, layers, kv_mode)
    measured_source = None
    if readings is not None:
        dependencies, measured_source = apply_readings(dependencies, readings, req.device_readings, warnings,
                                                       questions)

    return SelectionManifest(
        generator=Generator(version=__version__),
        inputs=Inputs(
            config=facts.path, progress=progress.path, dispatch=dispatch.line,
            framework_root=checkout.root if checkout else None,
            npu_model=str(progress.npu_model.value) if progress.npu_model else None,
            num_cards=int(progress.num_cards.value) if progress.num_cards else None,
            starting_point=sorted({s.value for s in progress.starting_point}),
            runner_files=sorted(set(progress.runner_files) | set(checkout.runner_files if checkout else [])),
            progress_sources=_progress_sources(progress, req, deploy),
        ),
        model=ModelInfo(
            model_type=facts.model_type,
            family=facts.family,
            attention_kind=_attention_kind(facts),
            architectures=facts.architectures,
            num_layers=facts.num_layers.value,
            hidden_size=facts.hidden_size.value,
            num_attention_heads=facts.num_attention_heads.value,
            num_key_value_heads=facts.num_key_value_heads.value,
            head_dim=facts.head_dim.value,
            qk_head_dim=facts.qk_head_dim,
            dtype=facts.dtype.value,
            vocab_size=facts.vocab_size,
            max_position_embeddings=facts.max_position_embeddings.value,
            rms_norm_eps=facts.rms_norm_eps.value,
            mla=facts.mla.value,
            rope=facts.rope.value,
            has_sinks=facts.has_sinks.value,
            num_mtp_layers=facts.num_mtp_layers.value,
            sublayers_per_layer=facts.sublayers_per_layer.value,
            sources=facts.sources(),
            v_head_dim=facts.v_head_dim.value,
            sink_layers=list(facts.sink_layers.value) if facts.has_sinks.value and facts.sink_layers.value else None,
        ),
        deploy_mode=deploy,
        framework_api=framework_api,
        framework_api_evidence=api_evidence,
        kv_mode=KvModeDecision(value=kv_mode, evidence=kv.evidence, reason=kv.reason + (
            f" in the config only: family {facts.model_type!r} is unknown (see warnings)" if unknown and not blockers
            else "")),
        fa=FaDecision(
            version=fa_version.value,
            input_layout=layout.value,
            softmax_scale=scale,
            scale_derivation=scale_txt,
            reason=fa_version.reason,
            is_default=fa_version.is_default,
        ),
        mla=mla,
        mtp=rules.decide_mtp(facts, next_n),
        exe_mode=rules.decide_exe_mode(*_exe_mode(req, progress), next_n, _dynamic_graph(req, progress)),
        legacy_attention=legacy_attention,
        mixed_attn_types=mixed,
        layers=layers,
        no_cache_layers=no_cache_layers(facts),
        recurrent_loops=recurrent_loops(facts, layers),
        parallel=parallel,
        block_size=req.block_size,
        memory=memory_plan,
        cache_dtype=cache_dtype,
        linear_attention=rules.decide_linear(facts, parallel, cache_dtype.value if cache_dtype else None, next_n),
        cross_attention=cross,
        drafter=drafter_kind.decide(facts, layers),
        # the format's own section (dsa, compressed), from the plan built above
        **format_of(facts).sections(facts, layers, groups, parallel, cache_dtype.value if cache_dtype else
                                    facts.dtype.value, req.block_size, memory_plan.max_len),
        device_dependencies=dependencies,
        device_readings=measured_source,
        open_questions=questions,
        warnings=warnings,
        blockers=blockers,
    )


def _assemble_byte_patches(config: dict[str, Any], where: str, req: AnalyzeRequest, progress_text: str | None,
                           readings) -> SelectionManifest:
    """BLT's manifest: the byte_patches section (analyzer/kinds/byte_patch_section.py) and the layers it builds, one
    per planned cache layer in cache order (byte_patches.cache_plan), the model-level fields the local decoder's; the
    plan checked against transformers' own modules first (arch_check.byte_patch_problems). One rank: the stacks'
    heads differ, and the byte-stepping validation runs them unsplit."""
    facts = byte_patches_kind.read_facts(config, where)
    problems = arch_check.byte_patch_problems(config)
    if problems:
        raise InputError(where, "architecture cross-check against transformers' own attention modules (meta device) "
                                "failed: " + "; ".join(problems[:3]), field="model_type")
    progress = (parse_progress(progress_text, req.progress) if req.progress and progress_text is not None
                else load_progress(req.progress) if req.progress else ProgressFacts())
    dispatch = parse_dispatch(req.dispatch, req.dispatch_source)
    checkout = inspect_checkout(req.framework_root, "blt", "blt", ["BltForCausalLM"]) if req.framework_root else None
    warnings: list[Finding] = []
    questions: list[Finding] = []
    reading, _ = resolve_window_reading(req.window_reading, readings, req.device_readings)
    deploy = _deploy_mode(dispatch, req, progress, checkout, warnings)
    tp, tp_source = _tp_size(req, progress, warnings)
    if tp != 1:
        raise InputError("--attn-tp-size" if req.attn_tp_size else tp_source, f"{tp}: BLT's stacks are planned on one "
                         "rank (attention TP of stacks with different head counts is not planned by kvcache yet)",
                         field="attn_tp_size")
    if req.kv_mode == "legacy":  # no contiguous-cache template steps four stacks at two rates
        raise InputError("--kv-mode", "legacy: BLT's stacks are planned paged only (each a paged FA call; the global "
                                      "stack a row per completed patch)", field="kv_mode")
    if req.next_n:
        raise InputError("--next-n", f"{req.next_n} speculative tokens: BLT has no MTP layer to draft them",
                         field="next_n")
    stated = config_dtype(config, where)
    dtype = req.cache_dtype or stated.value
    if stated.is_default and req.cache_dtype is None:
        questions.append(Finding(message="config states no dtype: cache dtype assumed bfloat16",
                                 fields=["torch_dtype", "dtype"]))
    positions = config.get("max_position_embeddings")
    positions = Sourced(positions if isinstance(positions, int) and positions > 0 else None, "max_position_embeddings")
    section = byte_patch_section.decide(facts, reading, req.max_len or positions.value, where)
    layers = byte_patch_section.layers(section, dtype)
    heads, kv_heads, head_dim = byte_patch_section.model_heads(section)
    framework_api, api_evidence = _framework_api(deploy.value, req, checkout, questions)
    blockers: list[Finding] = []
    _state_registration(f"BLT's per-request slots (the decoder's cross K/V of the latest patch, the open patch's "
                        f"{section.open_patch_rows} encoder rows)", ["byte_patches", "--framework-root"], deploy.value,
                        framework_api, checkout, blockers, questions)
    itemsize = rules.DTYPE_BYTES[dtype]
    groups = byte_patch_section.memory_groups(section, req.block_size, itemsize)
    total = sum(g.per_token_bytes for g in groups)
    derivation = [f"per-token bytes (one rank) = {total} = sum over BLT's stacks of 2 x layers x KV heads x head_dim "
                  f"x itemsize (one pool per stack: their shapes differ)",
                  f"{byte_patch_section.OPEN_PATCH}: one slot per request of {section.open_patch_rows} encoder rows "
                  f"({section.open_patch_bound})"]
    memory_plan = _budget(groups, total, derivation, layers, req, progress, questions, warnings, positions)
    _progress_conflicts(progress, req, dispatch, deploy, tp_source, questions, warnings)
    dependencies = _device_dependencies(layers, "paged", reading, deploy.value)
    measured_source = None
    if readings is not None:
        dependencies, measured_source = apply_readings(dependencies, readings, req.device_readings, warnings,
                                                       questions)
    fa_version = req.fa_version or "v1"
    model = next(s for s in section.stacks if s.section == byte_patch_section.MODEL_STACK)
    dec = config["decoder_config"]
    rope = dec.get("rope_parameters") if isinstance(dec.get("rope_parameters"), dict) else {}
    return SelectionManifest(
        generator=Generator(version=__version__),
        inputs=Inputs(config=where, progress=progress.path, dispatch=dispatch.line,
                      framework_root=checkout.root if checkout else None,
                      npu_model=str(progress.npu_model.value) if progress.npu_model else None,
                      num_cards=int(progress.num_cards.value) if progress.num_cards else None,
                      starting_point=sorted({s.value for s in progress.starting_point}),
                      progress_sources=_progress_sources(progress, req, deploy)),
        model=ModelInfo(model_type="blt", family="blt", attention_kind="mha" if heads == kv_heads else "gqa",
                        architectures=list(config.get("architectures") or ["BltForCausalLM"]),
                        num_layers=len(layers), hidden_size=heads * head_dim, num_attention_heads=heads,
                        num_key_value_heads=kv_heads, head_dim=head_dim, qk_head_dim=head_dim, dtype=dtype,
                        vocab_size=config.get("vocab_size"), max_position_embeddings=positions.value,
                        rms_norm_eps=dec.get("rms_norm_eps"), rope=RopeInfo(rope_type=rope.get("rope_type", "default")),
                        sources={"model-level fields": "decoder_config (the local decoder: its rows give the logits); "
                                                       "the other stacks' in byte_patches.stacks and per layer",
                                 "dtype": stated.source}),
        deploy_mode=deploy, framework_api=framework_api, framework_api_evidence=api_evidence,
        kv_mode=KvModeDecision(value="paged", reason="Paged is the target: every stack's attention is a paged FA "
                                                     "call (byte_patches); " + ("; ".join(b.message for b in blockers)
                                                                               or "no blocker found")),
        fa=FaDecision(version=fa_version, input_layout="TND", softmax_scale=model.softmax_scale,
                      scale_derivation=f"decoder_config head_dim = {head_dim}^-0.5 (BltSelfAttention.scaling); each "
                                       "stack its own (byte_patches.stacks)",
                      reason=f"requested {fa_version} by the user" if req.fa_version else
                      "GQA/MHA default v1 (Qwen3 reference): every stack's attention is a GQA/MHA call",
                      is_default=req.fa_version is None),
        mla=MlaDecision(enabled=False, absorb=False, cache_mode=None, rope=True, reason="not an MLA model",
                        constraints=[]),
        exe_mode=rules.decide_exe_mode(*_exe_mode(req, progress), 0, _dynamic_graph(req, progress)),
        mixed_attn_types=len({layer.attn_type for layer in layers}) > 1,
        layers=layers,
        parallel=ParallelPlan(attn_tp_size=1, attn_tp_source=tp_source, num_q_heads_per_rank=heads,
                              num_kv_heads_per_rank=kv_heads, kv_heads_replicated=False, latent_replicated=False),
        block_size=req.block_size, memory=memory_plan, byte_patches=section,
        device_dependencies=dependencies, device_readings=measured_source, open_questions=questions,
        warnings=warnings, blockers=blockers)


def _recurrent_state(facts: ModelFacts, deploy: str, framework_api: str | None, checkout, blockers,
                     questions) -> None:
    """Framework mode registers linear layers' states (and cross-attention slots) as MambaCacheEntry, which only G3
    frameworks define."""
    linear = sum(holds_state(kind) for kind in facts.layer_kinds.value)
    if linear and facts.linear.value is not None:
        what, fields = f"the {linear} linear layers' states", [facts.layer_kinds.source, "--framework-root"]
    elif facts.cross.value is not None and facts.cross.value.max_encoder_len is not None:
        what, fields = (f"the {facts.num_layers.value} cross-attention layers' encoder K/V slots",
                        [facts.cross.source, "--framework-root"])
    else:
        return
    _state_registration(what, fields, deploy, framework_api, checkout, blockers, questions)


def _state_registration(what: str, fields: list[str], deploy: str, framework_api: str | None, checkout, blockers,
                        questions) -> None:
    """Per-request state slots (``what``) register as MambaCacheEntry in framework mode, which only G3 frameworks
    define: a blocker where the checkout or the named generation lacks it, a question where neither is known."""
    if deploy != "framework":
        return
    if checkout is not None and not checkout.mamba_state_evidence:
        blockers.append(Finding(
            message=f"the checkout's framework ({checkout.generation or 'unknown generation'}) has no "
                    f"MambaCacheEntry: {what} cannot be registered (framework mode needs "
                    "a framework that defines it, fda5670 or later; or deploy standalone, where the runner owns the states)",
            fields=fields))
    elif checkout is None and framework_api in ("G0", "G1"):
        blockers.append(Finding(
            message=f"--framework-api {framework_api} has no MambaCacheEntry: {what} "
                    "cannot be registered (framework mode needs a framework that defines it, fda5670 or later; or deploy "
                    "standalone)",
            fields=["--framework-api", fields[0]]))
    elif checkout is None:
        questions.append(Finding(
            message=f"{what} register as MambaCacheEntry (attn_type Mamba), which "
                    "only frameworks from fda5670 on define: pass --framework-root to check the checkout",
            fields=fields))


def _attention_kind(facts: ModelFacts) -> str:
    return format_of(facts).attention_kind(facts)


def _deploy_mode(dispatch, req, progress, checkout, warnings) -> DeployModeDecision:
    # Self-check evidence, strongest first (SKILL.md, '开始前:部署模式与必要输入'): registration, own runner loop, progress wording.
    self_checks: list[tuple[str, str]] = []
    if checkout and checkout.registered:
        self_checks.append(("framework", f"registered in support_models ({checkout.registered_evidence})"))
    if checkout and checkout.standalone_runner:
        self_checks.append(("standalone", f"own runner loop ({checkout.runner_evidence})"))
    if progress.deploy_mode:
        s = progress.deploy_mode
        self_checks.append((s.value, f"{progress.where(s)}: {s.text!r}"))

    s = progress.deploy_mode
    # An explicit `部署模式:` statement that contradicts the dispatch is an error; prose is weaker
    # evidence and only shows up as overridden.
    if dispatch.deploy_mode and s and s.kind in ("key", "table") and s.value != dispatch.deploy_mode:
        raise InputError(
            progress.path or "progress.md",
            f"line {s.line} says {s.value} ({s.text!r}) but the dispatch line {dispatch.line!r} says "
            f"{dispatch.deploy_mode}",
            field="部署模式",
        )
    value, source, evidence, losers = rules.decide_deploy_mode(
        dispatch.deploy_mode, dispatch.line, req.deploy_mode, self_checks
    )
    overridden = [Evidence(value=v, source=s, detail=d) for v, s, d in losers]
    for loser in overridden:
        if loser.value != value:
            warnings.append(Finding(
                message=f"deployment mode {loser.value} from {loser.source} ({loser.detail}) "
                        f"overridden by {value} from {source}",
                fields=["部署模式", "--deploy-mode"],
            ))
    return DeployModeDecision(value=value, source=source, evidence=evidence, overridden=overridden)


def _tp_size(req: AnalyzeRequest, progress: ProgressFacts, warnings: list[Finding]) -> tuple[int, str]:
    stated = progress.attn_tp_size
    if req.attn_tp_size is not None:
        if stated and stated.value != req.attn_tp_size:
            warnings.append(Finding(
                message=f"--attn-tp-size {req.attn_tp_size} overrides {progress.where(stated)} ({stated.text})",
                fields=["--attn-tp-size", "attn_tp_size"],
            ))
        return req.attn_tp_size, "--attn-tp-size"
    if stated:
        return int(stated.value), f"{progress.where(stated)}"
    cards = progress.num_cards
    if cards and int(cards.value) > 1:
        warnings.append(Finding(
            message=f"{progress.where(cards)} states {cards.value} cards but no attention TP size: "
                    "assumed attn_tp_size 1 (attention data-parallel); pass --attn-tp-size if attention is split",
            fields=["--attn-tp-size", "attn_tp_size", "部署卡数"],
        ))
        return 1, f"default: 1 ({cards.value} cards stated, attention TP not stated)"
    return 1, "default: 1 (no --attn-tp-size, none in progress.md)"


def _progress_sources(progress: ProgressFacts, req: AnalyzeRequest, deploy: DeployModeDecision) -> dict[str, str]:
    """Every progress.md value the manifest uses -> 'file:line: quoted phrase'."""
    used = {
        "deploy_mode": deploy.source == "self_check" and progress.deploy_mode is not None
        and any(progress.where(progress.deploy_mode) in e for e in deploy.evidence),
        "attn_tp_size": req.attn_tp_size is None,
        "num_cards": True,
        "npu_model": True,
        "hbm_gb": req.hbm_gb is None,
    }
    out = {}
    for name, wanted in used.items():
        stated = getattr(progress, name)
        if stated is not None and wanted:
            out[FACT_LABELS[name]] = f"{progress.where(stated)}: {stated.text}"
    return out


def _progress_conflicts(progress: ProgressFacts, req: AnalyzeRequest, dispatch: DispatchFacts,
                        deploy: DeployModeDecision, tp_source: str, questions: list[Finding],
                        warnings: list[Finding]) -> None:
    """progress.md that cannot be read as it stands: an unclosed kvcache section (warned), a fact stated in
    contradicting ways (no value picked, the fallback said, the user asked)."""
    settled = {
        "deploy_mode": dispatch.deploy_mode is not None or req.deploy_mode is not None,
        "attn_tp_size": req.attn_tp_size is not None,
        "hbm_gb": req.hbm_gb is not None,
    }
    fallback = {
        "deploy_mode": f"deployment mode {deploy.value} from {deploy.source}",
        "attn_tp_size": f"attn_tp_size from {tp_source}",
        "hbm_gb": "no HBM budget (pass --hbm-gb)",
        "num_cards": "card count left out of the manifest",
        "npu_model": "NPU model left out of the manifest",
    }
    if progress.unclosed_section:
        warnings.append(Finding(
            message=f"{progress.path}:{progress.unclosed_section} opens a kvcache section that never ends: the "
                    "lines after it were not read (restore the end marker)", fields=["progress.md"]))
    for name, statements in progress.conflicts.items():
        label = FACT_LABELS[name]
        stated = " vs ".join(f"{progress.where(s)} {s.text!r} ({s.value})" for s in statements)
        if settled.get(name):
            warnings.append(Finding(message=f"progress.md states {label} in contradicting ways: {stated}; "
                                            "a flag or the dispatch line decided instead", fields=[label]))
            continue
        questions.append(Finding(
            message=f"progress.md states {label} in contradicting ways: {stated}; none of them is used, "
                    f"{fallback[name]} instead: read progress.md and confirm the value with the user",
            fields=[label, *(progress.where(s) for s in statements)],
        ))


def _framework_api(deploy: str, req, checkout, questions) -> tuple[str | None, str]:
    if deploy != "framework":
        return None, "standalone mode: no framework API"
    # The manifest names the framework's generation (G3 for a HEAD-era checkout, as validate's harness does);
    # renders follow render_api of it (G3 frameworks take G2's model-side contract).
    detected = checkout.generation if checkout else None
    if req.framework_api:
        if detected and render_api(detected) != render_api(req.framework_api):
            raise InputError("--framework-api", f"{req.framework_api} contradicts the checkout's {detected} "
                                                f"({checkout.generation_evidence})")
        if detected and detected != req.framework_api:  # same render contract: the checkout says which framework
            return detected, (f"{checkout.generation_evidence} (--framework-api {req.framework_api} names the same "
                              f"{render_api(detected)} render contract)")
        return req.framework_api, "--framework-api" + _contract_note(req.framework_api)
    if detected:
        return detected, checkout.generation_evidence
    questions.append(Finding(
        message=f"framework API generation unknown (pass --framework-root or --framework-api "
                f"{'|'.join(GENERATIONS)}); the renderer defaults to the {DEFAULT_RENDER_CONTRACT} model-side "
                f"contract, which {' and '.join(frameworks_taking(DEFAULT_RENDER_CONTRACT))} frameworks take "
                "(an older framework needs its own generation named)",
        fields=["--framework-root", "--framework-api"],
    ))
    return None, "unknown: no --framework-root / --framework-api"


def _contract_note(generation: str) -> str:
    contract = render_api(generation)
    return "" if contract == generation else f" ({generation} frameworks take the {contract} model-side contract: " \
                                             f"renders follow {contract})"


def _layer_shape(facts: ModelFacts, parallel, decoder_idx: int) -> dict[str, Any]:
    """A layer's own head_dim / KV heads per rank (or MLA dims, query heads per rank and softmax scale), written
    only where they differ from the model's."""
    out: dict[str, Any] = {}
    if facts.heads_at(decoder_idx) != facts.num_attention_heads.value:
        out["num_q_heads_per_rank"] = facts.heads_at(decoder_idx) // parallel.attn_tp_size
    if facts.qk_head_dim_at(decoder_idx) != facts.qk_head_dim:  # its scale follows its own head (the format's label)
        out["softmax_scale"], out["scale_derivation"] = rules.decide_scale(facts, decoder_idx)
    if facts.layer_heads.value is None:
        return out
    if facts.head_dim_at(decoder_idx) != facts.head_dim.value:
        out["head_dim"] = facts.head_dim_at(decoder_idx)
    kv = rules.kv_heads_per_rank(facts, parallel.attn_tp_size, decoder_idx)
    if kv != parallel.num_kv_heads_per_rank:
        out["num_kv_heads_per_rank"] = kv
    return out


def _kv_source(facts: ModelFacts, decoder_idx: int, subs: int) -> dict[str, int]:
    """A KV-shared layer's source (the layer plan index of the decoder layer whose cache it reads), only there."""
    source = facts.kv_source_at(decoder_idx)
    return {} if source is None else {"kv_source_layer": source * subs}


def _dynamic_graph(req: AnalyzeRequest, progress: ProgressFacts) -> tuple[bool | None, str]:
    """(enable_dynamic_graph, source): False by --static-graph, else progress.md's, else (None) not stated."""
    if req.static_graph:
        return False, "--static-graph"
    if progress.dynamic_graph is not None:
        return progress.dynamic_graph.value, progress.where(progress.dynamic_graph)
    return None, ""


def _exe_mode(req: AnalyzeRequest, progress: ProgressFacts) -> tuple[str | None, str]:
    """(mode, source): --exe-mode, else progress.md's exe_mode, else (None) not stated: eager."""
    if req.exe_mode is not None:
        return req.exe_mode, "--exe-mode"
    if progress.exe_mode is not None:
        return progress.exe_mode.value, progress.where(progress.exe_mode)
    return None, ""


def speculative_tokens(facts: ModelFacts, req: AnalyzeRequest) -> int:
    """The framework's next_n the plan serves: --next-n, else one per MTP layer; 0 without MTP layers."""
    if not facts.num_mtp_layers.value:
        return 0
    return req.next_n if req.next_n is not None else int(facts.num_mtp_layers.value)


def _layers(facts: ModelFacts, parallel, kv_mode: str, reading: str, cache_dtype: str | None = None,
            next_n: int = 0, block_size: int = 128) -> list[LayerPlan]:
    fmt = format_of(facts)
    write_op = rules.decide_write_op(kv_mode, fmt.latent)
    window = facts.sliding_window.value
    out = []
    subs = facts.sublayers_per_layer.value
    loops = facts.loops.value
    # Dory per_loop, HRM's cycles: each call of a looped layer is a cache layer of its own, in transformers' cache
    # index order (layer_idx + the call's offset), planned as the layer it runs (analyzer/kinds/loops.py)
    for decoder_idx in loops.calls if loops else range(len(facts.layer_kinds.value)):
        config_kind = facts.layer_kinds.value[decoder_idx]
        if config_kind == NO_CACHE:  # no_cache_layers() lists it; the cache layers' index skips it
            continue
        out += _sublayers(facts, parallel, kv_mode, reading, cache_dtype, next_n, block_size, fmt, write_op, window,
                          decoder_idx, sublayer_kinds(config_kind, subs), len(out))
    return out


def recurrent_loops(facts: ModelFacts, layers: list[LayerPlan]) -> RecurrentLoopsDecision | None:
    """The manifest's recurrent_loops section (Dory per_loop, HRM's cycles), None where every layer runs once."""
    loops = facts.loops.value
    if loops is None:
        return None
    first: dict[int, int] = {}
    extra = [i for i, d in enumerate(loops.calls) if first.setdefault(d, i) != i]
    runs = sorted({loops.calls.count(d) for d in first})
    return RecurrentLoopsDecision(
        calls=list(loops.calls), offset_kwarg=loops.offset_kwarg,
        stacks=list(loops.stacks) if loops.stacks else None, cache_layers=extra,
        module_attr=loops_kind.MODULE_ATTR, source=loops.source,
        reason=f"{len(first)} decoder layers make {len(loops.calls)} calls per forward ({' or '.join(map(str, runs))} "
               f"each), each call writing a cache of its own at transformers' cache index (layer_idx + "
               f"{loops.offset_kwarg}): {len(loops.calls)} cache layers; one attention module keeps one cache, so "
               "the port gives each later call its own module, the layer's weights tied (as for Zamba2's shared "
               "block)")


def no_cache_layers(facts: ModelFacts) -> list[NoCacheLayer] | None:
    """The decoder blocks that hold no cache (MLP-only / MoE-only), None when every block holds one."""
    kinds = facts.layer_kinds.value
    blocks = [i for i, kind in enumerate(kinds) if kind == NO_CACHE]
    if not blocks:
        return None
    names = facts.block_names or {}

    def why(i: int) -> str:
        if names.get(i) == cross_kind.ONLY_BLOCK:  # Mllama: its K/V over the vision states are the cross section's
            return (f"{facts.cross.source.split(' (')[0]}: block {i} attends over the vision states only: no "
                    "self-attention KV cache; its K/V are the request's cross-attention slot (cross_attention)")
        return (f"{facts.layer_kinds.source}[{i}] = {names.get(i, NO_CACHE)!r}: a block without attention or a mixer "
                "state keeps no cache (transformers' cache keeps a dummy layer there; the framework refuses a layer "
                "without cache entries, so get_cache_info leaves it out)")

    return [NoCacheLayer(decoder_layer=i, block=names.get(i, NO_CACHE), reason=why(i)) for i in blocks]


def _sublayers(facts, parallel, kv_mode, reading, cache_dtype, next_n, block_size, fmt, write_op, window, decoder_idx,
               kinds: tuple[str, ...], start: int) -> list[LayerPlan]:
    """The layer plans of one decoder layer, one per sublayer kind (a parallel hybrid's attention then its state)."""
    out: list[LayerPlan] = []
    for sub, config_kind in enumerate(kinds):
        kind, w, full_reason = rules.planned_layer_kind(config_kind, window, facts.max_position_embeddings.value)
        # A linear layer of an unknown family plans no state (a blocker says why): no Mamba entry without shapes.
        attn_type = FULL_ATTENTION if kind == "linear" and facts.linear.value is None else rules.decide_attn_type(kind)
        caches = rules.decide_caches(facts, parallel, kv_mode, kind, cache_dtype, decoder_idx)
        states = rules.linear_states(facts, parallel.attn_tp_size, cache_dtype, next_n) if attn_type == MAMBA else []
        sparse, mask, _ = rules.decide_sparse(attn_type, fmt.latent, kv_mode)
        pre, nxt, derivation = rules.decide_window_tokens(w, reading)
        derivation = derivation or full_reason
        chunk = facts.attention_chunk_size.value if kv_cache_spec.is_chunked(attn_type) else None
        attention = dict(sliding_window=w, sparse_mode=sparse, pre_tokens=pre, next_tokens=nxt, mask=mask,
                         **({"attention_chunk_size": chunk} if chunk else {}),
                         write_op=write_op, caches=caches, window_derivation=derivation,
                         **_layer_shape(facts, parallel, decoder_idx),
                         **_kv_source(facts, decoder_idx, subs=len(kinds)),
                         **fmt.layer_fields(facts, decoder_idx, cache_dtype or facts.dtype.value, block_size))
        if facts.drafter.value is not None:  # it reads its target's cache: no entries, its own masks
            attention.update(drafter_kind.layer_fields(w, reading))
        common = dict(index=start + len(out), decoder_layer=decoder_idx, sublayer=sub, attn_type=attn_type,
                      layer_kind=kind, group_key=fmt.group_key(attn_type, caches))
        # a state layer is its states (no KV cache, no FA call): the manifest's tagged layer plan
        out.append(StateLayerPlan(**common, states=states) if states else AttentionLayerPlan(**common, **attention))
    return out


def _memory(facts, layers, req: AnalyzeRequest, progress, questions,
            warnings, cross=None) -> tuple[MemoryPlan, list[memory.Group]]:
    """The memory plan and the group specs it was sized from."""
    fmt = format_of(facts)
    groups, group_notes = fmt.memory_groups(facts, layers, lambda layer: rules.cache_token_bytes(layer.caches),
                                            speculative_tokens(facts, req), req.block_size)
    total = sum(g.per_token_bytes for g in groups)
    derivation = [f"per-token bytes (one rank) = {total} = sum over layers of dim x num_head x itemsize"
                  + fmt.per_token_note()]
    state_layers = [layer for layer in layers if layer.is_state]
    if state_layers:
        # One Mamba block holds one request's states of every linear layer (MambaCacheEntry: [num_blocks, *shape]).
        per_block = sum(rules.state_bytes(layer.states) for layer in state_layers)
        next_n = speculative_tokens(facts, req)
        groups.append(kv_cache_spec.MambaSpec(MAMBA, per_block, next_n, len(state_layers)))
        derivation.append(f"{MAMBA}: one state block per request (+ {next_n} speculative) = "
                          f"{len(state_layers)} linear layers x {rules.state_bytes(state_layers[0].states)} B = "
                          f"{per_block} B, fixed (does not grow with the sequence)")
    if cross is not None:
        # one slot per request holds its encoder K/V of every cross-attention layer (kv_cache_spec.CrossAttentionSpec)
        groups.append(cross_kind.memory_group(cross))
        derivation.append(cross_kind.memory_note(cross))
    derivation += group_notes
    if facts.drafter.value is not None:
        derivation.append(drafter_kind.memory_note(drafter_kind.decide(facts, layers)))
    shared = [layer for layer in layers if layer.kv_source_layer is not None]
    if shared:
        sources = sorted({layer.kv_source_layer for layer in shared})
        derivation.append(
            f"{len(shared)} KV-shared layer(s) ({shared[0].index}..{shared[-1].index}) hold no cache (0 B per token): "
            f"they read the caches of layer(s) {', '.join(map(str, sources))} through the same block table "
            f"({facts.kv_sources.source}; transformers' is_kv_shared_layer computes no K/V there)")
    return _budget(groups, total, derivation, layers, req, progress, questions, warnings,
                   facts.max_position_embeddings), groups


def _budget(groups, total: int, derivation: list[str], layers, req: AnalyzeRequest, progress, questions, warnings,
            max_positions) -> MemoryPlan:
    """The memory plan of ``groups`` (``total`` bytes per token) under the request's budget; ``max_positions``: the
    Sourced max_position_embeddings a budget without --max-len sizes requests by."""
    hbm = req.hbm_gb
    if hbm is None and progress.hbm_gb:
        hbm = float(progress.hbm_gb.value)
        warnings.append(Finding(
            message=f"HBM {hbm:g} GB taken from {progress.where(progress.hbm_gb)} as the KV budget: that is "
                    "the card's whole HBM (weights and activations live there too), so blocks are an upper bound; "
                    "pass --hbm-gb with the memory left for the KV cache",
            fields=["单卡 HBM", "--hbm-gb"]))
    ratio = req.kv_mem_ratio if req.kv_mem_ratio is not None else (DEFAULT_KV_MEM_RATIO if hbm else None)

    max_len, concurrency = req.max_len, req.max_concurrency
    plan = None
    if hbm:
        budget = hbm * memory.GIB * ratio
        if req.kv_mem_ratio is None:
            derivation.append(f"kv_mem_ratio default {DEFAULT_KV_MEM_RATIO}")
        if max_len is None and max_positions.value:
            max_len = max_positions.value
            derivation.append(f"max_len = {max_len} from {max_positions.source} (no --max-len)")
        if concurrency is None and max_len:
            concurrency = memory.max_concurrency_at(groups, budget, max_len)
            derivation.append(f"max_concurrency = {concurrency}: the most requests of {max_len} tokens that fit "
                              "(no --max-concurrency)")
            if concurrency == 0:
                warnings.append(Finding(message=f"not one request of {max_len} tokens fits in the KV budget",
                                        fields=["--hbm-gb", "--max-len"]))
        if concurrency is None:
            questions.append(Finding(message="KV budget given without --max-len / --max-concurrency (and no "
                                             "max_position_embeddings): sliding reservations assume 1 request",
                                     fields=["--max-len", "--max-concurrency"]))
        plan = memory.plan_budget(groups, budget, concurrency if concurrency is not None else 1, max_len)
        warnings += [Finding(message=m, fields=["--hbm-gb", "--max-concurrency", "--max-len"])
                     for m in memory.plan_warnings(plan, req.max_concurrency, max_len)]
    elif max_len and concurrency:
        plan = memory.plan_offline(groups, max_len, concurrency)
        plan.derivation.append(f"pools need {memory.plan_bytes(groups, plan.blocks)} B on one rank")

    legacy = None
    if max_len and concurrency:
        legacy = total * max_len * concurrency
        derivation.append(f"legacy reservation = {total} x max_len {max_len} x concurrency {concurrency} = {legacy} B")
    if plan:
        derivation += plan.derivation
    return MemoryPlan(
        per_token_bytes=total,
        per_layer_token_bytes=[rules.cache_token_bytes(layer.caches) for layer in layers],
        groups=[GroupMemory(group_key=g.group_key, attn_type=g.attn_type,
                            num_layers=g.num_layers, per_token_bytes=g.per_token_bytes, fixed_blocks=g.fixed,
                            blocks=plan.blocks.get(g.group_key) if plan else None,
                            **g.reported(req.block_size)) for g in groups],
        legacy_reservation_bytes=legacy,
        hbm_gb=hbm,
        kv_mem_ratio=ratio,
        max_concurrency=concurrency,
        max_len=max_len,
        blocks=plan.blocks if plan else None,
        max_tokens=plan.max_tokens if plan else None,
        max_concurrency_at_max_len=plan.max_concurrency_at_max_len if plan else None,
        derivation=derivation,
    )


def _notes(facts: ModelFacts, progress: ProgressFacts, layers: list[LayerPlan], kv_mode: str,
           warnings: list[Finding], questions: list[Finding]) -> None:
    """Non-blocking facts the implementer must not miss."""
    if kv_mode == "legacy":
        if facts.attn_logit_softcapping.value is not None:
            warnings.append(Finding(
                message="FA has no soft-capping: the Legacy render keeps the model's own eager attention with the "
                        "tanh soft-cap (legacy_attention.kernel 'model'); the fa/sparse_mode fields apply to no call",
                fields=[facts.attn_logit_softcapping.source],
            ))
        sliding = [layer.index for layer in layers if layer.is_sliding]
        if sliding:
            warnings.append(Finding(
                message=f"Legacy sliding layers ({len(sliding)}): whether BSH FA honours sparse_mode 4 / pre_tokens "
                        "at q_len 1 is open (band_at_single_query), so the rendered Legacy decode bounds the keys to "
                        "the window itself (FA: the cache sliced to the last W keys; model attention: its window "
                        "mask); hand-written decode code must do the same",
                fields=[facts.sliding_window.source],
            ))
    if facts.prefix_lm.value:
        warnings.append(Finding(
            message="prefix_lm true: transformers attends the tokens a request marks with token_type_ids == 1 both "
                    "ways at its first forward (HrmTextModel.forward: create_causal_mask's block_sequence_ids); the "
                    "plan and its validation attend causally (the paged FA call's causal mask), so serve requests "
                    "without token_type_ids or give their prefill that mask",
            fields=[facts.prefix_lm.source],
        ))
    unplanned = [layer.index for layer in layers if layer.is_recurrent and not layer.is_state]
    if unplanned:
        warnings.append(Finding(
            message=f"{len(unplanned)} linear-attention layers of an unknown family: no state is planned for them "
                    "and they are left out of the memory plan",
            fields=[facts.layer_kinds.source],
        ))
    if "paged" in {s.value for s in progress.starting_point} and kv_mode == "legacy":
        warnings.append(Finding(
            message="progress.md says the code is already paged, but a blocker keeps Legacy: review the blockers",
            fields=["progress.md"],
        ))
    kind_warnings, kind_questions = format_of(facts).notes(facts)
    warnings += kind_warnings
    questions += kind_questions


def _window_dependency(reading: str, sliding: list[int], where: str = "") -> DeviceDependency:
    window = QUESTIONS["window_pre_tokens"]
    other = window.alternatives(reading)[0]
    return DeviceDependency(
        question=window.name,
        assumed=reading,
        alternative=other,
        consequence=f"under '{other}' the rendered pre_tokens admits one key too many or too few{where} "
                    "(re-analyze with --window-reading to switch)",
        layers=sliding,
    )


def _linear_dependencies(facts: ModelFacts, layers: list[LayerPlan]) -> list[DeviceDependency]:
    """Gated-delta-net layers with more value heads than key heads feed the NPU operators q/k per key head: which
    key head serves a value head is the operator's (gdr_head_grouping), and the model's is consecutive."""
    lin = facts.linear.value
    if lin is None or lin.family != "gated_delta_net" or lin.num_v_heads == lin.num_k_heads:
        return []
    return [_assumed_default("gdr_head_grouping", lambda other: (
        f"the model pairs value head h with key head h // {lin.num_v_heads // lin.num_k_heads} (transformers' "
        f"repeat_interleave); under '{other}' the operators pair other heads and every linear layer's output is "
        "wrong (validation sweeps both)"), [layer.index for layer in layers if layer.is_state])]


def _assumed_default(question: str, consequence, layers: list[int]) -> DeviceDependency:
    """A dependency on ``question``'s default reading; ``consequence(other)`` says what its first other reading
    would do."""
    q = QUESTIONS[question]
    other = q.alternatives(q.default)[0]
    return DeviceDependency(question=q.name, assumed=q.default, alternative=other, consequence=consequence(other),
                            layers=layers)


def _value_dim_dependencies(facts: ModelFacts, layers: list[LayerPlan], kv_mode: str) -> list[DeviceDependency]:
    """Value heads narrower than key heads (MiMo-V2-Flash): every FA call passes V caches of their own width, which
    the op docs both list (TND pairs) and forbid (identical K/V shapes): value_head_dim."""
    if facts.v_head_dim.value is None or kv_mode != "paged":
        return []
    return [_assumed_default("value_head_dim", lambda other: (
        f"K caches of {facts.head_dim.value} and V caches of {facts.v_head_dim.value} per head; under '{other}' every "
        f"FA call fails, and zero-padding V to {facts.head_dim.value} would leave the layers with learnable sinks "
        "without FA (learnable_sink needs value D <= 128, 2.14.0 _op_plugin_docs.py:8757)"),
        [layer.index for layer in layers if layer.caches])]


def _device_dependencies(layers: list[LayerPlan], kv_mode: str, reading: str, deploy_mode: str = "standalone",
                         legacy_fa: bool = False, fa_band: bool = True) -> list[DeviceDependency]:
    """The device readings the plan rests on; ``fa_band`` False: the sliding layers' band is not FA's (the kind
    attends through a kernel of its own), so FA's band readings are none of them."""
    sliding = [layer.index for layer in layers if layer.is_sliding] if fa_band else []
    if kv_mode != "paged":
        # Legacy: the model's own attention calls no FA; a Legacy FA call bands its sliding prefill (its decode
        # slices the last W keys itself, so band_at_single_query is no dependency).
        if legacy_fa and sliding:
            return [_window_dependency(reading, sliding, " (Legacy prefill; decode where the band is honoured)")]
        return []
    out = []
    if sliding:
        band = QUESTIONS["band_at_single_query"]
        out.append(DeviceDependency(
            question=band.name,
            assumed=band.default,
            alternative=band.alternatives(band.default)[0],
            consequence="if the band is ignored at q_len 1, decode reads the null block and out-of-window keys",
            layers=sliding,
        ))
        out.append(_window_dependency(reading, sliding))
    out.append(DeviceDependency(
        question="null_block_contents",
        assumed="undefined (poisoned in validation)",
        alternative="zeros",
        consequence="a design that reads the null block is wrong even if zeros hide it",
        layers=[],
    ))
    if deploy_mode == "framework":
        slots = QUESTIONS["repeated_slots"]
        out.append(DeviceDependency(
            question=slots.name,
            assumed=slots.default,
            alternative="error",
            consequence="the engine pads decode batches (every padded row writes the null block's slot 0); "
                        "if the writer rejects repeated slots, padded decode steps fail",
            layers=[],
        ))
    return out
