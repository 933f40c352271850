"""Matmul operators: ``npu_grouped_matmul`` and ``npu_transpose_batchmatmul`` (torch-npu 2.9.0 docs).

``npu_grouped_matmul`` (non-quantized formula 1, ``y_i = x_i @ weight_i + bias_i``), in the form the
MoE experts use: one ``x [M, K]``, one ``weight [E, K, N]``, ``group_type=0`` (groups along M),
``group_list`` an int64 tensor of E entries (``group_list_type`` 0: cumulative ends, 1: sizes),
``split_item`` 2/3 (one output tensor) or 0/1 (a list with one tensor per weight: here one). Rows past
the last group are not computed by the device; the emulation fills them with NaN so a read shows.
Quantization (scale/offset/antiquant/per-token scales), activations and the ``List[int]`` overload
are refused.

``npu_transpose_batchmatmul``: ``input`` permuted by ``perm_x1`` to ``[B, M, K]``, ``weight`` by
``perm_x2`` to ``[B, K, N]``, batched matmul, result permuted by ``perm_y``; bias and scale
(quantized output) and ``batch_split_factor`` != 1 are refused.
"""

from __future__ import annotations

import torch
from model_infer_kvcache.validators.npu_ops import op_checks as chk
from model_infer_kvcache.validators.npu_ops.errors import NpuOpError, UnemulatedFeatureError


def _one(op: str, name: str, value) -> torch.Tensor:
    if not isinstance(value, (list, tuple)):
        raise NpuOpError(op, name, f"must be a list of tensors, got {type(value).__name__}")
    if len(value) != 1:
        raise UnemulatedFeatureError(op, name, f"{len(value)} tensors: only the single-tensor (MoE) form is emulated")
    return chk.tensor(op, name, value[0])


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                       antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                       activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=None,
                       group_list_type=0, act_type=0, tuning_config=None, output_dtype=None):
    """``[y]`` with ``y[rows of group e] = x[rows of group e] @ weight[e] (+ bias[e])``."""
    op = "npu_grouped_matmul"
    chk.absent(op, scale=scale, offset=offset, antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset,
               per_token_scale=per_token_scale, activation_input=activation_input,
               activation_quant_scale=activation_quant_scale, activation_quant_offset=activation_quant_offset)
    lhs = _one(op, "x", x)
    rhs = _one(op, "weight", weight)
    chk.tensor(op, "x", lhs, dims=(2,), dtypes=chk.FLOAT_DTYPES)
    chk.tensor(op, "weight", rhs, dims=(3,))
    chk.same_dtype(op, "weight", rhs, "x", lhs)
    chk.choice(op, "group_type", group_type, (0,), documented=(-1, 1, None))
    chk.choice(op, "split_item", split_item, (0, 1, 2, 3))
    chk.choice(op, "group_list_type", group_list_type, (0, 1))
    chk.choice(op, "act_type", act_type, (0,), documented=(1, 2, 4, 5))
    if output_dtype is not None and output_dtype != lhs.dtype:
        raise UnemulatedFeatureError(op, "output_dtype", f"{output_dtype} differs from x's {lhs.dtype} (a quantized output)")
    experts, k, n = (int(s) for s in rhs.shape)
    if lhs.shape[1] != k:
        raise NpuOpError(op, "weight", f"shape {tuple(rhs.shape)} needs K = x's last dim {lhs.shape[1]}")
    if isinstance(group_list, (list, tuple)):
        raise UnemulatedFeatureError(op, "group_list", "the List[int] overload is not emulated; pass an int64 tensor")
    groups = chk.tensor(op, "group_list", group_list, dims=(1,), dtypes=(torch.int64,))
    if groups.numel() != experts:
        raise NpuOpError(op, "group_list", f"has {groups.numel()} entries for {experts} weights")
    if bool((groups < 0).any()):
        raise NpuOpError(op, "group_list", "values must be non-negative")
    if group_list_type == 0:
        if groups.numel() > 1 and bool((groups[1:] < groups[:-1]).any()):
            raise NpuOpError(op, "group_list", "group_list_type 0 takes a non-decreasing cumsum")
        ends = groups
    else:
        ends = torch.cumsum(groups, 0)
    rows = int(lhs.shape[0])
    if experts and int(ends[-1]) > rows:
        raise NpuOpError(op, "group_list", f"groups cover {int(ends[-1])} rows, x has {rows}")
    cdt = chk.compute_dtype(lhs.dtype)
    out = torch.full((rows, n), float("nan"), dtype=cdt)
    biases = None
    if bias is not None:
        biases = _one(op, "bias", bias)
        chk.tensor(op, "bias", biases, dims=(2,), dtypes=chk.FLOAT_DTYPES)
        if tuple(biases.shape) != (experts, n):
            raise NpuOpError(op, "bias", f"shape {tuple(biases.shape)} must be ({experts}, {n})")
    covered = int(ends[-1]) if experts else 0
    # One batched product over the covered rows: the expert of each row, then its weight.
    expert_of_row = torch.searchsorted(ends, torch.arange(covered), right=True)
    xs = lhs[:covered].to(cdt)
    w = rhs.to(cdt)
    y = torch.empty(covered, n, dtype=cdt)
    for e in torch.unique(expert_of_row).tolist():
        sel = expert_of_row == e
        y[sel] = xs[sel] @ w[e]
    if biases is not None:
        y = y + biases.to(cdt)[expert_of_row]
    out[:covered] = y
    return [out.to(lhs.dtype)]


