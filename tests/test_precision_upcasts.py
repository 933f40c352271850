"""float64 kept float64 in a validation run (validators/pipeline/precision.py): the eager patch and the pass over a
captured graph (graph-mode decode) apply one rule, so a replayed step and its eager twin compute alike."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model_infer_kvcache.validators.pipeline.precision import float64_upcasts, traceable_upcasts, upcast_graph


def _step(x):
    # transformers' half-precision upcasts: RMSNorm's .to(float32), RoPE's .float(), the router's .type(float32),
    # eager attention's softmax(dtype=float32) (functional and method)
    h = x.to(torch.float32)
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    scores = F.softmax(h, dim=-1, dtype=torch.float32) + h.softmax(-1, torch.float32)
    # DeepSeek-V2's RoPE: int positions .float() times the float64 inv_freq .to(dtype=torch.float): float64 under
    # the rule, so the product's own .to(float32) must keep float64 too (the trace saw it float32 throughout)
    freqs = torch.arange(x.shape[-1]).float() * x[0].to(device=x.device, dtype=torch.float)
    return scores + h.float().sin() + h.type(torch.float32).cos() + (freqs * 1.5).to(torch.float32).cos()


def _captured(x, *, rule: bool):
    """The step compiled as the capture compiles it (traceable_upcasts, a backend running the graph as traced), with
    or without the graph pass."""
    def backend(gm, _inputs):
        if rule:
            upcast_graph(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(_step, fullgraph=True, dynamic=False, backend=backend)
    with traceable_upcasts():
        return compiled(x)


def test_a_captured_step_keeps_float64_as_its_eager_twin_does():
    x = torch.randn(3, 16, dtype=torch.float64)
    with float64_upcasts():
        eager = _step(x)
        graph = _captured(x, rule=True)
    assert eager.dtype == graph.dtype == torch.float64
    assert torch.equal(graph, eager)
    # the same step outside the rule rounds to float32 where transformers asks for it
    assert (_step(x) - eager).abs().max() > 1e-9


def test_negative_control_without_the_graph_pass_the_capture_rounds_to_float32():
    x = torch.randn(3, 16, dtype=torch.float64)
    with float64_upcasts():
        eager = _step(x)
        graph = _captured(x, rule=False)
    assert graph.dtype == torch.float32 or (graph - eager).abs().max() > 1e-9


def test_other_dtypes_and_runs_outside_the_rule_are_untouched():
    x = torch.randn(3, 16, dtype=torch.float32)
    with float64_upcasts():
        graph = _captured(x, rule=True)
    assert torch.allclose(graph, _step(x), atol=1e-6) and graph.dtype == torch.float32
    x64 = torch.randn(3, 16, dtype=torch.float64)
    assert torch.equal(_captured(x64, rule=True), _step(x64))  # no float64_upcasts: upcast_graph leaves the graph
