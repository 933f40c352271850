"""Model-side operators (norms, rotary, activations, formats, MoE, matmuls) against independent
references (transformers' own modeling code, or plain torch written from the op docs), their
strictness, and the one-line failure of an operator that is not emulated."""

from __future__ import annotations

import importlib.util
import textwrap
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from model_infer_kvcache.validators.npu_ops import (
    DeviceReadings,
    NpuOpError,
    UnemulatedFeatureError,
    UnemulatedOperatorError,
    consulted_questions,
    device_readings,
    emulated,
    install_emulation,
)
from model_infer_kvcache.validators.standins import NotStoodInError, device_standins
from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb as hf_rotary

GEN = torch.Generator().manual_seed(0)
ops = SimpleNamespace(**emulated.OPS)


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=GEN).to(dtype)


def expect(argument, fn, *args, error=NpuOpError, **kwargs):
    with pytest.raises(error) as info:
        fn(*args, **kwargs)
    assert info.value.argument == argument, str(info.value)
    assert info.value.op in str(info.value)
    return info.value


def _hf_norm(x, weight, eps):
    norm = Qwen3RMSNorm(weight.shape[-1], eps=eps)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm(x)


# --------------------------------------------------------------------------- norms
@pytest.mark.parametrize("dtype, atol, rtol", [(torch.float32, 1e-6, 0), (torch.bfloat16, 1e-2, 2e-2)])
def test_rms_norm_matches_transformers(dtype, atol, rtol):
    x, w = randn(5, 3, 16, dtype=dtype), randn(16, dtype=dtype)
    y, rstd = ops.npu_rms_norm(x, w, 1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    assert rstd.dtype == torch.float32 and rstd.shape == (5, 3, 1)  # meta: x.shape[:-g] + [1] * g
    # transformers rounds the normalized value to bf16 before the weight: one extra rounding step
    torch.testing.assert_close(y.double(), _hf_norm(x, w, 1e-6).double(), atol=atol, rtol=rtol)
    torch.testing.assert_close(rstd.double(), x.double().pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt(),
                               atol=1e-5, rtol=1e-5)


def test_rms_norm_float64_validation_mode_is_exact_math():
    x, w = randn(4, 2, 16, dtype=torch.float64), randn(2, 16, dtype=torch.float64)
    y, rstd = ops.npu_rms_norm(x, w, 1e-6)  # gamma over the last two axes
    want = x / (x.pow(2).mean((-2, -1), keepdim=True) + 1e-6).sqrt() * w
    torch.testing.assert_close(y, want, atol=1e-12, rtol=0)
    assert y.dtype == torch.float64 and rstd.shape == (4, 1, 1)


def test_add_rms_norm_returns_normed_sum_and_sum():
    x1, x2, w = randn(4, 16), randn(4, 16), randn(16)
    y, rstd, total = ops.npu_add_rms_norm(x1, x2, w, 1e-5)
    torch.testing.assert_close(total, x1 + x2)
    torch.testing.assert_close(y, _hf_norm(x1 + x2, w, 1e-5), atol=1e-6, rtol=0)
    assert rstd.shape == (4, 1)


def test_norms_refuse_bad_arguments():
    x = randn(4, 16)
    expect("gamma", ops.npu_rms_norm, x, randn(16, dtype=torch.bfloat16))  # doc: gamma has self's dtype
    expect("gamma", ops.npu_rms_norm, x, randn(8))
    expect("self", ops.npu_rms_norm, x.int(), torch.ones(16, dtype=torch.int32))
    expect("epsilon", ops.npu_rms_norm, x, randn(16), -1.0)
    expect("x2", ops.npu_add_rms_norm, x, randn(4, 8), randn(16))
    expect("x2", ops.npu_add_rms_norm, x, randn(4, 16, dtype=torch.float16), randn(16))
    with pytest.raises(TypeError):
        ops.npu_rms_norm(x, randn(16), eps=1e-6)  # the schema's name is epsilon


# --------------------------------------------------------------------------- rotary
def _cos_sin(tokens, dim, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    freqs = torch.outer(torch.arange(tokens, dtype=torch.float32), inv)
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos(), emb.sin()


def test_apply_rotary_pos_emb_tnd_half_matches_transformers():
    t, nq, nk, d = 6, 4, 2, 16
    q, k = randn(t, nq, d), randn(t, nk, d)
    cos, sin = _cos_sin(t, d)
    q_out, k_out = ops.npu_apply_rotary_pos_emb(q, k, cos[:, None], sin[:, None], layout="TND")
    # transformers works on [B, H, S, D] with cos [B, S, D]
    q_ref, k_ref = hf_rotary(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    torch.testing.assert_close(q_out, q_ref[0].transpose(0, 1), atol=1e-6, rtol=0)
    torch.testing.assert_close(k_out, k_ref[0].transpose(0, 1), atol=1e-6, rtol=0)
    assert not torch.equal(q_out, q)  # the rotation did something; the inputs are left as they were


def test_apply_rotary_pos_emb_bsnd_and_interleave():
    b, s, n, d = 2, 3, 2, 8
    q, k = randn(b, s, n, d), randn(b, s, 1, d)
    cos, sin = _cos_sin(s, d)
    cos4, sin4 = cos[None, :, None].expand(b, s, 1, d), sin[None, :, None].expand(b, s, 1, d)
    q_out, _ = ops.npu_apply_rotary_pos_emb(q, k, cos4, sin4)  # default layout 'BSH' = [B, S, N, D]
    q_ref, _ = hf_rotary(q, q, cos[None], sin[None], unsqueeze_dim=2)
    torch.testing.assert_close(q_out, q_ref, atol=1e-6, rtol=0)
    # interleave (npu_rotary_mul doc): pairs (x0, x1) rotate together, written back in place
    c, sn = cos4.clone(), sin4.clone()
    q_int, _ = ops.npu_apply_rotary_pos_emb(q, k, c, sn, layout="BSND", rotary_mode="interleave")
    x1, x2 = q[..., 0::2], q[..., 1::2]
    want = torch.stack((x1 * c[..., 0::2] - x2 * sn[..., 0::2], x2 * c[..., 1::2] + x1 * sn[..., 1::2]), -1)
    torch.testing.assert_close(q_int, want.flatten(-2), atol=1e-6, rtol=0)


def test_apply_rotary_pos_emb_refuses_bad_arguments():
    q, k, cs = randn(4, 2, 8), randn(4, 1, 8), randn(4, 1, 8)
    f = ops.npu_apply_rotary_pos_emb
    expect("layout", f, q, k, cs, cs, layout="NTD")
    expect("rotary_mode", f, q, k, cs, cs, layout="TND", rotary_mode="quarter", error=UnemulatedFeatureError)
    expect("rotary_mode", f, q, k, cs, cs, layout="TND", rotary_mode="full")
    expect("query", f, q, k, cs, cs)  # 3-D query under the default 4-D 'BSH' layout
    expect("cos", f, q, k, randn(4, 2, 8), randn(4, 2, 8), layout="TND")  # cos must be 1 on the head axis
    expect("sin", f, q, k, cs, randn(1, 1, 8), layout="TND")
    expect("key", f, q, randn(3, 1, 8), cs, cs, layout="TND")
    expect("cos", f, q, k, cs.double(), cs.double(), layout="TND")
    expect("query", f, randn(4, 2, 7), randn(4, 1, 7), randn(4, 1, 7), randn(4, 1, 7), layout="TND")


def test_interleave_rope_matches_transformers_deepseek():
    n, s, d = 3, 5, 8
    x = randn(1, n, s, d)
    cos, sin = _cos_sin(s, d)
    out = ops.npu_interleave_rope(x, cos[None, None], sin[None, None])
    want, _ = apply_rotary_pos_emb_interleave(x, x, cos[None], sin[None])
    torch.testing.assert_close(out, want, atol=1e-6, rtol=0)
    expect("x", ops.npu_interleave_rope, x[0], cos[None], sin[None])
    expect("cos", ops.npu_interleave_rope, x, randn(1, n, s, d), randn(1, n, s, d))


def test_rotary_mul_half_matches_transformers_and_interleave_the_doc():
    """npu_rotary_mul (doc): half = cos * x + sin * cat(-x2, x1), transformers' rotate_half (Gemma-4 sliding
    layers call it on [B, S, N, D] with [B, S, 1, D] tables); interleave = the doc's pairwise program."""
    b, s, n, d = 2, 3, 4, 8
    x = randn(b, s, n, d)
    cos, sin = _cos_sin(s, d)
    c4, s4 = cos[None, :, None].expand(b, s, 1, d), sin[None, :, None].expand(b, s, 1, d)
    want, _ = hf_rotary(x, x, cos[None], sin[None], unsqueeze_dim=2)
    torch.testing.assert_close(ops.npu_rotary_mul(x, c4, s4), want, atol=1e-6, rtol=0)
    c1, s1 = cos[None, :, None], sin[None, :, None]  # 1S1D: interleave takes only S and D axes
    x1, x2 = x[..., 0::2], x[..., 1::2]
    pair = torch.stack((-x2, x1), -1).flatten(-2)
    torch.testing.assert_close(ops.npu_rotary_mul(x, c1, s1, rotary_mode="interleave"), c1 * x + s1 * pair,
                               atol=1e-6, rtol=0)
    assert not torch.allclose(ops.npu_rotary_mul(x, c1, s1, rotary_mode="interleave"), ops.npu_rotary_mul(x, c1, s1))
    f = ops.npu_rotary_mul
    expect("rotary_mode", f, x, c4, s4, rotary_mode="quarter")
    expect("input", f, x[0], c4[0], s4[0])  # 3-D input
    expect("input", f, randn(1, 2, 2, 7), randn(1, 2, 1, 7), randn(1, 2, 1, 7))  # odd D
    expect("input", f, randn(1, 1, 1, 896), randn(1, 1, 1, 896), randn(1, 1, 1, 896))  # D < 896
    expect("r1", f, x, randn(b, s, 2, d), randn(b, s, 2, d))  # 2 heads do not broadcast over 4
    expect("r1", f, x, c4, s4, rotary_mode="interleave")  # BS1D is a half-mode table
    expect("r2", f, x, c4, s4[:1])
    expect("r1", f, x, c4.double(), s4.double())


def test_geglu_activates_the_half_activate_left_names():
    """npu_geglu: gelu on one half times the other; (out, gelu of the activated half); approximate 1 = tanh."""
    x = randn(3, 4, 12)
    left, right = x.chunk(2, -1)
    out, gelu = ops.npu_geglu(x)  # default: activate_left False -> the right half is activated
    torch.testing.assert_close(out, F.gelu(right, approximate="tanh") * left, atol=1e-6, rtol=0)
    torch.testing.assert_close(gelu, F.gelu(right, approximate="tanh"), atol=1e-6, rtol=0)
    out, _ = ops.npu_geglu(x, dim=-1, approximate=1, activate_left=True)  # upstream gemma_4's call
    torch.testing.assert_close(out, F.gelu(left, approximate="tanh") * right, atol=1e-6, rtol=0)
    out, _ = ops.npu_geglu(x, approximate=0, activate_left=True)
    torch.testing.assert_close(out, F.gelu(left) * right, atol=1e-6, rtol=0)
    assert not torch.allclose(out, ops.npu_geglu(x, approximate=0)[0])  # the side matters
    a, b = x.chunk(2, 1)
    torch.testing.assert_close(ops.npu_geglu(x, dim=1)[0], F.gelu(b, approximate="tanh") * a, atol=1e-6, rtol=0)
    expect("dim", ops.npu_geglu, randn(3, 5))
    expect("dim", ops.npu_geglu, x, dim=3)
    expect("approximate", ops.npu_geglu, x, approximate=2)
    expect("self", ops.npu_geglu, x.long())


# --------------------------------------------------------------------------- activations, formats
def test_swiglu_is_silu_of_first_half_times_second():
    x = randn(3, 4, 12)
    a, b = x.chunk(2, -1)
    torch.testing.assert_close(ops.npu_swiglu(x), F.silu(a) * b, atol=1e-6, rtol=0)
    a, b = x.chunk(2, 1)
    torch.testing.assert_close(ops.npu_swiglu(x, dim=1), F.silu(a) * b, atol=1e-6, rtol=0)
    expect("dim", ops.npu_swiglu, randn(3, 5))
    expect("dim", ops.npu_swiglu, x, dim=3)
    expect("self", ops.npu_swiglu, x.long())


def test_format_cast_keeps_values_in_new_storage():
    w = randn(8, 4).t()
    out = ops.npu_format_cast(w, 29)
    assert torch.equal(out, w) and out.is_contiguous() and out.data_ptr() != w.data_ptr()
    expect("acl_format", ops.npu_format_cast, w, 3, error=UnemulatedFeatureError)  # NC1HWC0: documented
    expect("acl_format", ops.npu_format_cast, w, 77)
    expect("customize_dtype", ops.npu_format_cast, w, 29, customize_dtype=1, error=UnemulatedFeatureError)


# --------------------------------------------------------------------------- exposure
def test_model_ops_reachable_as_torch_npu_and_torch_ops_npu():
    x, w = randn(3, 16), randn(16)
    with install_emulation() as torch_npu:
        a = torch_npu.npu_rms_norm(x, w, 1e-6)[0]
        b = torch.ops.npu.npu_rms_norm(x, w, 1e-6)[0]
        q, k = randn(2, 2, 8), randn(2, 1, 8)
        cs = randn(2, 1, 8)
        r1 = torch.ops.npu.npu_apply_rotary_pos_emb(q, k, cs, cs, "TND")
        r2 = torch_npu.npu_apply_rotary_pos_emb(q, k, cs, cs, "TND")
        assert torch.equal(torch.ops.npu.npu_swiglu(x), torch_npu.npu_swiglu(x))
    assert torch.equal(a, b) and all(torch.equal(u, v) for u, v in zip(r1, r2, strict=True))


def _fake_checkout(tmp_path, body: str):
    """A file at models/toy/models/modeling_toy.py of a folder that looks like a checkout."""
    (tmp_path / "executor" / "core").mkdir(parents=True)
    path = tmp_path / "models" / "toy" / "models" / "modeling_toy.py"
    path.parent.mkdir(parents=True)
    path.write_text(textwrap.dedent(body), encoding="utf-8")
    spec = importlib.util.spec_from_file_location("modeling_toy_for_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("call, name", [("torch_npu.npu_moe_distribute_dispatch_v3(x)",
                                         "torch_npu.npu_moe_distribute_dispatch_v3"),
                                        ("torch.ops.npu.npu_dynamic_quant(x)", "torch.ops.npu.npu_dynamic_quant")])
def test_not_emulated_op_fails_with_one_line_naming_the_model_line(tmp_path, call, name):
    module = _fake_checkout(tmp_path, f"""
        import torch


        def forward(x):
            import torch_npu
            y = x + 1
            return {call}
    """)
    with device_standins():
        with pytest.raises(UnemulatedOperatorError) as info:
            module.forward(torch.ones(2))
    message = str(info.value)
    assert message == (f"{name} is not emulated on CPU (called at models/toy/models/modeling_toy.py:8); "
                       f"emulated ops: references/emulated_ops.md")
    assert "\n" not in message and isinstance(info.value, NotStoodInError)
    assert info.value.op == name and info.value.location.endswith("modeling_toy.py:8")


def test_non_operator_attributes_still_say_no_stand_in():
    with device_standins():
        import torch_npu

        with pytest.raises(NotStoodInError) as info:
            torch_npu.some_config_switch  # noqa: B018
    assert not isinstance(info.value, UnemulatedOperatorError)


# --------------------------------------------------------------------------- MoE routing
def test_gating_top_k_softmax_values_indices_and_row_layout():
    x = randn(3, 6)
    y, idx, row_idx = ops.npu_moe_gating_top_k_softmax(x, None, k=2)
    probs = torch.softmax(x, -1)
    torch.testing.assert_close(y, probs.gather(1, idx.long()), atol=1e-7, rtol=0)
    assert (y[:, 0] >= y[:, 1]).all() and torch.equal(idx.long()[:, 0], probs.argmax(-1))
    assert idx.dtype == row_idx.dtype == torch.int32
    assert row_idx.tolist() == [[0, 3], [1, 4], [2, 5]]  # the doc example of npu_moe_init_routing
    y3, _, r3 = ops.npu_moe_gating_top_k_softmax(randn(2, 2, 6), k=1)
    assert y3.shape == (2, 2, 1) and r3.flatten().tolist() == [0, 1, 2, 3]
    expect("k", ops.npu_moe_gating_top_k_softmax, x, k=7)
    expect("finished", ops.npu_moe_gating_top_k_softmax, x, torch.zeros(3, dtype=torch.bool), k=2,
           error=UnemulatedFeatureError)


def test_init_routing_follows_the_documented_program():
    x = torch.tensor([[0.1] * 4, [0.2] * 4, [0.3] * 4])
    row_idx = torch.tensor([[0, 3], [1, 4], [2, 5]], dtype=torch.int32)
    expert_idx = torch.tensor([[1, 2], [0, 1], [0, 2]], dtype=torch.int32)
    expanded_x, expanded_row_idx, expanded_expert_idx = ops.npu_moe_init_routing(x, row_idx, expert_idx, 3)
    # stable sort of the row-major experts [1, 2, 0, 1, 0, 2] -> flat positions [2, 4, 0, 3, 1, 5]
    assert expanded_expert_idx.tolist() == [0, 0, 1, 1, 2, 2]
    sorted_rows = [1, 2, 0, 4, 3, 5]  # row_idx values at those positions
    assert [expanded_row_idx[r].item() for r in sorted_rows] == list(range(6))
    torch.testing.assert_close(expanded_x, x[[r % 3 for r in sorted_rows]])
    assert ops.npu_moe_init_routing(x, row_idx, expert_idx, 1)[0].shape == (2, 4)  # min(N, active) * K rows
    expect("row_idx", ops.npu_moe_init_routing, x, torch.zeros(3, 2, dtype=torch.int32), expert_idx, 3)
    expect("expert_idx", ops.npu_moe_init_routing, x, row_idx, expert_idx.long(), 3)


def test_compute_expert_tokens_doc_example():
    out = ops.npu_moe_compute_expert_tokens(torch.tensor([3, 3, 4, 5, 6, 7], dtype=torch.int32), 5)
    assert out.tolist() == [0, 0, 0, 2, 3] and out.dtype == torch.int32
    expect("sorted_expert_for_source_row", ops.npu_moe_compute_expert_tokens,
           torch.tensor([2, 1], dtype=torch.int32), 3)


@pytest.mark.parametrize("mode", [0, 2])
def test_finalize_routing_matches_the_doc_formula(mode):
    n, k, h, e = 5, 3, 4, 6
    rows, scales = randn(n * k, h), randn(n, k)
    skip1, skip2, bias = randn(n, h), randn(n, h), randn(e, h)
    src = torch.randperm(n * k, generator=GEN).to(torch.int32)
    experts = torch.randint(0, e, (n, k), generator=GEN, dtype=torch.int32)
    out = ops.npu_moe_finalize_routing(rows, skip1, skip2, bias, scales, src, experts, drop_pad_mode=mode)
    want = skip1 + skip2
    for i in range(n):
        for j in range(k):
            dst = src[i + j * n] if mode == 0 else src[i * k + j]
            want[i] += scales[i, j] * (rows[dst] + bias[experts[i, j]])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    f = ops.npu_moe_finalize_routing
    expect("drop_pad_mode", f, rows, None, None, None, scales, src, None, drop_pad_mode=1, error=UnemulatedFeatureError)
    expect("scales", f, rows, None, None, None, None, src, None, error=UnemulatedFeatureError)
    expect("export_for_source_row", f, rows, None, None, bias, scales, src, None)
    expect("expanded_src_to_dst_row", f, rows, None, None, None, scales, src[:-1], None)


@pytest.mark.parametrize("reading", ["added", "ignored", "rejected"])
def test_finalize_skip1_without_skip2_follows_the_device_reading(reading):
    """The doc forbids skip1 without skip2, upstream DeepSeek passes it: the emulator follows the switch and
    notes the question as consulted (the checkout mode sweeps what a run consulted)."""
    n, k, h = 4, 2, 8
    rows, scales, skip1 = randn(n * k, h), randn(n, k), randn(n, h)
    src = torch.randperm(n * k, generator=GEN).to(torch.int32)
    f = ops.npu_moe_finalize_routing
    with consulted_questions() as seen:
        base = f(rows, None, None, None, scales, src, None)
        assert not seen  # the documented forms consult nothing
        with device_readings(DeviceReadings(finalize_skip1_alone=reading)):
            if reading == "rejected":
                expect("skip2", f, rows, skip1, None, None, scales, src, None)
            else:
                out = f(rows, skip1, None, None, scales, src, None)
                torch.testing.assert_close(out, base + skip1 if reading == "added" else base, atol=1e-6, rtol=0)
            expect("skip1", f, rows, skip1[:-1], None, None, scales, src, None)  # shape checked under every reading
    assert seen == {"finalize_skip1_alone"}


def test_consulted_questions_nest_and_each_block_keeps_its_own():
    """An inner block sees only what was consulted inside it; the outer keeps collecting after the inner ends
    (also when both sets hold the same questions when the inner one closes)."""
    from model_infer_kvcache.validators.npu_ops.readings import consult

    with consulted_questions() as outer:
        consult("finalize_skip1_alone")
        with consulted_questions() as inner:
            consult("finalize_skip1_alone")
        assert inner == {"finalize_skip1_alone"}
        consult("repeated_slots")
        assert outer == {"finalize_skip1_alone", "repeated_slots"}
        with consulted_questions() as second:
            pass
        assert second == set()
    consult("repeated_slots")  # no block open: nothing collects, nothing fails
    assert outer == {"finalize_skip1_alone", "repeated_slots"} and inner == {"finalize_skip1_alone"}


def _moe_reference(x, weights, experts, expert_fn):
    """Per token: sum_k weight * expert_k(x) - the transformers MoE block's arithmetic."""
    out = torch.zeros(x.shape[0], expert_fn(0, x[:1]).shape[-1])
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            out[t] += weights[t, j] * expert_fn(int(experts[t, j]), x[t:t + 1])[0]
    return out


def test_gpt_oss_routing_chain_equals_per_token_experts():
    n, h, e, k, inter = 7, 8, 4, 2, 6
    x, logits = randn(n, h), randn(n, e)
    w_up, b_up = randn(e, h, inter), randn(e, inter)
    topk, idx, row_idx = ops.npu_moe_gating_top_k_softmax(logits, None, k=k)
    weights = topk / topk.sum(-1, keepdim=True)
    expanded_x, expanded_row_idx, expanded_expert_idx = ops.npu_moe_init_routing(x, row_idx, idx, n)
    tokens = ops.npu_moe_compute_expert_tokens(expanded_expert_idx, e).to(torch.int64)
    y = ops.npu_grouped_matmul([expanded_x], [w_up], group_list=tokens, split_item=3, group_type=0,
                               bias=[b_up])[0]
    out = ops.npu_moe_finalize_routing(torch.tanh(y), None, None, None, weights, expanded_row_idx, idx)
    want = _moe_reference(x, weights, idx, lambda ex, v: torch.tanh(v @ w_up[ex] + b_up[ex]))
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)


