"""The SelectionManifest: the versioned contract between analyzer, implementer, validators and agents.

Every field an agent or another tool reads lives here. Breaking changes bump ``SCHEMA_VERSION``;
the JSON Schema exported from these models is committed under ``references/``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Annotated, ClassVar, Literal

from model_infer_kvcache.analyzer import kinds
from model_infer_kvcache.analyzer.device_questions import DEPENDENCY_QUESTIONS, OP_BACKENDS, UNKNOWN
from model_infer_kvcache.analyzer.framework_checkout import RENDER_APIS
from model_infer_kvcache.analyzer.kinds import INDEXER_KEY_CACHE  # noqa: F401  (the manifest's entry name, re-exported)
from model_infer_kvcache.analyzer.kinds import loops as loops_kind
from model_infer_kvcache.analyzer.kinds.invariants import RECURRENT_SIZES
from model_infer_kvcache.analyzer.kv_cache_spec import (
    ATTENTION_ATTN_TYPES,
    GROUP_ATTN_TYPES,
    PLANNED_ATTN_TYPES,
    STATE_ATTN_TYPES,
    holds_state,
    is_chunked,
    is_windowed,
    layer_kind_is_chunked,
    manager_attn_type,
    spec_for_layer_kind,
)
from model_infer_kvcache.analyzer.linear_config import LINEAR_FAMILIES
from model_infer_kvcache.analyzer.operators.fa_facts import INT32_MAX
from model_infer_kvcache.analyzer.vocabulary import DEPLOY_MODES, FA_VERSIONS, KV_MODES, PLANNED_CACHE_DTYPES
from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

SCHEMA_VERSION = "2.0"

AttnType = Literal[PLANNED_ATTN_TYPES]
LayerKind = Literal["full", "sliding", "chunked", "linear"]
DeployMode = Literal[DEPLOY_MODES]
DeploySource = Literal["dispatch", "user", "self_check", "default"]
FrameworkApi = Literal[RENDER_APIS]
KvMode = Literal[KV_MODES]
FaVersion = Literal[FA_VERSIONS]
MaskKind = Literal["causal_2048", "none"]
WriteOp = Literal["npu_scatter_nd_update_", "npu_kv_rmsnorm_rope_cache", "scatter_update_"]
CacheDtype = Literal["bfloat16", "float16", "float32", "int8"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _without_unset(data, *names: str):
    """``data`` (a serialized model) without the named keys whose value is None: fields added after schema 1.0
    stay out of the JSON while unset, so existing manifests keep their bytes and hash."""
    if isinstance(data, dict):
        for name in names:
            if name in data and data[name] is None:
                del data[name]
    return data


class Finding(_Model):
    """An open question, warning or blocker: one message and the input field(s) it concerns."""

    message: str
    fields: list[str] = Field(default_factory=list, description="config/progress/CLI fields involved")


class MlaDims(_Model):
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


class RopeInfo(_Model):
    rope_type: str = Field(description="'default' when the config has no scaling")
    factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    original_max_position_embeddings: int | None = None


class ModelInfo(_Model):
    model_type: str
    family: str = Field(description="code family the model follows, e.g. kimi_k2 -> deepseek_v3")
    attention_kind: Literal["mha", "gqa", "mqa", "mla", "hybrid"]
    architectures: list[str] = Field(default_factory=list)
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    qk_head_dim: int = Field(description="query/key head dim used by the score (MLA: nope + rope)")
    dtype: CacheDtype
    vocab_size: int | None = None
    max_position_embeddings: int | None = None
    rms_norm_eps: float | None = None
    mla: MlaDims | None = None
    rope: RopeInfo
    has_sinks: bool = False
    num_mtp_layers: int = 0
    sublayers_per_layer: int = 1
    sources: dict[str, str] = Field(
        default_factory=dict, description="normalized fact -> config field it came from, or 'default: ...'"
    )
    v_head_dim: int | None = Field(default=None, description="the value heads' dim where it differs from head_dim "
                                                             "(MiMo-V2-Flash: 128 beside 192): the V cache's width")
    sink_layers: list[int] | None = Field(default=None, description="the decoder layers whose attention keeps "
                                                                    "learnable sinks when only some do (has_sinks); "
                                                                    "absent: every attention layer")

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler):
        """Written only where set: other manifests keep their bytes and hash."""
        return _without_unset(handler(self), "v_head_dim", "sink_layers")

    def v_head_dim_at(self, layer_head_dim: int | None = None) -> int:
        return self.v_head_dim or layer_head_dim or self.head_dim

    def has_sinks_at(self, decoder_layer: int) -> bool:
        return self.has_sinks and (self.sink_layers is None or decoder_layer in self.sink_layers)


class Evidence(_Model):
    value: str
    source: DeploySource
    detail: str


class DeployModeDecision(_Model):
    value: DeployMode
    source: DeploySource
    evidence: list[str] = Field(default_factory=list)
    overridden: list[Evidence] = Field(
        default_factory=list, description="lower-priority or conflicting sources that lost"
    )


class KvModeDecision(_Model):
    value: KvMode
    reason: str
    evidence: list[str] = Field(default_factory=list)


class FaDecision(_Model):
    version: FaVersion
    input_layout: str
    softmax_scale: float
    scale_derivation: str
    reason: str
    is_default: bool = Field(description="True when the version is no requirement (the family default, or the "
                                         "version the --framework-root checkout's model already calls)")


class MlaDecision(_Model):
    enabled: bool
    absorb: bool
    cache_mode: Literal["PA_NZ", "PA"] | None = None
    rope: bool = Field(default=True, description="the qk_rope_head_dim part of queries and keys is rotated by "
                                                 "position; False: position-free MLA (Kimi-Linear), that part is "
                                                 "cached and attended unrotated")
    latent_scale: str | None = Field(default=None, description="the attention module's attribute that scales the "
                                                               "normalised latent (LongCat-Flash: mla_scale_kv_lora, "
                                                               "Dots3-Note: kv_lora_scale): "
                                                               "the fused writer's gamma is kv_a_layernorm.weight x "
                                                               "it; absent: no scale")
    reason: str
    constraints: list[str] = Field(
        default_factory=list, description="what the absorb FA call and the fused writer require (MLA only)"
    )
    rope_norm: bool | None = Field(
        default=None, description="k_rot RMS-normalized by the module's k_rope_only_layernorm before the writer's "
                                  "RoPE (Dots3-Note); absent: not normalized")

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler):
        """The latent transforms are written only for a family that has them: other manifests keep their bytes."""
        return _without_unset(handler(self), "latent_scale", "rope_norm")


class MtpDecision(_Model):
    """MTP (next-n) layers: extra cache holders, and decode steps with q_len > 1 when speculation is on."""

    num_layers: int
    next_n: int | None = Field(default=None, description="speculative tokens per verify step (the framework's "
                                                         "next_n) where not one per MTP layer (--next-n: the MTP "
                                                         "worker runs its layers next_n times); None: num_layers")
    holds_caches: bool
    decode_sparse_mode: int = Field(description="sparse_mode of non-sliding layers when decode q_len > 1")
    decode_mask: MaskKind
    reason: str

    @property
    def speculative_tokens(self) -> int:
        """The framework's next_n: tokens drafted per step, each verified in one q_len = 1 + next_n step."""
        return self.num_layers if self.next_n is None else self.next_n

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler):
        """``next_n`` written only where it is not one per MTP layer: other manifests keep their bytes and hash."""
        return _without_unset(handler(self), "next_n")


