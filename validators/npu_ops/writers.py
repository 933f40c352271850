"""Cache writers: ``npu_scatter_nd_update(_)``, ``scatter_update(_)``, ``npu_kv_rmsnorm_rope_cache(_v2)``.

All writes are vectorized ``index_put_``/advanced-index assignments into the caller's tensor
(views included), so an in-place op really updates the cache storage the model holds.
"""

from __future__ import annotations

import math

import torch
from model_infer_kvcache.validators.npu_ops import null_block
from model_infer_kvcache.validators.npu_ops.errors import NpuOpError, UnemulatedFeatureError
from model_infer_kvcache.validators.npu_ops.nz import nz_c0
from model_infer_kvcache.validators.npu_ops.readings import active_readings
from model_infer_kvcache.validators.npu_ops.rotary import deinterleaved_rope

INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
CACHE_MODES = ("Norm", "PA", "PA_BNSD", "PA_NZ", "PA_BLK_BNSD", "PA_BLK_NZ")


# --------------------------------------------------------------------------- repeated slots
def _single_writer_rows(op: str, name: str, targets: torch.Tensor, in_null: torch.Tensor) -> torch.Tensor | None:
    """Which rows write, when several rows target the same place (``None``: all of them).

    ``targets`` is one integer per row naming where it goes, ``in_null`` whether that place is in
    the null block (see ``null_block``), where padded decode rows land. Repeats elsewhere are a
    race between live tokens and always refused; repeats in the null block follow the
    ``repeated_slots`` device reading (see ``readings``).
    """
    uniq, inverse, counts = torch.unique(targets, return_inverse=True, return_counts=True)
    if uniq.numel() == targets.numel():
        return None
    repeated = counts[inverse] > 1
    racing = repeated & ~in_null
    if bool(racing.any()):
        raise NpuOpError(op, name, f"target {int(targets[racing][0])} is written more than once outside the null "
                                   f"block (block {null_block.NULL_BLOCK_ID}): two live tokens race for one slot")
    reading = active_readings().repeated_slots
    if reading == "error":
        raise NpuOpError(op, name, "slots must not repeat (device reading repeated_slots='error'; padded decode "
                                   "rows all write the null block's slot 0)")
    rows = torch.arange(targets.numel(), dtype=torch.int64)
    winner = torch.full((uniq.numel(),), -1 if reading == "last_wins" else targets.numel(), dtype=torch.int64)
    winner.scatter_reduce_(0, inverse, rows, reduce="amax" if reading == "last_wins" else "amin")
    return rows == winner[inverse]


