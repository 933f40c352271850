"""Manifest -> the small, typed context the templates see (never the raw dict).

Everything that reaches generated code passes through here: names are checked identifiers that
shadow nothing, numbers come from typed and range-checked manifest fields, free text (derivations)
is flattened to one printable line for comments, and designs no template renders faithfully are
refused with the manifest field that says why.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from dataclasses import field as dataclass_field

from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.framework_checkout import DEFAULT_RENDER_CONTRACT, render_api
from model_infer_kvcache.analyzer.kv_cache_spec import is_windowed, manager_attn_type
from model_infer_kvcache.analyzer.manifest import LayerPlan, SelectionManifest
from model_infer_kvcache.analyzer.operators.fa_facts import (
    BAND_MODE,
    COMPRESSED_MASK_MODES,
    FA_KEYWORDS,
    INT32_MAX,
    SPARSE_FA,
    SPARSE_MODES,
    FaKeywords,
    SparseFaCall,
)
from model_infer_kvcache.analyzer.rules import VALID_BLOCK_SIZES
from model_infer_kvcache.analyzer.version import __version__
from model_infer_kvcache.implementer.header import design_line, generated_line
from model_infer_kvcache.implementer.kinds import attention_kind, check_unrendered, kinds_of
from model_infer_kvcache.implementer.kinds import gqa as gqa_kind
from model_infer_kvcache.implementer.kinds import loops as loops_kind
from model_infer_kvcache.implementer.kinds import recurrent as recurrent_kind
from model_infer_kvcache.implementer.kinds.common import TORCH_DTYPE
from model_infer_kvcache.implementer.kinds.common import bad as _bad
from model_infer_kvcache.implementer.kinds.cross import CrossCtx
from model_infer_kvcache.implementer.kinds.loops import LoopCtx
from model_infer_kvcache.implementer.kinds.recurrent import LinearCtx
from model_infer_kvcache.implementer.names import RESERVED_NAMES, Names, check_identifier  # noqa: F401 - re-exported

DEFAULT_API = DEFAULT_RENDER_CONTRACT
_MODEL_TYPE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def one_line(text: str) -> str:
    """Free text from the manifest made safe for a ``#`` comment or a table cell: one printable line."""
    return " ".join("".join(ch if ch.isprintable() else " " for ch in text).split())


@dataclass(frozen=True)
class PathPlan:
    """sparse_mode / mask / band of one layer kind on one path."""

    sparse_mode: int
    mask: bool
    pre_tokens: int
    next_tokens: int


@dataclass(frozen=True)
class KindPlan:
    attn_type: str
    window: int | None
    prefill: PathPlan
    decode: PathPlan
    # the why, not the plan: a layer planned full because its window covers the context (Olmo3Config's defaults) and
    # a full layer share one plan
    window_derivation: str | None = dataclass_field(compare=False)
    # Decode steps with q_len = 1 + next_n (MTP verify), when they need another plan than q_len 1.
    verify: PathPlan | None = None

    @property
    def same_paths(self) -> bool:
        return self.prefill == self.decode and self.verify is None

    @property
    def pre_tokens_offset(self) -> int:
        """W - pre_tokens of the band: 1 under the 'exclusive' reading, 0 under 'inclusive'."""
        band = self.prefill if self.prefill.sparse_mode == BAND_MODE else self.decode
        return int(self.window - band.pre_tokens)


@dataclass(frozen=True)
class CacheCtx:
    name: str
    dim: int
    num_head: int
    dim_constant: str  # the rendered constant its width is (its kind's CACHE_CONSTANTS)
    heads_constant: str  # per-token heads: "1" for the latent / rope / indexer caches, the KV heads for k/v


