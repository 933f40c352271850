"""Cross-attention slots of an encoder-decoder model's decoder: one slot per request holding its encoder K/V, written
at its prefill and read by every step with no mask (manifest cross_attention; analyzer/kinds/cross.py)."""

from __future__ import annotations

import torch
from model_infer_kvcache.analyzer.kinds import cross as cross_kind
from model_infer_kvcache.analyzer.kv_cache_spec import CROSS_ATTENTION, MAMBA

NAMES = (cross_kind.KEY, cross_kind.VALUE, cross_kind.LENGTH)
CALLS_CHECK = ("cross-attention reads each request's encoder K/V unmasked (sparse_mode 0, KV length = its encoder "
               "length)")


def expected_constants(manifest) -> dict[str, object]:
    x = manifest.cross_attention
    if x is None:
        return {}
    return {"CROSS_MAX_ENCODER_LEN": x.max_encoder_len, "CROSS_BLOCK_SIZE": x.slot_block_size,
            "CROSS_SLOT_TOKENS": x.slot_tokens, "CROSS_NUM_KV_HEADS_PER_RANK": x.num_kv_heads_per_rank,
            "CROSS_HEAD_DIM": x.head_dim}


def split_entries(got: dict) -> tuple[dict, dict]:
    """(self-attention entries, cross-attention slot entries) of one layer's LayerCacheInfo."""
    return ({k: v for k, v in got.items() if k not in NAMES}, {k: v for k, v in got.items() if k in NAMES})


def split_layer_infos(manifest, infos: list) -> tuple[list, list]:
    """(the self-attention and state layers' infos, the cross-attention-only blocks' infos): a cross-only block
    (manifest cross_attention.self_attention false, Mllama) registers its slot entries as a cache layer of their own;
    an encoder-decoder's decoder has none (its slots ride in its self-attention's info)."""
    x = manifest.cross_attention
    if x is None or x.self_attention:
        return infos, []
    alone = [i for i in infos if i.caches and all(e.cache_name in NAMES for e in i.caches)]
    return [i for i in infos if not any(i is a for a in alone)], alone


def only_blocks_within(manifest, decoder_layers: int) -> int:
    """How many cross-attention-only blocks (Mllama) a model of ``decoder_layers`` decoder blocks (a prefix of the
    planned model: the tiny model's, or a checkout's every block) holds, each a cache layer of its own."""
    x = manifest.cross_attention
    if x is None or x.self_attention:
        return 0
    return sum(1 for i in x.layers if i < decoder_layers)


def entry_problems(manifest, index: int, got: dict, cache_dtype: torch.dtype, alone: bool = False) -> list[str]:
    """A layer's cross slot entries against the manifest: its names, MambaCacheEntry in manager_key CrossAttention,
    the planned slot shape, the run's dtype (int32 for the length), block size 1, no speculative blocks. ``alone``:
    the info of a cross-attention-only block; a self-attention layer of such a manifest holds none."""
    x = manifest.cross_attention
    if x is None:
        return [f"layer {index}: cross-attention entries {sorted(got)} and the manifest plans none"] if got else []
    if not x.self_attention and not alone:
        return [f"layer {index}: cross-attention entries {sorted(got)} beside a self-attention, and the manifest "
                "plans cross-attention-only blocks (their own cache layers)"] if got else []
    want = {s.name: s for s in x.states}
    if set(got) != set(want):
        return [f"layer {index}: cross-attention entries {sorted(got)} != {sorted(want)}"]
    out = []
    for name, entry in got.items():
        have = (entry.attn_type, getattr(entry, "manager_key", None), list(getattr(entry, "shape", []) or []),
                entry.dtype, getattr(entry, "block_size", 1), int(getattr(entry, "next_n", 0) or 0))
        dtype = torch.int32 if want[name].dtype == "int32" else cache_dtype
        wanted = (MAMBA, CROSS_ATTENTION, list(want[name].shape), dtype, 1, 0)
        if have != wanted:
            out.append(f"layer {index} {name}: (attn_type, manager_key, shape, dtype, block_size, next_n) {have} != "
                       f"{wanted}")
    return out


def check_cross_calls(report, manifest, host) -> None:
    """Every cross-attention FA call: no mask, sparse_mode 0, and at a prefill the KV lengths the host's encoder
    states have (each request's own); at decode lengths within 1..max_encoder_len (the slot's stored length)."""
    if manifest.cross_attention is None:
        return
    calls = host.probe.cross_calls
    prefill_lens = getattr(host, "cross_prefill_lens", {})
    bad = []
    for call in calls:
        mode = call.get("sparse_mode", 0)
        kv = [int(n) for n in (call.get("kv_lens") or [])]
        if call["has_mask"] or mode != 0:
            bad.append(f"step {call['step']} layer {call['layer']}: atten_mask {'given' if call['has_mask'] else 'None'}"
                       f", sparse_mode {mode} (want None, 0)")
        elif call["step"] in prefill_lens and not _lens_match(kv, prefill_lens[call["step"]]):
            bad.append(f"step {call['step']} layer {call['layer']}: KV lengths {kv} != the requests' encoder lengths "
                       f"{_expected_lens(prefill_lens[call['step']])}")
        elif any(n < 1 or n > manifest.cross_attention.max_encoder_len for n in kv):  # padding rows: clamped too
            bad.append(f"step {call['step']} layer {call['layer']}: KV lengths {kv} outside 1.."
                       f"{manifest.cross_attention.max_encoder_len}")
    steps = {c["step"] for c in calls}
    want = len(steps) * len(host.cross_attentions)
    if len(calls) != want:
        bad.append(f"{len(calls)} cross-attention FA calls over {len(steps)} steps, want one per cross layer per step "
                   f"({want})")
    # Mllama's prefills: requests without an image, and with text rows before their image token (what they cover)
    vision = [r for lens in prefill_lens.values() if isinstance(lens, tuple) for r in zip(*lens, strict=True)]
    report.add(CALLS_CHECK, "runtime", bool(calls) and not bad, detail="; ".join(bad[:3]), calls=len(calls),
               **({"requests_without_image": sum(1 for r in vision if not r[1]),
                   "requests_with_rows_before_image": sum(1 for r in vision if r[1] and r[2])} if vision else {}))