def test_qwen3_moe_routing_chain_equals_per_token_swiglu_experts():
    n, h, e, k, inter = 6, 8, 5, 2, 4
    x, logits = randn(n, h), randn(n, e)
    w13, w2 = randn(e, h, 2 * inter), randn(e, inter, h)
    topk, idx, _ = ops.npu_moe_gating_top_k_softmax(logits, None, k=k)
    weights = topk / (topk.sum(-1, keepdim=True) + 1e-20)
    expanded_x, expanded_row_idx, counts, _ = ops.npu_moe_init_routing_v2(
        x, idx, active_num=n * k, expert_num=e, expert_tokens_num_type=1, expert_tokens_num_flag=True,
        active_expert_range=[0, e], quant_mode=-1)
    assert counts.dtype == torch.int64 and counts.tolist() == torch.bincount(idx.flatten().long(), minlength=e).tolist()
    mid = ops.npu_grouped_matmul([expanded_x], [w13], group_list=counts, group_type=0, group_list_type=1,
                                 split_item=3)[0]
    out = ops.npu_grouped_matmul([ops.npu_swiglu(mid)], [w2], group_list=counts, group_type=0, group_list_type=1,
                                 split_item=3)[0]
    out = ops.npu_moe_finalize_routing(out, None, None, None, weights, expanded_row_idx, None, drop_pad_mode=2)

    def expert(ex, v):
        gate, up = (v @ w13[ex]).chunk(2, -1)
        return (F.silu(gate) * up) @ w2[ex]

    torch.testing.assert_close(out, _moe_reference(x, weights, idx, expert), atol=1e-4, rtol=0)


