"""BLT (Byte Latent Transformer, transformers ``BltForCausalLM``), analyzer side: its four stacks, the cache layout
transformers gives them, the paged plan a kvcache port needs, and why kvcache refuses it today.

What transformers 5.25 runs (models/blt/modeling_blt.py), per forward over a chunk of bytes:

1. the entropy patcher (``BltPatcher``, patcher_config: P causal layers, sliding window patcher_config.sliding_window)
   runs over the chunk's bytes and cuts patches: byte 0 is a patch, and a patch ends at byte p >= 1 when the
   patcher's next-byte entropy at p exceeds ``patching_threshold`` (``patch_lengths_from_entropies``);
2. the local encoder (``BltLocalEncoder``, encoder_config: E layers) over the bytes, causal with the window
   ``local_attention_window_len``; its cross-attention (patch rows query the patch's own bytes) pools each patch;
3. the global transformer (``BltGlobalTransformer``, global_config: G layers) causal over the patches;
4. the local decoder (``BltLocalDecoder``, decoder_config: D layers) over the bytes with the encoder's window mask;
   before each layer (cross_attn_all_layers) byte p cross-attends the ``cross_attn_k`` rows of the latest patch
   that ended at or before p (``_patch_ids_from_lengths(patch_lengths[:, 1:])``).

The cache transformers keeps (``BltModel.forward``): ``EncoderDecoderCache(self_attention_cache,
cross_attention_cache)``, two DynamicCaches numbered separately. ``self_attention_cache`` holds the local encoder's
layers at indices 0..E-1; ``cross_attention_cache``, despite its name, holds the local decoder's causal
self-attention at indices 0..D-1. Both grow one row per byte. The patcher (called without a cache), the global
transformer (``cache=None``, positions 0.. over the forward's own patches) and every cross-attention module keep
nothing: a cached decode step reruns them over that step's byte alone, so transformers' cached decode is not its own
model (tests/test_blt_layout.py, a tiny float64 model: max |diff| 4.7 against its full forward, whose logits reach
3.6). It does not even build that cache itself: ``DynamicCache(config=BltConfig)`` raises
AttributeError (no num_hidden_layers), so ``use_cache=True`` and ``generate()`` fail; only a caller-built
EncoderDecoderCache runs. The full forward is causal (each prefix's logits equal the whole sequence's), so a paged
port can match it, caching what transformers recomputes: ``cache_plan`` (the stacks' layers, transformers' cache order
first) with the patch boundary of ``ends_patch``. Stepped byte by byte on those caches (the test's reference) the model
gives transformers' full-forward logits within 1.2e-7 (the float32 cast of its logits); a boundary read one byte late
leaves it by 1.4, the global stack rerun uncached by 1.0.

The plan runs on CPU: validators/pipeline/byte_patch_run.py steps every stack on its paged pool through the emulated
scatter and FA calls (the global stack a row per completed patch, at the boundary ``ends_patch`` decides), keeps the
per-request states (the open patch's encoder rows, the decoder's cross K/V slot of the latest patch) and matches
transformers' full forward (V117 / V234 / V309 / V310 / V408). ``kvcache analyze`` writes the manifest around the
``byte_patches`` section (each stack's FA shape, scale and band, and the layers it plans:
analyzer/kinds/byte_patch_section.py), checked first against transformers' modules: the architecture cross-check's
meta build joins the four stacks in cache order (``stacks_of``), each module agreeing with its planned layer
(``module_problems``). ``kvcache render`` writes it (implementer/kinds/byte_patches.py) and ``kvcache run`` drives
that render in place of the host's attention in both deploy modes (V108 / V201 beside those). A route that reads one
decoder stack refuses a BLT config naming the plan (``refusal``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from model_infer_kvcache.analyzer import kv_cache_spec
from model_infer_kvcache.analyzer.errors import InputError, NotSupportedByKvcache

SOURCE = "transformers models/blt/modeling_blt.py BltModel.forward"
# transformers' cache containers (EncoderDecoderCache attributes) and which stack each one holds
SELF_CACHE, CROSS_CACHE = "self_attention_cache", "cross_attention_cache"
# the rate a planned cache layer grows at: a row per byte, or a row per completed patch
PER_BYTE, PER_PATCH = "byte", "patch"


@dataclass(frozen=True)
class Stack:
    """One of BLT's stacks: its config section, transformers' module path, what it attends over and with which
    window field (None: full causal)."""

    section: str
    module: str
    over: str  # PER_BYTE or PER_PATCH: the rows of its attention, hence of its cache
    window_field: str | None
    container: str | None  # transformers' cache holding it, None: transformers caches it nowhere


# In the order a forward runs them (modeling_blt.py BltModel.forward). The encoder's and decoder's window is the top
# level's local_attention_window_len (BltConfig.__post_init__ copies it to encoder_config.sliding_window; the decoder
# gets the encoder's mask); the patcher's is its own sliding_window (BltPatcher.forward's mask_function).
STACKS = (
    Stack("patcher_config", "model.patcher", PER_BYTE, "patcher_config.sliding_window", None),
    Stack("encoder_config", "model.local_encoder", PER_BYTE, "local_attention_window_len", SELF_CACHE),
    Stack("global_config", "model.global_transformer", PER_PATCH, None, None),
    Stack("decoder_config", "model.local_decoder", PER_BYTE, "local_attention_window_len", CROSS_CACHE),
)


@dataclass(frozen=True)
class StackFacts:
    stack: Stack
    layers: int
    heads: int
    kv_heads: int
    head_dim: int  # BltSelfAttention: hidden_size // num_attention_heads
    window: int | None

    @property
    def attn_type(self) -> str:
        """The framework kind of the stack's layers: a windowed stack attends through FA's band."""
        return kv_cache_spec.SLIDING_WINDOW if self.window else kv_cache_spec.FULL_ATTENTION

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5  # BltSelfAttention.scaling


@dataclass(frozen=True)
class CacheLayer:
    """One planned cache layer: its stack, the layer within the stack, and transformers' (container, index) where
    transformers caches it."""

    index: int
    stack: StackFacts
    layer: int
    transformers_slot: tuple[str, int] | None

    @property
    def path(self) -> str:
        return f"{self.stack.stack.module}.layers.{self.layer}.self_attn"


@dataclass(frozen=True)
class BytePatchFacts:
    stacks: tuple[StackFacts, ...]
    threshold: float | None
    max_patch_length: int | None
    cross_attn_k: int
    decoder_cross_layers: int  # decoder cross-attention modules (cross_attn_all_layers: one per layer, else 1)
    encoder_cross_layers: int
    # patches cut by the patcher's entropy (patching_mode "entropy" with patch_in_forward); False: every byte is a
    # patch of its own and no patcher is built (BltModel.forward's process_patch_lengths of ones)
    entropy_patching: bool = True

    def of(self, section: str) -> StackFacts:
        return next(s for s in self.stacks if s.stack.section == section)


def is_blt(cfg: dict[str, Any]) -> bool:
    """A BLT config: the four sub-model sections its stacks read (BltConfig.sub_configs_defaults)."""
    return all(isinstance(cfg.get(s.section), dict) for s in STACKS)


def _int(cfg: dict[str, Any], where: str, field: str, *, default: int | None = None) -> int:
    value = cfg.get(field.rsplit(".", 1)[-1])
    value = default if value is None else value  # null: the config class's own default (num_key_value_heads: heads)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InputError(where, f"must be a positive integer, got {value!r}", field=field)
    return value


def _window(cfg: dict[str, Any], where: str, field: str) -> int | None:
    section, _, name = field.rpartition(".")
    holder = cfg[section] if section else cfg
    if name not in holder:  # BltConfig.to_dict writes it (null: full causal); absent, the class default would apply
        raise InputError(where, "missing: the window transformers applies to this stack; null means full causal",
                         field=field)
    value = holder[name]
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InputError(where, f"must be a positive integer or null, got {value!r}", field=field)
    return value


def read_facts(cfg: dict[str, Any], where: str) -> BytePatchFacts:
    """The four stacks' attention shapes and windows, each field named where it is bad."""
    stacks = []
    for stack in STACKS:
        sub, name = cfg[stack.section], stack.section
        heads = _int(sub, where, f"{name}.num_attention_heads")
        kv_heads = _int(sub, where, f"{name}.num_key_value_heads", default=heads)  # __post_init__: or heads
        hidden = _int(sub, where, f"{name}.hidden_size")
        if hidden % heads or heads % kv_heads:
            raise InputError(where, f"hidden_size {hidden} / num_attention_heads {heads} / num_key_value_heads "
                                    f"{kv_heads} do not divide (BltSelfAttention sizes its heads by them)",
                             field=f"{name}.num_attention_heads")
        window = _window(cfg, where, stack.window_field) if stack.window_field else None
        stacks.append(StackFacts(stack, _int(sub, where, f"{name}.num_hidden_layers"), heads, kv_heads,
                                 hidden // heads, window))
    threshold = cfg.get("patching_threshold")
    max_len = cfg.get("max_patch_length")
    enc, dec = cfg["encoder_config"], cfg["decoder_config"]
    e, d = stacks[1].layers, stacks[3].layers
    return BytePatchFacts(tuple(stacks), threshold if isinstance(threshold, (int, float)) else None,
                          max_len if isinstance(max_len, int) else None,
                          _int(cfg, where, "cross_attn_k", default=2),
                          d if dec.get("cross_attn_all_layers", True) else 1,
                          e if enc.get("cross_attn_all_layers", False) else 1,
                          cfg.get("patching_mode", "entropy") == "entropy" and cfg.get("patch_in_forward", True)
                          is not False)


def ends_patch(position: int, entropy: float, open_bytes: int, facts: BytePatchFacts) -> bool:
    """Whether byte ``position`` closes the open patch (``open_bytes`` bytes, this one included), read as transformers
    cuts patches over a whole sequence: byte 0 is a patch of its own; byte p >= 1 ends one when the patcher's entropy
    at p exceeds patching_threshold (``patch_lengths_from_entropies``: a patch starts at t when entropy[t - 1] does);
    with max_patch_length, a patch also ends at that many bytes (``process_patch_lengths`` splits longer ones). The
    global stack writes its row, and the decoder's cross-attention switches to it, at that byte."""
    if position == 0 or not facts.entropy_patching:
        return True
    if facts.max_patch_length is not None and open_bytes >= facts.max_patch_length:
        return True
    # an entropy tensor compares in its own dtype (the threshold cast to it), as patch_lengths_from_entropies does
    return facts.threshold is not None and bool(entropy > facts.threshold)


def cache_plan(facts: BytePatchFacts) -> list[CacheLayer]:
    """The cache layers a paged port keeps, in cache index order: transformers' own first, in its numbering
    (self_attention_cache's encoder layers 0..E-1, then cross_attention_cache's decoder layers 0..D-1, offset by E),
    then the stacks transformers reruns each forward and a port must cache to match the full forward: the patcher's
    layers (a row per byte), then the global transformer's (a row per completed patch)."""
    # without entropy patching transformers builds no patcher (BltModel: self.patcher = None): nothing to cache
    stacks = [s for s in facts.stacks if facts.entropy_patching or s.stack.section != "patcher_config"]
    ordered = sorted(stacks, key=lambda s: (s.stack.container is None, s.stack.container != SELF_CACHE,
                                                  s.stack.over == PER_PATCH))
    out: list[CacheLayer] = []
    for s in ordered:
        for i in range(s.layers):
            slot = (s.stack.container, i) if s.stack.container else None
            out.append(CacheLayer(len(out), s, i, slot))
    return out


def stacks_of(section: dict[str, Any]) -> tuple[str, ...] | None:
    """The ModuleLists whose joined layers are the planned cache layers of a BLT config, in cache index order
    (``cache_plan``), for the architecture cross-check's meta build (hf_layout.find_decoder_stack: else it finds
    one stack, the global transformer's); None for any other config, or one the facts reader refuses by name."""
    if not is_blt(section):
        return None
    try:
        plan = cache_plan(read_facts(section, "config"))
    except InputError:
        return None
    return tuple(f"{layer.stack.stack.module.removeprefix('model.')}.layers"
                 for layer in plan if layer.layer == 0)


def transformers_layout(facts: BytePatchFacts) -> list[tuple[str, int, str, int, int]]:
    """What transformers' EncoderDecoderCache holds after a forward: (container, index, module path, KV heads,
    head_dim) for each planned layer transformers caches. The cross-check (tests/test_blt_layout.py) compares it with
    a real forward's caches."""
    return [(*layer.transformers_slot, layer.path, layer.stack.kv_heads, layer.stack.head_dim)
            for layer in cache_plan(facts) if layer.transformers_slot is not None]


def layout_problems(facts: BytePatchFacts, observed: dict[str, list[tuple[int, int]]]) -> list[str]:
    """Where the planned transformers layout disagrees with the caches a forward left (container -> (KV heads,
    head_dim) at each index): one line per disagreement, naming the container and index."""
    out = []
    planned = transformers_layout(facts)
    for container in sorted({c for c, *_ in planned} | set(observed)):
        mine = sorted((index, rest) for c, index, *rest in planned if c == container)
        got = observed.get(container, [])
        if [index for index, _ in mine] != list(range(len(got))):
            out.append(f"{container}: analyzer places layer(s) at indices {[index for index, _ in mine]}, "
                       f"transformers' forward fills {len(got)} from index 0")
            continue
        for (_, (path, kv, dim)), shape in zip(mine, got, strict=True):
            if tuple(shape) != (kv, dim):
                out.append(f"{container} ({path}): planned (KV heads, head_dim) {(kv, dim)}, transformers "
                           f"holds {tuple(shape)}")
    return out


def module_problems(facts: BytePatchFacts, attentions) -> list[str]:
    """Where the planned cache layers disagree with transformers' attention modules as the architecture
    cross-check's meta build reports them (arch_check.HfAttention, joined in cache order by ``stacks_of``): the
    count, and per layer the scale, (key head_dim, KV heads, value head_dim) and query heads. Windows are not
    compared: BltModel.forward builds the decoder's mask from the encoder's window, which no decoder module holds."""
    plan = cache_plan(facts)
    if len(attentions) != len(plan):
        return [f"transformers' modules give {len(attentions)} attention layer(s), the plan {len(plan)}"]
    out = []
    for layer, hf in zip(plan, attentions, strict=True):
        s = layer.stack
        got = (hf.scale[0] if hf.scale else None, hf.kv_shape, dict(hf.kind_facts).get("query_heads"))
        want = (s.scale, (s.head_dim, s.kv_heads, s.head_dim), s.heads)
        if got[1:] != want[1:] or got[0] is None or abs(got[0] - want[0]) > 1e-12 * want[0]:
            out.append(f"cache layer {layer.index} ({layer.path}): planned (scale, K/V shape, query heads) {want}, "
                       f"transformers' {hf.path} {got}")
    return out


def _stack_text(layer_count: int, s: StackFacts, where: str) -> str:
    window = f"window {s.window}" if s.window else "full causal"
    return (f"{s.stack.section.removesuffix('_config')} {layer_count} x {s.kv_heads} KV heads x {s.head_dim} "
            f"({window}, a row per {s.stack.over}; {where})")


def refusal(facts: BytePatchFacts, where: str) -> NotSupportedByKvcache:
    """What a route reading one decoder stack (the normalized ModelFacts: a checkout's model run, the lint) says of
    a BLT config: its plan is four stacks, which `kvcache analyze` writes as the byte_patches section and `kvcache
    run` validates byte by byte; this route has none of them."""
    plan = cache_plan(facts)
    parts = []
    for s in dict.fromkeys(layer.stack for layer in plan):  # in cache index order
        mine = [layer.index for layer in plan if layer.stack is s]
        slot = (f"transformers' {s.stack.container} 0..{s.layers - 1}" if s.stack.container
                else "transformers reruns it uncached each forward")
        parts.append(_stack_text(s.layers, s, f"cache layers {mine[0]}..{mine[-1]}, {slot}"))
    return NotSupportedByKvcache(
        where, f"BLT's stacks need caches of their own ({'; '.join(parts)}), planned by `kvcache analyze` as the "
               "manifest's byte_patches section (analyzer/kinds/byte_patch_section.py) and validated by `kvcache run` "
               "(validators/pipeline/byte_patch_run.py); this route reads one decoder stack, which BLT does not have "
               f"({SOURCE})", field="global_config")