class ExecModeDecision(_Model):
    """The framework's execution mode for decode (``model_config.exe_mode``) and what it asks of the decode step.

    Written only when stated (``--exe-mode`` or progress.md): a manifest without it is eager."""

    value: Literal["eager", "npugraph_ex", "ge_graph"]
    source: str = Field(description="where it was stated: --exe-mode or progress.md:line")
    consequences: list[str] = Field(default_factory=list, description="what a captured decode step must do, each "
                                                                      "with its source (empty for eager)")
    dynamic_graph: bool | None = Field(None, description="whether the decode graph is compiled with dynamic shapes "
                                                         "(the yaml's enable_dynamic_graph; npugraph_ex default True, "
                                                         "ge_graph always False); None for eager")
    dynamic_graph_source: str = Field("", description="where enable_dynamic_graph was stated: --static-graph or "
                                                      "progress.md:line; empty for the framework's default")
    reason: str


class LegacyAttention(_Model):
    """How the Legacy path attends over its contiguous cache (SKILL.md: the model's own attention where FA
    cannot express it)."""

    kernel: Literal["fa", "model"] = Field(
        description="fa: one BSH FA call over the cache; model: the model's own eager attention over the cache "
                    "(a blocker says FA cannot express it), the fa/sparse_mode fields then apply to no call")
    softcap: float | None = Field(
        default=None, description="attn_logit_softcapping of the model: scores = tanh(scores / cap) * cap "
                                  "after the scale, before the mask (kernel model only)")
    alibi: bool = Field(default=False, description="the model adds an ALiBi position bias (kernel model only)")
    reason: str


class PerPath(_Model):
    prefill: int
    decode: int


class MaskPerPath(_Model):
    prefill: MaskKind
    decode: MaskKind


class CacheSpec(_Model):
    name: str
    dim: int
    num_head: int
    dtype: CacheDtype




class StateSpec(_Model):
    """One fixed-size state entry of a linear (recurrent) layer: one block per request in the framework's Mamba
    group (upstream ``MambaCacheEntry(cache_name, dtype, shape)``), a tensor ``[num_blocks, *shape]``."""

    name: str
    shape: list[int] = Field(description="one request's state on one attention-TP rank")
    dtype: Literal["bfloat16", "float16", "float32", "int32"]
    layout: str = Field(description="what each dim of shape is")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# LinearAttentionDecision's recurrent-state sizes: all set, or all absent (a conv-only family; kinds/invariants.py
# checks it)


class LinearAttentionDecision(_Model):
    """Hybrid models' linear-attention layers (Qwen3-Next / Qwen3.5 gated delta net, Kimi-Linear / Ling-3.0 KDA,
    Ling-2.5 lightning attention): a fixed-size recurrent state per request instead of a KV cache.

    The framework keeps it in its Mamba group (attn_type Mamba, block size 1): a request owns one state block,
    found at ``block_table["Mamba"][row, 0]``, across every linear layer. A block is reused by later requests after
    its request finishes, so prefill starts from a zero state, never from what the block holds.
    """

    family: Literal[LINEAR_FAMILIES]
    layers: list[int] = Field(description="decoder layers that are linear (hold states, no KV cache)")
    # None (left out of the JSON): a conv-only family (short_conv), whose layers keep no recurrent state
    num_k_heads: int | None = Field(default=None, ge=1, description="query/key heads (all ranks); absent: no "
                                                                      "recurrent state (a conv-only family)")
    num_v_heads: int | None = Field(default=None, ge=1, description="value heads = state heads (all ranks); absent: "
                                                                      "no recurrent state")
    head_k_dim: int | None = Field(default=None, ge=1)
    head_v_dim: int | None = Field(default=None, ge=1)
    num_k_heads_per_rank: int | None = Field(default=None, ge=1)
    num_v_heads_per_rank: int | None = Field(default=None, ge=1)
    conv_kernel: int | None = Field(description="short causal conv width; None: the family has none")
    conv_channels_per_rank: int = Field(ge=0, description="channels of the fused q|k|v conv on one rank")
    states: list[StateSpec] = Field(description="the state entries of every linear layer (one rank)")
    state_bytes_per_layer: int = Field(description="one request's states of one linear layer, one rank")
    framework_entry: str = Field(description="how the states register with the framework")
    operators: dict[str, str] = Field(description="what computes the recurrence: prefill / decode")
    state_blocks_per_request: int = Field(default=1, ge=1, description="state blocks one decoding request holds: "
                                                                       "1 + next_n (one per verify token)")
    speculative: str | None = Field(default=None, description="how a verify step keeps the states (one block per "
                                                              "verify token, resumed from the last accepted one); "
                                                              "None: no speculative decoding")
    beta_scale: float | None = Field(default=None, gt=0, description="gated delta net: beta = beta_scale x sigmoid(b) "
                                                                      "(2: OLMo-Hybrid's linear_allow_neg_eigval, "
                                                                      "beta in [0, 2]); None: 1")
    query_scale: float | None = Field(default=None, gt=0, description="lightning: the query's scale before the "
                                                                       "recurrence (1: MiniMax); None: head_k_dim^-0.5")

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler):
        """Written only under speculative decoding: manifests without it keep their bytes and hash."""
        data = handler(self)
        if isinstance(data, dict) and data.get("speculative", "") is None and data.get("state_blocks_per_request") == 1:
            del data["state_blocks_per_request"]
        return _without_unset(data, "speculative", "beta_scale", "query_scale", *RECURRENT_SIZES)
    reference: str | None = Field(description="what the validation compares against: transformers' own classes, "
                                              "or for a family transformers lacks (Ling-2.5 lightning) kvcache's "
                                              "reference built from transformers' code; None: none named (a "
                                              "manifest of an older kvcache)")
    source: str
    reason: str


