"""npu_mla_prolog_v3 against an independent reference (transformers' DeepSeek-V3 MLA pieces), its cache writes
against npu_kv_rmsnorm_rope_cache_v2 (the same write rules), and its documented argument rules; copy experts of
the single-rank MoE dispatch / combine."""

from __future__ import annotations

import pytest
import torch
from model_infer_kvcache.validators.npu_ops.emulated import OPS
from model_infer_kvcache.validators.npu_ops.errors import NpuOpError, UnemulatedFeatureError

T, HE, HCQ, N, D, DR, HCKV, BS, BN = 5, 96, 48, 2, 128, 64, 512, 16, 4


def _inputs(seed=0, cache_mode="PA_BSND"):
    g = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=g) * 0.2

    pos = torch.arange(T, dtype=torch.float32)
    inv = 1.0 / (10000 ** (torch.arange(0, DR, 2, dtype=torch.float32) / DR))
    freqs = torch.outer(pos, inv)
    emb = torch.cat([freqs, freqs], -1)
    return dict(token_x=r(T, HE), weight_dq=r(HE, HCQ), weight_uq_qr=r(HCQ, N * (D + DR)), weight_uk=r(N, D, HCKV),
                weight_dkv_kr=r(HE, HCKV + DR), rmsnorm_gamma_cq=1 + r(HCQ), rmsnorm_gamma_ckv=1 + r(HCKV),
                rope_sin=emb.sin(), rope_cos=emb.cos(), kv_cache=torch.zeros(BN, BS, 1, HCKV),
                kr_cache=torch.zeros(BN, BS, 1, DR), cache_index=torch.tensor([17, 18, 19, 33, 2]),
                cache_mode=cache_mode)


