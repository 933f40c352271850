"""The validation reference of Ling-2.5 / 2.6 (``BailingMoeV2_5ForCausalLM``: MLA full layers + lightning attention).

transformers (5.24) has no Ling-2.5: its ``bailing_hybrid`` (the model_type Ling-2.5's hub config also names) is
Ling-3.0, whose linear layers are KDA. This reference is built from transformers' own Ling-family code and replaces
only what Ling-2.5 does differently. Provenance, part by part:

* **from transformers, unchanged** (``transformers/models/bailing_hybrid/modeling_bailing_hybrid.py``): the
  CausalLM, model, decoder layer (pre-norm residuals), embedding, RMSNorm, MoE (group-limited sigmoid router with
  ``e_score_correction_bias``, renormalised top-k, routed scaling, shared experts), dense MLP, the MLA full
  attention (``BailingHybridAttention``: q/kv_a/kv_b projections, ``kv_a_layernorm``, interleaved RoPE over
  ``qk_rope_head_dim``, softmax scale ``qk_head_dim ** -0.5``) and its rotary embedding. Its conversion mapping
  writes the published Ling checkpoint names (``model.word_embeddings``, ``.attention.``, ``attention.dense``,
  ``mlp.gate.expert_bias``, per-expert ``experts.E.gate_proj``), which Ling-2.5's ``load_weights`` reads.
* **Ling-3.0's MLA output gate removed**: transformers' MLA multiplies its output by ``sigmoid(g_proj(x))`` per
  head (Ling-3.0); Ling-2.5's MLA has no gate (upstream ``modeling_bailing_moe_v2_5.py`` class
  ``BailingMoeV25MLA``, :676; the file's only g_proj is the linear layers', :1222). ``g_proj`` is replaced by
  ``NoOutputGate``, which has no weight and returns ``+inf``: ``sigmoid(+inf) == 1.0`` exactly, so transformers'
  forward runs as written.
* **the linear layers' module, written here in plain torch** (``LingLightningAttention``): the lightning attention
  recurrence ``S_t = exp(g) S_{t-1} + k_t^T v_t``, ``o_t = q_t S_t`` and its per-head slopes ``base ** (h + 1)``,
  ``base = 2 ** (-8 / H)`` are transformers' ``MiniMaxLightningAttention`` (``models/minimax/modeling_minimax.py``:
  ``get_slope_rate`` :151-160, the recurrence :245-257, the decay-masked intra-block form :162-174 / :228-230),
  the same OpenNLPLab lightning attention. Ling-2.5's own differences are taken from the upstream port
  (``models/bailing_2_5/models/modeling_bailing_moe_v2_5.py``, class ``BailingMoeV25LinearAttention``), each cited
  where it is used: the fused ``[q heads | k heads | v heads]`` projection, q/k RMSNorm (``use_qk_norm``), partial
  rotate-half RoPE on the first ``head_dim * partial_rotary_factor`` dims of q and k, the query scale
  ``head_dim ** -0.5`` (``simple_gla_torch.py``'s default: the port passes no scale), the layer factor
  ``1 - (layer_idx - 1) / (num_hidden_layers - 1) + 1e-5`` on the slopes, group RMSNorm over ``group_norm_size``
  groups, the ``sigmoid(g_proj(x))`` output gate and the output projection.

What it is not: the lightning math here and in the model under test have one source (the port's own reading of the
hub code; the hub file itself is not in the snapshot). So this is an oracle for the cache/state handling of the
model under test (each sequence is computed from scratch in one forward, with no cache, no state and no paging)
and for its MLA/MoE parts (transformers' code); it does not independently confirm that Ling-2.5's published
weights mean what the port computes. ``linear_silu`` (read by no line of the port) must be false.
"""

from __future__ import annotations

import math

import torch
from torch import nn

UPSTREAM = "models/bailing_2_5/models/modeling_bailing_moe_v2_5.py"