def test_init_routing_v2_refuses_what_it_does_not_emulate():
    x, idx = randn(2, 8), torch.tensor([[0, 1], [1, 2]], dtype=torch.int32)
    ok = dict(active_num=4, expert_num=3, expert_tokens_num_type=1, expert_tokens_num_flag=True, quant_mode=-1,
              active_expert_range=[0, 3])
    f = ops.npu_moe_init_routing_v2
    expect("quant_mode", f, x, idx, **{**ok, "quant_mode": 1}, error=UnemulatedFeatureError)
    expect("quant_mode", f, x, idx, **{**ok, "quant_mode": 5})
    expect("active_num", f, x, idx, **{**ok, "active_num": 3})
    expect("active_expert_range", f, x, idx, **{**ok, "active_expert_range": [0, 2]}, error=UnemulatedFeatureError)
    expect("active_expert_range", f, x, idx, **{**ok, "active_expert_range": [2, 1]})
    expect("expert_tokens_num_flag", f, x, idx, **{**ok, "expert_tokens_num_flag": False}, error=UnemulatedFeatureError)
    expect("expert_tokens_num_type", f, x, idx, **{**ok, "expert_tokens_num_type": 0}, error=UnemulatedFeatureError)
    expect("expert_idx", f, x, idx + 2, **ok)  # expert id 3 is not below expert_num 3