@dataclass(frozen=True)
class RenderContext:
    version: str
    manifest_hash: str
    model_type: str
    deploy_mode: str
    kv_mode: str
    api: str  # the model-side contract the code follows (render_api of the generation: G3 renders G2's)
    api_defaulted: bool
    generation: str  # the framework generation named (the manifest's or --framework-api), G0..G3
    fa: FaKeywords
    fa_version: str
    layout: str
    scale: float
    scale_derivation: str
    block_size: int
    num_heads_per_rank: int
    num_kv_heads_per_rank: int
    head_dim: int
    attn_tp_size: int
    has_sinks: bool
    mixed: bool
    kinds: tuple[KindPlan, ...]
    sliding_layers: tuple[int, ...]
    caches: tuple[CacheCtx, ...]
    cache_dtype: str
    num_layers: int
    sublayers: int
    mtp_layers: int
    names: Names
    # MLA (implementer/kinds/mla.py): False/0 for other attention kinds
    is_mla: bool = False
    mla_rope: bool = True  # False: position-free MLA (mla.rope), the rope part written and attended unrotated
    latent_scale: str | None = None  # the module attribute the MLA writer scales its gamma by (mla.latent_scale)
    kv_lora_rank: int = 0
    rope_norm: bool = False  # mla.rope_norm: k_rot normalized (k_rope_only_layernorm) before the writer
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    paged_standalone_mode: int = 2  # the standalone runner's paged mode: 2 (K/V, static arange table), MLA's 3
    # DSA (manifest.dsa): the indexer's selection width, heads (all on every rank), head dim and RoPE layout
    is_dsa: bool = False
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_rope: str = ""
    # QSA (manifest.qsa, implementer/kinds/qsa.py): tokens per pooled block and blocks kept per query (its indexer
    # heads and head dim in index_n_heads / index_head_dim)
    # DiffLlama's differential attention (manifest differential): K/V halves of half_kv_heads, FA calls of
    # half_q_heads
    is_diff: bool = False
    half_kv_heads: int = 0
    half_q_heads: int = 0
    is_qsa: bool = False
    qsa_ratio: int = 0
    index_rope_dim: int = 0
    qsa_block_topk: int = 0
    # DeepSeek-V4 compressed attention (implementer/kinds/compressed.py): the HCA layers and their rate
    is_compressed: bool = False
    hca_layers: tuple[int, ...] = ()
    hca_ratio: int = 0
    csa_layers: tuple[int, ...] = ()  # CSA layers (and their rate): the indexer's top-k over compressed entries
    csa_ratio: int = 0
    sparse_width: int = 0  # npu_sparse_attn_sharedkv's cmp_sparse_indices width (K2)
    rope_head_dim: int = 0
    rms_norm_eps: float = 0.0
    cmp_state_dtype: str = ""
    state_ring: dict[str, int] | None = None  # the standalone runner's compressor state ring per branch (csa / hca)
    # False: a pure state stack (every layer a Mamba mixer): the state partial alone, no attention mixin or KV cache
    attends: bool = True
    # decoder blocks without any cache (Nemotron-H's MLP / MoE blocks): get_cache_info registers nothing for them
    no_cache_blocks: tuple[int, ...] = ()
    # Hybrid models (manifest.linear_attention): the gated-delta-net state mixin; None without linear layers.
    linear: LinearCtx | None = None
    # Encoder-decoder models (manifest.cross_attention): the cross-attention slots; None for a decoder-only model.
    cross: CrossCtx | None = None
    # A section run several times per forward, a cache per loop (manifest.recurrent_loops, Dory); None: each once.
    loops: LoopCtx | None = None
    # Legacy only: "fa" (one BSH FA call) or "model" (the model's own eager attention); "" on the paged path.
    legacy_kernel: str = ""
    softcap: float | None = None  # attn_logit_softcapping the model attention applies (kernel "model")
    # exe_mode npugraph_ex: the captured decode passes FA the engine's host lists (fa_lengths), prefill the tensors
    graph_lists: bool = False
    # any graph mode: the standalone runner pads decode to its batch and keeps a null block (captured shapes)
    graph_padding: bool = False
    # the module the paged FA call is reached through: torch_npu, or fa_ops()'s pick (ge_graph: torchair.ops on decode)
    fa_module: str = "torch_npu"
    # the paged FA call's (query, KV) length values: the metadata tensors, or fa_lengths()'s pick under npugraph_ex
    fa_lengths: tuple[str, str] = ("forward_metadata.actual_seq_lengths_cu_q", "forward_metadata.actual_seq_lengths_kv")
    # chunked local attention (implementer/kinds/chunked.py): the chunk C (0: none), its layers and their plan
    chunk_size: int = 0
    chunked_layers: tuple[int, ...] = ()
    chunked: KindPlan | None = None
    # cross-layer KV sharing (layers[i].kv_source_layer): (shared layer, the layer whose cache it reads); () none
    kv_sources: tuple[tuple[int, int], ...] = ()
    # per-layer attention shapes (implementer/kinds/gqa.py): (layer, head_dim, KV heads per rank) of each layer whose
    # shape differs from HEAD_DIM / NUM_KV_HEADS_PER_RANK; () when every layer has the model's
    layer_shapes: tuple[tuple[int, int, int], ...] = ()
    # value heads narrower than key heads (implementer/kinds/gqa.py): the V cache's width, 0 when it is HEAD_DIM
    v_head_dim: int = 0
    # the decoder layers whose FA calls pass learnable sinks when only some keep them (model.sink_layers); None: all
    sink_layers: tuple[int, ...] | None = None

    def own(self, constant: str, obj: str) -> str:
        """How the code at ``obj`` (``self`` in the attention mixin, ``attn`` in the runner) reads a layer's value of
        ``constant``: the module constant, or with per-layer shapes the attribute init_kv_cache set for its layer."""
        if self.layer_shapes and constant in gqa_kind.LAYER_SHAPE_ATTRS:
            return f"{obj}.{gqa_kind.LAYER_SHAPE_ATTRS[constant]}"
        return constant

    @property
    def full(self) -> KindPlan | None:
        return next((k for k in self.kinds if not is_windowed(k.attn_type)), None)

    @property
    def sliding(self) -> KindPlan | None:
        return next((k for k in self.kinds if is_windowed(k.attn_type)), None)

    @property
    def generated_line(self) -> str:
        return generated_line(self.version, self.manifest_hash)

    @property
    def design_line(self) -> str:
        return design_line(self.model_type, self.deploy_mode, self.api, self.kv_mode, self.fa_version, self.layout)

    @property
    def spec_decode(self) -> bool:
        """MTP layers on a paged cache: decode steps may verify 1 + next_n tokens per request."""
        return self.mtp_layers > 0 and self.kv_mode == "paged"

    @property
    def sparse_fa(self) -> SparseFaCall:
        """DSA's attention call (the sparse FA over the indexer's selection): its operator, layouts and mode."""
        return SPARSE_FA

    @property
    def g2(self) -> bool:
        return self.api == "G2"

    @property
    def scale_literal(self) -> str:
        return repr(float(self.scale))

    @property
    def softcap_literal(self) -> str:
        return repr(float(self.softcap)) if self.softcap is not None else "None"

    @property
    def standalone_mode(self) -> int:
        """1: contiguous list of (k, v); 2: paged with a static arange table; 3: MLA latent on mode 2."""
        return 1 if self.kv_mode == "legacy" else self.paged_standalone_mode