class RecurrentLoopsDecision(_Model):
    """Decoder layers called several times per forward, each call with caches of its own (Dory's per_loop loops,
    HRM's cycled stacks: analyzer/kinds/loops.py): cache layer i, in transformers' own cache index order (the
    module's ``layer_idx`` + the call's offset), runs decoder layer ``calls[i]`` with that layer's attention; the port
    gives each call after a layer's first its own attention module, the weights tied."""

    calls: list[int] = Field(description="per cache layer (transformers' cache index order), the decoder layer it runs")
    offset_kwarg: str = Field(description="the attention forward's keyword carrying the call's cache offset "
                                          "(Dory: cache_offset, HRM: cycle_offset)")
    stacks: list[str] | None = Field(default=None, description="the module paths whose concatenated layers are the "
                                                               "decoder layers, where there are several (HRM: "
                                                               "L_module.layers, H_module.layers); absent: one stack")
    cache_layers: list[int] = Field(description="the cache layers that are not their layer's first call")
    module_attr: str = Field(description="the decoder layer's attribute holding its later calls' attention modules, "
                                         "one per call after the first (the port adds it)")
    source: str
    reason: str


class CrossAttentionDecision(_Model):
    """The decoder of an encoder-decoder model (BART family, Whisper, TrOCR): each decoder layer also attends over
    the request's encoder states. Their K/V are computed once at the request's prefill and read by every decode
    step with no causal mask, so they are kept in one slot per request (analyzer/kinds/cross.py), sized by the
    longest encoder output; the framework registers them as MambaCacheEntry under manager_key CrossAttention."""

    layers: list[int] = Field(description="decoder layers with a cross-attention module (beside their self-attention)")
    module_attr: str = Field(description="transformers' attribute of the decoder layer's cross-attention module")
    self_attention: bool = Field(True, description="the cross-attention layers also hold a causal self-attention "
                                                   "(BART family: planned in layers); false: blocks whose only "
                                                   "attention is over the other model's states (Mllama's "
                                                   "cross_attention_layers), listed in no_cache_layers")
    max_encoder_len: int = Field(ge=1, description="the longest encoder output a request may bring")
    max_encoder_len_source: str
    max_encoder_len_from: Literal["config", "user input"] = Field(
        default="config", description="where max_encoder_len comes from: a config field or a derivation from the "
                                      "config ('config'), or the user's --encoder-length ('user input')")
    num_heads: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    num_kv_heads_per_rank: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    slot_block_size: int = Field(ge=1, description="tokens of one FA block of a slot (the paged read's block_size)")
    slot_tokens: int = Field(ge=1, description="encoder positions one slot holds: max_encoder_len rounded up to "
                                               "whole blocks")
    states: list[StateSpec] = Field(description="the slot entries of every cross-attention layer (one rank)")
    slot_bytes_per_layer: int
    slot_bytes: int = Field(description="one request's slot, every layer, one rank")
    framework_entry: str
    fa: str = Field(description="how the slot is written and read (FA arguments)")
    source: str
    reason: str


class DrafterDecision(_Model):
    """A drafter over its target model's cache (Gemma-4 assistants, analyzer/kinds/drafter.py): every layer reads
    the target's K/V of its attn_type through the target's block table; no blocks of its own."""

    target_layers: dict[str, str] = Field(description="per attn_type: the target model's layer whose cache it reads")
    shared_kv_keys: dict[str, str] = Field(description="per attn_type: transformers' shared_kv_states key")
    input_width: int = Field(ge=2, description="inputs_embeds width: 2 x backbone_hidden_size (the target's)")
    blocks: Literal[0] = Field(description="blocks the drafter plans of its own: none")
    fa: str = Field(description="how its FA calls read the target's cache")
    source: str
    reason: str


class ByteStackPlan(_Model):
    """One of BLT's stacks as its paged attention reads it (analyzer/kinds/byte_patches.py): its cache layers and
    the shape, scale and band of its FA calls (the stacks differ in query heads, head_dim and window)."""

    section: str = Field(description="the config section of the stack (patcher_config, encoder_config, ...)")
    module: str = Field(description="transformers' module path of the stack")
    rows_per: Literal["byte", "patch"] = Field(description="its cache grows a row per byte or per completed patch")
    cache_layers: list[int] = Field(description="the planned cache-layer indices of its layers")
    num_heads: int = Field(ge=1, description="query heads (one rank)")
    num_kv_heads: int = Field(ge=1, description="KV heads (one rank)")
    head_dim: int = Field(ge=1, description="hidden_size // num_attention_heads (BltSelfAttention)")
    softmax_scale: float = Field(gt=0, description="head_dim ** -0.5 (BltSelfAttention.scaling)")
    sliding_window: int | None = Field(description="its window; null: full causal")
    sparse_mode: int
    pre_tokens: int
    next_tokens: int
    mask: MaskKind
    window_derivation: str | None = None


class BytePatchesDecision(_Model):
    """BLT's stacks chained through per-request states (analyzer/kinds/byte_patches.py): each stack's paged
    attention, and the patch boundary that steps the global stack (a row per completed patch)."""

    stacks: list[ByteStackPlan] = Field(description="in the order a forward runs them")
    entropy_patching: bool = Field(description="patches cut by the patcher's entropy; false: every byte a patch")
    patching_threshold: float | None = Field(description="a patch ends at byte p >= 1 when the entropy at p exceeds it")
    max_patch_length: int | None = Field(description="a patch also ends at this many bytes; null: no limit")
    cross_attn_k: int = Field(ge=1, description="rows of a patch the decoder's cross-attention reads")
    decoder_cross_layers: int = Field(ge=1, description="decoder cross-attention layers (a K/V slot each)")
    per_request_states: str = Field(description="what each request keeps between steps besides its pool rows")
    open_patch_rows: int = Field(ge=1, description="encoder rows the open patch holds at most per request (its "
                                                   "state slot): max_patch_length, else the request's bytes bound it")
    open_patch_bound: str = Field(description="where open_patch_rows comes from")
    source: str


class CacheDtypeDecision(_Model):
    """The cache planned in another dtype than the config's (``kvcache analyze --cache-dtype``)."""

    value: Literal[PLANNED_CACHE_DTYPES] = Field(description="dtype of every cache entry and of the memory plan")
    config_dtype: str = Field(description="the config's torch_dtype (the model's dtype, model.dtype)")
    reason: str


