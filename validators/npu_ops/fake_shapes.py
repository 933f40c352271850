"""Output shapes of the emulated operators without running them: what a graph capture traces through.

A captured decode step (``torch.compile``, as the framework's ``npugraph_ex`` / ``ge_graph`` modes do) sees each
``torch.ops.npu`` operator as one node and asks only for its outputs' shapes and dtypes, as the device graph
does; the emulation itself runs when the graph replays. The rules follow torch_npu's own meta registrations
(``torch_npu/op_plugin/meta/_meta_registrations.py`` of the pinned releases): an operator without a rule here
cannot be captured, and a capture that reaches it says so by name.
"""

from __future__ import annotations

import torch

# The packed query layouts; a combined input_layout names query then output (TND_NTD: TND in, NTD out).
_PACKED = ("TND", "NTD")


def _split_layout(input_layout: str) -> tuple[str, str]:
    query, _, out = input_layout.partition("_")
    return query, out or query


def _value_dim(value: torch.Tensor, query_layout: str, num_kv_heads: int, paged: bool) -> int:
    """get_value_d of the meta registration: a paged 3-D cache [blocks, block_size, N_kv * D] divides by N_kv."""
    if paged:
        return value.size(2) // num_kv_heads if value.dim() == 3 else value.size(3) if value.dim() == 4 else \
            value.size(2) * value.size(4)
    if query_layout == "BSH":
        return value.size(2) // num_kv_heads
    return value.size(-1)


def _attention_out(query: torch.Tensor, layout: str, num_heads: int, value_d: int) -> torch.Tensor:
    query_layout, out_layout = _split_layout(layout)
    if query_layout in _PACKED:
        t, n = (query.size(0), query.size(1)) if query_layout == "TND" else (query.size(1), query.size(0))
        shape = {"TND": (t, n, value_d), "NTD": (n, t, value_d)}[out_layout]
    else:
        b, s, n = {"BSH": (query.size(0), query.size(1), num_heads),
                   "BSND": (query.size(0), query.size(1), query.size(2)),
                   "BNSD": (query.size(0), query.size(2), query.size(1))}[query_layout]
        shape = {"BSH": (b, s, n * value_d), "BSND": (b, s, n, value_d), "BNSD": (b, n, s, value_d),
                 "NBSD": (n, b, s, value_d)}[out_layout]
    return query.new_empty(shape)


def _lse(query: torch.Tensor, layout: str, num_heads: int, wanted: bool) -> torch.Tensor:
    if not wanted:
        return query.new_empty((0,), dtype=torch.float32)
    query_layout, _ = _split_layout(layout)
    if query_layout in _PACKED:
        t, n = (query.size(0), query.size(1)) if query_layout == "TND" else (query.size(1), query.size(0))
        return query.new_empty((t, n, 1), dtype=torch.float32)
    b, s = query.size(0), query.size(2) if query_layout == "BNSD" else query.size(1)
    return query.new_empty((b, num_heads, s, 1), dtype=torch.float32)


def fused_infer_attention_score(query, key, value, *, block_table=None, num_heads=1, num_key_value_heads=0,
                                input_layout="BSH", softmax_lse_flag=False, **_):
    n_kv = num_key_value_heads or num_heads
    value_d = _value_dim(value, _split_layout(input_layout)[0], n_kv, block_table is not None)
    return (_attention_out(query, input_layout, num_heads, value_d),
            _lse(query, input_layout, num_heads, softmax_lse_flag))


def fused_infer_attention_score_v2(query, key, value, *, block_table=None, num_query_heads=1, num_key_value_heads=0,
                                   input_layout="BSH", return_softmax_lse=False, **_):
    return fused_infer_attention_score(query, key, value, block_table=block_table, num_heads=num_query_heads,
                                       num_key_value_heads=num_key_value_heads, input_layout=input_layout,
                                       softmax_lse_flag=return_softmax_lse)


def kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, *, v=None, **_):
    rope = cos.size(3) if v is None else kv.size(3)
    latent = gamma.size(0) if v is None else v.size(3)
    return (torch.empty_like(k_cache), torch.empty_like(ckv_cache), kv.new_empty((*kv.shape[:3], rope)),
            kv.new_empty((*kv.shape[:3], latent)))


# operator -> its shape rule (the operators the rendered decode steps call; extend with the op, never elsewhere)
FAKE_SHAPES = {
    "npu_fused_infer_attention_score": fused_infer_attention_score,
    "npu_fused_infer_attention_score_v2": fused_infer_attention_score_v2,
    "npu_scatter_nd_update_": lambda self, indices, updates: self,
    "npu_scatter_nd_update": lambda self, indices, updates: torch.empty_like(self),
    "npu_interleave_rope": lambda x, cos, sin: torch.empty_like(x),
    "npu_kv_rmsnorm_rope_cache": kv_rmsnorm_rope_cache,
    "npu_rms_norm": lambda x, gamma, epsilon=1e-6: (torch.empty_like(x), x.new_empty(
        (*x.shape[:x.dim() - gamma.dim()], *([1] * gamma.dim())), dtype=torch.float32)),
}
