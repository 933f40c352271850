"""Expert-parallel MoE communication operators on a single rank (EP = 1).

``npu_moe_re_routing``, ``npu_moe_distribute_dispatch_v2`` and ``npu_moe_distribute_combine_v2`` have
no doc entry in torch-npu 2.9.0; arguments and output shapes come from the schema and the meta
registration, and the semantics from how the recipes use them (qwen3-moe, DeepSeek at ``moe_tp_size
== 1``):

* ``npu_moe_re_routing(tokens, expert_token_num_per_rank [R, L])``: tokens arrive rank-major (rank
  ``r``'s tokens for its local experts ``0..L-1`` in order); the output is expert-major (expert ``e``:
  rank 0's tokens, rank 1's, ...). ``permute_token_idx[p]`` is the input row of output row ``p``
  (the recipes invert it with ``argsort``); ``expert_token_num`` the per-expert totals;
  ``per_token_scales`` (when given) are permuted with the tokens.
* ``npu_moe_distribute_dispatch_v2`` with ``ep_world_size == 1``: no other rank, so dispatch sorts the
  token copies by expert like ``npu_moe_init_routing_v2`` (stable over ``i * K + k``).
  ``expand_x [A, H]`` (``A = bs * min(experts, K)`` from the meta function; rows past ``bs * K`` are NaN),
  ``expert_token_nums`` the per-expert counts (type 1) or their cumsum (type 0), ``ep_recv_counts`` /
  ``tp_recv_counts`` the counts received. ``expand_idx`` (``assist_info_for_combine``) is an opaque
  handle on the device; here its first ``bs * K`` entries are the ``expand_x`` row of copy
  ``i * K + k`` and the emulated combine reads exactly that.
* ``npu_moe_distribute_combine_v2``: ``out[i] = sum_k expert_scales[i, k] * expand_x[row of (i, k)]``.

* Copy experts (``copy_expert_num``, LongCat-Flash's identity "zero experts", ids
  ``moe_expert_num .. moe_expert_num + copy_expert_num - 1``): no doc entry in 2.9.0 or 2.14.0 either; as
  LongCat-Flash uses them (its prefill path adds ``moe_input * identity_weight``): dispatch sends
  only the routed copies (``expand_x``, counts and ``ep_recv_counts`` cover ``moe_expert_num`` experts; a
  copy expert's ``expand_idx`` entry is ``-1``), and combine adds ``expert_scales[i, k] * ori_x[i]`` for
  each copy-expert choice, so ``ori_x`` is required with copy experts.

* ``shared_expert_x`` (combine): the shared experts' output, computed by the model, added once to every token's
  sum (ops-transformer ``mc2/moe_distribute_combine_v2`` kernel ``AddSharedExpertX``: an unweighted ``Add``; the
  doc's formula writes it inside the ``expertScales`` sum, which is the same when a token's scales sum to 1).

* More than one EP rank (``ep_world_size = W > 1``, upstream bailing_2_5 at ``moe_tp_size 1``): the EP group must
  be the whole default process group (the validator's gloo ranks; ``group_ep`` names an HCCL domain, which a gloo
  run does not have), every rank dispatching the same ``bs``. Expert ``e`` lives on rank ``e // (E / W)``. Dispatch
  gathers every rank's tokens and keeps the copies of its local experts, ordered by local expert, then source rank,
  then copy ``i * K + k``: ``expand_x`` rows (``A = bs * W * min(E / W, K)`` from the meta function, NaN past the
  received ones), ``expert_token_nums`` per local expert. ``expand_idx`` and ``ep_recv_counts`` are opaque handles
  on the device (the model hands them to combine unchanged); here ``expand_idx[p] = source rank * bs * K + copy``
  for each received row ``p`` and ``ep_recv_counts[l * W + s]`` counts local expert ``l``'s copies from rank
  ``s``. Combine sends each row back to its source rank (all-to-all) and sums as on one rank.

Quantization, TP-domain communication (``tp_world_size 2``), shared experts on their own ranks, masks and the zero
/ constant experts are refused; copy experts only on one EP rank.
"""

from __future__ import annotations

