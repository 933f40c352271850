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


def _rstd(x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """The RMSNorm operators' rstd: x's leading dims, 1 over gamma's."""
    return x.new_empty((*x.shape[:x.dim() - gamma.dim()], *([1] * gamma.dim())), dtype=torch.float32)


def moe_init_routing_v2(x, expert_idx, *, quant_mode=0, expert_num=-1, expert_tokens_num_type=0,
                        active_expert_range=(), **_):
    rows = x.size(0) * expert_idx.size(1)
    experts = (active_expert_range[1] - active_expert_range[0]) if len(active_expert_range) == 2 else expert_num
    counts = (experts,) if expert_tokens_num_type in (0, 1) else (expert_num, 2)
    return (x.new_empty((rows, x.size(1)), dtype=x.dtype if quant_mode == -1 else torch.int8),
            x.new_empty((rows,), dtype=torch.int32), x.new_empty(counts, dtype=torch.int64),
            x.new_empty((rows,), dtype=torch.float32))


def moe_distribute_dispatch_v2(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, scales=None,
                               expert_scales=None, tp_world_size=0, shared_expert_num=1, shared_expert_rank_num=0,
                               quant_mode=0, global_bs=0, **_):
    """The meta registration's expert-parallel rows (shared experts in front, no elastic info)."""
    bs, h, k = x.size(0), x.size(1), expert_ids.size(1)
    global_bs = global_bs or bs * ep_world_size
    if ep_rank_id < shared_expert_rank_num:
        local = 1
        per_shared = shared_expert_rank_num // shared_expert_num
        rows = global_bs // ep_world_size * ((ep_world_size + per_shared - 1) // per_shared)
    else:
        local = moe_expert_num // (ep_world_size - shared_expert_rank_num)
        rows = global_bs * min(local, k)
    tp = max(tp_world_size, 1)
    recv = ep_world_size * local * (tp_world_size if tp_world_size == 2 else 1)
    dtype = torch.int8 if scales is not None or quant_mode != 0 else x.dtype
    expand_scales = x.new_empty((0,), dtype=torch.float32)
    if expert_scales is not None:
        recv = ep_world_size * local + global_bs * 2 * k * (ep_world_size // 8)
        expand_scales = x.new_empty((rows,), dtype=torch.float32)
    return (x.new_empty((rows * tp, h), dtype=dtype), x.new_empty((rows * tp,), dtype=torch.float32),
            x.new_empty((max(bs * k, rows * 128),), dtype=torch.int32), x.new_empty((local,), dtype=torch.int64),
            x.new_empty((recv,), dtype=torch.int32), x.new_empty((tp_world_size,), dtype=torch.int32), expand_scales)


def grouped_matmul(x, weight, *, split_item=0, output_dtype=None, group_list=None, **_):
    """split_item 0: one output per x; 2 / 3: one output of all rows (1, per group_list, is data-dependent)."""
    single = len(weight) == 1 and weight[0].dim() == 3
    n = weight[0].shape[2] if single else weight[0].shape[1]
    dtype = output_dtype if isinstance(output_dtype, torch.dtype) else x[0].dtype
    if split_item == 0:
        return [xi.new_empty((*xi.shape[:-1], n if single else wi.shape[1]), dtype=dtype)
                for xi, wi in zip(x, weight * len(x) if single else weight, strict=False)]
    if split_item in (2, 3):
        rows = sum(xi.shape[0] for xi in x) if split_item == 2 else x[0].shape[0]
        return [x[0].new_empty((rows, n), dtype=dtype)]
    raise NotImplementedError("not supported by kvcache: capturing npu_grouped_matmul with split_item 1 (one output "
                              "per group_list entry: data-dependent shapes)")


def moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                         expert_for_source_row, drop_pad_mode=0, **_):
    if scales is None:
        return torch.empty_like(expanded_permuted_rows)
    hidden = expanded_permuted_rows.size(2 if drop_pad_mode in (1, 3) else 1)
    return expanded_permuted_rows.new_empty((scales.size(0), hidden))


def moe_re_routing(tokens, expert_token_num_per_rank, per_token_scales=None, **_):
    scales = (per_token_scales.new_empty(per_token_scales.shape) if per_token_scales is not None
              else tokens.new_empty((tokens.size(0),), dtype=torch.float32))
    return (torch.empty_like(tokens), scales, tokens.new_empty((tokens.size(0),), dtype=torch.int32),
            expert_token_num_per_rank.new_empty((expert_token_num_per_rank.size(1),)))


def transpose_batchmatmul(input, weight, *, scale=None, perm_x1=None, perm_x2=None, batch_split_factor=1, **_):  # noqa: A002
    """npu_transpose_batchmatmul_meta: [M, B, N] (perm_y [1, 0, 2]); int8 [M, 1, B * N] with a scale."""
    perm_x1, perm_x2 = list(perm_x1 or (0, 1, 2)), list(perm_x2 or (0, 1, 2))
    m, batch, n = input.size(perm_x1.index(1)), input.size(perm_x1.index(0)), weight.size(perm_x2.index(2))
    if scale is not None:
        return input.new_empty((m, 1, batch * n), dtype=torch.int8)
    if batch_split_factor and batch_split_factor > 1:
        return input.new_empty((batch_split_factor, m, batch * n // batch_split_factor))
    return input.new_empty((m, batch, n))


def mla_prolog_v3(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq, rmsnorm_gamma_ckv,
                  rope_sin, rope_cos, kv_cache, kr_cache, *, query_norm_flag=False, **_):
    """npu_mla_prolog_v3_forward's shapes: query [.., N, Hckv], query_rope [.., N, Dr], the reserved scales (1,) (the
    emulation's reading of the pre-8.5 CANN placeholders) and query_norm [.., Hcq] only with query_norm_flag; in
    token_x's dtype, as the emulation returns them (the meta's bfloat16 query_rope is the device's compute dtype)."""
    lead = tuple(token_x.shape[:-1])
    n, hckv, dr = weight_uk.size(0), weight_uk.size(2), rope_sin.size(-1)
    query_norm = token_x.new_empty((*lead, weight_dq.size(1))) if query_norm_flag else token_x.new_empty((1,))
    return (token_x.new_empty((*lead, n, hckv)), token_x.new_empty((*lead, n, dr)),
            token_x.new_empty((1,), dtype=torch.float32), query_norm, token_x.new_empty((1,), dtype=torch.float32))


def lightning_indexer(query, key, weights, *, layout_query="BSND", layout_key="BSND", sparse_count=2048, **_):
    """npu_lightning_indexer_forward: int32 indices [B, S1, N2, k] (BSND) or [T1, N2, k]; no values."""
    n2 = key.size(1 if layout_key == "TND" else 2)
    shape = (query.size(0), query.size(1), n2, sparse_count) if layout_query == "BSND" else \
        (query.size(0), n2, sparse_count)
    return query.new_empty(shape, dtype=torch.int32), query.new_empty((0,))


def sparse_flash_attention(query, key, value, sparse_indices, scale_value, **_):
    """npu_sparse_flash_attention_forward: the output takes the query's shape; no softmax max / sum."""
    return (query.new_empty(query.shape), query.new_empty((0,), dtype=torch.float32),
            query.new_empty((0,), dtype=torch.float32))


def _halved(x: torch.Tensor, dim: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = shape[dim] // 2
    return x.new_empty(shape)


# What a capture says when an operator's int-list argument was given a device tensor (graph_capture.py finds it).
HOST_INTS = "a device tensor given for host ints"


def checked(name: str, rule):
    """The shape rule behind a check the device graph implies: an int-list (``SymInt[]``) argument given a device
    tensor arrives here as data-dependent symbols (the tensor was read back element by element). Eager torch_npu
    accepts that with a host sync; inside a captured step it is a read the device graph cannot replay."""

    def fake(*args, **kwargs):
        for key, value in [*enumerate(args), *kwargs.items()]:
            if isinstance(value, (list, tuple)) and any(_read_for_this_call(v) for v in value):
                where = f"{key}=" if isinstance(key, str) else f"argument {key}"
                raise ValueError(f"{HOST_INTS}: {where} of torch_npu.{name} is SymInt[]; a tensor there is read "
                                 "back on the host inside the captured step, a sync the device graph cannot replay "
                                 "(pass a host list, as the engine fills actual_seq_lengths_list_kv)")
        return rule(*args, **kwargs)

    fake.__name__ = getattr(rule, "__name__", name)
    return fake


def _read_for_this_call(value) -> bool:
    """A data-dependent symbol made for this call (pending: no graph node holds it yet), i.e. by converting a tensor
    argument; one the model's own ``.tolist()`` made is a node already, found at its line by the capture."""
    if not isinstance(value, torch.SymInt):
        return False
    pending = {str(s) for s in getattr(value.node.shape_env, "pending_fresh_unbacked_symbols", ())}
    return any(str(s) in pending for s in value.node.expr.free_symbols)


# operator -> its shape rule (the operators the rendered decode steps call; extend with the op, never elsewhere)
FAKE_SHAPES = {
    "npu_fused_infer_attention_score": fused_infer_attention_score,
    "npu_fused_infer_attention_score_v2": fused_infer_attention_score_v2,
    "npu_scatter_nd_update_": lambda self, indices, updates: self,
    "npu_scatter_nd_update": lambda self, indices, updates: torch.empty_like(self),
    "scatter_update_": lambda self, indices, updates, axis: self,
    "scatter_update": lambda self, indices, updates, axis: torch.empty_like(self),
    "npu_interleave_rope": lambda x, cos, sin: torch.empty_like(x),
    "npu_rotary_mul": lambda embedding, cosine, sine, mode="half", **_: torch.empty_like(embedding),
    "npu_kv_rmsnorm_rope_cache": kv_rmsnorm_rope_cache,
    "npu_mla_prolog_v3": mla_prolog_v3,
    "npu_lightning_indexer": lightning_indexer,
    # the gated delta rule: output shaped as value (the meta's bfloat16 is the device's dtype; the emulation keeps the
    # run's), the chunked form also the final state
    "npu_recurrent_gated_delta_rule": lambda query, key, value, state, **_: value.new_empty(value.shape),
    "npu_chunk_gated_delta_rule": lambda query, key, value, *, initial_state=None, **_: (
        value.new_empty(value.shape), initial_state.new_empty(initial_state.shape)),
    "npu_sparse_flash_attention": sparse_flash_attention,
    # v2 writes the caches in place and returns only k_rope and c_kv (npu_kv_rmsnorm_rope_cache_v2_meta)
    "npu_kv_rmsnorm_rope_cache_v2": lambda *args, **kwargs: kv_rmsnorm_rope_cache(*args, **kwargs)[2:],
    "npu_rms_norm": lambda x, gamma, epsilon=1e-6: (torch.empty_like(x), _rstd(x, gamma)),
    "npu_add_rms_norm": lambda x1, x2, gamma, epsilon=1e-6: (torch.empty_like(x1), _rstd(x1, gamma),
                                                            torch.empty_like(x1)),
    "npu_apply_rotary_pos_emb": lambda query, key, cos, sin, layout="BSH", rotary_mode="half": (
        torch.empty_like(query), torch.empty_like(key)),
    "npu_swiglu": lambda x, dim=-1: _halved(x, dim),
    "npu_moe_gating_top_k_softmax": lambda x, finished=None, k=1: (
        x.new_empty((*x.shape[:-1], k)), x.new_empty((*x.shape[:-1], k), dtype=torch.int32),
        x.new_empty((*x.shape[:-1], k), dtype=torch.int32)),
    "npu_moe_gating_top_k": lambda x, k=1, bias=None, *args, **kwargs: (
        x.new_empty((x.size(0), k)), x.new_empty((x.size(0), k), dtype=torch.int32),
        x.new_empty((x.size(0), x.size(1)), dtype=torch.float32)),
    "npu_moe_init_routing_v2": moe_init_routing_v2,
    "npu_moe_distribute_dispatch_v2": moe_distribute_dispatch_v2,
    "npu_moe_distribute_combine_v2": lambda expand_x, expert_ids, *args, **kwargs: expand_x.new_empty(
        (expert_ids.size(0), expand_x.size(1))),
    "npu_grouped_matmul": grouped_matmul,
    "npu_transpose_batchmatmul": transpose_batchmatmul,
    "npu_moe_finalize_routing": moe_finalize_routing,
    "npu_moe_re_routing": moe_re_routing,
}
