"""The recurrent states of a hybrid model's linear layers: gated delta net, KDA, lightning, Mamba-2, Mamba-1
(templates/kinds/recurrent_state.py.j2)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from model_infer_kvcache.analyzer.linear_config import CONV_ONLY
from model_infer_kvcache.analyzer.operators.gdr_facts import RECURRENT_MAX_LEN, chunk_misfit, recurrent_misfit
from model_infer_kvcache.implementer.kinds.common import TORCH_DTYPE, bad

NAME = "recurrent state"
# Linear-attention families whose states the partial renders, and how the rendered code names each.
FAMILY_NAMES = {"gated_delta_net": "gated delta net", "kimi_delta_attention": "Kimi delta attention",
                "lightning_attention": "lightning attention", "mamba2": "Mamba-2", "mamba": "Mamba-1",
                "short_conv": "short conv", "rwkv": "RWKV", "mlstm": "mLSTM",
                "rg_lru": "RG-LRU", "cca": "CCA projection"}
# Families rendered without speculative decoding only (no published checkpoint of theirs has MTP layers)
NO_SPECULATIVE = frozenset({"mamba2", "mamba", "short_conv", "rwkv", "mlstm", "rg_lru", "cca"})
RENDERED = tuple(FAMILY_NAMES)
# transformers' attribute of a decoder layer's state module (JambaMambaDecoderLayer.mamba, Bamba / Granite-4.0-H
# .mamba; Qwen3-Next, Ling: .linear_attn)
MODULE_ATTR = {"mamba2": "mamba", "mamba": "mamba",  # Falcon-H1 too: self_attn and mamba side by side
               "short_conv": "conv",  # Lfm2DecoderLayer / Lfm3DecoderLayer .conv
               "rwkv": "attention",  # RwkvBlock.attention (the time-mix), whose states its feed_forward shares
               "mlstm": "mlstm_layer",  # xLSTMBlock.mlstm_layer
               "rg_lru": "temporal_block",  # RecurrentGemmaDecoderLayer.temporal_block (RecurrentGemmaRecurrentBlock)
               "cca": "self_attn.qkv_proj"}  # ZayaDecoderLayer.self_attn.qkv_proj (ZayaCCAProjection)
# families whose decoder layer keeps its attention under the state module's attribute too (RecurrentGemmaDecoderLayer:
# an attention block or a recurrent block, both as temporal_block): the render's attention attribute unless the user
# names another (--attn-attr)
ATTENTION_ATTR = {"rg_lru": "temporal_block"}


def attention_attr_names(m, names):
    """The names with the family's own attention attribute where the user kept the default one."""
    lin = m.linear_attention
    attr = ATTENTION_ATTR.get(lin.family) if lin is not None else None
    if attr is None or names.attn_attr != type(names).attn_attr:
        return names
    return replace(names, attn_attr=attr)


# model types whose decoder blocks keep every mixer (Mamba, attention, MLP, MoE) as ``mixer``: Mamba2Block,
# MambaBlock, FalconMambaBlock, NemotronHBlock
MIXER_ATTR = {"mamba": "mixer", "mamba2": "mixer", "falcon_mamba": "mixer", "nemotron_h": "mixer",
              "minimax": "self_attn"}  # MiniMaxDecoderLayer: self_attn is its lightning or its softmax attention
# model types whose hybrid decoder layer keeps its attention in a shared transformer block and its mixer in a Mamba
# decoder below it: (block attribute, the block's attention, the mixer's decoder), as transformers names them
# (Zamba2HybridLayer.shared_transformer.self_attn, .mamba_decoder.mamba; a Zamba2 Mamba layer keeps .mamba itself)
SHARED_BLOCK_ATTRS = {"zamba2": ("shared_transformer", "self_attn", "mamba_decoder"),
                      # ZambaHybridLayer.shared_transf.self_attn, .mamba_decoder.mamba
                      "zamba": ("shared_transf", "self_attn", "mamba_decoder")}


