"""The checkout's own AscendC operators emulated from their docs (validators/npu_ops/custom_ops.py, issue 38).

Each result is checked against an independent computation (the interleaved RoPE as a complex rotation of each
lane pair; the scatter as plain row assignment), and each documented argument rule with a call that breaks it.
"""

from __future__ import annotations

import pytest
import torch
from model_infer_kvcache.validators.npu_ops.custom_ops import inplace_partial_rotary_mul, scatter_nd_update_asc
from model_infer_kvcache.validators.npu_ops.errors import NpuOpError, UnemulatedFeatureError


def _tables(b: int, s: int, width: int, per_token: bool):
    """cos / sin tables in the interleaved layout upstream deepseek_v4 builds: each angle twice, one per lane of a
    pair; and the angles themselves."""
    theta = torch.rand(b, s if per_token else 1, 1, width // 2, dtype=torch.float64) * 6.0
    return (theta.cos().repeat_interleave(2, -1), theta.sin().repeat_interleave(2, -1), theta)


@pytest.mark.parametrize("per_token", [False, True])
def test_partial_rotary_rotates_only_the_slice_as_complex_pairs(per_token):
    b, s, n, d, start = 3, 4, 2, 16, 6
    x = torch.randn(b, s, n, d, dtype=torch.float64)
    before = x.clone()
    cos, sin, theta = _tables(b, s, d - start, per_token)
    storage = x.data_ptr()
    inplace_partial_rotary_mul(x, cos, sin, rotary_mode="interleave", partial_slice=[start, d])
    assert x.data_ptr() == storage  # in place
    assert torch.equal(x[..., :start], before[..., :start])  # the nope part untouched
    pairs = torch.view_as_complex(before[..., start:].reshape(b, s, n, -1, 2).contiguous())
    want = torch.view_as_real(pairs * torch.polar(torch.ones_like(theta), theta)).reshape(b, s, n, -1)
    assert torch.allclose(x[..., start:], want, atol=1e-12)


def test_partial_rotary_keeps_x_dtype_with_float32_tables():
    x = torch.randn(2, 1, 1, 8, dtype=torch.bfloat16)
    cos, sin, _ = _tables(2, 1, 4, False)
    ref = x.clone().to(torch.float64)
    inplace_partial_rotary_mul(x, cos.float(), sin.float(), rotary_mode="interleave", partial_slice=[4, 8])
    inplace_partial_rotary_mul(ref, cos, sin, rotary_mode="interleave", partial_slice=[4, 8])
    assert x.dtype == torch.bfloat16 and torch.allclose(x.double(), ref, atol=2e-2)


@pytest.mark.parametrize("mutate, argument", [
    (lambda a: a.update(rotary_mode="half"), "rotary_mode"),  # the doc supports interleave only
    (lambda a: a.update(partial_slice=[5, 16]), "partial_slice"),  # odd slice
    (lambda a: a.update(partial_slice=[8]), "partial_slice"),
    (lambda a: a.update(r1=a["r1"][..., :4].contiguous()), "r1"),  # table narrower than the slice
    (lambda a: a.update(r2=a["r2"].to(torch.float16)), "r2"),  # r1 / r2 dtypes differ
    (lambda a: a.update(r1=a["r1"].expand(2, 3, 1, 8)), "r1"),  # non-contiguous table
    (lambda a: a.update(x=torch.randn(2, 3, 1, 1026)), "x"),  # d above 1024
])
def test_partial_rotary_refuses_what_its_doc_rules_out(mutate, argument):
    args = {"x": torch.randn(2, 3, 1, 16), "r1": torch.randn(2, 1, 1, 8), "r2": torch.randn(2, 1, 1, 8),
            "rotary_mode": "interleave", "partial_slice": [8, 16]}
    mutate(args)
    with pytest.raises(NpuOpError) as info:
        inplace_partial_rotary_mul(args.pop("x"), args.pop("r1"), args.pop("r2"), **args)
    assert info.value.argument == argument, info.value


def test_scatter_writes_rows_and_skips_negative_indices():
    var = torch.zeros(6, 128, dtype=torch.bfloat16)
    update = torch.randn(3, 128).to(torch.bfloat16)
    scatter_nd_update_asc(var, torch.tensor([[4], [-1], [0]], dtype=torch.int32), update)
    assert torch.equal(var[4], update[0]) and torch.equal(var[0], update[2])
    assert not var[[1, 2, 3, 5]].any()  # the skipped update wrote nowhere


@pytest.mark.parametrize("var, indices, update, argument, error", [
    (torch.zeros(4, 64), torch.tensor([[0]]), torch.zeros(1, 64), "var", NpuOpError),  # float32 var
    (torch.zeros(4, 64, dtype=torch.float16), torch.tensor([[0]]), torch.zeros(1, 64, dtype=torch.float16), "var",
     NpuOpError),  # row width 64
    (torch.zeros(4, 128, dtype=torch.float16), torch.tensor([[4]]), torch.zeros(1, 128, dtype=torch.float16),
     "indices", NpuOpError),  # out of range
    (torch.zeros(2, 1, dtype=torch.int8), torch.tensor([[0], [1], [1]]), torch.zeros(3, 1, dtype=torch.int8),
     "indices", NpuOpError),  # more updates than rows
    (torch.zeros(4, 1, dtype=torch.int8), torch.tensor([[1], [1]]), torch.zeros(2, 1, dtype=torch.int8), "indices",
     UnemulatedFeatureError),  # one row updated twice: the doc fixes no order
    (torch.zeros(4, 1, dtype=torch.int8), torch.tensor([[1]]), torch.zeros(1, 1, dtype=torch.float16), "update",
     NpuOpError),  # dtype differs from var
    (torch.zeros(4, 1, dtype=torch.int8), torch.tensor([[1.0]]), torch.zeros(1, 1, dtype=torch.int8), "indices",
     NpuOpError),  # float indices
])
def test_scatter_refuses_what_its_doc_rules_out(var, indices, update, argument, error):
    with pytest.raises(error) as info:
        scatter_nd_update_asc(var, indices, update)
    assert info.value.argument == argument, info.value


def test_the_checkout_stand_ins_answer_with_the_emulations_and_name_the_rest():
    from model_infer_kvcache.validators.npu_ops.errors import UnemulatedOperatorError
    from model_infer_kvcache.validators.standins.device import device_standins

    with device_standins():
        assert torch.ops.custom.scatter_nd_update_asc is scatter_nd_update_asc
        assert not hasattr(torch.ops.custom, "compressor")  # a model's own fallback can probe it
        with pytest.raises(UnemulatedOperatorError, match="torch.ops.custom.compressor"):
            torch.ops.custom.compressor(None)
