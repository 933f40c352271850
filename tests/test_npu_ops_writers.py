"""Cache writers: scatter_nd_update, scatter_update, kv_rmsnorm_rope_cache (+ NZ consistency with FA)."""

from __future__ import annotations

import math

import pytest
import torch
from model_infer_kvcache.validators.npu_ops import NpuOpError, UnemulatedFeatureError, emulated, nz_view
from test_npu_ops_reference import MASK_2048, ref_attention  # tests/ is on sys.path (not a package)


def expect(argument, fn, *args, **kwargs):
    with pytest.raises(NpuOpError) as info:
        fn(*args, **kwargs)
    assert info.value.argument == argument, str(info.value)


# --------------------------------------------------------------------------- scatter_nd_update
def test_scatter_nd_update_paged_slots_in_place():
    bn, bs, n_kv, d = 4, 8, 2, 16
    cache = torch.zeros(bn, bs, n_kv, d)
    slots = torch.tensor([9, 10, 31], dtype=torch.int32)
    states = torch.randn(3, n_kv, d)
    out = emulated.npu_scatter_nd_update_(cache.view(-1, n_kv, d), slots.view(-1, 1), states)
    assert out.data_ptr() == cache.data_ptr()
    for i, slot in enumerate(slots.tolist()):
        assert torch.equal(cache[slot // bs, slot % bs], states[i])
    assert int(torch.count_nonzero(cache.abs().sum(dim=(2, 3)))) == 3


def test_scatter_nd_update_out_of_place_and_depth_two():
    data = torch.zeros(3, 4, 5)
    idx = torch.tensor([[0, 1], [2, 3]])
    upd = torch.ones(2, 5)
    out = emulated.npu_scatter_nd_update(data, idx, upd)
    assert torch.count_nonzero(data) == 0
    assert out[0, 1].sum() == 5 and out[2, 3].sum() == 5 and out.sum() == 10


def test_scatter_nd_update_rejections():
    data = torch.zeros(4, 2, 3)
    ok_upd = torch.ones(2, 2, 3)
    expect("indices", emulated.npu_scatter_nd_update_, data, torch.tensor([1, 2]), ok_upd)  # 1-D
    expect("indices", emulated.npu_scatter_nd_update_, data, torch.tensor([[1.0], [2.0]]), ok_upd)
    expect("indices", emulated.npu_scatter_nd_update_, data, torch.tensor([[1], [4]]), ok_upd)  # out of range
    expect("updates", emulated.npu_scatter_nd_update_, data, torch.tensor([[1], [2]]), torch.ones(2, 3))
    expect("updates", emulated.npu_scatter_nd_update_, data, torch.tensor([[1], [2]]), ok_upd.half())


# --------------------------------------------------------------------------- scatter_update
def test_scatter_update_legacy_bsh_cache():
    cache = torch.zeros(3, 10, 8)  # [B, S_max, H]
    kv_len = torch.tensor([0, 4, 7])
    states = torch.randn(3, 2, 8)
    out = emulated.scatter_update_(cache, kv_len, states, 1)
    assert out is cache
    for b, start in enumerate(kv_len.tolist()):
        assert torch.equal(cache[b, start:start + 2], states[b])
    assert int(torch.count_nonzero(cache.abs().sum(-1))) == 6


def test_scatter_update_bnsd_axis_minus_two_and_out_of_place():
    data = torch.zeros(2, 1, 6, 4)
    upd = torch.randn(2, 1, 1, 4)
    out = emulated.scatter_update(data, torch.tensor([5, 2], dtype=torch.int32), upd, -2)
    assert torch.count_nonzero(data) == 0
    assert torch.equal(out[0, 0, 5], upd[0, 0, 0]) and torch.equal(out[1, 0, 2], upd[1, 0, 0])


def test_scatter_update_rejections():
    data = torch.zeros(2, 6, 4)
    upd = torch.ones(2, 2, 4)
    expect("axis", emulated.scatter_update_, data, torch.tensor([0, 1]), upd, 0)
    expect("indices", emulated.scatter_update_, data, torch.tensor([0, 5]), upd, 1)  # 5 + 2 > 6
    expect("updates", emulated.scatter_update_, data, torch.tensor([0, 1]), torch.ones(2, 2, 4, 1), 1)
    expect("indices", emulated.scatter_update_, data, torch.tensor([0, 1, 2]), upd, 1)
    with pytest.raises(UnemulatedFeatureError):
        emulated.scatter_update_(data, torch.tensor([[0, 1], [1, 2]]), upd, 1)


# --------------------------------------------------------------------------- kv_rmsnorm_rope_cache
def ref_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved rope, element by element: lanes (2i, 2i+1) rotate into (i, i + D/2)."""
    half = x.shape[-1] // 2
    y = torch.empty_like(x, dtype=torch.float64)
    for i in range(half):
        a, b = x[..., 2 * i].double(), x[..., 2 * i + 1].double()
        y[..., i] = a * cos[..., i] - b * sin[..., i]
        y[..., half + i] = b * cos[..., half + i] + a * sin[..., half + i]
    return y


def ref_rms(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * gamma.double()


def mla_inputs(tokens, dv=32, dk=16, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(tokens, 1, 1, dv + dk, generator=gen).to(dtype)
    gamma = (torch.rand(dv, generator=gen) + 0.5).to(dtype)
    angle = torch.rand(tokens, 1, 1, dk, generator=gen) * 3
    return kv, gamma, angle.cos().to(dtype), angle.sin().to(dtype)


@pytest.mark.parametrize("mode", ["PA", "PA_BNSD", "PA_NZ"])
def test_kv_rmsnorm_rope_cache_paged_modes(mode):
    bn, bs, dv, dk, eps = 4, 16, 32, 16, 1e-6
    kv, gamma, cos, sin = mla_inputs(5, dv, dk)
    k_cache = torch.full((bn, bs, 1, dk), math.nan)  # rope cache
    ckv_cache = torch.full((bn, bs, 1, dv), math.nan)  # nope / latent cache
    slots = torch.tensor([17, 18, -1, 40, 3])
    out = emulated.npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, slots, k_cache, ckv_cache, epsilon=eps,
                                             cache_mode=mode, is_output_kv=True)
    assert len(out) == 4 and out[0] is k_cache and out[1] is ckv_cache
    rope = ref_rope(kv[..., dv:], cos.double(), sin.double())
    norm = ref_rms(kv[..., :dv], gamma, eps)
    assert torch.allclose(out[2].double(), rope, atol=1e-6) and torch.allclose(out[3].double(), norm, atol=1e-6)
    nd_k = nz_view(k_cache) if mode == "PA_NZ" else None
    nd_c = nz_view(ckv_cache) if mode == "PA_NZ" else None
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        blk, off = divmod(slot, bs)
        if mode == "PA_NZ":
            got_k = torch.stack([nd_k[blk, 0, d // 16, off, d % 16] for d in range(dk)])
            got_c = torch.stack([nd_c[blk, 0, d // 16, off, d % 16] for d in range(dv)])
        else:
            got_k, got_c = k_cache[blk, off, 0], ckv_cache[blk, off, 0]
        assert torch.allclose(got_k.double(), rope[t, 0, 0], atol=1e-6)
        assert torch.allclose(got_c.double(), norm[t, 0, 0], atol=1e-6)
    assert int(torch.isfinite(k_cache).sum()) == 4 * dk  # skipped token (-1) wrote nothing


def test_kv_rmsnorm_rope_cache_norm_mode_and_v2_and_v_input():
    b, s, dv, dk = 2, 3, 32, 16
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn(b, 1, s, dv + dk, generator=gen)
    gamma = torch.rand(dv, generator=gen) + 0.5
    cos, sin = torch.rand(b, 1, s, dk, generator=gen), torch.rand(b, 1, s, dk, generator=gen)
    k_cache, ckv_cache = torch.zeros(b, 1, 8, dk), torch.zeros(b, 1, 8, dv)
    index = torch.tensor([[0, 1, 2], [5, -1, 7]])
    k_rope, c_kv = emulated.npu_kv_rmsnorm_rope_cache_v2(kv, gamma, cos, sin, index, k_cache, ckv_cache,
                                                         cache_mode="Norm", is_output_kv=True)
    rope = ref_rope(kv[..., dv:], cos.double(), sin.double())
    assert torch.allclose(k_cache[1, 0, 7].double(), rope[1, 0, 2], atol=1e-6)
    assert torch.count_nonzero(k_cache[1, 0, 6]) == 0 and torch.allclose(k_rope.double(), rope, atol=1e-6)
    assert torch.allclose(ckv_cache[0, 0, 2].double(), ref_rms(kv[0, 0, 2, :dv], gamma, 1e-5), atol=1e-6)
    # separate v: kv is all rope, v all norm
    k_cache2, ckv_cache2 = torch.zeros(b, 1, 8, dk), torch.zeros(b, 1, 8, dv)
    emulated.npu_kv_rmsnorm_rope_cache(kv[..., dv:].contiguous(), gamma, cos, sin, index, k_cache2, ckv_cache2,
                                       v=kv[..., :dv].contiguous(), cache_mode="Norm")
    assert torch.allclose(k_cache2, k_cache) and torch.allclose(ckv_cache2, ckv_cache)
    assert c_kv.shape == (b, 1, s, dv)


def test_kv_rmsnorm_rope_cache_outputs_undefined_without_is_output_kv():
    kv, gamma, cos, sin = mla_inputs(2)
    k_cache, ckv_cache = torch.zeros(2, 16, 1, 16), torch.zeros(2, 16, 1, 32)
    _, _, k_rope, c_kv = emulated.npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, torch.tensor([0, 1]), k_cache,
                                                            ckv_cache, cache_mode="PA")
    assert torch.isnan(k_rope).all() and torch.isnan(c_kv).all()
    assert torch.isfinite(k_cache[0, :2]).all() and torch.count_nonzero(k_cache[0, :2]) > 0


def test_kv_rmsnorm_rope_cache_blk_mode():
    bs, dv, dk = 16, 32, 16
    gen = torch.Generator().manual_seed(2)
    kv = torch.randn(1, 1, 20, dv + dk, generator=gen)
    gamma = torch.ones(dv)
    cos, sin = torch.ones(1, 1, 20, dk), torch.zeros(1, 1, 20, dk)
    k_cache, ckv_cache = torch.zeros(4, bs, 1, dk), torch.zeros(4, bs, 1, dv)
    index = torch.tensor([3 * bs, 1 * bs])  # block starts for tokens 0-15 and 16-19
    emulated.npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, cache_mode="PA_BLK_BNSD")
    rope = ref_rope(kv[..., dv:], cos.double(), sin.double())
    assert torch.allclose(k_cache[3, 5, 0].double(), rope[0, 0, 5], atol=1e-6)
    assert torch.allclose(k_cache[1, 3, 0].double(), rope[0, 0, 19], atol=1e-6)


def test_kv_rmsnorm_rope_cache_bfloat16():
    kv, gamma, cos, sin = mla_inputs(3, dtype=torch.bfloat16)
    k_cache = torch.zeros(2, 16, 1, 16, dtype=torch.bfloat16)
    ckv_cache = torch.zeros(2, 16, 1, 32, dtype=torch.bfloat16)
    _, _, k_rope, c_kv = emulated.npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, torch.tensor([0, 1, 2]),
                                                            k_cache, ckv_cache, cache_mode="PA_NZ",
                                                            is_output_kv=True)
    assert k_rope.dtype == torch.bfloat16
    assert torch.allclose(c_kv.double(), ref_rms(kv[..., :32], gamma, 1e-5), atol=2e-2)


def test_kv_rmsnorm_rope_cache_rejections():
    kv, gamma, cos, sin = mla_inputs(2)
    kc, cc = torch.zeros(2, 16, 1, 16), torch.zeros(2, 16, 1, 32)
    idx = torch.tensor([0, 1])
    fn = emulated.npu_kv_rmsnorm_rope_cache
    expect("kv", fn, kv[:, 0], gamma, cos, sin, idx, kc, cc, cache_mode="PA")
    expect("kv", fn, kv.expand(2, 2, 1, 48), gamma, cos, sin, idx, kc, cc, cache_mode="PA")  # N must be 1
    expect("kv", fn, kv, gamma[:16], cos, sin, idx, kc, cc, cache_mode="PA")  # Dv + Dk != D
    expect("index", fn, kv, gamma, cos, sin, idx.int(), kc, cc, cache_mode="PA")
    expect("index", fn, kv, gamma, cos, sin, torch.tensor([19, 19]), kc, cc, cache_mode="PA")  # repeated outside block 0
    expect("index", fn, kv, gamma, cos, sin, torch.tensor([0, 32]), kc, cc, cache_mode="PA")  # past the cache
    expect("cache_mode", fn, kv, gamma, cos, sin, idx, kc, cc, cache_mode="PA_ND")
    expect("k_cache", fn, kv, gamma, cos, sin, idx, kc.half(), cc, cache_mode="PA")
    expect("sin", fn, kv, gamma, cos, sin[..., :8], idx, kc, cc, cache_mode="PA")
    with pytest.raises(UnemulatedFeatureError) as info:
        fn(kv, gamma, cos, sin, idx, kc, cc, c_kv_scale=torch.ones(1), cache_mode="PA")
    assert info.value.argument == "c_kv_scale"


# --------------------------------------------------------------------------- writer -> FA round trip
def _mla_round_trip(write_mode: str, read_nz: bool):
    """Write an MLA cache with the fused writer, decode with FA v2 reading ND or NZ views."""
    bn, bs, dv, dk, heads = 3, 128, 512, 64, 2
    tokens = 70
    kv, gamma, cos, sin = mla_inputs(tokens, dv, dk, seed=3)
    nope = torch.zeros(bn, bs, 1, dv)
    rope = torch.zeros(bn, bs, 1, dk)
    table = torch.tensor([[2]], dtype=torch.int32)
    slots = 2 * bs + torch.arange(tokens)
    _, _, k_rope, c_kv = emulated.npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, slots, rope, nope,
                                                            cache_mode=write_mode, is_output_kv=True)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, heads, dv, generator=gen)
    q_rope = torch.randn(1, heads, dk, generator=gen)
    if read_nz:
        key, key_rope = nz_view(nope), nz_view(rope)
    else:
        key, key_rope = nope.view(bn, bs, dv), rope.view(bn, bs, dk)
    out, _ = emulated.npu_fused_infer_attention_score_v2(
        q, key, key, query_rope=q_rope, key_rope=key_rope, actual_seq_qlen=[1], actual_seq_kvlen=[tokens],
        block_table=table, num_query_heads=heads, num_key_value_heads=1, softmax_scale=0.04,
        input_layout="TND_NTD", block_size=bs, sparse_mode=0)
    latent = c_kv.view(tokens, 1, dv)
    ref, _ = ref_attention(q, latent, latent, scale=0.04, q_rope=q_rope, k_rope=k_rope.view(tokens, 1, dk))
    return float((out.transpose(0, 1).double() - ref).abs().max())


def test_nz_written_nz_read_matches_and_mixing_arrangements_does_not():
    assert _mla_round_trip("PA_NZ", read_nz=True) <= 1e-5
    assert _mla_round_trip("PA", read_nz=False) <= 1e-5
    assert _mla_round_trip("PA_NZ", read_nz=False) > 1e-2  # NZ data read as ND: wrong, as on device
    assert _mla_round_trip("PA", read_nz=True) > 1e-2  # ND data read as NZ: wrong


def test_gqa_scatter_nd_update_then_paged_decode():
    # The standard paged GQA write (npu_scatter_nd_update_) feeding a TND decode.
    bn, bs, n_kv, d, heads = 4, 16, 2, 16, 4
    k_cache = torch.full((bn, bs, n_kv, d), math.nan)
    v_cache = torch.full((bn, bs, n_kv, d), math.nan)
    gen = torch.Generator().manual_seed(5)
    keys, values = torch.randn(20, n_kv, d, generator=gen), torch.randn(20, n_kv, d, generator=gen)
    table = torch.tensor([[3, 1]], dtype=torch.int32)
    slots = torch.tensor([int(table[0, p // bs]) * bs + p % bs for p in range(20)])
    emulated.npu_scatter_nd_update_(k_cache.view(-1, n_kv, d), slots.view(-1, 1), keys)
    emulated.npu_scatter_nd_update_(v_cache.view(-1, n_kv, d), slots.view(-1, 1), values)
    q = torch.randn(1, heads, d, generator=gen)
    out, _ = emulated.npu_fused_infer_attention_score(
        q, k_cache.view(bn, bs, -1), v_cache.view(bn, bs, -1), atten_mask=MASK_2048, actual_seq_lengths=[1],
        actual_seq_lengths_kv=[20], block_table=table, block_size=bs, num_heads=heads, num_key_value_heads=n_kv,
        scale=0.25, input_layout="TND", sparse_mode=3)
    ref, _ = ref_attention(q, keys, values, scale=0.25, mode=3)
    assert float((out.double() - ref).abs().max()) <= 1e-5


def test_repeated_slots_only_in_the_null_block():
    # Padded decode rows all write slot 0 of the null block (block 0): legal; repeats elsewhere are not.
    kv, gamma, cos, sin = mla_inputs(3)
    kc, cc = torch.zeros(2, 16, 1, 16), torch.zeros(2, 16, 1, 32)
    emulated.npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, torch.tensor([17, 0, 0]), kc, cc, cache_mode="PA")
    assert torch.count_nonzero(kc[1, 1]) > 0  # the real row was written
    expect("index", emulated.npu_kv_rmsnorm_rope_cache, kv, gamma, cos, sin, torch.tensor([17, 17, 0]), kc, cc,
           cache_mode="PA")