import torch
from model_infer_kvcache.validators.npu_ops import op_checks as chk
from model_infer_kvcache.validators.npu_ops.errors import NpuOpError, UnemulatedFeatureError


def npu_moe_re_routing(tokens, expert_token_num_per_rank, *, per_token_scales=None, expert_token_num_type=1,
                       idx_type=0):
    """``(permute_tokens, permute_per_token_scales, permute_token_idx, expert_token_num)``."""
    op = "npu_moe_re_routing"
    chk.tensor(op, "tokens", tokens, dims=(2,))
    counts = chk.tensor(op, "expert_token_num_per_rank", expert_token_num_per_rank, dims=(2,),
                        dtypes=(torch.int32, torch.int64))
    if per_token_scales is not None:  # permuted with the tokens (DeepSeek passes init_routing_v2's scales)
        chk.tensor(op, "per_token_scales", per_token_scales, dims=(1,), dtypes=(torch.float32,))
        if per_token_scales.shape[0] != tokens.shape[0]:
            raise NpuOpError(op, "per_token_scales", f"has {per_token_scales.shape[0]} entries for "
                                                     f"{tokens.shape[0]} tokens")
    chk.choice(op, "expert_token_num_type", expert_token_num_type, (1,), documented=(0,))
    chk.choice(op, "idx_type", idx_type, (0,), documented=(1,))
    if bool((counts < 0).any()) or int(counts.sum()) != tokens.shape[0]:
        raise NpuOpError(op, "expert_token_num_per_rank", f"counts must be >= 0 and sum to the {tokens.shape[0]} "
                                                          f"tokens, got {counts.tolist()}")
    ranks, local = (int(s) for s in counts.shape)
    starts = torch.cumsum(counts.reshape(-1), 0) - counts.reshape(-1)  # rank-major block starts
    pieces = [torch.arange(int(starts[r * local + e]), int(starts[r * local + e] + counts[r, e]))
              for e in range(local) for r in range(ranks)]
    order = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
    scales = (per_token_scales[order] if per_token_scales is not None
              else torch.full((tokens.shape[0],), float("nan"), dtype=torch.float32))  # undefined without them
    return tokens[order], scales, order.to(torch.int32), counts.sum(0).to(counts.dtype)


def _single_rank(op: str, ep_world_size, ep_rank_id, tp_world_size, tp_rank_id, shared_expert_rank_num,
                 moe_expert_num, expert_shard_type, zero_expert_num, copy_expert_num, const_expert_num) -> None:
    """The arguments every emulated call shares; more than one EP rank is emulated over the default process group
    only (``_ep_group``)."""
    chk.integer(op, "ep_world_size", ep_world_size, low=1)
    chk.integer(op, "ep_rank_id", ep_rank_id, low=0, high=ep_world_size - 1)
    if ep_world_size > 1:
        _ep_group(op, ep_world_size, ep_rank_id)
        if moe_expert_num % ep_world_size:
            raise NpuOpError(op, "moe_expert_num", f"{moe_expert_num} experts do not split over {ep_world_size} EP "
                                                   "ranks (moe_expert_num % ep_world_size must be 0)")
        if copy_expert_num:
            raise UnemulatedFeatureError(op, "copy_expert_num", "copy experts are emulated on a single EP rank only")
    chk.choice(op, "tp_world_size", tp_world_size, (0, 1), documented=(2,))
    chk.integer(op, "tp_rank_id", tp_rank_id, low=0, high=0)
    chk.choice(op, "shared_expert_rank_num", shared_expert_rank_num, (0,))
    chk.choice(op, "expert_shard_type", expert_shard_type, (0,))
    chk.integer(op, "moe_expert_num", moe_expert_num, low=1)
    for name, value in (("zero_expert_num", zero_expert_num), ("const_expert_num", const_expert_num)):
        chk.choice(op, name, value, (0,), documented=(value,) if value else ())
    chk.integer(op, "copy_expert_num", copy_expert_num, low=0)