class DsaDecision(_Model):
    """DeepSeek sparse attention (DeepSeek-V3.2 ``deepseek_v32``, GLM-5 ``glm_moe_dsa``, A.X-K2 ``axk2``; the
    families' indexer facts: ``config_loader.INDEXER_FAMILIES``): per query, a lightning
    indexer scores every cached key of the request and attention reads only the top ``index_topk``.

    Its own cache kind: the indexer key cache, one single-head row of ``index_head_dim`` per token, in the same
    manager group and blocks as the layer's MLA caches (upstream ``CacheEntry("indexer_key_cache")``), written
    every step by each layer that runs its indexer; a "shared" layer reuses the previous selection and keeps none.
    """

    index_topk: int = Field(ge=1, description="keys selected per query (sequences up to this length attend densely)")
    index_n_heads: int = Field(ge=1, description="indexer query heads (all ranks)")
    index_n_heads_per_rank: int = Field(ge=1, description="indexer query heads on one attention-TP rank: all of "
                                        "them (replicated; the top-k sums every head's score)")
    index_head_dim: int = Field(ge=1)
    indexer_cache: CacheSpec = Field(description="the indexer key cache entry of every layer that runs its indexer")
    indexer_layers: list[int] = Field(description="decoder layers that run their own indexer (and cache its keys)")
    shared_layers: list[int] = Field(default_factory=list,
                                     description="decoder layers reusing the previous indexer layer's selection")
    dense_layers: list[int] = Field(default_factory=list,
                                    description="decoder layers whose layer_types entry is not 'indexed_attention' "
                                                "(dense attention beside the indexed layers): no indexer, no "
                                                "indexer key cache, no selection")
    index_rope: Literal["half", "interleave"] = Field(
        description="RoPE layout on the first qk_rope_head_dim dims of the indexer's queries and keys: half-split "
                    "(DeepSeek-V3.2) or interleaved pairs (GLM-5)")
    key_transform: str = Field(description="what an indexer key is before it is cached")
    selection: str = Field(description="how the top-k keys are chosen")
    source: str
    reason: str


class QsaDecision(_Model):
    """Qwen4-Exp's QSA (``qwen4_exp_text``, analyzer/kinds/qsa.py): a lightning indexer selects, per query, the top
    ``block_topk`` complete blocks of ``ratio`` tokens by their pooled indexer keys, plus the incomplete tail block;
    the layer's GQA attention reads only their tokens. Each attention layer keeps, beside its K/V, the raw indexer key
    of every token (``indexer_raw_key_cache``) and the pooled key of each complete block (``indexer_block_key_cache``,
    block j at the slot of position j), single-head ``head_dim`` rows in the layer's blocks."""

    n_heads: int = Field(ge=1, description="indexer query heads (all ranks: the selection sums every head's score)")
    head_dim: int = Field(ge=1, description="indexer head dim (its raw and pooled keys' width)")
    budget: int = Field(ge=1, description="indexer_budget: tokens of complete blocks a query may read")
    ratio: int = Field(ge=1, description="indexer_compress_ratio: tokens per pooled block")
    block_topk: int = Field(ge=1, description="blocks selected per query: budget // ratio")
    rope_dim: int = Field(ge=0, description="the leading dims of an indexer head that rotate (rotate-half)")
    selection: str
    source: str
    reason: str


class DifferentialDecision(_Model):
    """DiffLlama's differential attention (analyzer/kinds/diff.py): K and V each kept as two caches of half the KV
    heads (``k_cache`` / ``v_cache`` heads < k/2, ``k_cache_hi`` / ``v_cache_hi`` the rest); four FA calls of half the
    query heads each pair a query half's key cache with both value halves."""

    half_kv_heads: int = Field(ge=1, description="KV heads per rank in each half-head cache")
    half_q_heads: int = Field(ge=1, description="query heads per rank in each FA call (num_heads)")
    layout: str = Field(description="which cache holds which heads and which FA call reads which")
    memory: str
    source: str
    reason: str


class CompressedEntry(_Model):
    """One cache entry of a layer's compressed branch (DeepSeek-V4), as upstream registers it (``CacheEntry``)."""

    name: str
    role: Literal["compressed_kv", "indexer_kv", "compressor_state", "indexer_state"]
    dim: list[int] = Field(description="the entry's trailing dims per token row (upstream CacheEntry.dim)")
    num_head: int = Field(ge=1, description="rows per token: 1 for a compressed entry, 2 for a state (the kv and "
                                            "its gate score)")
    dtype: Literal["bfloat16", "float16", "float32"]
    manager_key: str = Field(description="the framework manager (block table) the entry's blocks come from")
    block_size: int = Field(ge=1, description="tokens one block spans: block_size x compress_ratio for a compressed "
                                              "entry, whose block holds block_size rows")
    compress_ratio: int = Field(default=1, ge=1, description="tokens pooled into one row (1: one row per token)")
    sliding_window: int | None = Field(default=None, description="a state entry: the tokens it keeps (coff x m)")

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler):
        return _without_unset(handler(self), "sliding_window")


class CompressedBranch(_Model):
    """A DeepSeek-V4 layer's compressed branch beside its window branch: CSA (one entry per m tokens, an indexer's
    top-k over them) or HCA (one entry per m' tokens, attended whole)."""

    kind: Literal["csa", "hca"]
    compress_ratio: int = Field(ge=2)
    entries: list[CompressedEntry]
    index_topk: int | None = Field(default=None, description="CSA: entries each query attends (the indexer's top-k)")


class CompressedAttentionDecision(_Model):
    """DeepSeek-V4 compressed attention: which layers compress at which rate, the indexer, the kernels, the device
    constraints and the long-context figure (references/compressed.md)."""

    csa_layers: list[int]
    hca_layers: list[int]
    window_only_layers: list[int] = Field(description="decoder layers with the window branch alone")
    compress_rates: dict[str, int] = Field(description="branch -> tokens pooled into one entry")
    sliding_window: int
    index_topk: int = Field(ge=1)
    index_n_heads: int = Field(ge=1)
    index_head_dim: int = Field(ge=1)
    mtp_layers: int = Field(default=0, description="MTP layers: the window branch only (upstream compress_ratio 1)")
    operators: dict[str, str]
    device_constraints: list[str] = Field(description="each fixed shape of the fused kernels, met or not")
    long_context: str = Field(description="bytes one request of max_len tokens holds, beside uncompressed and MLA")
    source: str
    reason: str