def _rms(x, g, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g


def _call(kw, **extra):
    args = dict(kw)
    pos = [args.pop(k) for k in ("token_x", "weight_dq", "weight_uq_qr", "weight_uk", "weight_dkv_kr",
                                 "rmsnorm_gamma_cq", "rmsnorm_gamma_ckv", "rope_sin", "rope_cos", "kv_cache",
                                 "kr_cache")]
    return OPS["npu_mla_prolog_v3"](*pos, **args, **extra)


def test_matches_transformers_deepseek_v3_mla():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    kw = _inputs()
    query, query_rope, dq, qn, dqn = _call(kw, query_norm_flag=True)
    x = kw["token_x"]
    cq = _rms(x @ kw["weight_dq"], kw["rmsnorm_gamma_cq"])
    q = (cq @ kw["weight_uq_qr"]).view(T, N, D + DR)
    want_query = torch.einsum("tnd,ndh->tnh", q[..., :D], kw["weight_uk"])
    kv = x @ kw["weight_dkv_kr"]
    cos, sin = kw["rope_cos"][None], kw["rope_sin"][None]  # [1, T, Dr]
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q[..., D:].transpose(0, 1)[None], kv[None, None, :, HCKV:],
                                                   cos, sin)
    torch.testing.assert_close(query, want_query, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(query_rope, q_rot[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(qn, cq, rtol=1e-5, atol=1e-5)  # query_norm_flag: the normalised c_q
    assert dq.shape == (1,) and dqn.shape == (1,)
    slots = kw["cache_index"]
    torch.testing.assert_close(kw["kv_cache"].view(-1, HCKV)[slots], _rms(kv[:, :HCKV], kw["rmsnorm_gamma_ckv"]))
    torch.testing.assert_close(kw["kr_cache"].view(-1, DR)[slots], k_rot[0, 0], rtol=1e-5, atol=1e-5)
    untouched = torch.ones(BN * BS, dtype=torch.bool)
    untouched[slots] = False
    assert not kw["kv_cache"].view(-1, HCKV)[untouched].any()  # nothing else written


def test_cache_writes_equal_kv_rmsnorm_rope_cache_v2_in_nz_mode():
    kw = _inputs(cache_mode="PA_NZ")
    _call(kw)
    kv = kw["token_x"] @ kw["weight_dkv_kr"]
    k_cache, ckv_cache = torch.zeros(BN, BS, 1, DR), torch.zeros(BN, BS, 1, HCKV)
    OPS["npu_kv_rmsnorm_rope_cache_v2"](kv.view(T, 1, 1, -1), kw["rmsnorm_gamma_ckv"], kw["rope_cos"].view(T, 1, 1, DR),
                                        kw["rope_sin"].view(T, 1, 1, DR), kw["cache_index"], k_cache, ckv_cache,
                                        cache_mode="PA_NZ")
    torch.testing.assert_close(kw["kr_cache"], k_cache, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kw["kv_cache"], ckv_cache, rtol=1e-5, atol=1e-5)
    # negative control: the NZ arrangement is not the ND one
    nd = _inputs(cache_mode="PA_BSND")
    _call(nd)
    assert not torch.equal(nd["kv_cache"], kw["kv_cache"])


@pytest.mark.parametrize("change, arg, error", [
    (dict(weight_uk=torch.zeros(N, 64, HCKV)), "weight_uk", NpuOpError),  # D must be 128
    (dict(weight_dkv_kr=torch.zeros(HE, HCKV)), "weight_dkv_kr", NpuOpError),  # no rope lanes
    (dict(kv_cache=torch.zeros(BN, 32, 1, HCKV), kr_cache=torch.zeros(BN, 32, 1, DR)), "kv_cache", NpuOpError),
    (dict(cache_index=torch.tensor([1, 2, 3, 4, 5], dtype=torch.int32)), "cache_index", NpuOpError),
    (dict(cache_index=None), "cache_index", NpuOpError),
    (dict(cache_mode="PA_BNSD"), "cache_mode", NpuOpError),
    (dict(rope_sin=torch.zeros(T, 32)), "rope_sin", NpuOpError),
    (dict(weight_dq=torch.zeros(HE, HCQ, dtype=torch.float16)), "weight_dq", NpuOpError),
])
def test_documented_argument_rules(change, arg, error):
    kw = {**_inputs(), **change}
    with pytest.raises(error, match=f"npu_mla_prolog_v3: argument '{arg}'"):
        _call(kw)


@pytest.mark.parametrize("extra, arg", [
    (dict(dequant_scale_x=torch.ones(T, 1)), "dequant_scale_x"),
    (dict(weight_quant_mode=1), "weight_quant_mode"),
    (dict(kv_cache_quant_mode=3), "kv_cache_quant_mode"),
    (dict(qc_qr_scale=2.0), "qc_qr_scale"),
])
def test_quantization_and_scale_corrections_are_refused_not_ignored(extra, arg):
    with pytest.raises(UnemulatedFeatureError, match=f"argument '{arg}'"):
        _call(_inputs(), **extra)


def test_copy_experts_pass_the_token_through_combine():
    """LongCat-Flash's identity experts (ids >= moe_expert_num, copy_expert_num of them): not dispatched,
    combined as expert_scales * ori_x."""
    dispatch, combine = OPS["npu_moe_distribute_dispatch_v2"], OPS["npu_moe_distribute_combine_v2"]
    x = torch.randn(3, 8)
    ids = torch.tensor([[0, 4], [5, 1], [1, 2]], dtype=torch.int32)  # 4 routed experts, ids 4-5 copy experts
    scales = torch.rand(3, 2)
    expand_x, _, expand_idx, counts, recv, *_ = dispatch(x, ids, "g", 1, 0, 4, copy_expert_num=2)
    assert counts.tolist() == [1, 2, 1, 0] and int(counts.sum()) == 4  # only routed copies are sent
    expert_out = expand_x * 3.0  # stand-in for the experts' computation
    out = combine(expert_out, ids, expand_idx, recv, scales, "g", 1, 0, 4, copy_expert_num=2, ori_x=x)
    routed = {(i, k) for i in range(3) for k in range(2) if ids[i, k] < 4}
    want = torch.stack([sum(scales[i, k] * (3.0 * x[i] if (i, k) in routed else x[i]) for k in range(2))
                        for i in range(3)])
    torch.testing.assert_close(out, want)
    with pytest.raises(NpuOpError, match="argument 'ori_x'"):
        combine(expert_out, ids, expand_idx, recv, scales, "g", 1, 0, 4, copy_expert_num=2)
    with pytest.raises(NpuOpError, match="argument 'expert_ids'"):  # without copy experts, id 4 is out of range
        dispatch(x, ids, "g", 1, 0, 4)
