"""Cross-attention, analyzer side: the decoder of an encoder-decoder model (BART, mBART, Marian, Pegasus,
BigBird-Pegasus, Blenderbot, PLBart, MVP, Whisper, TrOCR), whose decoder blocks attend over the encoder's states
beside their causal self-attention (transformers: ``<decoder layer>.encoder_attn``).

Each request brings its own encoder states. Their K/V (the decoder's ``k_proj`` / ``v_proj`` of
``encoder_hidden_states``) are computed once, at the request's prefill, and read by every later step with no causal
mask: they do not grow with the decoded sequence. kvcache keeps them in one slot per request (a fixed-size state,
like a Mamba block), sized by the longest encoder output the config allows; the self-attention keeps the normal paged
KV cache (its layers in the manifest's ``layers``). The group's block math is ``kv_cache_spec.CrossAttentionSpec``.

Here: the config facts (does the decoder attend over an encoder, how long an encoder output can be, and from which
field), the manifest section (``cross_attention``), its memory group, the blocker when the length is unknown, and
the comparison with transformers' cross-attention modules (analyzer.arch_check).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from model_infer_kvcache.analyzer import kv_cache_spec
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.manifest import CrossAttentionDecision, Finding, StateSpec

# Tokens of one FA block of a cross slot: the paged FA call takes a block size of 128..512 in steps of 128 when a
# query is longer than one token (the prefill; torch_npu npu_fused_infer_attention_score, block_size), so a slot is
# the maximum encoder length rounded up to whole 128-token blocks and read through a block table of its blocks.
CROSS_BLOCK_SIZE = 128
# transformers' attribute of a decoder block's cross-attention module, in every family this kind serves
MODULE_ATTR = "encoder_attn"
# the attribute names transformers gives a decoder block's attention over the encoder's states (the cross-check
# recognises all of them; the host and the render route MODULE_ATTR)
MODULE_NAMES = ("encoder_attn", "crossattention", "cross_attention", "encoder_attention", "cross_attn")
# Fields that give the longest encoder output a decoder attends over, first hit wins, with why that field is it.
# A field map, not per-family code: Whisper names its encoder's positions (the audio frames after the conv stem),
# the BART family (BART, mBART, Marian, Pegasus, BigBird-Pegasus, Blenderbot, PLBart, MVP) sizes the encoder's and
# the decoder's position tables by one max_position_embeddings (BartEncoder / BartDecoder: embed_positions).
ENCODER_LENGTH_FIELDS = (
    ("max_source_positions", "the encoder's position table (WhisperEncoder.embed_positions: the audio frames after "
                             "the conv stem)"),
    ("encoder_max_position_embeddings", "the encoder's position table"),
)
SHARED_POSITIONS = ("max_position_embeddings", "one position table size for the encoder and the decoder of an "
                                               "encoder-decoder config (BartEncoder and BartDecoder both size "
                                               "embed_positions by config.max_position_embeddings)")
# Cache entries of one cross-attention layer: the encoder K/V of a request, and how many encoder positions it holds.
KEY, VALUE, LENGTH = "cross_key", "cross_value", "cross_len"


@dataclass(frozen=True)
class CrossFacts:
    """A decoder whose blocks attend over encoder states: the longest encoder output (None: no field gives it)."""

    max_encoder_len: int | None
    length_source: str  # the field, or why none gives it
    source: str  # why the config is an encoder-decoder's decoder
    # Blocks whose only attention is over the other model's states (Mllama's cross_attention_layers), None: every
    # decoder layer holds one beside its causal self-attention (the BART family)
    only_layers: tuple[int, ...] | None = None
    num_kv_heads: int | None = None  # K/V heads of the cross module when it groups them (None: as many as queries)
    module_attr: str = MODULE_ATTR
    stated: bool = False  # max_encoder_len is the user's --encoder-length (else a config field or a derivation)


def read_facts(get: Callable[..., tuple[Any, str] | None], cfg: dict[str, Any], where: str = "",
               num_layers: int = 0) -> CrossFacts | None:
    """The cross-attention facts of a config (None: a decoder-only model). ``get`` is the config reader's lookup
    (first present, non-null field); ``cfg`` the model section, for keys whose presence alone says it (TrOCR keeps
    ``cross_attention_hidden_size`` null when the encoder is as wide as the decoder)."""
    if get("cross_attention_layers") is not None:
        return _only_layers_facts(get, where, num_layers)
    enc_dec = get("is_encoder_decoder")
    is_enc_dec = bool(enc_dec and enc_dec[0] is True)
    if is_enc_dec:
        source = f"{enc_dec[1]} true (an encoder-decoder config: its decoder blocks attend over the encoder)"
    elif "cross_attention_hidden_size" in cfg:
        source = ("cross_attention_hidden_size (a decoder built to attend over a separate encoder's states: "
                  "TrOCRDecoderLayer.encoder_attn, MusicgenDecoderLayer.encoder_attn over its text encoder's)")
    else:
        return None
    for name, why in ENCODER_LENGTH_FIELDS + ((SHARED_POSITIONS,) if is_enc_dec else ()):
        hit = get(name)
        if hit is not None and isinstance(hit[0], int) and not isinstance(hit[0], bool) and hit[0] > 0:
            return CrossFacts(hit[0], f"{hit[1]}: {why}", source)
    return CrossFacts(None, "no field of the config gives the encoder's output length (max_source_positions, "
                            "encoder_max_position_embeddings"
                            + (", max_position_embeddings" if is_enc_dec else "; its max_position_embeddings sizes "
                               "the decoder's own positions") + ")", source)


# Mllama: its cross_attention_states are the vision model's output, one row per patch (plus the class token) of every
# tile of every image: MllamaVisionModel.num_patches = (image_size // patch_size) ** 2 + 1, and MllamaModel.forward
# reshapes the vision output [batch, images, max_num_tiles, num_patches, hidden] to [batch, images x max_num_tiles x
# num_patches, hidden] (padding tiles included, masked by cross_attention_mask).
VISION_FIELDS = ("image_size", "patch_size", "max_num_tiles")
ONLY_MODULE_ATTR = "cross_attn"  # MllamaCrossAttentionDecoderLayer.cross_attn
ONLY_BLOCK = "cross_attention"  # a cross-attention-only block's name in no_cache_layers (no self-attention cache)


# How the slot of a cross-only block is read and what it does not cover, from transformers' modeling_mllama.py: said in
# the plan.
ONLY_LIMITS = ("; a request's slot holds every vision row its prefill gives (the padded reservation) and its length is "
               "its image's valid tiles x patches: rows at or after the image token read that prefix (transformers' "
               "cross_attention_mask hides the padding tiles), rows before it read every row given (their mask row "
               "is all zero, which _prepare_cross_attention_mask turns into no mask; their MLP output is zeroed by "
               "full_text_row_masked_out_mask, the render's cross_text_rows), a request without an image reads "
               "nothing (its rows' output 0: MllamaTextModel skips the cross blocks); not rendered: more than one "
               "image per request (each image's text rows read that image's own tiles, not a prefix)")


def vision_length(image_size: int, patch_size: int, max_num_tiles: int) -> tuple[int, int]:
    """(vision positions of one image, patches per tile): MllamaVisionModel.num_patches = (image_size //
    patch_size) ** 2 + 1 per tile, max_num_tiles tiles."""
    patches = (image_size // patch_size) ** 2 + 1
    return max_num_tiles * patches, patches


def _only_layers_facts(get, where: str, num_layers: int) -> CrossFacts:
    """Mllama's text decoder: the blocks listed in cross_attention_layers attend over the vision states only
    (MllamaTextModel.__init__ builds MllamaCrossAttentionDecoderLayer there, MllamaSelfAttentionDecoderLayer
    elsewhere). The slot is sized by one image's vision states (vision_config of the composite config); a text
    config alone gives no vision length: max_source_positions, when given, is that length, else a blocker."""
    raw, src = get("cross_attention_layers")
    if not isinstance(raw, list) or not raw or any(isinstance(i, bool) or not isinstance(i, int) for i in raw) \
            or len(set(raw)) != len(raw) or any(i < 0 or i >= num_layers for i in raw):
        raise InputError(where, f"must list distinct decoder layer indices in 0..{num_layers - 1}, got {raw!r}",
                         field=src)
    layers = tuple(sorted(raw))
    kv = get("num_key_value_heads")
    source = (f"{src} {list(layers)} (transformers MllamaTextModel: a MllamaCrossAttentionDecoderLayer there, whose "
              f"only attention ({ONLY_MODULE_ATTR}) is over cross_attention_states, the vision model's output)")
    kv_heads = kv[0] if kv and isinstance(kv[0], int) and not isinstance(kv[0], bool) and kv[0] > 0 else None
    common = {"source": source, "only_layers": layers, "num_kv_heads": kv_heads, "module_attr": ONLY_MODULE_ATTR}
    vision = get("vision_config")
    if vision is not None and isinstance(vision[0], dict):
        vals = {name: vision[0].get(name) for name in VISION_FIELDS}
        bad = [n for n, v in vals.items() if isinstance(v, bool) or not isinstance(v, int) or v <= 0]
        if bad:
            raise InputError(where, f"must be a positive integer, got {vals[bad[0]]!r} (it sizes the vision states "
                                    "the cross-attention layers read)", field=f"{vision[1]}.{bad[0]}")
        length, patches = vision_length(vals["image_size"], vals["patch_size"], vals["max_num_tiles"])
        return CrossFacts(length, f"{vision[1]}: max_num_tiles {vals['max_num_tiles']} x ((image_size "
                                  f"{vals['image_size']} // patch_size {vals['patch_size']})^2 + 1 = {patches} "
                                  f"patches per tile) = {length} vision positions of one image (MllamaVisionModel."
                                  "num_patches; MllamaModel.forward: images x tiles x patches per request); one "
                                  "image per request", **common)
    explicit = get("max_source_positions")
    if explicit is not None and isinstance(explicit[0], int) and not isinstance(explicit[0], bool) \
            and explicit[0] > 0:
        return CrossFacts(explicit[0], f"{explicit[1]}: the vision states' length, given explicitly", **common)
    return CrossFacts(None, "the text model's config gives no vision length (the composite MllamaConfig's "
                            "vision_config: image_size, patch_size, max_num_tiles; or max_source_positions)", **common)


# The user's statement of the encoder's longest output (`kvcache analyze` / `kvcache run`): the slot's size where no
# config field gives it (TrOCR's ViT patches, MusicGen's T5 text tokens: neither decoder config names them).
FLAG = "--encoder-length"
USER_INPUT, CONFIG = "user input", "config"  # the manifest's max_encoder_len_from


def check_length(n: int | None, most: int) -> None:
    """``--encoder-length``'s own validation, in every command that takes it (analyze, run, validate): a positive
    count of positions, at most ``most`` (config_loader.LIMITS: far beyond any encoder's output)."""
    if n is None:
        return
    if n <= 0:
        raise InputError(FLAG, f"must be a positive integer, got {n}")
    if n > most:
        raise InputError(FLAG, f"{n} positions: above {most}, far beyond any encoder's output")


def check_manifest_length(n: int | None, cross: CrossAttentionDecision | None, model_type: str) -> None:
    """``--encoder-length`` beside a manifest (validate): the length its cross-attention slot was analyzed with, as
    ``--next-n`` must be the manifest's depth; the slot is sized at analysis, so another length means re-analyzing."""
    if n is None:
        return
    if cross is None:
        raise InputError(FLAG, f"{n}: the decoder attends over no encoder (the manifest of {model_type!r} has no "
                               "cross_attention section to size); drop the flag")
    if n != cross.max_encoder_len:
        raise InputError(FLAG, f"{n} differs from the manifest's max_encoder_len {cross.max_encoder_len} "
                               f"({cross.max_encoder_len_from}: {cross.max_encoder_len_source}); re-analyze with "
                               f"{FLAG} {n}")


def with_stated_length(cross: CrossFacts | None, n: int | None, model_source: str) -> CrossFacts | None:
    """``cross`` sized by ``--encoder-length n`` (None: as read). The flag sizes a slot no field sizes, or widens one
    (a larger input than the config's, e.g. a ViT run on bigger images); below what the config gives it is refused:
    the encoder brings that many positions, and the render's slot write refuses a request longer than its slot."""
    if n is None:
        return cross
    if cross is None:
        raise InputError(FLAG, f"{n}: the decoder attends over no encoder ({model_source}: no cross-attention to "
                               "size); drop the flag")
    given = cross.max_encoder_len
    if given is not None and n < given:
        raise InputError(FLAG, f"{n} is below the {given} encoder positions the config gives ({cross.length_source}):"
                               f" a request bringing them would not fit the slot; pass at least {given} or drop it")
    why = "the encoder's longest output, stated by the user"
    if given is not None:
        why += f"; the config gives {given}: {cross.length_source}"
    return replace(cross, max_encoder_len=n, length_source=f"{FLAG} {n} ({USER_INPUT}: {why})", stated=True)


# A composite encoder-decoder config (transformers' VisionEncoderDecoderConfig: TrOCR checkpoints) holds its encoder's
# config beside the decoder's: a vision encoder sized by image_size outputs a fixed number of positions, which
# transformers' own encoder class says (ViT: the patches + the class token; DeiT: + a distillation token; Swin: the
# last stage's merged patches). Run on the meta device at that image size: no weights, no data.
ENCODER_SECTION = "encoder"


def composite_encoder(config: dict[str, Any] | None, where: str) -> tuple[dict[str, Any], int, list[int]] | None:
    """(encoder section, num_channels, [height, width]) of a composite config whose ``encoder`` section is a vision
    encoder sized by image_size; None for any other config. A malformed size is bad input naming its field."""
    enc = (config or {}).get(ENCODER_SECTION)
    if not isinstance(enc, dict) or not isinstance(enc.get("model_type"), str) or "image_size" not in enc:
        return None
    size, channels = enc["image_size"], enc.get("num_channels", 3)
    side = list(size) if isinstance(size, list | tuple) else [size, size]
    if len(side) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in [*side, channels]):
        raise InputError(where, f"must be a positive integer (or [height, width]) beside a positive num_channels, got "
                                f"image_size {size!r}, num_channels {channels!r} (they size the encoder output the "
                                "decoder's cross-attention reads)", field=f"{ENCODER_SECTION}.image_size")
    return enc, channels, side


