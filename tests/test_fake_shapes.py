"""The shape rules a graph capture traces through (validators/npu_ops/fake_shapes.py) give the shapes and dtypes the
emulated operators return when they run (the replay): a rule that disagrees would let a capture pass over a graph
whose replay computes something else, or fail a correct one."""

from __future__ import annotations

import pytest
import torch
from model_infer_kvcache.validators.npu_ops import emulated, install_emulation
from model_infer_kvcache.validators.npu_ops.fake_shapes import FAKE_SHAPES
from test_npu_ops_schema_pin import MODEL_OP_CALLS


def _mla_cache_write(f):
    # DeepSeek's decode write (upstream deepseek_r1): 5 tokens into PA caches, outputs kept (is_output_kv)
    kv, gamma = torch.randn(5, 1, 1, 48), torch.rand(32) + 0.5
    cos, sin = torch.rand(5, 1, 1, 16), torch.rand(5, 1, 1, 16)
    k_cache, ckv_cache = torch.zeros(4, 16, 1, 16), torch.zeros(4, 16, 1, 32)
    return f(kv, gamma, cos, sin, torch.tensor([17, 18, -1, 40, 3]), k_cache, ckv_cache, cache_mode="PA",
             is_output_kv=True)


def _state_write(f):
    # a Legacy / state cache [B, S_max, H] written at each row's offset (qwen3.5's decode, modeling_qwen3_5_moe.py)
    return f(torch.zeros(3, 10, 8), torch.tensor([0, 4, 7]), torch.randn(3, 2, 8), 1)


# The operators with a rule and a sample call (the schema-pin test's model-style calls, the MLA cache writers, the
# offset writers).
CALLS = {**MODEL_OP_CALLS, "npu_kv_rmsnorm_rope_cache": _mla_cache_write,
         "npu_kv_rmsnorm_rope_cache_v2": _mla_cache_write, "scatter_update_": _state_write,
         "scatter_update": _state_write}
SAMPLED = sorted(set(FAKE_SHAPES) & set(CALLS))


def _leaves(value) -> list[tuple[tuple[int, ...], torch.dtype]]:
    if isinstance(value, torch.Tensor):
        return [(tuple(value.shape), value.dtype)]
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _leaves(v)]
    return []


def test_the_rules_cover_the_operators_of_the_rendered_and_upstream_decode_steps():
    # a capture of one of these reaches the rule; the ones with a sample call are compared below
    assert {"npu_fused_infer_attention_score_v2", "npu_transpose_batchmatmul", "npu_kv_rmsnorm_rope_cache_v2"} <= \
        set(FAKE_SHAPES)
    assert len(SAMPLED) >= 10, SAMPLED


@pytest.mark.parametrize("op", SAMPLED)
def test_a_rule_gives_the_shapes_and_dtypes_the_emulation_returns(op):
    from torch._subclasses.fake_tensor import FakeTensorMode

    state = torch.random.get_rng_state()
    real = CALLS[op](emulated.OPS[op])
    torch.random.set_rng_state(state)
    with install_emulation(), FakeTensorMode(allow_non_fake_inputs=True):
        fake = CALLS[op](getattr(torch.ops.npu, op))
    assert _leaves(fake) == _leaves(real), (op, _leaves(fake), _leaves(real))


def test_the_checkout_names_a_gloo_group_with_a_str_as_the_dispatch_schema_takes():
    """The checkout's stand-in for a group's HCCL name: a capture of an MoE dispatch checks its schema's `str group_ep`
    (torch_npu's binding does too); None there stopped upstream longcat_flash's ge_graph capture as if the model
    were wrong."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from model_infer_kvcache.validators.checkout_run.engine_run import _gloo_name

    assert _gloo_name(None) is None  # no group: None, as upstream's get_group_name
    x, ids = torch.randn(4, 8), torch.randint(0, 8, (4, 2), dtype=torch.int32)
    with install_emulation(), FakeTensorMode(allow_non_fake_inputs=True):
        out = torch.ops.npu.npu_moe_distribute_dispatch_v2(x, ids, _gloo_name(object()), 1, 0, 8)
        assert out[0].shape == (8, 8)
        with pytest.raises(RuntimeError, match="Expected a value of type 'str'"):
            torch.ops.npu.npu_moe_distribute_dispatch_v2(x, ids, None, 1, 0, 8)


def test_the_checkouts_half_dtype_mode_lets_a_decode_step_capture():
    """The checkout's HalfDtypesAs (models that cast to bfloat16 by hand compute in the comparison dtype) runs inside
    the captured step too: its rule for ``Tensor.to`` must not compare a tensor with a dtype, which a capture refuses
    (upstream qwen3.5's ``query.to(torch.bfloat16)`` stopped its ge_graph capture as if the model were wrong)."""
    from model_infer_kvcache.validators.checkout_run.engine_run import HalfDtypesAs
    from model_infer_kvcache.validators.standins.device import _NpuDeviceIsCpu

    def step(x):
        return x.to(torch.bfloat16) * 2

    torch._dynamo.reset()
    # as in a checkout run: the stand-ins' device mode below, the half-dtype mode above it
    with _NpuDeviceIsCpu(), HalfDtypesAs(torch.float32):
        out = torch.compile(step, fullgraph=True, backend="eager")(torch.ones(3))
    assert out.dtype == torch.float32 and torch.equal(out, torch.full((3,), 2.0))