class _LayerBase(_Model):
    """What every cache layer states, whatever its kind: where it sits, what the config calls it, its manager."""

    index: int = Field(description="cache-layer index (sublayers flattened)")
    decoder_layer: int
    sublayer: int = 0
    attn_type: AttnType  # the tag: each kind of plan narrows it to its own attn_types
    layer_kind: LayerKind = Field(
        default="full",
        description="what the config says the layer is; chunked layers are attn_type ChunkedLocal (their chunk in "
                    "attention_chunk_size); linear layers are attn_type Mamba (a state layer) unless their family is "
                    "unknown (a blocker)",
    )
    group_key: str = Field(description="key of block_table/slot_mapping dicts for this layer")

    @property
    def is_sliding(self) -> bool:
        """The layer attends through a window (its kind's spec says so; no string comparison)."""
        return is_windowed(self.attn_type)

    @property
    def is_chunked(self) -> bool:
        """The layer attends within its chunk [floor(p / C) * C, p] (chunked local attention; its spec says so)."""
        return is_chunked(self.attn_type)

    @property
    def is_recurrent(self) -> bool:
        """The config makes this layer recurrent (linear attention), whether or not a state is planned for it (a
        linear family kvcache does not know plans none): the layer kind's spec keeps a state."""
        return spec_for_layer_kind(self.layer_kind).state

    @property
    def is_state(self) -> bool:
        """The layer keeps a fixed-size recurrent state (attn_type Mamba), not a KV cache."""
        return holds_state(self.attn_type)


class AttentionLayerPlan(_LayerBase):
    """A layer that attends over a paged KV cache (full or sliding): its cache entries and its FA call's band,
    sparse mode, mask and writer."""

    attn_type: Literal[ATTENTION_ATTN_TYPES]
    plans: ClassVar[str] = "an attention layer (a paged KV cache, an FA call)"
    sliding_window: int | None = None
    sparse_mode: PerPath
    pre_tokens: int
    next_tokens: int
    mask: MaskPerPath
    write_op: WriteOp
    caches: list[CacheSpec]
    window_derivation: str | None = None
    # Set only on a layer whose attention shape differs from the model's (transformers' per_layer_config,
    # Gemma-4's global_head_dim / num_global_key_value_heads): its head_dim and KV heads per rank.
    head_dim: int | None = Field(default=None, description="this layer's head_dim where it differs from model.head_dim")
    num_kv_heads_per_rank: int | None = Field(
        default=None, description="this layer's KV heads per rank where they differ from parallel.num_kv_heads_per_rank")
    # Set only on an MLA layer whose shape differs from the model's (transformers' per_layer_config: Dots3-Note's
    # sliding layers): its latent / head dims, query heads per rank and softmax scale.
    mla_dims: MlaDims | None = Field(default=None, description="this MLA layer's dims where they differ from "
                                                            "model.mla")
    num_q_heads_per_rank: int | None = Field(
        default=None, ge=1, description="this layer's query heads per rank where they differ from "
                                        "parallel.num_q_heads_per_rank")
    softmax_scale: float | None = Field(default=None, gt=0, description="this layer's softmax scale where it differs "
                                                                        "from fa.softmax_scale")
    scale_derivation: str | None = Field(default=None, description="how this layer's softmax_scale was derived")
    compressed: CompressedBranch | None = Field(
        default=None, description="a DeepSeek-V4 layer's compressed branch (CSA / HCA); absent: none")
    attention_chunk_size: int | None = Field(
        default=None, ge=1, description="a ChunkedLocal layer's chunk C: a query at position p attends the keys in "
                                        "[floor(p / C) * C, p]; absent: not chunked")
    kv_source_layer: int | None = Field(
        default=None, ge=0, description="a KV-shared layer (Gemma-3n / Gemma-4 num_kv_shared_layers): the index of the "
                                        "earlier layer whose K/V cache it reads through the same block table; it "
                                        "holds no cache of its own (caches empty) and writes none; absent: its own")
    reads_target: bool | None = Field(
        default=None, description="a drafter's layer (Gemma-4 assistants): it reads the target model's cache of its "
                                   "attn_type (drafter.target_layers) and holds none; absent: its own")

    @property
    def states(self) -> list[StateSpec]:
        """An attention layer keeps no recurrent state."""
        return []

    @property
    def registers_as(self) -> tuple[str, int | None]:
        """(attn_type, sliding_window) of the layer's framework CacheEntry: its own attn_type and window, but a
        chunked layer's manager (SlidingWindow, window = its chunk: kv_cache_spec.ChunkedLocalSpec)."""
        if self.is_chunked:
            return manager_attn_type(self.attn_type), self.attention_chunk_size
        return self.attn_type, self.sliding_window if self.is_sliding else None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler):
        """The per-layer shape fields are written only where a layer differs."""
        return _without_unset(handler(self), "head_dim", "num_kv_heads_per_rank", "compressed",
                              "attention_chunk_size", "kv_source_layer", "reads_target", "mla_dims", "num_q_heads_per_rank",
                              "softmax_scale", "scale_derivation")


class StateLayerPlan(_LayerBase):
    """A recurrent layer (linear attention): one fixed-size state per request in its Mamba group; no KV cache and no
    FA call, so none of the FA fields."""

    attn_type: Literal[STATE_ATTN_TYPES]
    plans: ClassVar[str] = "a state layer (a recurrent state, no KV cache)"
    states: list[StateSpec] = Field(min_length=1, description="the layer's state entries (= linear_attention.states)")

    # what a state layer answers where code walks every layer: no per-token KV cache, no window (a state summarises
    # the whole prefix), no compressed branch, no per-layer attention shape
    sliding_window: ClassVar[None] = None
    attention_chunk_size: ClassVar[None] = None
    compressed: ClassVar[None] = None
    head_dim: ClassVar[None] = None
    num_kv_heads_per_rank: ClassVar[None] = None
    kv_source_layer: ClassVar[None] = None
    reads_target: ClassVar[None] = None
    mla_dims: ClassVar[None] = None
    num_q_heads_per_rank: ClassVar[None] = None
    softmax_scale: ClassVar[None] = None
    scale_derivation: ClassVar[None] = None

    @property
    def caches(self) -> list[CacheSpec]:
        return []


class NoCacheLayer(_Model):
    """A decoder block that holds no cache at all (Nemotron-H's MLP-only and MoE-only blocks): no KV cache, no state,
    no entry in ``layers`` (the framework refuses a layer without cache entries, so get_cache_info leaves it out and
    the cache layers' ``index`` skips it while their ``decoder_layer`` keeps the block index)."""

    decoder_layer: int = Field(ge=0, description="the block's index in the model's layer list")
    block: str = Field(description="what the config calls the block (layers_block_type)")
    reason: str


# One layer of the plan, tagged by its attn_type: a state layer carries no FA fields (schema 2.0).
LayerPlan = Annotated[AttentionLayerPlan | StateLayerPlan, Field(discriminator="attn_type")]


class ParallelPlan(_Model):
    attn_tp_size: int
    attn_tp_source: str
    num_q_heads_per_rank: int
    num_kv_heads_per_rank: int
    kv_heads_replicated: bool = Field(description="fewer KV heads than ranks: each rank holds a copy")
    latent_replicated: bool = Field(description="MLA latent cache is whole on every rank")