def _path(layer: LayerPlan, prefill: bool) -> PathPlan:
    name = "prefill" if prefill else "decode"
    mode = layer.sparse_mode.prefill if prefill else layer.sparse_mode.decode
    mask = (layer.mask.prefill if prefill else layer.mask.decode) != "none"
    where = f"layers[{layer.index}]"
    if mode not in SPARSE_MODES:
        raise _bad(f"{where}.sparse_mode.{name}", f"sparse_mode {mode} is not one of {SPARSE_MODES}")
    if mode in COMPRESSED_MASK_MODES and not mask:
        raise _bad(f"{where}.mask.{name}", f"sparse_mode {mode} needs the 2048x2048 causal mask, the manifest "
                                           "says none")
    if mode == BAND_MODE:
        if layer.sliding_window is None or not 0 <= layer.pre_tokens <= layer.sliding_window:
            raise _bad(f"{where}.pre_tokens", f"band pre_tokens {layer.pre_tokens} must lie in "
                                              f"[0, sliding_window {layer.sliding_window}]")
        if layer.next_tokens < 0:
            raise _bad(f"{where}.next_tokens", f"next_tokens {layer.next_tokens} must be >= 0")
        return PathPlan(mode, mask, layer.pre_tokens, layer.next_tokens)
    return PathPlan(mode, mask, INT32_MAX, 0)