def _expected_lens(lens) -> list[int | None]:
    """A prefill's FA KV lengths, one per FA sequence: an encoder-decoder's, each request's encoder length; Mllama's
    (HostModel.vision_step: rows given, valid vision lengths, image token rows), transformers' cross_attention_mask
    read per row (validators/pipeline/vision_rows.py): the rows before the image token over every row given, the rest
    over the image's valid length, a request without an image any length (None: its output is zeroed)."""
    if not isinstance(lens, tuple):
        return list(lens)
    out: list[int | None] = []
    for given, valid, start in zip(*lens, strict=True):
        out += [None] if not valid else ([given] if start else []) + [valid]
    return out


def _lens_match(kv: list[int], lens) -> bool:
    want = _expected_lens(lens)
    return len(kv) == len(want) and all(w is None or w == n for n, w in zip(kv, want, strict=True))


def tiny_prefix(manifest, n: int) -> tuple[int, str | None]:
    """The tiny model's decoder-layer prefix grown by one block when it ends at a cross-attention-only block (Mllama)
    and the model has a block after it: a self-attention layer then caches what the cross-attention wrote into the
    stream, instead of the cross output going straight to the head. (n, the note; None when unchanged)."""
    x = manifest.cross_attention
    if x is None or x.self_attention or (n - 1) not in x.layers or n >= manifest.model.num_layers:
        return n, None
    return n + 1, (f"block {n} kept after the cross-attention-only block {n - 1}: its self-attention caches the "
                   "stream the cross-attention wrote")


def tiny_cross_fields(d: dict, manifest, layers: int) -> None:
    """The tiny config of an encoder-decoder's decoder, in place: its own fields (BART family, Whisper, TrOCR name
    the decoder's stack ``decoder_layers`` / ``decoder_attention_heads`` / ``decoder_ffn_dim``; the generic names the
    tiny model writes map to the encoder's in their configs), shrunk like a decoder-only model's. A field map, not
    per-family code; a decoder-only manifest: nothing."""
    if manifest.cross_attention is None:
        return
    if not manifest.cross_attention.self_attention and "cross_attention_layers" in d:
        # Mllama: the cross-attention-only blocks the tiny prefix keeps (MllamaTextModel builds them by this list)
        d["cross_attention_layers"] = [i for i in manifest.cross_attention.layers if i < layers]
    sizes = {"decoder_layers": layers, "decoder_attention_heads": manifest.model.num_attention_heads,
             "decoder_ffn_dim": 128, "encoder_ffn_dim": 128, "encoder_layers": 1}
    for key, value in sizes.items():
        if key in d:
            d[key] = value


# Mllama's tanh gates on a cross-attention-only block's attention and MLP outputs (MllamaCrossAttentionDecoderLayer:
# cross_attn_attn_gate, cross_attn_mlp_gate), zero at init: a tiny model keeping them zero would never let the
# cross-attention reach the logits, so it draws them at random (tiny_model._randomize)
GATE_PARAMS = ("cross_attn_attn_gate", "cross_attn_mlp_gate")


# A CPU run of a Mllama manifest: the same tiles and patch size, CPU_IMAGE_PATCHES patches a side (MllamaConfig():
# 4 tiles x (8^2 + 1) = 260 vision positions, a slot of 3 blocks: the paged read still crosses block ends), where
# the published image (448 / 14: 4100 positions) would spend the run's time in the vision rows' k/v projections.
CPU_IMAGE_PATCHES = 8


def cpu_section(manifest, real: dict | None, heads: tuple[int, int] | None) -> dict | None:
    """The cross_attention section of a CPU-sized manifest (tiny_model.cpu_sized), None where it keeps its sizes:
    a cross-only (Mllama) plan at fewer heads (``heads``: query, KV) and at a smaller image of the same vision
    architecture (vision_config.image_size; the length by the analyzer's own rule). Every derived field is the
    analyzer's (analyzer.kinds.cross.resized)."""
    x = manifest.cross_attention
    if x is None or x.self_attention:
        return None
    changes = {"num_heads": heads[0], "num_kv_heads": heads[1]} if heads else {}
    vision = (real or {}).get("vision_config")
    if isinstance(vision, dict) and all(isinstance(vision.get(k), int) for k in cross_kind.VISION_FIELDS):
        image, patch, tiles = (vision[k] for k in cross_kind.VISION_FIELDS)
        small = min(image, CPU_IMAGE_PATCHES * patch)
        length, _ = cross_kind.vision_length(small, patch, tiles)
        if length < x.max_encoder_len:
            changes |= {"max_encoder_len": length, "max_encoder_len_source": (
                f"{x.max_encoder_len_source}; a CPU run at vision_config.image_size {small} (not {image}): "
                f"{length} vision positions")}
    return cross_kind.resized(x, manifest.parallel.attn_tp_size, **changes).model_dump(mode="json") \
        if changes else None


def cpu_size_changes(manifest, small) -> list[str]:
    """What cpu_section changed, for a report note."""
    x, y = manifest.cross_attention, small.cross_attention
    if x is None or y is None or x.max_encoder_len == y.max_encoder_len:
        return []
    return [f"vision length {x.max_encoder_len} -> {y.max_encoder_len} (a smaller image of the same tiles and patch "
            "size)"]

