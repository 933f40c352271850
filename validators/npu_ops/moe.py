"""MoE routing operators (torch-npu 2.9.0 docs, ``_op_plugin_docs.py``):

* ``npu_moe_gating_top_k_softmax``: softmax over experts, then top-k; ``row_idx[i, j] = j * N + i``
  (the layout ``npu_moe_init_routing`` expects, see its doc example);
* ``npu_moe_init_routing``: ``expanded_expert_idx, sorted_row_idx = keyValueSort(expert_idx, row_idx)``,
  ``expanded_row_idx[sorted_row_idx[i]] = i``, ``expanded_x[i] = x[sorted_row_idx[i] % N]``; the sort is
  stable over the row-major flattening of ``expert_idx`` (the documented equivalent numpy program);
* ``npu_moe_compute_expert_tokens``: binary search of each expert's last row in the sorted experts,
  i.e. ``out[e] = #(sorted <= e)`` (a cumsum that ``npu_grouped_matmul`` takes as ``group_list_type=0``);
* ``npu_moe_finalize_routing``: ``out[i] = skip1 + skip2 + sum_k scales[i, k] *
  (rows[src_to_dst[i + k * N]] + bias[expert[i, k]])``; ``drop_pad_mode`` 0 indexes ``src_to_dst``
  column-major (``i + k * N``), 2 row-major (``i * K + k``, the form ``npu_moe_init_routing_v2`` makes);
  skip1 without skip2 (which the doc forbids) follows the device question ``finalize_skip1_alone``;
* ``npu_moe_init_routing_v2`` (non-quantized, dropless, count mode): the same sort over the row-major
  flat index ``f = i * K + k``: ``expanded_row_idx[f] = position of f``, ``expanded_x[p] = x[f // K]``,
  and the token count of every expert of ``active_expert_range``.

* ``npu_moe_gating_top_k`` (DeepSeek ``noaux_tc``): ``norm = sigmoid(x)`` (``norm_type=1``) or
  ``softmax(x)`` (0); experts are chosen on ``norm + bias`` among the ``k_group`` best of
  ``group_count`` groups (group score: max, or sum of the top 2 for ``group_select_mode=1``); the
  weights are ``norm`` at the chosen experts, divided by their sum + ``eps`` for sigmoid, times
  ``routed_scaling_factor`` (the doc's formula and equivalent program; ties keep the lower index).

Quantization, drop/pad (capacity) modes and partial expert ranges (EP > 1) are refused
(``UnemulatedFeatureError``) rather than approximated.
"""

from __future__ import annotations

import torch
from model_infer_kvcache.validators.npu_ops import op_checks as chk
from model_infer_kvcache.validators.npu_ops.errors import NpuOpError, UnemulatedFeatureError
from model_infer_kvcache.validators.npu_ops.readings import consult

INT32 = (torch.int32,)


def _expert_ids(op: str, name: str, expert_idx: torch.Tensor, num_rows: int, experts: int | None) -> torch.Tensor:
    chk.tensor(op, name, expert_idx, dims=(2,), dtypes=INT32)
    if expert_idx.shape[0] != num_rows:
        raise NpuOpError(op, name, f"has {expert_idx.shape[0]} rows, x has {num_rows}")
    if expert_idx.numel() and int(expert_idx.min()) < 0:
        raise NpuOpError(op, name, "expert ids must be >= 0")
    if experts is not None and expert_idx.numel() and int(expert_idx.max()) >= experts:
        raise NpuOpError(op, name, f"expert id {int(expert_idx.max())} is not below the expert count {experts}")
    return expert_idx


def npu_moe_gating_top_k_softmax(x, finished=None, k=1):
    """``(y, expert_idx, row_idx)``: top-k of ``softmax(x)`` along the experts, descending."""
    op = "npu_moe_gating_top_k_softmax"
    chk.tensor(op, "x", x, dims=(2, 3), dtypes=chk.FLOAT_DTYPES)
    chk.absent(op, finished=finished)
    chk.integer(op, "k", k, low=1, high=min(int(x.shape[-1]), 1024))
    probs = torch.softmax(x.to(chk.compute_dtype(x.dtype)), dim=-1)
    values, indices = torch.topk(probs, k, dim=-1, sorted=True)
    rows = x.shape[:-1].numel()
    row_idx = (torch.arange(k, dtype=torch.int32).view(k, 1) * rows
               + torch.arange(rows, dtype=torch.int32).view(1, rows)).t().reshape(*x.shape[:-1], k)
    return values.to(x.dtype), indices.to(torch.int32), row_idx.contiguous()


