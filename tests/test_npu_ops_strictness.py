"""Every call the device rejects is rejected by the emulation, naming the offending argument."""

from __future__ import annotations

import pytest
import torch
from model_infer_kvcache.analyzer.operators.fa_facts import keywords_of
from model_infer_kvcache.validators.npu_ops import NpuOpError, UnemulatedFeatureError, emulated

MASK = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
V1 = emulated.npu_fused_infer_attention_score
V2 = emulated.npu_fused_infer_attention_score_v2


def tnd(t=6, n=4, d=16):
    return torch.randn(t, n, d)


def paged(n_blocks=5, bs=16, h=32):
    return torch.randn(n_blocks, bs, h)


def decode_kwargs(**over):
    """A valid paged TND decode call (2 requests, 2 KV heads of 16, block 16)."""
    kw = dict(actual_seq_lengths=[1, 2], actual_seq_lengths_kv=[20, 9], num_heads=4, num_key_value_heads=2,
              input_layout="TND", block_table=torch.tensor([[1, 2], [3, 0]], dtype=torch.int32), block_size=16,
              sparse_mode=3, atten_mask=MASK)
    kw.update(over)
    return kw


def expect(argument, fn, *args, **kwargs):
    with pytest.raises(NpuOpError) as info:
        fn(*args, **kwargs)
    assert info.value.argument == argument, str(info.value)
    assert argument in str(info.value)
    return info.value


def test_valid_baseline_calls_pass():
    q = tnd(2)
    V1(q, paged(), paged(), **decode_kwargs())
    V2(q, paged(), paged(), actual_seq_qlen=[1, 2], actual_seq_kvlen=[20, 9], num_query_heads=4,
       num_key_value_heads=2, input_layout="TND", block_table=torch.tensor([[1, 2], [3, 0]], dtype=torch.int32),
       block_size=16, sparse_mode=3, atten_mask=MASK)


def test_gqa_ratio_above_64_is_refused():
    """Falcon-7B's 71 query heads on one KV head: one FA call cannot serve them (the Legacy path keeps the
    model's own attention instead)."""
    V1(tnd(2, n=64), paged(h=16), paged(h=16), **decode_kwargs(num_heads=64, num_key_value_heads=1))
    err = expect("num_key_value_heads", V1, tnd(2, n=71), paged(h=16), paged(h=16),
                 **decode_kwargs(num_heads=71, num_key_value_heads=1))
    assert "query/KV head ratio 71 exceeds 64" in str(err)


# --------------------------------------------------------------------------- masks
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_float_mask_rejected(dtype):
    q = tnd(2)
    expect("atten_mask", V1, q, paged(), paged(), **decode_kwargs(atten_mask=MASK.to(dtype)))
    b = torch.randn(1, 2, 4, 16)
    expect("atten_mask", V1, b, b, b, num_heads=2, input_layout="BNSD", atten_mask=torch.zeros(4, 4, dtype=dtype))


@pytest.mark.parametrize("shape", [(1024, 1024), (2, 2048, 2048), (2048, 1024)])
def test_compressed_mask_shape_must_be_2048(shape):
    q = tnd(2)
    expect("atten_mask", V1, q, paged(), paged(), **decode_kwargs(atten_mask=torch.ones(shape, dtype=torch.bool)))


def test_compressed_mask_required_and_must_be_causal_template():
    q = tnd(2)
    expect("atten_mask", V1, q, paged(), paged(), **decode_kwargs(atten_mask=None))
    expect("atten_mask", V1, q, paged(), paged(), **decode_kwargs(atten_mask=~MASK))  # tril passed by mistake
    V1(q, paged(), paged(), **decode_kwargs(atten_mask=MASK.view(1, 1, 2048, 2048).to(torch.int8)))


def test_mask_modified_in_place_after_a_good_call_is_rechecked():
    q = tnd(2)
    mask = MASK.clone()
    V1(q, paged(), paged(), **decode_kwargs(atten_mask=mask))
    mask[0, 1] = False  # no longer the causal template
    expect("atten_mask", V1, q, paged(), paged(), **decode_kwargs(atten_mask=mask))


def test_mode1_requires_full_mask():
    b = torch.randn(1, 2, 4, 16)
    expect("atten_mask", V1, b, b, b, num_heads=4, input_layout="BSND", sparse_mode=1)


def test_user_mask_too_small():
    b = torch.randn(1, 3, 2, 16)
    expect("atten_mask", V1, b, b, b, num_heads=2, input_layout="BSND",
           atten_mask=torch.zeros(3, 2, dtype=torch.bool))


# --------------------------------------------------------------------------- sparse modes / layouts
@pytest.mark.parametrize("mode", [5, 8, 9, -1])
def test_unsupported_sparse_modes(mode):
    b = torch.randn(1, 2, 4, 16)
    expect("sparse_mode", V1, b, b, b, num_heads=4, input_layout="BSND", sparse_mode=mode, atten_mask=MASK)