def _verify_path(m: SelectionManifest, layer: LayerPlan, decode: PathPlan) -> PathPlan | None:
    """Plan of a speculative-decode verify step (q_len = 1 + next_n) when it differs from q_len 1.

    The manifest's ``mtp`` decision covers non-sliding layers (a sliding band is causal at any
    q_len); only the paged templates decode several query tokens per request.
    """
    if m.mtp is None or m.kv_mode.value != "paged" or layer.is_sliding:
        return None
    mode, mask = m.mtp.decode_sparse_mode, m.mtp.decode_mask != "none"
    if mode not in SPARSE_MODES or mode == BAND_MODE:
        raise _bad("mtp.decode_sparse_mode", f"sparse_mode {mode} is not one of {SPARSE_MODES[:4]}")
    if mode in COMPRESSED_MASK_MODES and not mask:
        raise _bad("mtp.decode_mask", f"sparse_mode {mode} needs the 2048x2048 causal mask, the manifest says none")
    plan = PathPlan(mode, mask, INT32_MAX, 0)
    return None if plan == decode else plan


def _check_layers(m: SelectionManifest) -> None:
    """Refuse manifests the templates cannot render faithfully, naming the layers and why."""
    if not m.layers:
        raise _bad("layers", "manifest has no layers")
    kinds = kinds_of(m)
    for kind in kinds[1:]:  # the recurrent state first, as before the attention kinds' own checks
        kind.check_layers(m)
    # a KV-shared layer holds none on purpose: it reads its source layer's (manifest invariants check the source)
    uncached = [layer for layer in m.layers if not layer.caches and not layer.is_state and layer.kv_source_layer is None]
    if uncached:
        kinds = sorted({layer.layer_kind for layer in uncached})
        raise _bad(f"layers[{uncached[0].index}].caches",
                   f"{len(uncached)} layer(s) ({', '.join(kinds)}: e.g. linear attention / recurrent state) hold no "
                   "KV cache; the templates render attention KV caches only, so this model is outside the "
                   "standard path (see the manifest's blockers)")
    check_unrendered(m)
    kinds[0].check_layers(m)
    attention = [layer for layer in m.layers if not layer.is_state and layer.kv_source_layer is None]
    if not attention:  # a pure state stack (Mamba, Mamba2): the state partial alone
        return
    # a layer with its own shape (layers[i].head_dim / num_kv_heads_per_rank) is rendered per layer: its entries match
    # the others' in names and dtypes, their dims and heads are its own (the manifest invariants tie them to it)
    shaped = {layer.index for layer in attention if layer.head_dim is not None or layer.num_kv_heads_per_rank is not None}
    first = next((layer for layer in attention if layer.index not in shaped), attention[0])

    def entries(layer) -> list:
        if layer.index not in shaped:
            return layer.caches
        return [c.model_copy(update={"dim": d.dim, "num_head": d.num_head}) for c, d in
                zip(layer.caches, first.caches, strict=False)] + layer.caches[len(first.caches):]

    for layer in attention:
        if entries(layer) != first.caches:
            raise _bad(f"layers[{layer.index}].caches",
                       f"cache entries {[c.name for c in layer.caches]} differ from layer {first.index}'s "
                       f"{[c.name for c in first.caches]} (names, dims, heads or dtypes); the templates give every "
                       "layer the same entries")
    own_key = getattr(kinds[0], "GROUP_KEY", None)  # a kind whose manager is keyed by its entry (V4's win_kv)
    for layer in m.layers:
        if layer.group_key != (own_key or manager_attn_type(layer.attn_type)):
            raise _bad(f"layers[{layer.index}].group_key",
                       f"group key {layer.group_key!r} differs from the manager of attn_type {layer.attn_type!r} "
                       f"({manager_attn_type(layer.attn_type)!r}); the rendered code indexes block_table/slot_mapping "
                       "by the attn_type it registers (no manager_key support)")
        if layer.is_sliding and not layer.sliding_window:
            raise _bad(f"layers[{layer.index}].sliding_window", "a SlidingWindow layer needs a positive window")
    kind = kinds[0]
    names = tuple(c.name for c in first.caches)
    if m.kv_mode.value == "paged" and names != kind.CACHE_NAMES:
        raise _bad(f"layers[{first.index}].caches", f"cache names {list(names)} must be {list(kind.CACHE_NAMES)} "
                                                    f"for {kind.NAME} paged caches")
    if m.kv_mode.value == "legacy" and ("legacy" not in kind.LAYOUTS or names != kind.CACHE_NAMES):
        raise _bad(f"layers[{first.index}].caches", "the Legacy template renders GQA/MHA k_cache/v_cache only")
    for i, c in enumerate(first.caches):
        if c.dim <= 0 or c.num_head <= 0:
            raise _bad(f"layers[{first.index}].caches[{i}]", f"dim {c.dim} and num_head {c.num_head} must be > 0")


