"""Host the rendered attention inside a transformers model, shared by every family.

The decoder layers and their attention modules are found by structure (analyzer.hf_layout), not
by one naming scheme. How an attention module is routed depends on its own code:
- its forward calls transformers' attention interface (Qwen, Llama, Mistral, Phi-3, GLM-4,
  gpt-oss...): the host registers an attention implementation, which receives the post-RoPE
  q/k/v of each layer; the rendered ``kv_cache_attention`` does the cache write and the FA call;
- MLA (DeepSeek-V2/V3, Kimi-K2): the forward is replaced, because the rendered code needs the
  latent before its norm and the query split into nope/rope parts;
- a fused ``query_key_value`` split by the module's own ``_split_heads`` (Falcon): the forward is
  replaced by one that reuses the module's projections, head split and rotary function; one laid out head by head
  and scored by the module itself (GPT-NeoX-Japanese: partial RoPE, a bias on the last layer's output) likewise, and
  GPT-1's ``Conv1D`` ``c_attn`` of q | k | v (openai-gpt) and GPT-Neo's q_proj / k_proj / v_proj split by its
  ``_split_heads``, scored unscaled in its ``_attn``.
- an attention computing its scores itself: an encoder-decoder's ``q_proj``/``k_proj``/``v_proj`` + ``torch.bmm``
  (TrOCR, MVP) or a BERT-era ``query``/``key``/``value`` self-attention (BigBird, RemBert, MegatronBert, RoFormer with
  its rotary at each token's own position): the forward is replaced by one around the module's own projections;
- DeepSeek-V4's shared-KV attention: the forward is replaced, because the rendered code needs the hidden states
  (its compressor's input) beside the normed query and K=V row, and returns before the grouped output projection.
- Qwen4-Exp's QSA attention: the forward is replaced, because the rendered code needs its indexer's query and raw
  key (from the hidden states) and the model's RoPE at each pooled block's first position, beside the gated GQA q/k/v.
- JetMoE's mixture of attention (query / output experts over one shared kv_proj): the forward is replaced, because its
  K/V reach the interface tiled to every query head and its query heads are expert-major, not grouped by KV head.
Anything else is refused with one line naming the module.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import inspect
import itertools
import sys
import types
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from model_infer_kvcache.analyzer.arch_check import unscaled_scores
from model_infer_kvcache.analyzer.errors import InputError, NotSupportedByKvcache
from model_infer_kvcache.analyzer.hf_layout import LayoutError, find_attentions, find_decoder_stack
from model_infer_kvcache.analyzer.kinds.cross import MODULE_NAMES as CROSS_MODULE_NAMES
from model_infer_kvcache.analyzer.kinds.diff import HF_PARTS as DIFF_PARTS
from model_infer_kvcache.analyzer.kinds.mla import MLA_LATENT_SCALES
from model_infer_kvcache.analyzer.linear_config import (
    cca_facts,
    mlstm_facts,
    rg_lru_facts,
    rwkv_facts,
    short_conv_facts,
)
from model_infer_kvcache.analyzer.operators.fa_facts import FA_KEYWORDS, FA_OP_NAMES, RECORDED_KEYWORDS
from model_infer_kvcache.validators.pipeline import dsa_args, vision_rows

ATTN_IMPL = "kvcache_rendered"
ATOL_FP32 = 1e-4  # emulated backend: float32 end to end
ATOL_BF16 = 5e-2  # NPU backend: bf16 model under test vs the float32 reference (untested in CI)
_counter = itertools.count()
CROSS_KV_LENS = tuple(kw.kv_lens for kw in FA_KEYWORDS.values())  # a cross-attention call's KV lengths, either version
_ENCODER_SEED = 20  # the encoder states' seed (each request's own, by its first prompt tokens)
_CURRENT: list = []  # the ForwardMetaData of the step being run (a stack: steps never nest)


@dataclass
class RenderedCode:
    attention: types.ModuleType
    runner: types.ModuleType | None

    def attention_mixin(self) -> type | None:
        """The attention mixin, None in a pure state stack's render (no layer attends)."""
        try:
            return _class_with(self.attention, "init_kv_cache")
        except LookupError:
            return None

    def model_mixin(self) -> type | None:
        try:
            return _class_with(self.attention, "get_cache_info")
        except LookupError:
            return None

    def runner_mixin(self) -> type | None:
        return _class_with(self.runner, "_init_kvcache") if self.runner else None

    def linear_mixin(self) -> type | None:
        """The state mixin of a hybrid model's linear layers (templates/kinds/recurrent_state.py.j2), None without one."""
        try:
            return _class_with(self.attention, "init_state_cache")
        except LookupError:
            return None


def _class_with(module: types.ModuleType, method: str) -> type:
    for value in vars(module).values():
        if isinstance(value, type) and value.__module__ == module.__name__ and method in vars(value):
            return value
    raise LookupError(f"{module.__file__}: no class defines {method}()")


def import_rendered(rendered_dir: str | Path) -> RenderedCode:
    """Import the rendered files (call inside the emulation/framework contexts they import from)."""
    root = Path(rendered_dir)
    tag = next(_counter)

    def load(name: str) -> types.ModuleType | None:
        path = root / name
        if not path.is_file():
            return None
        mod_name = f"_kvcache_rendered_{tag}_{path.stem}"
        spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        spec.loader.exec_module(module)
        return module

    attention = load("kvcache_attention.py")
    if attention is None:
        raise FileNotFoundError(f"{root}: no kvcache_attention.py (render first)")
    return RenderedCode(attention, load("kvcache_runner.py"))


@contextlib.contextmanager
def current_metadata(forward_metadata, position_ids=None, encoder_lens=None):
    """The step's forward metadata (and its tokens' positions, [B, S]; a prefill's encoder lengths, one per request)
    for the routed modules of one forward."""
    _CURRENT.append((forward_metadata, position_ids, encoder_lens))
    try:
        yield
    finally:
        _CURRENT.pop()


def _metadata():
    if not _CURRENT:
        raise RuntimeError("rendered attention called outside a validation step")
    return _CURRENT[-1][0]


def _record_call(host, fm, q, k, dtype, scaling) -> None:
    """What a routed module hands the rendered attention this step, for the probe's checks: the shapes, dtype, the
    module's own scaling and the step's kv lengths."""
    host.probe.record(layer=host.layer_idx, attn_type=getattr(host, "attn_type", None), is_prefill=fm.is_prefill,
                      q=q, k=k, dtype=dtype, hf_scaling=scaling, kv_lens=fm.actual_seq_lengths_kv)


def _route_start(module, hidden_states, position_embeddings):
    """A routed module's step inputs: its host, the step's metadata, its own modeling file's apply_rotary_pos_emb,
    the step's rows [T, hidden] and their cos / sin [T, rotary dims]."""
    x = hidden_states[0]
    cos, sin = (e[0, -x.shape[0]:] for e in position_embeddings)
    return (module._kvcache_host, _metadata(), sys.modules[type(module).__module__].apply_rotary_pos_emb, x, cos,
            sin)


def _positions():
    """The step's token positions [B, S]: for a routed module whose transformers forward gets none (Ling-2.5's
    lightning layers rotate q and k themselves)."""
    if not _CURRENT or _CURRENT[-1][1] is None:
        raise RuntimeError("token positions asked outside a validation step")
    return _CURRENT[-1][1]


class _Probe:
    """Records what each layer saw around the FA call (runtime-link evidence)."""

    def __init__(self):
        self.records: list[dict] = []
        self.fa_calls: list[dict] = []
        self.sparse_calls: list[dict] = []  # DSA's indexer and sparse-FA calls (dsa_args)
        self.cross_calls: list[dict] = []  # the FA calls of cross-attention modules (validators/kinds/cross.py)
        self.sharedkv_calls: list[dict] = []  # DeepSeek-V4's shared-KV attention calls (validators/kinds/compressed)
        self.cross_layer = None  # the cross-attention layer running now (its FA call goes to cross_calls)
        self.step = -1
        self.last_layer = None  # the layer that ran last (attention or linear), to place a failure

    def record(self, **kw) -> None:
        """One layer's evidence; ``kv_lens`` as the metadata holds it (tensor or list). Inside a graph capture nothing
        is recorded (and no tensor read back): a captured step's evidence is its eager rerun's (graph_capture.py)."""
        if torch.compiler.is_compiling():
            return
        if "kv_lens" in kw:
            kw["kv_lens"] = _as_list(kw["kv_lens"])
        self.records.append(kw)
        self.last_layer = kw.get("layer")




class _RecordingTorchair:
    """Stands in for ``torchair`` inside the rendered module: its ``ops`` record the FA calls of a ge_graph decode
    (``torchair.ops``' attention) as ``_RecordingOps`` records torch_npu's."""

    def __init__(self, torchair, probe: _Probe):
        self._torchair = torchair
        self.ops = _RecordingOps(torchair.ops, probe)

    def __getattr__(self, name):
        return getattr(self._torchair, name)


class _RecordingOps:
    """Stands in for ``torch_npu`` inside the rendered module: records each FA call's arguments."""

    def __init__(self, ops, probe: _Probe):
        self._ops = ops
        self._probe = probe

    def __getattr__(self, name):
        target = getattr(self._ops, name)
        if torch.compiler.is_compiling():  # a graph capture (graph_capture.py): the operator, a node of the graph
            return target
        if name in dsa_args.DSA_OPS:
            return self._dsa_call(name, target)
        if name not in FA_OP_NAMES:
            return target

        def call(*args, **kwargs):
            last = self._probe.records[-1] if self._probe.records else {}
            if self._probe.cross_layer is not None:  # a cross-attention read: judged by validators/kinds/cross.py
                kv_lens = next((kwargs[k] for k in CROSS_KV_LENS if k in kwargs), None)
                self._probe.cross_calls.append({"op": name, "step": self._probe.step, "layer": self._probe.cross_layer,
                                                **{k: kwargs[k] for k in RECORDED_KEYWORDS if k in kwargs},
                                                "kv_lens": _as_list(kv_lens),
                                                "has_mask": kwargs.get("atten_mask") is not None})
                return target(*args, **kwargs)
            self._probe.fa_calls.append({"op": name, "step": self._probe.step, "layer": last.get("layer"),
                                         "is_prefill": last.get("is_prefill"),
                                         **{k: kwargs[k] for k in RECORDED_KEYWORDS if k in kwargs},
                                         "has_mask": kwargs.get("atten_mask") is not None})
            return target(*args, **kwargs)

        return call

    def _dsa_call(self, name, target):
        def call(*args, **kwargs):
            a = dsa_args.bind(target, args, kwargs)
            if a is None:  # the operator reports the bad call
                return target(*args, **kwargs)
            last = self._probe.records[-1] if self._probe.records else {}
            # Recorded before the operator runs: a call it rejects is evidence too.
            rec = {**dsa_args.rendered_call(name, a, _metadata(), last), "step": self._probe.step}
            self._probe.sparse_calls.append(rec)
            result = target(*args, **kwargs)
            if name == dsa_args.INDEXER_OP:
                rec.update(dsa_args.selection(a, result[0]))
            else:
                rec.update(dsa_args.sparse_rows(a))
            return result

        return call


class _RecordingTorch:
    """Stands in for ``torch`` inside a rendered module that calls the checkout's own operators
    (``torch.ops.custom``, DeepSeek-V4): records each shared-KV attention call's arguments; everything else is
    torch's."""

    def __init__(self, probe: _Probe):
        self._probe = probe

    def __getattr__(self, name):
        return _RecordingTorchOps(self._probe) if name == "ops" else getattr(torch, name)


class _RecordingTorchOps:
    def __init__(self, probe: _Probe):
        self._probe = probe

    def __getattr__(self, name):
        return _RecordingCustom(self._probe) if name == "custom" else getattr(torch.ops, name)


