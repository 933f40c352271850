"""The snapshot's own shared modules (``module/``) run on the emulated operators: the unquantized
MoE expert path of ``FusedMoEGMM`` (format cast, grouped matmul, swiglu) equals plain per-expert
math, and a quantized layer fails with the one-line message naming the real module line."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from model_infer_kvcache.validators.npu_ops import UnemulatedOperatorError
from model_infer_kvcache.validators.standins import device_standins
from shared_dirs import upstream_head


@pytest.fixture
def snapshot_modules():
    """Import the snapshot's ``module`` package inside the stand-ins; undo sys.path/sys.modules after."""
    root = str(upstream_head())
    # transformers probes `find_spec("torch_npu")` on first import; with the stand-in in sys.modules that
    # raises (no __spec__), and a spec would send transformers down its NPU paths: import it first.
    import transformers.activations  # noqa: F401

    saved = {name: mod for name, mod in sys.modules.items() if name == "module" or name.startswith("module.")}
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, root)
    try:
        with device_standins():
            yield
    finally:
        sys.path.remove(root)
        for name in [n for n in sys.modules if n == "module" or n.startswith("module.")]:
            del sys.modules[name]
        sys.modules.update(saved)


def test_fused_moe_gmm_unquantized_experts_equal_per_expert_swiglu(snapshot_modules):
    from module.fuse_moe_gmm import UnquantizedFusedMoEGMMMethod

    gen = torch.Generator().manual_seed(3)
    experts, hidden, inter = 4, 8, 3
    method = UnquantizedFusedMoEGMMMethod()
    layer = torch.nn.Module()
    method.create_weights(layer, num_experts=experts, hidden_size=hidden, intermediate_size_per_partition=inter,
                          params_dtype=torch.float32)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen)  # checkpoint layout [E, 2I, H]
    w2 = torch.randn(experts, hidden, inter, generator=gen)
    with torch.no_grad():
        layer.w13_weight.copy_(w13)
        layer.w2_weight.copy_(w2)
    method.process_weights_after_loading(layer)  # transpose + npu_format_cast(..., 29)
    counts = torch.tensor([2, 0, 3, 1])
    x = torch.randn(int(counts.sum()), hidden, generator=gen)  # rows already sorted by expert
    out = method.apply(layer, x, counts, group_list_type=1)
    want, start = [], 0
    for e, n in enumerate(counts.tolist()):
        rows = x[start:start + n]
        gate, up = (rows @ w13[e].t()).chunk(2, -1)
        want.append((F.silu(gate) * up) @ w2[e].t())
        start += n
    torch.testing.assert_close(out, torch.cat(want), atol=1e-5, rtol=0)


def test_quantized_layer_fails_with_the_real_module_line(snapshot_modules):
    from module.linear import DynamicW8A8Linear

    source = (upstream_head() / "module" / "linear.py").read_text("utf-8").splitlines()
    line = next(i for i, text in enumerate(source, 1) if "torch_npu.npu_dynamic_quant(x, smooth_scales" in text)
    with pytest.raises(UnemulatedOperatorError) as info:
        DynamicW8A8Linear(4, 4)(torch.ones(2, 4, dtype=torch.bfloat16))
    assert str(info.value) == (f"torch_npu.npu_dynamic_quant is not emulated on CPU (called at module/linear.py:"
                               f"{line}); emulated ops: references/emulated_ops.md")