def npu_moe_init_routing(x, row_idx, expert_idx, active_num):
    """``(expanded_x, expanded_row_idx, expanded_expert_idx)`` (doc formula above)."""
    op = "npu_moe_init_routing"
    chk.tensor(op, "x", x, dims=(2,), dtypes=chk.FLOAT_DTYPES)
    num_rows = int(x.shape[0])
    _expert_ids(op, "expert_idx", expert_idx, num_rows, None)
    chk.tensor(op, "row_idx", row_idx, dims=(2,), dtypes=INT32)
    if row_idx.shape != expert_idx.shape:
        raise NpuOpError(op, "row_idx", f"shape {tuple(row_idx.shape)} must equal expert_idx's "
                                        f"{tuple(expert_idx.shape)}")
    total = expert_idx.numel()
    flat_rows = row_idx.reshape(-1).long()
    if not torch.equal(torch.sort(flat_rows).values, torch.arange(total)):
        raise NpuOpError(op, "row_idx", f"must be a permutation of 0..{total - 1} (gating's row_idx)")
    chk.integer(op, "active_num", active_num, low=0)
    order = torch.argsort(expert_idx.reshape(-1), stable=True)
    expanded_expert_idx = expert_idx.reshape(-1)[order]
    sorted_row_idx = flat_rows[order]
    expanded_row_idx = torch.empty(total, dtype=torch.int32)
    expanded_row_idx[sorted_row_idx] = torch.arange(total, dtype=torch.int32)
    keep = min(num_rows, active_num) * int(expert_idx.shape[1])
    expanded_x = x[sorted_row_idx[:keep] % num_rows]
    return expanded_x, expanded_row_idx, expanded_expert_idx.contiguous()


def npu_moe_compute_expert_tokens(sorted_expert_for_source_row, num_expert):
    """``out[e]``: rows of the sorted expert list up to and including expert ``e``."""
    op = "npu_moe_compute_expert_tokens"
    sorted_experts = chk.tensor(op, "sorted_expert_for_source_row", sorted_expert_for_source_row, dims=(1,),
                                dtypes=INT32)
    chk.integer(op, "num_expert", num_expert, low=1)
    if sorted_experts.numel() > 1 and bool((sorted_experts[1:] < sorted_experts[:-1]).any()):
        # The device binary-searches; an unsorted input gives meaningless counts there.
        raise NpuOpError(op, "sorted_expert_for_source_row", "must be sorted ascending (init_routing's output)")
    experts = torch.arange(num_expert, dtype=sorted_experts.dtype)
    return torch.searchsorted(sorted_experts.contiguous(), experts, right=True).to(sorted_experts.dtype)


def npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                             export_for_source_row, drop_pad_mode=0):
    """``out [N, H]``: each token's expert rows weighted by ``scales`` (+ bias, + skips)."""
    op = "npu_moe_finalize_routing"
    rows = chk.tensor(op, "expanded_permuted_rows", expanded_permuted_rows, dims=(2,), dtypes=chk.FLOAT_DTYPES)
    drop_pad_mode = 0 if drop_pad_mode is None else drop_pad_mode  # `int? drop_pad_mode=0`
    chk.choice(op, "drop_pad_mode", drop_pad_mode, (0, 2), documented=(1, 3))
    if scales is None:
        raise UnemulatedFeatureError(op, "scales", "finalize without scales (K from the attribute k) is not emulated")
    chk.tensor(op, "scales", scales, dims=(2,))
    chk.same_dtype(op, "scales", scales, "expanded_permuted_rows", rows)
    num_rows, k = (int(s) for s in scales.shape)
    src = chk.tensor(op, "expanded_src_to_dst_row", expanded_src_to_dst_row, dims=(1,), dtypes=INT32)
    if src.numel() != num_rows * k or rows.shape[0] != num_rows * k:
        raise NpuOpError(op, "expanded_src_to_dst_row", f"needs NUM_ROWS*K = {num_rows * k} entries and rows "
                                                        f"(got {src.numel()} and {rows.shape[0]})")
    if src.numel() and (int(src.min()) < 0 or int(src.max()) >= num_rows * k):
        raise NpuOpError(op, "expanded_src_to_dst_row", f"values must lie in [0, {num_rows * k - 1}]")
    hidden = int(rows.shape[1])
    for name, skip in (("skip1", skip1), ("skip2", skip2)):
        if skip is not None:
            chk.tensor(op, name, skip, dims=(2,))
            chk.same_dtype(op, name, skip, "expanded_permuted_rows", rows)
            if tuple(skip.shape) != (num_rows, hidden):
                raise NpuOpError(op, name, f"shape {tuple(skip.shape)} must be ({num_rows}, {hidden})")
    if skip2 is None and skip1 is not None:  # the doc forbids it, upstream relies on it: a device question
        reading = consult("finalize_skip1_alone")
        if reading == "rejected":
            raise NpuOpError(op, "skip2", "skip2 None requires skip1 None (the doc's rule; device question "
                                          "finalize_skip1_alone=rejected)")
        if reading == "ignored":
            skip1 = None
    cdt = chk.compute_dtype(rows.dtype)
    out = torch.zeros(num_rows, hidden, dtype=cdt)
    for skip in (skip1, skip2):
        if skip is not None:
            out += skip.to(cdt)
    grid = src.long().view(k, num_rows).t() if drop_pad_mode == 0 else src.long().view(num_rows, k)
    gathered = rows.to(cdt)[grid]  # [N, K, H]
    if bias is not None:
        chk.tensor(op, "bias", bias, dims=(2,))
        chk.same_dtype(op, "bias", bias, "expanded_permuted_rows", rows)
        if export_for_source_row is None:
            raise NpuOpError(op, "export_for_source_row", "bias needs the expert of every (row, k)")
        experts = _expert_ids(op, "export_for_source_row", export_for_source_row, num_rows, int(bias.shape[0]))
        if experts.shape[1] != k or bias.shape[1] != hidden:
            raise NpuOpError(op, "bias", f"shape {tuple(bias.shape)} / experts {tuple(experts.shape)} do not match "
                                         f"K={k}, H={hidden}")
        gathered = gathered + bias.to(cdt)[experts.long()]
    out += (scales.to(cdt).unsqueeze(-1) * gathered).sum(dim=1)
    return out.to(rows.dtype)