# Ling-2.5's config class defaults (upstream configuration_bailing_moe_v2_5.py:26-64) for the fields the reference
# reads: a config.json that omits one means this value to the model under test, while transformers'
# BailingHybridConfig (Ling-3.0) has other defaults (rope_theta 6e6, layer_group_size 6, routed_scaling_factor 2.5,
# first_k_dense_replace 2) or none (the Ling-2.5-only fields).
LING_2_5_DEFAULTS = {
    "use_qkv_bias": False, "use_bias": False, "rms_norm_eps": 1e-06, "rope_theta": 600000.0,
    "num_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 1,
    "head_dim": 128, "use_qk_norm": True, "routed_scaling_factor": 1.0, "layer_group_size": 5, "group_norm_size": 4,
    "linear_silu": False, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "qk_nope_head_dim": 128, "partial_rotary_factor": 0.5,
}


def with_ling_2_5_defaults(real: dict) -> dict:
    """``real`` (a Ling-2.5 config.json) with ``LING_2_5_DEFAULTS`` for the fields it omits."""
    return {**LING_2_5_DEFAULTS, **real}


def lightning_slopes(num_heads: int, layer_idx: int, num_layers: int) -> torch.Tensor:
    """Per-head log decay per token ``g_h < 0`` of one linear layer (float64, ``[H]``): ``S_t = exp(g) S_{t-1} + ...``.

    The rates are MiniMax's ``base ** (h + 1)`` with ``base = 1 / 2 ** (8 / H)`` (modeling_minimax.py:152-157), which
    is OpenNLPLab's ``get_slopes`` (upstream ``build_slope_tensor``, :1271) when H is a power of two; for other head
    counts OpenNLPLab interleaves a second series (the ALiBi workaround) and the two differ, so such H is refused.
    The layer factor is Ling-2.5's (upstream :1253), not MiniMax's ``1 - layer_idx / (L - 1 + 1e-5) + 1e-5``.
    """
    if num_heads < 1 or not math.log2(num_heads).is_integer():
        raise ValueError(f"{num_heads} lightning heads: the reference's slopes (MiniMax's base ** (h + 1)) equal "
                         "Ling-2.5's (OpenNLPLab get_slopes) only for a power-of-two head count")
    if num_layers < 2:
        raise ValueError("Ling-2.5's slope factor divides by num_hidden_layers - 1: at least 2 layers")
    base = 1 / (2 ** (8 / num_heads))
    rate = base ** (torch.arange(num_heads, dtype=torch.float64) + 1)
    factor = 1 - (layer_idx - 1) / (num_layers - 1) + 1e-5  # upstream :1253
    return -rate * factor  # upstream :1254: full_slope = -build_slope_tensor(H) * slope_decay


def lightning_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """``o_t = sum_{s <= t} exp(g (t - s)) (scale q_t . k_s) v_s`` for ``q, k, v [B, S, H, D]``, ``slope`` g ``[H]``.

    The whole sequence at once: the decay-masked form MiniMax computes inside a block (modeling_minimax.py:228-230,
    ``diagonal_decay`` :168-172), here over one block as long as the sequence, so there is no inter-block state.
    It equals the recurrence ``S_t = exp(g) S_{t-1} + k_t^T v_t``, ``o_t = scale q_t S_t`` from ``S_0 = 0``
    (MiniMax :245-257; tests/test_checkout_lightning.py checks both).
    """
    positions = torch.arange(q.shape[1], device=q.device)
    distance = positions[:, None] - positions[None, :]  # t - s
    decay = torch.exp(slope.to(q.dtype)[:, None, None] * distance.clamp(min=0))  # [H, S, S]
    decay = decay.masked_fill(distance < 0, 0.0)
    scores = torch.einsum("bthd,bshd->bhts", q * scale, k) * decay
    return torch.einsum("bhts,bshd->bthd", scores, v)