@dataclass(frozen=True)
class LinearCtx:
    """A linear layer's family and sizes on one rank (manifest.linear_attention)."""

    family: str
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int  # 0: the family has no short conv (lightning), so no conv state
    conv_channels: int
    conv_dtype: str
    state_dtype: str
    layers: tuple[int, ...]
    state_shape: str  # one request's recurrent state, as the rendered constants: the family's layout
    state_layout: str  # which layout, and whose
    next_n: int = 0  # speculative tokens per verify step: 1 + next_n state blocks per request, and an anchor
    parallel: bool = False  # each state sits beside an attention in the same decoder layer (Falcon-H1)
    model_type: str = ""
    beta_scale: float = 1.0  # gated delta net: beta = beta_scale x sigmoid(b) (OLMo-Hybrid's negative eigenvalues)
    prefill_window: int = 0  # gated delta net: 0, prefill by npu_chunk_gated_delta_rule; else the recurrent
    chunk_misfit: str = ""  # operator this many tokens a call, because the chunk operator does not take the sizes
    query_scale: float | None = None  # lightning: the query's scale (None: LINEAR_HEAD_K_DIM ** -0.5; MiniMax 1)

    @property
    def module_attr(self) -> str:
        """The decoder layer's attribute holding the state module, as transformers names it."""
        return MIXER_ATTR.get(self.model_type) or MODULE_ATTR.get(self.family, "linear_attn")

    @property
    def shared_block(self) -> tuple[str, str, str] | None:
        """(block, attention, mixer decoder) attributes of a hybrid layer running a shared transformer block
        (Zamba2), None for every other model."""
        return SHARED_BLOCK_ATTRS.get(self.model_type)

    @property
    def multihead(self) -> bool:
        """A multi-head Mamba-1 mixer (Zamba's n_mamba_heads): each head scans its own channels with its own B/C."""
        return self.family == "mamba" and self.num_k_heads > 1

    @property
    def family_name(self) -> str:
        return FAMILY_NAMES[self.family]

    @property
    def conv_only(self) -> bool:
        """The layers keep a conv state only (short conv): no recurrent state, no recurrence."""
        return self.family in CONV_ONLY


def doc_attention(m) -> str | None:
    """SKILL.md's model-kinds cell of a hybrid's attention (None without recurrent layers)."""
    if m.linear_attention is None:
        return None
    # the sentence below names them
    assert RENDERED == ("gated_delta_net", "kimi_delta_attention", "lightning_attention", "mamba2", "mamba",
                        "short_conv", "rwkv", "mlstm", "rg_lru", "cca")
    return (f"full 层 {m.fa.version};线性层是循环状态(Mamba 组,`linear_attention` 一节):gated delta net 已渲染"
            "(`npu_chunk_gated_delta_rule` prefill、`npu_recurrent_gated_delta_rule` decode),KDA、lightning、"
            "Mamba-2 与 Mamba-1 已渲染(torch 递推;lightning 只有 recurrent_state,没有 conv 状态),short conv"
            "(LFM2)只有 conv 状态,RWKV 已渲染(token shift 状态 + wkv 的 num/den/max,torch 递推),mLSTM(xLSTM)已渲染(C、n、m 合成一个 "
            "recurrent_state,torch 递推),RG-LRU(RecurrentGemma)已渲染(带 bias 的 conv 状态 + 每通道 float32 "
            "的 h,torch 递推),CCA 投影(ZAYA)已渲染(注意力旁的 q|k conv 状态 + 上一 token 的 v_proj_delayed,torch)")


def check_layers(m) -> None:
    states = [layer for layer in m.layers if layer.is_state]
    family = m.linear_attention.family if m.linear_attention else "unknown family"
    if states and (family not in RENDERED or m.kv_mode.value != "paged"):
        raise bad(f"layers[{states[0].index}].states",
                  f"{len(states)} linear layer(s) keep a recurrent state (attn_type Mamba, {family}"
                  f"{'' if m.kv_mode.value == 'paged' else ', Legacy'}); the templates render the states of "
                  f"{', '.join(RENDERED)} paged models only: implement them by hand from the manifest's "
                  "linear_attention section (references/hybrid_linear.md)")
    lin = m.linear_attention
    misfit = recurrent_misfit(lin.num_k_heads_per_rank, lin.num_v_heads_per_rank, lin.head_k_dim, lin.head_v_dim) \
        if states and family == "gated_delta_net" else None
    if misfit:
        raise bad("linear_attention.num_v_heads_per_rank", f"no device path for this gated delta net's decode: {misfit} "
                                                           "(a larger attention TP splits the heads)")
    if states and family in NO_SPECULATIVE and m.linear_attention.state_blocks_per_request > 1:
        raise bad("linear_attention.state_blocks_per_request",
                  f"not supported by kvcache: speculative decoding over {FAMILY_NAMES[family]} states (one state "
                  "block per verify token); render with --next-n 0")


def check(m) -> None:
    """Nothing beyond check_layers: the states' shapes are checked where the context is built."""