def _selection(kwargs) -> dict:
    """A CSA call's selection (cmp_sparse_indices): per query, the entries listed and the entries it could see
    (``w < (t + 1) // cmp_ratio``, t its position), for V232; {} without indices."""
    indices = kwargs.get("cmp_sparse_indices")
    if indices is None or kwargs.get("cu_seqlens_q") is None or kwargs.get("seqused_kv") is None:
        return {}
    cu = [int(v) for v in kwargs["cu_seqlens_q"]]
    kv = [int(v) for v in kwargs["seqused_kv"]]
    ratio = int(kwargs.get("cmp_ratio") or 1)
    visible = [(n - (b - a) + i + 1) // ratio for a, b, n in zip(cu, cu[1:], kv, strict=False) for i in range(b - a)]
    listed = (indices.reshape(indices.shape[0], -1) >= 0).sum(dim=-1).tolist()
    return {"selected": [int(v) for v in listed], "visible": visible}


class _RecordingCustom:
    def __init__(self, probe: _Probe):
        self._probe = probe

    def __getattr__(self, name):
        target = getattr(torch.ops.custom, name)
        if name != "npu_sparse_attn_sharedkv":
            return target
        probe = self._probe

        def call(q, **kwargs):
            last = probe.records[-1] if probe.records else {}
            probe.sharedkv_calls.append({
                "op": name, "step": probe.step, "layer": last.get("layer"), "has_cmp_kv": kwargs.get("cmp_kv") is not None,
                "cmp_ratio": kwargs.get("cmp_ratio"), "ori_win_left": kwargs.get("ori_win_left", 127),
                "softmax_scale": kwargs.get("softmax_scale"), "sinks": kwargs.get("sinks") is not None,
                **_selection(kwargs)})
            return target(q, **kwargs)

        return call


def _gqa_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention interface -> rendered kv_cache_attention (packed TND, or BSH for Legacy)."""
    host = module._kvcache_host
    fm = _metadata()
    if getattr(host, "is_cross", False):
        return _cross_attention(host, fm, query, key, value)
    b, n, s, d = query.shape
    q, k, v = (x.transpose(1, 2).contiguous() for x in (query, key, value))  # [B, S, N, D]
    _record_call(host, fm, (b * s, n, d), (b * s, k.shape[2], d), q.dtype, scaling)
    if host.bsh:
        out = host.kv_cache_attention(q.reshape(b, s, n * d), k.reshape(b, s, -1), v.reshape(b, s, -1), fm)
    else:
        out = host.kv_cache_attention(q[0], k[0], v[0], fm)
    return out.reshape(b, s, n, -1), None


def _cross_attention(host, fm, query, key, value):
    """A decoder layer's cross-attention (the module's own q_proj / k_proj / v_proj ran): at prefill its K/V are the
    step's requests' encoder states, packed, and go to the render with each request's encoder length; at decode the
    host fed NaN encoder states (the module's K/V are NaN), so the render must read its slots and ignore them."""
    b, n, s, d = query.shape
    q = query.transpose(1, 2).reshape(b * s, n, d)
    lens = _CURRENT[-1][2] if fm.is_prefill else None
    k = key.transpose(1, 2).reshape(-1, key.shape[1], key.shape[3]) if fm.is_prefill else None
    v = value.transpose(1, 2).reshape(-1, value.shape[1], value.shape[3]) if fm.is_prefill else None
    vision = {}
    if isinstance(lens, tuple):  # Mllama (HostModel.vision_step): rows given, valid vision lengths, image rows
        lens, vision = lens[0], {"vision_lens": lens[1], "text_starts": lens[2]}
    host.probe.cross_layer = host.layer_idx
    try:
        out = host.cross_attention(q, k, v, lens, fm, **vision)
    finally:
        host.probe.cross_layer = None
    return out.reshape(b, s, n, -1), None


def _as_list(x):
    return x.tolist() if isinstance(x, torch.Tensor) else list(x) if x is not None else None


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPL, _gqa_attention)
    try:
        from transformers import AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask

        AttentionMaskInterface.register(ATTN_IMPL, sdpa_mask)
    except ImportError:  # older transformers derive the mask from the implementation name
        pass


def _interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the fused MLA writer's convention: de-interleave even/odd lanes, then rotate half."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1, x2), dim=-1) * cos + torch.cat((-x2, x1), dim=-1) * sin


def _cos_sin(position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, rope] cos/sin in rotate-half layout from either transformers convention."""
    if isinstance(position_embeddings, (tuple, list)):
        cos, sin = position_embeddings
        return cos[0], sin[0]
    freqs = position_embeddings[0]  # complex [T, rope/2] (DeepSeek-V2), magnitude = attention scaling
    return torch.cat((freqs.real, freqs.real), -1), torch.cat((freqs.imag, freqs.imag), -1)


def _mla_forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    host = self._kvcache_host
    fm = _metadata()
    x = hidden_states[0]
    t = x.shape[0]
    q_a = None if self.q_lora_rank is None else self.q_a_proj(x)
    q_resid = None if q_a is None else self.q_a_layernorm(q_a)
    if q_resid is not None and getattr(self, "q_lora_scale", None) is not None:
        q_resid = q_resid * self.q_lora_scale  # Dots3-Note scales its query residual (the indexer's input too)
    gate = None
    if getattr(self, "q_gate_proj", None) is not None:  # A.X-K2: query and output gate from one fused projection
        q, gate = self.q_gate_proj(torch.cat([q_resid, q_a], dim=-1)).view(
            t, -1, self.qk_head_dim + self.v_head_dim).split([self.qk_head_dim, self.v_head_dim], dim=-1)
    else:
        q = self.q_proj(x) if q_resid is None else self.q_b_proj(q_resid)
    q = q.reshape(t, -1, self.qk_head_dim)
    q_nope, q_rot = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    if getattr(self, "mla_scale_q_lora", None) is not None:  # LongCat-Flash's query LoRA scale (its own forward)
        q_nope, q_rot = q_nope * self.mla_scale_q_lora, q_rot * self.mla_scale_q_lora
    compressed_kv = self.kv_a_proj_with_mqa(x)
    # position-free MLA (Kimi-Linear: no rotary, none passed): q_rot and k_rot stay unrotated, the render takes no cos/sin
    rope = () if position_embeddings is None else tuple(t.to(x.dtype) for t in _cos_sin(position_embeddings))
    if rope:  # DeepSeek-V2's freqs stay float32
        q_rot = _interleaved_rope(q_rot, rope[0][:, None, :], rope[1][:, None, :])
    _record_call(host, fm, tuple(q_nope.shape), tuple(compressed_kv.shape), q.dtype, getattr(self, "scaling", None))
    # DSA (an indexer beside the MLA): the rendered code selects keys from the hidden states and the query residual
    dsa = {"hidden_states": x, "q_resid": q_resid} if getattr(self, "indexer", None) is not None else {}
    out = host.kv_cache_attention(q_nope.contiguous(), q_rot.contiguous(), compressed_kv, *rope, fm, **dsa)
    if getattr(self, "g_proj", None) is not None:  # a gated MLA (Ling-3.0): one sigmoid gate per head, as the model
        out = out * torch.sigmoid(self.g_proj(x).float()).to(out.dtype).unsqueeze(-1)
    if gate is not None:  # A.X-K2: one sigmoid gate per output lane, in float32 as the model
        out = (out * torch.sigmoid(gate.float())).to(out.dtype)
    out = self.o_proj(out.reshape(t, -1))[None]
    return out, None


def _v4_forward(self, hidden_states, position_embeddings=None, position_ids=None, attention_mask=None, cache=None,
                **kwargs):
    """DeepSeek-V4's attention (transformers DeepseekV4Attention) through the rendered code: the module's own
    q_a / q_b projections and norms and kv_proj + kv_norm, then the render's RoPE, cache writes, compressor and
    shared-KV attention (with the layer's sinks), then the module's grouped o_a / o_b output projection."""
    host = self._kvcache_host
    fm = _metadata()
    x = hidden_states[0]
    t = x.shape[0]
    cos, sin = position_embeddings[self.rope_layer_type]  # [1, T, rope / 2]: one angle per interleaved pair
    q_residual = self.q_a_norm(self.q_a_proj(x))  # a CSA layer's indexer query input too
    q = self.q_b_norm(self.q_b_proj(q_residual).view(t, -1, self.head_dim))
    kv = self.kv_norm(self.kv_proj(x))
    _record_call(host, fm, tuple(q.shape), (t, 1, self.head_dim), q.dtype, self.scaling)
    compressor = self.compressor

    def entry_rope(positions):  # the compressor's own RoPE (its rope type) at the entries' positions
        c, s = compressor.rotary_emb(x, position_ids=positions[None], layer_type=compressor.rope_layer_type)
        return c[0], s[0]

    out = host.kv_cache_attention(q, kv, cos[0], sin[0], fm, x, entry_rope if compressor is not None else None,
                                  q_residual=q_residual)
    grouped = self.o_a_proj(out.reshape(t, self.config.o_groups, -1)).flatten(1)
    return self.o_b_proj(grouped)[None], None


def _qsa_forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
    """Qwen4-Exp's attention (transformers Qwen4ExpTextAttention) through the rendered QSA code: the module's own
    gated query, q/k norms, K/V and RoPE (its module's apply_rotary_pos_emb), and its indexer's projection, q norm
    and query RoPE; the render writes K/V and the raw indexer keys, pools blocks (with the model's RoPE at their first
    positions), selects and attends; the module's sigmoid gate and o_proj after it. transformers' own indexer is not
    called (the selection is the render's)."""
    host, fm, rope, x, cos, sin = _route_start(self, hidden_states, position_embeddings)
    t = x.shape[0]
    query, gate = self.q_proj(x).view(t, -1, 2 * self.head_dim).chunk(2, dim=-1)
    query = self.q_norm(query)
    key = self.k_norm(self.k_proj(x).view(t, -1, self.head_dim))
    value = self.v_proj(x).view(t, -1, self.head_dim)
    query, key = rope(query, key, cos, sin)
    ix = self.indexer
    index_query, index_key = ix.index_qk_proj(x).split([ix.index_n_heads * ix.index_head_dim, ix.index_head_dim], -1)
    index_query = rope(ix.q_layernorm(index_query.view(t, ix.index_n_heads, ix.index_head_dim)), cos=cos, sin=sin)
    rotary = self._kvcache_rotary

    def block_rope(positions):  # the model's rotary embedding at the blocks' first positions
        c, s = rotary(x, positions.view(1, 1, -1))
        return c[0], s[0]

    _record_call(host, fm, tuple(query.shape), tuple(key.shape), query.dtype, self.scaling)
    out = host.kv_cache_attention(query.contiguous(), key.contiguous(), value.contiguous(), fm,
                                  index_query.contiguous(), index_key.contiguous(), block_rope)
    out = out.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))
    return self.o_proj(out)[None], None


def _diff_forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
    """DiffLlama's attention (transformers DiffLlamaAttention) through the rendered differential code: the module's
    q/k/v projections and RoPE (its module's apply_rotary_pos_emb); the render writes the K/V halves and returns each
    query head's value1 and value2 outputs side by side ([T, N, 2D], the module's torch.cat of its two calls); then
    the module's own math: chunk along heads, out1 - lambda_full * out2, (1 - lambda_init) x groupnorm, o_proj."""
    host, fm, rope, x, cos, sin = _route_start(self, hidden_states, position_embeddings)
    t = x.shape[0]
    query = self.q_proj(x).view(t, -1, self.head_dim)
    key = self.k_proj(x).view(t, -1, self.head_dim)
    value = self.v_proj(x).view(t, -1, self.head_dim)
    query, key = rope(query, key, cos, sin)
    _record_call(host, fm, tuple(query.shape), tuple(key.shape), query.dtype, self.scaling)
    out = host.kv_cache_attention(query.contiguous(), key.contiguous(), value.contiguous(), fm)  # [T, N, 2D]
    out1, out2 = torch.chunk(out, 2, dim=1)
    lambda_1 = torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1, dim=-1, dtype=torch.float32)).to(query.dtype)
    lambda_2 = torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2, dim=-1, dtype=torch.float32)).to(query.dtype)
    out = out1 - (lambda_1 - lambda_2 + self.lambda_init) * out2
    out = (1 - self.lambda_init) * self.groupnorm(out)
    return self.o_proj(out.reshape(t, -1))[None], None


def _fused_qkv_forward(self, hidden_states, alibi=None, attention_mask=None, position_ids=None, layer_past=None,
                       use_cache=False, output_attentions=False, position_embeddings=None, **kwargs):
    """Falcon-style attention (modeling_falcon FalconAttention, rotary path) through the rendered code.

    The module's own ``query_key_value`` + ``_split_heads`` give q/k/v as [B, S, heads, D]; with
    ``new_decoder_architecture`` the KV heads come back broadcast to every query head, so the
    distinct ones (every group-th, GQA order) are taken. RoPE uses the module's own
    ``apply_rotary_pos_emb``; the output goes through ``dense`` like the original.
    """
    if alibi is not None:
        raise NotImplementedError(f"{type(self).__name__} with ALiBi: the FA path takes no position bias")
    q, k, v = self._split_heads(self.query_key_value(hidden_states))
    b, s = q.shape[:2]
    kv_heads = getattr(self, "num_kv_heads", k.shape[2])
    if k.shape[2] != kv_heads:
        group = k.shape[2] // kv_heads
        k, v = k[:, :, ::group], v[:, :, ::group]
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, heads, S, D]
    cos, sin = position_embeddings
    q, k = sys.modules[type(self).__module__].apply_rotary_pos_emb(q, k, cos, sin)
    out, _ = _gqa_attention(self, q, k, v, attention_mask, scaling=getattr(self, "inv_norm_factor", None))
    return self.dense(out.reshape(b, s, -1)), None