@pytest.mark.parametrize("mode,mask", [(1, torch.zeros(6, 6, dtype=torch.bool)), (2, MASK),
                                       (0, torch.zeros(6, 6, dtype=torch.bool))])
def test_packed_layout_modes(mode, mask):
    q = tnd()
    expect("sparse_mode", V1, q, q, q, actual_seq_lengths=[6], actual_seq_lengths_kv=[6], num_heads=4,
           input_layout="TND", sparse_mode=mode, atten_mask=mask)


def test_unknown_layout_and_rank():
    q = tnd()
    expect("input_layout", V1, q, q, q, actual_seq_lengths=[6], num_heads=4, input_layout="THD")
    expect("query", V1, q, q, q, num_heads=4, input_layout="BNSD")


def test_tnd_interception_rules():
    q = tnd()
    k = tnd(4)
    expect("actual_seq_lengths", V1, q, k, k, actual_seq_lengths=[6], actual_seq_lengths_kv=[4], num_heads=4,
           input_layout="TND", sparse_mode=3, atten_mask=MASK)
    q2 = tnd(4)
    expect("next_tokens", V1, q2, k, k, actual_seq_lengths=[4], actual_seq_lengths_kv=[4], num_heads=4,
           input_layout="TND", sparse_mode=4, atten_mask=MASK, pre_tokens=2, next_tokens=-3)
    expect("pre_tokens", V2, q2, k, k, actual_seq_qlen=[4], actual_seq_kvlen=[4], num_query_heads=4,
           input_layout="TND", sparse_mode=4, atten_mask=MASK, pre_tokens=-5, next_tokens=10)


# --------------------------------------------------------------------------- lengths
def test_cumulative_lengths_must_not_decrease():
    q = tnd()
    expect("actual_seq_lengths", V1, q, q, q, actual_seq_lengths=[4, 2, 6], actual_seq_lengths_kv=[4, 5, 6],
           num_heads=4, input_layout="TND")
    expect("actual_seq_qlen", V2, q, q, q, actual_seq_qlen=[3, 1], actual_seq_kvlen=[3, 6], num_query_heads=4,
           input_layout="TND")
    expect("actual_seq_lengths_kv", V1, q, q, q, actual_seq_lengths=[3, 6], actual_seq_lengths_kv=[5, 4],
           num_heads=4, input_layout="TND")
    expect("actual_seq_lengths", V1, q, q, q, actual_seq_lengths=[3, 7], actual_seq_lengths_kv=[3, 6],
           num_heads=4, input_layout="TND")  # past the 6 packed tokens


def test_packed_layout_requires_lengths():
    q = tnd()
    expect("actual_seq_lengths", V1, q, q, q, actual_seq_lengths_kv=[6], num_heads=4, input_layout="TND")
    expect("actual_seq_kvlen", V2, q, q, q, actual_seq_qlen=[6], num_query_heads=4, input_layout="TND")


def test_batch_layout_length_count():
    b = torch.randn(3, 4, 2, 16)
    expect("actual_seq_lengths", V1, b, b, b, actual_seq_lengths=[2, 3], num_heads=2, input_layout="BSND")
    expect("actual_seq_lengths_kv", V1, b, b, b, actual_seq_lengths_kv=[5], num_heads=2, input_layout="BSND")


def test_paged_path_requires_kv_lengths():
    q = tnd(2)
    expect("actual_seq_lengths_kv", V1, q, paged(), paged(), **decode_kwargs(actual_seq_lengths_kv=None))
    expect("actual_seq_kvlen", V2, q, paged(), paged(), actual_seq_qlen=[1, 2], num_query_heads=4,
           num_key_value_heads=2, input_layout="TND", block_size=16,
           block_table=torch.tensor([[1, 2], [3, 0]], dtype=torch.int32))


# --------------------------------------------------------------------------- heads
def test_heads_rules():
    q = tnd(2)
    expect("num_key_value_heads", V1, q, paged(h=48), paged(h=48), **decode_kwargs(num_key_value_heads=3))
    big = torch.randn(2, 130, 16)
    expect("num_key_value_heads", V1, big, paged(h=16), paged(h=16),
           **decode_kwargs(num_heads=130, num_key_value_heads=1))  # ratio 130 > 64
    expect("num_heads", V1, q, paged(), paged(), **decode_kwargs(num_heads=8, num_key_value_heads=2))
    expect("num_query_heads", V2, q, paged(), paged(), actual_seq_qlen=[1, 2], actual_seq_kvlen=[20, 9],
           input_layout="TND", block_size=16, block_table=torch.tensor([[1, 2], [3, 0]], dtype=torch.int32),
           )  # num_query_heads left at its default of 1 (e.g. after writing the v1 name)
    expect("num_heads", V1, q, paged(), paged(), **decode_kwargs(num_heads=0))