# torch_npu's meta registration of npu_transpose_batchmatmul (op_plugin/meta/_meta_registrations.py, both pinned
# releases): the defaults of None and the only permutations it accepts (the op doc names no other)
TRANSPOSE_BMM_PERMS = {"perm_x1": ((0, 1, 2), ((0, 1, 2), (1, 0, 2))), "perm_x2": ((0, 1, 2), ((0, 1, 2),)),
                       "perm_y": ((1, 0, 2), ((1, 0, 2),))}


def _perm(op: str, name: str, perm) -> tuple[int, ...]:
    default, allowed = TRANSPOSE_BMM_PERMS[name]
    value = default if perm is None else tuple(perm)
    if value not in allowed:
        raise NpuOpError(op, name, f"{list(value)} is not one of {[list(a) for a in allowed]} (torch_npu's meta "
                                   "registration of the op)")
    return value


def npu_transpose_batchmatmul(input, weight, *, bias=None, scale=None, perm_x1=None, perm_x2=None,  # noqa: A002
                              perm_y=None, batch_split_factor=1):
    """``permute(permute(input, perm_x1) @ permute(weight, perm_x2), perm_y)``; None takes the meta registration's
    default (perm_y [1, 0, 2]: the output is [M, B, N])."""
    op = "npu_transpose_batchmatmul"
    chk.tensor(op, "input", input, dims=(3,), dtypes=chk.FLOAT_DTYPES)
    chk.tensor(op, "weight", weight, dims=(3,))
    chk.same_dtype(op, "weight", weight, "input", input)
    chk.absent(op, bias=bias, scale=scale)
    if batch_split_factor not in (1, None):
        raise UnemulatedFeatureError(op, "batch_split_factor", f"{batch_split_factor} is not emulated (only 1)")
    lhs = input.permute(_perm(op, "perm_x1", perm_x1))
    rhs = weight.permute(_perm(op, "perm_x2", perm_x2))
    if lhs.shape[0] != rhs.shape[0] or lhs.shape[2] != rhs.shape[1]:
        raise NpuOpError(op, "weight", f"permuted shapes {tuple(lhs.shape)} @ {tuple(rhs.shape)} do not form "
                                       f"[B, M, K] @ [B, K, N]")
    cdt = chk.compute_dtype(input.dtype)
    y = torch.bmm(lhs.to(cdt), rhs.to(cdt))
    return y.permute(_perm(op, "perm_y", perm_y)).contiguous().to(input.dtype)


OPS = {"npu_grouped_matmul": npu_grouped_matmul, "npu_transpose_batchmatmul": npu_transpose_batchmatmul}