# (encoder section, num_channels, [height, width]) -> (positions, transformers' encoder class) or (None, why not):
# transformers' own encoder run on the meta device (analyzer.arch_check.encoder_positions, cached like its reports)
EncoderRun = Callable[[dict[str, Any], int, list[int]], tuple[int | None, str]]


def with_composite_length(cross: CrossFacts | None, config: dict[str, Any] | None, where: str,
                          run: EncoderRun) -> CrossFacts | None:
    """``cross`` sized by its composite config's vision encoder where no field of the decoder's sizes it."""
    if cross is None or cross.max_encoder_len is not None:
        return cross
    found = composite_encoder(config, where)
    if found is None:
        return cross
    enc, channels, side = found
    length, what = run(enc, channels, side)
    size = f"{ENCODER_SECTION}.image_size {enc['image_size']} ({enc['model_type']})"
    if length is None:
        return replace(cross, length_source=f"{cross.length_source}; {size} gives no length: transformers could not "
                                            f"run that encoder on the meta device ({what})")
    return replace(cross, max_encoder_len=length, length_source=(
        f"{size}: transformers {what} on the meta device, pixel_values [1, {channels}, {side[0]}, {side[1]}] -> "
        f"last_hidden_state of {length} positions"))


def blocker(facts) -> Finding | None:
    """A decoder over an encoder whose output length no field gives: the slot cannot be sized."""
    cross = facts.cross.value
    if cross is None or cross.max_encoder_len is not None:
        return None
    if cross.only_layers is not None:
        return Finding(message=f"not supported by kvcache: {facts.model_type!r} blocks {list(cross.only_layers)} "
                               f"attend over vision states only ({cross.source}) and {cross.length_source}: the "
                               "cross-attention slot of a request cannot be sized; analyze the composite config "
                               f"(model_type mllama, with vision_config), pass {FLAG} N or add max_source_positions "
                               "(the vision states' length of one request)",
                       fields=[FLAG, "vision_config", "max_source_positions"])
    return Finding(message=f"not supported by kvcache: {facts.model_type!r} decoder blocks attend over an encoder's "
                           f"states ({cross.source}) and {cross.length_source}: the cross-attention slot of a request "
                           f"cannot be sized; pass {FLAG} N (the encoder's longest output: e.g. the image patches + 1 "
                           "of a ViT encoder, the text encoder's longest prompt in tokens), analyze the composite "
                           "config (its encoder section with image_size), or add max_source_positions to the config",
                   fields=[FLAG, "max_source_positions"])