def test_dtype_mismatch():
    q = tnd(2)
    expect("key", V1, q, paged().half(), paged(), **decode_kwargs())


# --------------------------------------------------------------------------- block table / block size
def test_block_table_rules():
    q = tnd(2)
    table = torch.tensor([[1, 2], [3, 0]])
    expect("block_table", V1, q, paged(), paged(), **decode_kwargs(block_table=table))  # int64
    expect("block_table", V1, q, paged(), paged(), **decode_kwargs(block_table=table.int().view(-1)))  # 1-D
    expect("block_table", V1, q, paged(), paged(), **decode_kwargs(block_table=table.int()[:, :1]))  # narrow
    expect("block_table", V1, q, paged(), paged(), **decode_kwargs(block_table=table.int()[:1]))  # rows
    bad = torch.tensor([[1, 9], [3, 0]], dtype=torch.int32)
    expect("block_table", V1, q, paged(), paged(), **decode_kwargs(block_table=bad))  # no block 9


@pytest.mark.parametrize("bs,q_lens,ok", [(16, [1, 2], True), (8, [1, 2], False), (48, [1, 2], True),
                                         (16, [2, 4], False), (128, [2, 4], True), (256, [2, 4], True),
                                         (192, [2, 4], False), (640, [1, 2], False)])
def test_block_size_rules(bs, q_lens, ok):
    q = tnd(q_lens[-1])
    cache = torch.randn(4, bs, 32)
    kw = decode_kwargs(block_size=bs, actual_seq_lengths=q_lens, actual_seq_lengths_kv=[5, 9],
                       block_table=torch.tensor([[1], [2]], dtype=torch.int32))
    if ok:
        V1(q, cache, cache, **kw)
    else:
        expect("block_size", V1, q, cache, cache, **kw)


def test_block_size_must_match_cache_and_nz_rejects_16():
    q = tnd(2)
    expect("block_size", V1, q, paged(), paged(), **decode_kwargs(block_size=32))
    nz = torch.randn(5, 2, 1, 16, 16)
    expect("block_size", V1, q, nz, nz, **decode_kwargs())


def test_cache_form_rules():
    b = torch.randn(2, 1, 4, 16)
    four_d = torch.randn(5, 2, 16, 16)
    kw = dict(actual_seq_lengths_kv=[20, 9], num_heads=4, num_key_value_heads=2, block_size=16,
              block_table=torch.tensor([[1, 2], [3, 0]], dtype=torch.int32))
    expect("key", V1, b.view(2, 1, 64), four_d, four_d, input_layout="BSH", **kw)
    nz = torch.randn(5, 2, 1, 32, 16)
    expect("key", V1, b.transpose(1, 2).contiguous(), nz, nz, input_layout="BNSD",
           **dict(kw, block_size=32))
    expect("num_key_value_heads", V1, tnd(2), four_d, four_d, input_layout="TND", actual_seq_lengths=[1, 2],
           **dict(kw, num_key_value_heads=1))


# --------------------------------------------------------------------------- MLA rope split
def mla_kwargs(**over):
    kw = dict(actual_seq_qlen=[1, 2], actual_seq_kvlen=[20, 9], num_query_heads=2, num_key_value_heads=1,
              input_layout="TND_NTD", block_size=16, block_table=torch.tensor([[1, 2], [3, 0]], dtype=torch.int32),
              softmax_scale=0.04)
    kw.update(over)
    return kw


def test_mla_rope_rules():
    q, qr = torch.randn(2, 2, 512), torch.randn(2, 2, 64)
    k, kr = torch.randn(5, 16, 512), torch.randn(5, 16, 64)
    V2(q, k, k, query_rope=qr, key_rope=kr, **mla_kwargs())
    expect("key_rope", V2, q, k, k, query_rope=qr, **mla_kwargs())
    expect("query_rope", V2, q, k, k, key_rope=kr, **mla_kwargs())
    expect("query_rope", V2, q, k, k, query_rope=torch.randn(2, 2, 32), key_rope=kr, **mla_kwargs())
    expect("key_rope", V2, q, k, k, query_rope=qr, key_rope=torch.randn(5, 16, 32), **mla_kwargs())
    expect("query", V2, torch.randn(2, 2, 256), torch.randn(5, 16, 256), torch.randn(5, 16, 256),
           query_rope=qr, key_rope=kr, **mla_kwargs())
    k2, kr2 = torch.randn(5, 16, 1024), torch.randn(5, 16, 128)
    expect("num_key_value_heads", V2, q, k2, k2, query_rope=qr, key_rope=kr2,
           **mla_kwargs(num_key_value_heads=2))


