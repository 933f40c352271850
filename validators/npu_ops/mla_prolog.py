"""``npu_mla_prolog_v3``: the MLA pre-processing of DeepSeek-style attention in one operator.

Doc (torch-npu 2.9.0 ``_op_plugin_docs.py``, ``npu_mla_prolog_v3``; same entry in 2.14.0), five paths:

* ``c_q = RmsNorm(x @ W_dq) * gamma_cq`` (``rmsnorm_epsilon_cq``); ``c_q @ W_uq_qr`` is per head
  ``[D | Dr]`` (``weight_uq_qr (Hcq, N*(D+Dr))``): the first ``D`` lanes times ``W_uk (N, D, Hckv)``
  are ``query (T, N, Hckv)``, the last ``Dr`` lanes after RoPE are ``query_rope (T, N, Dr)``;
* ``x @ W_dkv_kr`` (``(He, Hckv+Dr)``): the first ``Hckv`` lanes RMS-normalised with ``gamma_ckv``
  (``rmsnorm_epsilon_ckv``) are written to ``kv_cache``, the last ``Dr`` after RoPE to ``kr_cache``,
  both at ``cache_index`` (slots ``block * BlockSize + offset``; ``PA_BSND``: ND caches,
  ``PA_NZ``: the FRACTAL_NZ arrangement inside the same allocation);
* ``dequant_scale_q_nope``: shape ``(1,)`` outside full quantization; ``query_norm``
  (``query_norm_flag=True``: ``c_q``, else the reserved ``(1,)`` zero tensor) and
  ``dequant_scale_q_norm`` (reserved, ``(1,)`` zeros).

The RoPE is the interleaved (DeepSeek) rotary of the same operator family as
``npu_kv_rmsnorm_rope_cache`` (``rotary.deinterleaved_rope``), with ``rope_sin``/``rope_cos``
``(T, Dr)`` or ``(B, S, Dr)``. Enforced doc rules: ranks and shapes of every input against each
other, ``Nkv = 1``, ``D = 128``, ``Dr = 64``, ``Hckv = 512``, ``N`` in 1..128 (powers of two),
``BlockSize`` 16 or 128, ``cache_mode`` ``PA_BSND`` / ``PA_NZ``, ``cache_index`` int64. Not
enforced: the production sizes ``He`` in (6144, 7168, 7680) and ``Hcq = 1536``, which a validation
model shrinks. Quantization (every dequant/quant/smooth/clip argument, ``weight_quant_mode``,
``kv_cache_quant_mode``, ``query_quant_mode`` other than 0), the merged cache layout
(``ckvkr_repo_mode``, ``quant_scale_repo_mode``) and the scale corrections ``qc_qr_scale`` /
``kc_scale`` other than 1.0 are refused as not emulated.
"""

from __future__ import annotations

import torch
from model_infer_kvcache.validators.npu_ops import op_checks as chk
from model_infer_kvcache.validators.npu_ops.errors import NpuOpError, UnemulatedFeatureError
from model_infer_kvcache.validators.npu_ops.rotary import deinterleaved_rope
from model_infer_kvcache.validators.npu_ops.writers import write_paged_latent

OP = "npu_mla_prolog_v3"
CACHE_MODES = ("PA_BSND", "PA_NZ")
HEAD_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128)
BLOCK_SIZES = (16, 128)
D_NOPE, D_ROPE, H_CKV = 128, 64, 512