def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                            expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0, expert_tokens_num_flag=False,
                            quant_mode=0, active_expert_range=[], row_idx_type=0):  # noqa: B006 - the schema default
    """``(expanded_x, expanded_row_idx, expert_token_count, expanded_scale)`` (non-quantized, count mode)."""
    op = "npu_moe_init_routing_v2"
    chk.tensor(op, "x", x, dims=(2,), dtypes=chk.FLOAT_DTYPES)
    chk.choice(op, "quant_mode", quant_mode, (-1,), documented=(0, 1))
    chk.absent(op, scale=scale, offset=offset)
    chk.choice(op, "drop_pad_mode", drop_pad_mode, (0,), documented=(1,))
    chk.choice(op, "expert_tokens_num_type", expert_tokens_num_type, (1,), documented=(0, 2))
    if expert_tokens_num_flag is not True:
        raise UnemulatedFeatureError(op, "expert_tokens_num_flag", "only True (counts are output) is supported")
    chk.choice(op, "row_idx_type", row_idx_type, (0,), documented=(1,))
    chk.integer(op, "expert_num", expert_num, low=1, high=10240)
    chk.integer(op, "expert_capacity", expert_capacity)
    num_rows = int(x.shape[0])
    _expert_ids(op, "expert_idx", expert_idx, num_rows, expert_num)
    k = int(expert_idx.shape[1])
    chk.integer(op, "active_num", active_num)
    if active_num != num_rows * k:
        raise NpuOpError(op, "active_num", f"must equal NUM_ROWS*K = {num_rows * k}, got {active_num}")
    if list(active_expert_range) != [0, expert_num]:
        if len(active_expert_range) != 2 or not 0 <= active_expert_range[0] < active_expert_range[1] <= expert_num:
            raise NpuOpError(op, "active_expert_range", f"{list(active_expert_range)} is not [start, end] with "
                                                        f"0 <= start < end <= expert_num ({expert_num})")
        raise UnemulatedFeatureError(op, "active_expert_range", "a partial expert range (EP > 1) is not emulated; "
                                                          f"pass [0, {expert_num}]")
    order = torch.argsort(expert_idx.reshape(-1), stable=True)  # sorted position -> flat index i*K+k
    expanded_row_idx = torch.empty(num_rows * k, dtype=torch.int32)
    expanded_row_idx[order] = torch.arange(num_rows * k, dtype=torch.int32)
    expanded_x = x[order // k]
    counts = torch.bincount(expert_idx.reshape(-1).long(), minlength=expert_num).to(torch.int64)
    expanded_scale = torch.full((num_rows * k,), float("nan"), dtype=torch.float32)  # undefined without scale
    return expanded_x, expanded_row_idx, counts, expanded_scale


def npu_moe_gating_top_k(x, k, *, bias=None, k_group=1, group_count=1, group_select_mode=0, renorm=0, norm_type=0,
                         out_flag=False, routed_scaling_factor=1.0, eps=1e-20):
    """``(y, expert_idx, norm_out)``: grouped top-k on ``norm(x) + bias``, weights from ``norm(x)``."""
    op = "npu_moe_gating_top_k"
    chk.tensor(op, "x", x, dims=(2,), dtypes=chk.FLOAT_DTYPES)
    experts = int(x.shape[1])
    if experts > 2048:
        raise NpuOpError(op, "x", f"{experts} experts: at most 2048")
    chk.integer(op, "group_count", group_count, low=1)
    if experts % group_count or experts // group_count <= 2:
        raise NpuOpError(op, "group_count", f"{experts} experts must split into {group_count} groups of more than 2")
    chk.integer(op, "k_group", k_group, low=1, high=group_count)
    chk.integer(op, "k", k, low=1, high=experts // group_count * k_group)
    chk.choice(op, "group_select_mode", group_select_mode, (0, 1))
    chk.choice(op, "renorm", renorm, (0,), documented=(1,))
    chk.choice(op, "norm_type", norm_type, (0, 1))
    if bias is not None:
        chk.tensor(op, "bias", bias, dims=(1,))
        chk.same_dtype(op, "bias", bias, "x", x)
    cdt = chk.compute_dtype(x.dtype)
    norm = torch.sigmoid(x.to(cdt)) if norm_type == 1 else torch.softmax(x.to(cdt), dim=-1)
    idx = grouped_top_k(op, norm, k, bias, k_group, group_count, group_select_mode)
    y = norm.gather(1, idx)
    if norm_type == 1:
        y = y / (y.sum(-1, keepdim=True) + float(eps))
    y = y * float(routed_scaling_factor)
    norm_out = norm.float() if out_flag else torch.full(x.shape, float("nan"), dtype=torch.float32)
    return y.to(x.dtype), idx.to(torch.int32), norm_out


def grouped_top_k(op: str, norm: torch.Tensor, k: int, bias, k_group: int, group_count: int,
                  group_select_mode: int) -> torch.Tensor:
    """The experts a gating top-k picks per row of ``norm [T, e]`` (int64 ``[T, k]``, best first): the ``k_group``
    best of ``group_count`` groups, each scored by its max (mode 0) or its two best (mode 1) of ``norm + bias``, then
    the ``k`` best experts of those groups; ``bias`` steers the choice only. Ties go to the lower index."""
    experts = int(norm.shape[1])
    choice = norm
    if bias is not None:  # (a 1-D tensor of x's dtype: the callers check it)
        if bias.shape[0] != experts:
            raise NpuOpError(op, "bias", f"has {bias.shape[0]} entries for {experts} experts")
        choice = norm + bias.to(norm.dtype)
    if group_count > 1:
        grouped = choice.view(norm.shape[0], group_count, -1)
        score = grouped.amax(-1) if group_select_mode == 0 else grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(score, dtype=torch.bool)
        keep.scatter_(1, torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :k_group], True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(norm.shape[0], -1)
    return torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :k]


OPS = {
    "npu_moe_gating_top_k": npu_moe_gating_top_k,
    "npu_moe_gating_top_k_softmax": npu_moe_gating_top_k_softmax,
    "npu_moe_init_routing": npu_moe_init_routing,
    "npu_moe_compute_expert_tokens": npu_moe_compute_expert_tokens,
    "npu_moe_finalize_routing": npu_moe_finalize_routing,
    "npu_moe_init_routing_v2": npu_moe_init_routing_v2,
}