def _headwise_qkv_forward(self, hidden_states, attention_mask=None, position_ids=None, layer_past=None,
                          use_cache=False, output_attentions=False, position_embeddings=None, **kwargs):
    """GPT-NeoX-era attention scoring by itself (modeling_gpt_neox_japanese GPTNeoXJapaneseAttention): one fused
    ``query_key_value`` laid out head by head ([heads, q | k | v] of ``head_size`` each), RoPE on the first
    ``rotary_ndims`` lanes by the module's own ``apply_rotary_pos_emb``, scores over ``norm_factor`` (sqrt of the head
    size), then ``dense``. Returns what the module does: the output, no weights, and its ``dense_bias`` (the last
    layer's, which its decoder layer adds; None elsewhere)."""
    b, s = hidden_states.shape[:2]
    qkv = self.query_key_value(hidden_states).view(b, s, self.num_attention_heads, 3 * self.head_size)
    q, k, v = (x.transpose(1, 2) for x in qkv.split(self.head_size, dim=-1))  # [B, heads, S, D]
    r = self.rotary_ndims
    cos, sin = position_embeddings
    q_rot, k_rot = sys.modules[type(self).__module__].apply_rotary_pos_emb(q[..., :r], k[..., :r], cos, sin)
    q, k = torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)
    out, _ = _gqa_attention(self, q, k, v, attention_mask, scaling=1.0 / self.norm_factor)
    return self.dense(out.reshape(b, s, -1)), None, getattr(self, "dense_bias", None)


def _conv1d_qkv_forward(self, x, attention_mask=None, output_attentions=False, *args, **kwargs):
    """GPT-1-era attention scoring by itself (modeling_openai Attention): one ``Conv1D`` ``c_attn`` whose output is
    q | k | v of ``split_size`` each, split into ``n_head`` heads, scores over sqrt(head size) when the module's
    ``scale`` flag is set (1 otherwise), then ``c_proj``. Returns the output without weights, in a list as the module."""
    b, s = x.shape[:2]
    q, k, v = (t.view(b, s, self.n_head, -1).transpose(1, 2) for t in self.c_attn(x).split(self.split_size, dim=2))
    out, _ = _gqa_attention(self, q, k, v, None, scaling=q.shape[-1] ** -0.5 if self.scale else 1.0)
    return [self.c_proj(out.reshape(b, s, -1))]  # a list, as the module's: its Block concatenates lists


def _split_qkv_forward(self, hidden_states, attention_mask=None, layer_past=None, use_cache=False,
                       output_attentions=False, **kwargs):
    """GPT-Neo's attention (modeling_gpt_neo GPTNeoSelfAttention): ``q_proj`` / ``k_proj`` / ``v_proj`` split by the
    module's own ``_split_heads``, scores unscaled in its ``_attn`` (arch_check.unscaled_scores: the manifest's scale 1),
    its local layers' window the rendered code's (the manifest's per-layer plan), then ``out_proj``."""
    q, k, v = (self._split_heads(getattr(self, name)(hidden_states), self.num_heads, self.head_dim)
               for name in ("q_proj", "k_proj", "v_proj"))
    b, s = hidden_states.shape[:2]
    out, _ = _gqa_attention(self, q, k, v, None, scaling=1.0)
    return self.out_proj(out.reshape(b, s, -1)), None


def _moa_forward(self, hidden_states, attention_mask=None, position_embeddings=None, cache=None, **kwargs):
    """JetMoE's mixture of attention (modeling_jetmoe JetMoeAttention): each token's top_k query experts
    (``experts.map``: [B, S, top_k, KV heads x D]) over one shared ``kv_proj`` (K, V of ``num_key_value_heads``), RoPE
    by the module's own ``apply_rotary_pos_emb``, then the output experts (``experts.reduce``). transformers tiles
    K/V (``.repeat(1, top_k, 1, 1)``): query head ``e * H + h`` reads KV head ``h``. FA groups query heads by KV
    head (head ``j`` reads KV head ``j // top_k``), so the queries go to the render as [H, top_k] and its output comes
    back as [top_k, H]. Returns what the module does: output, no weights, its router logits."""
    b, s = hidden_states.shape[:2]
    q, router_logits, topo = self.experts.map(hidden_states)
    k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in self.kv_proj(hidden_states).chunk(2, dim=-1))
    q = q.view(b, s, -1, self.head_dim).transpose(1, 2)  # [B, top_k x H, S, D], expert-major
    q, k = sys.modules[type(self).__module__].apply_rotary_pos_emb(q, k, *position_embeddings)
    h, d = self.num_key_value_heads, self.head_dim
    q = q.reshape(b, self.top_k, h, s, d).transpose(1, 2).reshape(b, h * self.top_k, s, d)  # KV-head-major (GQA)
    out, _ = _gqa_attention(self, q, k, v, None, scaling=self.scaling)  # [B, S, H x top_k, D]
    out = out.reshape(b, s, h, self.top_k, d).transpose(2, 3).reshape(b, s, self.top_k, h * d)
    return self.experts.reduce(out, topo), None, router_logits


def _forward_source(module) -> str:
    try:
        return inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return ""


def _returned_values(module) -> int:
    """How many values the module's own forward returns (GLM-5's attention adds its top-k indices: 3)."""
    import ast
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(_forward_source(module)))
    except SyntaxError:
        return 2
    returns = [n.value for n in ast.walk(tree) if isinstance(n, ast.Return) and isinstance(n.value, ast.Tuple)]
    return max((len(r.elts) for r in returns), default=2)


def _padded(forward, count: int):
    """``forward`` (returning ``(out, None)``, or more) returning ``count`` values, the extra ones None: a decoder
    layer that unpacks three (GLM-5's top-k for the next shared layer, unused: render refuses shared layers) gets
    three."""
    if count <= 2:
        return forward

    def padded(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        return (*out, *([None] * (count - len(out))))

    return padded


def attention_route(module, is_mla: bool) -> str | None:
    """How the host routes one transformers attention module: interface | mla | v4 | qsa | diff | moa | headwise_qkv | fused_qkv |
    eager_qkv | split_qkv | conv1d_qkv | bert_qkv | lin_qkv | None."""
    if is_mla:
        return "mla" if hasattr(module, "kv_a_proj_with_mqa") else None
    if all(hasattr(getattr(module, "indexer", None), a) for a in ("index_qk_proj", "compress_ratio", "k_layernorm")):
        return "qsa"  # Qwen4-Exp's QSA: its indexer needs the hidden states (its forward calls the interface too)
    if all(hasattr(module, a) for a in DIFF_PARTS):
        return "diff"  # DiffLlama: two interface calls over V's halves, combined by its lambdas and group norm
    if all(hasattr(module, a) for a in ("q_b_norm", "kv_proj", "o_a_proj", "sinks", "compressor")):
        return "v4"  # DeepSeek-V4's shared-KV attention (its forward calls the interface too, on the whole K=V)
    source = _forward_source(module)
    if all(callable(getattr(getattr(module, "experts", None), a, None)) for a in ("map", "reduce")) and \
            isinstance(getattr(module, "kv_proj", None), torch.nn.Linear) and "repeat(1, self.top_k" in source:
        return "moa"  # JetMoE: query / output experts over a shared kv_proj, K/V tiled (its forward calls the interface)
    if "ALL_ATTENTION_FUNCTIONS" in source:
        return "interface"
    if all(hasattr(module, a) for a in ("query_key_value", "dense", "rotary_ndims", "norm_factor")) and \
            "3 * self.head_size" in source and "_attn(" in source:
        return "headwise_qkv"  # GPT-NeoX-Japanese: fused per-head q | k | v, partial RoPE, scoring by itself
    if all(hasattr(module, a) for a in ("query_key_value", "_split_heads", "dense")) and \
            "position_embeddings" in inspect.signature(type(module).forward).parameters:
        return "fused_qkv"  # Falcon's rotary path (Bloom's ALiBi-only attention has no position_embeddings)
    if all(hasattr(module, a) for a in ("q_proj", "k_proj", "v_proj", "out_proj", "scaling", "head_dim")) and \
            "torch.bmm" in source and "key_value_states" in inspect.signature(type(module).forward).parameters:
        return "eager_qkv"  # TrOCR, MVP: encoder-decoder attention computing its scores itself
    if all(isinstance(getattr(module, a, None), torch.nn.Linear) for a in ("q_proj", "k_proj", "v_proj", "out_proj")) \
            and "self._split_heads(" in source and "self._attn(" in source and unscaled_scores(module) is not None:
        return "split_qkv"  # GPT-Neo: its own head split, unscaled scores in _attn
    if all(type(getattr(module, a, None)).__name__ == "Conv1D" for a in ("c_attn", "c_proj")) and \
            all(hasattr(module, a) for a in ("split_size", "n_head", "scale")) and "self._attn(" in source:
        return "conv1d_qkv"  # GPT-1 (openai-gpt): a Conv1D c_attn of q | k | v, scoring by itself
    if all(isinstance(getattr(module, a, None), torch.nn.Linear) for a in ("q_lin", "k_lin", "v_lin", "out_lin")) and \
            "q / math.sqrt(self.head_dim)" in source and "torch.matmul(q, k.transpose" in source:
        return "lin_qkv"  # XLM's MultiHeadAttention: q_lin / k_lin / v_lin, q over sqrt(head_dim), scoring by itself
    if all(isinstance(getattr(module, a, None), torch.nn.Linear) for a in ("query", "key", "value")) and \
            hasattr(module, "attention_head_size") and "torch.matmul(query_layer, key_layer.transpose" in source:
        return "bert_qkv"  # BigBird, RemBert, MegatronBert, RoFormer: BERT-era self-attention scoring by itself
    return None


def sinusoidal_table(hf_model) -> torch.Tensor | None:
    """RoFormer's table of sinusoidal angles [max positions, head size] (its encoder's ``embed_positions``), None in a
    model without one. The encoder hands every layer the angles of positions 0..S-1 of the batch it sees: right for
    transformers' reference (each request whole), wrong for the engine's packed step, so the routed attention looks
    its tokens' own positions up here, as a port of the model must."""
    for module in hf_model.modules():
        if type(module).__name__.endswith("SinusoidalPositionalEmbedding") and isinstance(
                getattr(module, "weight", None), torch.Tensor) and "cache_length" in \
                inspect.signature(type(module).forward).parameters:
            return module.weight
    return None


def _eager_qkv_forward(self, hidden_states, key_value_states=None, *args, attn_prompt=None, **kwargs):
    """An encoder-decoder attention that computes its scores itself (TrOCR, MVP: ``q_proj(x) * scaling``, then
    ``torch.bmm``): its own q_proj / k_proj / v_proj / out_proj around the rendered attention, which applies the
    module's scaling itself (the manifest's scale is the module's ``scaling``). ``key_value_states``: the
    cross-attention's encoder states."""
    if attn_prompt is not None:
        raise NotSupportedByKvcache("--config", f"{type(self).__name__} with prompt tuning (attn_prompt: MVP's "
                                                "use_prompt): the prompt keys are not in the rendered cache",
                                    field="use_prompt")
    b, s = hidden_states.shape[:2]
    source = key_value_states if key_value_states is not None else hidden_states
    q = self.q_proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
    k = self.k_proj(source).view(b, source.shape[1], -1, self.head_dim).transpose(1, 2)
    v = self.v_proj(source).view(b, source.shape[1], -1, self.head_dim).transpose(1, 2)
    out, _ = _gqa_attention(self, q, k, v, None, scaling=self.scaling)
    return self.out_proj(out.reshape(b, s, -1)), None


def _bert_qkv_forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, *args, **kwargs):
    """A BERT-era self-attention that computes its scores itself (BigBird's original_full, RemBert, MegatronBert:
    ``query`` / ``key`` / ``value`` linears, scores over ``sqrt(attention_head_size)``): its own projections around the
    rendered attention; the module's output projection is its parent's (``BertSelfOutput``), left to it. Returns
    the context as the module does, [B, S, heads x head size]."""
    if encoder_hidden_states is not None:
        raise NotSupportedByKvcache("--config", f"{type(self).__name__} called as a cross-attention (add_cross_attention):"
                                                " the validation host routes its self-attention only",
                                    field="add_cross_attention")
    b, s = hidden_states.shape[:2]
    q, k, v = (getattr(self, name)(hidden_states).view(b, s, -1, self.attention_head_size).transpose(1, 2)
               for name in ("query", "key", "value"))
    if "sinusoidal_pos" in kwargs:  # RoFormer: its rotary at each token's own position (sinusoidal_table)
        table = getattr(self, "_kvcache_sinusoidal", None)
        if table is None:
            raise NotSupportedByKvcache("--config", f"{type(self).__name__} rotates q / k by sinusoidal positions the "
                                                    "host found no table of", field="model_type")
        angles = table[_positions().reshape(-1).long()].to(q.dtype)[None, None]
        rotated = self.apply_rotary_position_embeddings(angles, q, k, v if self.rotary_value else None)
        q, k = rotated[0], rotated[1]
        v = rotated[2] if self.rotary_value else v
    out, _ = _gqa_attention(self, q, k, v, None, scaling=self.attention_head_size ** -0.5)
    return out.reshape(b, s, -1), None