def _check_numbers(m: SelectionManifest) -> None:
    kind = attention_kind(m)
    layouts = kind.LAYOUTS.get(m.kv_mode.value, ())
    if m.fa.input_layout not in layouts:
        raise _bad("fa.input_layout", f"{m.fa.input_layout!r} is not rendered for this design "
                                      f"(supported: {', '.join(layouts) or 'none'})")
    if not (math.isfinite(m.fa.softmax_scale) and m.fa.softmax_scale > 0):
        raise _bad("fa.softmax_scale", f"{m.fa.softmax_scale} must be a finite positive number")
    if m.kv_mode.value == "paged" and m.block_size not in VALID_BLOCK_SIZES:
        raise _bad("block_size", f"{m.block_size} is not one of {VALID_BLOCK_SIZES}")
    counts = {"parallel.num_q_heads_per_rank": m.parallel.num_q_heads_per_rank,
              "parallel.num_kv_heads_per_rank": m.parallel.num_kv_heads_per_rank,
              "parallel.attn_tp_size": m.parallel.attn_tp_size, "model.head_dim": m.model.head_dim,
              "model.sublayers_per_layer": m.model.sublayers_per_layer}
    if not m.attention_layers:  # a pure state stack: no attention heads to count
        counts = {k: v for k, v in counts.items() if k in ("parallel.attn_tp_size", "model.sublayers_per_layer")}
    for field, value in counts.items():
        if value <= 0:
            raise _bad(field, f"{value} must be > 0")
    if m.attention_layers:
        kind.check(m)
    if not _MODEL_TYPE.fullmatch(m.model.model_type):
        raise _bad("model.model_type", f"{m.model.model_type!r} is not a plain model type ([A-Za-z0-9_.-])")


def _legacy_kernel(m: SelectionManifest) -> tuple[str, float | None]:
    """(kernel, softcap) of a Legacy manifest; refuses what no Legacy template renders faithfully."""
    if m.kv_mode.value != "legacy":
        return "", None
    legacy = m.legacy_attention
    if legacy is None:
        if m.blockers:  # a manifest written before the decision: FA would silently drop what blocks it
            raise _bad("legacy_attention", "a blocked Legacy manifest without legacy_attention (written by an older "
                                           "kvcache): re-run kvcache analyze so it says how the model attends")
        return "fa", None
    if legacy.alibi:
        raise _bad("legacy_attention.alibi", "the model adds an ALiBi bias, whose convention is the family's own "
                                             "(Falcon scales it with the scores, BLOOM does not): no template renders "
                                             "it (an FA call would drop it); keep the model's own attention forward "
                                             "over a contiguous cache written at kv_len by hand")
    if legacy.kernel == "fa" and legacy.softcap is not None:
        raise _bad("legacy_attention.kernel", "an FA call cannot apply the soft-cap: the kernel must be 'model'")
    return legacy.kernel, legacy.softcap


def _cache_constants(m: SelectionManifest) -> dict[str, tuple[str, str]]:
    """(width constant, heads constant) of each cache entry: the kind's, with its manifest-dependent ones (a GQA V
    cache narrower than its K cache: V_HEAD_DIM)."""
    kind = attention_kind(m)
    return kind.cache_constants(m) if hasattr(kind, "cache_constants") else kind.CACHE_CONSTANTS


def _graph_mode(m: SelectionManifest) -> str | None:
    return None if m.exe_mode is None or m.exe_mode.value == "eager" else m.exe_mode.value


def _graph_lists(m: SelectionManifest) -> bool:
    return _graph_mode(m) == "npugraph_ex"


