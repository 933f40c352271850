"""Read a Hugging Face ``config.json`` into normalized, source-tracked model facts.

Configs spell the same fact many ways (``n_head`` / ``num_attention_heads``, ``rope_scaling`` /
``rope_parameters``, ``torch_dtype`` / ``dtype``, nested ``text_config``...). Every normalized
value keeps the field it came from, or says it is a default, so the manifest can explain itself.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, NamedTuple, TypeVar

import yaml
from model_infer_kvcache.analyzer.errors import InputError, NotSupportedByKvcache
from model_infer_kvcache.analyzer.files import json_syntax_problem, read_input_text
from model_infer_kvcache.analyzer.hf_config_source import BadOperand, ConfigClassFacts, config_class_facts
from model_infer_kvcache.analyzer.kinds import byte_patches as byte_patches_kind
from model_infer_kvcache.analyzer.kinds import compressed as compressed_kind
from model_infer_kvcache.analyzer.kinds import cross as cross_kind
from model_infer_kvcache.analyzer.kinds import diff as diff_kind
from model_infer_kvcache.analyzer.kinds import drafter as drafter_kind
from model_infer_kvcache.analyzer.kinds import loops as loops_kind
from model_infer_kvcache.analyzer.kinds import qsa as qsa_kind
from model_infer_kvcache.analyzer.linear_config import (
    CCA_HYBRIDS,
    NO_CACHE,
    PARALLEL,
    PARALLEL_HYBRIDS,
    PARALLEL_SLIDING,
    POST_INIT_LAYER_TYPES,
    SHARED_BLOCK,
    SHARED_BLOCK_HYBRIDS,
    LinearFacts,
    attends,
    bailing_layer_kinds,
    block_types,
    family_of_linear,
    holds_state,
    kimi_layer_kinds,
    mamba_layer_kinds,
    read_linear,
    short_conv_layer_kinds,
)
from model_infer_kvcache.analyzer.manifest import MlaDims, RopeInfo

T = TypeVar("T")

# model_type -> the code family whose attention it follows.
FAMILY_OF = {
    "kimi_k2": "deepseek_v3",
    # DeepSeek sparse attention: DeepSeek's MLA (same scale rule) plus an indexer (ModelFacts.dsa).
    "deepseek_v32": "deepseek_v3",
    "glm_moe_dsa": "deepseek_v3",
    "qwen3_moe": "qwen3",
    # Qwen3.5: gated-delta-net linear layers beside gated full attention (scale head_dim^-0.5, as Qwen3's)
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5",
    "qwen2_moe": "qwen2",
    "llama4_text": "llama4",
    "gemma3_text": "gemma3",
    "gemma4_text": "gemma4",
    "gemma3n_text": "gemma3n",
    "gemma4_unified": "gemma4",
    "gemma4_unified_text": "gemma4",
    "mixtral": "mistral",
    "granitemoe": "granite",
    "granitemoeshared": "granite",
}

# model_type -> the transformers model_type that implements it (same code under another name).
HF_MODEL_TYPE = {"kimi_k2": "deepseek_v3"}

# Configs that nest the language model's fields (multimodal checkpoints). ``decoder``: a composite whose causal LM is
# its decoder section (MusicGen / MusicGen-Melody: MusicgenForCausalLM over config.decoder, beside text_encoder and
# audio_encoder; TrOCR's VisionEncoderDecoderConfig: TrOCRForCausalLM over config.decoder, beside its ViT encoder),
# the name transformers' PreTrainedConfig.get_text_config(decoder=True) looks up first.
NESTED_SECTIONS = ("text_config", "language_config", "llm_config", "decoder")

# Layer kinds as configs name them in `layer_types`.
_LAYER_TYPE_KIND = {
    "full_attention": "full",
    "attention": "full",
    # LFM2 / LFM2-MoE / LFM3's gated short-conv layers: a conv state per request (linear_config SHORT_CONV)
    "conv": "linear",
    # DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): full attention over the keys an indexer selects;
    # the cache grows like full attention's (plus the indexer key cache, ModelFacts.dsa).
    "indexed_attention": "full",
    "sliding_attention": "sliding",
    "chunked_attention": "chunked",
    "linear_attention": "linear",
    "mamba": "linear",
    "recurrent": "linear",
    # blocks with neither attention nor a mixer state (Nemotron-H's MLP-only and MoE-only blocks): no cache at all,
    # as transformers' cache keeps a "dummy" layer for them (cache_utils.get_layer_types_and_kwargs)
    "mlp": NO_CACHE,
    "moe": NO_CACHE,
}

# DeepSeek-V4's compressed layer types (analyzer/kinds/compressed.py): every such layer attends through a window
# branch (planned as a sliding layer) and keeps a compressed branch beside it (ModelFacts.compressed).
_LAYER_TYPE_KIND.update({name: "sliding" for name in compressed_kind.LAYER_TYPE_KIND})

# Gated-delta-net sizes: the same defaults in Qwen3NextConfig, Qwen3_5TextConfig and Qwen3_5MoeTextConfig.
_GDN_DEFAULTS = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                 "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}

# Attention fields that published configs omit because they equal the transformers class defaults.
# Used only when the config lacks the field; the source then names the class.
FAMILY_DEFAULTS: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma3": ("Gemma3TextConfig", {
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256,
        "sliding_window": 4096, "rms_norm_eps": 1e-6, "vocab_size": 262208,
    }),
    "gemma2": ("Gemma2Config", {
        "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
    }),
    "qwen3_next": ("Qwen3NextConfig", {"full_attention_interval": 4, **_GDN_DEFAULTS}),
    "qwen3_5": ("Qwen3_5MoeTextConfig", _GDN_DEFAULTS),
    "lara_mini": ("LaraMiniConfig", {**_GDN_DEFAULTS, "linear_num_key_heads": 8, "linear_num_value_heads": 16,
                                   "sliding_window": 512}),
    # OlmoHybridConfig derives its linear heads and dims from the attention's (linear_config._read_gdn)
    "olmo_hybrid": ("OlmoHybridConfig", {"linear_conv_kernel_dim": 4}),
    "gpt_oss": ("GptOssConfig", {"sliding_window": 128}),
    "granite": ("GraniteConfig", {"attention_multiplier": 1.0}),
    # the Mamba mixers' sizes (analyzer.linear_config): each config class's defaults
    **{family: (cls, {"mamba_n_heads": 128, "mamba_d_head": heads_dim, "mamba_n_groups": 1, "mamba_d_state": 256,
                      "mamba_d_conv": 4, "mamba_expand": 2, **extra})
       for family, cls, heads_dim, extra in (
           ("granitemoehybrid", "GraniteMoeHybridConfig", 64, {}), ("bamba", "BambaConfig", 64, {}),
           ("falcon_h1", "FalconH1Config", 8, {"mamba_d_ssm": 1024}))},
    "nemotron_h": ("NemotronHConfig", {"mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128,
                                       "n_groups": 8, "conv_kernel": 4, "expand": 2}),
    "jamba": ("JambaConfig", {"mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "attn_layer_period": 8,
                              "attn_layer_offset": 4}),
    "zamba": ("ZambaConfig", {"n_mamba_heads": 2, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2}),
}

# Upper bounds on sizes: far above every published model (the largest have ~200 layers, 128 query
# heads, 256k vocabularies), low enough that a typo (2**64 heads, 1e12 layers) is refused instead of
# planned: such a value would make every later figure (bytes per token, pool sizes) meaningless.
LIMITS = {
    "layers": 4096,
    "heads": 4096,
    "head_dim": 8192,
    "hidden_size": 1 << 20,
    "vocab_size": 1 << 24,
    "mtp_layers": 64,
    "mla_dim": 1 << 16,
    "positions": 1 << 31,
}

# rope types transformers implements (``ROPE_INIT_FUNCTIONS`` plus 'default'), and the legacy
# spellings it maps onto them ('mrope': multimodal sections over the default rotation; 'su': longrope).
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional", "mrope", "su")
# rope types that stretch the context by `factor` (transformers requires it there, >= 1).
_SCALED_ROPE = ("linear", "dynamic", "yarn", "llama3")

_DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
}


@dataclass(frozen=True)
class Sourced(Generic[T]):
    """A value plus the config field it came from (``default: ...`` when none did)."""

    value: T
    source: str

    @property
    def is_default(self) -> bool:
        return self.source.startswith("default")


@dataclass(frozen=True)
class IndexerFamily:
    """What a DSA family's lightning indexer does that no config field says (its modeling code decides).

    ``rope``: the layout of the indexer's rotation ("half": rotate-half, "interleave": even/odd pairs);
    ``rope_dims``: which qk_rope_head_dim dims of each indexer head it rotates ("first" | "last");
    ``source``: the transformers file:function that fixes both; ``device_refusal``: why no pinned torch_npu op
    can serve the family's selection or attention (with the op doc line that says it); ``kvcache_gap``: what the
    ops could serve but kvcache does not plan or render yet. None when planned. ``typed_layers``: where the modeling code builds the indexer only on the
    'indexed_attention' entries of ``layer_types`` (None: on every layer, whatever layer_types says), so a config
    without such an entry has no indexer at all.
    """

    rope: str
    rope_dims: str
    source: str
    device_refusal: str | None = None
    kvcache_gap: str | None = None
    typed_layers: str | None = None


# DSA family -> its indexer's facts. Every family scores like DeepSeek-V3.2 (sum over indexer heads of
# weight_h * n_heads^-0.5 * relu(q_h . k) * index_head_dim^-0.5, one LayerNorm'd key per token, causal, top
# min(index_topk, keys)); they differ only in the RoPE layout and which dims it rotates (read off each file below).
_TF = "transformers/models/"
INDEXER_FAMILIES = {
    "deepseek_v32": IndexerFamily("half", "first", f"{_TF}deepseek_v32/modeling_deepseek_v32.py:"
                                  "DeepseekV32Indexer.forward (apply_rotary_pos_emb, half-split)"),
    "glm_moe_dsa": IndexerFamily("interleave", "first", f"{_TF}glm_moe_dsa/modeling_glm_moe_dsa.py:"
                                 "GlmMoeDsaIndexer.forward (apply_rotary_pos_emb_interleave)"),
    # A.X-K2: the V3.2 indexer unchanged; its attention fuses q_b_proj into q_gate_proj and gates the output, both
    # outside the cache (the model keeps them around kv_cache_attention)
    "axk2": IndexerFamily("half", "first", f"{_TF}axk2/modeling_axk2.py:AXK2Indexer.forward "
                          "(apply_rotary_pos_emb, half-split)"),
    "dots3_note_text": IndexerFamily("interleave", "first", f"{_TF}dots3_note/modeling_dots3_note.py:"
                                     "Dots3NoteTextIndexer.forward (apply_rotary_pos_emb_interleave)",
                                     typed_layers=f"{_TF}dots3_note/modeling_dots3_note.py:Dots3NoteTextAttention."
                                                  "__init__ builds Dots3NoteTextIndexer only where layer_types[i] "
                                                  "== 'indexed_attention' (use_dsa false: none)"),
    "hy_v4": IndexerFamily(
        "interleave", "last", f"{_TF}hy_v4/modeling_hy_v4.py:HYV4Indexer.forward (q/k split [pass, rot], "
        "apply_rotary_pos_emb_interleave on the last qk_rope_head_dim dims)",
        kvcache_gap="its sparse attention adds a learnable sink logit per head to the softmax (HYV4Attention.sinks, "
                    "eager_attention_forward s_aux): torch_npu 2.14.0 declares npu_sparse_flash_attention(..., "
                    "Tensor? sinks=None) (csrc/aten/npu_native_functions_by_codegen.yaml:978, meta "
                    "_meta_registrations.py:288) without documenting it, 2.9.0 only return_softmax_lse to apply it "
                    "after the call, and kvcache neither emulates nor renders either; its indexer_types 'shared' "
                    "layers (3 of 4 by default) and its indexer RoPE on the last qk_rope_head_dim dims have no "
                    "template either"),
}


# Families whose 'indexed_attention' is not DSA (no kv_lora_rank): refused with what the device lacks.
NON_MLA_INDEXERS = {
    "kolibri1_1": IndexerFamily(
        "none", "none", f"{_TF}kolibri1_1/modeling_kolibri1_1.py:Kolibri1_1Indexer",
        device_refusal="its indexed layers (NoPE GQA) select over their own K cache with no indexer weights: NVFP4-rounded "
                "queries of the first index_num_heads heads against key head 0, first a pool of index_pool_size keys "
                "from blocks of index_compression averaged keys (its index_layers; the other indexed layers reuse "
                "it), then the top index_topk of that pool plus the first index_num_sink_tokens and last "
                f"index_num_local_tokens keys always kept ({_TF}kolibri1_1/modeling_kolibri1_1.py: "
                "Kolibri1_1Indexer.select_pool / select_tokens); npu_lightning_indexer returns the plain top "
                "sparse_count of sum_h weights_h * relu(q_h . k) over one key per token (torch_npu-2.14.0 "
                "_op_plugin_docs.py:1371, 2.9.0: :8752): no pool stage, no always-kept sink/local keys, no NVFP4 "
                "rounding"),
}


@dataclass(frozen=True)
class DsaFacts:
    """DeepSeek sparse attention: a lightning indexer picks ``index_topk`` cached keys per query.

    ``own_indexer[i]``: decoder layer i runs its own indexer and so writes its own indexer keys; a
    "shared" layer (GLM-5 ``indexer_types``) reuses the previous indexer layer's selection and keeps no
    indexer key cache.
    """

    index_topk: int
    index_n_heads: int
    index_head_dim: int
    own_indexer: tuple[bool, ...]
    sources: str
    rope: str = "half"  # INDEXER_FAMILIES: "half" | "interleave"
    rope_source: str = ""
    rope_dims: str = "first"  # INDEXER_FAMILIES: "first" | "last" qk_rope_head_dim dims of an indexer head
    # decoder layers that attend densely (layer_types beside 'indexed_attention', e.g. dots.llm3's sliding layers):
    # no indexer, no indexer key cache, no selection
    dense: tuple[int, ...] = ()


@dataclass(frozen=True)
class LayerHeads:
    """One decoder layer's attention shape where layers differ (transformers' ``per_layer_config``, Gemma-4's
    ``global_head_dim`` / ``num_global_key_value_heads`` on its full-attention layers)."""

    head_dim: int
    num_kv_heads: int


@dataclass(frozen=True)
class LayerMla:
    """One MLA decoder layer's own shape where layers differ (Dots3-Note's sliding layers: Dots3NoteTextAttention
    sizes its projections from ``config.per_layer_config[layer_idx]``): its query heads and latent / head dims."""

    num_attention_heads: int
    dims: MlaDims


# per_layer_config overrides kvcache reads per layer; any other attention field overridden per layer is refused
# (a per-layer window, head count or rope would be planned wrongly, silently); the rest (MLP, MoE) does not
# touch the cache and is left to the model.
PER_LAYER_HEAD_FIELDS = ("head_dim", "num_key_value_heads")
# On an MLA model, the fields that size a layer's latent cache, query heads and scale (every MLA dimension
# Dots3NoteTextAttention.__init__ reads off its layer's config): planned per layer (LayerMla).
PER_LAYER_MLA_FIELDS = ("num_attention_heads", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                        "qk_rope_head_dim", "v_head_dim")
PER_LAYER_REFUSED = ("num_attention_heads", "sliding_window", "layer_types", "attention_chunk_size",
                     "rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor",
                     "attn_logit_softcapping", "query_pre_attn_scalar", "use_sliding_window", "kv_lora_rank",
                     "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "attention_k_eq_v")


@dataclass(frozen=True)
class ModelFacts:
    path: str
    model_type: str
    family: str
    architectures: list[str]
    num_layers: Sourced[int]
    hidden_size: Sourced[int]
    num_attention_heads: Sourced[int]
    num_key_value_heads: Sourced[int]
    head_dim: Sourced[int]
    dtype: Sourced[str]
    vocab_size: int | None
    rms_norm_eps: Sourced[float | None]
    mla: Sourced[MlaDims | None]
    rope: Sourced[RopeInfo]
    layer_kinds: Sourced[tuple[str, ...]]  # per decoder layer: full | sliding | chunked | linear | parallel
    sliding_window: Sourced[int | None]
    attn_logit_softcapping: Sourced[float | None]
    alibi: Sourced[bool]
    attention_chunk_size: Sourced[int | None]
    has_sinks: Sourced[bool]
    num_mtp_layers: Sourced[int]
    sublayers_per_layer: Sourced[int]
    query_pre_attn_scalar: Sourced[float | None]
    notes: list[str] = field(default_factory=list)
    max_position_embeddings: Sourced[int | None] = Sourced(None, "default: not in config")
    attention_multiplier: Sourced[float | None] = Sourced(None, "default: none")
    dsa: Sourced[DsaFacts | None] = Sourced(None, "default: no index_topk (dense attention)")
    # the linear (recurrent-state) layers' family and sizes; None: no linear layers, or a family kvcache lacks
    linear: Sourced[LinearFacts | None] = Sourced(None, "default: no linear-attention layers")
    # DeepSeek-V4's compressed branches (analyzer/kinds/compressed.py); None: no compressed layers
    compressed: Sourced[compressed_kind.CompressedFacts | None] = Sourced(None, "default: no compressed layers")
    # Qwen4-Exp's QSA indexer on every attention layer (analyzer/kinds/qsa.py); None: no QSA
    qsa: Sourced[qsa_kind.QsaFacts | None] = Sourced(None, "default: no QSA indexer")
    # DiffLlama's differential attention (analyzer/kinds/diff.py); None: one value layout
    diff: Sourced[diff_kind.DiffFacts | None] = Sourced(None, "default: no differential attention")
    # what the config calls each block that holds no cache (Nemotron-H's "mlp" / "moe"), by block index
    block_names: dict[int, str] | None = None
    # the decoder of an encoder-decoder model (analyzer/kinds/cross.py); None: decoder-only
    cross: Sourced[cross_kind.CrossFacts | None] = Sourced(None, "default: decoder-only (no cross-attention)")
    # per decoder layer, only when some layer's head_dim or KV head count differs from the config's own
    layer_heads: Sourced[tuple[LayerHeads, ...] | None] = Sourced(None, "default: one head_dim and KV head count")
    # per decoder layer of an MLA model, only when some layer's query heads or MLA dims differ from the config's own
    layer_mla: Sourced[tuple[LayerMla, ...] | None] = Sourced(None, "default: one MLA shape for every layer")
    # per decoder layer: the earlier layer whose K/V cache it reads (None: it computes and caches its own), only
    # when the config shares caches across layers (Gemma-3n / Gemma-4 ``num_kv_shared_layers``)
    kv_sources: Sourced[tuple[int | None, ...] | None] = Sourced(None, "default: every layer caches its own K/V")
    # a drafter whose every layer reads its target model's K/V (Gemma-4 assistants, analyzer/kinds/drafter.py)
    drafter: Sourced[drafter_kind.DrafterFacts | None] = Sourced(None, "default: not a drafter")
    # value heads of another width than the key heads (MiMo-V2-Flash's v_head_dim 128 beside head_dim 192); None: equal
    v_head_dim: Sourced[int | None] = Sourced(None, "default: value heads as wide as key heads")
    # the layers whose attention keeps learnable sinks when only some do (MiMo-V2-Flash: its sliding layers); None:
    # every attention layer when has_sinks
    sink_layers: Sourced[tuple[int, ...] | None] = Sourced(None, "default: every attention layer when has_sinks")
    # a middle section run several times per forward, each loop with its own caches (Dory per_loop); None: once
    loops: Sourced[loops_kind.LoopFacts | None] = Sourced(None, "default: every decoder layer runs once")
    # a prefix block attended both ways where the request marks it (HRM-text's prefix_lm with token_type_ids == 1:
    # HrmTextModel.forward's block_sequence_ids mask at the first forward); the plan attends causally
    prefix_lm: Sourced[bool] = Sourced(False, "default: causal prompts")

    def kv_source_at(self, decoder_layer: int | None) -> int | None:
        sources = self.kv_sources.value
        return sources[decoder_layer] if sources and decoder_layer is not None else None

    def head_dim_at(self, decoder_layer: int | None) -> int:
        heads = self.layer_heads.value
        return heads[decoder_layer].head_dim if heads and decoder_layer is not None else self.head_dim.value

    def kv_heads_at(self, decoder_layer: int | None) -> int:
        heads = self.layer_heads.value
        return heads[decoder_layer].num_kv_heads if heads and decoder_layer is not None \
            else self.num_key_value_heads.value

    def mla_at(self, decoder_layer: int | None) -> MlaDims | None:
        """A layer's MLA dims: its own where per_layer_config sets them, else the model's (None: not MLA)."""
        layers = self.layer_mla.value
        return layers[decoder_layer].dims if layers and decoder_layer is not None else self.mla.value

    def heads_at(self, decoder_layer: int | None) -> int:
        """A layer's query heads: its own on a per-layer MLA shape, else the model's."""
        layers = self.layer_mla.value
        return layers[decoder_layer].num_attention_heads if layers and decoder_layer is not None \
            else self.num_attention_heads.value

    def qk_head_dim_at(self, decoder_layer: int | None) -> int:
        mla = self.mla_at(decoder_layer)
        return mla.qk_nope_head_dim + mla.qk_rope_head_dim if mla else self.head_dim.value

    def v_head_dim_at(self, decoder_layer: int | None) -> int:
        """The value head dim of a layer: v_head_dim where the model sets one, else its key head dim."""
        return self.v_head_dim.value or self.head_dim_at(decoder_layer)

    def has_sinks_at(self, decoder_layer: int | None) -> bool:
        layers = self.sink_layers.value
        return self.has_sinks.value and (layers is None or decoder_layer is None or decoder_layer in layers)

    def distinct_kv_heads(self) -> list[int]:
        heads = self.layer_heads.value
        return sorted({h.num_kv_heads for h in heads}) if heads else [self.num_key_value_heads.value]

    @property
    def attends(self) -> bool:
        """Some layer attends (has a KV cache); False for a pure state stack, whose attention fields are not read."""
        return any(attends(kind) for kind in self.layer_kinds.value)

    @property
    def is_mla(self) -> bool:
        return self.mla.value is not None

    @property
    def qk_head_dim(self) -> int:
        mla = self.mla.value
        return mla.qk_nope_head_dim + mla.qk_rope_head_dim if mla else self.head_dim.value

    def sources(self) -> dict[str, str]:
        # v_head_dim / sink_layers only where a model sets them: other manifests keep their bytes and hash
        optional = {name: getattr(self, name).source for name in ("v_head_dim", "sink_layers")
                    if getattr(self, name).value is not None}
        return {
            name: getattr(self, name).source
            for name in (
                "num_layers",
                "hidden_size",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "dtype",
                "rms_norm_eps",
                "mla",
                "rope",
                "layer_kinds",
                "sliding_window",
                "attn_logit_softcapping",
                "alibi",
                "attention_chunk_size",
                "has_sinks",
                "num_mtp_layers",
                "sublayers_per_layer",
                "max_position_embeddings",
            )
        } | optional


class _Reader:
    """Field lookup over a (possibly nested) config with the path of each hit recorded."""

    def __init__(self, where: str, outer: dict[str, Any]):
        self.where = where
        self.outer = outer
        self.defaults: tuple[str, dict[str, Any]] = ("", {})
        self.cfg, self.prefix = model_section(outer)

    def get(self, *names: str) -> tuple[Any, str] | None:
        """First present, non-null field among ``names`` (nested config first, then the outer one)."""
        for cfg, prefix in ((self.cfg, self.prefix), (self.outer, "")):
            for name in names:
                if name in cfg and cfg[name] is not None:
                    return cfg[name], f"{prefix}{name}"
            if cfg is self.outer:
                break
        for name in names:  # a field the config class names otherwise (XLM's emb_dim for hidden_size)
            alias = self.aliases.get(name)
            # an encoder-decoder class aliases the encoder's fields (WhisperConfig: num_key_value_heads ->
            # encoder_attention_heads); its causal LM is the decoder, whose own fields are named above
            if isinstance(alias, str) and alias not in names and not alias.startswith("encoder_") \
                    and self.cfg.get(alias) is not None:
                return self.cfg[alias], f"{self.prefix}{alias} (transformers {self.aliases_of}.attribute_map {name!r})"
        cls, defaults = self.defaults
        for name in names:
            if name in defaults and not self.has_key(name):
                return defaults[name], f"default: transformers {cls}.{name}"
        return None

    def derived(self, name: str, in_post_init: bool = False) -> tuple[Any, str] | None:
        """A field the config class computes rather than stores: ``attribute_map`` names a property of the class
        (RecurrentGemma: layer_types -> layers_block_type, cycled from block_types), or (``in_post_init``) a field its
        ``__post_init__`` fills when the config leaves it out (Zamba2's layers_block_type). Read from the config class
        built over this config's section (transformers is imported only then); None without transformers, the
        alias, or a build."""
        alias = self.aliases.get(name, name if in_post_init else None)  # a class may derive the field under its name
        if not isinstance(alias, str) or alias in self.cfg or not (in_post_init or alias in self._class.properties):
            return None
        try:
            from transformers import CONFIG_MAPPING

            cls = CONFIG_MAPPING[self._model_type]
            value = getattr(cls(**{k: v for k, v in self.cfg.items() if k != "model_type"}), alias)
        except Exception:  # noqa: BLE001 - a config the class rejects derives nothing here
            return None
        return (list(value), f"{self.prefix}{alias} (derived by transformers {cls.__name__}.{alias})") \
            if isinstance(value, (list, tuple)) else None

    def computed(self, name: str, maximum: int | None = None) -> Sourced[int] | None:
        """A field the file leaves out and the config class's ``__post_init__`` computes from others (JetMoE's
        ``num_attention_heads = num_key_value_heads * num_experts_per_tok``: its query experts' heads), read as it
        computes it. None when the file has the field (JetMoeConfig keeps a given one: its kwargs are set after) or
        the class computes no such field; the cross-check then compares the value with transformers' modules."""
        if self.has_key(name):
            return None
        try:
            hit = self._class.compute(name, lambda f: (self.get(f) or (None,))[0])
        except BadOperand as bad:
            operand, value = bad.args
            raise InputError(self.where, f"must be a positive integer, got {_shown(value)} (transformers "
                                         f"{self.aliases_of} computes {name} from it)",
                             field=(self.get(operand) or (None, operand))[1]) from None
        if hit is None:
            return None
        value, expr = hit
        src = f"{expr} (computed by transformers {self.aliases_of}.__post_init__)"
        if value <= 0:
            raise InputError(self.where, f"must be a positive integer, got {value}", field=src)
        _check_maximum(self.where, src, value, maximum)
        return Sourced(value, src)

    @property
    def _model_type(self) -> str:
        model_type = self.cfg.get("model_type") or self.outer.get("model_type")
        return HF_MODEL_TYPE.get(model_type, model_type) if isinstance(model_type, str) else ""

    @functools.cached_property
    def _class(self) -> ConfigClassFacts:
        """The config class's declarations, from its source file (analyzer/hf_config_source: no import)."""
        return config_class_facts(self._model_type)

    @property
    def aliases(self) -> dict[str, str]:
        """The config class's ``attribute_map`` (PretrainedConfig: a standard name -> the field this class keeps it
        in); empty without transformers or for a model type it does not ship."""
        return self._class.attribute_map

    @property
    def aliases_of(self) -> str:
        return self._class.name

    def has_key(self, name: str) -> bool:
        return name in self.cfg or name in self.outer

    def positive_int(self, *names: str, required: bool = True, maximum: int | None = None) -> Sourced[int] | None:
        hit = self.get(*names)
        if hit is None:
            if required:
                raise InputError(self.where, f"missing (looked for {', '.join(names)})", field=names[0])
            return None
        value, src = hit
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InputError(self.where, f"must be a positive integer, got {_shown(value)}", field=src)
        _check_maximum(self.where, src, value, maximum)
        return Sourced(value, src)

    def number(self, *names: str, kind: type = float, minimum: float | None = None,
               maximum: float | None = None) -> Sourced | None:
        """Optional numeric field: None when absent, ``InputError`` when present but not a number.

        ``kind=int`` also rejects fractional values; ``minimum`` and ``maximum`` are inclusive.
        """
        hit = self.get(*names)
        if hit is None:
            return None
        value, src = hit
        return Sourced(kind(checked_number(self.where, src, value, kind, minimum, maximum)), src)

    def flag(self, *names: str) -> tuple[bool, str] | None:
        """Optional boolean field: a JSON ``true``/``false``; any other value (``"true"``, 1) is refused,
        because reading it as either would change the design silently."""
        return self._typed(names, bool, "true or false")

    def mapping(self, *names: str) -> tuple[dict[str, Any], str] | None:
        """Optional object field; a value of another JSON type is refused naming its path."""
        return self._typed(names, dict, "a JSON object")

    def _typed(self, names: tuple[str, ...], kind: type, what: str) -> tuple[Any, str] | None:
        hit = self.get(*names)
        if hit is None:
            return None
        value, src = hit
        if not isinstance(value, kind):
            got = _shown(value) if kind is bool else f"{_json_type(value)} {_shown(value)}"
            raise InputError(self.where, f"must be {what}, got {got}", field=src)
        return value, src


# Families whose attention adds a learnable per-head sink logit to the softmax denominator (FA v2's
# learnable_sink): no config field says so, their transformers modeling code does.
SINK_FAMILIES = {
    "gpt_oss": "",  # the first one planned: its manifests' source text (and hashes) unchanged
    "flint": ": FlintAttention.sinks, an extra softmax logit",
    "granite_swa": ": GraniteSWAAttention.sinks, sigmoid(logsumexp - sink) scaling = an extra softmax logit",
    "granitemoe_swa": ": GraniteMoeSWAAttention.sinks, sigmoid(logsumexp - sink) scaling = an extra softmax logit",
}

class SlidingLayerRule(NamedTuple):
    """How a family's sliding-window layers differ from its full ones where no config field says so."""

    kv_factor: int  # their KV heads = num_key_value_heads x this
    sinks_only: bool  # learnable sinks on the sliding layers only
    source: str  # the transformers code that says so


SLIDING_LAYER_RULES = {
    "mimo_v2_flash": SlidingLayerRule(2, True, "transformers MiMoV2FlashAttention.__init__: is_swa -> "
                                               "num_key_value_heads * 2 and sinks, full layers num_key_value_heads "
                                               "and sinks None"),
}


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(type(value), "a number")


def _shown(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _check_maximum(where: str, src: str, value: float, maximum: float | None) -> None:
    if maximum is not None and value > maximum:
        raise InputError(where, f"must be at most {maximum:,} (far beyond any published model: a typo?), "
                                f"got {_shown(value)}", field=src)


def checked_number(where: str, src: str, value: Any, kind: type = float, minimum: float | None = None,
                   maximum: float | None = None, above: float | None = None) -> float:
    """``value`` if it is a finite number of ``kind`` within the bounds, else one ``InputError`` naming
    ``src`` (its JSON path). ``minimum``/``maximum`` are inclusive, ``above`` exclusive. A number
    written as a string ("40") is refused: reading it as absent would silently change the design."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and kind is int:
        ok = float(value).is_integer()
    if not ok:
        what = "an integer" if kind is int else "a number"
        if isinstance(value, float) and not math.isfinite(value):  # JSON's NaN / Infinity: "a number" misleads
            raise InputError(where, f"must be a finite number, got {_shown(value)}", field=src)
        raise InputError(where, f"must be {what}, got {_json_type(value)} {_shown(value)}", field=src)
    if minimum is not None and value < minimum:
        raise InputError(where, f"must be >= {minimum:g}, got {value!r}", field=src)
    if above is not None and value <= above:
        raise InputError(where, f"must be > {above:g}, got {value!r}", field=src)
    _check_maximum(where, src, value, maximum)
    return value


def model_section(data: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The language model's own fields: a nested text/language section when there is one."""
    for nested in NESTED_SECTIONS:
        inner = data.get(nested)
        # a decoder section may name its stack decoder_layers (TrOCR's, in a VisionEncoderDecoderConfig)
        keys = ("hidden_size", "num_hidden_layers") + (("decoder_layers",) if nested == "decoder" else ())
        if isinstance(inner, dict) and any(k in inner for k in keys):
            return inner, f"{nested}."
    return data, ""


def read_config_file(path: str | Path) -> tuple[str, dict[str, Any]]:
    """Load ``config.json`` (or a model dir holding one); bad files become ``InputError``.

    A ``.yaml``/``.yml`` file with the same keys is accepted too (configs re-saved as YAML).
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    where = str(p)
    text = read_input_text(p)  # UTF-8, or UTF-16/32 by its byte-order mark (saved by Windows editors)
    if p.suffix.lower() in (".yaml", ".yml"):
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            at = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
            raise InputError(where, f"invalid YAML{at}: {getattr(exc, 'problem', None) or exc}") from None
        except RecursionError:
            raise InputError(where, "invalid YAML: nested too deeply") from None
        kind = "YAML mapping"
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(where, json_syntax_problem(exc)) from None
        except RecursionError:
            raise InputError(where, "invalid JSON: nested too deeply") from None
        kind = "JSON object"
    if not isinstance(data, dict):
        raise InputError(where, f"top level must be a {kind}")
    return where, data


def load_model_facts(path: str | Path) -> ModelFacts:
    where, data = read_config_file(path)
    return normalize_config(data, where)


def normalize_config(data: dict[str, Any], where: str = "config.json") -> ModelFacts:
    _check_sections(data, where)
    data = _dory_layers(data)
    r = _Reader(where, data)
    notes: list[str] = []
    model_type = _model_type(r)
    family = FAMILY_OF.get(model_type, model_type)
    r.defaults = FAMILY_DEFAULTS.get(family, ("", {}))
    architectures = _architectures(r)

    blocks = block_types(r, model_type)
    # HRM-text: two stacks called in cycles, num_hidden_layers counting the calls' cache slots (analyzer/kinds/loops)
    cycled = loops_kind.hrm_stacks(r.get, where)
    if model_type == "longcat_flash" and r.get("num_layers") and not r.get("num_hidden_layers"):
        # LongCat-Flash: `num_layers` decoder layers, each with two attention sublayers.
        num_layers = r.positive_int("num_layers", maximum=LIMITS["layers"])
        sublayers = Sourced(2, "model_type longcat_flash (two attention sublayers per decoder layer)")
    elif cycled is not None:  # the decoder layers are the two stacks' modules; each call its own cache layer
        num_layers = Sourced(2 * cycled[0], f"2 stacks x num_layers_per_stack ({cycled[3]})")
        sublayers = Sourced(1, "default: one attention per decoder layer")
    elif blocks is not None:  # Nemotron-H: the layer count is the block list's length
        num_layers = Sourced(len(blocks[0]), f"len({blocks[1]})")
        _check_maximum(where, num_layers.source, num_layers.value, LIMITS["layers"])
        sublayers = Sourced(1, "default: one mixer per decoder block")
    else:
        # decoder_layers: a decoder-only use of an encoder-decoder family (BART's ForCausalLM), whose own stack it is
        if byte_patches_kind.is_blt(r.cfg):  # BLT: four stacks, planned by `kvcache analyze` (build.py), not here
            raise byte_patches_kind.refusal(byte_patches_kind.read_facts(r.cfg, where), where)
        _refuse_composite(r)
        num_layers = r.positive_int("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers",
                                    "num_decoder_layers", maximum=LIMITS["layers"])
        sublayers = Sourced(1, "default: one attention per decoder layer")
        if model_type in PARALLEL_HYBRIDS:  # Falcon-H1: the attention's KV cache and the mixer's states
            sublayers = Sourced(2, f"model_type {model_type} (attention and a Mamba-2 mixer side by side: two "
                                   "sublayers per decoder layer)")
        if model_type in CCA_HYBRIDS:  # ZAYA: each attention's KV cache, then its CCA projection's states
            sublayers = Sourced(2, f"model_type {model_type} (an attention whose CCA projection keeps a conv state and "
                                   "a delayed value: two sublayers per decoder layer)")
        if model_type in SHARED_BLOCK_HYBRIDS:  # Zamba / Zamba2: a hybrid layer's KV cache and its mixer's states
            mixer = "Mamba-2" if model_type == "zamba2" else "multi-head Mamba-1"
            sublayers = Sourced(2, f"model_type {model_type} (a hybrid layer: the shared transformer block's "
                                   f"attention, then its {mixer} mixer: two sublayers; a Mamba layer its mixer only)")

    hidden = r.positive_int("hidden_size", "n_embd", "d_model", maximum=LIMITS["hidden_size"])
    linear_family = family_of_linear(lambda name: r.get(name), model_type, architectures, where)
    compressed = compressed_kind.read_facts(r.get, where, num_layers.value)
    if compressed is None:
        layer_kinds, sliding_window = _layer_kinds(r, model_type, num_layers.value, linear_family, blocks)
    else:
        # every compressed-model layer attends through its window branch; the compressed branch rides beside it
        layer_kinds = Sourced(("sliding",) * num_layers.value, compressed.source)
        sliding_window = Sourced(compressed.window, compressed.window_source)
    cross = cross_kind.read_facts(r.get, r.cfg, where, num_layers.value)
    if cross is not None and cross.only_layers is not None:
        # Mllama: a cross-attention-only block keeps no self-attention cache (its vision K/V: the cross_attention
        # section), so the cache layers skip it as they skip an MLP-only block
        layer_kinds = Sourced(tuple(NO_CACHE if i in cross.only_layers else kind
                                    for i, kind in enumerate(layer_kinds.value)),
                              f"{layer_kinds.source}; {cross.source.split(' (')[0]}: cross-attention only")
    if not any(attends(kind) for kind in layer_kinds.value):
        # a pure state stack (Mamba, Mamba2, ...): no layer attends, so no attention field is read (Mamba2Config's
        # num_heads / head_dim are its mixer's, read by the linear family below)
        heads = kv_heads = head_dim = Sourced(0, f"not read: no layer attends ({layer_kinds.source})")
        mla = Sourced(None, "not read: no layer attends")
    else:
        heads = r.computed("num_attention_heads", maximum=LIMITS["heads"]) or r.positive_int(
            "num_attention_heads", "n_head", "num_heads", "n_heads", "attention_heads", "decoder_attention_heads",
            "num_decoder_attention_heads", maximum=LIMITS["heads"])
        kv_heads = _kv_heads(r, heads)
        mla = _mla_dims(r)
        head_dim = _head_dim(r, hidden, heads, mla, model_type)
    v_head_dim = _value_head_dim(r, head_dim) if heads.value and mla.value is None else Sourced(
        None, "default: value heads as wide as key heads")
    if heads.value and (kv_heads.value > heads.value or heads.value % kv_heads.value):
        raise InputError(
            where,
            f"{heads.value} query heads are not a multiple of {kv_heads.value} KV heads",
            field=kv_heads.source,
        )
    if model_type in SHARED_BLOCK_HYBRIDS:
        _refuse_adapter_widths(r, hidden, heads, kv_heads, head_dim)

    dtype = _dtype(r)
    eps = r.number("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "norm_eps", minimum=0) or Sourced(
        None, "default: not in config")
    rope = _rope(r)
    qsa = qsa_kind.read_facts(r.get, where, model_type, head_dim.value, r.prefix)
    diff = diff_kind.read_facts(r.get, where, model_type, kv_heads.value, kv_heads.source)
    linear = _linear(r, linear_family, layer_kinds, heads, model_type, hidden.value)
    raw_types = blocks[0] if blocks else (r.get("layer_types") or (None,))[0]
    block_names = ({i: t for i, (t, k) in enumerate(zip(raw_types, layer_kinds.value, strict=False)) if k == NO_CACHE}
                   or None) if isinstance(raw_types, list) else None
    if cross is not None and cross.only_layers is not None:
        block_names = dict.fromkeys(cross.only_layers, cross_kind.ONLY_BLOCK)

    softcap = r.number("attn_logit_softcapping") or Sourced(None, "default: none")
    alibi = _alibi(r, model_type)
    chunk_hit = r.number("attention_chunk_size", kind=int, minimum=1)
    chunk = chunk_hit if chunk_hit and "chunked" in layer_kinds.value else Sourced(None, "default: none")
    sliding_rule = SLIDING_LAYER_RULES.get(family)
    sliding_layers = tuple(i for i, kind in enumerate(layer_kinds.value) if kind == "sliding")
    sinks = (
        Sourced(True, f"model_type {model_type} (learnable sinks in every attention layer{SINK_FAMILIES[family]})")
        if family in SINK_FAMILIES
        else Sourced(True, f"model_type {model_type} (learnable sinks on its sliding layers: {sliding_rule.source})")
        if sliding_rule and sliding_rule.sinks_only and sliding_layers
        else Sourced(True, "compressed attention (DeepSeek-V4): DeepseekV4Attention.sinks, upstream attn_sink")
        if compressed is not None
        else Sourced(False, "default: no sinks for this family")
    )
    mtp = r.number("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers", kind=int,
                   minimum=0, maximum=LIMITS["mtp_layers"]) or Sourced(0, "default: no MTP layers")
    qpas = r.number("query_pre_attn_scalar") or Sourced(None, "default: none")
    multiplier = r.number("attention_multiplier") or Sourced(None, "default: none")
    if multiplier.value is not None and multiplier.value <= 0:
        raise InputError(where, f"must be positive, got {multiplier.value!r}", field=multiplier.source)
    if qpas.value is not None and qpas.value <= 0:
        raise InputError(where, f"must be positive, got {qpas.value!r}", field=qpas.source)
    # a compressed model's index_* fields are its CSA indexer's (ModelFacts.compressed), not DSA's
    dsa = _dsa(r, mla, num_layers.value, model_type) if compressed is None else Sourced(
        None, "compressed attention: the indexer is CSA's")
    layer_heads = _layer_heads(r, num_layers.value, layer_kinds.value, head_dim, kv_heads, heads, mla, sliding_rule)
    layer_mla = _layer_mla(r, num_layers.value, heads, mla)
    sink_layers = Sourced(sliding_layers, sinks.source) if sliding_rule and sliding_rule.sinks_only and sliding_layers \
        else Sourced(None, "default: every attention layer when has_sinks")
    kv_sources = _kv_sources(r, num_layers.value, layer_kinds.value)
    shared = r.number("num_kv_shared_layers", kind=int, minimum=0, maximum=LIMITS["layers"])
    drafter = drafter_kind.read_facts(r.get, (shared.value, shared.source), num_layers.value, layer_kinds.value,
                                      where) if shared else None
    vocab = r.number("vocab_size", "padded_vocab_size", kind=int, minimum=1, maximum=LIMITS["vocab_size"])
    max_pos = r.number("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length",
                       kind=int, minimum=1, maximum=LIMITS["positions"]) or Sourced(None, "default: not in config")

    # Dory: its saved layer counts are halved above (_dory_layers), as DoryConfig.__post_init__ does
    loops = loops_kind.read_facts(r.get, where, num_layers.value) if model_type == "dory" else \
        loops_kind.hrm_facts(*cycled) if cycled is not None else None

    return ModelFacts(
        path=where,
        model_type=model_type,
        family=family,
        architectures=architectures,
        num_layers=num_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        vocab_size=vocab.value if vocab else None,
        rms_norm_eps=eps,
        mla=mla,
        rope=rope,
        layer_kinds=layer_kinds,
        layer_heads=layer_heads,
        layer_mla=layer_mla,
        v_head_dim=v_head_dim,
        sink_layers=sink_layers,
        kv_sources=kv_sources,
        drafter=Sourced(drafter, drafter.source if drafter else "default: not a drafter"),
        sliding_window=sliding_window,
        attn_logit_softcapping=softcap,
        alibi=alibi,
        attention_chunk_size=chunk,
        has_sinks=sinks,
        num_mtp_layers=mtp,
        sublayers_per_layer=sublayers,
        query_pre_attn_scalar=qpas,
        notes=notes,
        max_position_embeddings=max_pos,
        attention_multiplier=multiplier,
        dsa=dsa,
        linear=linear,
        block_names=block_names,
        compressed=Sourced(compressed, compressed.source) if compressed else Sourced(
            None, "default: no compressed layers"),
        qsa=Sourced(qsa, qsa.source) if qsa else Sourced(None, "default: no QSA indexer"),
        diff=Sourced(diff, diff.source) if diff else Sourced(None, "default: no differential attention"),
        cross=Sourced(cross, cross.source) if cross else Sourced(None, "default: decoder-only (no cross-attention)"),
        loops=Sourced(loops, loops.source) if loops else Sourced(None, "default: every decoder layer runs once"),
        prefix_lm=Sourced(True, prefix[1]) if (prefix := r.get("prefix_lm")) and prefix[0] is True else Sourced(
            False, "default: causal prompts"),
    )


def _refuse_adapter_widths(r: _Reader, hidden: Sourced[int], heads: Sourced[int], kv_heads: Sourced[int],
                           head_dim: Sourced[int]) -> None:
    """Zamba2 with ``use_shared_attention_adapter``: Zamba2Attention adds each LoRA adapter's output, of
    attention_hidden_size = 2 x hidden_size, to q_proj (heads x head_dim) and k_proj / v_proj (KV heads x head_dim)
    (transformers/models/zamba2/modeling_zamba2.py), so transformers' model runs only where those widths agree
    (KV heads = heads under the derived head_dim): bad input, the field named."""
    adapters = r.flag("use_shared_attention_adapter")
    if not adapters or adapters[0] is not True:
        return
    width = 2 * hidden.value
    for name, n in ((heads.source, heads.value), (kv_heads.source, kv_heads.value)):
        if n * head_dim.value != width:
            raise InputError(r.where, f"{n} heads x head_dim {head_dim.value} = {n * head_dim.value} is not "
                                      f"attention_hidden_size 2 x hidden_size = {width}: with {adapters[1]} true, "
                                      "transformers' Zamba2Attention adds adapter outputs of that width to these "
                                      "projections and does not run", field=name)


def _refuse_composite(r: _Reader) -> None:
    """A config with no layer count of its own whose nested sub-model sections hold one each: a composite model,
    several stacks each with its own config, not one decoder kvcache can plan. Refused naming the sections. (BLT's four
    stacks are read before this: planned by `kvcache analyze`, analyzer/kinds/byte_patches.py; a composite whose causal
    LM is its ``decoder`` section, MusicGen's, is read from that section: NESTED_SECTIONS.)"""
    if r.get("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "num_decoder_layers"):
        return
    layered = ("num_hidden_layers", "num_layers", "n_layers", "decoder_layers")
    subs = [k for k, v in r.cfg.items() if isinstance(v, dict) and any(isinstance(v.get(n), int) for n in layered)]
    if not subs:
        return
    raise NotSupportedByKvcache(
        r.where, f"no layer count at the top level: a composite model whose sub-model sections "
                 f"{', '.join(subs)} each hold their own stack's config (several stacks, not one decoder kvcache "
                 f"plans)", field=f"{r.prefix}num_hidden_layers")


def _value_head_dim(r: _Reader, head_dim: Sourced[int]) -> Sourced[int | None]:
    """A GQA model whose value heads are narrower or wider than its key heads (MiMo-V2-Flash: ``v_head_dim`` 128 beside
    ``head_dim`` 192, transformers' v_proj / o_proj sized by it): its V cache is that wide, and FA takes it where the op
    docs list the pair (analyzer/kinds/gqa.py, fa_facts.VALUE_DIM_PAIRS). None where the two are equal."""
    hit = r.positive_int("v_head_dim", required=False, maximum=LIMITS["head_dim"])
    if hit is None or hit.value == head_dim.value:
        return Sourced(None, "default: value heads as wide as key heads")
    return hit


def _dory_layers(data: dict[str, Any]) -> dict[str, Any]:
    """A saved Dory config lists an "mlp" block after every attention block and doubles its layer counts
    (DoryConfig.to_dict); DoryConfig.__post_init__ reads every other entry and halves the counts: the same here."""
    types = data.get("layer_types")
    if data.get("model_type") != "dory" or not isinstance(types, list) or "mlp" not in types:
        return data
    out = {**data, "layer_types": types[::2]}
    for key in ("num_hidden_layers", "n_input_layers", "n_output_layers", "n_recurrent_layers"):
        if isinstance(data.get(key), int) and not isinstance(data.get(key), bool):
            out[key] = data[key] // 2
    return out


def _linear(r: _Reader, family: tuple[str, str] | None, kinds: Sourced[tuple[str, ...]], heads: Sourced[int],
            model_type: str, hidden: int) -> Sourced[LinearFacts | None]:
    """The linear layers' family and sizes (analyzer.linear_config), when the config has linear layers."""
    if not any(holds_state(kind) for kind in kinds.value):
        return Sourced(None, "default: no linear-attention layers")
    if family is None:
        return Sourced(None, f"model_type {model_type}: no linear-attention family kvcache knows")
    # Ling-3.0 (KDA bailing_hybrid) sizes its linear heads by the config's own head_dim (transformers copies it to
    # linear_head_dim before overwriting head_dim with qk_rope_head_dim); Ling-2.5 the same field.
    head_dim = r.get("head_dim") if model_type in ("bailing_hybrid", "minimax") else None
    facts = read_linear(r, family[0], family[1], heads.value, head_dim, LIMITS, hidden, model_type)
    return Sourced(facts, facts.source)


def _kv_heads(r: _Reader, heads: Sourced[int]) -> Sourced[int]:
    explicit = r.positive_int(
        "num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num", required=False,
        maximum=LIMITS["heads"],
    )
    new_arch = r.flag("new_decoder_architecture")
    if new_arch and new_arch[0] is True and explicit:
        return explicit  # Falcon-40B style: num_kv_heads is authoritative
    multi_query = r.flag("multi_query")
    if multi_query and multi_query[0] is True and not (new_arch and new_arch[0] is True):
        return Sourced(1, f"{multi_query[1]}=true (one shared KV head)")
    if explicit:
        return explicit
    attn_cfg = r.mapping("attn_config")  # DBRX keeps its attention fields in a nested object
    if attn_cfg and attn_cfg[0].get("kv_n_heads") is not None:
        kv = attn_cfg[0]["kv_n_heads"]
        if not (isinstance(kv, int) and not isinstance(kv, bool) and 0 < kv <= LIMITS["heads"]):
            raise InputError(r.where, f"must be a positive integer, got {_shown(kv)}", field=f"{attn_cfg[1]}.kv_n_heads")
        return Sourced(kv, f"{attn_cfg[1]}.kv_n_heads")
    return Sourced(heads.value, f"default: = {heads.source} (no KV-head field, MHA)")


def _mla_dims(r: _Reader) -> Sourced[MlaDims | None]:
    hit = r.get("kv_lora_rank")
    if hit is None:
        return Sourced(None, "default: no kv_lora_rank (not MLA)")
    need = {}
    for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        need[name] = r.positive_int(name, maximum=LIMITS["mla_dim"]).value
    # null: plain q_proj (DeepSeek-V2-Lite)
    q_lora = r.number("q_lora_rank", kind=int, minimum=1, maximum=LIMITS["mla_dim"])
    dims = MlaDims(
        kv_lora_rank=r.positive_int("kv_lora_rank", maximum=LIMITS["mla_dim"]).value,
        q_lora_rank=q_lora.value if q_lora else None,
        **need,
    )
    return Sourced(dims, f"{hit[1]} (+ qk_nope_head_dim, qk_rope_head_dim, v_head_dim, q_lora_rank)")


def _dsa(r: _Reader, mla: Sourced[MlaDims | None], num_layers: int, model_type: str) -> Sourced[DsaFacts | None]:
    """DSA from ``index_topk`` / ``index_n_heads`` / ``index_head_dim`` (+ GLM-5's ``indexer_types``, and
    ``layer_types``: only 'indexed_attention' layers run an indexer when dense layers sit beside them), with the
    family's indexer facts from ``INDEXER_FAMILIES``."""
    topk = r.positive_int("index_topk", required=False, maximum=LIMITS["positions"])
    if topk is None:
        return Sourced(None, "default: no index_topk (dense attention)")
    family = INDEXER_FAMILIES.get(model_type) or NON_MLA_INDEXERS.get(model_type)
    if family is not None and family.device_refusal:
        raise InputError(r.where, f"index_topk on model_type {model_type!r}: no pinned torch_npu op serves it: "
                                  f"{family.device_refusal}", field="model_type")
    if family is not None and family.kvcache_gap:
        raise NotSupportedByKvcache(r.where, f"the sparse attention of model_type {model_type!r}: {family.kvcache_gap} "
                                             f"(indexer: {family.source})", field="model_type")
    if mla.value is None:
        raise InputError(r.where, "index_topk without kv_lora_rank: DeepSeek sparse attention is known over MLA "
                                  "only (DeepSeek-V3.2, GLM-5); kvcache does not know this layout", field=topk.source)
    if family is None:
        # The indexer's RoPE layout is the family's code, not a config field: guessing it would rotate the wrong
        # pairs of every indexer query and key (a wrong selection, no error).
        raise InputError(r.where, f"index_topk on model_type {model_type!r}: kvcache knows the DSA indexer of "
                                  f"{', '.join(sorted(INDEXER_FAMILIES))} only (its RoPE layout is the family's "
                                  "code)", field="model_type")
    types_hit = r.get("layer_types")
    if family.typed_layers and types_hit is not None and isinstance(types_hit[0], list) \
            and "indexed_attention" not in types_hit[0]:
        return Sourced(None, f"{types_hit[1]}: no 'indexed_attention' layer, so no indexer ({family.typed_layers})")
    heads = r.positive_int("index_n_heads", maximum=LIMITS["heads"])
    dim = r.positive_int("index_head_dim", maximum=LIMITS["head_dim"])
    rope = mla.value.qk_rope_head_dim
    if dim.value < rope:
        raise InputError(r.where, f"{dim.value} is smaller than qk_rope_head_dim {rope}: the indexer rotates "
                                  f"the {family.rope_dims} qk_rope_head_dim dims of its keys", field=dim.source)
    dense: tuple[int, ...] = ()
    # only a family that builds its indexer by layer type attends densely elsewhere (A.X-K2 builds it on every
    # layer, whatever its layer_types say: the cross-check compares each module's indexer with the plan)
    if family.typed_layers and types_hit is not None and isinstance(types_hit[0], list) \
            and "indexed_attention" in types_hit[0]:
        dense = tuple(i for i, t in enumerate(types_hit[0]) if t != "indexed_attention")
    own, how = tuple(i not in dense for i in range(num_layers)), "every layer runs its indexer"
    if dense:
        how = (f"{types_hit[1]}: {num_layers - len(dense)} 'indexed_attention' layers run their indexer, "
               f"{len(dense)} attend densely")
    hit = r.get("indexer_types")
    if hit is not None:
        raw, src = hit
        if not isinstance(raw, list) or len(raw) != num_layers:
            raise InputError(r.where, f"must list one indexer type per layer ({num_layers}), got {_shown(raw)}",
                             field=src)
        for i, t in enumerate(raw):
            if t not in ("full", "shared"):
                raise InputError(r.where, f"must be 'full' or 'shared', got {_shown(t)}", field=f"{src}[{i}]")
        if raw[0] == "shared":
            raise InputError(r.where, "the first layer cannot reuse a previous layer's selection", field=f"{src}[0]")
        own = tuple(t == "full" and i not in dense for i, t in enumerate(raw))
        how = f"{src}: {sum(own)} layers run their indexer, {num_layers - sum(own)} reuse the previous selection"
    facts = DsaFacts(index_topk=topk.value, index_n_heads=heads.value, index_head_dim=dim.value, own_indexer=own,
                     sources=f"{topk.source}, {heads.source}, {dim.source}; {how}", rope=family.rope,
                     rope_source=family.source, rope_dims=family.rope_dims, dense=dense)
    return Sourced(facts, topk.source)


def _head_dim(r: _Reader, hidden: Sourced[int], heads: Sourced[int], mla: Sourced[MlaDims | None],
              model_type: str = "") -> Sourced[int]:
    if mla.value is not None:
        d = mla.value.qk_nope_head_dim + mla.value.qk_rope_head_dim
        return Sourced(d, "qk_nope_head_dim + qk_rope_head_dim (MLA)")
    explicit = r.positive_int("head_dim", required=False, maximum=LIMITS["head_dim"])
    if explicit:
        return explicit
    if model_type in SHARED_BLOCK_HYBRIDS:
        # Zamba's / Zamba2's shared block attends over concat(hidden, embeddings): ZambaConfig / Zamba2Config
        # .__post_init__ derive attention_head_dim = 2 x hidden_size // num_attention_heads (a saved one wins: read above)
        cls = "Zamba2Config" if model_type == "zamba2" else "ZambaConfig"
        return Sourced(2 * hidden.value // heads.value, f"default: 2 x {hidden.source} // {heads.source} "
                                                        f"(transformers {cls}.__post_init__ attention_head_dim)")
    if hidden.value % heads.value:
        # transformers' modeling code computes `hidden_size // num_attention_heads` (floor) and builds projections of
        # heads * that width, narrower than the hidden size: plan what it builds, say so; the FA head-dim rule judges it.
        return Sourced(hidden.value // heads.value,
                       f"default: {hidden.source} // {heads.source} = {hidden.value} // {heads.value} (floor, as "
                       f"transformers' attention modules compute it; {hidden.value} is not a multiple of {heads.value})")
    return Sourced(hidden.value // heads.value, f"default: {hidden.source} / {heads.source}")


# torch dtypes a config may name that are not cache dtypes (quantized checkpoints, "auto"): the cache
# plan falls back to bfloat16 and says so. Anything else is a typo and refused.
_OTHER_DTYPES = ("auto", "fp8", "float8", "fp4", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "int8", "uint8",
                 "float64", "double", "int4", "int32")


def config_dtype(cfg: dict[str, Any], where: str) -> Sourced[str]:
    """The model dtype a config states (torch_dtype / dtype), read as every config's is: for a config kept off the
    one-stack path (BLT's stacks: analyzer/kinds/byte_patch_section.py)."""
    return _dtype(_Reader(where, cfg))


def _dtype(r: _Reader) -> Sourced[str]:
    hit = r.get("torch_dtype", "dtype")
    if hit is None:
        return Sourced("bfloat16", "default: bfloat16 (config names no dtype)")
    raw, src = hit
    if not isinstance(raw, str):
        raise InputError(r.where, f"must be a dtype name such as \"bfloat16\", got {_shown(raw)}", field=src)
    name = raw.replace("torch.", "").lower()
    value = _DTYPES.get(name)
    if value is None:
        if name not in _OTHER_DTYPES:
            raise InputError(r.where, f"unknown dtype {raw!r} (expected one of {', '.join(sorted(_DTYPES))})",
                             field=src)
        return Sourced("bfloat16", f"default: bfloat16 ({src}={raw!r} is not a cache dtype)")
    return Sourced(value, src)


def _rope(r: _Reader) -> Sourced[RopeInfo]:
    """The rope of the full-attention layers, every nested field checked where it is read.

    A malformed ``rope_scaling`` (a list, a string, ``"factor": "40"``, a factor <= 0) is refused
    naming its JSON path: read as "no scaling" it would silently drop YaRN's mscale from the softmax
    scale (DeepSeek-V3: 0.1352 -> 0.0722).
    """
    hit = r.get("rope_scaling", "rope_parameters")
    if hit is None:
        return Sourced(RopeInfo(rope_type="default"), "default: no rope_scaling/rope_parameters")
    raw, src = hit
    if not isinstance(raw, dict):
        raise InputError(r.where, f"must be a JSON object (e.g. {{\"rope_type\": \"yarn\", \"factor\": 40}}) or "
                                  f"null, got {_json_type(raw)} {_shown(raw)}", field=src)
    per_layer_type = {k: v for k, v in raw.items() if k in _LAYER_TYPE_KIND}
    if per_layer_type:  # transformers v5: one rope per layer type; null: that layer type has none (Beam's NoPE)
        for name, entry in per_layer_type.items():
            if not isinstance(entry, dict) and entry is not None:
                raise InputError(r.where, f"must be a JSON object or null, got {_json_type(entry)} {_shown(entry)}",
                                 field=f"{src}.{name}")
            if entry is not None:
                _rope_entry(r.where, entry, f"{src}.{name}")
        roped = [name for name, entry in per_layer_type.items() if entry is not None]
        if not roped:
            return Sourced(RopeInfo(rope_type="default"), f"{src}: null for every layer type (no RoPE)")
        name = "full_attention" if "full_attention" in roped else roped[0]
        raw, src = per_layer_type[name], f"{src}.{name}"
    info, key = _rope_entry(r.where, raw, src)
    return Sourced(info, f"{src}.{key}")


def _rope_entry(where: str, raw: dict[str, Any], src: str) -> tuple[RopeInfo, str]:
    key = "rope_type" if "rope_type" in raw else "type"
    kind = raw.get(key)
    if kind is None:
        kind = "default"
    if not isinstance(kind, str) or kind not in ROPE_TYPES:
        raise InputError(where, f"unknown rope type {_shown(kind)} (kvcache knows {', '.join(ROPE_TYPES)})",
                         field=f"{src}.{key}")

    def num(name: str, **bounds) -> float | None:
        value = raw.get(name)
        return None if value is None else float(checked_number(where, f"{src}.{name}", value, **bounds))

    factor = num("factor", above=0)
    if kind in _SCALED_ROPE:
        if factor is None:
            raise InputError(where, f"missing: rope type {kind!r} scales by a factor", field=f"{src}.factor")
        if factor < 1:
            raise InputError(where, f"must be >= 1 for rope type {kind!r} (transformers' rope validation), "
                                    f"got {raw['factor']!r}", field=f"{src}.factor")
    for name in ("beta_fast", "beta_slow", "low_freq_factor", "high_freq_factor"):
        num(name)
    num("rope_theta", above=0)
    num("attention_factor", above=0)
    num("partial_rotary_factor", above=0, maximum=1)
    for name, kind_of in (("short_factor", float), ("long_factor", float), ("mrope_section", int)):
        values = raw.get(name)
        if values is None:
            continue
        if not isinstance(values, list):
            raise InputError(where, f"must be a list of numbers, got {_json_type(values)} {_shown(values)}",
                             field=f"{src}.{name}")
        for i, v in enumerate(values):
            checked_number(where, f"{src}.{name}[{i}]", v, kind_of)
    orig = raw.get("original_max_position_embeddings")
    if orig is not None:
        orig = int(checked_number(where, f"{src}.original_max_position_embeddings", orig, int, minimum=1,
                                  maximum=LIMITS["positions"]))
    info = RopeInfo(
        rope_type=kind,
        factor=factor,
        mscale=num("mscale", minimum=0),
        mscale_all_dim=num("mscale_all_dim", minimum=0),
        original_max_position_embeddings=orig,
    )
    return info, key


def _check_sections(data: dict[str, Any], where: str) -> None:
    """A nested language-model section of the wrong type would be skipped and the outer fields read."""
    for name in NESTED_SECTIONS:
        value = data.get(name)
        if value is not None and not isinstance(value, dict):
            raise InputError(where, f"must be a JSON object, got {_json_type(value)} {_shown(value)}", field=name)


def _model_type(r: _Reader) -> str:
    hit = r.get("model_type")
    if hit is None:
        return "unknown"
    value, src = hit
    if not isinstance(value, str) or not value.strip():
        raise InputError(r.where, f"must be a non-empty string such as \"qwen3\", got {_shown(value)}", field=src)
    return value


def _architectures(r: _Reader) -> list[str]:
    hit = r.get("architectures")
    if hit is None:
        return []
    value, src = hit
    names = value if isinstance(value, list) else [value]
    for i, name in enumerate(names):
        if not isinstance(name, str):
            field = f"{src}[{i}]" if isinstance(value, list) else src
            raise InputError(r.where, f"must be a class name string, got {_shown(name)}", field=field)
    return list(names)


def _alibi(r: _Reader, model_type: str) -> Sourced[bool]:
    hit = r.flag("alibi", "use_alibi")
    if hit is not None and hit[0] is True:
        return Sourced(True, hit[1])
    attn_cfg = r.mapping("attn_config")
    if attn_cfg and attn_cfg[0].get("alibi") is not None:
        if not isinstance(attn_cfg[0]["alibi"], bool):
            raise InputError(r.where, f"must be true or false, got {_shown(attn_cfg[0]['alibi'])}",
                             field=f"{attn_cfg[1]}.alibi")
        if attn_cfg[0]["alibi"]:
            return Sourced(True, f"{attn_cfg[1]}.alibi")
    pos = r.get("position_embedding_type")
    if pos and not isinstance(pos[0], str):
        raise InputError(r.where, f"must be a string such as \"rope\", got {_shown(pos[0])}", field=pos[1])
    if pos and pos[0].lower() == "alibi":
        return Sourced(True, pos[1])
    if model_type == "bloom":
        return Sourced(True, "model_type bloom (ALiBi by design)")
    if hit is not None:
        return Sourced(False, hit[1])
    return Sourced(False, "default: no ALiBi field")


def _layer_heads(r: _Reader, num_layers: int, kinds: tuple[str, ...], head_dim: Sourced[int],
                 kv_heads: Sourced[int], heads: Sourced[int], mla: Sourced[MlaDims | None],
                 sliding_rule: SlidingLayerRule | None = None) -> Sourced[tuple[LayerHeads, ...] | None]:
    """Per-layer head_dim / KV heads, from transformers' ``per_layer_config`` (a sparse map of layer index ->
    overridden config fields, the HeterogeneousConfigMixin) or, in a config written without it, Gemma-4's
    ``global_head_dim`` and ``num_global_key_value_heads`` on the full-attention layers (the latter only when
    ``attention_k_eq_v`` is set or absent: Gemma4TextConfig's rule), or a family's sliding-layer rule (MiMo-V2-Flash:
    ``SLIDING_LAYER_RULES``). None when every layer is alike."""
    default = Sourced(None, "default: one head_dim and KV head count")
    overrides: dict[int, dict[str, Any]] = {}
    hit = r.mapping("per_layer_config")
    if hit is not None and hit[0]:
        raw, src = hit
        for key, fields in raw.items():
            index = int(key) if isinstance(key, str) and key.strip().isdigit() else None
            if index is None or not 0 <= index < num_layers:
                raise InputError(r.where, f"key {key!r} is not a layer index below num_hidden_layers {num_layers}",
                                 field=src)
            if not isinstance(fields, dict):
                raise InputError(r.where, f"must map to an object of overridden fields, got {_json_type(fields)}",
                                 field=f"{src}.{key}")
            # an MLA model's layer dims are read by _layer_mla
            refused = [f for f in fields if f in PER_LAYER_REFUSED and not (mla.value and f in PER_LAYER_MLA_FIELDS)]
            if refused:
                # every refused field of the layer, so one message sizes the gap (Dots3-Note's sliding MLA layers:
                # their own query heads, latent ranks and nope / rope split)
                raise InputError(r.where, f"overrides {', '.join(refused)} on layer {index}: kvcache plans one value "
                                          f"of {'it' if len(refused) == 1 else 'each'} for every layer (not "
                                          "supported by kvcache yet; per-layer head_dim and num_key_value_heads of "
                                          "GQA/MHA layers and the MLA dims of MLA layers are)", field=f"{src}.{key}")
            if mla.value is not None:
                continue  # an MLA layer's cache is its latent: _layer_mla reads its shape, head_dim / KV heads below
            for name in PER_LAYER_HEAD_FIELDS:
                if name in fields:
                    checked_number(r.where, f"{src}.{key}.{name}", fields[name], int, 1, LIMITS["head_dim"]
                                   if name == "head_dim" else LIMITS["heads"])
            overrides[index] = {k: int(v) for k, v in fields.items() if k in PER_LAYER_HEAD_FIELDS}
        source = src
    elif sliding_rule and sliding_rule.kv_factor != 1 and "sliding" in kinds:
        # MiMo-V2-Flash: its sliding layers' KV heads are a multiple of num_key_value_heads (SLIDING_LAYER_RULES)
        overrides = {i: {"num_key_value_heads": kv_heads.value * sliding_rule.kv_factor}
                     for i, kind in enumerate(kinds) if kind == "sliding"}
        source = f"{kv_heads.source} x {sliding_rule.kv_factor} on the sliding layers ({sliding_rule.source})"
    else:
        glob_dim = r.positive_int("global_head_dim", required=False, maximum=LIMITS["head_dim"])
        glob_kv = r.positive_int("num_global_key_value_heads", required=False, maximum=LIMITS["heads"])
        k_eq_v = r.flag("attention_k_eq_v")
        if glob_kv is not None and k_eq_v is not None and not k_eq_v[0]:
            glob_kv = None  # Gemma4TextConfig applies the global KV heads only with attention_k_eq_v
        if glob_dim is None and glob_kv is None:
            return default
        full = {}
        if glob_dim is not None:
            full["head_dim"] = glob_dim.value
        if glob_kv is not None:
            full["num_key_value_heads"] = glob_kv.value
        overrides = {i: dict(full) for i, kind in enumerate(kinds) if kind == "full"}
        source = " + ".join(h.source for h in (glob_dim, glob_kv) if h is not None) + " (full-attention layers)"
    if not overrides:
        return default
    if mla.value is not None:
        raise InputError(r.where, "per-layer head_dim / KV heads on an MLA model: not supported by kvcache yet",
                         field=source)
    layers = tuple(LayerHeads(overrides.get(i, {}).get("head_dim", head_dim.value),
                              overrides.get(i, {}).get("num_key_value_heads", kv_heads.value))
                   for i in range(num_layers))
    for i, layer in enumerate(layers):
        if layer.num_kv_heads > heads.value or heads.value % layer.num_kv_heads:
            raise InputError(r.where, f"layer {i}: {heads.value} query heads are not a multiple of "
                                      f"{layer.num_kv_heads} KV heads", field=source)
    if all(layer == LayerHeads(head_dim.value, kv_heads.value) for layer in layers):
        return default
    return Sourced(layers, source)


def _layer_mla(r: _Reader, num_layers: int, heads: Sourced[int],
               mla: Sourced[MlaDims | None]) -> Sourced[tuple[LayerMla, ...] | None]:
    """Per-layer query heads and MLA dims of an MLA model, from transformers' ``per_layer_config`` (Dots3-Note: its
    sliding layers' own heads, kv_lora_rank and qk_nope_head_dim, which Dots3NoteTextAttention reads off
    ``config.per_layer_config[layer_idx]``). None when every layer is alike. Keys and refused fields were checked by
    _layer_heads; a per-layer head_dim / num_key_value_heads there sizes no latent cache (the latent is one head;
    Dots3NoteTextConfig requires KV heads = query heads and reads head_dim only for the rotary fraction)."""
    default = Sourced(None, "default: one MLA shape for every layer")
    hit = r.mapping("per_layer_config")
    if mla.value is None or hit is None or not hit[0]:
        return default
    raw, src = hit
    model = mla.value
    layers = []
    for i in range(num_layers):
        key = next((k for k in raw if isinstance(k, str) and k.strip().isdigit() and int(k) == i), None)
        fields = raw[key] if key is not None else {}
        got = {}
        for name in PER_LAYER_MLA_FIELDS:
            if name not in fields:
                continue
            value = fields[name]
            if name == "q_lora_rank" and value is None:
                got[name] = None  # a plain q_proj on this layer
                continue
            got[name] = int(checked_number(r.where, f"{src}.{key}.{name}", value, int, 1,
                                           LIMITS["heads"] if name == "num_attention_heads" else LIMITS["mla_dim"]))
        n = got.pop("num_attention_heads", heads.value)
        layers.append(LayerMla(n, model.model_copy(update=got)))
    if all(layer == LayerMla(heads.value, model) for layer in layers):
        return default
    return Sourced(tuple(layers), f"{src} (per layer: {', '.join(PER_LAYER_MLA_FIELDS)})")


def _kv_sources(r: _Reader, num_layers: int, kinds: tuple[str, ...]) -> Sourced[tuple[int | None, ...] | None]:
    """Cross-layer KV sharing (Gemma-3n / Gemma-4 ``num_kv_shared_layers``): the last n layers compute no K/V and
    read the cache of the last layer before them of the same layer type (transformers' ``kv_sharing_modes``: the
    "store" layer of each type, read by every "reuse" layer of that type). None when no layer shares."""
    hit = r.number("num_kv_shared_layers", kind=int, minimum=0, maximum=LIMITS["layers"])
    if hit is None or not hit.value:
        return Sourced(None, "default: every layer caches its own K/V")
    first = num_layers - hit.value
    if first == 0:
        # Gemma-4 assistants (Gemma4*AssistantConfig sets num_kv_shared_layers = num_hidden_layers): every layer reads
        # the K/V its target model computed; no source layer in this model (ModelFacts.drafter, analyzer/kinds/drafter)
        return Sourced(None, f"{hit.source} = {hit.value}: every layer reads its target model's K/V (a drafter)")
    if first < 0:
        raise InputError(r.where, f"{hit.value} shared layers leave no layer of the {num_layers} to compute K/V",
                         field=hit.source)
    sources: list[int | None] = [None] * num_layers
    for i in range(first, num_layers):
        owner = next((j for j in range(first - 1, -1, -1) if kinds[j] == kinds[i]), None)
        if owner is None:
            raise InputError(r.where, f"layer {i} ({kinds[i]}) shares the K/V of an earlier {kinds[i]} layer and "
                                      f"none of the first {first} layers is one", field=hit.source)
        sources[i] = owner
    return Sourced(tuple(sources), f"{hit.source} = {hit.value} (the last {hit.value} layers read the cache of the "
                                   "last earlier layer of their type)")


def _layer_kinds(r: _Reader, model_type: str, num_layers: int, linear_family: tuple[str, str] | None = None,
                 blocks: tuple[list[str], str] | None = None) -> tuple[Sourced[tuple[str, ...]], Sourced[int | None]]:
    """Per-layer kind and the window, for every spelling configs use, first match wins.

    ``layer_types`` lists ``sliding_attention`` / ``full_attention`` per layer (gpt-oss, Gemma-2/3,
    newer Qwen3); ``full_attention_interval`` marks the other layers linear attention (Qwen3-Next);
    Qwen2/Qwen3 ``use_sliding_window`` gates the window (false: all full; true: layers from
    ``max_window_layers`` on slide); ``sliding_window_pattern`` makes every Nth layer full
    (Gemma-3); Gemma-2/3 without a pattern use their model's default; a bare ``sliding_window``
    slides every layer (Mistral v0.1). ``sliding_window: null`` means no window (so does ``0`` beside
    ``use_sliding_window: false``).
    """
    window_hit = r.get("sliding_window", "sliding_window_size")
    window = None
    if window_hit is not None:
        w = window_hit[0]
        use_sw = r.flag("use_sliding_window")
        # 0 beside use_sliding_window false: transformers' Qwen2-MoE config writes it so (the window is off)
        inert_zero = w == 0 and not isinstance(w, bool) and use_sw is not None and use_sw[0] is False
        if not inert_zero and (isinstance(w, bool) or not isinstance(w, int) or w <= 0):
            raise InputError(r.where, f"must be a positive integer or null, got {w!r}", field=window_hit[1])
        window = w or None

    types_hit = blocks or r.get("layer_types")  # Nemotron-H: its block list (linear_config.block_types)
    def listed(types_hit: tuple[Any, str]) -> tuple[Sourced[tuple[str, ...]], Sourced[int | None]]:
        raw, src = types_hit
        if not isinstance(raw, list) or len(raw) != num_layers:
            raise InputError(r.where, f"must list one type per layer ({num_layers})", field=src)
        kinds = []
        for i, t in enumerate(raw):
            kind = _LAYER_TYPE_KIND.get(t) if isinstance(t, str) else None
            if t == "hybrid" and model_type in SHARED_BLOCK_HYBRIDS:  # "hybrid" names other layers elsewhere (ZAYA)
                kind = SHARED_BLOCK
            if t in ("hybrid", "hybrid_sliding") and model_type in CCA_HYBRIDS:
                # ZAYA: a full / sliding attention beside its CCA projection's states
                kind = PARALLEL if t == "hybrid" else PARALLEL_SLIDING
            if kind is None:
                raise InputError(r.where, f"unknown layer type {t!r}", field=f"{src}[{i}]")
            kinds.append(kind)
        if ("sliding" in kinds or PARALLEL_SLIDING in kinds) and window is None:
            raise InputError(r.where, "sliding layers listed but no sliding_window", field="sliding_window")
        return Sourced(tuple(kinds), src), _window_source(window, window_hit)

    if types_hit is not None:
        return listed(types_hit)

    neo = _gpt_neo_kinds(r, num_layers)
    if neo is not None:
        return neo

    mamba = mamba_layer_kinds(r, model_type, num_layers) if linear_family else None
    if mamba is not None:
        return Sourced(mamba[0], mamba[1]), Sourced(None, "default: none")
    kimi = kimi_layer_kinds(r, num_layers) if linear_family else None
    if kimi is not None:
        return Sourced(kimi[0], kimi[1]), Sourced(None, "default: none")
    lfm = short_conv_layer_kinds(r, model_type, num_layers) if linear_family else None
    if lfm is not None:
        return Sourced(lfm[0], lfm[1]), Sourced(None, "default: none")
    group = r.positive_int("layer_group_size", required=False) if model_type == "bailing_hybrid" else None
    if group is not None and linear_family is not None:
        # Ling: the last layer of every layer_group_size group is full attention (MLA), the others linear.
        kinds = bailing_layer_kinds(group.value, num_layers, linear_family[0])
        return Sourced(kinds, f"{group.source}={group.value} (last layer of each group full attention, "
                              "the others linear)"), Sourced(None, "default: none")

    interval = r.positive_int("full_attention_interval", required=False)
    if interval is not None:
        # Qwen3-Next: linear-attention layers, every interval-th layer full attention.
        n = interval.value
        kinds = tuple("full" if (i + 1) % n == 0 else "linear" for i in range(num_layers))
        return Sourced(kinds, f"{interval.source}={n} (other layers linear attention)"), Sourced(None, "default: none")

    # a config class that derives its layer types (RecurrentGemma's block_types; Zamba2Config.__post_init__'s pattern)
    derived = r.derived("layer_types", in_post_init=model_type in SHARED_BLOCK_HYBRIDS | POST_INIT_LAYER_TYPES)
    if derived is not None:
        return listed(derived)

    use_sw = r.flag("use_sliding_window")
    if use_sw is not None and use_sw[0] is False:
        # Qwen2/Qwen3: the window field is inert unless use_sliding_window is true.
        kinds = ("full",) * num_layers
        return Sourced(kinds, f"{use_sw[1]}=false"), Sourced(None, f"{use_sw[1]}=false")

    if window is None:
        chunk = r.get("attention_chunk_size")
        if chunk is not None and family_of(model_type) == "llama4":
            return _llama4_kinds(r, chunk[1], num_layers), Sourced(None, "default: none")
        return Sourced(("full",) * num_layers, "default: no sliding_window"), Sourced(None, "default: none")

    if use_sw is not None and use_sw[0] is True:
        mwl = r.number("max_window_layers", kind=int, minimum=0)
        start = mwl.value if mwl else 0
        kinds = tuple("sliding" if i >= start else "full" for i in range(num_layers))
        src = f"{use_sw[1]}=true, layers >= {mwl.source if mwl else 'max_window_layers (absent: 0)'}"
        return Sourced(kinds, src), _window_source(window, window_hit)

    pattern = r.positive_int("sliding_window_pattern", required=False)
    if pattern is not None:
        n = pattern.value
        kinds = tuple("sliding" if (i + 1) % n else "full" for i in range(num_layers))
        return Sourced(kinds, f"{pattern.source}={n} (every {n}th layer full)"), _window_source(window, window_hit)

    fam = family_of(model_type)
    if fam == "gemma2":
        kinds = tuple("sliding" if (i + 1) % 2 else "full" for i in range(num_layers))
        return Sourced(kinds, "model_type gemma2 (even layers sliding)"), _window_source(window, window_hit)
    if fam == "gemma3":
        kinds = tuple("sliding" if (i + 1) % 6 else "full" for i in range(num_layers))
        return Sourced(kinds, "model_type gemma3 (default pattern 6)"), _window_source(window, window_hit)
    if fam == "gemma4":  # Gemma4TextConfig: pattern 6 (5:1), and the last layer is always full attention
        kinds = tuple("sliding" if (i + 1) % 6 and i < num_layers - 1 else "full" for i in range(num_layers))
        return Sourced(kinds, "model_type gemma4 (default pattern 6, last layer full)"), \
            _window_source(window, window_hit)

    return (
        Sourced(("sliding",) * num_layers, f"{window_hit[1]} with no layer_types (every layer)"),
        _window_source(window, window_hit),
    )


def _llama4_kinds(r: _Reader, chunk_src: str, num_layers: int) -> Sourced[tuple[str, ...]]:
    """Llama-4 without layer_types: RoPE layers use chunked attention, NoPE layers full attention.

    ``no_rope_layers[i]`` is 1 when layer i uses RoPE (transformers' convention); when the list is
    empty or absent it defaults to "every ``no_rope_layer_interval``-th layer is NoPE" (default 4).
    """
    listed = r.get("no_rope_layers")
    if listed is not None and not isinstance(listed[0], list):
        raise InputError(r.where, f"must be a list of 0/1 flags, got {_shown(listed[0])}", field=listed[1])
    if listed is not None and listed[0]:
        flags, src = listed
        if len(flags) != num_layers:
            raise InputError(r.where, f"must list one flag per layer ({num_layers})", field=src)
        for i, flag in enumerate(flags):
            if flag not in (0, 1) or isinstance(flag, float):
                raise InputError(r.where, f"must be 0 or 1 (1 = the layer uses RoPE), got {_shown(flag)}",
                                 field=f"{src}[{i}]")
        kinds = tuple("chunked" if flag else "full" for flag in flags)
        return Sourced(kinds, f"{chunk_src} + {src} (1 = RoPE = chunked)")
    interval_hit = r.number("no_rope_layer_interval", kind=int, minimum=1)
    interval = interval_hit.value if interval_hit else 4
    kinds = tuple("full" if (i + 1) % interval == 0 else "chunked" for i in range(num_layers))
    how = interval_hit.source if interval_hit else "default: transformers Llama4TextConfig.no_rope_layer_interval"
    return Sourced(kinds, f"{chunk_src} + {how}={interval} (every {interval}th layer NoPE = full)")


_NEO_KINDS = {"global": "full", "local": "sliding"}


def _gpt_neo_kinds(r: _Reader, num_layers: int) -> tuple[Sourced[tuple[str, ...]], Sourced[int | None]] | None:
    """GPT-Neo's spelling, None for a config without it: ``attention_types`` ``[[[types...], repeats], ...]`` expands
    to "global" / "local" per layer (GPTNeoConfig rebuilds ``attention_layers`` from it; that list alone is read
    where it is missing), the local layers slide over
    ``window_size`` keys, their own included (transformers GPTNeoSelfAttention: its causal mask minus
    ``tril(-window_size)``, the ``sliding_window`` convention)."""
    hit = None
    if (groups := r.get("attention_types")) is not None:  # what GPTNeoConfig rebuilds attention_layers from
        raw, src = groups
        try:
            hit = [t for group, repeats in raw for _ in range(repeats) for t in group], f"{src} (expanded)"
        except (TypeError, ValueError):
            raise InputError(r.where, "must list [[layer types...], repeats] pairs (GPT-Neo)", field=src) from None
    hit = hit or r.get("attention_layers")
    if hit is None:
        return None
    raw, src = hit
    if not (isinstance(raw, list) and raw and all(isinstance(t, str) and t in _NEO_KINDS for t in raw)):
        raise InputError(r.where, f"must list 'global' / 'local' per layer (GPT-Neo), got {raw!r}"[:200], field=src)
    if len(raw) != num_layers:
        raise InputError(r.where, f"lists {len(raw)} layer types for {num_layers} layers", field=src)
    kinds = tuple(_NEO_KINDS[t] for t in raw)
    if "sliding" not in kinds:
        return Sourced(kinds, f"{src} (global: full attention)"), Sourced(None, f"{src}: no local layer")
    window = r.positive_int("window_size")
    return Sourced(kinds, f"{src} (global: full attention, local: sliding over window_size)"), \
        Sourced(window.value, window.source)


def _window_source(window: int | None, hit: tuple[Any, str] | None) -> Sourced[int | None]:
    return Sourced(window, hit[1]) if hit else Sourced(None, "default: none")


def family_of(model_type: str) -> str:
    return FAMILY_OF.get(model_type, model_type)


def yarn_mscale(factor: float | None, mscale_all_dim: float | None) -> float:
    """YaRN attention-scale factor m (1 when the factor does not stretch the context)."""
    if not factor or factor <= 1 or not mscale_all_dim:
        return 1.0
    return 0.1 * mscale_all_dim * math.log(factor) + 1.0
