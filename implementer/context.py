"""Manifest -> the small, typed context the templates see (never the raw dict).

Everything that reaches generated code passes through here: names are checked identifiers,
numbers come from typed manifest fields, strings are rendered with ``repr``.
"""

from __future__ import annotations

import keyword
from dataclasses import dataclass

from analyzer.errors import InputError
from analyzer.manifest import LayerPlan, SelectionManifest
from analyzer.version import __version__

DEFAULT_API = "G2"
NO_LIMIT = 2147483647

_TORCH_DTYPE = {"bfloat16": "torch.bfloat16", "float16": "torch.float16", "float32": "torch.float32",
                "int8": "torch.int8"}


def check_identifier(value: str, flag: str) -> str:
    if not value.isidentifier() or keyword.iskeyword(value) or not value.isascii():
        raise InputError(flag, f"{value!r} is not a valid Python identifier")
    return value


@dataclass(frozen=True)
class Names:
    attention_mixin: str = "KVCacheAttentionMixin"
    model_mixin: str = "KVCacheModelMixin"
    runner_mixin: str = "KVCacheRunnerMixin"
    attn_attr: str = "self_attn"

    def checked(self) -> Names:
        for flag, value in (("--attention-class", self.attention_mixin), ("--model-class", self.model_mixin),
                            ("--runner-class", self.runner_mixin), ("--attn-attr", self.attn_attr)):
            check_identifier(value, flag)
        return self


@dataclass(frozen=True)
class FaArgs:
    """Keyword names of one FA version: the only place the v1/v2 naming lives for the templates."""

    op: str
    scale: str
    num_heads: str
    q_lens: str
    kv_lens: str


FA_ARGS = {
    "v1": FaArgs("npu_fused_infer_attention_score", "scale", "num_heads", "actual_seq_lengths",
                 "actual_seq_lengths_kv"),
    "v2": FaArgs("npu_fused_infer_attention_score_v2", "softmax_scale", "num_query_heads", "actual_seq_qlen",
                 "actual_seq_kvlen"),
}


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
    window_derivation: str | None

    @property
    def same_paths(self) -> bool:
        return self.prefill == self.decode

    @property
    def pre_tokens_offset(self) -> int:
        """W - pre_tokens of the band: 1 under the 'exclusive' reading, 0 under 'inclusive'."""
        band = self.prefill if self.prefill.sparse_mode == 4 else self.decode
        return int(self.window - band.pre_tokens)


@dataclass(frozen=True)
class CacheCtx:
    name: str
    dim: int
    num_head: int


@dataclass(frozen=True)
class RenderContext:
    version: str
    manifest_hash: str
    model_type: str
    deploy_mode: str
    kv_mode: str
    api: str
    api_defaulted: bool
    fa: FaArgs
    fa_version: str
    layout: str
    scale: float
    scale_derivation: str
    block_size: int
    num_heads_per_rank: int
    num_kv_heads_per_rank: int
    head_dim: int
    attn_tp_size: int
    is_mla: bool
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
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

    @property
    def full(self) -> KindPlan | None:
        return next((k for k in self.kinds if k.attn_type == "FullAttention"), None)

    @property
    def sliding(self) -> KindPlan | None:
        return next((k for k in self.kinds if k.attn_type == "SlidingWindow"), None)

    @property
    def g2(self) -> bool:
        return self.api == "G2"

    @property
    def scale_literal(self) -> str:
        return repr(float(self.scale))

    @property
    def standalone_mode(self) -> int:
        """1: contiguous list of (k, v); 2: paged with a static arange table; 3: MLA latent on mode 2."""
        if self.kv_mode == "legacy":
            return 1
        return 3 if self.is_mla else 2


def _path(layer: LayerPlan, prefill: bool) -> PathPlan:
    mode = layer.sparse_mode.prefill if prefill else layer.sparse_mode.decode
    mask = (layer.mask.prefill if prefill else layer.mask.decode) != "none"
    return PathPlan(mode, mask, layer.pre_tokens if mode == 4 else NO_LIMIT, layer.next_tokens if mode == 4 else 0)


def build_context(m: SelectionManifest, names: Names, api_override: str | None = None) -> RenderContext:
    if not m.layers:
        raise InputError("--manifest", "manifest has no layers", field="layers")
    kinds: dict[str, KindPlan] = {}
    for layer in m.layers:
        plan = KindPlan(layer.attn_type, layer.sliding_window, _path(layer, True), _path(layer, False),
                        layer.window_derivation)
        seen = kinds.setdefault(layer.attn_type, plan)
        if seen != plan:
            raise InputError("--manifest", f"layer {layer.index}: {layer.attn_type} layers disagree on their "
                                           "window/sparse plan; the renderer needs one plan per attn_type",
                             field=f"layers[{layer.index}]")
    caches = {tuple(c for c in layer.caches) for layer in m.layers}
    if len(caches) != 1:
        raise InputError("--manifest", "layers declare different cache entries", field="layers[].caches")
    first = m.layers[0]
    api = api_override or m.framework_api or DEFAULT_API
    if api_override and m.framework_api and api_override != m.framework_api:
        raise InputError("--framework-api", f"{api_override} contradicts the manifest's {m.framework_api}")
    mla = m.model.mla
    return RenderContext(
        version=__version__,
        manifest_hash=m.content_hash(),
        model_type=m.model.model_type,
        deploy_mode=m.deploy_mode.value,
        kv_mode=m.kv_mode.value,
        api=api,
        api_defaulted=m.framework_api is None and api_override is None,
        fa=FA_ARGS[m.fa.version],
        fa_version=m.fa.version,
        layout=m.fa.input_layout,
        scale=float(m.fa.softmax_scale),
        scale_derivation=m.fa.scale_derivation,
        block_size=int(m.block_size),
        num_heads_per_rank=int(m.parallel.num_q_heads_per_rank),
        num_kv_heads_per_rank=int(m.parallel.num_kv_heads_per_rank),
        head_dim=int(m.model.head_dim),
        attn_tp_size=int(m.parallel.attn_tp_size),
        is_mla=m.mla.enabled,
        kv_lora_rank=mla.kv_lora_rank if mla else 0,
        qk_rope_head_dim=mla.qk_rope_head_dim if mla else 0,
        qk_nope_head_dim=mla.qk_nope_head_dim if mla else 0,
        v_head_dim=mla.v_head_dim if mla else 0,
        has_sinks=m.model.has_sinks,
        mixed=m.mixed_attn_types,
        kinds=tuple(kinds.values()),
        sliding_layers=tuple(layer.index for layer in m.layers if layer.attn_type == "SlidingWindow"),
        caches=tuple(CacheCtx(c.name, int(c.dim), int(c.num_head)) for c in first.caches),
        cache_dtype=_TORCH_DTYPE[first.caches[0].dtype],
        num_layers=len(m.layers),
        sublayers=int(m.model.sublayers_per_layer),
        mtp_layers=int(m.model.num_mtp_layers),
        names=names.checked(),
    )
