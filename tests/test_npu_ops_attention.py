"""Emulated FA v1/v2 against the independent float64 reference (max abs error <= 1e-5 in float32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from model_infer_kvcache.validators.npu_ops import emulated, fa_core
from model_infer_kvcache.validators.npu_ops.errors import NpuOpError

# tests/ is not a package: pytest puts its directory on sys.path.
from test_npu_ops_reference import (
    INT_MAX,
    MASK_2048,
    build_paged,
    from_out_layout,
    make_case,
    max_err,
    pack,
    pad,
    split_packed,
    split_padded,
    to_batch_layout,
)

TOL = 1e-5
PACKED = {"TND": ("TND", "TND"), "NTD": ("NTD", "NTD"), "NTD_TND": ("NTD", "TND"), "TND_NTD": ("TND", "NTD")}
BATCH = {"BSH": ("BSH", "BSH"), "BSND": ("BSND", "BSND"), "BNSD": ("BNSD", "BNSD"), "NSD": ("NSD", "NSD"),
         "BNSD_BSND": ("BNSD", "BSND"), "BSH_BNSD": ("BSH", "BNSD"), "BSND_BNSD": ("BSND", "BNSD"),
         "BSH_NBSD": ("BSH", "NBSD"), "BSND_NBSD": ("BSND", "NBSD"), "BNSD_NBSD": ("BNSD", "NBSD")}


def run(case, *, version=1, layout="TND", scale=0.25, mode=0, pre=INT_MAX, nxt=INT_MAX, paged=None,
        user_mask=None, lse=True, actual_q=None):
    """Call the emulated op on ``case``; returns per-request (outputs, lses)."""
    packed = layout in PACKED
    q_layout, out_layout = (PACKED if packed else BATCH)[layout]

    def as_query(tensors):
        if packed:
            t, _ = pack(tensors)
            return t if q_layout == "TND" else t.transpose(0, 1).contiguous()
        return to_batch_layout(pad(tensors), q_layout)

    def as_kv(tensors):
        if packed:
            t, _ = pack(tensors)
            return t if q_layout == "TND" else t.transpose(0, 1).contiguous()
        return to_batch_layout(pad(tensors), q_layout)

    query = as_query(case.q)
    query_rope = as_query(case.q_rope) if case.q_rope is not None else None
    if paged is not None:
        key, value, key_rope = paged.k, paged.v, paged.k_rope
    else:
        key = as_kv(case.k)
        value = key if case.v is case.k else as_kv(case.v)
        key_rope = as_kv(case.k_rope) if case.k_rope is not None else None
    if packed:
        q_arg = pack(case.q)[1] if actual_q is None else actual_q
        kv_arg = case.kv_lens if paged is not None else pack(case.k)[1]
    else:
        q_arg = case.q_lens if actual_q is None else actual_q
        kv_arg = case.kv_lens
    mask = MASK_2048 if mode in (2, 3, 4) else user_mask
    common = dict(query_rope=query_rope, key_rope=key_rope, atten_mask=mask,
                  block_table=None if paged is None else paged.table, pre_tokens=pre, next_tokens=nxt,
                  input_layout=layout, sparse_mode=mode, num_key_value_heads=case.num_kv,
                  block_size=0 if paged is None else paged.block_size)
    if version == 1:
        out, lse_out = emulated.npu_fused_infer_attention_score(
            query, key, value, actual_seq_lengths=q_arg, actual_seq_lengths_kv=kv_arg, num_heads=case.num_heads,
            scale=scale, softmax_lse_flag=lse, **common)
    else:
        out, lse_out = emulated.npu_fused_infer_attention_score_v2(
            query, key, value, actual_seq_qlen=q_arg, actual_seq_kvlen=kv_arg, num_query_heads=case.num_heads,
            softmax_scale=scale, return_softmax_lse=lse, learnable_sink=case.sinks, **common)
    assert out.dtype == case.q[0].dtype
    canon = from_out_layout(out, out_layout, case.num_heads)
    if packed:
        outs = split_packed(canon, case.q_lens)
        lses = split_packed(lse_out[..., 0], case.q_lens) if lse else None
    else:
        outs = split_padded(canon, case.q_lens)
        lses = split_padded(lse_out[..., 0].transpose(1, 2), case.q_lens) if lse else None
    return outs, lses


def check(case, *, scale=0.25, mode=0, pre=INT_MAX, nxt=INT_MAX, tol=TOL, user_masks=None, **kwargs):
    outs, lses = run(case, scale=scale, mode=mode, pre=pre, nxt=nxt, **kwargs)
    ref_out, ref_lse = case.reference(scale=scale, mode=mode, pre=pre, nxt=nxt, user_masks=user_masks)
    assert max_err(outs, ref_out) <= tol
    if lses is not None:
        finite = [torch.where(torch.isfinite(r), r, torch.zeros_like(r)) for r in ref_lse]
        got = [torch.where(torch.isfinite(g.double()), g.double(), torch.zeros_like(g.double())) for g in lses]
        assert max_err(got, finite) <= tol * 10  # lse magnitudes are larger than outputs
        for g, r in zip(lses, ref_lse, strict=True):
            assert torch.equal(torch.isfinite(g), torch.isfinite(r))
    return outs


# --------------------------------------------------------------------------- non-paged layouts
@pytest.mark.parametrize("layout", sorted(PACKED))
@pytest.mark.parametrize("mode", [0, 3, 4])
def test_packed_layouts_non_paged(layout, mode):
    # GQA 4 (8 query heads, 2 KV heads); chunked prefill: q shorter than kv for every request.
    # a seed fixed per case (hash() of a str differs per process: failures would not reproduce)
    case = make_case([3, 5, 1], [7, 5, 4], 8, 2, 16, seed=sorted(PACKED).index(layout) * 10 + mode)
    check(case, layout=layout, mode=mode, pre=3, nxt=1, version=1)


@pytest.mark.parametrize("layout", sorted(BATCH))
@pytest.mark.parametrize("mode", [0, 2, 3, 4])
def test_batch_layouts_non_paged(layout, mode):
    batch = 1 if layout == "NSD" else 2
    q_lens = [4, 2][:batch]
    # Per-request query lengths (actual_seq_lengths) on a padded batch tensor; GQA 4 or MHA.
    case = make_case(q_lens, [6, 6][:batch], 4, 4 if layout == "NSD" else 1, 16, seed=mode)
    check(case, layout=layout, mode=mode, pre=2, nxt=0, version=2)


@pytest.mark.parametrize("with_band", [False, True])
def test_mode0_user_mask_and_mode1(with_band):
    case = make_case([3, 3], [5, 5], 4, 2, 16, seed=3)
    gen = torch.Generator().manual_seed(1)
    mask = torch.rand(2, 1, 3, 5, generator=gen) > 0.6
    per_request = [mask[b, 0] for b in range(2)]
    pre, nxt = (1, 1) if with_band else (INT_MAX, INT_MAX)
    check(case, layout="BSND", mode=0, pre=pre, nxt=nxt, user_mask=mask.to(torch.uint8),
          user_masks=per_request)
    check(case, layout="BNSD", mode=1, user_mask=mask, user_masks=per_request)


def test_batch_layout_actual_lengths_and_padded_rows_are_zero():
    case = make_case([2, 4], [6, 6], 2, 2, 16, seed=5)
    check(case, layout="BSND", mode=3, actual_q=[2, 4])
    outs, _ = run(case, layout="BSND", mode=0, actual_q=[2, 4], lse=False)
    # the op's padded output rows (query positions past actual length) are zero
    full, _ = emulated.npu_fused_infer_attention_score(
        to_batch_layout(pad(case.q), "BSND"), to_batch_layout(pad(case.k), "BSND"),
        to_batch_layout(pad(case.v), "BSND"), actual_seq_lengths=[2, 4], num_heads=2, input_layout="BSND")
    assert torch.count_nonzero(full[0, 2:]) == 0


# --------------------------------------------------------------------------- paged
@pytest.mark.parametrize("form", ["3d", "4d", "nz"])
@pytest.mark.parametrize("ratio", [1, 4, 8])
def test_paged_decode_tnd(form, ratio):
    # q_len 1, KV lengths crossing block boundaries, shuffled table padded with the null block.
    case = make_case([1, 1, 1], [37, 16, 70], 8, 8 // ratio, 32, seed=ratio)
    block = 32 if form == "nz" else 16  # NZ caches reject block size 16
    paged = build_paged(case, block, form, seed=ratio, table_width=6)
    for mode in (0, 3):
        check(case, layout="TND", mode=mode, paged=paged, version=1)
    check(case, layout="TND_NTD", mode=4, pre=20, nxt=0, paged=paged, version=2)


@pytest.mark.parametrize("form", ["3d", "4d", "nz"])
@pytest.mark.parametrize("mode", [0, 3, 4])
def test_paged_prefill_and_chunked_prefill_tnd(form, mode):
    # block 128 (the Q_S > 1 minimum); request 0 is a chunked prefill (q 40 of kv 300),
    # request 1 a fresh prefill, request 2 decodes inside the same call.
    case = make_case([40, 150, 1], [300, 150, 200], 4, 2, 16, seed=mode)
    paged = build_paged(case, 128, form, seed=mode)
    check(case, layout="TND", mode=mode, pre=130, nxt=0, paged=paged)


@pytest.mark.parametrize("layout,form", [("BSH", "3d"), ("BSND", "3d"), ("BNSD", "3d"), ("BNSD", "4d")])
def test_paged_batch_layouts(layout, form):
    case = make_case([2, 2], [130, 200], 4, 1, 16, seed=11)
    paged = build_paged(case, 128, form, seed=2)
    check(case, layout=layout, mode=3, paged=paged)


def test_paged_sliding_window_with_null_blocks_poisoned():
    # Out-of-window leading blocks point at the NaN-poisoned null block; the band keeps them
    # out, so the output is finite and exact.
    case = make_case([1, 1], [100, 64], 4, 2, 32, seed=4)
    paged = build_paged(case, 16, "3d", null_columns={0: {0, 1, 2}, 1: {0}})
    outs = check(case, layout="TND", mode=4, pre=40, nxt=0, paged=paged, version=2)
    assert all(bool(torch.isfinite(o).all()) for o in outs)


def test_paged_shared_block_between_requests():
    # Request 1 reuses request 0's first block (shared prefix): processed in two rounds.
    case = make_case([1, 1], [40, 20], 4, 2, 32, seed=9)
    case.k[1][:16] = case.k[0][:16]
    case.v[1][:16] = case.v[0][:16]
    paged = build_paged(case, 16, "4d", shared=(0, 0, 1, 0))
    assert int(paged.table[0, 0]) == int(paged.table[1, 0])
    check(case, layout="TND", mode=3, paged=paged)


@pytest.mark.parametrize("form", ["3d", "4d", "nz"])
def test_paged_block_shared_by_several_rows_with_poisoned_tails(form):
    # Graph-mode decode pads rows onto one block: three rows read the same partial block (its slots past kv_len
    # NaN-poisoned), one row its own blocks. The first reference is read in place, the other two gathered into a
    # second round; the NaN tails are cleaned in both.
    block = 128 if form == "nz" else 16  # NZ caches take block sizes 128/256/512 only
    case = make_case([1, 1, 1, 1], [300, 5, 5, 5], 4, 2, 32, seed=31)
    for b in (2, 3):
        case.k[b][:] = case.k[1]
        case.v[b][:] = case.v[1]
    paged = build_paged(case, block, form, seed=31)
    paged.table[2, 0] = paged.table[3, 0] = paged.table[1, 0]
    outs = check(case, layout="TND", mode=3, paged=paged, version=2)
    assert all(bool(torch.isfinite(o).all()) for o in outs)


def test_paged_decode_sparse_cache_uses_gather_plan():
    # Far more cache blocks than used ones: the block-major path gathers the listed blocks.
    case = make_case([1, 1], [30, 50], 4, 4, 16, seed=2)
    paged = build_paged(case, 16, "3d", extra_blocks=200, seed=3)
    check(case, layout="TND", mode=0, paged=paged)


@pytest.mark.parametrize("materialize", [True, False])
def test_request_major_chunking_matches(monkeypatch, materialize):
    # Force many row chunks and key pieces through the request-major path, with the keys
    # converted once up front or gathered piece by piece.
    monkeypatch.setattr(fa_core, "SCORE_BUDGET_BYTES", 4096)
    monkeypatch.setattr(fa_core, "KV_CHUNK_BYTES", 2048)
    monkeypatch.setattr(fa_core, "MATERIALIZE_BYTES", 1 << 40 if materialize else 0)
    case = make_case([9, 17], [20, 17], 4, 2, 16, seed=6)
    check(case, layout="TND", mode=3)
    check(case, layout="TND", mode=4, pre=5, nxt=2)
    paged_case = make_case([20, 3], [140, 260], 4, 2, 16, seed=6)
    check(paged_case, layout="TND", mode=3, paged=build_paged(paged_case, 128, "nz"))


@pytest.mark.parametrize("form", ["3d", "4d"])  # read in place / converted per step
def test_block_major_chunking_matches(monkeypatch, form):
    monkeypatch.setattr(fa_core, "BLOCK_CHUNK_BYTES", 1)  # one block per step
    monkeypatch.setattr(fa_core, "IN_PLACE_STEP_BYTES", 1)
    case = make_case([1, 2, 1], [133, 300, 16], 8, 2, 16, seed=8)  # MTP-like 2-token query
    paged = build_paged(case, 128, form, seed=8)
    check(case, layout="TND", mode=3, paged=paged)


# --------------------------------------------------------------------------- MLA, sinks, dtypes
def test_mla_absorb_decode_v2_nz_and_mtp():
    # key = value = latent (D 512), rope split (D 64), 1 KV head, NZ caches, block 128.
    case = make_case([1, 1], [130, 60], 4, 1, 512, rope=True, same_kv=True, seed=12)
    paged = build_paged(case, 128, "nz", seed=12)
    check(case, layout="TND_NTD", mode=0, paged=paged, version=2, scale=0.04)
    mtp = make_case([2, 2], [130, 60], 4, 1, 512, rope=True, same_kv=True, seed=13)
    check(mtp, layout="TND_NTD", mode=3, paged=build_paged(mtp, 128, "nz", seed=13), version=2, scale=0.04)


def test_mla_absorb_decode_bsnd_takes_an_nz_cache():
    """The MLA rope path's own section of the op docs: with NZ key/value the query layout may be BSH/BSND (not BNSD):
    upstream bailing_2_5's eager decode calls v1 BSND_NBSD on its PA_NZ caches. Outside that path a BSND query
    still takes only a [bn, bs, H] cache."""
    case = make_case([1, 1], [130, 60], 4, 1, 512, rope=True, same_kv=True, seed=12)
    check(case, layout="BSND_NBSD", mode=0, paged=build_paged(case, 128, "nz", seed=12), version=1, scale=0.04)
    plain = make_case([1, 1], [130, 60], 4, 1, 64, seed=17)
    with pytest.raises(NpuOpError, match="BSND queries only accept a") as err:
        run(plain, layout="BSND", mode=0, paged=build_paged(plain, 128, "nz", seed=17), version=1)
    assert err.value.argument == "key"


@pytest.mark.parametrize("version", [1, 2])
def test_mla_absorb_decode_mode3_follows_its_device_question(version):
    # The op docs: with query_rope at Q_S 1 only sparse 0 without a mask or 4 with a mask is supported
    # (mode 3 needs Q_S > 1); upstream kimi_k2_thinking passes mode 3 with the mask at decode. What the device
    # does is the question mla_decode_sparse_mode3: each reading gives its own, distinct result.
    from model_infer_kvcache.validators.npu_ops import DeviceReadings, consulted_questions, device_readings

    case = make_case([1, 1], [130, 60], 4, 1, 512, rope=True, same_kv=True, seed=12)
    paged = build_paged(case, 128, "nz", seed=12)
    with consulted_questions() as seen:
        mode0 = run(case, layout="TND_NTD", mode=0, paged=paged, version=version, scale=0.04)[0]
    assert seen == set()  # the documented call depends on no reading
    with consulted_questions() as seen:
        same = run(case, layout="TND_NTD", mode=3, paged=paged, version=version, scale=0.04)[0]
    assert seen == {"mla_decode_sparse_mode3"} and max_err(same, mode0) == 0  # default: same_as_mode0
    with device_readings(DeviceReadings(mla_decode_sparse_mode3="deviates")):
        off = run(case, layout="TND_NTD", mode=3, paged=paged, version=version, scale=0.04)[0]
    assert max_err(off, mode0) > 1e-2  # the query saw key 0 only
    with device_readings(DeviceReadings(mla_decode_sparse_mode3="rejected")), pytest.raises(NpuOpError) as err:
        run(case, layout="TND_NTD", mode=3, paged=paged, version=version, scale=0.04)
    assert err.value.argument == "sparse_mode" and "Q_S 1" in str(err.value) and "=rejected" in str(err.value)
    # a combination no reading covers stays refused under every reading: mode 0 with a mask
    for reading in ("same_as_mode0", "deviates"):
        with device_readings(DeviceReadings(mla_decode_sparse_mode3=reading)), \
                pytest.raises(NpuOpError, match="got 0 with a mask"):
            run(case, layout="TND_NTD", mode=0, paged=paged, version=version, scale=0.04, user_mask=MASK_2048)
    # one request in the step with two query tokens (an MTP verify) makes Q_S 2: mode 3 is supported
    mixed = make_case([1, 2], [130, 60], 4, 1, 512, rope=True, same_kv=True, seed=16)
    check(mixed, layout="TND_NTD", mode=3, paged=build_paged(mixed, 128, "nz", seed=16), version=version,
          scale=0.04)
    # without rope the documented rule is "ignored at Q_S 1": mode 3 still runs (and equals mode 0)
    plain = make_case([1, 1], [130, 60], 4, 1, 64, seed=17)
    outs3 = check(plain, layout="TND", mode=3, paged=build_paged(plain, 128, "3d", seed=17), version=version)
    outs0 = check(plain, layout="TND", mode=0, paged=build_paged(plain, 128, "3d", seed=17), version=version)
    assert max_err(outs3, outs0) == 0


def test_mla_block16_nd_cache_v1_bsnd():
    case = make_case([1, 1], [20, 33], 2, 1, 512, rope=True, same_kv=True, seed=14)
    check(case, layout="BSND", mode=0, paged=build_paged(case, 16, "3d", seed=14), scale=0.04)


def test_mla_prefill_rope_head_dim_128_v1_ntd_tnd():
    case = make_case([5, 7], [5, 7], 4, 4, 128, rope=True, seed=15)
    check(case, layout="NTD_TND", mode=3, version=1, scale=0.06)


@pytest.mark.parametrize("paged", [False, True])
def test_learnable_sinks(paged):
    case = make_case([3, 1], [6, 40], 4, 2, 32, sinks=True, seed=16)
    cache = build_paged(case, 128, "3d") if paged else None
    check(case, layout="TND", mode=3, paged=cache, version=2)
    check(case, layout="TND", mode=4, pre=4, nxt=0, paged=cache, version=2)


def test_bfloat16_inputs_return_bfloat16():
    case = make_case([1, 1], [20, 33], 4, 2, 16, dtype=torch.bfloat16, seed=17)
    paged = build_paged(case, 16, "3d", seed=17)
    outs, _ = run(case, layout="TND", mode=0, paged=paged, lse=False)
    ref, _ = case.reference(scale=0.25)
    assert outs[0].dtype == torch.bfloat16
    assert max_err(outs, ref) <= 2e-2  # bf16 output rounding
    # computed in float32: equals the float32 run on the same (bf16-valued) inputs, then rounded
    f32 = make_case([1, 1], [20, 33], 4, 2, 16, dtype=torch.bfloat16, seed=17)
    for lst in (f32.q, f32.k, f32.v):
        lst[:] = [t.float() for t in lst]
    outs32, _ = run(f32, layout="TND", mode=0, paged=build_paged(f32, 16, "3d", seed=17), lse=False)
    for a, b in zip(outs, outs32, strict=True):
        assert torch.equal(a, b.to(torch.bfloat16))


def test_float64_inputs_compute_in_float64():
    case = make_case([3], [9], 2, 1, 16, dtype=torch.float64, seed=18)
    check(case, layout="TND", mode=3, tol=1e-12)


def test_lse_not_requested_is_empty():
    case = make_case([2], [4], 2, 2, 16)
    _, lse = emulated.npu_fused_infer_attention_score(
        case.q[0], case.k[0], case.v[0], actual_seq_lengths=[2], actual_seq_lengths_kv=[4], num_heads=2,
        input_layout="TND")
    assert lse.numel() == 0 and lse.dtype == torch.float32


@pytest.mark.parametrize("lens", [[6, 9, 4], [7, 7, 7]])  # ragged, and equal (gather-free views)
def test_sdpa_cross_check_causal_tnd(lens):
    case = make_case(lens, lens, 8, 2, 32, seed=19)
    q, cum = pack(case.q)
    k, _ = pack(case.k)
    v, _ = pack(case.v)
    out, _ = emulated.npu_fused_infer_attention_score(
        q, k, v, atten_mask=MASK_2048, actual_seq_lengths=cum, actual_seq_lengths_kv=cum, num_heads=8,
        num_key_value_heads=2, scale=32 ** -0.5, input_layout="TND", sparse_mode=3)
    for b, got in enumerate(split_packed(out, case.q_lens)):
        sdpa = F.scaled_dot_product_attention(
            case.q[b].transpose(0, 1), case.k[b].transpose(0, 1), case.v[b].transpose(0, 1),
            is_causal=True, enable_gqa=True)
        assert (got - sdpa.transpose(0, 1)).abs().max() <= TOL


def test_scale_is_applied_and_v1_v2_agree():
    case = make_case([2, 3], [5, 3], 4, 2, 16, seed=20)
    a, _ = run(case, version=1, scale=0.1, mode=3, lse=False)
    b, _ = run(case, version=2, scale=0.1, mode=3, lse=False)
    c, _ = run(case, version=2, scale=1.0, mode=3, lse=False)
    assert max_err(a, [t.double() for t in b]) == 0.0
    assert max_err(a, [t.double() for t in c]) > 1e-3


def test_packed_tokens_past_the_last_cumulative_length_are_zero():
    case = make_case([2, 3], [2, 3], 2, 1, 16, seed=22)
    q, cum = pack(case.q)
    k, _ = pack(case.k)
    v, _ = pack(case.v)
    pad_rows = torch.randn(2, 2, 16)
    out, lse = emulated.npu_fused_infer_attention_score_v2(
        torch.cat([q, pad_rows]), torch.cat([k, pad_rows[:, :1]]), torch.cat([v, pad_rows[:, :1]]),
        atten_mask=MASK_2048, actual_seq_qlen=cum, actual_seq_kvlen=cum, num_query_heads=2, num_key_value_heads=1,
        input_layout="TND", sparse_mode=3, return_softmax_lse=True)
    assert out.shape == (7, 2, 16) and torch.count_nonzero(out[5:]) == 0 and torch.isinf(lse[5:]).all()
    ref, _ = case.reference(scale=1.0, mode=3)
    assert max_err(split_packed(out[:5], case.q_lens), ref) <= TOL