# --------------------------------------------------------------------------- matmuls
def test_grouped_matmul_groups_rows_and_poisons_uncovered_rows():
    x, w = randn(6, 4), randn(3, 4, 5)
    cum = ops.npu_grouped_matmul([x], [w], group_list=torch.tensor([2, 2, 5]), group_type=0, split_item=2)[0]
    counts = ops.npu_grouped_matmul([x], [w], group_list=torch.tensor([2, 0, 3]), group_type=0,
                                    group_list_type=1, split_item=2)[0]
    want = torch.cat([x[:2] @ w[0], x[2:5] @ w[2]])
    torch.testing.assert_close(cum[:5], want, atol=1e-6, rtol=0)
    torch.testing.assert_close(counts[:5], want, atol=1e-6, rtol=0)
    assert torch.isnan(cum[5]).all()  # row 5 is in no group: undefined on the device
    f = ops.npu_grouped_matmul
    g = torch.tensor([2, 2, 5])
    expect("group_list", f, [x], [w], group_list=torch.tensor([3, 2, 5]), group_type=0)
    expect("group_list", f, [x], [w], group_list=torch.tensor([2, 5]), group_type=0)
    expect("group_list", f, [x], [w], group_list=[2, 2, 5], group_type=0, error=UnemulatedFeatureError)
    expect("group_list", f, [x], [w], group_list=torch.tensor([2, 2, 7]), group_type=0)
    expect("group_type", f, [x], [w], group_list=g, group_type=1, error=UnemulatedFeatureError)
    expect("scale", f, [x], [w], group_list=g, group_type=0, scale=[torch.ones(5)], error=UnemulatedFeatureError)
    expect("x", f, [x, x], [w], group_list=g, group_type=0, error=UnemulatedFeatureError)
    expect("weight", f, [x], [randn(3, 5, 5)], group_list=g, group_type=0)
    expect("bias", f, [x], [w], group_list=g, group_type=0, bias=[randn(3, 4)])