def _lin_qkv_forward(self, input, mask=None, kv=None, cache=None, *args, **kwargs):  # noqa: A002 - XLM's name
    """XLM's MultiHeadAttention (modeling_xlm.py: ``q_lin`` / ``k_lin`` / ``v_lin``, ``q / math.sqrt(head_dim)``, its
    own masked softmax, ``out_lin``): its projections around the rendered attention at the module's scale. The
    model's mask (causal, from get_masks) is the FA call's causal mode. Returns the module's tuple (output, None)."""
    if kv is not None:
        raise NotSupportedByKvcache("--config", f"{type(self).__name__} called as a cross-attention (kv given): the "
                                                "validation host routes its self-attention only", field="model_type")
    b, s = input.shape[:2]
    q, k, v = (getattr(self, name)(input).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
               for name in ("q_lin", "k_lin", "v_lin"))
    out, _ = _gqa_attention(self, q, k, v, None, scaling=self.head_dim ** -0.5)
    return self.out_lin(out.reshape(b, s, -1)), None


def model_inputs(model, input_ids: torch.Tensor) -> dict:
    """What a transformers causal LM takes beside its ids and positions, fed alike to the reference and the model under
    test (its one home: the host, the reference, the localisation replay and the graph capture call it):

    - ``langs``: a model with language embeddings (XLM with n_langs > 1 and use_lang_emb builds
      ``lang_embeddings``) adds one row per token's language; transformers' generation feeds every token
      ``config.lang_id`` (XLMWithLMHeadModel.prepare_inputs_for_generation), and so does a port of the model;
    - ``lengths``: a model taking each row's length (XLM's get_masks) derives it, when not given, from the row's count
      of non-pad ids and zeroes the hidden states past it, so a token that happens to be the pad id would cut its row:
      every validation token is a real one (a packed step holds no padding), so each row's length is its width."""
    params = inspect.signature(model.forward).parameters
    extra = {}
    config = getattr(model, "config", None)
    if "langs" in params and any(isinstance(getattr(m, "lang_embeddings", None), torch.nn.Embedding)
                                 for m in model.modules()):
        extra["langs"] = torch.full_like(input_ids, int(config.lang_id))
    if "lengths" in params:
        extra["lengths"] = torch.full((input_ids.shape[0],), input_ids.shape[1], dtype=torch.long,
                                      device=input_ids.device)
    return extra


_ROUTED_FORWARD = {"mla": _mla_forward, "fused_qkv": _fused_qkv_forward, "eager_qkv": _eager_qkv_forward,
                   "bert_qkv": _bert_qkv_forward, "v4": _v4_forward, "headwise_qkv": _headwise_qkv_forward,
                   "conv1d_qkv": _conv1d_qkv_forward, "split_qkv": _split_qkv_forward, "moa": _moa_forward,
                   "lin_qkv": _lin_qkv_forward, "qsa": _qsa_forward,
                   "diff": _diff_forward}


def find_linear(layer) -> tuple[str, torch.nn.Module] | None:
    """The gated-delta-net module of a hybrid model's linear decoder layer (transformers' ``linear_attn``)."""
    from model_infer_kvcache.analyzer.arch_check import is_linear_module

    for name, module in layer.named_children():
        if is_linear_module(type(module).__name__):
            return name, module
    # a mixer one sub-block down (Zamba2HybridLayer: mamba_decoder.mamba, after its shared transformer block)
    for name, module in layer.named_modules():
        if "." in name and is_linear_module(type(module).__name__):
            return name, module
    return None


def _gdn_forward(self, hidden_states, attention_mask=None, **kwargs):
    """transformers' gated delta net (Qwen3-Next ``in_proj_qkvz``/``in_proj_ba``, Qwen3.5 ``in_proj_qkv``/``_z``/
    ``_b``/``_a``) with the conv and the recurrence, and so the states, done by the rendered code: the model's own
    projections, gates and output norm around ``linear_attention`` on the packed tokens."""
    host = self._kvcache_host
    fm = _metadata()
    x = hidden_states[0]
    t = x.shape[0]
    if hasattr(self, "in_proj_qkvz"):
        q, k, v, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(x)[None], self.in_proj_ba(x)[None])
        mixed = torch.cat([u.reshape(1, t, -1) for u in (q, k, v)], dim=-1)[0]
        z, b, a = z[0], b[0], a[0]
    elif hasattr(self, "g_proj"):  # OLMo-Hybrid: separate q/k/v/a/b projections, g_proj's gate, o_norm / o_proj
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        z, b, a = self.g_proj(x), self.b_proj(x), self.a_proj(x)
    else:
        mixed = self.in_proj_qkv(x)
        z, b, a = self.in_proj_z(x).reshape(t, -1, self.head_v_dim), self.in_proj_b(x), self.in_proj_a(x)
    beta = b.sigmoid()  # the render scales it where the mixer does (linear_attention.beta_scale)
    g = -self.A_log.float().exp() * torch.nn.functional.softplus(a.float() + self.dt_bias)  # as transformers
    host.probe.last_layer = host.layer_idx
    core = host.linear_attention(mixed, beta, g.to(x.dtype), fm)
    norm, out_proj = (self.o_norm, self.o_proj) if hasattr(self, "o_norm") else (self.norm, self.out_proj)
    out = norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim)).reshape(1, t, -1)
    return out_proj(out.to(x.dtype))


def _kda_forward(self, hidden_states, attention_mask=None, **kwargs):
    """transformers' Kimi delta attention (Kimi-Linear, Ling-3.0's ``bailing_hybrid``) with the conv and the recurrence,
    and so the states, done by the rendered code: the model's own projections, forget gate, beta, output gate
    (Ling-3.0 ``g_proj``, Kimi ``g_b_proj(g_a_proj)``) and norm around ``linear_attention``."""
    host = self._kvcache_host
    fm = _metadata()
    x = hidden_states[0]
    t = x.shape[0]
    mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
    g = self.forget_gate(hidden_states)[0]  # [T, H, Dk]
    beta = torch.sigmoid(self.b_proj(x))
    host.probe.last_layer = host.layer_idx
    core = host.linear_attention(mixed, beta, g, fm)
    gate = self.g_proj(x) if hasattr(self, "g_proj") else self.g_b_proj(self.g_a_proj(x))
    out = self.o_norm(core, gate.view(t, -1, self.head_dim)).reshape(1, t, -1)
    return self.o_proj(out.to(x.dtype))


def _lightning_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """kvcache's Ling-2.5 reference lightning module (validators/pipeline/ling_lightning.py) with the recurrence, and
    so the state, done by the rendered code: the module's own projection, q/k norms and RoPE (at the step's
    positions), group norm, gate and output projection around ``linear_attention``."""
    host = self._kvcache_host
    fm = _metadata()
    x = hidden_states[0]
    q, k, v = (t[0] for t in self.project(hidden_states, _positions()))
    host.probe.last_layer = host.layer_idx
    core = host.linear_attention(q, k, v, self.slope.to(x.dtype), fm)
    return self.finish(core[None], hidden_states)


# Mamba mixers (transformers 5.x): every family's mixer calls its modeling module's ``causal_conv1d_forward`` and
# ``mamba2_scan_forward`` (Mamba-2) / ``mamba_scan_forward`` (Mamba-1), the functions transformers' ``kernelize``
# swaps for "a runtime that manages the state itself". The host swaps them the same way: a mixer bound to the
# rendered code (``_kvcache_host``) has its conv and scan, and so its states, done there around the model's own
# projections, norms and gate; any other module (the reference model's) runs transformers' own functions.
MAMBA_SCANS = {"mamba2_scan_forward": "mamba2_scan", "mamba_scan_forward": "mamba_scan"}  # -> the render's method
_CONV = "causal_conv1d_forward"


def mamba_scan_of(module) -> str | None:
    """The scan function a Mamba mixer's forward calls (a key of MAMBA_SCANS), None for any other module."""
    home = sys.modules.get(type(module).__module__)
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return None
    if home is None or f"{_CONV}(" not in source or not hasattr(home, _CONV):
        return None
    return next((name for name in MAMBA_SCANS if f"{name}(" in source and hasattr(home, name)), None)


def _host_conv(original):
    def causal_conv1d_forward(conv1d, hidden_states, cache=None, layer_idx=None, activation=None, *args, **kwargs):
        host = getattr(conv1d, "_kvcache_host", None)
        if host is None:
            # transformers' own conv, on a contiguous copy of the same values: torch's CPU float64 depthwise conv1d
            # over the mixer's transposed split view takes 52 s where the contiguous input takes 0.06 s (8704
            # channels x 300 tokens, measured); same operator, same values
            return original(conv1d, hidden_states.contiguous(), cache, layer_idx, activation, *args, **kwargs)
        if getattr(conv1d, "_kvcache_no_activation", False):  # a short conv: none, as transformers' layer calls it
            if activation is not None:
                raise NotSupportedByKvcache("--config", f"a short conv with activation {activation!r} (the rendered "
                                                        "conv applies none)", field="model_type")
        elif activation not in ("silu", "swish"):  # the rendered conv applies SiLU, as every Mamba config names
            raise NotSupportedByKvcache("--config", f"a Mamba conv activation {activation!r} (the rendered conv "
                                                    "applies SiLU)", field="hidden_act")
        out = host.conv_step(hidden_states[0].transpose(0, 1), _metadata())  # [C, T] -> [T, C] packed tokens
        return out.transpose(0, 1)[None]

    causal_conv1d_forward._kvcache_original = original
    return causal_conv1d_forward


def _host_mamba2_scan(original):
    def mamba2_scan_forward(module, hidden_states, B, C, dt, cache=None, **kwargs):  # noqa: N803 - transformers' names
        host = getattr(module, "_kvcache_host", None)
        if host is None:
            return original(module, hidden_states, B, C, dt, cache, **kwargs)
        t = hidden_states.shape[1]
        groups = (t, module.n_groups, module.ssm_state_size)
        host.probe.last_layer = host.layer_idx
        out = host.mamba2_scan(hidden_states[0].reshape(t, module.num_heads, module.head_dim), dt[0],
                               B[0].reshape(groups), C[0].reshape(groups), -torch.exp(module.A_log.float()), module.D,
                               module.dt_bias, tuple(module.time_step_limit), _metadata())
        return out.reshape(1, t, -1)

    mamba2_scan_forward._kvcache_original = original
    return mamba2_scan_forward


def _host_mamba_scan(original):
    def mamba_scan_forward(module, hidden_states, time_step, B, C, gate, cache=None, **kwargs):  # noqa: N803
        host = getattr(module, "_kvcache_host", None)
        if host is None:
            return original(module, hidden_states, time_step, B, C, gate, cache, **kwargs)
        host.probe.last_layer = host.layer_idx
        out = host.mamba_scan(hidden_states[0].T, time_step[0].T, B[0], C[0], gate[0].T,
                              -torch.exp(module.A_log.float()), module.D, module.dt_proj.bias, _metadata())
        return out.T[None]

    mamba_scan_forward._kvcache_original = original
    return mamba_scan_forward


def multihead_mamba(module) -> bool:
    """A multi-head Mamba-1 mixer (transformers ZambaMambaMixer: per-head ``x_proj_weight`` / ``dt_proj_weight``),
    whose forward scans its heads itself: no scan function to swap, so the host routes its forward."""
    return hasattr(module, "x_proj_weight") and hasattr(module, "n_mamba_heads")


