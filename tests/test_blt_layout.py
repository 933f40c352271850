"""BLT (transformers BltForCausalLM): the cache layout analyzer/kinds/byte_patches.py writes down, checked against a
real forward of transformers' model, the manifest `kvcache analyze` writes around it, and its render run byte by
byte (the whole `kvcache run` route in both modes: tests/test_blt_route.py).

Cross-check: a tiny BLT built from a config through the same facts reader; a prefill and a decode step with a
caller-built EncoderDecoderCache (transformers cannot build its own: DynamicCache(config=BltConfig) raises); the caches
it leaves must be the layout the analyzer plans, container by container and index by index.
"""

from __future__ import annotations

import json

import pytest
import torch
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.errors import InputError, NotSupportedByKvcache
from model_infer_kvcache.analyzer.kinds import byte_patch_section
from model_infer_kvcache.analyzer.kinds import byte_patches as bp
from model_infer_kvcache.analyzer.operators.fa_facts import INT32_MAX

SMALL = dict(
    patcher_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64),
    encoder_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        hidden_size_global=64),
    decoder_config=dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, hidden_size_global=64,
                        intermediate_size=64),
    global_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128),
    encoder_hash_byte_group_vocab=100, local_attention_window_len=4)


def _between(entropy: torch.Tensor) -> float:
    """A threshold halfway between the two middle entropies: patches of several lengths, and no entropy on the edge
    (where rounding would decide a boundary)."""
    s = entropy.sort().values
    return (s[len(s) // 2 - 1] + s[len(s) // 2]).item() / 2


def _tiny(threshold: float | None = None, **extra):
    from transformers import BltConfig, BltForCausalLM

    cfg = BltConfig(**SMALL, **extra, **({"patching_threshold": threshold} if threshold is not None else {}))
    torch.manual_seed(1)
    return cfg, BltForCausalLM(cfg).eval().double()


def _observed(cache) -> dict[str, list[tuple[int, int]]]:
    return {name: [tuple(layer.keys.shape[i] for i in (1, 3)) for layer in getattr(cache, name).layers]
            for name in (bp.SELF_CACHE, bp.CROSS_CACHE)}


def _decode(model, ids, prefill: int):
    from transformers import DynamicCache, EncoderDecoderCache

    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    with torch.no_grad():
        logits = [model(ids[:, :prefill], cache=cache, use_cache=True).logits[0]]
        for p in range(prefill, ids.shape[1]):
            logits.append(model(ids[:, p:p + 1], cache=cache, use_cache=True).logits[0])
    return cache, torch.cat(logits)


def test_planned_layout_is_what_transformers_caches():
    """Encoder layers in self_attention_cache 0..E-1, the decoder's self-attention in cross_attention_cache 0..D-1
    (KV heads, head_dim per stack), one row per byte; the patcher and the global transformer cached nowhere.
    Negative controls: a plan numbering the decoder after the encoder in one cache, and one taking the global
    transformer for transformers-cached, each fail naming the container."""
    cfg, model = _tiny()
    facts = bp.read_facts(cfg.to_dict(), "blt.json")
    ids = torch.randint(0, 260, (1, 9))
    cache, _ = _decode(model, ids, 7)
    observed = _observed(cache)
    assert bp.layout_problems(facts, observed) == []
    assert observed == {bp.SELF_CACHE: [(2, 8)] * 2, bp.CROSS_CACHE: [(2, 16)] * 3}
    for name in (bp.SELF_CACHE, bp.CROSS_CACHE):  # a row per byte: the prefill's 7 and the 2 decoded
        assert {layer.keys.shape[2] for layer in getattr(cache, name).layers} == {9}
    plan = bp.cache_plan(facts)
    assert [(layer.stack.stack.section, layer.layer) for layer in plan] == [
        ("encoder_config", 0), ("encoder_config", 1), ("decoder_config", 0), ("decoder_config", 1),
        ("decoder_config", 2), ("patcher_config", 0), ("patcher_config", 1), ("global_config", 0),
        ("global_config", 1)]
    assert [layer.stack.stack.over for layer in plan].count(bp.PER_PATCH) == 2

    shared = bp.Stack("decoder_config", "model.local_decoder", bp.PER_BYTE, "local_attention_window_len",
                      bp.SELF_CACHE)
    one_cache = bp.BytePatchFacts(tuple(bp.StackFacts(shared, *[getattr(s, f) for f in (
        "layers", "heads", "kv_heads", "head_dim", "window")]) if s.stack.section == "decoder_config" else s
        for s in facts.stacks), facts.threshold, facts.max_patch_length, facts.cross_attn_k,
        facts.decoder_cross_layers, facts.encoder_cross_layers)
    problems = bp.layout_problems(one_cache, observed)
    assert any(p.startswith("self_attention_cache: analyzer places") for p in problems), problems
    glob = facts.of("global_config")
    cached_global = bp.BytePatchFacts(tuple(
        bp.StackFacts(bp.Stack("global_config", glob.stack.module, bp.PER_PATCH, None, bp.CROSS_CACHE),
                      glob.layers, glob.heads, glob.kv_heads, glob.head_dim, None) if s is glob else s
        for s in facts.stacks), facts.threshold, None, 2, 3, 1)
    problems = bp.layout_problems(cached_global, observed)
    assert any(p.startswith("cross_attention_cache: analyzer places") for p in problems), problems


def test_transformers_cached_decode_is_not_its_model_but_its_full_forward_is_causal():
    """Why the plan caches the patcher and the global transformer: transformers' cached decode reruns them over the
    step's byte alone and leaves its own full forward (by more than the logits' scale / 10), while every prefix of the
    full forward gives the whole sequence's logits (0 difference), so a paged port can match it. The threshold is the
    patcher's middle entropy, so the sequence holds patches of several lengths."""
    _, model = _tiny(0.0)
    ids = torch.randint(0, 260, (1, 16))
    with torch.no_grad():
        entropy = model.model.patcher(ids, patch_size=4, threshold=0.0)[0][0, 1:]
    _, model = _tiny(_between(entropy))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits[0]
        lengths = model.model.patcher(ids, patch_size=4, threshold=model.config.patching_threshold)[1]
        prefix = max((model(ids[:, :n], use_cache=False).logits[0] - full[:n]).abs().max().item()
                     for n in range(2, 16))
    assert len(set(lengths[0].tolist()) - {0}) > 1, lengths
    assert prefix == 0.0
    _, cached = _decode(model, ids, 10)
    assert (cached - full).abs().max().item() > full.abs().max().item() / 10


def _write(tmp_path, data):
    path = tmp_path / "blt.json"
    path.write_text(json.dumps(data, default=str), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("dispatch", ["部署模式：框架部署", "部署模式：独立部署"])
def test_analyze_writes_the_byte_patches_manifest(tmp_path, dispatch):
    """The class defaults: a manifest (both dispatch modes) whose layers are the plan's 49 cache layers in cache order,
    each with its stack's own shape where it differs from the model-level stack (the local decoder's 16 x 64): the
    patcher's 12 query heads, the global stack's head_dim 128 and scale; each stack a manager of its own; the
    byte_patches section beside them; the memory groups a pool per stack plus the decoder's cross slot and the open
    patch's rows (4096: no max_patch_length, the request's bytes bound them)."""
    from transformers import CONFIG_MAPPING

    data = CONFIG_MAPPING["blt"]().to_dict()
    m = analyze(AnalyzeRequest(config=_write(tmp_path, data), dispatch=dispatch))
    assert m.deploy_mode.value == ("framework" if "框架" in dispatch else "standalone")
    assert m.byte_patches is not None and not m.blockers and m.kv_mode.value == "paged"
    assert (m.model.num_layers, m.model.num_attention_heads, m.model.head_dim) == (49, 16, 64)
    by_stack = {}
    for layer in m.layers:
        by_stack.setdefault(layer.group_key, []).append(layer.index)
    assert by_stack == {"encoder_config": [0], "decoder_config": list(range(1, 10)),
                        "patcher_config": list(range(10, 24)), "global_config": list(range(24, 49))}
    patcher, glob = m.layers[10], m.layers[24]
    assert (patcher.num_q_heads_per_rank, patcher.num_kv_heads_per_rank, patcher.head_dim) == (12, 12, None)
    assert (glob.head_dim, glob.softmax_scale, glob.sliding_window, glob.sparse_mode.decode) == (128, 128 ** -0.5,
                                                                                                None, 3)
    assert (m.layers[1].sliding_window, m.layers[1].pre_tokens, m.layers[1].softmax_scale) == (512, 511, None)
    groups = {g.group_key: g for g in m.memory.groups}
    assert set(groups) == {"patcher_config", "encoder_config", "global_config", "decoder_config", "CrossAttention",
                           byte_patch_section.OPEN_PATCH}
    assert groups[byte_patch_section.OPEN_PATCH].state_bytes == 4096 * 1024 * 2
    assert m.byte_patches.open_patch_rows == 4096 and "request's bytes" in m.byte_patches.open_patch_bound
    assert m.memory.per_token_bytes == sum(m.memory.per_layer_token_bytes)
    limited = analyze(AnalyzeRequest(config=_write(tmp_path, data | {"max_patch_length": 6}), dispatch=dispatch))
    assert limited.byte_patches.open_patch_rows == 6
    static = analyze(AnalyzeRequest(config=_write(tmp_path, data | {"patching_mode": "static"}), dispatch=dispatch))
    assert len(static.layers) == 35 and "patcher_config" not in {layer.group_key for layer in static.layers}


def test_bad_blt_fields_are_bad_input_by_field(tmp_path):
    """A stack's bad field, a missing window: bad input naming the field (the facts reader); attention TP above 1:
    refused naming --attn-tp-size (the stacks are planned on one rank); a one-stack route refuses BLT naming its plan."""
    from transformers import CONFIG_MAPPING

    data = CONFIG_MAPPING["blt"]().to_dict()
    for section, field, value in (("encoder_config", "num_attention_heads", "16"),
                                  ("global_config", "num_attention_heads", 15)):
        bad = json.loads(json.dumps(data))
        bad[section][field] = value
        with pytest.raises(InputError) as err:
            analyze(AnalyzeRequest(config=_write(tmp_path, bad)))
        assert not isinstance(err.value, NotSupportedByKvcache) and err.value.field == f"{section}.{field}"
    missing = {k: v for k, v in data.items() if k != "local_attention_window_len"}
    with pytest.raises(InputError) as err:
        analyze(AnalyzeRequest(config=_write(tmp_path, missing)))
    assert err.value.field == "local_attention_window_len" and "missing" in err.value.message
    with pytest.raises(InputError) as err:
        analyze(AnalyzeRequest(config=_write(tmp_path, data), attn_tp_size=2))
    assert err.value.where == "--attn-tp-size" and "one rank" in err.value.message
    for flag, request in (("--kv-mode", dict(kv_mode="legacy")), ("--next-n", dict(next_n=1))):
        with pytest.raises(InputError) as err:
            analyze(AnalyzeRequest(config=_write(tmp_path, data), **request))
        assert err.value.where == flag, err.value.render()
    from model_infer_kvcache.implementer.render import render_manifest

    with pytest.raises(InputError) as err:  # a graph-captured step: not rendered (the boundary branches per request)
        render_manifest(analyze(AnalyzeRequest(config=_write(tmp_path, data), exe_mode="npugraph_ex")))
    assert err.value.field == "exe_mode" and "eager only" in err.value.message
    # framework mode registers the per-request slots as MambaCacheEntry: a question where the generation is unknown, a
    # blocker where it lacks one (G1), which the render refuses (no Legacy path); standalone: neither
    framework = dict(config=_write(tmp_path, data), dispatch="部署模式：框架部署")
    assert any("MambaCacheEntry" in q.message for q in analyze(AnalyzeRequest(**framework)).open_questions)
    blocked = analyze(AnalyzeRequest(**framework, framework_api="G1"))
    assert "open patch's 4096 encoder rows" in blocked.blockers[0].message
    with pytest.raises(NotSupportedByKvcache) as err:
        render_manifest(blocked)
    assert err.value.field == "blockers"
    standalone = analyze(AnalyzeRequest(config=_write(tmp_path, data), dispatch="部署模式：独立部署"))
    assert not standalone.blockers and not any("MambaCacheEntry" in q.message for q in standalone.open_questions)
    # a route that reads one decoder stack (normalize_config: a checkout's model run) names the plan and where it lives
    from model_infer_kvcache.analyzer.config_loader import normalize_config

    with pytest.raises(NotSupportedByKvcache) as err:
        normalize_config(data, "blt.json")
    assert "global 25 x 16 KV heads x 128 (full causal, a row per patch; cache layers 24..48" in err.value.message
    assert "byte_patches section" in err.value.message and err.value.field == "global_config"


def test_a_hand_edited_blt_manifest_is_refused_by_field(tmp_path):
    """Hand edits of a BLT manifest, each a plausible mistake, refused by field when loaded: a global layer read at
    the decoder's scale (the layer off its stack), the decoder given the global stack's scale in both the section and
    its layers (the section's own rule: BltSelfAttention.scaling), a layer moved to another stack's manager, the open
    patch's rows past max_patch_length."""
    from model_infer_kvcache.analyzer.manifest_io import load_manifest
    from transformers import CONFIG_MAPPING

    data = CONFIG_MAPPING["blt"]().to_dict() | {"max_patch_length": 6}
    text = analyze(AnalyzeRequest(config=_write(tmp_path, data))).to_json()
    path = tmp_path / "manifest.json"
    path.write_text(text, encoding="utf-8")
    assert load_manifest(path).byte_patches.max_patch_length == 6

    def edited(edit):
        m = json.loads(text)
        edit(m)
        path.write_text(json.dumps(m), encoding="utf-8")
        with pytest.raises(InputError) as err:
            load_manifest(path)
        return err.value.field

    def decoder_at_global_scale(m):
        m["byte_patches"]["stacks"][3]["softmax_scale"] = 128 ** -0.5
        for layer in m["layers"][1:10]:
            layer.update(softmax_scale=128 ** -0.5, scale_derivation="edited")

    assert edited(lambda m: m["layers"][30].pop("softmax_scale")) == "layers[30]"
    assert edited(decoder_at_global_scale) == "byte_patches.stacks[3].softmax_scale"
    assert edited(lambda m: m["layers"][5].update(group_key="encoder_config")) == "layers[5]"
    assert edited(lambda m: m["byte_patches"].update(open_patch_rows=7)) == "byte_patches.open_patch_rows"


def _case(extra):
    """A tiny float64 BLT whose threshold is the patcher's middle entropy over random bytes (patches of several
    lengths), with ``extra`` config fields."""
    _, model = _tiny(0.0)
    ids = torch.randint(0, 260, (1, 14), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        entropy = model.model.patcher(ids, patch_size=4, threshold=0.0)[0][0, 1:]
    cfg, model = _tiny(_between(entropy), **extra)
    return model, bp.read_facts(cfg.to_dict(), "blt.json")


def _judged(model, facts, **knobs):
    from model_infer_kvcache.validators.npu_ops.backend import load
    from model_infer_kvcache.validators.pipeline import byte_patch_run as host
    from model_infer_kvcache.validators.pipeline.report import Report

    run = host.run_byte_patches(model, facts, load("emulated"), **knobs)
    report = Report("emulated", "framework", "blt", "-", "float64", 1e-9)
    worst = host.check_byte_patches(report, model, facts, run, 1e-9)
    return run, {c.id: c.passed for c in report.checks}, worst


@pytest.mark.parametrize("extra", [{}, {"max_patch_length": 2}, {"patching_mode": "static"}])
def test_the_planned_caches_reproduce_the_full_forward_byte_by_byte(extra):
    """The plan is sufficient: the validators' byte-stepping host (validators/pipeline/byte_patch_run.py: three
    requests admitted late and finishing early, each stack's K/V written with the emulated npu_scatter_nd_update_
    into its paged pool and read by the emulated FA through its block table) gives transformers' full-forward logits
    at every byte (a float64 model: within the float32 cast of transformers' logits) and its greedy bytes, each
    byte-rate pool holding a row per byte and the global one a row per patch at the bytes transformers' own patcher
    ends them; with max_patch_length a patch also ends at that many bytes; without entropy patching every byte is a
    patch and no patcher is cached."""
    model, facts = _case(extra)
    run, passed, worst = _judged(model, facts)
    assert passed == {"V117": True, "V234": True, "V309": True, "V310": True, "V408": True}, passed
    assert worst < 1e-6
    stacks = {c.stack for c in run.calls}
    assert stacks == {layer.stack.stack.section for layer in bp.cache_plan(facts)}
    per_patch = {c.requests for c in run.calls if c.stack == "global_config"}
    if facts.entropy_patching:  # some steps end no patch: the global stack steps for a subset of the requests
        assert len({r for c in run.calls if c.stack == "global_config" for r in c.requests}) == 3
        assert sum(st.patches for st in run.states.values()) < sum(len(st.bytes) for st in run.states.values())
    else:
        assert sum(st.patches for st in run.states.values()) == sum(len(st.bytes) for st in run.states.values())
    assert per_patch


@pytest.mark.parametrize("knob, fails", [
    ({"boundary_shift": 1}, {"V234", "V309", "V310"}),
    ({"global_cached": False}, {"V234", "V309", "V310"}),
    ({"refresh_cross": False}, {"V309", "V310"}),
    ({"reading": "inclusive"}, {"V309", "V310"}),
    ({"release": False}, {"V408"}),
])
def test_byte_patch_mistakes_fail_by_check_id(knob, fails):
    """Negative controls, each a plausible port mistake: the patch boundary read one byte late (the global stack
    steps at the wrong bytes: V234, and the logits leave the full forward by ~1.6), the global stack rerun over the
    step's patch alone as transformers' cached path does (its kv_len stays 1: V234; ~1.1), the decoder's cross K/V
    kept from the first patch instead of refreshed at each patch end (~2.4), the byte stacks' pre_tokens planned under
    the 'inclusive' reading while the operators count 'exclusive' (one key past the window: ~4.8), a finished
    request's blocks never released (V408 alone: the logits stay right)."""
    model, facts = _case({})
    _, passed, worst = _judged(model, facts, **knob)
    assert {i for i, ok in passed.items() if not ok} == fails, passed
    assert (worst > 0.1) == bool(fails & {"V309", "V201"}), worst  # V201: the run stopped (inf)


def test_a_blt_config_validates_at_cpu_sizes():
    """transformers' class-default BLT (its 16 / 12 query heads, 512 windows, entropy patching) run by the host at
    CPU sizes (byte_patch_run.cpu_model: 2 layers a stack, head dims 4 / 8 / 16 (patcher, local, global), window
    6, the threshold re-set to the random model's median entropy, each cut noted): every check passes, max |diff|
    within the float32 cast (the mistakes that fail by check id: test_byte_patch_mistakes_fail_by_check_id)."""
    from model_infer_kvcache.validators.npu_ops.backend import load
    from model_infer_kvcache.validators.pipeline import byte_patch_run as host
    from model_infer_kvcache.validators.pipeline.report import Report
    from transformers import CONFIG_MAPPING

    real = CONFIG_MAPPING["blt"]().to_dict()
    report = Report("emulated", "framework", "blt", "-", "float64", 1e-9)
    worst = host.validate_config(report, real, load("emulated"))
    assert report.passed and worst < 1e-6, [(c.id, c.detail) for c in report.checks]
    assert {"BLT at CPU sizes: global_config.num_hidden_layers 25 -> 2",
            "BLT at CPU sizes: local_attention_window_len 512 -> 6"} <= set(report.notes), report.notes
    assert any(n.startswith("BLT at CPU sizes: patching_threshold 1.335") for n in report.notes), report.notes
    _, facts, _ = host.cpu_model(real)
    assert [s.heads for s in facts.stacks] == [12, 16, 16, 16] and facts.of("encoder_config").window == 6


def test_the_section_plans_each_stack_its_own_heads_scale_and_band():
    """The manifest's byte_patches section (byte_patch_section.decide) at transformers' class defaults: each stack
    its own query heads, head_dim and scale (the global stack 128 wide, the local ones 64, the patcher 12 heads),
    the byte stacks banded by their 512 window (pre_tokens W - 1 under the exclusive reading, W under the inclusive
    one), the global stack causal; together the stacks' cache layers are the plan's."""
    from transformers import CONFIG_MAPPING

    facts = bp.read_facts(CONFIG_MAPPING["blt"]().to_dict(), "blt.json")
    section = byte_patch_section.decide(facts, "exclusive", 4096)  # the section's own home, beside the facts'
    got = {s.section: (s.num_heads, s.head_dim, s.softmax_scale, s.sparse_mode, s.pre_tokens) for s in section.stacks}
    assert got == {"patcher_config": (12, 64, 0.125, 4, 511), "encoder_config": (16, 64, 0.125, 4, 511),
                   "global_config": (16, 128, 128 ** -0.5, 3, INT32_MAX), "decoder_config": (16, 64, 0.125, 4, 511)}
    assert sorted(i for s in section.stacks for i in s.cache_layers) == [c.index for c in bp.cache_plan(facts)]
    assert {s.pre_tokens for s in byte_patch_section.decide(facts, "inclusive", 4096).stacks if s.sliding_window} == {512}
    assert section.patching_threshold == facts.threshold and section.cross_attn_k == 2


def _render_judged(edit=None, extra=None, dtype="float64"):
    """The implementer's render of the class-default BLT's (with ``extra`` config fields) CPU-sized section
    (``edit``: a text mutation of the rendered file, which must change it) run by the host in place of its own
    attention and boundary."""
    import tempfile
    from pathlib import Path

    from model_infer_kvcache.validators.npu_ops.backend import install_emulation, load
    from model_infer_kvcache.validators.pipeline import byte_patch_run as host
    from model_infer_kvcache.validators.pipeline.precision import TOLERANCE
    from model_infer_kvcache.validators.pipeline.report import Report
    from transformers import CONFIG_MAPPING

    real = CONFIG_MAPPING["blt"]().to_dict() | (extra or {})
    with tempfile.TemporaryDirectory() as tmp:
        path = host.render_cpu(real, tmp)
        text = path.read_text(encoding="utf-8")
        if edit is not None:
            mutated = edit(text)
            assert mutated != text
            Path(path).write_text(mutated, encoding="utf-8")
        report = Report("emulated", "framework", "blt", "-", dtype, TOLERANCE[dtype])
        with install_emulation():
            worst = host.validate_config(report, real, load("emulated"), rendered_dir=tmp)
    return text, {c.id: c.passed for c in report.checks}, worst


@pytest.mark.parametrize("extra, constants", [
    ({}, ("ENTROPY_PATCHING = True", "MAX_PATCH_LENGTH = None")),
    ({"max_patch_length": 2}, ("ENTROPY_PATCHING = True", "MAX_PATCH_LENGTH = 2")),
    ({"patching_mode": "static"}, ("ENTROPY_PATCHING = False", "PATCHING_THRESHOLD = None")),
], ids=["entropy", "max-patch-length", "static"])
def test_the_rendered_attention_reproduces_the_full_forward(extra, constants):
    """The render (implementer/kinds/byte_patches.py) of the CPU-sized section: its KVCacheBytePatchAttention runs
    every stack's FA call, its KVCacheByteCrossAttention writes and reads the decoder's per-request cross K/V slots
    and its ends_patch decides every boundary, in place of the host's own: all checks pass,
    within the float32 cast of transformers' logits; with max_patch_length, and without entropy patching (every
    byte a patch, no patcher stack rendered)."""
    text, passed, worst = _render_judged(extra=extra)
    assert passed == {"V201": True, "V117": True, "V234": True, "V309": True, "V310": True, "V408": True}, passed
    assert worst < 1e-6, worst
    assert '"global_config": dict(num_heads=16, num_kv_heads=16, head_dim=16, scale=0.25, sparse_mode=3' in text
    assert all(line in text.splitlines() for line in constants), text
    assert ('"patcher_config"' in text) == ("static" not in extra.values())


def _scale_of(stack: str, text: str) -> str:
    import re

    return re.search(rf'"{stack}": dict\(.*?scale=([0-9.e-]+)', text).group(1)


def _decoder_at_global_scale(text: str) -> str:
    import re

    return re.sub(r'("decoder_config": dict\(.*?scale=)[0-9.e-]+', lambda m: m.group(1) + _scale_of("global_config",
                  text), text)


@pytest.mark.parametrize("edit, fails, extra", [
    (lambda t: t.replace("entropies[position] >", "entropies[position - 1] >"), {"V234", "V309", "V310"}, None),
    (_decoder_at_global_scale, {"V309"}, None),
    (lambda t: t.replace('"encoder_config": dict(num_heads=16', '"encoder_config": dict(num_heads=12'), {"V201"},
     None),
    (lambda t: t.replace("sparse_mode=3, pre_tokens=2147483647", "sparse_mode=4, pre_tokens=5"), {"V309", "V310"},
     None),
    (lambda t: t.replace("open_bytes >= MAX_PATCH_LENGTH", "open_bytes > MAX_PATCH_LENGTH"), {"V234", "V309"},
     {"max_patch_length": 2}),
    (lambda t: t.replace("[CROSS_ATTN_K] * t", "[CROSS_ATTN_K - 1] * t"), {"V309", "V310"}, None),
    (lambda t: t.replace("+ slot * self.k_slots.shape[1]).view", "+ (slot % 2 + 1) * self.k_slots.shape[1]).view"),
     {"V309", "V310"}, None),
    (lambda t: t.replace("OPEN_PATCH_ROWS = 25", "OPEN_PATCH_ROWS = 2"), {"V234"}, None),
], ids=["boundary-a-byte-late", "decoder-scale-of-global", "encoder-heads-of-patcher", "global-banded",
        "max-patch-length-a-byte-late", "cross-reads-one-row-short", "cross-written-to-another-slot",
        "open-patch-slot-too-small"])
def test_render_mistakes_fail_by_check_id(edit, fails, extra):
    """Negative controls on the rendered file, each a plausible port mistake: the boundary read on the previous
    byte's entropy (the global stack steps a byte late: V234, logits off by ~2), the decoder attending at the global
    stack's scale (one model-level SOFTMAX_SCALE: ~0.2), the encoder given the patcher's 12 query heads (the
    operator rejects the call: V201), the global stack banded like the byte stacks' window, a max_patch_length
    patch cut a byte late (~1.6), the decoder's cross-attention reading one row of the patch's K/V short (~1.9), a
    patch's cross K/V written into another request's slot (~2.1), the open patch's state slot sized for 2 rows where
    no max_patch_length bounds a patch (the stream's patches outgrow it: V234 alone, the logits stay right)."""
    _, passed, worst = _render_judged(edit, extra)
    assert {i for i, ok in passed.items() if not ok} == fails, passed
    assert (worst > 0.1) == bool(fails & {"V309", "V201"}), worst  # V201: the run stopped (inf)


def _edited(section, stack: str, **fields):
    return section.model_copy(update={"stacks": [s.model_copy(update=fields) if s.section == stack else s
                                                 for s in section.stacks]})


def test_a_hand_edited_section_is_refused_by_field():
    """The render refuses a section whose invariants a hand edit broke (byte_patch_section.problems), naming the
    field: the decoder at the global stack's scale, a byte stack's band dropped to causal, the global stack given a
    window, two stacks claiming one cache layer, a pre_tokens no device reading gives; the decided section renders."""
    from model_infer_kvcache.implementer.kinds import byte_patches as render_kind
    from model_infer_kvcache.implementer.render import ATTENTION_FILE, _environment
    from transformers import CONFIG_MAPPING

    facts = bp.read_facts(CONFIG_MAPPING["blt"]().to_dict(), "blt.json")
    section = byte_patch_section.decide(facts, "exclusive", 4096)
    assert byte_patch_section.problems(section) == []
    assert render_kind.render(section, _environment(), ATTENTION_FILE)
    order = [s.section for s in section.stacks]
    for edit, field in (
            (_edited(section, "decoder_config", softmax_scale=128 ** -0.5), "softmax_scale"),
            (_edited(section, "encoder_config", sparse_mode=3), "sparse_mode"),
            (_edited(section, "global_config", sliding_window=512, sparse_mode=4, pre_tokens=511), "sliding_window"),
            (_edited(section, "encoder_config", cache_layers=[1]), None),
            (_edited(section, "patcher_config", pre_tokens=510), "pre_tokens")):
        with pytest.raises(InputError) as err:
            render_kind.render(edit, _environment(), ATTENTION_FILE)
        stack = next(s.section for s, t in zip(edit.stacks, section.stacks, strict=True) if s != t)
        want = "byte_patches.stacks" if field is None else f"byte_patches.stacks[{order.index(stack)}].{field}"
        assert err.value.field == want, (err.value.field, err.value.message)


def test_the_rendered_attention_at_float32():
    """The same render in a float32 model: every check passes within float32's tolerance (3.3e-6 measured). (At
    bfloat16, measured by hand: transformers' stepped and whole-sequence patchers round some entropies to either side
    of the threshold, request 1's bytes 11 and 12, 5.0625 vs 5.0938 at a threshold bfloat16 reads as 5.0625; the
    checks judge such boundaries with the run's own (``rounding_boundaries``) and then pass, max |diff| 0.047 to 0.0496
    against the 0.05 bound in the three patching modes: too near the bound to pin here.)"""
    _, passed, worst = _render_judged(dtype="float32")
    assert all(passed.values()) and set(passed) == {"V201", "V117", "V234", "V309", "V310", "V408"}, passed
    assert worst < 1e-4, worst


def test_a_boundary_moved_by_rounding_is_judged_with_the_runs_own():
    """``rounding_boundaries``: patch ends that differ from transformers' only at bytes whose entropy lies within
    NEAR_THRESHOLD_EPS x eps x threshold (in the entropy's dtype) are rounding, and the run's own are judged (the
    full forward given the run's entropies cuts the same patches as its own patcher when they are its own); one
    differing byte away from the threshold, or any at float64 beyond ~1e-15, is a wrong boundary (None)."""
    from model_infer_kvcache.validators.pipeline import byte_patch_run as host

    model, facts = _case({})
    thr = facts.threshold
    bf16 = torch.tensor([thr, thr + 0.03, thr - 0.5, thr + 0.5], dtype=torch.bfloat16)
    assert host.rounding_boundaries(facts, [0, 1], [0], bf16) == [1]
    assert host.rounding_boundaries(facts, [0, 1, 2], [0], bf16) is None  # byte 2 is far below the threshold
    assert host.rounding_boundaries(facts, [0, 3], [0, 3], bf16) == []
    f64 = torch.tensor([thr, thr + 1e-3, thr - 0.5, thr + 0.5], dtype=torch.float64)
    assert host.rounding_boundaries(facts, [0, 1], [0], f64) is None
    ids = torch.randint(0, 260, (14,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        own = model.model.patcher(torch.tensor([ids]), patch_size=4, threshold=0.0)[0][0]
    assert torch.equal(host.full_forward(model, ids, own), host.full_forward(model, ids))


def test_the_cross_checks_meta_build_reads_the_planned_stacks_in_cache_order():
    """The architecture cross-check's meta build (arch_check.transformers_report) joins BLT's four stacks in the
    plan's cache order (byte_patches.stacks_of: else it finds the global transformer's 25 layers alone), and each of
    its 49 modules has the planned scale, K/V shape and query heads (module_problems); a plan that gave the decoder
    the patcher's 12 query heads, or the global stack the local head_dim, is named by cache layer."""
    import dataclasses

    from model_infer_kvcache.analyzer import arch_check
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING["blt"]().to_dict()
    facts = bp.read_facts(config, "blt.json")
    report = arch_check.transformers_report(config, "blt")
    assert report.ships and report.error is None and len(report.attentions) == 49
    assert bp.module_problems(facts, report.attentions) == []

    def swapped(section, **fields):
        return dataclasses.replace(facts, stacks=tuple(dataclasses.replace(s, **fields) if s.stack.section == section
                                                       else s for s in facts.stacks))

    found = bp.module_problems(swapped("decoder_config", heads=12), report.attentions)
    assert len(found) == 9 and found[0].startswith("cache layer 1 (model.local_decoder.layers.0.self_attn)"), found
    found = bp.module_problems(swapped("global_config", head_dim=64), report.attentions)
    assert len(found) == 25 and found[0].startswith("cache layer 24 (model.global_transformer.layers.0"), found
    assert bp.stacks_of({"num_hidden_layers": 2}) is None


def test_analyze_checks_the_plan_against_transformers(tmp_path, monkeypatch):
    """`kvcache analyze` checks BLT's plan against transformers' modules first: at the class defaults they agree and
    the manifest is written; an analyzer whose facts gave the decoder the patcher's 12 query heads is stopped by the
    cross-check (bad input naming the cache layer and transformers' module), not given a wrong plan."""
    import dataclasses

    from transformers import CONFIG_MAPPING

    path = _write(tmp_path, CONFIG_MAPPING["blt"]().to_dict())
    assert analyze(AnalyzeRequest(config=path)).byte_patches is not None
    read = bp.read_facts

    def misread(cfg, where):
        facts = read(cfg, where)
        return dataclasses.replace(facts, stacks=tuple(
            dataclasses.replace(s, heads=12) if s.stack.section == "decoder_config" else s for s in facts.stacks))

    monkeypatch.setattr(bp, "read_facts", misread)
    with pytest.raises(InputError) as err:
        analyze(AnalyzeRequest(config=path))
    assert not isinstance(err.value, NotSupportedByKvcache) and err.value.field == "model_type"
    assert "cache layer 1 (model.local_decoder.layers.0.self_attn)" in err.value.message, err.value.message


def test_the_memory_groups_of_the_section():
    """byte_patch_section.memory_groups at the class defaults (bfloat16, block 128): a pool per stack with its own
    bytes per token (2 x layers x KV heads x head_dim x 2 bytes: encoder 1 x 16 x 64, decoder 9 x 16 x 64, patcher
    14 x 12 x 64, global 25 x 16 x 128), the byte stacks' 512 window as fixed blocks (ceil(512 / 128) + 1), the
    global stack growing with the bytes, the decoder's cross slot (9 layers x 2 rows x 16 x 64, K and V) and the open
    patch's encoder rows (a slot per request: 4096 rows x 1024 wide)."""
    from model_infer_kvcache.analyzer import kv_cache_spec
    from transformers import CONFIG_MAPPING

    section = byte_patch_section.decide(bp.read_facts(CONFIG_MAPPING["blt"]().to_dict(), "blt.json"), "exclusive",
                                        4096)
    groups = {g.group_key: g for g in byte_patch_section.memory_groups(section, 128, 2)}
    assert {k: g.per_token_bytes for k, g in groups.items() if not g.fixed or g.windowed} == {
        "encoder_config": 2 * 1 * 16 * 64 * 2, "decoder_config": 2 * 9 * 16 * 64 * 2,
        "patcher_config": 2 * 14 * 12 * 64 * 2, "global_config": 2 * 25 * 16 * 128 * 2}
    assert {k: g.blocks_per_request(4096) for k, g in groups.items()} == {
        "encoder_config": 5, "decoder_config": 5, "patcher_config": 5, "global_config": 32,
        kv_cache_spec.CROSS_ATTENTION: 1, byte_patch_section.OPEN_PATCH: 1}
    assert groups[kv_cache_spec.CROSS_ATTENTION].state_bytes == 9 * 2 * 2 * 16 * 64 * 2
    assert groups[byte_patch_section.OPEN_PATCH].state_bytes == 4096 * 1024 * 2  # open patch rows x encoder hidden


@pytest.mark.parametrize("planned, device, fails", [
    ("inclusive", "inclusive", set()),
    ("inclusive", "exclusive", {"V234", "V309", "V310"}),
    ("exclusive", "inclusive", {"V234", "V309", "V310"}),
])
def test_the_render_follows_the_device_window_reading(planned, device, fails):
    """The section planned under a device reading of pre_tokens (W under 'inclusive', W - 1 under 'exclusive')
    renders that band, and passes where the operators count the same way; planned under the other reading, the byte
    stacks see one key too many or too few (the patcher's entropies move the boundaries too: V234)."""
    import tempfile

    from model_infer_kvcache.validators.npu_ops.backend import install_emulation, load
    from model_infer_kvcache.validators.npu_ops.readings import DeviceReadings, device_readings
    from model_infer_kvcache.validators.pipeline import byte_patch_run as host
    from model_infer_kvcache.validators.pipeline.report import Report
    from transformers import CONFIG_MAPPING

    real = CONFIG_MAPPING["blt"]().to_dict()
    with tempfile.TemporaryDirectory() as tmp:
        text = host.render_cpu(real, tmp, reading=planned).read_text(encoding="utf-8")
        report = Report("emulated", "framework", "blt", "-", "float64", 1e-9)
        with install_emulation(), device_readings(DeviceReadings(window_pre_tokens=device)):
            worst = host.validate_config(report, real, load("emulated"), rendered_dir=tmp)
    assert f"pre_tokens={6 if planned == 'inclusive' else 5}, next_tokens=0" in text  # CPU window 6
    assert {c.id for c in report.checks if not c.passed} == fails, [(c.id, c.detail) for c in report.checks]
    assert (worst > 0.1) == bool(fails), worst
