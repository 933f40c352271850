"""BLT (transformers BltForCausalLM): the cache layout analyzer/kinds/byte_patches.py writes down, checked against a
real forward of transformers' model, and the refusal that names the plan and what kvcache lacks.

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
from model_infer_kvcache.analyzer.kinds import byte_patches as bp

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


def test_blt_refusal_names_the_plan_and_the_gap(tmp_path):
    """The class defaults: refused naming each stack's cache layers, transformers' containers, the per-patch global
    stack and what kvcache lacks; bad fields of a stack are bad input naming them."""
    from transformers import CONFIG_MAPPING

    data = CONFIG_MAPPING["blt"]().to_dict()
    with pytest.raises(NotSupportedByKvcache) as err:
        analyze(AnalyzeRequest(config=_write(tmp_path, data)))
    msg = err.value.message
    assert err.value.field == "global_config"
    for words in ("encoder 1 x 16 KV heads x 64 (window 512, a row per byte; cache layers 0..0, transformers' "
                  "self_attention_cache 0..0)", "decoder 9 x 16 KV heads x 64 (window 512, a row per byte; cache "
                  "layers 1..9, transformers' cross_attention_cache 0..8)", "patcher 14 x 12 KV heads x 64 "
                  "(window 512", "global 25 x 16 KV heads x 128 (full causal, a row per patch; cache layers 24..48",
                  "2 rows x 9 layers", "no cache layer written once per completed patch"):
        assert words in msg, msg
    nulled = json.loads(json.dumps(data))
    nulled["patcher_config"]["num_key_value_heads"] = None  # BltPatcherConfig.__post_init__: or num_attention_heads
    with pytest.raises(NotSupportedByKvcache, match=r"patcher 14 x 12 KV heads x 64"):
        analyze(AnalyzeRequest(config=_write(tmp_path, nulled)))
    static = data | {"patching_mode": "static"}
    with pytest.raises(NotSupportedByKvcache) as err:
        analyze(AnalyzeRequest(config=_write(tmp_path, static)))
    assert "patcher" not in err.value.message.split(". ")[0] and "global 25 x 16 KV heads x 128 (full causal, a " \
        "row per patch; cache layers 10..34" in err.value.message, err.value.message
    data["local_attention_window_len"] = None
    with pytest.raises(NotSupportedByKvcache, match=r"encoder 1 x 16 KV heads x 64 \(full causal"):
        analyze(AnalyzeRequest(config=_write(tmp_path, data)))
    for section, field, value in (("encoder_config", "num_attention_heads", "16"),
                                  ("global_config", "num_attention_heads", 15)):
        bad = json.loads(json.dumps(data)) | {}
        bad[section][field] = value
        with pytest.raises(InputError) as err:
            analyze(AnalyzeRequest(config=_write(tmp_path, bad)))
        assert not isinstance(err.value, NotSupportedByKvcache) and err.value.field == f"{section}.{field}"
    del data["local_attention_window_len"]
    with pytest.raises(InputError) as err:
        analyze(AnalyzeRequest(config=_write(tmp_path, data)))
    assert err.value.field == "local_attention_window_len" and "missing" in err.value.message


def _window_mask(pos: int, window: int | None) -> torch.Tensor:
    """One query at ``pos`` over keys 0..pos: transformers' sliding overlay keeps kv > q - window."""
    keys = torch.arange(pos + 1)
    keep = keys > pos - window if window else torch.ones(pos + 1, dtype=torch.bool)
    return torch.where(keep, 0.0, float("-inf")).double()[None, None, None]


def _run_stack(layers, rotary, h, pos: int, cache, window):
    emb = rotary(h, torch.tensor([[pos]]))
    for layer in layers:
        h = layer(h, position_embeddings=emb, attention_mask=_window_mask(pos, window), cache=cache)
    return h