def test_transpose_batchmatmul_deepseek_absorb_form():
    t, n, d, r = 5, 3, 4, 6
    q, wk = randn(t, n, d), randn(n, d, r)
    out = ops.npu_transpose_batchmatmul(q, wk, bias=None, scale=None, perm_x1=(1, 0, 2), perm_x2=(0, 1, 2),
                                        perm_y=(1, 0, 2))
    torch.testing.assert_close(out, torch.einsum("tnd,ndr->tnr", q, wk), atol=1e-6, rtol=0)
    f = ops.npu_transpose_batchmatmul
    expect("perm_x1", f, q, wk, perm_x1=(1, 1, 2))
    # torch_npu's meta registration: perm_y only [1, 0, 2] (also its default), perm_x2 only [0, 1, 2]
    expect("perm_y", f, q, wk, perm_x1=(1, 0, 2), perm_y=(0, 1, 2))
    expect("perm_x2", f, q, wk.transpose(1, 2).contiguous(), perm_x1=(1, 0, 2), perm_x2=(0, 2, 1))
    torch.testing.assert_close(f(q, wk, perm_x1=(1, 0, 2)), out, atol=0, rtol=0)  # perm_y None: [1, 0, 2]
    expect("weight", f, q, wk)  # without perm_x1 the batch axes do not match
    expect("bias", f, q, wk, bias=torch.ones(r), perm_x1=(1, 0, 2), error=UnemulatedFeatureError)
    expect("batch_split_factor", f, q, wk, perm_x1=(1, 0, 2), batch_split_factor=2, error=UnemulatedFeatureError)


