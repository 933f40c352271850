"""Linear-attention (recurrent-state) layers of hybrid models: which family, and the sizes its state has.

One home for what a config says about its linear layers. A linear layer keeps, per request, a fixed-size
state instead of a growing KV cache: a recurrent state (one ``Dk x Dv`` matrix per value head) and, where the
family runs a short causal convolution before it, the last ``kernel - 1`` inputs of that convolution. Families
(their code is the source of truth, cited per family):

* ``gated_delta_net`` -- Qwen3-Next, Qwen3.5, LaraMini, OLMo-Hybrid (transformers ``Qwen3NextGatedDeltaNet``,
  ``Qwen3_5MoeGatedDeltaNet``, ``LaraMiniGatedDeltaNet``, ``OlmoHybridGatedDeltaNet``; one row each in
  ``GDN_VARIANTS``): one fused conv over q|k|v (``2*Nk*Dk + Nv*Dv`` channels), ``Nv`` value heads sharing ``Nk``
  key heads; on the NPU ``npu_recurrent_gated_delta_rule`` keeps its state ``[Nv, Dv, Dk]``. OLMo-Hybrid doubles
  beta (``LinearFacts.beta_scale``).
* ``kimi_delta_attention`` -- Kimi-Linear, Ling-3.0 (transformers ``KimiLinearKimiDeltaAttention`` / model_type
  ``bailing_hybrid``'s ``BailingHybridDeltaAttention``): one fused conv over q|k|v (``3*H*D`` channels), a
  per-channel gate, state ``[H, Dk, Dv]`` (pure torch: no torch-npu operator).
* ``lightning_attention`` -- Ling-2.5 / 2.6 (``BailingMoeV2_5ForCausalLM``, published under model_type
  ``bailing_hybrid`` with remote code; upstream ``models/bailing_2_5``): simple gated linear attention with
  fixed per-head decay slopes, no conv, state ``[H, D, D]``. transformers 5.x's own ``bailing_hybrid`` is the
  KDA model above: the same model_type names two architectures, told apart by the fields only one has.
* ``mamba2`` -- Mamba-2 (SSD) mixers: Granite-4.0-H (``granitemoehybrid``), Bamba, Falcon-H1, Nemotron-H, Zamba2,
  Mamba2 (transformers ``*Mixer`` / ``GraniteMoeHybridMambaLayer`` and their ``mamba2_scan_forward``): in_proj ->
  gate | x|B|C | dt, one causal conv over x|B|C (``H*P + 2*G*N`` channels), then per head h the state
  ``[P, N]`` <- exp(dt_h A_h) state + dt_h x_h B_g^T, y = state C_g + D_h x_h. The groups G play the key heads
  (B and C are shared by H/G heads, as GQA shares keys), P the value dim, N the key dim: state ``[H, P, N]``, the
  gated delta net's ``[Nv, Dv, Dk]``.
* ``short_conv`` -- LiquidAI LFM2 / LFM2-MoE / LFM3 (transformers ``Lfm2ShortConv`` / ``Lfm2MoeShortConv`` /
  ``Lfm3ShortConv``, kept as the decoder layer's ``conv``): in_proj -> B | C | x, then ``B * x`` through a depthwise
  causal conv of width ``conv_L_cache`` over the hidden_size channels (no activation), ``C *`` its output, out_proj.
  Its only state is the conv's: the last ``conv_L_cache - 1`` inputs of hidden_size channels; no recurrent matrix
  (LinearFacts keeps 0 heads and dims, the manifest none).
* ``mamba`` -- Mamba-1 selective-scan mixers: Jamba, Mamba, FalconMamba, Zamba (transformers ``*MambaMixer`` and
  their ``mamba_scan_forward``): the conv over the I = expand x hidden inner channels only (B, C and dt come from
  ``x_proj`` after it), per channel a state ``[N]`` with its own A row: state ``[I, N]``. Zamba's mixer is multi-head
  (``ZambaMambaMixer``: ``n_mamba_heads`` heads of I / H channels, each its own x_proj / dt_proj, so its own B and C,
  scanned one head at a time): the heads play Mamba-2's groups (the key heads), state ``[H, I / H, N]`` as
  transformers stacks the heads' states; one head is Jamba's ``[I, N]``.

* ``rwkv`` -- RWKV-4 (transformers ``RwkvForCausalLM``, modeling_rwkv.py): every block a time-mix
  (``RwkvSelfAttention``) and a channel-mix (``RwkvFeedForward``), no attention, no conv. Each mixes its input with
  the previous token's (the token shift, ``time_shift``): the block keeps the last time-mix input and the last
  channel-mix input, hidden_size channels each, planned as a width-2 window (``conv_state [2 x hidden, 1]``: the
  last ``kernel - 1 = 1`` input; time-mix channels first). The time-mix's wkv keeps per attention channel a
  numerator, a denominator and a running max exponent (``rwkv_linear_attention_cpu``'s num / den / max, float32):
  ``recurrent_state [attention_hidden_size, 3]``, the CUDA kernel's ``[hidden, 3]`` layout (one "value head" of
  width 1 per channel, one replicated "key head" of 3, as Mamba-1 maps its channels).
* ``mlstm`` -- xLSTM's mLSTM layers (transformers ``xLSTMForCausalLM``, modeling_xlstm.py, its native kernels): per
  head h an exponentially gated matrix memory C ``[Dqk, Dv]``, a normalizer n ``[Dqk]`` and a max-state m (the
  stabiliser), all float32 (``inference_state_dtype``); no conv. n is C's column for a value channel fixed at 1, m one
  scalar per head: planned as one ``recurrent_state [H, Dqk + 1, Dv + 1]`` (C, n as its last column, m at
  ``[Dqk, 0]``). Dqk = int(hidden_size x qk_dim_factor) / H, Dv = int(hidden_size x v_dim_factor) / H, as
  ``xLSTMLayer`` sizes its projections.
* ``rg_lru`` -- RecurrentGemma (transformers ``RecurrentGemmaForCausalLM``, modeling_recurrent_gemma.py): its
  'recurrent' blocks (``RecurrentGemmaRecurrentBlock``, the decoder layer's ``temporal_block``) run a depthwise causal
  conv of width ``conv1d_width`` (with bias, no activation) over the lru_width channels of ``linear_x``, then the
  RG-LRU (``RecurrentGemmaRglru``): per channel h <- a h + sqrt(1 - a^2) (i x), a diagonal gated recurrence whose
  state is one float32 number per channel (its ``recurrent_states [batch, lru_width]``), reset (a = 0, no
  normalisation) at position 0. States: ``conv_state [lru_width, conv1d_width - 1]`` (the model's dtype, as
  transformers keeps ``conv1d_state``) and ``recurrent_state [lru_width]`` float32 (one "value head" of width 1 per
  channel, one replicated "key head" of 1, as Mamba-1 maps its channels). Its 'attention' blocks are local
  sliding-window attention (``attention_window_size``): ordinary KV-cache layers.
* ``cca`` -- ZAYA (transformers ``ZayaForCausalLM``, modeling_zaya.py): every decoder layer's attention projects
  q / k / v through ``ZayaCCAProjection`` (compressed convolutional attention), which keeps two per-request states
  beside the layer's (pageable) KV cache. q|k (``(H + KVH) x head_dim`` channels, queries first) run through a
  depthwise causal conv of width ``cca_time0`` then a grouped one of width ``cca_time1`` (one group per head): a
  receptive field of ``cca_time0 + cca_time1 - 1`` inputs, so the conv state keeps the last
  ``cca_time0 + cca_time1 - 2`` q|k inputs (transformers' ``update_conv_state(..., conv_kernel_size=(t0 - 1) +
  (t1 - 1))``). Half of each value head comes from the previous token's ``v_proj_delayed`` output: the recurrent
  state is that last output, ``[KVH, head_dim / 2]`` (``update_recurrent_state(delayed_v_state[:, -1, :])``); a
  prefill starts it from ``v_proj_delayed(0)``. Planned as Falcon-H1's parallel layers: the attention sublayer (KV
  cache, FA) and a state sublayer (conv_state, recurrent_state). LinearFacts: the query heads as key heads, the KV
  heads as value heads of head_dim / 2.

No torch-npu release pinned here has a selective-scan or SSD operator (the 2.14.0 op schemas list
``npu_fused_causal_conv1d`` for the conv, nothing for the scan): the Mamba families run their recurrence in torch.

Torch-free; sizes are plain ints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from model_infer_kvcache.analyzer.errors import InputError

GATED_DELTA_NET = "gated_delta_net"
KIMI_DELTA = "kimi_delta_attention"
LIGHTNING = "lightning_attention"
MAMBA2 = "mamba2"
MAMBA = "mamba"
SHORT_CONV = "short_conv"
RWKV = "rwkv"
MLSTM = "mlstm"
RG_LRU = "rg_lru"
CCA = "cca"
LINEAR_FAMILIES = (GATED_DELTA_NET, KIMI_DELTA, LIGHTNING, MAMBA2, MAMBA, SHORT_CONV, RWKV, MLSTM, RG_LRU, CCA)
# Families whose layers keep a conv state only (no recurrent state): planned without heads, dims or recurrent_state
CONV_ONLY = frozenset({SHORT_CONV})
# A decoder layer of a parallel hybrid (Falcon-H1) runs attention and a Mamba mixer side by side on the same input:
# its config layer kind, planned as two sublayers (the attention's KV cache, then the mixer's states).
PARALLEL = "parallel"
# the same beside a sliding-window attention (ZAYA's "hybrid_sliding" layers)
PARALLEL_SLIDING = "parallel_sliding"
PARALLEL_HYBRIDS = frozenset({"falcon_h1"})
# ZAYA's "hybrid" / "hybrid_sliding" layer types: a full / sliding-window attention whose CCA projection keeps
# per-request states, planned as a parallel layer (the attention's KV cache, then the projection's states)
CCA_HYBRIDS = frozenset({"zaya"})
# ZayaConfig's class defaults of the CCA conv widths
_CCA_DEFAULTS = {"cca_time0": 2, "cca_time1": 2}
# A Zamba2 "hybrid" decoder layer runs the shared transformer block (attention + MLP whose weights several hybrid
# layers share), a linear, then the layer's own Mamba-2 mixer (transformers Zamba2HybridLayer): its config layer kind,
# planned like a parallel layer as two sublayers, since the cache is indexed by the decoder layer, not by the shared
# module (Zamba2Attention.forward: cache.update(..., layer_idx) with the caller's layer_idx; its own is -1).
SHARED_BLOCK = "shared_block"
# Zamba (v1) builds its hybrid layers so too (ZambaHybridLayer: shared_transf, linear, mamba_decoder; every hybrid
# layer's shared_transf tied to the first's weights, ZambaModel._tied_weights_keys), its mixer a multi-head Mamba-1.
SHARED_BLOCK_HYBRIDS = frozenset({"zamba2", "zamba"})
# A layer that holds no cache at all (Dory's and Nemotron-H's MLP-only blocks, Nemotron-H's MoE-only blocks): its
# config layer kind, planned as a layer with neither a KV cache nor a state (transformers' cache keeps a "dummy" layer
# there: cache_utils.get_layer_types_and_kwargs).
NO_CACHE = "nocache"
# Families whose single B/C group (key head) stays whole on every rank: Mamba-1 has one B/C for all channels (a
# multi-head Mamba-1, Zamba's, splits its heads as Mamba-2 splits its groups); RWKV's one wkv "head" and the
# RG-LRU's (its state is per channel, nothing shared across channels) likewise.
_REPLICATED_K_HEADS = frozenset({MAMBA, RWKV, RG_LRU})
# RWKV's wkv state per attention channel: numerator, denominator, max exponent (rwkv_linear_attention_cpu)
RWKV_WKV_PARTS = 3

# LFM2-family model types (their conv width ``conv_L_cache``; the class default where a config omits it)
_SHORT_CONV_KERNEL_DEFAULTS = {"lfm2": ("Lfm2Config", 3), "lfm2_moe": ("Lfm2MoeConfig", 3), "lfm3": ("Lfm3Config", 7)}


@dataclass(frozen=True)
class GdnVariant:
    """What a gated-delta-net model_type's config and mixer add to Qwen3-Next's (the mixer: conv over q|k|v, then the
    gated delta rule with q/k l2-normalised and scale Dk^-0.5; its projections, gate and norm stay the model's own).

    ``module``: transformers' mixer class (the source read). ``derived``: the config class derives the linear sizes
    it leaves out from other fields (OLMo-Hybrid's ``__post_init__``), else the family defaults apply.
    ``beta_scale``: (field, class default) of a flag that doubles beta inside the mixer (OLMo-Hybrid
    ``linear_allow_neg_eigval``: beta in [0, 2], negative eigenvalues of the state transition), None: beta =
    sigmoid(b)."""

    module: str
    derived: bool = False
    beta_scale: tuple[str, bool] | None = None
    own_reference: bool = True  # the validation's reference names this mixer (False: the family's sentence)

    @property
    def reference(self) -> str:
        """What the validation compares the layers with (the manifest's ``linear_attention.reference``)."""
        if not self.own_reference:
            return REFERENCE[GATED_DELTA_NET]
        return f"transformers {self.module.split(':')[1].split(' ')[0]} (torch_chunk_gated_delta_rule)"


_QWEN35_GDN = "transformers/models/qwen3_5/modeling_qwen3_5.py:Qwen3_5GatedDeltaNet"
# One row per model_type whose linear layers are gated delta nets (their modeling files, read against Qwen3-Next's)
GDN_VARIANTS = {
    # (their reference: the family's sentence naming both)
    "qwen3_next": GdnVariant("transformers/models/qwen3_next/modeling_qwen3_next.py:Qwen3NextGatedDeltaNet",
                             own_reference=False),
    **dict.fromkeys(("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"),
                    GdnVariant(_QWEN35_GDN, own_reference=False)),
    # LaraMiniGatedDeltaNet subclasses Qwen3_5GatedDeltaNet unchanged (its gated norm is GLM-5-Next's fp32 one with
    # SiLU, kept in the model); its full layers attend without RoPE, its sliding ones with (the model's own q/k path)
    "lara_mini": GdnVariant("transformers/models/lara_mini/modeling_lara_mini.py:LaraMiniGatedDeltaNet "
                            f"(= {_QWEN35_GDN})"),
    # OlmoHybridGatedDeltaNet: separate q/k/v/a/b projections, a g_proj output gate, o_norm / o_proj; the same conv
    # over q|k|v and the same rule, except beta doubled under linear_allow_neg_eigval (OlmoHybridConfig default True)
    "olmo_hybrid": GdnVariant("transformers/models/olmo_hybrid/modeling_olmo_hybrid.py:OlmoHybridGatedDeltaNet",
                              derived=True, beta_scale=("linear_allow_neg_eigval", True)),
    # Qwen4ExpTextGatedDeltaNet subclasses Qwen3_5GatedDeltaNet (only its norm's gate activation is configurable:
    # output_gate_type, kept in the model); its attention layers are another matter (config_loader: the QSA indexer)
    "qwen4_exp_text": GdnVariant("transformers/models/qwen4_exp/modeling_qwen4_exp.py:Qwen4ExpTextGatedDeltaNet "
                                 f"(a {_QWEN35_GDN} subclass)"),
}
_GDN_TYPES = tuple(GDN_VARIANTS)
# config classes whose __post_init__ fills layer_types when a config leaves it out (LaraMiniConfig: the published
# period-5 pattern; OlmoHybridConfig: every 4th layer full, the last one at least): read from the class itself
POST_INIT_LAYER_TYPES = frozenset({"lara_mini", "olmo_hybrid"})
# Fields only Ling-2.5's remote code reads (BailingMoeV2_5Config) / only the KDA model reads.
_LIGHTNING_FIELDS = ("group_norm_size", "linear_silu")
_KDA_FIELDS = ("short_conv_kernel_size", "kda_safe_gate", "kda_lower_bound")
_LIGHTNING_ARCH = "BailingMoeV2_5ForCausalLM"
# Lightning attention transformers implements itself (beside Ling-2.5's, which it does not): model_type -> its module.
# MiniMaxLightningAttention: the same recurrence S <- exp(-slope) S + k^T v, o = q S, with q not scaled (its intra
# and inter products use q as is; Ling-2.5's kernels scale it by head_dim^-0.5)
_LIGHTNING_TYPES = {"minimax": "transformers/models/minimax/modeling_minimax.py:MiniMaxLightningAttention"}

# The Mamba families' mixer fields, by model_type (each config class's own names): heads H, head dim P, state N,
# groups G, conv width, expand (inner width I = expand x hidden unless the class names I itself).
_MAMBA2_FIELDS = {
    **dict.fromkeys(("granitemoehybrid", "bamba", "falcon_h1"), {
        "heads": "mamba_n_heads", "head_dim": "mamba_d_head", "state": "mamba_d_state", "groups": "mamba_n_groups",
        "conv": "mamba_d_conv"}),
    # Zamba2Config.__post_init__ derives mamba_headdim = int(mamba_expand x hidden_size) // n_mamba_heads when the
    # config saves none (a saved one, set after it, wins)
    "zamba2": {"heads": "n_mamba_heads", "head_dim": "mamba_headdim", "state": "mamba_d_state",
               "groups": "mamba_ngroups", "conv": "mamba_d_conv", "derived_head_dim": True},
    "nemotron_h": {"heads": "mamba_num_heads", "head_dim": "mamba_head_dim", "state": "ssm_state_size",
                   "groups": "n_groups", "conv": "conv_kernel"},
    "mamba2": {"heads": "num_heads", "head_dim": "head_dim", "state": "state_size", "groups": "n_groups",
               "conv": "conv_kernel"},
}
_MAMBA_FIELDS = {
    "jamba": {"state": "mamba_d_state", "conv": "mamba_d_conv", "expand": "mamba_expand"},
    # MambaConfig / FalconMambaConfig: intermediate_size = expand x hidden_size (their __post_init__)
    **dict.fromkeys(("mamba", "falcon_mamba"), {"state": "state_size", "conv": "conv_kernel", "expand": "expand"}),
    # ZambaConfig: n_mamba_heads heads of the inner channels (ZambaMambaMixer.mamba_head_dim = I // n_mamba_heads)
    "zamba": {"state": "mamba_d_state", "conv": "mamba_d_conv", "expand": "mamba_expand", "heads": "n_mamba_heads"},
}
# Pure Mamba stacks: every decoder layer one mixer, no attention (Mamba2ForCausalLM, MambaForCausalLM,
# FalconMambaForCausalLM)
# RwkvForCausalLM: every block a time-mix and a channel-mix, both holding a state, no attention
_PURE_STACKS = ("mamba2", "mamba", "falcon_mamba", "rwkv", "xlstm")
# config classes whose saved intermediate_size is the Mamba-1 mixer's inner width
INNER_IS_INTERMEDIATE = ("mamba", "falcon_mamba")

# Class-name endings of linear-attention modules (transformers' Qwen3NextGatedDeltaNet, KimiLinearDeltaAttention,
# BailingHybridDeltaAttention, MiniMaxLightningAttention; kvcache's Ling-2.5 reference LingLightningAttention): the
# cross-check and the rendered-mode host tell them from softmax attention by these. Not "LinearAttention":
# Kimi-Linear's full (MLA) layers are KimiLinearAttention.
LINEAR_MODULE_SUFFIXES = ("GatedDeltaNet", "DeltaAttention", "LightningAttention",
                          # the Mamba mixers: JambaMambaMixer, BambaMixer, FalconH1Mixer, NemotronHMamba2Mixer,
                          # GraniteMoeHybridMambaLayer
                          "MambaMixer", "Mamba2Mixer", "BambaMixer", "FalconH1Mixer", "MambaLayer",
                          # LFM2 / LFM2-MoE / LFM3's gated short conv (Lfm2ShortConv ...)
                          "ShortConv",
                          # RWKV-4's time-mix (the block's state holder; its channel-mix shares the block's state)
                          "RwkvSelfAttention",
                          # xLSTM's mLSTM layer (xLSTMBlock.mlstm_layer)
                          "xLSTMLayer",
                          # RecurrentGemma's recurrent block (its conv_1d and RG-LRU; RecurrentGemmaRecurrentBlock)
                          "RecurrentGemmaRecurrentBlock",
                          # ZAYA's CCA projection (ZayaCCAProjection: its conv and delayed-value states)
                          "CCAProjection")

# What the validation compares each family with. Gated delta net and KDA: transformers' own classes. Lightning
# (Ling-2.5): transformers has no such model, so kvcache builds one from transformers' Ling-family code with a
# plain-torch lightning attention (validators/pipeline/ling_lightning.py; references/hybrid_linear.md says what
# that reference shares with the model under test).
REFERENCE = {
    GATED_DELTA_NET: "transformers Qwen3NextGatedDeltaNet / Qwen3_5MoeGatedDeltaNet (torch_chunk_gated_delta_rule)",
    KIMI_DELTA: "transformers KimiLinearKimiDeltaAttention / BailingHybridDeltaAttention (chunk_kimi_delta_attention)",
    LIGHTNING: "kvcache's Ling-2.5 reference (validators/pipeline/ling_lightning.py): transformers' BailingHybrid "
               "model, MLA (output gate removed) and MoE, with a plain-torch lightning attention in the linear layers "
               "(MiniMaxLightningAttention's recurrence and slopes, Ling-2.5's layout, norms, gate and slope factor "
               "from the upstream bailing_2_5 port)",
    MAMBA2: "transformers' own Mamba-2 mixer of the family (its mamba2_scan_forward: the SSD chunk scan)",
    MAMBA: "transformers' own Mamba-1 mixer of the family (its mamba_scan_forward: the selective scan)",
    MLSTM: "transformers' own xLSTMForCausalLM (its native mLSTM kernels: chunkwise over the prefix, the recurrent "
           "step for the rest)",
    RG_LRU: "transformers' own RecurrentGemmaForCausalLM (its conv_1d over the prefix and RecurrentGemmaRglru's "
            "_rnn_scan)",
    RWKV: "transformers' own RwkvForCausalLM (its rwkv_linear_attention_cpu recurrence over the whole prefix)",
    CCA: "transformers' own ZayaForCausalLM (ZayaCCAProjection's two convs over the whole prefix and its delayed "
         "value)",
    SHORT_CONV: "transformers' own short-conv layer of the family (Lfm2ShortConv / Lfm2MoeShortConv / Lfm3ShortConv: "
                "its causal_conv1d_forward over the whole prefix)",
}
# Families transformers implements no model of: the architecture cross-check cannot build them (Ling-2.5's
# model_type bailing_hybrid is, in transformers, the KDA model).
NOT_IN_TRANSFORMERS = frozenset({LIGHTNING})


def kvcache_reference(lin) -> bool:
    """The plan's linear layers are validated against kvcache's own reference (Ling-2.5: transformers implements no
    such model; MiniMax's lightning attention is transformers' own). ``lin``: LinearFacts or the manifest's section."""
    return lin is not None and lin.family in NOT_IN_TRANSFORMERS and lin.reference == REFERENCE[lin.family]


@dataclass(frozen=True)
class LinearFacts:
    """What the config says about its linear layers (all ranks)."""

    family: str
    num_k_heads: int  # query/key heads (0: no recurrent state, a conv-only family)
    num_v_heads: int  # value heads (= state heads; 0: no recurrent state)
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int | None  # None: no short convolution
    conv_channels: int  # channels of the fused short conv (0 without one)
    source: str
    reference: str | None
    # the gated delta net's beta = beta_scale x sigmoid(b): 2 where the mixer allows negative eigenvalues
    # (GdnVariant.beta_scale), 1 elsewhere and for every other family
    beta_scale: float = 1.0
    # lightning: what the query is scaled by before the recurrence (None: head_k_dim^-0.5, Ling-2.5's kernels; 1:
    # MiniMax's, which scales none)
    query_scale: float | None = None

    def k_heads_per_rank(self, tp: int) -> int:
        """Key heads (Mamba: B/C groups) one attention-TP rank holds (``k_heads_per_rank``)."""
        return k_heads_per_rank(self.family, self.num_k_heads, tp)

    def k_heads_split_by(self, tp: int) -> bool:
        """Whether attention TP ``tp`` splits (or, where ``k_heads_per_rank`` says so, replicates) the key heads."""
        return k_heads_per_rank(self.family, self.num_k_heads, tp) is not None

    def conv_channels_per_rank(self, tp: int) -> int:
        """Channels one attention-TP rank convolves: its share of every head (q|k|v alike; Mamba-2's x|B|C,
        Mamba-1's inner channels only)."""
        if not self.conv_kernel:
            return 0
        if self.family in CONV_ONLY or self.family == RG_LRU:  # depthwise: each rank its share of the channels
            return self.conv_channels // tp
        if self.family == RWKV:  # the token shift is of the block's (replicated) hidden input: whole on every rank
            return self.conv_channels
        if self.family == CCA:  # q|k of this rank's query and KV heads (one conv group per head)
            return (self.num_k_heads // tp + self.num_v_heads // tp) * self.head_k_dim
        nk, nv = self.k_heads_per_rank(tp), self.num_v_heads // tp
        if self.family in (GATED_DELTA_NET, MAMBA2):
            return 2 * nk * self.head_k_dim + nv * self.head_v_dim
        if self.family == MAMBA:
            return nv * self.head_v_dim
        return nk * self.head_k_dim * 2 + nv * self.head_v_dim  # KDA: q|k of Dk, v of Dv per head


def k_heads_per_rank(family: str, num_k_heads: int, tp: int) -> int | None:
    """Key heads (Mamba: B/C groups) one attention-TP rank holds, None where ``tp`` can neither split nor replicate
    them. Mamba-1's single B/C stays whole on every rank; Mamba-2 with fewer groups than ranks, the ranks a multiple
    of them (Granite-4.0-H / Bamba: 1 group), gives each rank the one group its heads read (vLLM's MambaMixer2
    replicates the groups over the ranks the same way); every other family splits them."""
    if family in _REPLICATED_K_HEADS and num_k_heads == 1:
        return num_k_heads
    if not num_k_heads % tp:
        return num_k_heads // tp
    if family == MAMBA2 and not tp % num_k_heads:
        return 1
    return None


def family_of_linear(get, model_type: str, architectures: list[str], where: str) -> tuple[str, str] | None:
    """(family, why) of a config with linear layers, None for a model_type kvcache knows no linear family of.

    ``get(name)`` looks a config field up (the reader's ``get``). ``bailing_hybrid`` is two architectures: the
    fields decide, and a config with neither set of fields is refused (reading it as either plans the wrong state).
    """
    if model_type in _GDN_TYPES:
        return GATED_DELTA_NET, f"model_type {model_type}"
    if model_type == "kimi_linear":
        return KIMI_DELTA, "model_type kimi_linear"
    if model_type in _MAMBA2_FIELDS:
        return MAMBA2, f"model_type {model_type} (Mamba-2 mixers)"
    if model_type in _MAMBA_FIELDS:
        return MAMBA, f"model_type {model_type} (Mamba-1 mixers)"
    if model_type in _SHORT_CONV_KERNEL_DEFAULTS:
        return SHORT_CONV, f"model_type {model_type} (gated short-conv layers)"
    if model_type == RWKV:
        return RWKV, "model_type rwkv (RWKV-4 time-mix and channel-mix, a recurrence)"
    if model_type == "xlstm":
        return MLSTM, "model_type xlstm (mLSTM layers, a recurrence)"
    if model_type in _LIGHTNING_TYPES:
        return LIGHTNING, f"model_type {model_type} (lightning attention, {_LIGHTNING_TYPES[model_type]})"
    if model_type == "recurrent_gemma":
        return RG_LRU, "model_type recurrent_gemma (conv + RG-LRU recurrent blocks)"
    if model_type in CCA_HYBRIDS:
        return CCA, f"model_type {model_type} (CCA projections: a conv state and a delayed value beside each attention)"
    if model_type != "bailing_hybrid":
        return None
    lightning = [f for f in _LIGHTNING_FIELDS if get(f) is not None]
    kda = [f for f in _KDA_FIELDS if get(f) is not None]
    if _LIGHTNING_ARCH in architectures:
        lightning.append(f"architectures {_LIGHTNING_ARCH}")
    if lightning and kda:
        raise InputError(where, f"model_type bailing_hybrid with both Ling-2.5 lightning fields ({lightning[0]}) "
                                f"and Ling-3.0 KDA fields ({kda[0]}): kvcache cannot tell which state to plan",
                         field="model_type")
    if lightning:
        return LIGHTNING, f"model_type bailing_hybrid with {lightning[0]} (Ling-2.5 lightning attention)"
    if kda:
        return KIMI_DELTA, f"model_type bailing_hybrid with {kda[0]} (Ling-3.0 KDA, transformers' bailing_hybrid)"
    raise InputError(where, "model_type bailing_hybrid names two architectures (Ling-2.5 lightning attention: "
                            f"{', '.join(_LIGHTNING_FIELDS)}; Ling-3.0 KDA: short_conv_kernel_size) and the config "
                            "has the fields of neither", field="model_type")


def bailing_layer_kinds(group: int, num_layers: int, family: str) -> tuple[str, ...]:
    """Ling's ``layer_group_size``: the last layer of every group is full attention. Ling-2.5's code also makes the
    layers past the last whole group full (upstream modeling_bailing_moe_v2_5.py, ``attention_layer_type``);
    transformers' KDA ``bailing_hybrid`` only the last of each group."""
    tail = num_layers // group * group if family == LIGHTNING else num_layers
    return tuple("full" if (i + 1) % group == 0 or i >= tail else "linear" for i in range(num_layers))


def read_linear(r, family: str, why: str, heads: int, head_dim_field: tuple[Any, str] | None,
                limits: dict[str, int], hidden: int = 0, model_type: str = "") -> LinearFacts:
    """The family's sizes from the config (``r``: config_loader's reader; defaults named by their class)."""
    if family == GATED_DELTA_NET:
        return _read_gdn(r, why, heads, hidden, limits, GDN_VARIANTS[model_type])
    if family == MAMBA2:
        return _read_mamba2(r, why, hidden, limits, model_type)
    if family == MAMBA:
        return _read_mamba(r, why, hidden, limits, model_type)
    if family == SHORT_CONV:
        return _read_short_conv(r, why, hidden, model_type)
    if family == RWKV:
        return _read_rwkv(r, why, hidden)
    if family == MLSTM:
        return _read_mlstm(r, why, hidden, limits)
    if family == RG_LRU:
        return _read_rg_lru(r, why, hidden, limits)
    if family == CCA:
        return _read_cca(r, why, heads, head_dim_field, limits)
    if family == KIMI_DELTA:
        section = r.mapping("linear_attn_config")
        sub = section[0] if section else {}
        h = _sub_int(r, sub, section, "num_heads") or r.positive_int("linear_num_heads", "num_attention_heads",
                                                                      maximum=limits["heads"])
        # linear_head_dim: a config transformers re-saved (it overwrote head_dim with the MLA rope dim); else the
        # published file's head_dim (Ling-3.0), else the class default (Kimi-Linear).
        d = (_sub_int(r, sub, section, "head_dim") or r.positive_int("linear_head_dim", required=False,
                                                                      maximum=limits["head_dim"])
             or (_positive(r, head_dim_field) if head_dim_field else None))
        if d is None:
            raise InputError(r.where, "missing (looked for linear_attn_config.head_dim, linear_head_dim, head_dim)",
                             field="linear_head_dim")
        kernel = _sub_int(r, sub, section, "short_conv_kernel_size") or r.positive_int(
            "short_conv_kernel_size", "linear_conv_kernel_dim", maximum=64)
        src = f"{why}: {h.source}, {d.source}, {kernel.source}"
        return LinearFacts(family, h.value, h.value, d.value, d.value, kernel.value, 3 * h.value * d.value, src,
                           REFERENCE[family])
    d = _positive(r, head_dim_field) if head_dim_field else None
    if d is None and model_type in _LIGHTNING_TYPES:  # MiniMaxLightningAttention: head_dim or hidden // heads
        d = _int_at(r.where, "hidden_size", hidden // heads) if heads else None
        d = d and _Hit(d.value, "default: hidden_size // num_attention_heads (MiniMaxLightningAttention.head_dim)")
    if d is None:
        raise InputError(r.where, "missing: Ling-2.5's linear layers use head_dim per head", field="head_dim")
    module = _LIGHTNING_TYPES.get(model_type)
    reference = f"transformers {module.split(':')[1]} (its block-chunked lightning attention)" if module \
        else REFERENCE[family]
    return LinearFacts(family, heads, heads, d.value, d.value, None, 0,
                       f"{why}: num_attention_heads, {d.source} (state [H, D, D]; no short conv)", reference,
                       query_scale=1.0 if module else None)


def _read_gdn(r, why: str, heads: int, hidden: int, limits: dict[str, int], variant: GdnVariant) -> LinearFacts:
    """A gated delta net's sizes: Nk key heads of Dk, Nv value heads of Dv, the conv over q|k|v; a variant that
    derives them (OLMo-Hybrid) as its config class does when the config leaves them out."""
    need = not variant.derived
    nk = r.positive_int("linear_num_key_heads", required=need, maximum=limits["heads"])
    nv = r.positive_int("linear_num_value_heads", required=need, maximum=limits["heads"])
    dk = r.positive_int("linear_key_head_dim", required=need, maximum=limits["head_dim"])
    dv = r.positive_int("linear_value_head_dim", required=need, maximum=limits["head_dim"])
    if variant.derived:  # OlmoHybridConfig.__post_init__: heads = num_attention_heads, Dk = int(0.75 hidden / Nk)
        nk = nk or _Hit(heads, "default: num_attention_heads (OlmoHybridConfig.__post_init__)")
        nv = nv or _Hit(heads, "default: num_attention_heads (OlmoHybridConfig.__post_init__)")
        if dk is None:
            dk = _int_at(r.where, "linear_key_head_dim", int(0.75 * hidden / nk.value))
            dk = _Hit(dk.value, f"default: int(0.75 x hidden_size / {nk.source}) (OlmoHybridConfig.__post_init__)")
        dv = dv or _Hit(2 * dk.value, f"default: 2 x {dk.source} (OlmoHybridConfig.__post_init__)")
    kernel = r.positive_int("linear_conv_kernel_dim", maximum=64)
    if nv.value % nk.value:
        raise InputError(r.where, f"{nv.value} value heads are not a multiple of {nk.value} key heads "
                                  "(each key head serves a group of value heads)", field=nv.source)
    channels = 2 * nk.value * dk.value + nv.value * dv.value
    src = f"{why}: {nk.source}, {nv.source}, {dk.source}, {dv.source}, {kernel.source}"
    scale = 1.0
    if variant.beta_scale is not None:
        name, default = variant.beta_scale
        hit = r.flag(name)
        on, where = hit if hit is not None else (default, f"default: {name} {default} ({variant.module})")
        scale = 2.0 if on else 1.0
        src += f", {where}: beta = {scale:g} x sigmoid(b)"
    return LinearFacts(GATED_DELTA_NET, nk.value, nv.value, dk.value, dv.value, kernel.value, channels,
                       src, variant.reference, scale)


def _read_mamba2(r, why: str, hidden: int, limits: dict[str, int], model_type: str) -> LinearFacts:
    """Mamba-2: H heads of P channels, G groups of B/C with N state channels; the inner width I = H x P is what
    in_proj, the conv and out_proj are sized by (``expand x hidden`` or Falcon-H1's ``mamba_d_ssm``), refused when the
    config's own width disagrees (transformers would build a mixer whose scan cannot view its input)."""
    names = _MAMBA2_FIELDS[model_type]
    h = r.positive_int(names["heads"], maximum=limits["heads"])
    p = r.positive_int(names["head_dim"], required=not names.get("derived_head_dim"), maximum=limits["head_dim"]) \
        or _derived_head_dim(r, h, hidden, model_type)
    n = r.positive_int(names["state"], maximum=limits["head_dim"])
    g = r.positive_int(names["groups"], maximum=limits["heads"])
    kernel = r.positive_int(names["conv"], maximum=64)
    if h.value % g.value:
        raise InputError(r.where, f"{h.value} Mamba heads are not a multiple of {g.value} groups (each B/C group "
                                  "serves H/G heads)", field=g.source)
    inner = r.get("mamba_d_ssm", "mamba_expand", "expand")
    if inner is not None and isinstance(inner[0], (int, float)) and not isinstance(inner[0], bool):
        width = inner[0] if inner[1].endswith("mamba_d_ssm") else int(inner[0] * hidden)
        if hidden and width != h.value * p.value:
            raise InputError(r.where, f"inner width {width} ({inner[1]}) is not heads x head_dim = {h.value} x "
                                      f"{p.value}: the mixer's scan views its input as [heads, head_dim]",
                             field=inner[1])
    src = f"{why}: {h.source}, {p.source}, {n.source}, {g.source}, {kernel.source}"
    return LinearFacts(MAMBA2, g.value, h.value, n.value, p.value, kernel.value,
                       h.value * p.value + 2 * g.value * n.value, src, REFERENCE[MAMBA2])


def _derived_head_dim(r, heads: _Hit, hidden: int, model_type: str) -> _Hit:
    """Zamba2's Mamba head dim as its config class derives it where the config saves none: int(mamba_expand x
    hidden_size) // n_mamba_heads (Zamba2Config.__post_init__), refused when the heads do not divide the inner width (its scan views the inner
    channels as [heads, head_dim])."""
    expand = r.get("mamba_expand")
    if expand is None or isinstance(expand[0], bool) or not isinstance(expand[0], (int, float)) or expand[0] <= 0:
        raise InputError(r.where, f"must be a positive number (model_type {model_type} derives its Mamba head dim "
                                  "from it)", field=expand[1] if expand else "mamba_expand")
    inner = int(expand[0] * hidden)
    if inner % heads.value:
        raise InputError(r.where, f"{heads.value} Mamba heads do not divide the inner width {inner} ({expand[1]} x "
                                  "hidden_size): the mixer's scan views its input as [heads, head_dim]",
                         field=heads.source)
    return _Hit(inner // heads.value, f"default: int({expand[1]} x hidden_size) // {heads.source} (transformers "
                                      "Zamba2Config.__post_init__ mamba_headdim)")


def _read_mamba(r, why: str, hidden: int, limits: dict[str, int], model_type: str) -> LinearFacts:
    """Mamba-1: I = expand x hidden inner channels, each with an N-channel state; one B/C for all (a single
    replicated "key head" of N), each channel a "value head" of width 1. A multi-head mixer (Zamba's n_mamba_heads)
    has one B/C per head, each serving I / H channels: H key heads, refused when they do not divide I
    (ZambaConfig.validate_architecture)."""
    names = _MAMBA_FIELDS[model_type]
    n = r.positive_int(names["state"], maximum=limits["head_dim"])
    kernel = r.positive_int(names["conv"], maximum=64)
    expand = r.positive_int(names["expand"], maximum=1024)
    inner = expand.value * hidden
    src = f"{why}: {n.source}, {kernel.source}, {expand.source} x hidden_size = {inner} inner channels"
    saved = r.positive_int("intermediate_size", required=False, maximum=1 << 24) \
        if model_type in INNER_IS_INTERMEDIATE else None
    if saved is not None:
        # MambaConfig / FalconMambaConfig derive intermediate_size from expand x hidden_size, but a saved one is set
        # after that derivation (from_dict): the mixer is built at the saved width
        inner = saved.value
        src = f"{why}: {n.source}, {kernel.source}, {saved.source} = {inner} inner channels (the mixer's width)"
    heads = r.positive_int(names["heads"], maximum=limits["heads"]) if "heads" in names else None
    if heads is not None:
        if inner % heads.value:
            raise InputError(r.where, f"{heads.value} Mamba heads do not divide the inner width {inner} ({expand.source}"
                                      " x hidden_size): the mixer views its channels as [heads, I / heads] "
                                      "(transformers ZambaConfig.validate_architecture)", field=heads.source)
        src += f", {heads.source} = {heads.value} heads of {inner // heads.value} channels (each its own B/C)"
    return LinearFacts(MAMBA, heads.value if heads else 1, inner, n.value, 1, kernel.value, inner, src,
                       REFERENCE[MAMBA])


def _read_short_conv(r, why: str, hidden: int, model_type: str) -> LinearFacts:
    """LFM2 / LFM3: a depthwise conv of width conv_L_cache over the hidden_size channels (B * x), nothing else kept
    across steps: no heads, no recurrent state (0 in LinearFacts)."""
    kernel = r.positive_int("conv_L_cache", required=False, maximum=64)
    if kernel is None:
        cls, value = _SHORT_CONV_KERNEL_DEFAULTS[model_type]
        kernel = _Hit(value, f"default: transformers {cls}.conv_L_cache")
    if kernel.value < 2:
        raise InputError(r.where, f"must be at least 2 (a conv of width {kernel.value} keeps no previous input)",
                         field=kernel.source)
    src = f"{why}: {kernel.source}, hidden_size = {hidden} conv channels (depthwise, no recurrent state)"
    return LinearFacts(SHORT_CONV, 0, 0, 0, 0, kernel.value, hidden, src, REFERENCE[SHORT_CONV])


def _read_rwkv(r, why: str, hidden: int) -> LinearFacts:
    """RWKV-4: the wkv state over attention_hidden_size channels (RwkvConfig.__post_init__: hidden_size when absent),
    the token shift of both mixes over hidden_size channels each."""
    attn = r.positive_int("attention_hidden_size", required=False, maximum=1 << 20)
    width = attn.value if attn is not None else hidden
    src = (f"{why}: {attn.source if attn else 'attention_hidden_size absent: hidden_size (transformers RwkvConfig)'}"
           f" = {width} wkv channels x (num, den, max); hidden_size = {hidden} token-shift channels per mix")
    return LinearFacts(RWKV, 1, width, RWKV_WKV_PARTS, 1, 2, 2 * hidden, src, REFERENCE[RWKV])


def _read_rg_lru(r, why: str, hidden: int, limits: dict[str, int]) -> LinearFacts:
    """RecurrentGemma: lru_width channels (RecurrentGemmaConfig.__post_init__: hidden_size when absent), a conv of
    conv1d_width (class default 4); the RG-LRU's gates are num_attention_heads diagonal blocks of lru_width / heads
    channels (RecurrentGemmaRglru.block_width), refused when the heads do not divide the width."""
    width = r.positive_int("lru_width", required=False, maximum=1 << 20)
    width = width or _Hit(hidden, "lru_width absent: hidden_size (transformers RecurrentGemmaConfig)")
    kernel = r.positive_int("conv1d_width", required=False, maximum=64) \
        or _Hit(4, "default: transformers RecurrentGemmaConfig.conv1d_width")
    if kernel.value < 2:
        raise InputError(r.where, f"must be at least 2 (a conv of width {kernel.value} keeps no previous input)",
                         field=kernel.source)
    heads = r.positive_int("num_attention_heads", maximum=limits["heads"])
    if width.value % heads.value:
        raise InputError(r.where, f"{heads.value} heads do not divide lru_width {width.value}: the RG-LRU's gates are "
                                  "[heads, lru_width / heads, lru_width / heads] blocks (RecurrentGemmaRglru)",
                         field=width.source)
    src = (f"{why}: {width.source} = {width.value} RG-LRU channels (one float32 state each), {kernel.source} = "
           f"{kernel.value} conv width")
    return LinearFacts(RG_LRU, 1, width.value, 1, 1, kernel.value, width.value, src, REFERENCE[RG_LRU])


def _read_cca(r, why: str, heads: int, head_dim_field: tuple[Any, str] | None, limits: dict[str, int]) -> LinearFacts:
    """ZAYA's CCA projection: the conv over q|k of (H + KVH) heads of head_dim, of receptive field cca_time0 +
    cca_time1 - 1 (ZayaCCAProjection.conv_kernel_size = the state's columns), the delayed half of each KV head
    (head_dim / 2, v_proj_delayed's width per head)."""
    kv = r.positive_int("num_key_value_heads", maximum=limits["heads"])
    d = _positive(r, head_dim_field) if head_dim_field else r.positive_int("head_dim", maximum=limits["head_dim"])
    widths = []
    for name in ("cca_time0", "cca_time1"):
        hit = r.positive_int(name, required=False, maximum=64) or _Hit(_CCA_DEFAULTS[name],
                                                                       f"default: transformers ZayaConfig.{name}")
        widths.append(hit)
    if d.value % 2:
        raise InputError(r.where, f"must be even: ZayaCCAProjection takes half of each value head ({d.value}) from "
                                  "v_proj_current and half from v_proj_delayed", field=d.source)
    kernel = widths[0].value + widths[1].value - 1
    if kernel < 2:
        raise InputError(r.where, "cca_time0 + cca_time1 - 1 must be at least 2 (a conv of width 1 keeps no previous "
                                  "input)", field=widths[0].source)
    src = (f"{why}: num_attention_heads = {heads}, {kv.source} = {kv.value}, {d.source} = {d.value}, "
           f"{widths[0].source} + {widths[1].source} - 1 = {kernel} conv inputs per output")
    return LinearFacts(CCA, heads, kv.value, d.value, d.value // 2, kernel, (heads + kv.value) * d.value, src,
                       REFERENCE[CCA])


# xLSTMConfig's defaults of the fields that size an mLSTM layer
_MLSTM_DEFAULTS = {"num_heads": 8, "qk_dim_factor": 0.5, "v_dim_factor": 1.0}


def _read_mlstm(r, why: str, hidden: int, limits: dict[str, int]) -> LinearFacts:
    """xLSTM: H heads; xLSTMLayer projects q / k to int(hidden x qk_dim_factor) and v to int(hidden x v_dim_factor)
    channels (the config's rounded qk_dim / v_dim are not what the layer builds), split over the heads."""
    heads = r.positive_int("num_heads", required=False, maximum=limits["heads"]) \
        or _Hit(_MLSTM_DEFAULTS["num_heads"], "default: transformers xLSTMConfig.num_heads")
    widths = {}
    for name in ("qk_dim_factor", "v_dim_factor"):
        hit = r.get(name)
        factor, src = (hit if hit is not None and hit[0] is not None
                       else (_MLSTM_DEFAULTS[name], f"default: transformers xLSTMConfig.{name}"))
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise InputError(r.where, f"must be a positive number, got {factor!r}", field=src)
        width = int(hidden * factor)
        if width < heads.value or width % heads.value:
            raise InputError(r.where, f"int(hidden_size x {name}) = {width} is not a multiple of {heads.value} heads "
                                      "(xLSTMLayer reshapes it to [heads, head_dim])", field=src)
        widths[name] = (width // heads.value, src)
    (dk, dk_src), (dv, dv_src) = widths["qk_dim_factor"], widths["v_dim_factor"]
    src = (f"{why}: {heads.source} = {heads.value} heads, int(hidden_size x {dk_src}) / heads = {dk} (Dqk), "
           f"int(hidden_size x {dv_src}) / heads = {dv} (Dv)")
    return LinearFacts(MLSTM, heads.value, heads.value, dk, dv, None, 0, src, REFERENCE[MLSTM])


def short_conv_layer_kinds(r, model_type: str, num_layers: int) -> tuple[tuple[str, ...], str] | None:
    """An LFM2 config without ``layer_types``: ``full_attn_idxs`` lists the attention layers, the others are conv
    (Lfm2Config.__post_init__; absent, every layer attends). None for other model types or without the field; LFM2-MoE
    and LFM3 without ``layer_types`` are refused (bad input, the field named)."""
    if model_type not in _SHORT_CONV_KERNEL_DEFAULTS:
        return None
    if model_type != "lfm2":
        # Lfm2MoeConfig has no default (its decoder layers index config.layer_types: transformers cannot build the
        # model without it); Lfm3Config derives a pattern with sliding layers kvcache does not rebuild here
        cls = _SHORT_CONV_KERNEL_DEFAULTS[model_type][0]
        why = (f"; {cls} derives none when it is absent, and its decoder layers index config.layer_types: a config "
               "without it does not build in transformers either") if model_type == "lfm2_moe" else \
            f" ({cls} derives a pattern with sliding layers kvcache does not rebuild)"
        raise InputError(r.where, f"missing: model_type {model_type} names its conv and attention layers in "
                                  f"layer_types (transformers' decoder layers read config.layer_types){why}",
                         field="layer_types")
    hit = r.get("full_attn_idxs")
    if hit is None or hit[0] is None:
        return None
    listed, src = hit
    if not isinstance(listed, list):
        raise InputError(r.where, "must be a list of layer indices", field=src)
    for i, n in enumerate(listed):
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < num_layers:
            raise InputError(r.where, f"must be a layer index in 0..{num_layers - 1}, got {n!r}", field=f"{src}[{i}]")
    return tuple("full" if i in listed else "linear" for i in range(num_layers)), f"{src} (the others short conv)"


@dataclass(frozen=True)
class _Hit:
    """A value and the config field it came from (the reader's Sourced, without importing the loader)."""

    value: int
    source: str


def _int_at(where: str, src: str, value: Any) -> _Hit:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(where, f"must be a positive integer, got {value!r}", field=src)
    return _Hit(value, src)


def _sub_int(r, sub: dict, section, name: str) -> _Hit | None:
    """A positive int from the ``linear_attn_config`` object (Kimi-Linear's checkpoint layout), None if absent."""
    if name not in sub or sub[name] is None:
        return None
    return _int_at(r.where, f"{section[1]}.{name}", sub[name])


def _positive(r, hit: tuple[Any, str]) -> _Hit:
    return _int_at(r.where, hit[1], hit[0])


def kimi_layer_kinds(r, num_layers: int) -> tuple[tuple[str, ...], str] | None:
    """Kimi-Linear's checkpoint layout: ``linear_attn_config.full_attn_layers`` / ``kda_layers``, 1-indexed
    (transformers KimiLinearConfig.__post_init__)."""
    section = r.mapping("linear_attn_config")
    if not section or "full_attn_layers" not in section[0] or "kda_layers" not in section[0]:
        return None
    raw, src = section
    kinds: list[str | None] = [None] * num_layers
    for name, kind in (("full_attn_layers", "full"), ("kda_layers", "linear")):
        listed = raw[name]
        if not isinstance(listed, list):
            raise InputError(r.where, "must be a list of 1-based layer numbers", field=f"{src}.{name}")
        for i, n in enumerate(listed):
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= num_layers:
                raise InputError(r.where, f"must be a layer number in 1..{num_layers}, got {n!r}",
                                 field=f"{src}.{name}[{i}]")
            if kinds[n - 1] is not None:
                raise InputError(r.where, f"layer {n} listed twice", field=f"{src}.{name}[{i}]")
            kinds[n - 1] = kind
    missing = [i + 1 for i, k in enumerate(kinds) if k is None]
    if missing:
        raise InputError(r.where, f"layers {missing[:5]} are in neither full_attn_layers nor kda_layers",
                         field=src)
    return tuple(kinds), f"{src}.full_attn_layers / kda_layers (1-based)"


def mamba_layer_kinds(r, model_type: str, num_layers: int) -> tuple[tuple[str, ...], str] | None:
    """Where a Mamba hybrid without ``layer_types`` puts its attention layers: Jamba ``attn_layer_period`` /
    ``attn_layer_offset`` (JambaConfig.layers_block_type: attention where i % period == offset), Bamba
    ``attn_layer_indices`` (BambaConfig.layers_block_type; none: every layer Mamba). None for other model types."""
    if model_type == "jamba":
        period = r.positive_int("attn_layer_period")
        offset_hit = r.get("attn_layer_offset")
        offset = offset_hit[0] if offset_hit else None
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < period.value:
            raise InputError(r.where, f"must be an integer in 0..{period.value - 1} (below attn_layer_period), got "
                                      f"{offset!r}", field=offset_hit[1] if offset_hit else "attn_layer_offset")
        kinds = tuple("full" if i % period.value == offset else "linear" for i in range(num_layers))
        return kinds, f"{period.source}={period.value}, {offset_hit[1]}={offset} (attention where i % period == offset)"
    if model_type in _PURE_STACKS:  # Mamba2ForCausalLM, MambaForCausalLM ...: a stack of mixers, no attention
        what = {RWKV: "an RWKV time-mix and channel-mix", "xlstm": "an mLSTM layer"}.get(model_type, "a Mamba mixer")
        return ("linear",) * num_layers, f"model_type {model_type} (every layer {what}, no attention)"
    if model_type in PARALLEL_HYBRIDS:
        return (PARALLEL,) * num_layers, f"model_type {model_type} (attention and a Mamba-2 mixer side by side in " \
                                         "every decoder layer)"
    if model_type == "bamba":
        hit = r.get("attn_layer_indices")
        listed = hit[0] if hit else []
        src = hit[1] if hit else "attn_layer_indices (absent: every layer Mamba)"
        if not isinstance(listed, list):
            raise InputError(r.where, "must be a list of layer indices", field=src)
        for i, n in enumerate(listed):
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < num_layers:
                raise InputError(r.where, f"must be a layer index in 0..{num_layers - 1}, got {n!r}",
                                 field=f"{src}[{i}]")
        return tuple("full" if i in listed else "linear" for i in range(num_layers)), f"{src} (the others Mamba)"
    return None


# Nemotron-H's hybrid_override_pattern characters (NemotronHConfig._pattern_to_list)
_NEMOTRON_PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
# NemotronHConfig.__post_init__: neither layers_block_type nor hybrid_override_pattern given
_NEMOTRON_DEFAULT_BLOCKS = ("linear_attention", "moe", "full_attention", "mlp")


def block_types(r, model_type: str) -> tuple[list[str], str] | None:
    """Nemotron-H's decoder blocks, one type each (the layer count is their number: NemotronHConfig.num_hidden_layers
    is derived from the list, a config's own num_hidden_layers ignored): ``layers_block_type``, else the legacy
    ``hybrid_override_pattern`` string (M Mamba-2, * attention, - MLP, E MoE), else the class default. None for
    other model types."""
    if model_type != "nemotron_h":
        return None
    hit = r.get("layers_block_type", "hybrid_override_pattern")
    if hit is None:
        return list(_NEMOTRON_DEFAULT_BLOCKS), "default: transformers NemotronHConfig.layers_block_type"
    value, src = hit
    if isinstance(value, str) and value:
        for i, ch in enumerate(value):
            if ch not in _NEMOTRON_PATTERN:
                raise InputError(r.where, f"unknown block {ch!r} (M Mamba-2, * attention, - MLP, E MoE)",
                                 field=f"{src}[{i}]")
        return [_NEMOTRON_PATTERN[ch] for ch in value], f"{src} (M Mamba-2, * attention, - MLP, E MoE)"
    if isinstance(value, list) and value and all(isinstance(t, str) for t in value):
        return list(value), src
    raise InputError(r.where, "must be a non-empty list of block types or a pattern string", field=src)


MIXER_FACT = "mixer_"  # the prefix of mixer_facts' names


def mixer_facts(module) -> dict[str, int | None]:
    """A transformers Mamba mixer's sizes as the architecture cross-check compares them (analyzer/arch_check.py):
    heads, head dim, state size, groups and the conv's kernel and channels, read off the module built on the meta
    device; empty for any other module."""
    conv = getattr(module, "conv1d", None)
    state = getattr(module, "ssm_state_size", None)
    if conv is not None and isinstance(getattr(module, "head_k_dim", None), int) and hasattr(module, "dt_bias"):
        return gdn_facts(module)
    if conv is None or not isinstance(state, int) or not hasattr(module, "A_log"):
        return short_conv_facts(module) or rwkv_facts(module) or mlstm_facts(module) or rg_lru_facts(module) \
            or cca_facts(module)
    facts = {"mixer_state": state, "mixer_conv_kernel": int(conv.kernel_size[0]), "mixer_conv_channels":
             int(conv.in_channels)}
    if isinstance(getattr(module, "num_heads", None), int):  # Mamba-2: heads x head_dim, B/C groups
        facts.update(mixer_heads=module.num_heads, mixer_head_dim=module.head_dim, mixer_groups=module.n_groups)
    else:  # Mamba-1: one state row per inner channel; Zamba's heads each their own B/C (as groups)
        facts.update(mixer_heads=int(module.intermediate_size), mixer_head_dim=1,
                     mixer_groups=int(getattr(module, "n_mamba_heads", 1)))
    return facts


def short_conv_facts(module) -> dict[str, int | None]:
    """An LFM2-family short-conv layer's conv sizes (its depthwise ``conv`` beside ``in_proj`` / ``out_proj``), read off
    the module built on the meta device; empty for any other module."""
    conv = getattr(module, "conv", None)
    if conv is None or not hasattr(module, "in_proj") or not hasattr(module, "out_proj") \
            or getattr(conv, "groups", None) != getattr(conv, "in_channels", 0):
        return {}
    return {"mixer_conv_kernel": int(conv.kernel_size[0]), "mixer_conv_channels": int(conv.in_channels),
            "mixer_short_conv": 1}


def rwkv_facts(module) -> dict[str, int | None]:
    """An RWKV-4 time-mix's sizes (RwkvSelfAttention: ``time_decay`` / ``time_first`` per attention channel, the token
    shift's ``time_mix_key`` per hidden channel), read off the module built on the meta device; empty for any other
    module."""
    decay, first, mix = (getattr(module, n, None) for n in ("time_decay", "time_first", "time_mix_key"))
    if decay is None or first is None or mix is None or not hasattr(module, "receptance"):
        return {}
    return {"mixer_wkv_channels": int(decay.shape[-1]), "mixer_shift_channels": 2 * int(mix.shape[-1])}


def rg_lru_facts(module) -> dict[str, int | None]:
    """A RecurrentGemma recurrent block's sizes (RecurrentGemmaRecurrentBlock: its depthwise ``conv_1d`` over the
    lru_width channels beside its ``rg_lru``), read off the module built on the meta device; empty for any other
    module."""
    conv, lru = getattr(module, "conv_1d", None), getattr(module, "rg_lru", None)
    if conv is None or lru is None or not hasattr(lru, "recurrent_param"):
        return {}
    return {"mixer_lru_width": int(lru.recurrent_param.shape[-1]), "mixer_conv_kernel": int(conv.kernel_size[0]),
            "mixer_conv_channels": int(conv.in_channels)}


def cca_facts(module) -> dict[str, int | None]:
    """A ZAYA CCA projection's sizes (ZayaCCAProjection: its two q|k convs, its kv heads, v_proj_delayed's width),
    read off the module built on the meta device; empty for any other module."""
    depthwise, grouped = getattr(module, "conv_qk_depthwise", None), getattr(module, "conv_qk_grouped", None)
    delayed = getattr(module, "v_proj_delayed", None)
    if depthwise is None or grouped is None or delayed is None:
        return {}
    return {"mixer_cca_kv_heads": int(module.num_key_value_heads), "mixer_heads": int(module.num_attention_heads),
            "mixer_cca_delayed": int(delayed.out_features),
            "mixer_conv_kernel": int(depthwise.kernel_size[0]) + int(grouped.kernel_size[0]) - 1,
            "mixer_conv_channels": int(depthwise.in_channels)}


def mlstm_facts(module) -> dict[str, int | None]:
    """An xLSTM mLSTM layer's sizes (xLSTMLayer: its backend, heads from its config, q / v widths as it projects
    them), read off the module built on the meta device; empty for any other module."""
    config = getattr(module, "config", None)
    if not hasattr(module, "mlstm_backend") or not isinstance(getattr(config, "num_heads", None), int):
        return {}
    heads = config.num_heads
    return {"mixer_heads": heads, "mixer_qk_head_dim": int(module.qk_dim) // heads,
            "mixer_v_head_dim": int(module.v_dim) // heads}


def gdn_facts(module) -> dict[str, int | None]:
    """A transformers gated delta net's sizes (Qwen3NextGatedDeltaNet, Qwen3_5GatedDeltaNet and its subclasses,
    OlmoHybridGatedDeltaNet): heads and dims of k and v, the conv's kernel and channels, and the beta scale (2 where
    the module doubles beta: OLMo-Hybrid's ``allow_neg_eigval``), read off the module built on the meta device."""
    return {"mixer_gdn_k_heads": module.num_k_heads, "mixer_gdn_v_heads": module.num_v_heads,
            "mixer_gdn_k_dim": module.head_k_dim, "mixer_gdn_v_dim": module.head_v_dim,
            "mixer_conv_kernel": int(module.conv1d.kernel_size[0]), "mixer_conv_channels": int(module.conv1d.in_channels),
            "mixer_gdn_beta_scale": 2 if getattr(module, "allow_neg_eigval", False) else 1}


def mixer_off(lin: LinearFacts, facts: dict[str, int | None]) -> str | None:
    """Where the planned Mamba state differs from the transformers mixer's sizes (None: they agree, or the module
    is not a Mamba mixer, or the plan is another family's)."""
    if lin.family == SHORT_CONV or facts.get("mixer_short_conv"):
        return _short_conv_off(lin, facts)
    for family, (marker, module, planned_of) in _SIZED_FAMILIES.items():
        if lin.family == family or facts.get(marker):
            if not facts:
                return None
            if lin.family != family or not facts.get(marker):
                return f"family {lin.family} vs transformers' {module if lin.family != family else 'mixer'}"
            return _sizes_off(planned_of(lin), facts)
    if lin.family == GATED_DELTA_NET and facts.get("mixer_gdn_k_heads"):
        return _sizes_off({"mixer_gdn_k_heads": lin.num_k_heads, "mixer_gdn_v_heads": lin.num_v_heads,
                           "mixer_gdn_k_dim": lin.head_k_dim, "mixer_gdn_v_dim": lin.head_v_dim,
                           "mixer_conv_kernel": lin.conv_kernel, "mixer_conv_channels": lin.conv_channels,
                           "mixer_gdn_beta_scale": lin.beta_scale}, facts)
    if not facts.get("mixer_state") or lin.family not in (MAMBA2, MAMBA):
        return None
    return _sizes_off({"mixer_heads": lin.num_v_heads, "mixer_head_dim": lin.head_v_dim, "mixer_state": lin.head_k_dim,
                       "mixer_groups": lin.num_k_heads, "mixer_conv_kernel": lin.conv_kernel,
                       "mixer_conv_channels": lin.conv_channels}, facts)


# The state families whose module tells itself apart by one size (the marker fact): that fact, what transformers calls
# the module, and the planned sizes its facts are compared with.
_SIZED_FAMILIES = {
    MLSTM: ("mixer_qk_head_dim", "mLSTM layer", lambda lin: {
        "mixer_heads": lin.num_v_heads, "mixer_qk_head_dim": lin.head_k_dim, "mixer_v_head_dim": lin.head_v_dim}),
    RG_LRU: ("mixer_lru_width", "RG-LRU block", lambda lin: {
        "mixer_lru_width": lin.num_v_heads, "mixer_conv_kernel": lin.conv_kernel,
        "mixer_conv_channels": lin.conv_channels}),
    CCA: ("mixer_cca_kv_heads", "CCA projection", lambda lin: {
        "mixer_cca_kv_heads": lin.num_v_heads, "mixer_heads": lin.num_k_heads,
        "mixer_cca_delayed": lin.num_v_heads * lin.head_v_dim, "mixer_conv_kernel": lin.conv_kernel,
        "mixer_conv_channels": lin.conv_channels}),
    RWKV: ("mixer_wkv_channels", "RWKV time-mix", lambda lin: {
        "mixer_wkv_channels": lin.num_v_heads, "mixer_shift_channels": lin.conv_channels}),
}


def _sizes_off(planned: dict[str, float], facts: dict[str, int | None]) -> str | None:
    """'size planned vs transformers' for each planned size the module's facts contradict (None: none does)."""
    off = [f"{name[6:]} {planned[name]:g} vs {facts[name]}" if isinstance(planned[name], float)
           else f"{name[6:]} {planned[name]} vs {facts[name]}" for name in planned if facts.get(name) != planned[name]]
    return ", ".join(off) or None


def _short_conv_off(lin: LinearFacts, facts: dict[str, int | None]) -> str | None:
    """A short-conv plan against a transformers module: its conv's kernel and channels (None: they agree, or the
    module is no mixer); a short-conv module under another family's plan, or a Mamba mixer under a short-conv plan,
    is named."""
    if not facts:
        return None
    if lin.family != SHORT_CONV or not facts.get("mixer_short_conv"):
        return f"family {lin.family} vs transformers' {'short conv' if facts.get('mixer_short_conv') else 'Mamba mixer'}"
    planned = {"mixer_conv_kernel": lin.conv_kernel, "mixer_conv_channels": lin.conv_channels}
    off = [f"{name[6:]} {planned[name]} vs {facts[name]}" for name in planned if facts.get(name) != planned[name]]
    return ", ".join(off) or None


def sublayer_kinds(config_kind: str, sublayers: int) -> tuple[str, ...]:
    """The layer kind of each sublayer of a decoder layer: a parallel layer's (or a Zamba2 hybrid layer's) attention,
    then its Mamba state; a state layer of a model with up to two sublayers (Zamba2's Mamba layers) its state only;
    any other kind repeated (LongCat-Flash's two attention sublayers)."""
    if config_kind in (PARALLEL, SHARED_BLOCK):
        return "full", "linear"
    if config_kind == PARALLEL_SLIDING:
        return "sliding", "linear"
    return (config_kind,) if config_kind == "linear" else (config_kind,) * sublayers


def attends(config_kind: str) -> bool:
    """A decoder layer of this config kind has an attention (and so a KV cache): neither a pure state layer nor a
    layer without any cache."""
    return config_kind not in ("linear", NO_CACHE)


def holds_state(config_kind: str) -> bool:
    """A decoder layer of this config kind keeps a recurrent state (a linear layer, or a parallel one's mixer)."""
    return config_kind in ("linear", PARALLEL, PARALLEL_SLIDING, SHARED_BLOCK)