class GroupMemory(_Model):
    group_key: str
    attn_type: Literal[GROUP_ATTN_TYPES]
    num_layers: int
    per_token_bytes: int = Field(description="growing groups: bytes per token; a Mamba group: 0 (see state_bytes)")
    fixed_blocks: bool
    blocks: int | None = None
    state_bytes: int | None = Field(default=None, description="a Mamba group: one block = one request's states of "
                                                              "every linear layer, one rank")
    block_size: int | None = Field(default=None, description="tokens one block spans where it is not the manifest's "
                                                             "block_size (a compressed group: block_size x ratio)")
    compress_ratio: int | None = Field(default=None, description="a compressed group: tokens pooled into one row")

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler):
        return _without_unset(handler(self), "state_bytes", "block_size", "compress_ratio")


class MemoryPlan(_Model):
    per_token_bytes: int = Field(description="all layers, one rank")
    per_layer_token_bytes: list[int] = Field(
        default_factory=list, description="per-token bytes of each cache layer, in layers[] order, one rank"
    )
    groups: list[GroupMemory]
    legacy_reservation_bytes: int | None = Field(
        default=None, description="contiguous cache for max_concurrency x max_len (Legacy)"
    )
    hbm_gb: float | None = None
    kv_mem_ratio: float | None = None
    max_concurrency: int | None = Field(
        default=None, description="requests the plan is sized for: --max-concurrency, else (with HBM) the most "
                                  "requests of max_len that fit"
    )
    max_len: int | None = Field(default=None, description="--max-len, else (with HBM) max_position_embeddings")
    blocks: dict[str, int] | None = None
    max_tokens: int | None = None
    max_concurrency_at_max_len: int | None = Field(
        default=None, description="requests of max_len that fit in the budget"
    )
    derivation: list[str] = Field(default_factory=list)


class DeviceDependency(_Model):
    """An open device behaviour (references/device_questions.md) this design relies on; settled only by an NPU run."""

    question: Literal[DEPENDENCY_QUESTIONS]
    assumed: str
    alternative: str
    consequence: str
    layers: list[int] = Field(default_factory=list)
    status: Literal["assumed", "confirmed", "contradicted", UNKNOWN] = Field(
        default="assumed", description="assumed: no measurement; confirmed / contradicted: the readings file "
                                       "(device_readings) measured a reading the design survives / does not; "
                                       "unknown: the probe's output matched no known reading")
    measured: str | None = Field(default=None, description="the reading `kvcache probe` measured, if any")


class DeviceReadingsSource(_Model):
    """Where the measured device readings came from (`kvcache analyze --device-readings FILE`)."""

    file: str
    backend: Literal[OP_BACKENDS] = Field(description="emulated: a CPU dry run, it settles nothing")
    soc: str | None = None
    torch_npu_version: str | None = None
    cann_version: str | None = None
    probe_version: int
    settled: dict[str, str] = Field(default_factory=dict, description="question -> measured reading")
    unknown: list[str] = Field(default_factory=list, description="questions whose output matched no reading")


class Inputs(_Model):
    config: str | None = None
    progress: str | None = None
    dispatch: str | None = None
    framework_root: str | None = None
    npu_model: str | None = Field(default=None, description="NPU model stated in progress.md")
    num_cards: int | None = Field(default=None, description="card count stated in progress.md (部署卡数)")
    starting_point: list[str] = Field(
        default_factory=list, description="migrator output found: legacy_cache_unit | kv_list | paged"
    )
    runner_files: list[str] = Field(default_factory=list, description="runner_*.py named in progress.md or found")
    progress_sources: dict[str, str] = Field(
        default_factory=dict, description="each progress.md value the manifest uses -> 'file:line: quoted phrase'"
    )


class Generator(_Model):
    name: str = "model-infer-kvcache"
    version: str


# SelectionManifest fields left out of its JSON while None (see SelectionManifest._omit_unset).
OMITTED_WHEN_UNSET = ("cache_dtype", "dsa", "qsa", "differential", "legacy_attention", "linear_attention", "exe_mode",
                      "compressed", "no_cache_layers", "cross_attention", "recurrent_loops", "drafter", "byte_patches")