def rotate_half_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first ``cos.shape[-1]`` dims of ``x [B, S, H, D]``; the rest pass through (upstream
    :1388-:1393: ``npu_apply_rotary_pos_emb(..., layout='BSND')`` on ``q[..., :rope_dim]``, then concatenated)."""
    rot, rest = x[..., :cos.shape[-1]], x[..., cos.shape[-1]:]
    x1, x2 = rot.chunk(2, dim=-1)
    rotated = rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rotated, rest), dim=-1)


class GroupRMSNorm(nn.Module):
    """RMSNorm over each of ``groups`` equal slices of the last dim, then one weight over the whole width
    (upstream ``BailingMoeV25GroupRMSNorm``, :190-:210; ``npu_rms_norm`` with unit gamma per group)."""

    def __init__(self, width: int, groups: int, eps: float):
        super().__init__()
        if width % groups:
            raise ValueError(f"width {width} is not divisible by group_norm_size {groups}")
        self.weight = nn.Parameter(torch.ones(width))
        self.groups = groups
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grouped = x.view(*x.shape[:-1], self.groups, x.shape[-1] // self.groups)
        normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.view(x.shape) * self.weight


class LingLightningAttention(nn.Module):
    """One Ling-2.5 linear (lightning attention) layer, computed over whole sequences from position 0.

    Parameter names are Ling-2.5's published ones under transformers' ``self_attn`` prefix (the conversion mapping
    writes ``attention.``; ``o_proj`` is written ``attention.dense``): ``query_key_value``, ``query_layernorm``,
    ``key_layernorm``, ``g_proj``, ``g_norm``, ``o_proj``.
    """

    def __init__(self, config, layer_idx: int):
        super().__init__()
        from transformers.models.bailing_hybrid.modeling_bailing_hybrid import BailingHybridRMSNorm

        if getattr(config, "linear_silu", False):
            raise ValueError(f"linear_silu is true: no line of the upstream port ({UPSTREAM}) reads it, so the "
                             "reference has no source for what it changes")
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        # transformers' BailingHybridConfig overwrites head_dim with qk_rope_head_dim and keeps the config's
        # head_dim as linear_head_dim; Ling-2.5's linear layers use the config's head_dim (upstream :1173)
        self.head_dim = getattr(config, "linear_head_dim", None) or config.head_dim
        width = self.num_heads * self.head_dim
        # q, k and v: num_attention_heads each (upstream :1174, num_key_value_heads = num_attention_heads), one
        # fused projection laid out [q heads | k heads | v heads] (:1363-:1367)
        self.query_key_value = nn.Linear(config.hidden_size, 3 * width, bias=bool(getattr(config, "use_qkv_bias",
                                                                                        False)))
        self.use_qk_norm = bool(getattr(config, "use_qk_norm", False))
        if self.use_qk_norm:  # upstream :1207-:1209, :1368-:1370
            self.query_layernorm = BailingHybridRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.key_layernorm = BailingHybridRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.g_proj = nn.Linear(config.hidden_size, width, bias=False)  # output gate, upstream :1222
        self.g_norm = GroupRMSNorm(width, config.group_norm_size, config.rms_norm_eps)  # upstream :1233-:1243
        self.o_proj = nn.Linear(width, config.hidden_size, bias=bool(getattr(config, "use_bias", False)))  # :1211
        # partial rotary: dim head_dim * partial_rotary_factor, base rope_theta (upstream :1655-:1659); transformers
        # 5 moves partial_rotary_factor into rope_parameters
        rope = config.rope_parameters
        factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
        if factor is None or rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_parameters {rope}: the Ling-2.5 reference needs partial_rotary_factor and "
                             "default RoPE (upstream refuses other rope_scaling, :1646-:1648)")
        rope_dim = int(self.head_dim * factor)
        theta = rope["rope_theta"]
        self.register_buffer("inv_freq", 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64)
                                                            / rope_dim)), persistent=False)
        self.register_buffer("slope", lightning_slopes(self.num_heads, layer_idx, config.num_hidden_layers),
                             persistent=False)
        self.scale = self.head_dim ** -0.5  # simple_gla_torch.py:230 (scale=None -> k_dim ** -0.5)

    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs) -> torch.Tensor:
        if cache is not None:
            raise ValueError("the Ling-2.5 reference computes each sequence from scratch (use_cache=False)")
        bsz, seq_len, _ = hidden_states.shape
        # every sequence starts at position 0: the reference runs whole sequences (host_model.reference_logits)
        positions = torch.arange(seq_len, device=hidden_states.device).expand(bsz, seq_len)
        q, k, v = self.project(hidden_states, positions)
        return self.finish(lightning_attention(q, k, v, self.slope, self.scale), hidden_states)  # :1395-:1441

    def project(self, hidden_states: torch.Tensor, positions: torch.Tensor):
        """(q, k, v) ``[B, S, H, D]`` of ``hidden_states [B, S, hidden]`` at ``positions [B, S]``: the fused
        projection, the q/k norms and the partial RoPE (what surrounds the recurrence; rendered-mode validation
        routes this module's recurrence through the rendered code and keeps these)."""
        bsz, seq_len, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states).view(bsz, seq_len, 3 * self.num_heads, self.head_dim)
        q, k, v = qkv.split(self.num_heads, dim=2)
        if self.use_qk_norm:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        freqs = positions.to(torch.float64)[..., None] * self.inv_freq.to(torch.float64)
        emb = torch.cat((freqs, freqs), dim=-1)  # upstream BailingMoeV25RotaryEmbedding (:213, :238)
        cos = emb.cos().to(q.dtype)[:, :, None, :]
        sin = emb.sin().to(q.dtype)[:, :, None, :]
        return rotate_half_partial(q, cos, sin), rotate_half_partial(k, cos, sin), v

    def finish(self, core: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """The recurrence's output ``[B, S, H, D]`` through the group norm, the gate and the output projection."""
        bsz, seq_len, _ = hidden_states.shape
        out = self.g_norm(core.reshape(bsz, seq_len, -1))  # :1445-:1446
        out = out * torch.sigmoid(self.g_proj(hidden_states))  # :1447-:1448
        return self.o_proj(out)  # :1449


class NoOutputGate(nn.Module):
    """Stands in for transformers' MLA ``g_proj`` (Ling-3.0's head-wise output gate; Ling-2.5's MLA has none):
    no weight, ``+inf`` per head, so the ``sigmoid(g_proj(x))`` transformers multiplies by is exactly 1."""

    def __init__(self, num_heads: int):
        super().__init__()
        self.num_heads = num_heads

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states.new_full((*hidden_states.shape[:-1], self.num_heads), math.inf)


def ling_layer_types(num_layers: int, group: int) -> list[str]:
    """Ling-2.5's layer kinds (upstream :1495-:1499): full attention at the last layer of every group and at every
    layer past the last whole group; transformers' own rule (Ling-3.0) has only the first."""
    tail = num_layers // group * group
    return ["full_attention" if (i + 1) % group == 0 or i >= tail else "linear_attention" for i in range(num_layers)]


def build_ling_lightning(config):
    """transformers' BailingHybridForCausalLM built from ``config`` (a ``BailingHybridConfig`` of a Ling-2.5
    config) with Ling-2.5's layer kinds, lightning linear layers and ungated MLA; float32, eager, no weights set."""
    from transformers import AutoModelForCausalLM

    config.layer_types = ling_layer_types(config.num_hidden_layers, config.layer_group_size)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for i, layer in enumerate(model.model.layers):
        if config.layer_types[i] == "linear_attention":
            layer.self_attn = LingLightningAttention(config, i).to(torch.float32)
        else:
            layer.self_attn.g_proj = NoOutputGate(config.num_attention_heads)
    return model