def _rms(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * gamma


def _eps(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise NpuOpError(OP, name, f"must be a non-negative float, got {value!r}")
    return float(value)


def _shape(name: str, t: torch.Tensor, want: tuple) -> None:
    if tuple(t.shape) != tuple(want):
        raise NpuOpError(OP, name, f"shape {tuple(t.shape)} must be {tuple(want)}")


def mla_prolog_v3(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq, rmsnorm_gamma_ckv,
                  rope_sin, rope_cos, kv_cache, kr_cache, *, cache_index, rmsnorm_epsilon_cq, rmsnorm_epsilon_ckv,
                  cache_mode, query_norm_flag, unemulated: dict, modes: dict, scales: dict):
    chk.absent(OP, **unemulated)
    for name, value in modes.items():
        if value != 0:
            raise UnemulatedFeatureError(OP, name, f"{value} (quantized or merged-cache mode) is not emulated; "
                                                   "validate it on an NPU")
    for name, value in scales.items():
        if value != 1.0:
            raise UnemulatedFeatureError(OP, name, f"{value}: the scale correction of quantized runs is not emulated")
    chk.choice(OP, "cache_mode", cache_mode, CACHE_MODES)
    if not isinstance(query_norm_flag, bool):
        raise NpuOpError(OP, "query_norm_flag", f"must be a bool, got {type(query_norm_flag).__name__}")
    chk.tensor(OP, "token_x", token_x, dims=(2, 3), dtypes=chk.FLOAT_DTYPES)
    dtype = token_x.dtype
    lead = tuple(token_x.shape[:-1])  # (T,) or (B, S)
    he = int(token_x.shape[-1])
    for name, t, dims in (("weight_dq", weight_dq, 2), ("weight_uq_qr", weight_uq_qr, 2), ("weight_uk", weight_uk, 3),
                          ("weight_dkv_kr", weight_dkv_kr, 2), ("rmsnorm_gamma_cq", rmsnorm_gamma_cq, 1),
                          ("rmsnorm_gamma_ckv", rmsnorm_gamma_ckv, 1), ("rope_sin", rope_sin, token_x.dim()),
                          ("rope_cos", rope_cos, token_x.dim()), ("kv_cache", kv_cache, 4), ("kr_cache", kr_cache, 4)):
        chk.tensor(OP, name, t, dims=(dims,))
        chk.same_dtype(OP, name, t, "token_x", token_x)
    if weight_dq.shape[0] != he:
        raise NpuOpError(OP, "weight_dq", f"shape {tuple(weight_dq.shape)} must be (He={he}, Hcq)")
    hcq = int(weight_dq.shape[1])
    _shape("rmsnorm_gamma_cq", rmsnorm_gamma_cq, (hcq,))
    n, d, hckv = (int(s) for s in weight_uk.shape)
    if n not in HEAD_COUNTS:
        raise NpuOpError(OP, "weight_uk", f"N={n} is not one of {list(HEAD_COUNTS)}")
    if d != D_NOPE or hckv != H_CKV:
        raise NpuOpError(OP, "weight_uk", f"shape {tuple(weight_uk.shape)} must be (N, D={D_NOPE}, Hckv={H_CKV})")
    dr = D_ROPE
    _shape("weight_uq_qr", weight_uq_qr, (hcq, n * (d + dr)))
    _shape("weight_dkv_kr", weight_dkv_kr, (he, hckv + dr))
    _shape("rmsnorm_gamma_ckv", rmsnorm_gamma_ckv, (hckv,))
    _shape("rope_sin", rope_sin, (*lead, dr))
    _shape("rope_cos", rope_cos, (*lead, dr))
    for name, cache, width in (("kv_cache", kv_cache, hckv), ("kr_cache", kr_cache, dr)):
        if cache.shape[2] != 1 or cache.shape[3] != width:
            raise NpuOpError(OP, name, f"shape {tuple(cache.shape)} must be (BlockNum, BlockSize, Nkv=1, {width})")
        if cache.shape[1] not in BLOCK_SIZES:
            raise NpuOpError(OP, name, f"BlockSize {cache.shape[1]} is not one of {list(BLOCK_SIZES)}")
    if kv_cache.shape[:2] != kr_cache.shape[:2]:
        raise NpuOpError(OP, "kr_cache", f"shape {tuple(kr_cache.shape)} must share (BlockNum, BlockSize) with "
                                         f"kv_cache {tuple(kv_cache.shape)}")
    if cache_index is None:
        raise NpuOpError(OP, "cache_index", "required to write kv_cache / kr_cache (PagedAttention)")
    chk.tensor(OP, "cache_index", cache_index, dtypes=(torch.int64,))
    _shape("cache_index", cache_index, lead)
    eps_cq = _eps("rmsnorm_epsilon_cq", rmsnorm_epsilon_cq)
    eps_ckv = _eps("rmsnorm_epsilon_ckv", rmsnorm_epsilon_ckv)

    cdt = chk.compute_dtype(dtype)
    x = token_x.reshape(-1, he).to(cdt)
    cos, sin = rope_cos.reshape(-1, 1, dr).to(cdt), rope_sin.reshape(-1, 1, dr).to(cdt)
    c_q = _rms(x @ weight_dq.to(cdt), rmsnorm_gamma_cq.to(cdt), eps_cq)
    q = (c_q @ weight_uq_qr.to(cdt)).view(-1, n, d + dr)
    query = torch.einsum("tnd,ndh->tnh", q[..., :d], weight_uk.to(cdt))
    query_rope = deinterleaved_rope(q[..., d:], cos, sin)
    kv = x @ weight_dkv_kr.to(cdt)
    c_kv = _rms(kv[:, :hckv], rmsnorm_gamma_ckv.to(cdt), eps_ckv)
    k_rope = deinterleaved_rope(kv[:, None, hckv:], cos, sin)[:, 0]
    write_paged_latent(OP, rope_cache=kr_cache, latent_cache=kv_cache, index=cache_index.reshape(-1),
                       rope=k_rope.to(dtype), latent=c_kv.to(dtype), cache_mode=cache_mode)
    query_norm = c_q.to(dtype).view(*lead, hcq) if query_norm_flag else torch.zeros(1, dtype=dtype)
    return (query.to(dtype).view(*lead, n, hckv), query_rope.to(dtype).view(*lead, n, dr),
            torch.zeros(1, dtype=torch.float32), query_norm, torch.zeros(1, dtype=torch.float32))


def npu_mla_prolog_v3(
    token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq, rmsnorm_gamma_ckv, rope_sin,
    rope_cos, kv_cache, kr_cache, *, cache_index=None, dequant_scale_x=None, dequant_scale_w_dq=None,
    dequant_scale_w_uq_qr=None, dequant_scale_w_dkv_kr=None, quant_scale_ckv=None, quant_scale_ckr=None,
    smooth_scales_cq=None, actual_seq_len=None, k_nope_clip_alpha=None, rmsnorm_epsilon_cq=1e-05,
    rmsnorm_epsilon_ckv=1e-05, cache_mode="PA_BSND", query_norm_flag=False, weight_quant_mode=0,
    kv_cache_quant_mode=0, query_quant_mode=0, ckvkr_repo_mode=0, quant_scale_repo_mode=0, tile_size=128,
    qc_qr_scale=1.0, kc_scale=1.0,
):
    """``(query, query_rope, dequant_scale_q_nope, query_norm, dequant_scale_q_norm)``; writes the caches in
    place. ``actual_seq_len`` is documented as reserved (unused); ``tile_size`` matters only for per-tile
    quantization."""
    return mla_prolog_v3(
        token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq, rmsnorm_gamma_ckv,
        rope_sin, rope_cos, kv_cache, kr_cache, cache_index=cache_index, rmsnorm_epsilon_cq=rmsnorm_epsilon_cq,
        rmsnorm_epsilon_ckv=rmsnorm_epsilon_ckv, cache_mode=cache_mode, query_norm_flag=query_norm_flag,
        unemulated={"dequant_scale_x": dequant_scale_x, "dequant_scale_w_dq": dequant_scale_w_dq,
                    "dequant_scale_w_uq_qr": dequant_scale_w_uq_qr, "dequant_scale_w_dkv_kr": dequant_scale_w_dkv_kr,
                    "quant_scale_ckv": quant_scale_ckv, "quant_scale_ckr": quant_scale_ckr,
                    "smooth_scales_cq": smooth_scales_cq, "k_nope_clip_alpha": k_nope_clip_alpha},
        modes={"weight_quant_mode": weight_quant_mode, "kv_cache_quant_mode": kv_cache_quant_mode,
               "query_quant_mode": query_quant_mode, "ckvkr_repo_mode": ckvkr_repo_mode,
               "quant_scale_repo_mode": quant_scale_repo_mode},
        scales={"qc_qr_scale": qc_qr_scale, "kc_scale": kc_scale},
    )


OPS = {"npu_mla_prolog_v3": npu_mla_prolog_v3}