# --------------------------------------------------------------------------- scatter_nd_update
def scatter_nd_update_(op: str, self: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
    """``self[tuple(indices[..., i])] = updates`` for the leading ``a = indices.shape[-1]`` dims.

    Doc rules: indices int32/int64 and at least 2-D; ``a`` <= rank of self; updates shape is
    ``indices.shape[:-1] + self.shape[a:]`` and dtype equals self's; indices must not be out
    of range (the device does not check; the emulator refuses).
    """
    if indices.dtype not in INDEX_DTYPES:
        raise NpuOpError(op, "indices", f"dtype must be int32 or int64, got {indices.dtype}")
    if indices.dim() < 2:
        raise NpuOpError(op, "indices", f"must be at least 2-D (last dim = index depth), got {tuple(indices.shape)}")
    if not 1 <= self.dim() <= 8:
        raise NpuOpError(op, "self", f"rank must be 1..8, got {self.dim()}")
    depth = int(indices.shape[-1])
    if not 1 <= depth <= self.dim():
        raise NpuOpError(op, "indices", f"last dim {depth} must be in 1..{self.dim()} (rank of self)")
    expected = tuple(indices.shape[:-1]) + tuple(self.shape[depth:])
    if tuple(updates.shape) != expected:
        raise NpuOpError(op, "updates", f"shape {tuple(updates.shape)} must be {expected} "
                                        f"(indices.shape[:-1] + self.shape[{depth}:])")
    if updates.dtype != self.dtype:
        raise NpuOpError(op, "updates", f"dtype {updates.dtype} differs from self {self.dtype}")
    idx = indices.reshape(-1, depth).to(torch.int64)
    if idx.numel():
        limits = torch.tensor(self.shape[:depth], dtype=torch.int64)
        bad = (idx < 0) | (idx >= limits)
        if bool(bad.any()):
            row = int(bad.any(dim=1).nonzero()[0])
            raise NpuOpError(op, "indices", f"index {idx[row].tolist()} is out of range for self shape "
                                            f"{tuple(self.shape)}")
    rows = updates.reshape(-1, *self.shape[depth:])
    strides = torch.tensor([math.prod(self.shape[i + 1:depth]) for i in range(depth)], dtype=torch.int64)
    targets = (idx * strides).sum(1)
    # Where each row starts in the cache's storage: a declared cache (null_block.paged_caches) says
    # which of those lie in its null block. Undeclared, the op cannot see the block size of a flat
    # [slots, ...] cache: every repeat follows the reading (the fused MLA writer sees blocks).
    offsets = self.storage_offset() + (idx * torch.tensor(self.stride()[:depth], dtype=torch.int64)).sum(1)
    regions = null_block.declared(self)
    in_null = null_block.in_null(regions, offsets) if regions else torch.ones_like(targets, dtype=torch.bool)
    keep = _single_writer_rows(op, "indices", targets, in_null) if idx.numel() else None
    if keep is not None:
        idx, rows = idx[keep], rows[keep]
    self.index_put_(tuple(idx.unbind(1)), rows)
    null_block.poison_touched(regions, offsets)
    return self


# --------------------------------------------------------------------------- scatter_update
def scatter_update_(op: str, self: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor,
                    axis: int) -> torch.Tensor:
    """Batch ``i`` of ``updates`` goes into batch ``i`` of ``self`` at offset ``indices[i]`` along ``axis``.

    ``self[i, ..., indices[i] : indices[i] + updates.shape[axis], ...] = updates[i]``. Doc rules:
    self/updates rank 2..8 and equal; indices int32/int64, 1-D (the 2-D form is not emulated);
    no out-of-range offsets (not checked by the device; refused here).
    """
    if not 2 <= self.dim() <= 8:
        raise NpuOpError(op, "self", f"rank must be 2..8, got {self.dim()}")
    if updates.dim() != self.dim():
        raise NpuOpError(op, "updates", f"rank {updates.dim()} differs from self rank {self.dim()}")
    if updates.dtype != self.dtype:
        raise NpuOpError(op, "updates", f"dtype {updates.dtype} differs from self {self.dtype}")
    if indices.dtype not in INDEX_DTYPES:
        raise NpuOpError(op, "indices", f"dtype must be int32 or int64, got {indices.dtype}")
    if indices.dim() == 2:
        raise UnemulatedFeatureError(op, "indices", "the 2-D indices form is not emulated (use 1-D batch offsets)")
    if indices.dim() > 2:
        raise NpuOpError(op, "indices", f"must be 1-D or 2-D, got {indices.dim()}-D")
    if not -self.dim() <= axis < self.dim():
        raise NpuOpError(op, "axis", f"{axis} is out of range for rank {self.dim()}")
    ax = axis % self.dim()
    if ax == 0:
        raise NpuOpError(op, "axis", "axis 0 is the batch dimension; the update axis must be another one")
    batch = int(updates.shape[0])
    if indices.numel() != batch:
        raise NpuOpError(op, "indices", f"has {indices.numel()} offsets for {batch} update batches")
    if batch > self.shape[0]:
        raise NpuOpError(op, "updates", f"has {batch} batches, self only {self.shape[0]}")
    for d in range(1, self.dim()):
        if d != ax and updates.shape[d] != self.shape[d]:
            raise NpuOpError(op, "updates", f"dim {d} is {updates.shape[d]}, self has {self.shape[d]}")
    length = int(updates.shape[ax])
    offsets = indices.reshape(-1).to(torch.int64)
    bad = (offsets < 0) | (offsets + length > self.shape[ax])
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise NpuOpError(op, "indices", f"offset {int(offsets[i])} + {length} exceeds self dim {ax} "
                                        f"({self.shape[ax]}) for batch {i}")
    positions = offsets.view(-1, 1) + torch.arange(length, dtype=torch.int64).view(1, -1)
    rows = torch.arange(batch, dtype=torch.int64).view(-1, 1).expand(batch, length)
    self.movedim(ax, 1).index_put_((rows, positions), updates.movedim(ax, 1))
    return self


# --------------------------------------------------------------------------- kv_rmsnorm_rope_cache
def _rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * gamma


def _write_paged(op, name, cache, values, slots, nz: bool) -> None:
    """Write token rows ``values [M, d]`` to paged ``cache [bn, bs, 1, d]`` at ``slots [M]``."""
    bn, bs, _, d = cache.shape
    block, offset = slots // bs, slots % bs
    if nz:
        c0 = nz_c0(cache.dtype)
        try:
            tiles = cache.view(bn, 1, d // c0, bs, c0)[:, 0]
        except RuntimeError as exc:  # a non-contiguous cache cannot hold an NZ arrangement
            raise NpuOpError(op, name, f"an NZ write needs a contiguous cache allocation ({exc})") from exc
        tiles[block, :, offset, :] = values.reshape(-1, d // c0, c0)
    else:
        cache[block, offset, 0, :] = values


def kv_rmsnorm_rope_cache(
    op: str,
    kv: torch.Tensor,
    gamma: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    index: torch.Tensor,
    k_cache: torch.Tensor,
    ckv_cache: torch.Tensor,
    *,
    quant_args: dict[str, torch.Tensor | None],
    v: torch.Tensor | None,
    epsilon: float,
    cache_mode: str,
    is_output_kv: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA fused RMSNorm + interleaved RoPE + cache write; returns ``(k_rope, c_kv)``.

    ``kv [B, 1, S, Dv + Dk]`` (or ``[B, 1, S, Dk]`` plus ``v [B, 1, S, Dv]``): the first Dv lanes
    (``kv_lora_rank``) are RMS-normalized with ``gamma [Dv]`` and written to ``ckv_cache``; the
    last Dk lanes (``qk_rope_head_dim``) get the interleaved RoPE with ``cos``/``sin``
    ``[B, 1, S|1, Dk]`` and go to ``k_cache``. ``k_cache`` is the rope cache, ``ckv_cache``
    the nope/latent cache. ``index``: ``Norm`` -> ``[B, S]`` positions per request in
    ``[B, 1, S_cache, d]`` caches; ``PA``/``PA_BNSD``/``PA_NZ`` -> ``[B*S]`` slots
    (``block * block_size + offset``) in ``[block_num, block_size, 1, d]`` caches;
    ``PA_BLK_*`` -> one start slot per block of each sequence. ``-1`` skips a token.
    ``*_NZ`` modes store the FRACTAL_NZ arrangement inside the same allocation.
    When ``is_output_kv`` is False the returned ``k_rope``/``c_kv`` are undefined on the device;
    the emulator returns NaN-filled tensors so any use of them shows up.
    """
    for name, value in quant_args.items():
        if value is not None:
            raise UnemulatedFeatureError(op, name, "quantized cache writes are not emulated")
    if cache_mode not in CACHE_MODES:
        raise NpuOpError(op, "cache_mode", f"{cache_mode!r} is not one of {CACHE_MODES}")
    if kv.dim() != 4:
        raise NpuOpError(op, "kv", f"4D tensor expected [B, N, S, D], got {tuple(kv.shape)}")
    if kv.dtype not in FLOAT_DTYPES:
        raise NpuOpError(op, "kv", f"dtype {kv.dtype} not supported")
    if gamma.dim() != 1:
        raise NpuOpError(op, "gamma", f"1D tensor expected, got {tuple(gamma.shape)}")
    if cos.dim() != 4:
        raise NpuOpError(op, "cos", f"4D tensor expected, got {tuple(cos.shape)}")
    if sin.shape != cos.shape:
        raise NpuOpError(op, "sin", f"shape {tuple(sin.shape)} must equal cos {tuple(cos.shape)}")
    for name, t in (("gamma", gamma), ("cos", cos), ("sin", sin)):
        if t.dtype != kv.dtype:
            raise NpuOpError(op, name, f"dtype {t.dtype} differs from kv {kv.dtype}")
    for name, t in (("k_cache", k_cache), ("ckv_cache", ckv_cache)):
        if t.dtype == torch.int8:
            raise UnemulatedFeatureError(op, name, "int8 (quantized) caches are not emulated")
        if t.dtype != kv.dtype:
            raise NpuOpError(op, name, f"dtype {t.dtype} differs from kv {kv.dtype}")
    if index.dtype != torch.int64:
        raise NpuOpError(op, "index", f"dtype must be int64, got {index.dtype}")

    batch, heads, seq, width = kv.shape
    if heads != 1:
        raise NpuOpError(op, "kv", f"only N=1 (MLA latent) is supported, got N={heads}")
    dk, dv = int(cos.shape[3]), int(gamma.shape[0])
    if dk % 2:
        raise NpuOpError(op, "cos", f"rope dim must be even, got {dk}")
    if v is not None:
        if v.dim() != 4 or v.dtype != kv.dtype or v.shape[:3] != kv.shape[:3]:
            raise NpuOpError(op, "v", f"must be a 4-D {kv.dtype} tensor with token shape {tuple(kv.shape[:3])}")
        if width != dk or v.shape[3] != dv:
            raise NpuOpError(op, "v", f"with v, kv carries the rope part (D={dk}) and v the norm part (D={dv})")
        rope_in, norm_in = kv, v
    else:
        if width != dk + dv:
            raise NpuOpError(op, "kv", f"last dim {width} must equal gamma ({dv}) + rope dim ({dk})")
        norm_in, rope_in = kv[..., :dv], kv[..., dv:]
    if cos.shape[0] != batch or cos.shape[1] != 1 or cos.shape[2] not in (seq, 1):
        raise NpuOpError(op, "cos", f"shape {tuple(cos.shape)} must be [{batch}, 1, {seq} or 1, {dk}]")

    cdt = torch.float64 if kv.dtype == torch.float64 else torch.float32
    rope_out = deinterleaved_rope(rope_in.to(cdt), cos.to(cdt), sin.to(cdt))
    norm_out = _rms_norm(norm_in.to(cdt), gamma.to(cdt), float(epsilon))
    rope_out, norm_out = rope_out.to(kv.dtype), norm_out.to(kv.dtype)

    if cache_mode == "Norm":
        _write_norm_mode(op, k_cache, ckv_cache, index, rope_out, norm_out, dk, dv)
    else:
        _write_pa_mode(op, k_cache, ckv_cache, index, rope_out, norm_out, dk, dv, cache_mode)

    if not is_output_kv:
        return torch.full_like(rope_out, float("nan")), torch.full_like(norm_out, float("nan"))
    return rope_out, norm_out


def write_paged_latent(op: str, *, rope_cache: torch.Tensor, latent_cache: torch.Tensor, index: torch.Tensor,
                       rope: torch.Tensor, latent: torch.Tensor, cache_mode: str) -> None:
    """MLA's two paged caches written at slots ``index [T]`` from token rows ``rope [T, Dr]`` and
    ``latent [T, Hckv]`` (``*_NZ``: the FRACTAL_NZ arrangement), with the same slot, null-block and
    repeated-slot rules as ``npu_kv_rmsnorm_rope_cache``'s PA modes (``npu_mla_prolog_v3``)."""
    tokens = int(index.numel())
    _write_pa_mode(op, rope_cache, latent_cache, index, rope.reshape(1, 1, tokens, -1),
                   latent.reshape(1, 1, tokens, -1), int(rope.shape[-1]), int(latent.shape[-1]), cache_mode)


def _write_norm_mode(op, k_cache, ckv_cache, index, rope_out, norm_out, dk, dv) -> None:
    batch, _, seq, _ = rope_out.shape
    for name, cache, d in (("k_cache", k_cache, dk), ("ckv_cache", ckv_cache, dv)):
        if cache.dim() != 4 or cache.shape[1] != 1 or cache.shape[3] != d or cache.shape[0] < batch:
            raise NpuOpError(op, name, f"Norm mode needs [>= {batch}, 1, S_cache, {d}], got {tuple(cache.shape)}")
    if k_cache.shape[2] != ckv_cache.shape[2]:
        raise NpuOpError(op, "ckv_cache", "k_cache and ckv_cache have different cache lengths")
    if tuple(index.shape) != (batch, seq):
        raise NpuOpError(op, "index", f"Norm mode needs shape ({batch}, {seq}), got {tuple(index.shape)}")
    s_cache = int(k_cache.shape[2])
    if bool(((index < -1) | (index >= s_cache)).any()):
        raise NpuOpError(op, "index", f"values must lie in [-1, {s_cache})")
    b_idx, s_idx = (index >= 0).nonzero(as_tuple=True)
    pos = index[b_idx, s_idx]
    k_cache[b_idx, 0, pos, :] = rope_out[b_idx, 0, s_idx, :]
    ckv_cache[b_idx, 0, pos, :] = norm_out[b_idx, 0, s_idx, :]


def _write_pa_mode(op, k_cache, ckv_cache, index, rope_out, norm_out, dk, dv, cache_mode) -> None:
    batch, _, seq, _ = rope_out.shape
    nz = cache_mode.endswith("NZ")
    for name, cache, d in (("k_cache", k_cache, dk), ("ckv_cache", ckv_cache, dv)):
        if cache.dim() != 4 or cache.shape[2] != 1 or cache.shape[3] != d:
            raise NpuOpError(op, name, f"{cache_mode} needs [block_num, block_size, 1, {d}], got {tuple(cache.shape)}")
        if nz and d % nz_c0(cache.dtype):
            raise NpuOpError(op, name, f"{cache_mode} needs D ({d}) aligned to {nz_c0(cache.dtype)}")
    if k_cache.shape[:2] != ckv_cache.shape[:2]:
        raise NpuOpError(op, "ckv_cache", "k_cache and ckv_cache have different block layouts")
    block_num, block_size = int(k_cache.shape[0]), int(k_cache.shape[1])
    if block_size % nz_c0(k_cache.dtype):
        raise NpuOpError(op, "k_cache", f"block size {block_size} must be {nz_c0(k_cache.dtype)}-aligned")
    capacity = block_num * block_size
    flat = index.reshape(-1)
    if index.dim() != 1:
        raise NpuOpError(op, "index", f"{cache_mode} needs a 1-D index, got shape {tuple(index.shape)}")
    if bool(((flat < -1) | (flat >= capacity)).any()):
        raise NpuOpError(op, "index", f"values must lie in [-1, {capacity})")
    if cache_mode.startswith("PA_BLK"):
        per_seq = -(-seq // block_size)
        if flat.numel() != batch * per_seq:
            raise NpuOpError(op, "index", f"{cache_mode} needs {batch}x{per_seq} block start slots, got {flat.numel()}")
        starts = flat.view(batch, per_seq)
        valid_blocks = starts[starts >= 0]
        if valid_blocks.numel() != torch.unique(valid_blocks // block_size).numel():
            raise NpuOpError(op, "index", "block start slots must not share a block")
        s = torch.arange(seq, dtype=torch.int64)
        start = starts[:, s // block_size]  # [B, S]
        slots = torch.where(start >= 0, start + (s % block_size).view(1, -1), torch.full_like(start, -1))
        slots = slots.reshape(-1)
    else:
        if flat.numel() != batch * seq:
            raise NpuOpError(op, "index", f"{cache_mode} needs {batch * seq} slots (B*S), got {flat.numel()}")
        slots = flat
    keep = slots >= 0
    blocks = slots[keep] // block_size
    # Per cache: (its declared null-block regions, where each written block starts in its storage).
    declared = [(null_block.declared(cache), cache.storage_offset() + blocks * cache.stride(0))
                for cache in (k_cache, ckv_cache)]
    if any(regions for regions, _ in declared):  # declared caches: their own null block
        in_null = torch.zeros_like(blocks, dtype=torch.bool)
        for regions, starts in declared:
            in_null |= null_block.in_null(regions, starts)
    else:  # the framework's null block, read off the [block_num, block_size, 1, D] layout
        in_null = blocks == null_block.NULL_BLOCK_ID
    single = _single_writer_rows(op, "index", slots[keep], in_null)
    if single is not None:
        keep[keep.clone()] = single
    tokens_rope = rope_out.reshape(batch * seq, dk)[keep]
    tokens_norm = norm_out.reshape(batch * seq, dv)[keep]
    _write_paged(op, "k_cache", k_cache, tokens_rope, slots[keep], nz)
    _write_paged(op, "ckv_cache", ckv_cache, tokens_norm, slots[keep], nz)
    for regions, starts in declared:
        null_block.poison_touched(regions, starts)