def slot_tokens(max_encoder_len: int) -> int:
    return math.ceil(max_encoder_len / CROSS_BLOCK_SIZE) * CROSS_BLOCK_SIZE


def slot_bytes(states: list[StateSpec]) -> int:
    """One request's slot of one layer: its entries' bytes."""
    return sum(math.prod(s.shape) * (4 if s.dtype == "int32" else kv_cache_spec.DTYPE_BYTES[s.dtype]) for s in states)


def decide(facts, parallel, dtype: str | None) -> CrossAttentionDecision | None:
    """The cross-attention plan of an encoder-decoder model's decoder; None for a decoder-only model or one whose
    encoder length is unknown (a blocker says so)."""
    cross = facts.cross.value
    if cross is None or cross.max_encoder_len is None:
        return None
    heads = facts.num_attention_heads.value
    layers = list(cross.only_layers) if cross.only_layers is not None else list(range(facts.num_layers.value))
    return _decision(layers, cross.module_attr, cross.only_layers is None, cross.max_encoder_len, cross.length_source,
                     USER_INPUT if cross.stated else CONFIG, heads, cross.num_kv_heads or heads,
                     parallel.attn_tp_size, facts.head_dim.value, dtype or facts.dtype.value, cross.source)


def resized(x: CrossAttentionDecision, tp: int, **changes) -> CrossAttentionDecision:
    """The same plan with some of its sizes changed (``max_encoder_len`` with ``max_encoder_len_source``,
    ``num_heads``, ``num_kv_heads``), every derived field (slot, entries, bytes, wording) recomputed as ``decide``
    does: a CPU-sized validation of the same model (validators tiny_model.cpu_sized)."""
    v = {"max_encoder_len": x.max_encoder_len, "max_encoder_len_source": x.max_encoder_len_source,
         "num_heads": x.num_heads, "num_kv_heads": x.num_kv_heads} | changes
    return _decision(list(x.layers), x.module_attr, x.self_attention, v["max_encoder_len"],
                     v["max_encoder_len_source"], x.max_encoder_len_from, v["num_heads"], v["num_kv_heads"], tp,
                     x.head_dim, x.states[0].dtype, x.source)