def fields(m) -> dict:
    lin = m.linear_attention
    if lin.family in CONV_ONLY:
        return _conv_only_fields(m)
    rec = next(s for s in lin.states if s.name == "recurrent_state")
    conv = next((s for s in lin.states if s.name == "conv_state"), None)  # None: no short conv (lightning)
    # the operator's [Nv, Dv, Dk] for the gated delta net, the torch recurrence's [H, Dk, Dv] for KDA and lightning
    if lin.family == "gated_delta_net":
        dims, layout = ("V", "V", "K"), "[Nv, Dv, Dk]: npu_recurrent_gated_delta_rule's layout"
    elif lin.family == "mamba2":
        dims, layout = ("V", "V", "K"), "[H, P, N] (heads, head_dim, d_state): transformers' Mamba-2 layout"
    elif lin.family == "mamba" and lin.num_k_heads_per_rank > 1:
        dims, layout = ("H", "P", "K"), "[H, I / H, N] (mamba heads, their inner channels, d_state): transformers' " \
                                        "multi-head Mamba-1 (Zamba) layout"
    elif lin.family == "mamba":
        dims, layout = ("V", "K"), "[I, N] (inner channels, d_state): transformers' Mamba-1 layout"
    elif lin.family == "rwkv":
        dims, layout = ("V", "K"), "[A, 3] (attention channels, num | den | max): the wkv kernel's layout"
    elif lin.family == "rg_lru":
        dims, layout = ("V",), "[W] (lru_width channels): transformers' RG-LRU recurrent_states layout"
    elif lin.family == "cca":
        dims, layout = ("V", "V"), "[KVH, head_dim / 2]: the previous token's v_proj_delayed output"
    elif lin.family == "mlstm":
        dims, layout = ("V", "K", "V"), "[H, Dqk + 1, Dv + 1] (C, the normalizer n as its last column, m at [Dqk, 0])"
    else:
        dims, layout = ("V", "K", "V"), "[H, Dk, Dv]: the torch recurrence's layout"
    sizes = {"K": lin.head_k_dim, "V": lin.head_v_dim, "P": lin.num_v_heads_per_rank // lin.num_k_heads_per_rank}
    pad = 1 if lin.family == "mlstm" else 0  # mLSTM: n and m packed beside C (analyzer rules._mlstm_states)
    want = [lin.num_k_heads_per_rank if dims[0] == "H" else lin.num_v_heads_per_rank,
            *(sizes[d] + pad for d in dims[1:])]
    want_conv = None if lin.conv_kernel is None else [lin.conv_channels_per_rank, lin.conv_kernel - 1]
    if (conv.shape if conv else None) != want_conv or rec.shape != want:
        raise bad("linear_attention.states", f"shapes {conv.shape if conv else 'no conv_state'} / {rec.shape} are "
                                             f"not the {lin.family}'s {want_conv or 'no conv_state'} / {want}")
    names = {"H": "LINEAR_NUM_K_HEADS_PER_RANK", "P": "MAMBA_HEAD_CHANNELS"}  # a multi-head Mamba-1's state
    shape = ", ".join([names.get(dims[0], "LINEAR_NUM_V_HEADS_PER_RANK"),
                       *(names.get(d, f"LINEAR_HEAD_{d}_DIM{' + 1' if pad else ''}") for d in dims[1:])])
    shape += "," if len(dims) == 1 else ""  # a one-dimension state (RG-LRU): still a tuple
    return {"linear": LinearCtx(lin.family, int(lin.num_k_heads_per_rank), int(lin.num_v_heads_per_rank),
                                int(lin.head_k_dim), int(lin.head_v_dim), int(lin.conv_kernel or 0),
                                int(lin.conv_channels_per_rank), TORCH_DTYPE[conv.dtype] if conv else "None",
                                TORCH_DTYPE[rec.dtype], tuple(lin.layers), f"({shape})", layout,
                                lin.state_blocks_per_request - 1,
                                m.parallel_hybrid(), m.model.model_type, *_gdn_fields(lin),
                                query_scale=lin.query_scale)}


def _gdn_fields(lin) -> tuple[float, int, str]:
    """(beta scale, prefill window, why the window) of a gated delta net; (1, 0, "") for every other family."""
    if lin.family != "gated_delta_net":
        return 1.0, 0, ""
    misfit = chunk_misfit(lin.num_k_heads_per_rank, lin.num_v_heads_per_rank, lin.head_k_dim, lin.head_v_dim)
    return lin.beta_scale or 1.0, RECURRENT_MAX_LEN if misfit else 0, misfit or ""


def _conv_only_fields(m) -> dict:
    """A short-conv family's context: its conv state alone (no heads, no recurrent state)."""
    lin = m.linear_attention
    conv = next((s for s in lin.states if s.name == "conv_state"), None)
    want = [lin.conv_channels_per_rank, (lin.conv_kernel or 1) - 1]
    if conv is None or conv.shape != want or len(lin.states) != 1:
        raise bad("linear_attention.states", f"{[s.name for s in lin.states]} are not the {lin.family}'s one "
                                             f"conv_state {want}")
    return {"linear": LinearCtx(lin.family, 0, 0, 0, 0, int(lin.conv_kernel), int(lin.conv_channels_per_rank),
                                TORCH_DTYPE[conv.dtype], "None", tuple(lin.layers), "()",
                                "none: the layer keeps its conv state only", lin.state_blocks_per_request - 1,
                                m.parallel_hybrid(), m.model.model_type)}