def test_mla_query_head_counts():
    k, kr = torch.randn(5, 16, 512), torch.randn(5, 16, 64)
    V2(torch.randn(2, 128, 512), k, k, query_rope=torch.randn(2, 128, 64), key_rope=kr,
       **mla_kwargs(num_query_heads=128))  # 128 heads over one latent head: beyond the GQA cap of 64
    expect("num_query_heads", V2, torch.randn(2, 3, 512), k, k, query_rope=torch.randn(2, 3, 64), key_rope=kr,
           **mla_kwargs(num_query_heads=3))


def test_mla_sparse_mode_and_head_dim_128_paging():
    b, br = torch.randn(1, 2, 2, 512), torch.randn(1, 2, 2, 64)
    expect("sparse_mode", V1, b, b[:, :, :1], b[:, :, :1], query_rope=br, key_rope=br[:, :, :1], num_heads=2,
           num_key_value_heads=1, input_layout="BSND", sparse_mode=2, atten_mask=MASK)
    q, qr = torch.randn(2, 2, 128), torch.randn(2, 2, 64)
    k, kr = torch.randn(5, 16, 256), torch.randn(5, 16, 128)
    expect("block_table", V2, q, k, k, query_rope=qr, key_rope=kr,
           **mla_kwargs(num_key_value_heads=2, input_layout="TND"))


# --------------------------------------------------------------------------- sinks, names, not emulated
def test_sink_rules():
    q = tnd()
    kw = dict(actual_seq_qlen=[6], actual_seq_kvlen=[6], num_query_heads=4, input_layout="TND")
    V2(q, q, q, learnable_sink=torch.zeros(4), **kw)
    expect("learnable_sink", V2, q, q, q, learnable_sink=torch.zeros(3), **kw)
    b = torch.randn(1, 6, 4, 16)
    expect("learnable_sink", V2, b, b, b, learnable_sink=torch.zeros(4), num_query_heads=4, input_layout="BSND")
    wide = tnd(d=192)  # value D 192 > 128
    expect("learnable_sink", V2, wide, wide, wide, learnable_sink=torch.zeros(4), **kw)
    V2(wide, wide, tnd(d=128), learnable_sink=torch.zeros(4), **kw)  # MiMo-V2-Flash's K_D 192 / V_D 128 takes sinks


def test_value_head_dim_rules():
    """A value head dim other than the key's: only the documented TND pair (K_D 192 / V_D 128), and only under the
    device reading value_head_dim=documented_pairs (the docs also require identical K/V shapes)."""
    from dataclasses import replace

    from model_infer_kvcache.validators.npu_ops import DeviceReadings, device_readings

    kw = dict(actual_seq_qlen=[6], actual_seq_kvlen=[6], num_query_heads=4, input_layout="TND")
    wide, narrow = tnd(d=192), tnd(d=128)
    out, _ = V2(wide, wide, narrow, **kw)
    assert out.shape == (6, 4, 128)
    expect("value", V2, tnd(), tnd(), tnd(d=256), **kw)  # an undocumented pair
    expect("value", V2, wide, wide, tnd(d=64), **kw)
    bsnd = dict(num_query_heads=4, input_layout="BSND")
    expect("value", V2, wide.view(1, 6, 4, 192), wide.view(1, 6, 4, 192), narrow.view(1, 6, 4, 128), **bsnd)
    with device_readings(replace(DeviceReadings(), value_head_dim="equal_only")):
        expect("value", V2, wide, wide, narrow, **kw)


def test_v1_names_on_v2_and_reverse_are_type_errors():
    q = tnd()
    with pytest.raises(TypeError, match="scale"):
        V2(q, q, q, scale=0.1, actual_seq_qlen=[6], actual_seq_kvlen=[6], num_query_heads=4, input_layout="TND")
    with pytest.raises(TypeError, match="num_query_heads"):
        V1(q, q, q, num_query_heads=4, actual_seq_lengths=[6], actual_seq_lengths_kv=[6], input_layout="TND")
    with pytest.raises(TypeError, match="learnable_sink"):
        V1(q, q, q, learnable_sink=torch.zeros(4), actual_seq_lengths=[6], num_heads=4, input_layout="TND")
    with pytest.raises(TypeError):  # keyword-only arguments cannot be passed positionally
        V1(q, q, q, None, None)


@pytest.mark.parametrize("fn,name", [(V1, "pse_shift"), (V1, "antiquant_scale"), (V1, "kv_padding_size"),
                                     (V2, "dequant_scale_key"), (V2, "quant_scale_out")])
def test_unemulated_features_refuse(fn, name):
    q = tnd()
    kw = {keywords_of(fn.__name__).num_heads: 4}
    with pytest.raises(UnemulatedFeatureError) as info:
        fn(q, q, q, input_layout="TND", **{name: torch.zeros(1)}, **kw)
    assert info.value.argument == name