def _multihead_mamba_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """transformers' multi-head Mamba-1 mixer (ZambaMambaMixer.forward) with the conv and the heads' scans, and so the
    states, done by the rendered code around the model's own in_proj, per-head x_proj / dt_proj, A, D and out_proj,
    on the packed tokens."""
    host = self._kvcache_host
    if self.activation not in ("silu", "swish"):  # the rendered conv applies SiLU
        raise NotSupportedByKvcache("--config", f"a Mamba conv activation {self.activation!r} (the rendered conv "
                                                "applies SiLU)", field="hidden_mamba_act")
    fm = _metadata()
    t = hidden_states.shape[1]
    heads, width = self.n_mamba_heads, self.mamba_head_dim
    # in_proj's output channels interleave x and the gate: transformers views them as [I, 2] (x at 2i, gate at 2i + 1)
    inner, gate = self.in_proj(hidden_states[0]).view(t, -1, 2).unbind(-1)
    host.probe.last_layer = host.layer_idx
    inner = host.conv_step(inner, fm)  # [T, I], conv + SiLU over each request's conv state
    params = torch.einsum("hrp,thp->thr", self.x_proj_weight, inner.reshape(t, heads, width))  # each head's x_proj
    time_step, B, C = params.split([self.time_step_rank, self.ssm_state_size, self.ssm_state_size], dim=-1)
    dt = torch.einsum("hpr,thr->thp", self.dt_proj_weight, time_step).reshape(t, -1)  # each head's dt_proj
    out = host.mamba_scan(inner, dt, B, C, gate, -torch.exp(self.A_log.float()).reshape(heads * width, -1),
                          self.D.reshape(-1), self.dt_proj_bias.reshape(-1), fm)
    return self.out_proj(out.to(hidden_states.dtype))[None]


_HOST_HOOKS = {_CONV: _host_conv, "mamba2_scan_forward": _host_mamba2_scan, "mamba_scan_forward": _host_mamba_scan}


def bind_mamba(module, host, scan: str) -> None:
    """Route a Mamba mixer's conv and scan through ``host`` (once per modeling module, the swap stays: it falls
    through to transformers' own functions for every module not bound)."""
    if not hasattr(host, MAMBA_SCANS[scan]):
        raise InputError("--config", f"{type(module).__name__} calls {scan} and the rendered state mixin has no "
                                     f"{MAMBA_SCANS[scan]} (its linear_attention family is another)", field="model_type")
    home = sys.modules[type(module).__module__]
    for name in (_CONV, scan):
        current = getattr(home, name)
        if not hasattr(current, "_kvcache_original"):
            setattr(home, name, _HOST_HOOKS[name](current))
    module._kvcache_host = host
    module.conv1d._kvcache_host = host


def bind_short_conv(module, host) -> None:
    """Route an LFM2-family short-conv layer's conv through ``host``: its modeling module's ``causal_conv1d_forward``
    (the one transformers' ``kernelize`` swaps) is swapped once and falls through to transformers' own for every conv
    not bound; in_proj, B * x, C * and out_proj stay the layer's own."""
    if not hasattr(host, "conv_step"):
        raise InputError("--config", f"{type(module).__name__} is a short-conv layer and the rendered state mixin has "
                                     "no conv_step (its linear_attention family is another)", field="model_type")
    home = sys.modules[type(module).__module__]
    current = getattr(home, _CONV)
    if not hasattr(current, "_kvcache_original"):
        setattr(home, _CONV, _host_conv(current))
    module.conv._kvcache_host = host
    module.conv._kvcache_no_activation = True  # the layer convolves without an activation (C gates the output)


def _rwkv_time_mix_forward(self, hidden, state=None, use_cache=False):
    """transformers' RwkvSelfAttention with its token shift and wkv, and so its states, done by the rendered code:
    the module's own mixes, key / value / receptance projections, receptance gate and output projection around
    ``token_shift`` and ``wkv`` on the packed tokens."""
    host = self._kvcache_host
    fm = _metadata()
    x = hidden[0]
    shifted = host.token_shift(x, fm, 0)
    mixed = {name: x * mix[0, 0] + shifted * (1 - mix[0, 0]) for name, mix in (
        ("key", self.time_mix_key), ("value", self.time_mix_value), ("receptance", self.time_mix_receptance))}
    receptance = torch.sigmoid(self.receptance(mixed["receptance"]))
    host.probe.last_layer = host.layer_idx
    out = host.wkv(self.key(mixed["key"]), self.value(mixed["value"]), self.time_decay, self.time_first, fm)
    return self.output(receptance * out.to(x.dtype))[None], state


def _rwkv_channel_mix_forward(self, hidden, state=None):
    """transformers' RwkvFeedForward with its token shift, and so its state, done by the rendered code (the block's
    state holder, its time-mix's): the module's own mixes, squared-ReLU key, value and receptance gate."""
    host = self._kvcache_host
    x = hidden[0]
    shifted = host.token_shift(x, _metadata(), 1)
    key = x * self.time_mix_key[0, 0] + shifted * (1 - self.time_mix_key[0, 0])
    receptance = x * self.time_mix_receptance[0, 0] + shifted * (1 - self.time_mix_receptance[0, 0])
    value = self.value(torch.square(torch.relu(self.key(key))))
    return (torch.sigmoid(self.receptance(receptance)) * value)[None], state


def _route_state_module(module, host, method: str, what: str, forward, checked=None) -> None:
    """Route ``module``'s forward through ``host`` (``forward`` does the module's own arithmetic around the render's
    ``method``), refused by name when the render holds no such method (its linear_attention family is another).
    ``checked``: the module the refusal names, when another one is routed (an mLSTM layer's backend)."""
    if not hasattr(host, method):
        raise InputError("--config", f"{type(checked or module).__name__} is {what} and the rendered state mixin has "
                                     f"no {method} (its linear_attention family is another)", field="model_type")
    module._kvcache_host = host
    module.forward = types.MethodType(forward, module)


def bind_rwkv(block, time_mix, host) -> None:
    """Route an RWKV-4 block's time-mix (transformers' RwkvSelfAttention, the state holder) and its channel-mix (the
    block's other module with a token shift, RwkvFeedForward) through ``host``: both mixes' token shifts and the wkv
    keep their states in the time-mix's state block."""
    channel = [m for m in block.children() if m is not time_mix and hasattr(m, "time_mix_receptance")]
    _route_state_module(time_mix, host, "wkv", "an RWKV time-mix", _rwkv_time_mix_forward)
    if len(channel) != 1:
        raise InputError("--config", f"{type(block).__name__} holds {len(channel)} channel-mix modules beside its "
                                     "time-mix (the host routes one)", field="model_type")
    _route_state_module(channel[0], host, "token_shift", "an RWKV channel-mix", _rwkv_channel_mix_forward)


def _rg_lru_block_forward(self, input_states, position_ids=None, attention_mask=None, use_cache=True, **kwargs):
    """transformers' RecurrentGemmaRecurrentBlock with its conv and RG-LRU scan, and so its states, done by the rendered
    code: the block's own linear_y and activation, linear_x, the RG-LRU's block-diagonal gates (as
    RecurrentGemmaRglru.forward computes them) and linear_out around ``conv_step`` and ``rg_lru`` on the packed
    tokens."""
    host = self._kvcache_host
    fm = _metadata()
    x = input_states[0]
    y = self.act_fn(self.linear_y(x))
    conv = host.conv_step(self.linear_x(x), fm)  # [T, W], bias, no activation
    lru, t = self.rg_lru, conv.shape[0]
    blocks = conv.reshape(t, lru.num_attention_heads, lru.block_width).permute(1, 0, 2)
    gates = [torch.sigmoid(torch.baddbmm(bias[:, None, :], blocks, weight).transpose(0, 1).reshape(t, -1))
             for bias, weight in ((lru.input_gate_bias, lru.input_gate_weight),
                                  (lru.recurrent_gate_bias, lru.recurrent_gate_weight))]
    log_a = -8.0 * gates[1] * torch.nn.functional.softplus(lru.recurrent_param)
    host.probe.last_layer = host.layer_idx
    h = host.rg_lru(conv, gates[0], log_a, fm)
    return self.linear_out(h * y)[None], None


def bind_rg_lru(module, host) -> None:
    """Route a RecurrentGemma recurrent block (its conv_1d and RG-LRU, the block's conv1d_state and the RG-LRU's
    recurrent_states) through ``host``."""
    _route_state_module(module, host, "rg_lru", "a RecurrentGemma recurrent block", _rg_lru_block_forward)


def _mlstm_backend_forward(self, query, key, value, igate, fgate, c_initial=None, n_initial=None, m_initial=None,
                           return_last_states=None, mode=None):
    """transformers' xLSTMBackend (the mLSTM kernels) with its recurrence, and so its states, done by the rendered
    code: the layer's own projections, soft-capped gates, multi-head norm, output gate and out_proj around ``mlstm``
    on the packed tokens ([1, H, T, D] in, [1, H, T, Dv] out); no state is handed back (the render keeps it)."""
    host = self._kvcache_host
    host.probe.last_layer = host.layer_idx
    h = host.mlstm(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), igate[0].T, fgate[0].T,
                   self.config.eps, _metadata())
    return h.transpose(0, 1)[None], None


def bind_mlstm(module, host) -> None:
    """Route an xLSTM mLSTM layer's backend (its ``mlstm_backend``, the kernels that hold the C / n / m states)
    through ``host``."""
    _route_state_module(module.mlstm_backend, host, "mlstm", "an mLSTM layer", _mlstm_backend_forward, checked=module)


def _cca_forward(self, hidden_states, cache=None, conv_mask=None, **kwargs):
    """transformers' ZayaCCAProjection with its convs over the previous q|k inputs and its delayed value, and so its
    states, done by the rendered code: the module's own q_proj / k_proj, residual paths (queries averaged with their
    KV head's keys, keys the mean of their group) and v_proj_current / v_proj_delayed around ``cca_project`` on the
    packed tokens. Returns [1, T, heads, head_dim] query, key and value, as the module does."""
    host = self._kvcache_host
    if conv_mask is not None:  # padding zeroed before the convs, as transformers does (a packed step has none)
        hidden_states = hidden_states * conv_mask[:, :, None].to(hidden_states.dtype)
    x = hidden_states[0]
    t = x.shape[0]
    shape = (t, -1, self.head_dim)
    queries, keys = self.q_proj(x), self.k_proj(x)
    query_residual = (queries.view(shape) + keys.view(shape).repeat_interleave(self.num_key_value_groups, dim=1)) * 0.5
    key_residual = query_residual.view(t, -1, self.num_key_value_groups, self.head_dim).mean(dim=-2)
    v_init = self.v_proj_delayed(x.new_zeros(1, self.hidden_size))[0]  # the delayed value before a first token
    host.probe.last_layer = host.layer_idx
    qk, delayed = host.cca_project(torch.cat([queries, keys], dim=-1), self.v_proj_delayed(x), v_init, _metadata())
    query = qk[:, :queries.shape[-1]].view(shape) + query_residual
    key = qk[:, queries.shape[-1]:].view(shape) + key_residual
    value = torch.cat([self.v_proj_current(x), delayed], dim=-1).view(shape)
    return query[None], key[None], value[None]


def bind_cca(module, host) -> None:
    """Route a ZAYA CCA projection (its two q|k convs' conv state and its delayed value) through ``host``."""
    _route_state_module(module, host, "cca_project", "a CCA projection", _cca_forward)


def _minimax_lightning_forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                               **kwargs):
    """transformers' MiniMaxLightningAttention with the recurrence, and so the state, done by the rendered code: its
    own q|k|v projection (per head [q | k | v]) and activation, full-width norm, sigmoid output gate and output
    projection around ``linear_attention``; g is its per-head log decay, -slope_rate (the layer factor included)."""
    host = self._kvcache_host
    fm = _metadata()
    x = hidden_states[0]
    t = x.shape[0]
    qkv = self.act_fn(self.qkv_proj(x)).reshape(t, self.num_attention_heads, 3 * self.head_dim)
    q, k, v = torch.split(qkv, self.head_dim, dim=-1)
    host.probe.last_layer = host.layer_idx
    core = host.linear_attention(q, k, v, -self.slope_rate.view(-1).to(x.dtype), fm)
    out = torch.sigmoid(self.output_gate(hidden_states)) * self.norm(core.reshape(1, t, -1))
    return self.out_proj(out), None


def _linear_forward(module):
    """The host forward of a linear-attention module: KDA has a forget gate, lightning a slope (kvcache's Ling-2.5
    reference) or a slope rate (MiniMax), the gated delta net none."""
    if hasattr(module, "slope_rate"):
        return _minimax_lightning_forward
    if hasattr(module, "slope"):
        return _lightning_forward
    return _kda_forward if hasattr(module, "forget_gate") else _gdn_forward


