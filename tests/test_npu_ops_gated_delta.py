"""The gated delta rule operators (validators/npu_ops/gated_delta.py) against transformers' torch reference, their
refusals, and the three device questions they consult (references/device_questions.md)."""

from __future__ import annotations

import pytest
import torch
from model_infer_kvcache.validators.npu_ops import (
    DeviceReadings,
    NpuOpError,
    UnemulatedFeatureError,
    consulted_questions,
    device_readings,
    emulated,
)
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

REC = emulated.OPS["npu_recurrent_gated_delta_rule"]
CHUNK = emulated.OPS["npu_chunk_gated_delta_rule"]
F64 = torch.float64
GDR_QUESTIONS = {"gdr_state_writes", "gdr_accepted_start", "gdr_head_grouping"}


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def inputs(tokens, nk, nv, dk, dv, *, seed=0, dtype=F64):
    """l2-normalized q/k (the op does not normalize: the caller does, as the doc's example), beta in (0, 1),
    g < 0."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(tokens, nk, dk, generator=gen, dtype=F64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(tokens, nk, dk, generator=gen, dtype=F64), dim=-1)
    v = torch.randn(tokens, nv, dv, generator=gen, dtype=F64)
    beta = torch.rand(tokens, nv, generator=gen, dtype=F64)
    g = -torch.rand(tokens, nv, generator=gen, dtype=F64)
    return q.to(dtype), k.to(dtype), v.to(dtype), beta.to(dtype), g


def reference(q, k, v, beta, g, state_npu, *, chunk=False):
    """transformers on one request (rows of the packed tensors): (o, final state in the NPU layout [Nv, Dv, Dk])."""
    fn = torch_chunk_gated_delta_rule if chunk else torch_recurrent_gated_delta_rule
    o, s = fn(q[None].double(), k[None].double(), v[None].double(), g[None].double(), beta[None].double(),
              initial_state=state_npu.double().transpose(-1, -2)[None], output_final_state=True)
    return o[0].double(), s[0].transpose(-1, -2).double()


def test_chunk_prefill_matches_transformers_per_request_with_gqa():
    nk, nv, d = 2, 4, 128
    lens = [5, 70, 1]  # 70 crosses transformers' 64-token chunk
    q, k, v, beta, g = inputs(sum(lens), nk, nv, d, d)
    initial = torch.randn(len(lens), nv, d, d, dtype=F64) * 0.1
    before = initial.clone()
    o, final = CHUNK(q, k, v, beta=beta, initial_state=initial, actual_seq_lengths=i32(lens), scale=d ** -0.5, g=g)
    assert o.shape == (sum(lens), nv, d) and o.dtype == F64 and final.shape == initial.shape
    assert torch.equal(initial, before)  # not written: the schema has no (a!) on initial_state
    start = 0
    for b, n in enumerate(lens):
        rows = slice(start, start + n)
        ref_o, ref_s = reference(q[rows], k[rows], v[rows], beta[rows], g[rows], initial[b], chunk=True)
        torch.testing.assert_close(o[rows], ref_o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final[b], ref_s, atol=1e-5, rtol=1e-5)
        start += n


def test_chunk_scale_is_the_callers_and_g_none_is_no_decay():
    q, k, v, beta, _ = inputs(4, 1, 1, 128, 128)
    init = torch.zeros(1, 1, 128, 128, dtype=F64)
    o1, _ = CHUNK(q, k, v, beta=beta, initial_state=init, actual_seq_lengths=i32([4]), scale=1.0)
    o2, _ = CHUNK(q, k, v, beta=beta, initial_state=init, actual_seq_lengths=i32([4]), scale=0.5)
    torch.testing.assert_close(o2, o1 * 0.5)
    ref_o, _ = reference(q, k, v, beta, torch.zeros(4, 1, dtype=F64), init[0])  # transformers scales by Dk**-0.5
    torch.testing.assert_close(o1 * 128 ** -0.5, ref_o, atol=1e-5, rtol=1e-5)


def test_recurrent_multi_step_decode_updates_only_the_named_slots():
    """Three requests whose states live in slots 5, 1, 3 of 7; decode steps of one token each, then an MTP-like
    step of 2, 1 and 3 tokens (each request's tokens on its own slot); Dk != Dv and Nv = 2 Nk."""
    nk, nv, dk, dv = 2, 4, 16, 8
    slots = [5, 1, 3]
    pool = torch.randn(7, nv, dv, dk, dtype=F64) * 0.1
    untouched = {s: pool[s].clone() for s in range(7) if s not in slots}
    expected = {s: pool[s].clone() for s in slots}
    for step, lens in enumerate(([1, 1, 1], [1, 1, 1], [1, 1, 1], [2, 1, 3])):
        q, k, v, beta, g = inputs(sum(lens), nk, nv, dk, dv, seed=step + 1)
        per_token = [s for s, n in zip(slots, lens, strict=True) for _ in range(n)]
        o = REC(q, k, v, pool, beta=beta, scale=dk ** -0.5, actual_seq_lengths=i32(lens),
                ssm_state_indices=i32(per_token), g=g)
        assert o.shape == (sum(lens), nv, dv)
        start = 0
        for s, n in zip(slots, lens, strict=True):
            rows = slice(start, start + n)
            ref_o, expected[s] = reference(q[rows], k[rows], v[rows], beta[rows], g[rows], expected[s])
            torch.testing.assert_close(o[rows], ref_o, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(pool[s], expected[s], atol=1e-5, rtol=1e-5)
            start += n
    for s, before in untouched.items():
        assert torch.equal(pool[s], before), s


def test_recurrent_bfloat16_as_upstream_qwen3_5_decodes():
    """The upstream call (modeling_qwen3_5_moe.py _forward_decode): bf16, 16 key / 32 value heads of 128, one
    token per request, ssm_state_indices = arange(B), num_accepted_tokens=None, gk=None."""
    batch, nk, nv, d = 2, 16, 32, 128
    q, k, v, beta, g = inputs(batch, nk, nv, d, d, dtype=torch.bfloat16)
    state = (torch.randn(batch, nv, d, d) * 0.1).to(torch.bfloat16)
    start = state.clone()
    o = REC(q, k, v, state, beta=beta, scale=1.0 / d ** 0.5, actual_seq_lengths=torch.ones(batch, dtype=torch.int32),
            ssm_state_indices=torch.arange(batch, dtype=torch.int32), num_accepted_tokens=None, g=g.float(), gk=None)
    assert o.dtype == torch.bfloat16 and o.shape == (batch, nv, d)
    for b in range(batch):
        ref_o, ref_s = reference(q[b:b + 1], k[b:b + 1], v[b:b + 1], beta[b:b + 1], g[b:b + 1], start[b])
        torch.testing.assert_close(o[b:b + 1].double(), ref_o, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(state[b].double(), ref_s, atol=2e-2, rtol=2e-2)
    assert not torch.equal(state, start)


def test_single_token_calls_consult_no_question():
    q, k, v, beta, g = inputs(2, 2, 2, 8, 8)
    with consulted_questions() as seen:
        REC(q, k, v, torch.zeros(2, 2, 8, 8, dtype=F64), beta=beta, scale=1.0, actual_seq_lengths=i32([1, 1]),
            ssm_state_indices=i32([0, 1]), g=g)
    assert not seen & GDR_QUESTIONS


# --------------------------------------------------------------------------- refusals
def rec_call(**over):
    """A valid recurrent call (2 requests of 1 and 2 tokens, Dk 16 != Dv 8, 4 slots), with ``over`` replaced."""
    q, k, v, beta, g = inputs(3, 1, 2, 16, 8)
    kw = dict(query=q, key=k, value=v, state=torch.zeros(4, 2, 8, 16, dtype=F64), beta=beta, scale=0.25,
              actual_seq_lengths=i32([1, 2]), ssm_state_indices=i32([3, 0, 0]), g=g)
    kw.update(over)
    return kw


def expect(argument, fn, kind=NpuOpError, **kw):
    with pytest.raises(kind) as info:
        fn(**kw)
    assert info.value.argument == argument, str(info.value)
    return str(info.value)


def test_the_valid_baseline_passes():
    REC(**rec_call())


def test_transformers_state_layout_is_refused():
    message = expect("state", REC, **rec_call(state=torch.zeros(4, 2, 16, 8, dtype=F64)))
    assert "transformers' layout" in message


def test_lengths_and_indices_must_be_int32():
    expect("actual_seq_lengths", REC, **rec_call(actual_seq_lengths=torch.tensor([1, 2])))
    expect("ssm_state_indices", REC, **rec_call(ssm_state_indices=torch.tensor([3, 0, 0])))
    expect("num_accepted_tokens", REC, **rec_call(num_accepted_tokens=torch.tensor([1, 1])))


def test_lengths_must_sum_to_the_tokens():
    assert "sum to 4" in expect("actual_seq_lengths", REC, **rec_call(actual_seq_lengths=i32([2, 2])))


def test_state_index_outside_the_state_is_refused():
    assert "outside" in expect("ssm_state_indices", REC, **rec_call(ssm_state_indices=i32([3, 0, 4])))
    expect("ssm_state_indices", REC, **rec_call(ssm_state_indices=i32([3, 0, -1])))
    assert "(T,)" in expect("ssm_state_indices", REC, **rec_call(ssm_state_indices=i32([3, 0])))  # per token


def test_two_requests_on_one_slot_race_and_leave_it_undefined():
    """Two requests naming one slot race on it: the slot ends NaN (undefined), the other slots are exact. The
    framework pads decode rows onto the null block (all on slot 0), so this is no error; a real request sharing a
    slot with another gets a NaN state and fails the numeric link loudly."""
    kw = rec_call(ssm_state_indices=i32([0, 0, 1]), state=torch.zeros(4, 2, 8, 16, dtype=F64))
    own = rec_call(ssm_state_indices=i32([2, 0, 1]), state=torch.zeros(4, 2, 8, 16, dtype=F64))
    out, out_own = REC(**kw), REC(**own)
    assert torch.isnan(kw["state"][0]).all() and torch.isfinite(kw["state"][1:]).all()
    assert torch.equal(kw["state"][1], own["state"][1])  # the second request's own last slot: unaffected
    assert torch.equal(out, out_own)  # outputs come from each request's start state, read before any write


def test_request_longer_than_the_documented_8_tokens_is_refused():
    q, k, v, beta, g = inputs(9, 1, 2, 16, 8)
    kw = rec_call(query=q, key=k, value=v, beta=beta, g=g, actual_seq_lengths=i32([9]), ssm_state_indices=i32([0] * 9))
    assert "L_i <= 8" in expect("actual_seq_lengths", REC, **kw)
    q, k, v, beta, g = inputs(8, 1, 2, 16, 8)
    REC(**rec_call(query=q, key=k, value=v, beta=beta, g=g, actual_seq_lengths=i32([8]), ssm_state_indices=i32([0] * 8)))


def test_gk_is_refused_as_not_emulated():
    expect("gk", REC, UnemulatedFeatureError, **rec_call(gk=torch.zeros(3, 2, 16)))


def test_required_inputs_and_dtypes():
    expect("beta", REC, **rec_call(beta=None))
    expect("scale", REC, **rec_call(scale=None))
    expect("actual_seq_lengths", REC, **rec_call(actual_seq_lengths=None))
    expect("ssm_state_indices", REC, **rec_call(ssm_state_indices=None))
    base = rec_call()
    half = {n: base[n].to(torch.float16) for n in ("query", "key", "value")}
    expect("query", REC, **rec_call(**half))  # float16: not a dtype of these operators
    # float32 is (a checkout run's comparison dtype), but every tensor in one dtype: the float64 state is refused
    assert "must equal the query's torch.float32" in expect(
        "state", REC, **rec_call(query=base["query"].float(), key=base["key"].float(), value=base["value"].float()))
    expect("g", REC, **rec_call(g=base["g"].to(torch.float16)))
    expect("num_accepted_tokens", REC, **rec_call(num_accepted_tokens=i32([1, 3])))  # request 1 has 2 tokens


def test_chunk_refusals():
    q, k, v, beta, g = inputs(3, 1, 2, 128, 128)
    kw = dict(query=q, key=k, value=v, beta=beta, initial_state=torch.zeros(2, 2, 128, 128, dtype=F64),
              actual_seq_lengths=i32([1, 2]), scale=0.1, g=g)
    CHUNK(**kw)
    assert "initial_state[b]" in expect("initial_state", CHUNK, **dict(kw, initial_state=torch.zeros(3, 2, 128, 128,
                                                                                                     dtype=F64)))
    expect("initial_state", CHUNK, **dict(kw, initial_state=None))
    expect("actual_seq_lengths", CHUNK, **dict(kw, actual_seq_lengths=torch.tensor([1, 2])))
    q64, k64, v64, beta64, g64 = inputs(3, 1, 2, 64, 64)
    assert "128" in expect("query", CHUNK, **dict(kw, query=q64, key=k64, value=v64.expand(3, 2, 64),
                                                  initial_state=torch.zeros(2, 2, 64, 64, dtype=F64)))
    q3, k3, v3, beta3, g3 = inputs(3, 2, 3, 128, 128)  # Nv not a multiple of Nk
    expect("value", CHUNK, **dict(kw, query=q3, key=k3, value=v3, beta=beta3, g=g3,
                                  initial_state=torch.zeros(2, 3, 128, 128, dtype=F64)))


# --------------------------------------------------------------------------- device questions
def test_gdr_state_writes_readings_differ_on_a_two_token_request():
    """Slots [1, 2] for one request of 2 tokens: every_token leaves token 0's state in slot 1, last_only leaves it
    alone; slot 2 holds the final state under both."""
    q, k, v, beta, g = inputs(2, 1, 1, 8, 8)
    init = torch.randn(1, 8, 8, dtype=F64)
    results = {}
    for reading in ("every_token", "last_only"):
        pool = torch.zeros(3, 1, 8, 8, dtype=F64)
        pool[1] = init
        with device_readings(DeviceReadings(gdr_state_writes=reading)), consulted_questions() as seen:
            REC(q, k, v, pool, beta=beta, scale=1.0, actual_seq_lengths=i32([2]), ssm_state_indices=i32([1, 2]), g=g)
        assert "gdr_state_writes" in seen
        results[reading] = pool
    _, after_first = reference(q[:1], k[:1], v[:1], beta[:1], g[:1], init)
    _, final = reference(q, k, v, beta, g, init)
    torch.testing.assert_close(results["every_token"][1], after_first, atol=1e-5, rtol=1e-5)
    assert torch.equal(results["last_only"][1], init)
    for pool in results.values():
        torch.testing.assert_close(pool[2], final, atol=1e-5, rtol=1e-5)


def test_gdr_accepted_start_readings_differ_under_num_accepted_tokens():
    q, k, v, beta, g = inputs(2, 1, 1, 8, 8)
    pool = torch.randn(3, 1, 8, 8, dtype=F64)
    outs = {}
    for reading in ("accepted_slot", "first_slot"):
        with device_readings(DeviceReadings(gdr_accepted_start=reading)), consulted_questions() as seen:
            outs[reading] = REC(q, k, v, pool.clone(), beta=beta, scale=8 ** -0.5, actual_seq_lengths=i32([2]),
                                ssm_state_indices=i32([1, 2]), num_accepted_tokens=i32([2]), g=g)
        assert "gdr_accepted_start" in seen
    torch.testing.assert_close(outs["accepted_slot"], reference(q, k, v, beta, g, pool[2])[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs["first_slot"], reference(q, k, v, beta, g, pool[1])[0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(outs["accepted_slot"], outs["first_slot"])
    with consulted_questions() as seen:  # one accepted token: both readings read the first slot
        REC(q, k, v, pool.clone(), beta=beta, scale=8 ** -0.5, actual_seq_lengths=i32([2]), ssm_state_indices=i32([1, 2]),
            num_accepted_tokens=i32([1]), g=g)
    assert "gdr_accepted_start" not in seen


@pytest.mark.parametrize("op", ["recurrent", "chunk"])
def test_gdr_head_grouping_readings_differ_when_nv_exceeds_nk(op):
    nk, nv, d = 2, 4, 128
    q, k, v, beta, g = inputs(3, nk, nv, d, d)
    init = torch.zeros(1, nv, d, d, dtype=F64)

    def call():
        if op == "chunk":
            return CHUNK(q, k, v, beta=beta, initial_state=init, actual_seq_lengths=i32([3]), scale=d ** -0.5, g=g)[0]
        return REC(q, k, v, init.clone(), beta=beta, scale=d ** -0.5, actual_seq_lengths=i32([3]),
                   ssm_state_indices=i32([0, 0, 0]), g=g)

    outs = {}
    for reading in ("consecutive", "strided"):
        with device_readings(DeviceReadings(gdr_head_grouping=reading)), consulted_questions() as seen:
            outs[reading] = call()
        assert "gdr_head_grouping" in seen
    # consecutive = transformers' repeat_interleave; strided = the key heads tiled (h % Nk)
    torch.testing.assert_close(outs["consecutive"], reference(q, k, v, beta, g, init[0])[0], atol=1e-5, rtol=1e-5)
    tiled = reference(q.repeat(1, 2, 1), k.repeat(1, 2, 1), v, beta, g, init[0])[0]
    torch.testing.assert_close(outs["strided"], tiled, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(outs["consecutive"], outs["strided"])