def build_context(m: SelectionManifest, names: Names, api_override: str | None = None) -> RenderContext:
    _check_layers(m)
    _check_numbers(m)
    legacy_kernel, softcap = _legacy_kernel(m)
    kinds: dict[str, KindPlan] = {}
    chunked: dict[str, KindPlan] = {}  # the chunked layers' plan: their own calls (implementer/kinds/chunked.py)
    attention = [layer for layer in m.layers if not layer.is_state]  # linear layers: the state mixin
    for layer in attention:
        decode = _path(layer, False)
        plan = KindPlan(layer.attn_type, layer.sliding_window, _path(layer, True), decode,
                        one_line(layer.window_derivation) if layer.window_derivation else None,
                        _verify_path(m, layer, decode))
        seen = (chunked if layer.is_chunked else kinds).setdefault(layer.attn_type, plan)
        if seen != plan:
            raise _bad(f"layers[{layer.index}]", f"{layer.attn_type} layers disagree on their window/sparse plan; "
                                                 "the renderer needs one plan per attn_type")
    chunked_plan = next(iter(chunked.values()), None)
    if not kinds:  # every attention layer chunked: the shared paged call takes their plan
        kinds = dict(chunked)
    # None: a pure state stack, no KV cache entry; a KV-shared layer holds none, so the first one that caches
    # (a layer with its own shape is rendered per layer: the constants are the model's shape, an unshaped layer's)
    first = next((layer for layer in attention if layer.caches and layer.head_dim is None
                  and layer.num_kv_heads_per_rank is None),
                 next((layer for layer in attention if layer.caches), attention[0])) if attention else None
    generation = api_override or m.framework_api or DEFAULT_API
    # G3 frameworks take G2 renders: an override naming the manifest's render contract is no contradiction.
    if api_override and m.framework_api and render_api(api_override) != render_api(m.framework_api):
        raise InputError("--framework-api", f"{api_override} contradicts the manifest's {m.framework_api}")
    kind_fields = {name: value for kind in kinds_of(m) for name, value in kind.fields(m).items()}
    return RenderContext(
        version=__version__,
        manifest_hash=m.content_hash(),
        model_type=m.model.model_type,
        deploy_mode=m.deploy_mode.value,
        kv_mode=m.kv_mode.value,
        api=render_api(generation),
        api_defaulted=m.framework_api is None and api_override is None,
        generation=generation,
        fa=FA_KEYWORDS[m.fa.version],
        fa_version=m.fa.version,
        layout=m.fa.input_layout,
        scale=float(m.fa.softmax_scale),
        scale_derivation=one_line(m.fa.scale_derivation),
        block_size=int(m.block_size),
        num_heads_per_rank=int(m.parallel.num_q_heads_per_rank),
        num_kv_heads_per_rank=int(m.parallel.num_kv_heads_per_rank),
        head_dim=int(m.model.head_dim),
        attn_tp_size=int(m.parallel.attn_tp_size),
        has_sinks=m.model.has_sinks,
        mixed=len(kinds) > 1,
        kinds=tuple(sorted(kinds.values(), key=lambda k: k.attn_type)),
        # the index each sliding attention module's init_kv_cache receives (its decoder layer's in a parallel hybrid)
        sliding_layers=tuple(m.module_index(layer) for layer in m.layers if layer.is_sliding),
        caches=tuple(CacheCtx(c.name, int(c.dim), int(c.num_head), *_cache_constants(m)[c.name])
                     for c in first.caches) if first else (),
        cache_dtype=TORCH_DTYPE[first.caches[0].dtype] if first else "None",
        attends=first is not None,
        no_cache_blocks=tuple(b.decoder_layer for b in m.no_cache_layers or ()),
        **loops_kind.fields(m),
        num_layers=len(m.layers),
        sublayers=int(m.model.sublayers_per_layer),
        mtp_layers=int(m.model.num_mtp_layers),
        names=recurrent_kind.attention_attr_names(m, names).checked(),
        legacy_kernel=legacy_kernel,
        softcap=softcap,
        graph_lists=_graph_lists(m),
        graph_padding=_graph_mode(m) is not None,
        **({"fa_lengths": ("q_lens", "kv_lens")} if _graph_lists(m) else {}),
        **({"fa_module": "fa_ops(forward_metadata)"} if _graph_mode(m) == "ge_graph" else {}),
        **({"chunked": chunked_plan} if chunked_plan else {}),
        kv_sources=tuple((layer.index, layer.kv_source_layer) for layer in attention
                         if layer.kv_source_layer is not None),
        **kind_fields,
    )