def _ep_group(op: str, ep_world_size: int, ep_rank_id: int) -> None:
    """More than one EP rank: the emulation communicates over the default process group, which must be the EP group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise UnemulatedFeatureError(op, "ep_world_size", f"{ep_world_size} ranks without a process group: more than "
                                                          "one EP rank is emulated over the default process group only")
    if dist.get_world_size() != ep_world_size or dist.get_rank() != ep_rank_id:
        raise UnemulatedFeatureError(op, "ep_world_size", f"EP rank {ep_rank_id} of {ep_world_size} is not rank "
                                                          f"{dist.get_rank()} of the {dist.get_world_size()}-rank "
                                                          "default process group (the only EP group emulated)")


def _gathered(t: torch.Tensor, world: int) -> torch.Tensor:
    """``[world, *t.shape]``: every EP rank's ``t`` (the same shape on every rank)."""
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return torch.stack(parts)


def _dispatch_many(op, x, expert_ids, ep_world_size, ep_rank_id, moe_expert_num, expert_token_nums_type):
    """Dispatch over ``ep_world_size > 1`` ranks (the module docstring): this rank's local experts' copies."""
    bs, k = (int(s) for s in expert_ids.shape)
    world, local = ep_world_size, moe_expert_num // ep_world_size
    sizes = _gathered(torch.tensor([bs]), world).reshape(-1).tolist()
    if len(set(sizes)) != 1:
        raise UnemulatedFeatureError(op, "x", f"EP ranks dispatch {sizes} tokens: only equal batch sizes are emulated")
    xs = _gathered(x, world)  # [W, bs, H]
    ids = _gathered(expert_ids, world).reshape(world, bs * k).long()  # [W, bs * K]
    src = torch.arange(world).repeat_interleave(bs * k)
    copy = torch.arange(bs * k).repeat(world)
    expert = ids.reshape(-1)
    mine = (expert // local) == ep_rank_id
    key = (expert - ep_rank_id * local) * (world * bs * k) + src * (bs * k) + copy
    order = torch.nonzero(mine).reshape(-1)
    order = order[torch.argsort(key[order], stable=True)]
    received = int(order.numel())
    rows = bs * world * min(local, k)  # the meta function's A (global_bs = bs * W)
    expand_x = torch.full((rows, x.shape[1]), float("nan"), dtype=x.dtype)
    expand_x[:received] = xs[src[order], copy[order] // k]
    expand_idx = torch.full((max(bs * k, rows * 128),), -1, dtype=torch.int32)
    expand_idx[:received] = (src[order] * (bs * k) + copy[order]).to(torch.int32)
    local_expert = expert[order] - ep_rank_id * local
    counts = torch.bincount(local_expert, minlength=local)
    expert_token_nums = (counts if expert_token_nums_type == 1 else torch.cumsum(counts, 0)).to(torch.int64)
    per_source = torch.bincount(local_expert * world + src[order], minlength=local * world).to(torch.int32)
    return (expand_x, torch.full((rows,), float("nan"), dtype=torch.float32), expand_idx, expert_token_nums,
            per_source, torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.float32))


def _returned_rows(expand_x, assist, bs: int, k: int, world: int, cdt) -> torch.Tensor:
    """Combine over ``world > 1`` EP ranks: ``[bs * K, H]``, row ``i * K + k`` the expert output of this rank's copy
    ``(i, k)``, sent back by the rank that computed it."""
    import torch.distributed as dist

    send = torch.zeros(world, bs * k, expand_x.shape[1], dtype=cdt)
    rows = assist[:expand_x.shape[0]].long()
    held = torch.nonzero(rows >= 0).reshape(-1)
    send[rows[held] // (bs * k), rows[held] % (bs * k)] = expand_x[held].to(cdt)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv.view(world * bs * k, -1), send.view(world * bs * k, -1))
    return recv.sum(0)  # each copy comes from exactly one rank; the others sent zeros


def npu_moe_distribute_dispatch_v2(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *,
                                   scales=None, x_active_mask=None, expert_scales=None, elastic_info=None,
                                   performance_info=None, group_tp="", tp_world_size=0, tp_rank_id=0,
                                   expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0, quant_mode=0,
                                   global_bs=0, expert_token_nums_type=1, comm_alg="", zero_expert_num=0,
                                   copy_expert_num=0, const_expert_num=0):
    """``(expand_x, dynamic_scales, expand_idx, expert_token_nums, ep_recv_counts, tp_recv_counts, expand_scales)``."""
    op = "npu_moe_distribute_dispatch_v2"
    chk.tensor(op, "x", x, dims=(2,), dtypes=chk.FLOAT_DTYPES)
    _single_rank(op, ep_world_size, ep_rank_id, tp_world_size, tp_rank_id, shared_expert_rank_num, moe_expert_num,
                 expert_shard_type, zero_expert_num, copy_expert_num, const_expert_num)
    chk.absent(op, scales=scales, x_active_mask=x_active_mask, expert_scales=expert_scales,
               elastic_info=elastic_info, performance_info=performance_info)
    chk.choice(op, "quant_mode", quant_mode, (0,), documented=(1, 2, 3, 4))
    chk.choice(op, "expert_token_nums_type", expert_token_nums_type, (0, 1))
    bs = int(x.shape[0])
    chk.integer(op, "global_bs", global_bs, low=0)
    if global_bs not in (0, bs * ep_world_size):
        raise NpuOpError(op, "global_bs", f"{global_bs} is neither 0 nor bs * ep_world_size ({bs * ep_world_size})")
    chk.tensor(op, "expert_ids", expert_ids, dims=(2,), dtypes=(torch.int32,))
    if expert_ids.shape[0] != bs:
        raise NpuOpError(op, "expert_ids", f"has {expert_ids.shape[0]} rows, x has {bs}")
    total = moe_expert_num + copy_expert_num
    if expert_ids.numel() and (int(expert_ids.min()) < 0 or int(expert_ids.max()) >= total):
        raise NpuOpError(op, "expert_ids", f"expert ids must lie in [0, {total}) ({moe_expert_num} routed + "
                                           f"{copy_expert_num} copy experts)")
    if ep_world_size > 1:
        return _dispatch_many(op, x, expert_ids, ep_world_size, ep_rank_id, moe_expert_num, expert_token_nums_type)
    k = int(expert_ids.shape[1])
    rows = bs * min(moe_expert_num, k) * max(tp_world_size, 1)
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    order = order[flat[order] < moe_expert_num]  # copy experts are not dispatched
    sent = int(order.numel())
    expand_x = torch.full((rows, x.shape[1]), float("nan"), dtype=x.dtype)
    expand_x[:sent] = x[order // k]
    expand_idx = torch.full((max(bs * k, rows * 128),), -1, dtype=torch.int32)
    expand_idx[order] = torch.arange(sent, dtype=torch.int32)
    counts = torch.bincount(flat[flat < moe_expert_num].long(), minlength=moe_expert_num)
    expert_token_nums = (counts if expert_token_nums_type == 1 else torch.cumsum(counts, 0)).to(torch.int64)
    dynamic_scales = torch.full((rows,), float("nan"), dtype=torch.float32)
    ep_recv_counts = counts.to(torch.int32)
    tp_recv_counts = torch.full((tp_world_size,), bs * k, dtype=torch.int32)
    return (expand_x, dynamic_scales, expand_idx, expert_token_nums, ep_recv_counts, tp_recv_counts,
            torch.zeros(0, dtype=torch.float32))


def npu_moe_distribute_combine_v2(expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales,
                                  group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, tp_send_counts=None,
                                  x_active_mask=None, expand_scales=None, shared_expert_x=None, elastic_info=None,
                                  ori_x=None, const_expert_alpha_1=None, const_expert_alpha_2=None, const_expert_v=None,
                                  performance_info=None, group_tp="", tp_world_size=0, tp_rank_id=0,
                                  expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0, global_bs=0,
                                  comm_quant_mode=0, comm_alg="", zero_expert_num=0, copy_expert_num=0,
                                  const_expert_num=0):
    """``out [bs, H] = sum_k expert_scales[i, k] * expand_x[row of (i, k)]``."""
    op = "npu_moe_distribute_combine_v2"
    chk.tensor(op, "expand_x", expand_x, dims=(2,), dtypes=chk.FLOAT_DTYPES)
    _single_rank(op, ep_world_size, ep_rank_id, tp_world_size, tp_rank_id, shared_expert_rank_num, moe_expert_num,
                 expert_shard_type, zero_expert_num, copy_expert_num, const_expert_num)
    chk.absent(op, x_active_mask=x_active_mask, expand_scales=expand_scales,
               elastic_info=elastic_info, const_expert_alpha_1=const_expert_alpha_1,
               const_expert_alpha_2=const_expert_alpha_2, const_expert_v=const_expert_v,
               performance_info=performance_info)
    chk.choice(op, "comm_quant_mode", comm_quant_mode, (0,), documented=(1, 2, 3))
    chk.tensor(op, "expert_ids", expert_ids, dims=(2,), dtypes=(torch.int32,))
    bs, k = (int(s) for s in expert_ids.shape)
    chk.tensor(op, "expert_scales", expert_scales, dims=(2,), dtypes=(torch.float32,))
    if tuple(expert_scales.shape) != (bs, k):
        raise NpuOpError(op, "expert_scales", f"shape {tuple(expert_scales.shape)} must be ({bs}, {k})")
    assist = chk.tensor(op, "assist_info_for_combine", assist_info_for_combine, dims=(1,), dtypes=(torch.int32,))
    if assist.numel() < bs * k:
        raise NpuOpError(op, "assist_info_for_combine", f"has {assist.numel()} entries, needs {bs * k} "
                                                        f"(dispatch's expand_idx)")
    copy = expert_ids.reshape(-1).long() >= moe_expert_num  # copy experts: the token itself (ori_x)
    if bool(copy.any()):
        if ori_x is None:
            raise NpuOpError(op, "ori_x", "required when tokens choose copy experts (copy_expert_num)")
        chk.tensor(op, "ori_x", ori_x, dims=(2,))
        chk.same_dtype(op, "ori_x", ori_x, "expand_x", expand_x)
        if tuple(ori_x.shape) != (bs, expand_x.shape[1]):
            raise NpuOpError(op, "ori_x", f"shape {tuple(ori_x.shape)} must be ({bs}, {expand_x.shape[1]})")
    if bool((expert_ids.reshape(-1).long() >= moe_expert_num + copy_expert_num).any()):
        raise NpuOpError(op, "expert_ids", f"expert ids must lie in [0, {moe_expert_num + copy_expert_num})")
    if shared_expert_x is not None:
        chk.tensor(op, "shared_expert_x", shared_expert_x, dims=(2,))
        chk.same_dtype(op, "shared_expert_x", shared_expert_x, "expand_x", expand_x)
        if tuple(shared_expert_x.shape) != (bs, expand_x.shape[1]):
            raise NpuOpError(op, "shared_expert_x", f"shape {tuple(shared_expert_x.shape)} must be "
                                                    f"({bs}, {expand_x.shape[1]})")
    chk.tensor(op, "ep_send_counts", ep_send_counts, dims=(1,), dtypes=(torch.int32,))
    cdt = chk.compute_dtype(expand_x.dtype)
    if ep_world_size > 1:
        source = _returned_rows(expand_x, assist, bs, k, ep_world_size, cdt)
    else:
        rows = assist[:bs * k].long()
        routed = rows[~copy]
        if routed.numel() and (int(routed.min()) < 0 or int(routed.max()) >= expand_x.shape[0]):
            raise NpuOpError(op, "assist_info_for_combine", "does not come from this dispatch (rows out of range)")
        source = expand_x.to(cdt)[rows.clamp(min=0)]
    if bool(copy.any()):
        tokens = torch.arange(bs * k) // k
        source[copy] = ori_x.to(cdt)[tokens[copy]]
    out = (expert_scales.to(cdt).unsqueeze(-1) * source.view(bs, k, -1)).sum(dim=1)
    if shared_expert_x is not None:  # added once, unweighted (the kernel's AddSharedExpertX)
        out = out + shared_expert_x.to(cdt)
    return out.to(expand_x.dtype)


OPS = {
    "npu_moe_re_routing": npu_moe_re_routing,
    "npu_moe_distribute_dispatch_v2": npu_moe_distribute_dispatch_v2,
    "npu_moe_distribute_combine_v2": npu_moe_distribute_combine_v2,
}