# --------------------------------------------------------------------------- EP = 1 communication
def test_re_routing_goes_expert_major_and_its_index_inverts_by_argsort():
    counts = torch.tensor([[1, 0, 2], [2, 1, 0]])  # rank 0: e0 x1, e2 x2; rank 1: e0 x2, e1 x1
    tokens = torch.arange(6, dtype=torch.float32).view(6, 1).expand(6, 4).contiguous()
    out, scales, idx, per_expert = ops.npu_moe_re_routing(tokens, counts)
    # rank-major input rows: r0e0=[0], r0e2=[1, 2], r1e0=[3, 4], r1e1=[5]
    assert idx.tolist() == [0, 3, 4, 5, 1, 2] and torch.equal(out[:, 0], idx.float())
    assert per_expert.tolist() == [3, 1, 2] and torch.isnan(scales).all()
    restored = out.index_select(0, idx.float().argsort().int())  # what the recipes do after the experts
    assert torch.equal(restored, tokens)
    given = torch.arange(6, dtype=torch.float32)
    assert torch.equal(ops.npu_moe_re_routing(tokens, counts, per_token_scales=given)[1], given[idx.long()])
    expect("per_token_scales", ops.npu_moe_re_routing, tokens, counts, per_token_scales=given[:5])
    expect("expert_token_num_per_rank", ops.npu_moe_re_routing, tokens, torch.tensor([[1, 1]]))
    expect("idx_type", ops.npu_moe_re_routing, tokens, counts, idx_type=1, error=UnemulatedFeatureError)