class SelectionManifest(_Model):
    schema_version: str = SCHEMA_VERSION
    generator: Generator
    inputs: Inputs
    model: ModelInfo
    deploy_mode: DeployModeDecision
    framework_api: FrameworkApi | None = Field(description="cache_info API generation of the target framework "
                                               "(G3 renders follow G2's model-side contract); null when standalone "
                                               "or unknown")
    framework_api_evidence: str
    kv_mode: KvModeDecision
    fa: FaDecision
    mla: MlaDecision
    mtp: MtpDecision | None = None
    legacy_attention: LegacyAttention | None = Field(
        default=None, description="Legacy only: whether the render calls FA or keeps the model's own attention")
    mixed_attn_types: bool
    layers: list[LayerPlan]
    no_cache_layers: list[NoCacheLayer] | None = Field(
        default=None, description="decoder blocks without any cache (MLP-only / MoE-only blocks), left out of "
                                  "layers; absent: every block holds a cache")
    parallel: ParallelPlan
    block_size: int
    memory: MemoryPlan
    # Omitted from the JSON when None (_omit_unset): manifests without --cache-dtype keep their bytes and hash.
    cache_dtype: CacheDtypeDecision | None = Field(
        default=None, description="--cache-dtype: caches planned in this dtype instead of the config's; "
                                  "absent: the config's dtype")
    dsa: DsaDecision | None = Field(
        default=None, description="DeepSeek sparse attention: the indexer key cache and top-k selection; absent: dense")
    qsa: QsaDecision | None = Field(
        default=None, description="Qwen4-Exp's QSA: the indexer's raw and pooled block keys and the block selection; "
                                  "absent: no QSA")
    differential: DifferentialDecision | None = Field(
        default=None, description="DiffLlama's differential attention: K/V as two half-head caches each, four FA "
                                  "calls; absent: none")
    exe_mode: ExecModeDecision | None = Field(
        default=None, description="the framework's execution mode for decode and what a captured step must do; "
                                  "absent: eager (not stated)")
    linear_attention: LinearAttentionDecision | None = Field(
        default=None, description="linear (recurrent-state) layers of a hybrid model; absent: none")
    compressed: CompressedAttentionDecision | None = Field(
        default=None, description="DeepSeek-V4 compressed attention (CSA / HCA branches beside every layer's window "
                                  "branch); absent: none")
    cross_attention: CrossAttentionDecision | None = Field(
        default=None, description="the decoder of an encoder-decoder model: a slot per request for the K/V of its "
                                  "encoder states, beside the self-attention's paged cache; absent: decoder-only")
    recurrent_loops: RecurrentLoopsDecision | None = Field(
        default=None, description="a section run several times per forward, each loop with its own cache layers "
                                  "(Dory per_loop, HRM's cycles), in transformers' cache order; absent: every layer "
                                  "runs once")
    drafter: DrafterDecision | None = Field(
        default=None, description="a drafter whose every layer reads its target model's cache (Gemma-4 assistants); "
                                  "absent: the model computes its own K/V")
    byte_patches: BytePatchesDecision | None = Field(
        default=None, description="BLT's stacks (patcher, local encoder, global transformer, local decoder), each "
                                  "with its own paged cache, the global one a row per completed patch; layers list "
                                  "their cache layers in cache order; absent: one decoder stack")
    device_dependencies: list[DeviceDependency] = Field(default_factory=list)
    device_readings: DeviceReadingsSource | None = Field(
        default=None, description="the readings file the device questions were settled from; None: all assumed")
    open_questions: list[Finding] = Field(default_factory=list)
    warnings: list[Finding] = Field(default_factory=list)
    blockers: list[Finding] = Field(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self) -> SelectionManifest:
        problems = manifest_problems(self)
        if problems:
            raise ManifestInvariantError(*problems[0])
        if self.cache_dtype is not None:
            off = next((f"layers[{layer.index}].caches[{j}].dtype" for layer in self.layers
                        for j, c in enumerate(layer.caches) if c.dtype != self.cache_dtype.value), None)
            if off:
                raise ManifestInvariantError(off, f"contradicts cache_dtype {self.cache_dtype.value}")
        return self

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler):
        """Optional decisions added after schema 1.0 are left out while unset (existing manifests unchanged)."""
        return _without_unset(handler(self), *OMITTED_WHEN_UNSET)

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2, ensure_ascii=False) + "\n"

    def sliding_window(self) -> int | None:
        """The window of the model's sliding layers (one per model), None without sliding layers."""
        return next((layer.sliding_window for layer in self.attention_layers if layer.sliding_window), None)

    def parallel_hybrid(self) -> bool:
        """Decoder layers run attention and a recurrent mixer side by side (Falcon-H1): a state planned as a
        decoder layer's second sublayer, beside its attention."""
        return any(layer.is_state and layer.sublayer for layer in self.layers)

    def plan_of_module(self, layer_idx: int) -> LayerPlan:
        """The plan of the model's attention module of index ``layer_idx`` (the index the module keeps, as its FA
        calls are recorded): the plan of that index, except in a parallel hybrid (Falcon-H1), whose decoder layer i
        plans its attention as sublayer 0 beside its state."""
        if self.parallel_hybrid():
            return next(layer for layer in self.layers if layer.decoder_layer == layer_idx and not layer.is_state)
        if self.no_cache_layers:  # the cache layers skip the blocks without a cache: found by block index
            return next(layer for layer in self.layers if layer.decoder_layer == layer_idx)
        return self.layers[layer_idx]

    def module_index(self, layer: LayerPlan) -> int:
        """The layer index the attention module planned as ``layer`` keeps (``plan_of_module``'s inverse): its decoder
        layer's in a parallel hybrid (ZAYA's sliding layers) and where blocks without a cache are skipped, else its
        own."""
        return layer.decoder_layer if self.parallel_hybrid() or self.no_cache_layers else layer.index

    def attention_chunk_size(self) -> int | None:
        """The chunk of the model's chunked local attention layers (one per model), None without them."""
        return next((layer.attention_chunk_size for layer in self.attention_layers if layer.attention_chunk_size),
                    None)

    @property
    def attention_layers(self) -> list[AttentionLayerPlan]:
        """The layers that attend over a KV cache (a hybrid's state layers left out): the ones with FA fields."""
        return [layer for layer in self.layers if not layer.is_state]

    def content_hash(self) -> str:
        """Stable hash of the manifest content (sorted keys), used in rendered-file headers."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


class ManifestInvariantError(ValueError):
    """A manifest whose fields contradict each other (a hand edit); ``field`` names the one to fix."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


# "... = 128^-0.5" and the YaRN factor "... = 1.234567 (" of FaDecision.scale_derivation (rules.decide_scale).
_BASE = re.compile(r"= ([0-9.]+)\^-0\.5")
_MSCALE = re.compile(r"mscale\^2.*= ([0-9.]+) \(")