def _planned_decode(model, facts, ids, *, boundary_shift: int = 0, global_cached: bool = True):
    """BLT run byte by byte on the planned caches (analyzer/kinds/byte_patches.cache_plan): one cache per stack, a
    row per byte for the patcher, encoder and decoder (with the plan's windows), a row per completed patch for the
    global transformer; per request the open patch's last encoder rows and the latest patch's global output. Knobs for
    the negative controls: the boundary read one byte late, the global stack rerun uncached as transformers does."""
    from transformers import DynamicCache
    from transformers.models.blt.modeling_blt import compute_hash_embeddings

    blt, cfg = model.model, model.config
    caches = {s.stack.section: DynamicCache() for s in {layer.stack for layer in bp.cache_plan(facts)}}
    window = {s.stack.section: s.window for s in facts.stacks}
    entropies, open_rows, patches, latest = [], [], 0, None
    logits = []
    for p in range(ids.shape[1]):
        byte = ids[:, p:p + 1]
        if "patcher_config" in caches:
            ph = _run_stack(blt.patcher.layers, blt.patcher.rotary_emb, blt.patcher.embed_tokens(byte), p,
                            caches["patcher_config"], window["patcher_config"])
            probs = blt.patcher.lm_head(blt.patcher.norm(ph))
            entropies.append(torch.distributions.Categorical(logits=probs).entropy()[0, -1].item())
        else:
            entropies.append(float("nan"))
        embeds = compute_hash_embeddings(ids[:, :p + 1], blt.local_encoder, blt.encoder_hash_tok_embedding,
                                         cfg.encoder_hash_byte_group_nb_functions, cfg.encoder_hash_byte_group_size,
                                         cfg.encoder_hash_byte_group_vocab)[:, -1:]
        enc = blt.local_encoder
        eh = _run_stack(enc.layers, enc.rotary_emb, embeds, p, caches["encoder_config"], window["encoder_config"])
        open_rows.append(eh)
        if bp.ends_patch(p, entropies[max(p - boundary_shift, 0)], len(open_rows), facts):
            rows = torch.cat(open_rows, 1)
            k = cfg.cross_attn_k
            pooled = enc.patch_embedding_projection(rows.amax(1, keepdim=True)).reshape(1, k, -1)
            cross = enc.cross_attn_layers[len(enc.cross_attn_layers) - 1]
            pooled = pooled + cross(hidden_states=pooled, cross_attention_states=rows)[0]
            glob = blt.global_transformer
            g = glob.token_embedding_projection(pooled.reshape(1, 1, -1))
            cache = caches["global_config"] if global_cached else DynamicCache()
            latest = _run_stack(glob.layers, glob.rotary_emb, g, patches if global_cached else 0, cache, None)
            patches, open_rows = patches + 1, []
        dec = blt.local_decoder
        kv = dec.patch_embedding_projection(latest).reshape(1, cfg.cross_attn_k, -1)
        h, emb = eh, dec.rotary_emb(eh, torch.tensor([[p]]))
        for i, layer in enumerate(dec.layers):
            if i == 0 or dec.config.cross_attn_all_layers:
                h = h + dec.cross_attn_layers[i](hidden_states=h, cross_attention_states=kv)[0]
            h = layer(h, position_embeddings=emb, attention_mask=_window_mask(p, window["decoder_config"]),
                      cache=caches["decoder_config"])
        logits.append(model.lm_head(dec.norm(h))[0])
    return torch.cat(logits), caches


@pytest.mark.parametrize("extra", [{}, {"max_patch_length": 2}, {"patching_mode": "static"}])
def test_the_planned_caches_reproduce_the_full_forward_byte_by_byte(extra):
    """The plan is sufficient: BLT stepped one byte at a time on the planned caches gives transformers' full-forward
    logits at every position (a float64 model, within 1e-6: transformers casts its logits to float32), each byte-rate
    cache holding a row per byte and the global one a row per patch; with max_patch_length a patch also ends at that
    many bytes (process_patch_lengths); without entropy patching every byte is a patch and no patcher is cached.
    Negative controls (entropy patching): the patch boundary read one byte late, and the global transformer rerun
    uncached over the step's patch as transformers' cached path does, both leave the full forward."""
    _, model = _tiny(0.0)
    ids = torch.randint(0, 260, (1, 14))
    with torch.no_grad():
        entropy = model.model.patcher(ids, patch_size=4, threshold=0.0)[0][0, 1:]
    cfg, model = _tiny(_between(entropy), **extra)
    facts = bp.read_facts(cfg.to_dict(), "blt.json")
    with torch.no_grad():
        full = model(ids, use_cache=False).logits[0]
        got, caches = _planned_decode(model, facts, ids)
    # With max_patch_length, process_patch_lengths drops the zero-length patch that marks a boundary at the sequence's
    # last byte, so transformers' logits there read as if the sequence went on without that boundary: only that
    # position's; every earlier one is the causal model a decode reproduces (and a validation compares)
    upto = -1 if "max_patch_length" in extra else None
    assert (got[:upto] - full[:upto]).abs().max().item() < 1e-6
    rows = {name: {layer.keys.shape[2] for layer in cache.layers} for name, cache in caches.items()}
    if not facts.entropy_patching:
        assert rows == {"encoder_config": {14}, "decoder_config": {14}, "global_config": {14}}, rows
        return
    with torch.no_grad():
        lengths = model.model.patcher(ids, patch_size=4, threshold=cfg.patching_threshold,
                                      max_patch_length=cfg.max_patch_length)[1][0]
        late, _ = _planned_decode(model, facts, ids, boundary_shift=1)
        rerun, _ = _planned_decode(model, facts, ids, global_cached=False)
    patches = int((lengths > 0).sum())
    assert rows == {"patcher_config": {14}, "encoder_config": {14}, "decoder_config": {14},
                    "global_config": {patches}} and 1 < patches < 14, (rows, lengths)
    scale = full.abs().max().item()
    assert (late - full).abs().max().item() > scale / 100
    assert (rerun - full).abs().max().item() > scale / 100