def state_dtypes(dtype: torch.dtype, has_conv: bool, recurrent: bool = True) -> dict[str, torch.dtype]:
    """``init_state_cache``'s dtype arguments for the run's ``dtype``: a conv state's only where the family has one
    (lightning has no short conv), a recurrent state's only where it has one (short conv has none)."""
    return {**({"state_dtype": dtype} if recurrent else {}), **({"conv_dtype": dtype} if has_conv else {})}


def make_host_linear(mixin: type) -> type:
    class HostLinear(mixin):
        """A rendered state mixin bound to one transformers gated-delta-net module."""

        def __init__(self, hf_linear, layer_idx: int, probe: _Probe):
            self.hf = hf_linear
            self.probe = probe
            self.layer_idx = layer_idx
            if hasattr(hf_linear, "conv1d"):  # the model's own conv weights (lightning has no short conv)
                self.conv1d = hf_linear.conv1d
            elif short_conv_facts(hf_linear):  # LFM2's gated short conv keeps its depthwise conv as ``conv``
                self.conv = hf_linear.conv
            elif rg_lru_facts(hf_linear):  # RecurrentGemma's recurrent block keeps its conv as ``conv_1d``
                self.conv_1d = hf_linear.conv_1d
            elif cca_facts(hf_linear):  # ZAYA's CCA projection: its two convs over q|k
                self.conv_qk_depthwise = hf_linear.conv_qk_depthwise
                self.conv_qk_grouped = hf_linear.conv_qk_grouped

    return HostLinear


def decoder_layers(hf_model, stacks=None) -> tuple[str, torch.nn.ModuleList]:
    """(path, layers) of the decoder stack (``stacks``: the paths of several joined, manifest recurrent_loops.stacks);
    a model with none is refused in one line."""
    try:
        stack = find_decoder_stack(hf_model, tuple(stacks) if stacks else None)
    except LayoutError as exc:
        raise InputError("--config", f"the validation host found no decoder layers: {exc}", field="model_type") from None
    return stack.path, stack.layers


# the module attributes a rendered MLA writer may scale its gamma by (analyzer/kinds/mla.py)
MLA_LATENT_SCALE_ATTRS = tuple(sorted({attr for attr, _ in MLA_LATENT_SCALES.values()}))


def make_host_attention(mixin: type) -> type:
    class HostAttention(mixin):
        """A rendered attention mixin bound to one transformers attention module."""

        def __init__(self, hf_attention, layer_idx: int, probe: _Probe):
            self.hf = hf_attention
            self.probe = probe
            self.bsh = hasattr(self, "legacy_attention")  # Legacy renders take BSH [B, S, N*D]
            self.layer_idx = layer_idx
            if getattr(hf_attention, "sinks", None) is not None:  # MiMo-V2-Flash keeps sinks = None on full layers
                # float32 as the device op takes it; float64 only in the float64 validation mode.
                sinks = hf_attention.sinks.detach()
                self.sinks = sinks if sinks.dtype == torch.float64 else sinks.float()
            # the model's own modules the rendered MLA code reads (and DSA's indexer projections)
            for name in ("kv_a_layernorm", "kv_b_proj", "indexer", "compressor", "k_rope_only_layernorm",
                         *MLA_LATENT_SCALE_ATTRS):
                if getattr(hf_attention, name, None) is not None:
                    setattr(self, name, getattr(hf_attention, name))

    return HostAttention