def manifest_problems(m: SelectionManifest) -> list[tuple[str, str]]:
    """(field, why) for each invariant a manifest breaks: what a hand edit can desynchronise.

    Heads vs per-rank heads vs cache entries, the layer list vs the layer count, the schema
    version, and the softmax scale vs the derivation written next to it.
    """
    out: list[tuple[str, str]] = []
    if m.schema_version != SCHEMA_VERSION:
        out.append(("schema_version", f"{m.schema_version!r} is not the supported {SCHEMA_VERSION!r}"))
    p, model = m.parallel, m.model
    tp = p.attn_tp_size
    if tp < 1 or model.num_attention_heads % tp or p.num_q_heads_per_rank != model.num_attention_heads // tp:
        out.append(("parallel.num_q_heads_per_rank", f"{p.num_q_heads_per_rank} is not num_attention_heads "
                                                     f"{model.num_attention_heads} / attn_tp_size {tp}"))
    kv_per_rank, why = kinds.kv_heads_per_rank(m, tp)
    if p.num_kv_heads_per_rank != kv_per_rank:
        out.append(("parallel.num_kv_heads_per_rank", f"{p.num_kv_heads_per_rank} is not {kv_per_rank} ({why})"))
    uncached = m.no_cache_layers or []
    # a state-only decoder layer of a model whose hybrid layers plan two sublayers (Zamba2's Mamba layers) plans one
    # (linear_config.sublayer_kinds); every other decoder layer plans sublayers_per_layer
    state_only = {layer.decoder_layer for layer in m.layers if layer.is_state and not layer.sublayer} - \
        {layer.decoder_layer for layer in m.layers if layer.sublayer}
    short = len(state_only) * (model.sublayers_per_layer - 1) if m.parallel_hybrid() else 0
    loops = m.recurrent_loops
    extra = len(loops.cache_layers) if loops else 0  # each layer's later calls (Dory per_loop, HRM's cycles)
    want_layers = model.num_layers * model.sublayers_per_layer - len(uncached) - short + extra
    with_mtp = want_layers + model.num_mtp_layers * model.sublayers_per_layer
    if len(m.layers) not in (want_layers, with_mtp):
        out.append(("layers", f"{len(m.layers)} entries for {model.num_layers} decoder layers x "
                              f"{model.sublayers_per_layer} sublayer(s) - {len(uncached)} block(s) without a cache "
                              + (f"- {short} for the state-only layers " if short else "")
                              + (f"+ {extra} for the layers' later calls " if extra else "")
                              + f"= {want_layers}"))
    out += loops_kind.loop_problems(m)
    cached_blocks = {layer.decoder_layer for layer in m.layers}
    for j, block in enumerate(uncached):
        if block.decoder_layer in cached_blocks or block.decoder_layer >= model.num_layers:
            out.append((f"no_cache_layers[{j}].decoder_layer", f"{block.decoder_layer} is a cache layer's block or "
                                                               f"past the model's {model.num_layers} blocks"))
    for i, layer in enumerate(m.layers):
        where = f"layers[{i}]"
        if layer.index != i:
            out.append((f"{where}.index", f"{layer.index} out of order (expected {i}: a layer is missing)"))
            break
        if layer.is_state:  # its states, checked with linear_attention (analyzer/kinds/invariants.py)
            continue
        if layer.is_sliding != (layer.sliding_window is not None):
            out.append((f"{where}.sliding_window", f"{layer.sliding_window} does not fit attn_type {layer.attn_type}"))
        if layer_kind_is_chunked(layer.layer_kind) != layer.is_chunked:
            out.append((f"{where}.layer_kind", f"{layer.layer_kind} does not fit attn_type {layer.attn_type} (a chunked "
                                               "layer is planned ChunkedLocal, only it)"))
        elif layer.is_chunked != (layer.attention_chunk_size is not None):
            out.append((f"{where}.attention_chunk_size", f"{layer.attention_chunk_size} does not fit attn_type "
                                                         f"{layer.attn_type}"))
        elif layer.is_chunked and layer.group_key != manager_attn_type(layer.attn_type):
            out.append((f"{where}.group_key", f"{layer.group_key!r}: a {layer.attn_type} layer registers in the "
                                              f"framework's {manager_attn_type(layer.attn_type)} manager"))
        if layer.kv_source_layer is not None:
            out += _kv_source_problems(m, layer, where)
        layer_kv = layer.num_kv_heads_per_rank or p.num_kv_heads_per_rank
        layer_dim = layer.head_dim or model.head_dim
        heads, dim = kinds.cache_row_shape(m, layer_kv, layer_dim)
        _, v_dim = kinds.cache_row_shape(m, layer_kv, model.v_head_dim_at(layer_dim))
        for j, c in enumerate(layer.caches):
            if c.name in kinds.own_entries(m):  # a kind's own entries (QSA's indexer keys): checked by the kind
                continue
            if c.num_head != heads:
                out.append((f"{where}.caches[{j}].num_head", f"{c.num_head} is not {heads} "
                                                             "(KV heads per rank; 1 for MLA and Legacy rows)"))
            if c.name == "v_cache" and v_dim is not None and c.dim != v_dim:
                out.append((f"{where}.caches[{j}].dim", f"{c.dim} is not {v_dim} (the value heads' width)"))
            elif c.name != "v_cache" and dim is not None and c.dim != dim:
                out.append((f"{where}.caches[{j}].dim", f"{c.dim} is not {dim}"))
        # The band arguments a render passes: a windowed layer's own, INT32_MAX/0 for every other layer
        # (an edited value there would be accepted and silently ignored). A drafter's layer: its own band
        # (analyzer/kinds/drafter.py, checked there).
        if layer.reads_target or m.drafter is not None:  # the drafter's layers: drafter.problems says which
            continue
        if layer.is_sliding:
            if not 0 <= layer.pre_tokens <= (layer.sliding_window or 0):
                out.append((f"{where}.pre_tokens", f"{layer.pre_tokens} must lie in [0, sliding_window "
                                                   f"{layer.sliding_window}]"))
        elif layer.pre_tokens != INT32_MAX:
            out.append((f"{where}.pre_tokens", f"{layer.pre_tokens} on a layer without a window: FA's band is "
                                               f"unused there and the render passes {INT32_MAX}"))
        if layer.next_tokens != 0:
            out.append((f"{where}.next_tokens", f"{layer.next_tokens} must be 0 (causal attention sees no key "
                                                "after the query)"))
    out.extend(kinds.kind_problems(m))
    legacy = m.legacy_attention
    if legacy is not None and m.kv_mode.value != "legacy":
        out.append(("legacy_attention", f"set on a {m.kv_mode.value} manifest (Legacy only)"))
    if legacy is not None and legacy.kernel == "fa" and (legacy.softcap is not None or legacy.alibi):
        out.append(("legacy_attention.kernel", "fa cannot apply a soft-cap or an ALiBi bias: the kernel is 'model'"))
    if legacy is not None and legacy.softcap is not None and not (math.isfinite(legacy.softcap) and legacy.softcap > 0):
        out.append(("legacy_attention.softcap", f"{legacy.softcap} must be a finite positive number"))
    scale = _derived_scale(m.fa.scale_derivation)
    if scale is not None and not math.isclose(m.fa.softmax_scale, scale, rel_tol=1e-5):
        out.append(("fa.softmax_scale", f"{m.fa.softmax_scale!r} contradicts its derivation "
                                        f"'{m.fa.scale_derivation}' = {scale:.8g}"))
    return out


def _kv_source_problems(m: SelectionManifest, layer: AttentionLayerPlan, where: str) -> list[tuple[str, str]]:
    """A KV-shared layer holds no cache and reads an earlier layer's, one that owns its cache, of its own attn_type
    (same block table and window) and shape."""
    src = layer.kv_source_layer
    field = f"{where}.kv_source_layer"
    if layer.caches:
        return [(f"{where}.caches", f"{len(layer.caches)} entries on a KV-shared layer (kv_source_layer {src}): it "
                                    "reads its source layer's cache and holds none")]
    if src >= layer.index:
        return [(field, f"{src} is not an earlier layer than {layer.index}")]
    source = m.layers[src]
    if source.is_state or not source.caches or source.kv_source_layer is not None:
        return [(field, f"layer {src} holds no K/V cache of its own to read")]
    if (source.attn_type, source.sliding_window, source.head_dim, source.num_kv_heads_per_rank) != \
            (layer.attn_type, layer.sliding_window, layer.head_dim, layer.num_kv_heads_per_rank):
        return [(field, f"layer {src} is {source.attn_type} (window {source.sliding_window}), layer {layer.index} "
                        f"{layer.attn_type} (window {layer.sliding_window}): a shared cache is read through its "
                        "source's block table and shape")]
    return []


def _derived_scale(derivation: str) -> float | None:
    base = _BASE.search(derivation)
    if base is None:
        return None
    value = float(base.group(1)) ** -0.5
    mscale = _MSCALE.search(derivation)
    return value * float(mscale.group(1)) ** 2 if mscale else value


def manifest_json_schema() -> dict:
    return SelectionManifest.model_json_schema()