def test_single_rank_dispatch_experts_combine_equals_per_token_experts():
    n, h, e, k, inter = 5, 8, 4, 2, 3
    x, logits = randn(n, h), randn(n, e)
    w13, w2 = randn(e, h, 2 * inter), randn(e, inter, h)
    topk, idx, _ = ops.npu_moe_gating_top_k_softmax(logits, None, k=k)
    common = dict(ep_world_size=1, ep_rank_id=0, moe_expert_num=e, group_ep="ep", tp_world_size=1, tp_rank_id=0,
                  shared_expert_num=0, shared_expert_rank_num=0, expert_shard_type=0, global_bs=0)
    expand_x, _, expand_idx, tokens, ep_counts, tp_counts, _ = ops.npu_moe_distribute_dispatch_v2(
        x=x, expert_ids=idx, x_active_mask=None, scales=None, quant_mode=0, comm_alg="fullmesh_v2", **common)
    assert expand_x.shape == (n * k, h) and tokens.dtype == torch.int64 and tp_counts.tolist() == [n * k]
    mid = ops.npu_grouped_matmul([expand_x], [w13], group_list=tokens, group_type=0, group_list_type=1,
                                 split_item=3)[0]
    y = ops.npu_grouped_matmul([ops.npu_swiglu(mid)], [w2], group_list=tokens, group_type=0, group_list_type=1,
                               split_item=3)[0]
    out = ops.npu_moe_distribute_combine_v2(expand_x=y, expert_ids=idx, assist_info_for_combine=expand_idx,
                                            expert_scales=topk.float(), ep_send_counts=ep_counts,
                                            tp_send_counts=tp_counts, x_active_mask=None, comm_quant_mode=0, **common)

    def expert(ex, v):
        gate, up = (v @ w13[ex]).chunk(2, -1)
        return (F.silu(gate) * up) @ w2[ex]

    torch.testing.assert_close(out, _moe_reference(x, topk, idx, expert), atol=1e-4, rtol=0)
    f = ops.npu_moe_distribute_dispatch_v2
    expect("ep_world_size", f, x, idx, "ep", 2, 0, e, error=UnemulatedFeatureError)
    expect("quant_mode", f, x, idx, "ep", 1, 0, e, quant_mode=2, error=UnemulatedFeatureError)
    expect("expert_scales", f, x, idx, "ep", 1, 0, e, expert_scales=topk.float(), error=UnemulatedFeatureError)
    expect("expert_ids", f, x, idx + e, "ep", 1, 0, e)
    g = ops.npu_moe_distribute_combine_v2
    expect("expert_scales", g, y, idx, expand_idx, ep_counts, topk.double(), "ep", 1, 0, e)  # must be float32
    expect("assist_info_for_combine", g, y, idx, expand_idx[:3], ep_counts, topk.float(), "ep", 1, 0, e)


def test_combine_adds_the_shared_experts_output_once():
    """shared_expert_x (the model's own shared-expert output, upstream bailing_2_5): added to each token's weighted
    sum once, unweighted (ops-transformer's combine kernel, AddSharedExpertX); its shape and dtype are checked."""
    n, h, e, k = 4, 8, 4, 2
    x, shared = randn(n, h), randn(n, h)
    idx = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0]], dtype=torch.int32)
    scales = torch.rand(n, k, generator=GEN) * 2  # not summing to 1: the shared output is still added once
    expand_x, _, expand_idx, _, ep_counts, *_ = ops.npu_moe_distribute_dispatch_v2(x, idx, "ep", 1, 0, e)
    y = expand_x * 3.0
    plain = ops.npu_moe_distribute_combine_v2(y, idx, expand_idx, ep_counts, scales, "ep", 1, 0, e)
    out = ops.npu_moe_distribute_combine_v2(y, idx, expand_idx, ep_counts, scales, "ep", 1, 0, e,
                                            shared_expert_x=shared)
    torch.testing.assert_close(out, plain + shared)
    torch.testing.assert_close(plain, (scales.unsqueeze(-1) * 3.0 * x.unsqueeze(1)).sum(1))
    g = ops.npu_moe_distribute_combine_v2
    expect("shared_expert_x", g, y, idx, expand_idx, ep_counts, scales, "ep", 1, 0, e, shared_expert_x=shared[:3])
    expect("shared_expert_x", g, y, idx, expand_idx, ep_counts, scales, "ep", 1, 0, e,
           shared_expert_x=shared.double())