class EncoderStates:
    """Each request's encoder output, as the validation feeds it to the model under test and to the reference: random,
    fixed per request (seeded by the request's first prompt tokens, which every later prefix of it keeps), of a length
    that varies across requests and stays below the slot's maximum."""

    KEY_TOKENS = vision_rows.KEY_TOKENS  # every stream prompt is at least this long

    def __init__(self, hidden: int, max_len: int, seed: int):
        self.hidden = hidden
        self.max_len = max_len
        self.seed = seed
        self._cache: dict[tuple, torch.Tensor] = {}

    def of(self, token_ids) -> torch.Tensor:
        """[S_enc, hidden] float64 of the request whose sequence starts with ``token_ids``."""
        key = tuple(int(t) for t in list(token_ids)[:self.KEY_TOKENS])
        if key not in self._cache:
            g = torch.Generator().manual_seed(zlib.crc32(repr((self.seed, key)).encode()))
            top = max(2, min(self.max_len - 1, 300))
            length = int(torch.randint(max(1, top // 8), top + 1, (1,), generator=g))
            self._cache[key] = torch.randn(length, self.hidden, generator=g, dtype=torch.float64)
        return self._cache[key]

    def image_row(self, token_ids) -> int | None:
        """A vision request's image token row in its prompt, None: no image (vision_rows.image_row)."""
        return vision_rows.image_row(self.seed, token_ids)


def encoder_kwargs(model, states: torch.Tensor) -> dict:
    """The keyword a ForCausalLM decoder takes its encoder output by: ``encoder_hidden_states`` (BART family,
    TrOCR) or ``encoder_outputs`` (Whisper)."""
    params = inspect.signature(model.forward).parameters
    if "encoder_hidden_states" in params:
        return {"encoder_hidden_states": states}
    if "cross_attention_states" in params:  # Mllama: the vision states (the reference: masked_vision_kwargs)
        return {"cross_attention_states": states}
    return {"encoder_outputs": (states,)}


def masked_vision_kwargs(ref_model, encoder: EncoderStates, token_ids) -> dict | None:
    """Mllama's reference inputs as transformers builds them (None for another model): a request without an image
    runs with none; one with an image gets its vision states padded to the slot's reservation (the padding tiles'
    rows) and transformers' own cross_attention_mask of its image token's row (vision_rows.reference_kwargs). The model
    under test gets the same padded states: the two agree only when its paged reads stop where transformers' mask
    does, and read everything where the mask is empty (the rows before the image token)."""
    start = encoder.image_row(token_ids)
    return vision_rows.reference_kwargs(ref_model, None if start is None else encoder.of(token_ids), start,
                                        encoder.max_len, len(token_ids))


def _cross_hidden(layers, names) -> int | None:
    """The encoder width the decoder's cross-attention projects (its k_proj's input), None without one."""
    for layer in layers:
        for name in names:
            mod = getattr(layer, name, None)
            if mod is not None and hasattr(mod, "k_proj"):
                return int(mod.k_proj.in_features)
    return None


def _host_positions(original):
    """A decoder's position embedding (BART family, Whisper, TrOCR) computes positions itself from the step's length
    and the cache length (arange(S) + cache_length), which a packed step of several requests, or a decode step
    without a transformers cache, does not have: the host asks the model's own embedding for positions 0..max and
    picks each token's row by the step's real positions."""

    def forward(self, first, *args, **kwargs):
        if not _CURRENT or _CURRENT[-1][1] is None:
            return original(first, *args, **kwargs)
        pos = _CURRENT[-1][1]
        length = _table_length(self, pos)
        probe = (1, length) if isinstance(first, (tuple, list, torch.Size)) else _position_probe(original, first, length)
        kw = {"cache_length": 0} if "cache_length" in inspect.signature(original).parameters else {}
        if "position_ids" in inspect.signature(original).parameters:
            kw["position_ids"] = torch.arange(length, device=pos.device)[None]
        table = original(probe, **kw)
        return table.reshape(length, -1)[pos.long()]

    return forward


def _table_length(module, pos: torch.Tensor) -> int:
    """How many positions the host asks a position embedding for: up to the step's highest position; in a captured
    decode step (graph mode) a sinusoidal table's whole length (MusicGen's ``weights``), so that no length read from
    the step's positions (a host value: V228's data-dependent guard) shapes the graph."""
    rows = getattr(module, "weights", None)
    if isinstance(rows, torch.Tensor) and torch.compiler.is_compiling():
        return rows.shape[0]
    return int(pos.max()) + 1


def _position_probe(original, first: torch.Tensor, length: int) -> torch.Tensor:
    """Zeros shaped as the embedding's own input with ``length`` positions, batch 1: ids [..., seq] (MusicGen's
    [batch, codebooks, seq] too), or embeddings [..., seq, hidden] where the forward takes ``inputs_embeds``
    (MusicGen-Melody's sinusoidal table)."""
    shape = [1] * first.dim()
    if next(iter(inspect.signature(original).parameters), "") == "inputs_embeds":
        shape[-2], shape[-1] = length, first.shape[-1]
    else:
        shape[-1] = length
    return first.new_zeros(shape)


def derives_positions(module) -> bool:
    """A position embedding that numbers the step's tokens from the cache length it is handed and takes no position
    ids (MusicGen's and MusicGen-Melody's sinusoidal tables: ``arange(seq_len) + cache_length``): a packed step, or a
    decode step without a transformers cache, gives it no such length, so the host routes it (``_host_positions``)
    whether or not the decoder attends over an encoder."""
    params = inspect.signature(module.forward).parameters
    return "cache_length" in params and "position_ids" not in params


def _attention_sublayers(hits: list[tuple[str, object]], state) -> list[tuple[str, object]] | None:
    """A decoder layer's attention sublayers when it keeps them in one ModuleList (LongCat-Flash's
    ``self_attn[0]`` / ``self_attn[1]``), each module indexing its own cache layer the way transformers does
    (its ``layer_idx``: ``2 x layer + i``); None for anything else (one module, a hybrid's attention beside a mixer,
    modules under different names), which the single-module routing takes or refuses."""
    if state is not None or len(hits) < 2:
        return None
    parents = {name.rpartition(".")[0] for name, _ in hits}
    if len(parents) != 1 or not all(name.rpartition(".")[2].isdigit() for name, _ in hits):
        return None
    ordered = sorted(hits, key=lambda hit: int(hit[0].rpartition(".")[2]))
    indices = [getattr(module, "layer_idx", None) for _, module in ordered]
    if not all(isinstance(i, int) for i in indices) or indices != list(range(indices[0], indices[0] + len(indices))):
        return None
    return ordered


def loop_host(module, cache_offset: int):
    """The host of the cache layer a looped call writes: transformers' cache index ``layer_idx + offset`` (Dory's
    cache_offset, HRM's cycle_offset; the port gives that call its own module)."""
    return module._kvcache_loop_hosts[module.layer_idx + cache_offset]


def _looped_forward(forward, offset_kwarg: str):
    """A looped layer's attention forward that routes each call to the host of its cache layer (transformers passes
    the call's offset as ``offset_kwarg``), then runs the module's own forward."""
    def call(self, *args, **kwargs):
        self._kvcache_host = loop_host(self, kwargs.get(offset_kwarg, 0))
        return forward(*args, **kwargs)

    return call


class _DecoderLayer:
    """A decoder layer as get_cache_info() sees it: any attribute is its attention module, except that a layer whose
    state module transformers keeps under ``state_attr`` (Jamba's ``mamba``) answers that name only, as the model's
    own layer does (a render looking the module up under another name finds none)."""

    def __init__(self, attention, state_attr: str | None = None, state=None, cross=None, loops=None):
        self._loops = loops  # (attribute, hosts) of a looped layer's later loops (Dory: loop_attentions)
        self._attention = attention
        self._state_attr = state_attr
        self._state = state  # a parallel hybrid's mixer beside its attention (Falcon-H1), under state_attr
        self._cross = cross  # (attribute, host) of the layer's cross-attention module (an encoder-decoder's decoder)

    def __getattr__(self, name):
        if self._loops is not None and name == self._loops[0]:
            return self._loops[1]
        if self._cross is not None and name == self._cross[0]:
            return self._cross[1]
        if self._state is not None:
            return self._state if name == self._state_attr else self._attention
        if self._state_attr is not None and name != self._state_attr:
            raise AttributeError(f"the decoder layer holds its state module as {self._state_attr!r}, not {name!r}")
        return self._attention


class _ModulePaths:
    """A decoder layer as get_cache_info() sees it when its cache modules sit below sub-blocks, at transformers' own
    paths (Zamba2HybridLayer: ``shared_transformer.self_attn`` and ``mamba_decoder.mamba``), each path ending at the
    host of that module; any other name is not there (a render looking a module up elsewhere finds none)."""

    def __init__(self, modules: dict[str, object]):
        children: dict[str, object] = {}
        for path, module in modules.items():
            head, _, rest = path.partition(".")
            if rest:
                children.setdefault(head, {})[rest] = module
            else:
                children[head] = module
        self.__dict__["_children"] = children

    def __getattr__(self, name):
        child = self.__dict__["_children"].get(name)
        if child is None:
            raise AttributeError(f"the decoder layer holds no {name!r} (it holds {sorted(self._children)})")
        return _ModulePaths(child) if isinstance(child, dict) else child


def _stack_views(hf_model, joined: str, stacks, views: list) -> types.SimpleNamespace:
    """The model as get_cache_info() walks it when its decoder layers sit in several stacks: each stack's views at
    that stack's path (HRM: ``L_module.layers``, ``H_module.layers``), no ``layers`` of the model's own."""
    model = types.SimpleNamespace()
    start = 0
    for full, tail in zip(joined.split("+"), stacks, strict=True):
        n = len(hf_model.get_submodule(full))
        *parents, leaf = tail.split(".")
        node = model
        for name in parents:
            node = node.__dict__.setdefault(name, types.SimpleNamespace())
        setattr(node, leaf, views[start:start + n])
        start += n
    return model


class HostModel:
    """The tiny transformers model with its attention routed through the rendered code."""

    def __init__(self, hf_model, rendered: RenderedCode, *, is_mla: bool, cache_dtype=torch.float32,
                 window: int | None = None, block_size: int = 128, device: torch.device | None = None,
                 uncached: frozenset[int] = frozenset(), loops=None):
        self.hf_model = hf_model
        self.rendered = rendered
        self.cache_dtype = cache_dtype  # the compute dtype of the model under test
        self.step_index = -1  # forward calls so far, for failure locations
        self.device = device or torch.device("cpu")
        self.atol = ATOL_FP32 if self.device.type == "cpu" else ATOL_BF16
        self.window = window
        self.probe = _Probe()
        if hasattr(rendered.attention, "torch_npu"):
            rendered.attention.torch_npu = _RecordingOps(rendered.attention.torch_npu, self.probe)
        if hasattr(rendered.attention, "custom_ops"):  # the checkout's own operators (torch.ops.custom): DeepSeek-V4
            rendered.attention.torch = _RecordingTorch(self.probe)
        if hasattr(rendered.attention, "torchair"):  # ge_graph decode calls torchair.ops' attention
            rendered.attention.torchair = _RecordingTorchair(rendered.attention.torchair, self.probe)
        attention_mixin = rendered.attention_mixin()
        host_cls = make_host_attention(attention_mixin) if attention_mixin else None
        linear_mixin = rendered.linear_mixin()
        linear_cls = make_host_linear(linear_mixin) if linear_mixin else None
        self.attentions = []
        self._looped = []  # the hosts of a looped section's later loops (Dory), after the model's in self.attentions
        self.cross_attentions = []  # an encoder-decoder's decoder: each layer's cross-attention module, routed
        self.cross_prefill_lens: dict[int, list[int]] = {}  # step -> its requests' encoder lengths (prefill steps)
        path, layers = decoder_layers(hf_model, loops.stacks if loops else None)
        cross_names = CROSS_MODULE_NAMES if hasattr(host_cls, "init_cross_cache") else ()
        hidden = _cross_hidden(layers, cross_names)
        # each request's encoder output (None: a decoder-only render); the pipeline hands the reference the same
        self.encoder = EncoderStates(hidden, rendered.attention.CROSS_MAX_ENCODER_LEN, _ENCODER_SEED) \
            if hidden else None
        routes = set()
        views: list[_DecoderLayer] = []  # what get_cache_info() walks, one per decoder layer
        def route_one(where: str, hf_attn, cache_idx: int):
            """One attention module routed through the rendered code: its host holds cache layer cache_idx."""
            if host_cls is None:
                raise InputError("--config", f"{where} ({type(hf_attn).__name__}) attends and the rendered "
                                             "code has no attention mixin (a pure state stack's render)",
                                 field="model_type")
            route = attention_route(hf_attn, is_mla)
            if route is None:
                raise InputError("--config", f"attention module {where} ({type(hf_attn).__name__}) is not "
                                             "understood by the validation host: its forward neither calls "
                                             "transformers' attention interface nor is MLA, a fused "
                                             "query_key_value (Falcon's, GPT-NeoX-Japanese's), GPT-1's Conv1D c_attn, "
                                             "GPT-Neo's split q / k / v "
                                             "or a BERT-era query / key / value self-attention", field="model_type")
            routes.add(route)
            host = host_cls(hf_attn, cache_idx, self.probe)
            host.init_kv_cache(cache_idx, cache_dtype)
            hf_attn._kvcache_host = host
            if route == "bert_qkv":
                hf_attn._kvcache_sinusoidal = sinusoidal_table(hf_model)
            if route == "qsa":  # its pooled block keys' RoPE: the text model's rotary embedding (its bound forward,
                # not the module: an attribute holding a module would register it as the attention's child)
                hf_attn._kvcache_rotary = next(mod for name, mod in hf_model.named_modules()
                                               if name.endswith("rotary_emb") and "vis" not in name).forward
            if route in _ROUTED_FORWARD:
                hf_attn.forward = types.MethodType(_padded(_ROUTED_FORWARD[route], _returned_values(hf_attn)),
                                                   hf_attn)
            return host

        for idx, layer in enumerate(layers):
            # A linear module first: KDA's has q/k/v projections and would pass for attention.
            linear = find_linear(layer)
            crossed = [hit for hit in find_attentions(layer) if hit[0].rsplit(".", 1)[-1] in cross_names]
            if idx in uncached and crossed and linear is None and len(find_attentions(layer)) == 1:
                # a cross-attention-only block (Mllama): no self-attention cache, its slots a cache layer of their own
                cross_host = self._route_cross(crossed[0], idx, host_cls, cache_dtype, is_mla)
                views.append(_DecoderLayer(types.SimpleNamespace(), cross=(crossed[0][0].rsplit(".", 1)[-1],
                                                                          cross_host)))
                continue
            if idx in uncached:  # a block the manifest plans without any cache (an MLP / MoE block): left as it is
                if linear is not None or find_attentions(layer):
                    raise InputError("--config", f"{path}.{idx} ({type(layer).__name__}) is planned without a cache "
                                                 "(manifest no_cache_layers) and holds an attention or a recurrent "
                                                 "mixer", field="model_type")
                views.append(_DecoderLayer(types.SimpleNamespace()))  # no module with cache entries
                continue
            state, state_attr = None, None
            if linear is not None:
                if linear_cls is None:
                    raise InputError("--config", f"{path}.{idx}.{linear[0]} ({type(linear[1]).__name__}) is a linear "
                                                 "layer and the rendered code has no state mixin", field="model_type")
                state = linear_cls(linear[1], idx, self.probe)
                short_conv = bool(short_conv_facts(linear[1]))
                state.init_state_cache(idx, **state_dtypes(cache_dtype, hasattr(linear[1], "conv1d") or short_conv
                                                           or bool(rwkv_facts(linear[1]) or rg_lru_facts(linear[1])
                                                                   or cca_facts(linear[1])),
                                                           recurrent=not short_conv))
                scan = mamba_scan_of(linear[1])
                if rwkv_facts(linear[1]):
                    bind_rwkv(layer, linear[1], state)
                    state_attr = linear[0]  # the layer answers its time-mix's own name only (RWKV: attention)
                elif cca_facts(linear[1]):
                    bind_cca(linear[1], state)
                    state_attr = linear[0]  # the attention's own child (ZAYA: self_attn.qkv_proj)
                elif rg_lru_facts(linear[1]):
                    bind_rg_lru(linear[1], state)
                    state_attr = linear[0]  # the layer answers its recurrent block's own name only (temporal_block)
                elif mlstm_facts(linear[1]):
                    bind_mlstm(linear[1], state)
                    state_attr = linear[0]  # the layer answers its mLSTM layer's own name only (mlstm_layer)
                elif short_conv:
                    bind_short_conv(linear[1], state)
                    state_attr = linear[0]  # the layer answers its conv layer's own name only (LFM2: conv)
                elif scan is not None:
                    bind_mamba(linear[1], state, scan)
                    state_attr = linear[0]  # the layer answers its mixer's own name only
                elif multihead_mamba(linear[1]):
                    if not hasattr(state, "mamba_scan"):
                        raise InputError("--config", f"{type(linear[1]).__name__} is a Mamba-1 mixer and the rendered "
                                                     "state mixin has no mamba_scan (its linear_attention family is "
                                                     "another)", field="model_type")
                    linear[1]._kvcache_host = state
                    linear[1].forward = types.MethodType(_multihead_mamba_forward, linear[1])
                    state_attr = linear[0]
                else:
                    linear[1]._kvcache_host = state
                    linear[1].forward = types.MethodType(_linear_forward(linear[1]), linear[1])
            hits = [hit for hit in find_attentions(layer) if linear is None or hit[1] is not linear[1]]
            cross = None
            crossed = [hit for hit in hits if hit[0].rsplit(".", 1)[-1] in cross_names]
            if crossed:
                hits = [hit for hit in hits if hit not in crossed]
                cross = (crossed[0][0].rsplit(".", 1)[-1],
                         self._route_cross(crossed[0], idx, host_cls, cache_dtype, is_mla))
            if linear is not None and not (hits and state_attr):  # a parallel hybrid's Mamba layer keeps attention
                self.attentions.append(state)
                views.append(_DecoderLayer(state, state_attr))
                continue
            sublayers = _attention_sublayers(hits, state)
            if sublayers is not None:  # LongCat-Flash: one attention ModuleList, each module its own cache layer
                hosts = [route_one(f"{path}.{idx}.{name}", hf_attn, hf_attn.layer_idx) for name, hf_attn in sublayers]
                self.attentions += hosts
                views.append(_DecoderLayer(hosts))
                continue
            if len(hits) != 1:
                raise InputError("--config", f"the validation host routes one attention module per decoder layer "
                                             "(or one ModuleList of them, each with its own layer_idx), "
                                             f"{path}.{idx} ({type(layer).__name__}) holds {len(hits)}",
                                 field="model_type")
            name, hf_attn = hits[0]
            # a looped layer's own module serves its first call's cache layer (transformers' order)
            host = route_one(f"{path}.{idx}.{name}", hf_attn, loops.calls.index(idx) if loops else idx)
            # a parallel hybrid (Falcon-H1) or a Zamba2 hybrid layer: the attention sublayer, then the mixer's states
            self.attentions += [host] if state is None else [host, state]
            if state is not None and state_attr.startswith(f"{name}."):
                # the state module is the attention's own child (ZAYA's self_attn.qkv_proj): the attention's host
                # answers that child's name with the state's host, as the model's attention holds its projection
                setattr(host, state_attr[len(name) + 1:], state)
                views.append(_DecoderLayer(host))
                continue
            if state is not None and "." in name + state_attr:
                # the modules sit below sub-blocks (Zamba2: the shared transformer block, the Mamba decoder): the
                # layer answers their paths only. Each hybrid layer has its own attention module and host (its
                # own cache), transformers tying the shared block's weights, not the module.
                views.append(_ModulePaths({name: host, state_attr: state}))
                continue
            looped = self._loop_hosts(loops, idx, hf_attn, host, route_one, f"{path}.{idx}.{name}")
            views.append(_DecoderLayer(host, state_attr, state, cross, looped))
        if loops is not None:  # looped layers (Dory, HRM): every call's host in transformers' cache index order
            self.attentions = sorted(self.attentions + self._looped, key=lambda h: h.layer_idx)
        for name, module in hf_model.named_modules():
            if name.endswith("embed_positions") and not name.split(".")[-2:-1] == ["encoder"] and (
                    self.encoder is not None or derives_positions(module)):
                module.forward = types.MethodType(_host_positions(module.forward), module)
        if "interface" in routes:
            _register_attention()
            hf_model.config._attn_implementation = ATTN_IMPL
            for module in hf_model.modules():
                if hasattr(module, "config") and module.config is not hf_model.config:
                    module.config._attn_implementation = ATTN_IMPL
        # Each decoder layer's output of the last step, to name the first diverging layer on failure.
        self.layer_outputs: list[torch.Tensor | None] = [None] * len(layers)
        for idx, layer in enumerate(layers):
            layer.register_forward_hook(_store_output(self.layer_outputs, idx))
        # What get_cache_info() walks: model.layers[i].<attn_attr> (whatever --attn-attr the render
        # used), plus the model-level block size.
        self.block_size = block_size
        self.position_offset = position_offset(hf_model)
        self.model = types.SimpleNamespace(layers=views)
        if loops is not None and loops.stacks:  # a decoder of several stacks (HRM): each at its own path, as built
            self.model = _stack_views(hf_model, path, loops.stacks, views)

    def _loop_hosts(self, loops, idx: int, hf_attn, host, route_one, where: str):
        """(attribute, hosts) of decoder layer idx's later calls (manifest recurrent_loops: Dory per_loop, HRM's
        cycles), None for a layer called once. Each call is its own cache layer, transformers' index ``layer_idx +
        offset``: a host (its own cache) per call, the module's forward routing each call by the offset it
        receives."""
        cache_layers = [i for i, d in enumerate(loops.calls) if d == idx] if loops is not None else []
        if len(cache_layers) < 2:
            return None
        hosts = [route_one(f"{where} (call {k})", hf_attn, i) for k, i in enumerate(cache_layers[1:], 1)]
        # keyed by cache index, the manifest's being transformers' own (the module's layer_idx + the call's offset)
        hf_attn._kvcache_loop_hosts = {h.layer_idx: h for h in (host, *hosts)}
        hf_attn._kvcache_host = host
        hf_attn.forward = types.MethodType(_looped_forward(hf_attn.forward, loops.offset_kwarg), hf_attn)
        self._looped += hosts
        return loops.module_attr, hosts

    def get_cache_info(self):
        mixin = self.rendered.model_mixin()
        if mixin is None:
            raise LookupError("rendered code has no get_cache_info (standalone or legacy mode)")
        return mixin.get_cache_info(self)

    def _route_cross(self, hit, idx: int, host_cls, cache_dtype, is_mla: bool):
        """A decoder layer's cross-attention module routed through the rendered slots (its host, in
        self.cross_attentions)."""
        cross_host = host_cls(hit[1], idx, self.probe)
        cross_host.is_cross = True
        cross_host.init_cross_cache(idx, cache_dtype)
        hit[1]._kvcache_host = cross_host
        if attention_route(hit[1], is_mla) == "eager_qkv":  # TrOCR, MVP: their own score code
            hit[1].forward = types.MethodType(_padded(_eager_qkv_forward, _returned_values(hit[1])), hit[1])
        self.cross_attentions.append(cross_host)
        return cross_host

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, forward_metadata) -> torch.Tensor:
        """Packed [T] ids/positions -> logits [T, vocab]."""
        return self.forward_batch(input_ids[None], position_ids[None], forward_metadata)[0]

    @torch.no_grad()
    def forward_batch(self, input_ids: torch.Tensor, position_ids: torch.Tensor, forward_metadata) -> torch.Tensor:
        """[B, S] ids/positions -> logits [B, S, vocab] (B = 1 for packed paged steps)."""
        self.step_index += 1
        self.probe.step = self.step_index
        lens, extra = None, {}
        if self.encoder is not None:
            vision = self.cross_attentions and hasattr(self.cross_attentions[0], "cross_text_rows")
            lens, states = (self.vision_step if vision else self.encoder_step)(input_ids, forward_metadata)
            if lens is not None:
                self.cross_prefill_lens[self.step_index] = lens
            extra = encoder_kwargs(self.hf_model, states.to(device=self.device, dtype=self.hf_model.dtype))
            if vision:  # the port's MLP row mask: which rows see their request's image, from the render
                rows = self.cross_attentions[0].cross_text_rows(forward_metadata, *(lens[1:] if lens else ()))
                extra["full_text_row_masked_out_mask"] = rows.view(1, 1, -1, 1).to(self.hf_model.dtype)
        with current_metadata(forward_metadata, position_ids.to(self.device), lens):
            ids = input_ids.to(self.device)
            out = self.hf_model(input_ids=ids, position_ids=position_ids.to(self.device) + self.position_offset,
                                use_cache=False, **extra, **model_inputs(self.hf_model, ids))
        return out.logits.double().cpu()

    def encoder_step(self, input_ids: torch.Tensor, forward_metadata) -> tuple[list[int] | None, torch.Tensor]:
        """(each request's encoder length, the encoder states [1, sum S_enc, hidden]) of a prefill: each request's
        own, found by its prompt's first tokens (the packed ids split by the step's cumulative query lengths). A
        decode step: (None, NaN states [1, 1, hidden]): a render that reads them instead of its slots turns NaN."""
        if not forward_metadata.is_prefill:
            return None, torch.full((1, 1, self.encoder.hidden), float("nan"), dtype=torch.float64)
        ids = input_ids.reshape(-1).tolist()
        cu = [int(x) for x in torch.as_tensor(forward_metadata.actual_seq_lengths_cu_q).tolist()]
        states = [self.encoder.of(ids[a:b]) for a, b in zip([0] + cu[:-1], cu, strict=True) if b > a]
        return [len(x) for x in states], torch.cat(states)[None]

    def vision_step(self, input_ids: torch.Tensor, forward_metadata) -> tuple[tuple | None, torch.Tensor]:
        """Mllama's prefill (a render with ``cross_text_rows``): ((each request's vision rows given, its image's
        valid vision length, its image token's row), the vision states [1, sum rows, hidden]), one entry per request
        of the step; a request without an image gives no rows (0, 0, 0), one with an image the whole padded
        reservation (vision_rows.padded). A decode step, or a prefill with no image: NaN states, as encoder_step."""
        nan = torch.full((1, 1, self.encoder.hidden), float("nan"), dtype=torch.float64)
        if not forward_metadata.is_prefill:
            return None, nan
        ids = input_ids.reshape(-1).tolist()
        cu = [int(x) for x in torch.as_tensor(forward_metadata.actual_seq_lengths_cu_q).tolist()]
        given, valid, starts, states = [], [], [], []
        for a, b in zip([0] + cu[:-1], cu, strict=True):
            start = self.encoder.image_row(ids[a:b]) if b > a else None
            own = self.encoder.of(ids[a:b]) if start is not None else None
            if own is not None:
                states.append(vision_rows.padded(own, self.encoder.max_len))
            given.append(self.encoder.max_len if own is not None else 0)
            valid.append(len(own) if own is not None else 0)
            starts.append(start or 0)
        return (given, valid, starts), (torch.cat(states)[None] if states else nan)


def position_offset(hf_model) -> int:
    """What the model adds to a token's 0-based position before its position embedding. The Roberta-style embeddings
    (RobertaEmbeddings, XmodEmbeddings...) number positions from ``padding_idx + 1`` when they derive them from the
    input ids (``create_position_ids_from_input_ids``), which is how transformers runs the reference; given explicit
    position ids they use them as they are. The engine hands every model 0-based positions, so a port of such a model
    adds this offset, and the host does too."""
    for module in hf_model.modules():
        if hasattr(type(module), "create_position_ids_from_input_ids") and isinstance(
                getattr(module, "padding_idx", None), int) and "position_ids" in inspect.signature(
                    type(module).forward).parameters:  # TrOCR's sinusoidal table takes no position ids: nothing to add
            return module.padding_idx + 1
    return 0


def _store_output(outputs: list, idx: int):
    def hook(module, _inputs, output):
        out = output[0] if isinstance(output, (tuple, list)) else output  # GPT-1's Block returns a list
        config = getattr(module, "config", None)
        if out.dim() == 4 and hasattr(config, "altup_active_idx"):
            # Gemma-3n's AltUp stacks its predictions in front: [altup_num_inputs, batch, L, hidden]
            out = out[config.altup_active_idx]  # the active one is the stream
        elif out.dim() == 4:  # DeepSeek-V4's hyper-connection streams [batch, L, hc_mult, hidden]: all of them
            out = out.flatten(2)
        outputs[idx] = out.detach()

    return hook


@torch.no_grad()
def reference_logits(ref_model, token_ids: list[int]) -> torch.Tensor:
    """transformers eager forward over one whole sequence: logits [L, vocab] (float64 compare later)."""
    ids = torch.tensor(token_ids, dtype=torch.long)[None]
    encoder = getattr(ref_model, "_kvcache_encoder", None)  # an encoder-decoder's decoder: the request's own states
    extra = {}
    if encoder is not None:
        extra = masked_vision_kwargs(ref_model, encoder, token_ids) or \
            encoder_kwargs(ref_model, encoder.of(token_ids)[None].to(ref_model.dtype))
    extra |= model_inputs(ref_model, ids)
    if getattr(ref_model, OWN_DEFAULT_DTYPE, None) is None:
        try:
            return ref_model(input_ids=ids, use_cache=False, **extra).logits[0].double()
        except RuntimeError as exc:
            if ref_model.dtype != torch.float64:
                raise
            setattr(ref_model, OWN_DEFAULT_DTYPE, str(exc).splitlines()[0][:200])
    with default_dtype(ref_model.dtype):
        return ref_model(input_ids=ids, use_cache=False, **extra).logits[0].double()


class ReferenceMemo:
    """``reference_logits`` of one reference model, computed once per token sequence. A checkout run asks for the
    same sequence's logits up to three times (the comparison, the float32 noise measurement, the comparison again at
    the widened tolerance) and the reading sweep's rerun of the same stream once more: the forward is deterministic,
    so the first result is the oracle's answer each time. Only while the model's weights stay as they are, and only
    for plain logits: a forward with hooks (reference_layer_outputs) or moved weights (reference_sensitivity) calls
    reference_logits itself."""

    def __init__(self, ref_model):
        self.ref_model = ref_model
        self._logits: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, token_ids: list[int]) -> torch.Tensor:
        key = tuple(int(t) for t in token_ids)
        if key not in self._logits:
            self._logits[key] = reference_logits(self.ref_model, list(key))
        return self._logits[key].clone()  # callers may write into what they get


# Set on a float64 reference whose forward raised in torch's default float32 (the error's first line): transformers'
# XGLM builds its mask floor as torch.full((), finfo(float64).min) in the default dtype, which overflows float32
# (modeling_xglm.py, XGLMAttention.forward). Such a reference runs with its own dtype as torch's default: its
# constants then hold the float64 values its code asked for. Only a reference that raised: every other one runs as is.
OWN_DEFAULT_DTYPE = "_kvcache_own_default_dtype"


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """torch's default dtype set to ``dtype`` while the block runs (the checkout run's loader too)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@torch.no_grad()
def reference_sensitivity(ref_model, token_ids: list[int], seed: int = 0) -> float:
    """How far the reference's own logits move when its input embeddings change by one unit in the last place
    (a fixed random sign per element): the rounding amplification of the model itself, which no port can beat."""
    tables = ref_model.get_input_embeddings()
    # MusicGen's: one table per codebook (validators/pipeline/codebooks.py), each moved
    weights = [t.weight for t in tables] if isinstance(tables, torch.nn.ModuleList) else [tables.weight]
    saved = [w.detach().clone() for w in weights]
    g = torch.Generator().manual_seed(seed)
    base = reference_logits(ref_model, token_ids)
    try:
        for weight in weights:
            signs = torch.randint(0, 2, weight.shape, generator=g).to(weight.dtype) * 2 - 1
            weight.data.mul_(1 + torch.finfo(weight.dtype).eps * signs)
        moved = reference_logits(ref_model, token_ids)
    finally:
        for weight, before in zip(weights, saved, strict=True):
            weight.data.copy_(before)
    return (moved - base).abs().max().item()


@torch.no_grad()
def reference_dtype_drift(ref_model, token_ids: list[int], dtype: torch.dtype) -> float:
    """How far transformers' own model lands from the reference when it runs in ``dtype`` (bfloat16): the
    low-precision error of the architecture itself, which no port at that dtype can be held below."""
    low = copy.deepcopy(ref_model).to(dtype=dtype)
    encoder = getattr(ref_model, "_kvcache_encoder", None)
    if encoder is not None:
        low._kvcache_encoder = encoder
    return (reference_logits(low, token_ids) - reference_logits(ref_model, token_ids)).abs().max().item()


@torch.no_grad()
def reference_layer_outputs(ref_model, token_ids: list[int]) -> list[torch.Tensor]:
    """Each decoder layer's output [L, hidden] over one whole sequence (to locate a divergence)."""
    return reference_logits_and_layers(ref_model, token_ids)[1]


def reference_logits_and_layers(ref_model, token_ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """reference_logits and each decoder layer's output from the same forward (the hooks only read): the numeric
    check compares the logits and, where a request fails, names the first diverging layer without a second one."""
    _, layers = decoder_layers(ref_model)
    outputs: list = [None] * len(layers)
    embedded: list = [None]
    handles = [layer.register_forward_hook(_store_output(outputs, i)) for i, layer in enumerate(layers)]
    handles.append(ref_model.get_input_embeddings().register_forward_hook(_store_output(embedded, 0)))
    try:
        logits = reference_logits(ref_model, token_ids)
    finally:
        for h in handles:
            h.remove()
    # a layer transformers skipped (Mllama's cross blocks for a request without an image) passed its input on
    for i, out in enumerate(outputs):
        outputs[i] = out if out is not None else outputs[i - 1] if i else embedded[0]
    return logits, [o[0].double() for o in outputs]