def _decision(layers: list[int], module_attr: str, self_attention: bool, max_encoder_len: int, length_source: str,
              length_from: str, heads: int, kv_heads: int, tp: int, head_dim: int, dtype: str,
              source: str) -> CrossAttentionDecision:
    per_rank = max(kv_heads // tp, 1)
    tokens = slot_tokens(max_encoder_len)
    shape = [tokens, per_rank, head_dim]
    layout = (f"[encoder positions (max {max_encoder_len}, rounded up to {CROSS_BLOCK_SIZE}-token FA blocks), KV heads "
              "of this rank, head_dim]")
    states = [StateSpec(name=KEY, shape=shape, dtype=dtype, layout=layout),
              StateSpec(name=VALUE, shape=shape, dtype=dtype, layout=layout),
              StateSpec(name=LENGTH, shape=[1], dtype="int32", layout="[1]: the request's encoder length (the FA "
                                                                      "call's KV length)")]
    per_layer = slot_bytes(states)
    only = not self_attention
    return CrossAttentionDecision(
        layers=layers,
        module_attr=module_attr,
        self_attention=self_attention,
        max_encoder_len=max_encoder_len,
        max_encoder_len_source=length_source,
        max_encoder_len_from=length_from,
        num_heads=heads,
        num_kv_heads=kv_heads,
        num_kv_heads_per_rank=per_rank,
        head_dim=head_dim,
        slot_block_size=CROSS_BLOCK_SIZE,
        slot_tokens=tokens,
        states=states,
        slot_bytes_per_layer=per_layer,
        slot_bytes=per_layer * len(layers),
        framework_entry=(f"MambaCacheEntry(cache_name, dtype, shape, needs_block=True, manager_key="
                         f"'{kv_cache_spec.CROSS_ATTENTION}') per entry ({KEY}, {VALUE}, {LENGTH}) beside the layer's "
                         "self-attention entries: the Mamba manager keeps one slot per request in a pool of its own "
                         f"(block_table['{kv_cache_spec.CROSS_ATTENTION}'][row, 0]); frameworks from fda5670 on "
                         "(MambaCacheEntry) with manager_key (48a59dc0 on)"),
        fa=("prefill writes the request's encoder K/V into its slot, then prefill and decode read the slot through "
            f"the paged FA call (block_table = the slot's {tokens // CROSS_BLOCK_SIZE} "
            f"blocks of {CROSS_BLOCK_SIZE}, actual_seq_lengths_kv = the request's encoder length) with sparse_mode 0 "
            "and no atten_mask: every decoder position sees every encoder position (no causal mask)"
            + (ONLY_LIMITS if only else "")),
        source=source,
        reason=(f"{len(layers)} decoder layers attend over the request's encoder states (transformers "
                f"<decoder layer>.{module_attr}"
                + (", their only attention: no self-attention cache there" if only else "")
                + "): their K/V are computed once from "
                + ("cross_attention_states (the vision model's output)" if only
                   else "encoder_hidden_states") + " at the "
                "request's prefill and never change, so they are kept in one slot per request (a fixed reservation "
                f"of {max_encoder_len} encoder positions: {length_source}) and overwritten by the next "
                "request's prefill when the slot is reused; the self-attention keeps the paged cache"),
    )


def decision_row(m) -> tuple[str, str, str]:
    """progress.md's row of a manifest with cross-attention slots: the slot's size and where its length comes from
    (the user's --encoder-length is what the user confirms there)."""
    x = m.cross_attention
    origin = f"用户给出 {FLAG}" if x.max_encoder_len_from == USER_INPUT else "来自配置"
    return ("交叉注意力(每请求槽位)", f"{len(x.layers)} 层, 编码器最长 {x.max_encoder_len} 位置({origin}), 槽位 "
            f"{x.slot_tokens} 位置, 每请求 {x.slot_bytes} B", f"{x.max_encoder_len_source}; {x.reason}")


def memory_group(decision: CrossAttentionDecision) -> kv_cache_spec.CrossAttentionSpec:
    return kv_cache_spec.CrossAttentionSpec(kv_cache_spec.CROSS_ATTENTION, decision.slot_bytes, 0,
                                            len(decision.layers), slot_tokens=decision.slot_tokens)


def memory_note(decision: CrossAttentionDecision) -> str:
    return (f"{kv_cache_spec.CROSS_ATTENTION}: one slot per request = {len(decision.layers)} layers x "
            f"{decision.slot_bytes_per_layer} B (K and V of {decision.slot_tokens} encoder positions x "
            f"{decision.num_kv_heads_per_rank} heads x {decision.head_dim}, + the length) = {decision.slot_bytes} B, "
            "fixed (does not grow with the decoded sequence)")


def hf_problems(facts, cross_modules: list, scale: float) -> list[str]:
    """What transformers' cross-attention modules (analyzer.arch_check.HfAttention) say against the plan: one per
    decoder layer, each with the planned heads, head_dim and softmax scale. Empty when they agree."""
    cross = facts.cross.value
    n = facts.num_layers.value
    if cross is None:
        # the realistic analyzer mistake: the decoder's cross-attention ignored, planned decoder-only
        return [f"transformers' {facts.model_type!r} decoder blocks hold a cross-attention module beside their "
                f"self-attention ({cross_modules[0].cls} at {cross_modules[0].path}, {len(cross_modules)} layer(s)) "
                "and the analyzer plans none: the decoder of an encoder-decoder model, whose cross-attention over "
                "the encoder's states a decoder-only plan would leave out"]
    out = []
    if cross.only_layers is not None:
        n = len(cross.only_layers)
        built = sorted(int(mod.path.rsplit(".", 2)[-2]) for mod in cross_modules if mod.path.rsplit(".", 2)[-2].isdigit())
        if built != list(cross.only_layers):
            out.append(f"cross-attention-only blocks: analyzer plans {list(cross.only_layers)} ({cross.source}), "
                       f"transformers builds {built}")
    if len(cross_modules) != n:
        out.append(f"cross-attention layers: analyzer plans {n}, transformers builds {len(cross_modules)}")
    want = (facts.head_dim.value, cross.num_kv_heads or facts.num_attention_heads.value)
    for mod in cross_modules:
        if mod.kv_shape is not None and mod.kv_shape[:2] != want:
            out.append(f"{mod.path}: cross-attention K/V (head_dim, heads) {mod.kv_shape[:2]} != planned {want}")
            break
        if mod.scale is not None and not math.isclose(mod.scale[0], scale, rel_tol=1e-9):
            out.append(f"{mod.path}: cross-attention scale {mod.scale[0]!r} ({mod.scale[1]}) != planned {scale!r}")
            break
    return out