def _two_rank_moe(rank: int, port: int) -> None:
    """One of two gloo ranks: dispatch over EP 2 (each rank owns 2 of 4 experts), the local experts, combine;
    each rank's tokens must come back as the per-token MoE computed from every expert's weights."""
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        g = torch.Generator().manual_seed(0)
        n, h, e, k = 3, 8, 4, 2
        weights = torch.randn(e, h, h, generator=g)  # expert j: x @ weights[j]
        xs = [torch.randn(n, h, generator=g) for _ in range(2)]
        ids = [torch.tensor([[0, 3], [2, 1], [3, 2]], dtype=torch.int32), torch.tensor([[1, 0], [0, 2], [3, 1]],
                                                                                      dtype=torch.int32)]
        scales = [torch.rand(n, k, generator=g) for _ in range(2)]
        shared = [torch.randn(n, h, generator=g) for _ in range(2)]
        x, idx = xs[rank], ids[rank]
        expand_x, _, expand_idx, counts, recv, tp_recv, _ = ops.npu_moe_distribute_dispatch_v2(
            x, idx, None, 2, rank, e, shared_expert_num=0)
        assert expand_x.shape == (n * 2 * 2, h) and counts.tolist() == [
            sum(int((t == 2 * rank + j).sum()) for t in ids) for j in range(2)]
        out_rows = expand_x.clone()
        start = 0
        for j, c in enumerate(counts.tolist()):  # the local experts, rows grouped by expert
            out_rows[start:start + c] = expand_x[start:start + c] @ weights[2 * rank + j]
            start += c
        out = ops.npu_moe_distribute_combine_v2(out_rows, idx, expand_idx, recv, scales[rank], None, 2, rank, e,
                                                tp_send_counts=tp_recv, shared_expert_x=shared[rank],
                                                shared_expert_num=0)
        want = torch.stack([sum(scales[rank][i, j] * (x[i] @ weights[int(idx[i, j])]) for j in range(k))
                            for i in range(n)]) + shared[rank]
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    finally:
        dist.destroy_process_group()


def test_dispatch_and_combine_over_two_ep_ranks_return_each_token_its_experts():
    """More than one EP rank (upstream bailing_2_5's MoE at moe_tp_size 1): the EP group is the default process
    group; outside one (no process group here) the call is refused, naming ep_world_size."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(_two_rank_moe, args=(port,), nprocs=2, join=True, start_method="fork")  # no re-import
    x, idx = randn(3, 8), torch.tensor([[0, 1], [1, 2], [2, 3]], dtype=torch.int32)
    expect("ep_world_size", ops.npu_moe_distribute_dispatch_v2, x, idx, "ep", 2, 0, 4, error=UnemulatedFeatureError)


def test_gating_top_k_matches_transformers_deepseek_v3_router():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    e = 16
    config = DeepseekV3Config(hidden_size=e, n_routed_experts=e, n_group=4, topk_group=2, num_experts_per_tok=3,
                              norm_topk_prob=True, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(config)
    logits, bias = randn(9, e), randn(e) * 0.3
    with torch.no_grad():
        router.weight.copy_(torch.eye(e))  # the router's logits are then the input itself
        router.e_score_correction_bias.copy_(bias)
        _, want_w, want_idx = router(logits)
    y, idx, norm = ops.npu_moe_gating_top_k(logits, k=3, bias=bias, k_group=2, group_count=4, group_select_mode=1,
                                            renorm=0, norm_type=1, routed_scaling_factor=2.5, eps=1e-20)
    order = want_idx.argsort(-1)  # transformers does not sort the chosen experts by score
    assert torch.equal(idx.long().sort(-1).values, want_idx.gather(1, order).long())
    torch.testing.assert_close(y.gather(1, idx.long().argsort(-1)), want_w.gather(1, order), atol=1e-6, rtol=0)
    assert torch.isnan(norm).all()  # out_flag False: undefined
    assert torch.equal(ops.npu_moe_gating_top_k(logits, 3, bias=bias, out_flag=True, norm_type=1)[2],
                       torch.sigmoid(logits))
    f = ops.npu_moe_gating_top_k
    expect("group_count", f, logits, 3, group_count=8)  # 16 / 8 = 2 experts per group: not more than 2
    expect("k", f, logits, 9, k_group=2, group_count=4)
    expect("renorm", f, logits, 3, renorm=1, error=UnemulatedFeatureError)
    expect("bias", f, logits, 3, bias=bias.double())
