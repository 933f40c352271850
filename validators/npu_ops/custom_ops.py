"""The checkout's own AscendC operators (cann-recipes-infer ``ops/ascendc``, called as ``torch.ops.custom.<op>``),
emulated from their docs (``ops/ascendc/docs/custom-<op>.md``), strict about every documented argument rule.

Emulated (issue 38):

* ``scatter_nd_update_asc(var, indices, update)``: ``var [b, s]`` rows replaced in place, ``var[indices[i, 0]] =
  update[i]``; ``s`` in {1, 128, 512}, ``u <= b`` updates, indices int32 / int64 ``[u, 1]``; "索引不支持越界,负值会被直接
  跳过": an index at or past ``b`` is refused, a negative one writes nothing. Two updates of one row: the doc does
  not say which lands, so the emulation refuses the call instead of picking one.
* ``inplace_partial_rotary_mul(x, r1, r2, *, rotary_mode, partial_slice)``: ``x [b, s, n, d]`` rotated in place on
  its last axis between ``partial_slice[0]`` and ``partial_slice[1]`` with ``npu_rotary_mul``'s interleave formula
  (``validators/npu_ops/rotary.py``: ``cos * x + sin * stack(-x[1::2], x[0::2])``), ``r1`` / ``r2`` (cos / sin)
  ``[b, 1, 1, slice]`` or ``[b, s, 1, slice]``; only ``"interleave"``; ``d <= 1024`` and even, the slice even;
  ``x`` and the tables may differ in dtype ("支持混合精度").

* ``compressor(x, wkv, wgate, state_cache, ape, norm_weight, rope_sin, rope_cos, rope_head_dim, cmp_ratio, *,
  state_block_table, cu_seqlens, seqused, start_pos, coff, norm_eps, rotary_mode, cache_mode)``: below
  (``compressor``'s docstring says each reading and where it comes from).
* ``npu_sparse_attn_sharedkv(q, *, ori_kv, cmp_kv, cmp_sparse_indices, ...)``: the window branch and the compressed
  branch in one softmax with the sinks (its docstring).
* ``npu_moe_gating_top_k(x, k, *, bias, input_ids, tid2eid, ...)``: V4's router, top-k or hash (its docstring).
* ``npu_hc_pre`` / ``npu_hc_post``: mHC's stream collapse and expansion (hc 4, d 4096 as the docs fix them).
* ``npu_sparse_attn_sharedkv_metadata``: the attention's task list, returned as the call it was built for, which
  ``npu_sparse_attn_sharedkv`` checks (another scene's or a stale step's metadata is refused by name).
* ``npu_quant_lightning_indexer(query, key, weights, query_dequant_scale, key_dequant_scale, *, ...)``: CSA's top-k
  over the int8 compressed keys of a paged cache (its docstring), and ``npu_quant_lightning_indexer_metadata``, its
  task list, recorded and checked as the attention's.
* ``indexer_compress_epilog(cache, scale, x, slot_mapping, *, quant_mode, round_scale)``: fp8 quantization per 128
  lanes and the scatter into the indexer's key cache and its scales (its docstring; d 4096 as the doc fixes it).

Every operand must be contiguous ("不支持非连续"). The rest (``quant_compressor``, ``kv_compress_epilog``, the
hifloat8 ``cann_ops_transformer`` variants...) stay unemulated: used, they raise the one-line
``UnemulatedOperatorError`` naming them (``validators/standins/device.py``).
"""

from __future__ import annotations

import zlib

import torch
from model_infer_kvcache.validators.npu_ops import op_checks as chk
from model_infer_kvcache.validators.npu_ops.errors import NpuOpError, UnemulatedFeatureError
from model_infer_kvcache.validators.npu_ops.moe import grouped_top_k
from model_infer_kvcache.validators.npu_ops.rotary import rotate_half, rotate_interleave
from model_infer_kvcache.validators.npu_ops.sparse_attention import (
    INT64_MAX,
    INVALID,
    SPARSE_COUNT_MAX,
    SPARSE_MODES,
    _lengths,
    _query_rows,
)

SCATTER_ROW_WIDTHS = (1, 128, 512)  # custom-npu_scatter_nd_update_asc.md: "s 取值固定为:1或者128或者512"
SCATTER_DTYPES = (torch.bfloat16, torch.float16, torch.int8, torch.float64)  # float64: the CPU validation mode
INDEX_DTYPES = (torch.int32, torch.int64)
ROTARY_MAX_DIM = 1024  # custom-inplace_partial_rotary_mul.md: "d轴必须小于等1024,且关于2对齐"
# custom-npu_compressor.md, 约束说明: the three (D, coff, cmp_ratio) cases, H in 1K..10K and 512-aligned, rope 64
COMPRESSOR_CASES = {(512, 2, 4): "C4A", (128, 2, 4): "C4Li", (512, 1, 128): "C128A"}
COMPRESSOR_HIDDEN = (1024, 10240, 512)
COMPRESSOR_ROPE_DIM = 64
COMPRESSOR_X_DTYPES = (torch.bfloat16, torch.float16, torch.float64)
STATE_DTYPES = (torch.float32, torch.float64)


def _contiguous(op: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise NpuOpError(op, name, f"must be contiguous (the doc: 不支持非连续), got strides {t.stride()}")


def scatter_nd_update_asc(var: torch.Tensor, indices: torch.Tensor, update: torch.Tensor) -> None:
    op = "custom.scatter_nd_update_asc"
    chk.tensor(op, "var", var, dims=(2,), dtypes=SCATTER_DTYPES)
    chk.tensor(op, "indices", indices, dims=(2,), dtypes=INDEX_DTYPES)
    chk.tensor(op, "update", update, dims=(2,))
    chk.same_dtype(op, "update", update, "var", var)
    _contiguous(op, var=var, indices=indices, update=update)
    b, s = var.shape
    u = indices.shape[0]
    if s not in SCATTER_ROW_WIDTHS:
        raise NpuOpError(op, "var", f"row width s = {s} is not one of {SCATTER_ROW_WIDTHS}")
    if indices.shape[1] != 1:
        raise NpuOpError(op, "indices", f"shape {tuple(indices.shape)} must be [u, 1]")
    if tuple(update.shape) != (u, s):
        raise NpuOpError(op, "update", f"shape {tuple(update.shape)} must be [u, s] = [{u}, {s}]")
    if u > b:
        raise NpuOpError(op, "indices", f"{u} updates exceed var's {b} rows (u <= b)")
    rows = indices[:, 0].to(torch.int64)
    keep = rows >= 0  # a negative index writes nothing (the doc: 负值会被直接跳过)
    if bool((rows >= b).any()):
        raise NpuOpError(op, "indices", f"index {int(rows.max())} is out of var's {b} rows (the doc: 索引不支持越界)")
    kept = rows[keep]
    if kept.unique().numel() != kept.numel():
        raise UnemulatedFeatureError(op, "indices", "two updates of one row: the doc does not say which lands; "
                                                    "point the padded rows at a negative index")
    var[kept] = update[keep]


def inplace_partial_rotary_mul(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, *, rotary_mode: str,
                               partial_slice) -> None:
    op = "custom.inplace_partial_rotary_mul"
    chk.tensor(op, "x", x, dims=(4,), dtypes=chk.FLOAT_DTYPES)
    chk.tensor(op, "r1", r1, dims=(4,), dtypes=chk.FLOAT_DTYPES)
    chk.tensor(op, "r2", r2, dims=(4,), dtypes=chk.FLOAT_DTYPES)
    chk.same_dtype(op, "r2", r2, "r1", r1)
    _contiguous(op, x=x, r1=r1, r2=r2)
    if rotary_mode != "interleave":
        raise NpuOpError(op, "rotary_mode", f"{rotary_mode!r}: only 'interleave' is supported")
    if not (isinstance(partial_slice, (list, tuple)) and len(partial_slice) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in partial_slice)):
        raise NpuOpError(op, "partial_slice", f"{partial_slice!r} must be two ints [start, end]")
    b, s, _, d = x.shape
    start, end = partial_slice
    if d > ROTARY_MAX_DIM or d % 2:
        raise NpuOpError(op, "x", f"last axis d = {d} must be even and at most {ROTARY_MAX_DIM}")
    if not 0 <= start < end <= d or (end - start) % 2:
        raise NpuOpError(op, "partial_slice", f"[{start}, {end}] must lie in [0, {d}] with an even, non-empty slice")
    width = end - start
    if tuple(r1.shape) not in ((b, 1, 1, width), (b, s, 1, width)):
        raise NpuOpError(op, "r1", f"shape {tuple(r1.shape)} must be [b, 1, 1, slice] or [b, s, 1, slice] = "
                                   f"[{b}, 1 or {s}, 1, {width}]")
    if r2.shape != r1.shape:
        raise NpuOpError(op, "r2", f"shape {tuple(r2.shape)} must equal r1's {tuple(r1.shape)}")
    cdt = chk.compute_dtype(x.dtype if x.dtype == torch.float64 else r1.dtype)
    part = x[..., start:end].to(cdt)
    out = part * r1.to(cdt) + rotate_interleave(part) * r2.to(cdt)
    x[..., start:end] = out.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: int) -> torch.Tensor:
    """RoPE on the trailing ``cos.shape[-1]`` lanes of each row (mode 1 half, 2 interleave: npu_rotary_mul's two
    formulas, ``validators/npu_ops/rotary.py``); the leading lanes are the nope part, as upstream deepseek_v4 lays a
    head out (``partial_slice = [head_dim - rope_head_dim, head_dim]`` on the rows the compressor wrote)."""
    r = cos.shape[-1]
    nope, rope = x[..., :-r], x[..., -r:]
    rotate = rotate_half if mode == 1 else rotate_interleave
    return torch.cat([nope, rope * cos + rotate(rope) * sin], dim=-1)


def compressor(x, wkv, wgate, state_cache, ape, norm_weight, rope_sin, rope_cos, rope_head_dim, cmp_ratio, *,
               state_block_table=None, cu_seqlens=None, seqused=None, start_pos=None, coff=1, norm_eps=1e-6,
               rotary_mode=1, cache_mode=1) -> torch.Tensor:
    """custom-npu_compressor.md, read as follows (each reading is also what transformers' DeepseekV4HCACompressor /
    DeepseekV4CSACompressor compute, which the tests compare a streamed run with):

    * every new token at absolute position ``p = start_pos[b] + j`` (``j < seqused[b]``) has ``kv = x @ wkv.T`` and
      ``score = x @ wgate.T + ape[p % cmp_ratio]``; both are kept in ``state_cache[block, p % block_size]`` as
      ``[kv | score]`` (float32), ``block = state_block_table[b, p // block_size]``, a block id 0 meaning "not
      stored" (the doc: 当其中元素的值为0时,表示当前位置无需进行更新state_cache操作);
    * window ``g`` (tokens ``[g·m, (g+1)·m)``) becomes one entry in the call its last token arrives in; its tokens
      from earlier calls are read back from the state cache (the doc's read range starts one window before
      ``start_pos``'s); a block id 0 there is refused: the state it needs was never stored;
    * ``coff = 1``: softmax over the window's ``m`` tokens per lane, the weighted sum of ``kv``; ``coff = 2``
      (overlap): the slots are the first ``D`` lanes of window ``g - 1`` and the last ``D`` of window ``g`` (window 0:
      the latter only), softmax over them per lane;
    * RMSNorm with ``norm_weight`` and ``norm_eps``, then RoPE on the trailing ``rope_head_dim`` lanes with output row
      ``r``'s ``rope_cos[r]`` / ``rope_sin[r]`` (mode 1 half, 2 interleave);
    * output rows: TND (``x [T, H]`` with ``cu_seqlens``) each batch's entries in order, packed, then pad rows up to
      ``min(T, T // m + B)``; BSH (``x [B, S, H]``) ``[B, ceil(S / m), D]``, each batch's entries then pad. Pad rows
      are NaN: the doc leaves them undefined, and a consumer that writes them into a cache shows up.
    """
    op = "custom.compressor"
    chk.tensor(op, "x", x, dims=(2, 3), dtypes=COMPRESSOR_X_DTYPES)
    for name, w in (("wkv", wkv), ("wgate", wgate)):
        chk.tensor(op, name, w, dims=(2,))
        chk.same_dtype(op, name, w, "x", x)
    chk.tensor(op, "state_cache", state_cache, dims=(3,), dtypes=STATE_DTYPES)
    for name, t in (("ape", ape), ("norm_weight", norm_weight), ("rope_sin", rope_sin), ("rope_cos", rope_cos)):
        chk.tensor(op, name, t, dtypes=STATE_DTYPES)
    _contiguous(op, x=x, wkv=wkv, wgate=wgate, state_cache=state_cache, ape=ape)
    chk.integer(op, "rope_head_dim", rope_head_dim)
    if rope_head_dim != COMPRESSOR_ROPE_DIM:
        raise NpuOpError(op, "rope_head_dim", f"{rope_head_dim}: only {COMPRESSOR_ROPE_DIM} is supported")
    chk.integer(op, "cmp_ratio", cmp_ratio)
    chk.integer(op, "coff", coff)
    chk.choice(op, "rotary_mode", rotary_mode, (1, 2))
    chk.choice(op, "cache_mode", cache_mode, (1,), documented=(2,))
    m, cd = cmp_ratio, wkv.shape[0]
    if coff not in (1, 2) or cd % coff:
        raise NpuOpError(op, "coff", f"{coff} must be 1 or 2 and divide wkv's {cd} rows")
    d = cd // coff
    if (d, coff, m) not in COMPRESSOR_CASES:
        raise NpuOpError(op, "cmp_ratio", f"(D {d}, coff {coff}, cmp_ratio {m}) is none of the supported cases "
                                          f"{', '.join(f'{v}: {k}' for k, v in COMPRESSOR_CASES.items())}")
    h = x.shape[-1]
    low, high, align = COMPRESSOR_HIDDEN
    if not low <= h <= high or h % align:
        raise NpuOpError(op, "x", f"hidden size H = {h} must lie in [{low}, {high}] and be a multiple of {align}")
    for name, w in (("wkv", wkv), ("wgate", wgate)):
        if tuple(w.shape) != (cd, h):
            raise NpuOpError(op, name, f"shape {tuple(w.shape)} must be [coff*D, H] = [{cd}, {h}]")
    if tuple(ape.shape) != (m, cd):
        raise NpuOpError(op, "ape", f"shape {tuple(ape.shape)} must be [cmp_ratio, coff*D] = [{m}, {cd}]")
    if tuple(norm_weight.shape) != (d,):
        raise NpuOpError(op, "norm_weight", f"shape {tuple(norm_weight.shape)} must be [D] = [{d}]")
    blocks, block_size, width = state_cache.shape
    if blocks < 1 or width != 2 * cd:
        raise NpuOpError(op, "state_cache", f"shape {tuple(state_cache.shape)} must be [block_num > 0, block_size, "
                                            f"2*coff*D = {2 * cd}]")
    if state_block_table is None:
        raise UnemulatedFeatureError(op, "state_block_table", "None: the doc does not say where states are kept "
                                                              "without a block table")
    tnd = x.dim() == 2
    if tnd:
        chk.tensor(op, "cu_seqlens", cu_seqlens, dims=(1,), dtypes=(torch.int32,))
        cu = [int(v) for v in cu_seqlens]
        if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:], strict=False)) or cu[-1] != x.shape[0]:
            raise NpuOpError(op, "cu_seqlens", f"{cu} must start at 0, never decrease and end at T = {x.shape[0]}")
        batch, lengths = len(cu) - 1, [b - a for a, b in zip(cu, cu[1:], strict=False)]
        rows_of = [x[a:b] for a, b in zip(cu, cu[1:], strict=False)]
        out_rows = min(x.shape[0], x.shape[0] // m + batch)
    else:
        if cu_seqlens is not None:
            raise NpuOpError(op, "cu_seqlens", "must be None when x is [B, S, H]")
        batch, s = x.shape[0], x.shape[1]
        lengths, rows_of = [s] * batch, list(x)
        per_batch = -(-s // m)
    chk.tensor(op, "state_block_table", state_block_table, dims=(2,), dtypes=(torch.int32,))
    if state_block_table.shape[0] != batch:
        raise NpuOpError(op, "state_block_table", f"{state_block_table.shape[0]} rows for {batch} batch(es)")
    used = lengths if seqused is None else [int(v) for v in chk.tensor(op, "seqused", seqused, dims=(1,),
                                                                          dtypes=(torch.int32,))]
    starts = [0] * batch if start_pos is None else [int(v) for v in chk.tensor(op, "start_pos", start_pos, dims=(1,),
                                                                                  dtypes=(torch.int32,))]
    if len(used) != batch or any(not 0 <= u <= n for u, n in zip(used, lengths, strict=False)):
        raise NpuOpError(op, "seqused", f"{used} must hold one count per batch, each in [0, its length {lengths}]")
    if len(starts) != batch or any(p < 0 for p in starts):
        raise NpuOpError(op, "start_pos", f"{starts} must hold one non-negative position per batch")
    want_rope = (out_rows, rope_head_dim) if tnd else (batch, per_batch, rope_head_dim)
    for name, t in (("rope_sin", rope_sin), ("rope_cos", rope_cos)):
        if tuple(t.shape) != want_rope:
            raise NpuOpError(op, name, f"shape {tuple(t.shape)} must be {list(want_rope)}")

    cdt = chk.compute_dtype(x.dtype)
    table = state_block_table.tolist()

    def block_of(b: int, p: int, reading: bool) -> int:
        row = table[b]
        if p // block_size >= len(row):
            raise NpuOpError(op, "state_block_table", f"batch {b} position {p}: column {p // block_size} is past the "
                                                      f"table's {len(row)}")
        blk = row[p // block_size]
        if not 0 <= blk < blocks:
            raise NpuOpError(op, "state_block_table", f"batch {b}: block id {blk} outside the {blocks} blocks")
        if reading and blk == 0:
            raise NpuOpError(op, "state_block_table", f"batch {b} position {p}: the state of an earlier call is "
                                                      "needed but its block id is 0 (never stored)")
        return blk

    out = torch.full((out_rows, d) if tnd else (batch, per_batch, d), float("nan"), dtype=x.dtype)
    row = 0
    for b in range(batch):
        s0, n = starts[b], used[b]
        xb = rows_of[b][:n].to(cdt)
        kv_new = xb @ wkv.to(cdt).T
        positions = torch.arange(s0, s0 + n)
        score_new = xb @ wgate.to(cdt).T + ape.to(cdt)[positions % m]

        def state(p: int, b=b, s0=s0, kv_new=kv_new, score_new=score_new):
            if p >= s0:
                return kv_new[p - s0], score_new[p - s0]
            cached = state_cache[block_of(b, p, True), p % block_size].to(cdt)
            return cached[:cd], cached[cd:]

        entries = []
        for g in range(s0 // m, (s0 + n) // m):
            cur = [state(p) for p in range(g * m, (g + 1) * m)]
            kv = torch.stack([c[0][cd - d:] for c in cur])
            score = torch.stack([c[1][cd - d:] for c in cur])
            if coff == 2 and g > 0:  # the previous window's first D lanes (the overlap series)
                prev = [state(p) for p in range(g * m - m, g * m)]
                kv = torch.cat([torch.stack([c[0][:d] for c in prev]), kv])
                score = torch.cat([torch.stack([c[1][:d] for c in prev]), score])
            pooled = (kv * score.softmax(dim=0)).sum(dim=0)
            normed = norm_weight.to(cdt) * pooled * torch.rsqrt(pooled.pow(2).mean() + norm_eps)
            entries.append(normed)
        for j in range(n):  # the new tokens' states, where the table keeps them
            p = s0 + j
            blk = block_of(b, p, False)
            if blk:
                state_cache[blk, p % block_size] = torch.cat([kv_new[j], score_new[j]]).to(state_cache.dtype)
        if not entries:
            continue
        pooled = torch.stack(entries)
        if tnd:
            cos, sin = rope_cos[row:row + len(entries)], rope_sin[row:row + len(entries)]
            out[row:row + len(entries)] = _rope(pooled, cos.to(cdt), sin.to(cdt), rotary_mode).to(x.dtype)
            row += len(entries)
        else:
            cos, sin = rope_cos[b, :len(entries)], rope_sin[b, :len(entries)]
            out[b, :len(entries)] = _rope(pooled, cos.to(cdt), sin.to(cdt), rotary_mode).to(x.dtype)
    return out


SHAREDKV_DIM = 512  # "参数q中的D和ori_kv、cmp_kv的D值相等为512"
SHAREDKV_Q_HEADS = 64  # "layout_q为TND时shape为[T1,N1,D],其中N1仅支持64"
SHAREDKV_TOPK = 512  # "K2仅支持512"
SHAREDKV_WINDOW = (127, 0)  # ori_win_left / ori_win_right: "仅支持默认值"
SHAREDKV_DTYPES = (torch.bfloat16, torch.float16, torch.float64)


def _visible_entries(t: int, cmp_ratio: int) -> int:
    """How many compressed entries a query at absolute position ``t`` may see under rightDownCausal (sparse_mode 3):
    entry ``w`` pools tokens ``[w·m, (w+1)·m)`` and is visible once its last token is, ``w < (t + 1) // m`` (the
    threshold transformers' DeepseekV4Indexer masks with); the shared-KV attention's compressed branch and the
    quantized indexer both read it here."""
    return max(0, (t + 1) // cmp_ratio)


def _paged_rows(op: str, name: str, cache: torch.Tensor, table: list[int], count: int) -> torch.Tensor:
    """Rows ``0 .. count-1`` of one request's paged cache ``[blocks, block_size, 1, D]``."""
    block_size = cache.shape[1]
    if count and (count - 1) // block_size >= len(table):
        raise NpuOpError(op, name, f"{count} rows need {-(-count // block_size)} blocks; the table has {len(table)}")
    rows = [cache[table[p // block_size], p % block_size, 0] for p in range(count)]
    return torch.stack(rows) if rows else cache.new_zeros((0, cache.shape[-1]))


def _sharedkv_fixed(op: str, ori_mask_mode, ori_win_left, ori_win_right, **ineffective) -> None:
    """The rules the shared-KV attention and its metadata op share: the window band at its defaults (mask mode 4,
    127 / 0), and the arguments the docs say have no effect yet (设置此参数无效 / 目前暂不支持), refused when given: a
    caller expecting an effect gets none."""
    chk.choice(op, "ori_mask_mode", ori_mask_mode, (4,))
    if (ori_win_left, ori_win_right) != SHAREDKV_WINDOW:
        raise NpuOpError(op, "ori_win_left", f"({ori_win_left}, {ori_win_right}): only the defaults "
                                             f"{SHAREDKV_WINDOW} are supported")
    for name, value in ineffective.items():
        if value is not None:
            raise NpuOpError(op, name, "has no effect on the device (the doc: not supported yet): pass None")


def npu_sparse_attn_sharedkv(q, *, ori_kv=None, cmp_kv=None, ori_sparse_indices=None, cmp_sparse_indices=None,
                             ori_block_table=None, cmp_block_table=None, cu_seqlens_q=None, cu_seqlens_ori_kv=None,
                             cu_seqlens_cmp_kv=None, seqused_q=None, seqused_kv=None, sinks=None, metadata=None,
                             softmax_scale=0, cmp_ratio=0, ori_mask_mode=4, cmp_mask_mode=3, ori_win_left=127,
                             ori_win_right=0, layout_q="BSND", layout_kv="PA_ND", return_softmax_lse=False):
    """custom-npu_sparse_attn_sharedkv.md, read as follows (what transformers' DeepseekV4Attention computes over its
    window cache and its compressor's entries, which the tests compare with):

    * a request's queries are its last ``q_len`` tokens: query ``i`` sits at ``t = seqused_kv[b] - q_len + i``
      (rightDownCausal, the doc's example: 128 queries over 4096 keys);
    * window branch (ori_mask_mode 4, band ``ori_win_left`` 127 / ``ori_win_right`` 0): the ``ori_kv`` rows of
      positions ``t - 127 .. t``, read through ``ori_block_table``;
    * compressed branch (cmp_mask_mode 3 at ``cmp_ratio``): entry ``w`` (tokens ``[w·m, (w+1)·m)``) is visible to
      ``t`` when ``w < (t + 1) // m``; with ``cmp_sparse_indices`` ``[T1, 1, 512]`` only the listed entries, a
      negative index listing none. A listed entry the query may not see, or one listed twice, is refused: the doc
      does not say whether the kernel masks or double-counts it;
    * one softmax over both branches and the sinks (``exp(sinks[h])`` joins each head's denominator, as gpt-oss's),
      ``K = V`` (shared KV), scaled by ``softmax_scale``;
    * ``softmax_lse`` is not returned ("目前softmax_lse输出为无效值"): the second output is NaN.
    """
    op = "custom.npu_sparse_attn_sharedkv"
    chk.choice(op, "layout_q", layout_q, ("TND", "BSND"))
    chk.choice(op, "layout_kv", layout_kv, ("PA_ND",), documented=("TND",))
    chk.choice(op, "cmp_mask_mode", cmp_mask_mode, (3,))
    _sharedkv_fixed(op, ori_mask_mode, ori_win_left, ori_win_right, ori_sparse_indices=ori_sparse_indices,
                    seqused_q=seqused_q, cu_seqlens_ori_kv=cu_seqlens_ori_kv, cu_seqlens_cmp_kv=cu_seqlens_cmp_kv)
    if return_softmax_lse:
        raise UnemulatedFeatureError(op, "return_softmax_lse", "True: the doc says the returned lse is invalid")
    if metadata is None:
        raise NpuOpError(op, "metadata", "required (the npu_sparse_attn_sharedkv_metadata result; 目前为必传参数)")
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) or softmax_scale <= 0:
        raise UnemulatedFeatureError(op, "softmax_scale", f"{softmax_scale!r}: the signature's default 0 and the doc's "
                                                          "None (1/sqrt(D)) disagree; pass the scale")
    tnd = layout_q == "TND"
    chk.tensor(op, "q", q, dims=(3,) if tnd else (4,), dtypes=SHAREDKV_DTYPES)
    if ori_kv is None or ori_block_table is None or seqused_kv is None:
        raise NpuOpError(op, "ori_kv", "ori_kv, ori_block_table and seqused_kv are required (every scene has the "
                                       "window branch)")
    chk.tensor(op, "ori_kv", ori_kv, dims=(4,))
    chk.same_dtype(op, "ori_kv", ori_kv, "q", q)
    _contiguous(op, q=q, ori_kv=ori_kv)
    n1, d = q.shape[-2], q.shape[-1]
    if d != SHAREDKV_DIM or ori_kv.shape[-1] != d or ori_kv.shape[2] != 1:
        raise NpuOpError(op, "ori_kv", f"q D {d} / ori_kv {tuple(ori_kv.shape)}: D must be {SHAREDKV_DIM} on both, "
                                       "KV_N 1")
    if tnd and n1 != SHAREDKV_Q_HEADS:
        raise NpuOpError(op, "q", f"{n1} query heads: layout TND takes N1 = {SHAREDKV_Q_HEADS}")
    for name, cache in (("ori_kv", ori_kv), ("cmp_kv", cmp_kv)):
        if cache is not None and (cache.shape[1] % 16 or cache.shape[1] > 1024):
            raise NpuOpError(op, name, f"block size {cache.shape[1]} must be a multiple of 16, at most 1024")
    if cmp_kv is not None:
        chk.tensor(op, "cmp_kv", cmp_kv, dims=(4,))
        chk.same_dtype(op, "cmp_kv", cmp_kv, "q", q)
        _contiguous(op, cmp_kv=cmp_kv)
        chk.choice(op, "cmp_ratio", cmp_ratio, (4, 128))
        if cmp_block_table is None or cmp_kv.shape[-1] != d or cmp_kv.shape[2] != 1:
            raise NpuOpError(op, "cmp_kv", f"shape {tuple(cmp_kv.shape)} must be [blocks, block_size, 1, {d}] with "
                                           "cmp_block_table")
    elif cmp_sparse_indices is not None:
        raise NpuOpError(op, "cmp_sparse_indices", "given without cmp_kv")
    if sinks is not None:
        chk.tensor(op, "sinks", sinks, dims=(1,), dtypes=(torch.float32, torch.float64))
        if sinks.shape[0] != n1:
            raise NpuOpError(op, "sinks", f"shape {tuple(sinks.shape)} must be [N1] = [{n1}]")
    if tnd:
        chk.tensor(op, "cu_seqlens_q", cu_seqlens_q, dims=(1,), dtypes=(torch.int32,))
        cu = [int(v) for v in cu_seqlens_q]
        if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:], strict=False)) or cu[-1] != q.shape[0]:
            raise NpuOpError(op, "cu_seqlens_q", f"{cu} must start at 0, never decrease and end at T1 = {q.shape[0]}")
        spans = list(zip(cu, cu[1:], strict=False))
        queries = [q[a:b] for a, b in spans]
    else:
        queries = list(q)
        spans = [(b * q.shape[1], (b + 1) * q.shape[1]) for b in range(q.shape[0])]
    batch = len(queries)
    kv_lens = [int(v) for v in chk.tensor(op, "seqused_kv", seqused_kv, dims=(1,), dtypes=(torch.int32,))]
    if len(kv_lens) != batch or any(n < len(qb) for n, qb in zip(kv_lens, queries, strict=True)):
        raise NpuOpError(op, "seqused_kv", f"{kv_lens}: one length per batch, each at least its query count")
    for name, table in (("ori_block_table", ori_block_table), ("cmp_block_table", cmp_block_table)):
        if table is not None:
            chk.tensor(op, name, table, dims=(2,), dtypes=(torch.int32,))
            if table.shape[0] != batch:
                raise NpuOpError(op, name, f"{table.shape[0]} rows for {batch} batch(es)")
    if cmp_sparse_indices is not None:
        chk.tensor(op, "cmp_sparse_indices", cmp_sparse_indices, dims=(3,), dtypes=(torch.int32,))
        if tuple(cmp_sparse_indices.shape) != (sum(len(qb) for qb in queries), 1, SHAREDKV_TOPK):
            raise NpuOpError(op, "cmp_sparse_indices", f"shape {tuple(cmp_sparse_indices.shape)} must be [Q_T, 1, "
                                                       f"{SHAREDKV_TOPK}]")

    _check_metadata(op, metadata, {
        "num_heads_q": n1, "head_dim": d, "layout_q": layout_q, "has_cmp_kv": cmp_kv is not None,
        "cmp_ratio": cmp_ratio if cmp_kv is not None else None,
        "cmp_topk": SHAREDKV_TOPK if cmp_sparse_indices is not None else 0, "batch_size": batch,
        "cu_seqlens_q": [int(v) for v in cu_seqlens_q] if tnd else None, "seqused_kv": kv_lens})

    cdt = chk.compute_dtype(q.dtype)
    left = SHAREDKV_WINDOW[0]
    out = torch.empty_like(q)
    flat_out = out.view(-1, n1, d)
    sink = sinks.to(cdt) if sinks is not None else None
    for b, qb in enumerate(queries):
        n_q, n_kv = len(qb), kv_lens[b]
        ori = _paged_rows(op, "ori_block_table", ori_kv, ori_block_table[b].tolist(), n_kv).to(cdt)
        n_cmp = n_kv // cmp_ratio if cmp_kv is not None else 0
        cmp = (_paged_rows(op, "cmp_block_table", cmp_kv, cmp_block_table[b].tolist(), n_cmp).to(cdt)
               if n_cmp else None)
        for i in range(n_q):
            t = n_kv - n_q + i
            keys = [ori[max(0, t - left):t + 1]]
            if cmp is not None:
                visible = _visible_entries(t, cmp_ratio)
                if cmp_sparse_indices is None:
                    chosen = list(range(visible))
                else:
                    listed = [int(w) for w in cmp_sparse_indices[spans[b][0] + i, 0] if int(w) >= 0]
                    if any(w >= visible for w in listed) or len(set(listed)) != len(listed):
                        raise UnemulatedFeatureError(op, "cmp_sparse_indices", f"query {t} of batch {b} lists "
                                                     f"{sorted(w for w in listed if w >= visible)[:4] or 'a repeated'} "
                                                     f"entry (visible: {visible}): the doc does not say how the kernel "
                                                     "treats it; list -1 instead")
                    chosen = listed
                keys.append(cmp[chosen])
            k = torch.cat(keys)  # K = V (shared KV)
            logits = (qb[i].to(cdt) @ k.T) * softmax_scale  # [N1, keys]
            if sink is not None:
                logits = torch.cat([logits, sink[:, None]], dim=-1)
            probs = torch.softmax(logits, dim=-1)[:, :k.shape[0]]
            flat_out[spans[b][0] + i] = (probs @ k).to(q.dtype)
    lse = torch.full((1, flat_out.shape[0], n1), float("nan"), dtype=torch.float32)
    return out, lse


# kvcache's encoding of what an npu_sparse_attn_sharedkv_metadata result was built for. The device's result is a
# task list (per core: batch, head, Q / K block ranges) nobody reads; what matters is that the attention call it
# serves is the call it was built for: upstream builds one per scene and step (c1a / c4a / c128a: window only, CSA,
# HCA) and a layer handed another scene's or a stale step's list runs that list's tasks, silently.
METADATA_TAG = 0x5A5
METADATA_FIELDS = ("num_heads_q", "head_dim", "layout_q", "has_cmp_kv", "cmp_ratio", "cmp_topk", "batch_size")
_LAYOUT_CODES = {"BSND": 0, "TND": 1}


def npu_sparse_attn_sharedkv_metadata(num_heads_q, num_heads_kv, head_dim, *, cu_seqlens_q=None,
                                      cu_seqlens_ori_kv=None, cu_seqlens_cmp_kv=None, seqused_q=None, seqused_kv=None,
                                      batch_size=0, max_seqlen_q=0, max_seqlen_kv=0, ori_topk=0, cmp_topk=0,
                                      cmp_ratio=-1, ori_mask_mode=4, cmp_mask_mode=3, ori_win_left=127,
                                      ori_win_right=0, layout_q="BSND", layout_kv="PA_ND", has_ori_kv=True,
                                      has_cmp_kv=True, device="npu:0"):
    """custom-npu_sparse_attn_sharedkv_metadata.md: the task list ``npu_sparse_attn_sharedkv`` takes as ``metadata``,
    its arguments held to the doc's rules (N1 64, KV_N 1, band and causal masks at their defaults, ``cmp_topk`` 512,
    ``cmp_ratio`` 4 / 128, PA_ND keys, no ``ori_topk`` / ``seqused_q`` / kv prefix sums, not every tensor None). The
    emulation returns the call it describes (``METADATA_TAG``, ``METADATA_FIELDS``, then the lengths), which the
    attention call checks against its own."""
    op = "custom.npu_sparse_attn_sharedkv_metadata"
    chk.choice(op, "num_heads_q", num_heads_q, (SHAREDKV_Q_HEADS,))  # "目前仅支持64"
    chk.choice(op, "num_heads_kv", num_heads_kv, (1,))  # "目前仅支持1"
    chk.integer(op, "head_dim", head_dim, low=1)
    chk.choice(op, "layout_q", layout_q, tuple(_LAYOUT_CODES))
    chk.choice(op, "layout_kv", layout_kv, ("PA_ND",))
    _sharedkv_fixed(op, ori_mask_mode, ori_win_left, ori_win_right, cu_seqlens_ori_kv=cu_seqlens_ori_kv,
                    cu_seqlens_cmp_kv=cu_seqlens_cmp_kv, seqused_q=seqused_q)
    if ori_topk not in (0, None):
        raise NpuOpError(op, "ori_topk", f"{ori_topk}: not supported yet (the doc), leave it 0")
    if has_ori_kv is not True:
        raise NpuOpError(op, "has_ori_kv", "False: npu_sparse_attn_sharedkv always has the window branch")
    if has_cmp_kv:
        chk.choice(op, "cmp_ratio", cmp_ratio, (4, 128))
        chk.choice(op, "cmp_mask_mode", cmp_mask_mode, (3,))
    cmp_topk = cmp_topk or 0
    chk.choice(op, "cmp_topk", cmp_topk, (0, SHAREDKV_TOPK))
    if cmp_topk and not has_cmp_kv:
        raise NpuOpError(op, "cmp_topk", "a top-k over compressed entries without cmp_kv (has_cmp_kv False)")
    if cu_seqlens_q is None and seqused_kv is None:
        raise NpuOpError(op, "cu_seqlens_q", "every length tensor is None (the doc: Tensor不能全传None)")
    if layout_q == "TND" and cu_seqlens_q is None:
        raise NpuOpError(op, "cu_seqlens_q", "required with layout_q TND")
    cu = [int(v) for v in chk.tensor(op, "cu_seqlens_q", cu_seqlens_q, dims=(1,), dtypes=(torch.int32,))] \
        if cu_seqlens_q is not None else []
    used = [int(v) for v in chk.tensor(op, "seqused_kv", seqused_kv, dims=(1,), dtypes=(torch.int32,))] \
        if seqused_kv is not None else []
    chk.integer(op, "batch_size", batch_size, low=0)
    if used and batch_size != len(used):
        raise NpuOpError(op, "batch_size", f"{batch_size} for {len(used)} seqused_kv lengths")
    values = {"num_heads_q": num_heads_q, "head_dim": head_dim, "layout_q": _LAYOUT_CODES[layout_q],
              "has_cmp_kv": int(bool(has_cmp_kv)), "cmp_ratio": cmp_ratio if has_cmp_kv else -1,
              "cmp_topk": cmp_topk, "batch_size": batch_size}
    return torch.tensor([METADATA_TAG, *(values[f] for f in METADATA_FIELDS), len(cu), *cu, len(used), *used],
                        dtype=torch.int32)


def _check_metadata(op: str, metadata, call: dict) -> None:
    """The attention call's ``metadata`` was built for this call (``npu_sparse_attn_sharedkv_metadata``): same
    scene, batch and lengths; else the device runs another call's task list."""
    if not (isinstance(metadata, torch.Tensor) and metadata.dtype == torch.int32 and metadata.dim() == 1
            and metadata.numel() > len(METADATA_FIELDS) + 1 and int(metadata[0]) == METADATA_TAG):
        raise NpuOpError(op, "metadata", "not a result of custom.npu_sparse_attn_sharedkv_metadata (build it for "
                                         "this call)")
    got = [int(v) for v in metadata]
    built = dict(zip(METADATA_FIELDS, got[1:1 + len(METADATA_FIELDS)], strict=True))
    rest = got[1 + len(METADATA_FIELDS):]
    cu, rest = rest[1:1 + rest[0]], rest[1 + rest[0]:]
    used = rest[1:1 + rest[0]]
    want = {**call, "layout_q": _LAYOUT_CODES[call["layout_q"]], "has_cmp_kv": int(call["has_cmp_kv"]),
            "cmp_ratio": -1 if call["cmp_ratio"] is None else call["cmp_ratio"]}
    for field in METADATA_FIELDS:
        if built[field] != want[field]:
            raise NpuOpError(op, "metadata", f"built for {field} {built[field]}, this call has {want[field]}: the "
                                             "device would run another call's task list (one metadata per scene "
                                             "and step)")
    if call["cu_seqlens_q"] is not None and cu and cu != call["cu_seqlens_q"]:
        raise NpuOpError(op, "metadata", f"built for cu_seqlens_q {cu[:6]}, this call has {call['cu_seqlens_q'][:6]} "
                                         "(a stale step's metadata)")
    if used and used != call["seqused_kv"]:
        raise NpuOpError(op, "metadata", f"built for seqused_kv {used[:6]}, this call has {call['seqused_kv'][:6]} "
                                         "(a stale step's metadata)")


GATING_MAX_K = 64  # custom-npu_moe_gating_top_k.md: "取值小于等于e,且必须小于等于64"


def npu_moe_gating_top_k(x, k, *, bias=None, input_ids=None, tid2eid=None, k_group=1, group_count=1,
                         routed_scaling_factor=1.0, eps=1e-20, group_select_mode=0, renorm=0, norm_type=0,
                         out_flag=False):
    """custom-npu_moe_gating_top_k.md: ``(y, expert_idx, norm_out)`` over ``x [T, e]`` or ``[b, s, e]``. The scores
    are ``norm(x)`` (0 softmax, 1 sigmoid, 2 sqrt(softplus)); the experts are the grouped top-k of ``norm + bias``
    (``moe.grouped_top_k``, shared with torch_npu's op), or in the hash case (``input_ids`` and ``tid2eid`` both given)
    ``tid2eid[input_ids]``; ``y`` is their scores without the bias, ``y / (sum(y) + eps) * routed_scaling_factor``.

    Readings (references/device_questions.md, DeepSeek-V4 section): the weights leave the bias out and norm_type 2 is
    sqrt(softplus), as upstream deepseek_v4's own torch path (``gate_topk_native``, which maps "sqrtsoftplus" to 2)
    and transformers' DeepseekV4TopKRouter / DeepseekV4HashRouter compute; the doc's formula adds the bias to normOut
    before the top-k and names norm_type 2 "Softplus". ``out_flag`` with a bias is refused: the doc does not say
    whether the normalised output holds it."""
    op = "custom.npu_moe_gating_top_k"
    chk.tensor(op, "x", x, dims=(2, 3), dtypes=chk.FLOAT_DTYPES)
    experts = int(x.shape[-1])
    chk.integer(op, "k", k, low=1, high=min(experts, GATING_MAX_K))
    chk.choice(op, "renorm", renorm, (0,))  # "renorm仅支持0"
    chk.choice(op, "group_select_mode", group_select_mode, (0, 1))
    chk.choice(op, "norm_type", norm_type, (0, 1, 2))
    chk.integer(op, "group_count", group_count, low=1)
    chk.integer(op, "k_group", k_group, low=1, high=group_count)
    if experts % group_count or (group_select_mode == 1 and group_count > 1 and experts // group_count < 2):
        raise NpuOpError(op, "group_count", f"{experts} experts must split evenly into {group_count} groups"
                                            f"{' of at least 2 (group_select_mode 1 sums the top 2)' if group_select_mode else ''}")
    if k > experts // group_count * k_group:
        raise NpuOpError(op, "k", f"{k} experts cannot come from {k_group} of {group_count} groups of "
                                  f"{experts // group_count}")
    if bias is not None:
        chk.tensor(op, "bias", bias, dims=(1,))
        chk.same_dtype(op, "bias", bias, "x", x)  # "bias的dtype要和x相同"
    if (input_ids is None) != (tid2eid is None):
        raise NpuOpError(op, "input_ids" if input_ids is None else "tid2eid",
                         "input_ids and tid2eid come together (hash) or not at all (top-k): 不允许只有一个为空")
    if out_flag and bias is not None:
        raise UnemulatedFeatureError(op, "out_flag", "with a bias the doc does not say whether the normalised output "
                                                     "holds it (normOut is redefined as normOut + bias)")
    rows = x.reshape(-1, experts)
    cdt = chk.compute_dtype(x.dtype)
    logits = rows.to(cdt)
    norm = (torch.softmax(logits, dim=-1) if norm_type == 0 else torch.sigmoid(logits) if norm_type == 1
            else torch.nn.functional.softplus(logits).sqrt())
    if tid2eid is None:
        idx = grouped_top_k(op, norm, k, bias, k_group, group_count, group_select_mode)
    else:
        chk.tensor(op, "tid2eid", tid2eid, dims=(2,), dtypes=(torch.int32,))
        chk.tensor(op, "input_ids", input_ids, dims=(1,), dtypes=(torch.int64,))
        n = int(tid2eid.shape[0])
        if tuple(tid2eid.shape) != (n, k):
            raise NpuOpError(op, "tid2eid", f"shape {tuple(tid2eid.shape)} must be (n, k) = (n, {k})")
        if input_ids.shape[0] != rows.shape[0]:
            raise NpuOpError(op, "input_ids", f"{input_ids.shape[0]} ids for {rows.shape[0]} tokens")
        if input_ids.numel() and not 0 <= int(input_ids.min()) <= int(input_ids.max()) < n:
            raise NpuOpError(op, "input_ids", f"ids must index tid2eid's {n} rows, got {int(input_ids.min())}.."
                                              f"{int(input_ids.max())}")
        idx = tid2eid.long()[input_ids]
        if idx.numel() and not 0 <= int(idx.min()) <= int(idx.max()) < experts:
            raise NpuOpError(op, "tid2eid", f"expert ids must lie in [0, {experts}), got {int(idx.min())}.."
                                            f"{int(idx.max())}")
    y = norm.gather(1, idx)
    y = y / (y.sum(-1, keepdim=True) + float(eps)) * float(routed_scaling_factor)
    shape = (*x.shape[:-1], k)
    norm_out = (norm.float() if out_flag else torch.full(rows.shape, float("nan"), dtype=torch.float32))
    return y.to(x.dtype).view(shape), idx.to(torch.int32).view(shape), norm_out.view(x.shape)


HC_MULT = 4  # custom-npu_hc_pre.md / custom-npu_hc_post.md 约束说明: hc 取值固定为 4, d 固定为 4096, hc_mix 固定为 24
HC_DIM = 4096
HC_MIX = (2 + HC_MULT) * HC_MULT
HC_SINKHORN_ITERS = 20  # custom-npu_hc_pre.md: "hc_sinkhorn_iters 取值固定为20"
HC_X_DTYPES = (torch.bfloat16, torch.float64)  # hc_pre's x: bfloat16 (float64: the CPU validation mode)
HC_PARAM_DTYPES = (torch.float32, torch.float64)


def _hc_streams(op: str, x: torch.Tensor, lead: int) -> None:
    """``x [T, hc, d]`` / ``[b, s, hc, d]`` (``lead`` leading axes before hc) with hc and d as the docs fix them."""
    if tuple(x.shape[lead:]) != (HC_MULT, HC_DIM):
        raise NpuOpError(op, "x" if op.endswith("pre") else "residual",
                         f"trailing shape {tuple(x.shape[lead:])} must be (hc, d) = ({HC_MULT}, {HC_DIM}) "
                         "(the doc fixes hc 4 and d 4096)")


def npu_hc_pre(x, hc_fn, hc_scale, hc_base, *, hc_mult=4, hc_sinkhorn_iters=20, norm_eps=1e-6, hc_eps=1e-6):
    """custom-npu_hc_pre.md: ``(y [.., d], post [.., hc], comb [.., hc, hc])`` of mHC's pre-processing over the
    streams ``x [T, hc, d]`` / ``[b, s, hc, d]``. The doc defers the arithmetic to its example test (not in the
    snapshot); the emulation computes what upstream deepseek_v4's own torch path (``op_impls/mhc.py``:
    ``hc_pre_native`` + ``hc_split_sinkhorn_torch``) and transformers' DeepseekV4HyperConnection compute: the streams'
    RMS (``norm_eps``) scales ``x @ hc_fn^T``; pre = sigmoid(. * scale[0] + base) + hc_eps, post = 2 sigmoid(. *
    scale[1] + base), comb = softmax(. * scale[2] + base) + hc_eps made doubly stochastic by ``hc_sinkhorn_iters``
    column-then-row normalisations (columns first and last); ``y = sum_j pre[j] x[j]``."""
    op = "custom.npu_hc_pre"
    chk.tensor(op, "x", x, dims=(3, 4), dtypes=HC_X_DTYPES)
    chk.tensor(op, "hc_fn", hc_fn, dims=(2,), dtypes=HC_PARAM_DTYPES)
    chk.tensor(op, "hc_scale", hc_scale, dims=(1,), dtypes=HC_PARAM_DTYPES)
    chk.tensor(op, "hc_base", hc_base, dims=(1,), dtypes=HC_PARAM_DTYPES)
    _contiguous(op, x=x, hc_fn=hc_fn, hc_scale=hc_scale, hc_base=hc_base)
    chk.choice(op, "hc_mult", hc_mult, (HC_MULT,))
    chk.choice(op, "hc_sinkhorn_iters", hc_sinkhorn_iters, (HC_SINKHORN_ITERS,))
    for name, value in (("norm_eps", norm_eps), ("hc_eps", hc_eps)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise NpuOpError(op, name, f"must be a float (a host double), got {type(value).__name__}")
    lead = x.dim() - 2
    _hc_streams(op, x, lead)
    if tuple(hc_fn.shape) != (HC_MIX, HC_MULT * HC_DIM):
        raise NpuOpError(op, "hc_fn", f"shape {tuple(hc_fn.shape)} must be [hc_mix, hc * d] = [{HC_MIX}, "
                                      f"{HC_MULT * HC_DIM}]")
    if tuple(hc_scale.shape) != (3,):
        raise NpuOpError(op, "hc_scale", f"shape {tuple(hc_scale.shape)} must be [3]")
    if tuple(hc_base.shape) != (HC_MIX,):
        raise NpuOpError(op, "hc_base", f"shape {tuple(hc_base.shape)} must be [hc_mix] = [{HC_MIX}]")
    cdt = chk.compute_dtype(x.dtype if x.dtype == torch.float64 else hc_fn.dtype)
    hc = HC_MULT
    flat = x.reshape(*x.shape[:lead], hc * HC_DIM).to(cdt)
    mixes = torch.nn.functional.linear(flat, hc_fn.to(cdt)) * torch.rsqrt(
        flat.square().mean(-1, keepdim=True) + float(norm_eps))
    scale, base = hc_scale.to(cdt), hc_base.to(cdt)
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre = torch.sigmoid(pre_w * scale[0] + base[:hc]) + float(hc_eps)
    post = 2 * torch.sigmoid(post_w * scale[1] + base[hc:2 * hc])
    comb = torch.softmax(comb_w.unflatten(-1, (hc, hc)) * scale[2] + base[2 * hc:].view(hc, hc), dim=-1) + \
        float(hc_eps)
    comb = comb / (comb.sum(-2, keepdim=True) + float(hc_eps))
    for _ in range(hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + float(hc_eps))
        comb = comb / (comb.sum(-2, keepdim=True) + float(hc_eps))
    y = (pre.unsqueeze(-1) * x.to(cdt)).sum(dim=lead)
    return y.to(x.dtype), post, comb


def npu_hc_post(x, residual, post, comb):
    """custom-npu_hc_post.md: ``post.unsqueeze(-1) * x.unsqueeze(-2) + torch.sum(comb.unsqueeze(-1) *
    residual.unsqueeze(-2), dim=2)`` for ``[b, s, ...]`` operands: the streams mixed through comb's first axis
    (``comb^T @ residual``, as transformers' DeepseekV4DecoderLayer mixes them). The ``[T, ...]`` form is refused: there
    ``dim=2`` of the doc's formula is comb's other axis, and which one the kernel sums is not settled."""
    op = "custom.npu_hc_post"
    chk.tensor(op, "x", x, dims=(2, 3), dtypes=chk.FLOAT_DTYPES)
    chk.tensor(op, "residual", residual, dims=(3, 4), dtypes=chk.FLOAT_DTYPES)
    chk.tensor(op, "post", post, dims=(2, 3), dtypes=chk.FLOAT_DTYPES)
    chk.tensor(op, "comb", comb, dims=(3, 4), dtypes=chk.FLOAT_DTYPES)
    chk.same_dtype(op, "residual", residual, "x", x)  # "x、residual和y的dtype要保持一致"
    chk.same_dtype(op, "comb", comb, "post", post)  # "post和comb的dtype要保持一致"
    _contiguous(op, x=x, residual=residual, post=post, comb=comb)
    if x.dim() == 2:
        raise UnemulatedFeatureError(op, "x", "the [b * s, ...] form: the doc's formula sums dim=2, comb's second axis "
                                              "there but its first in the [b, s, ...] form; pass [b, s, ...] operands")
    b, s = x.shape[:2]
    _hc_streams(op, residual, 2)
    want = {"x": (b, s, HC_DIM), "residual": (b, s, HC_MULT, HC_DIM), "post": (b, s, HC_MULT),
            "comb": (b, s, HC_MULT, HC_MULT)}
    for name, value in (("x", x), ("residual", residual), ("post", post), ("comb", comb)):
        if tuple(value.shape) != want[name]:
            raise NpuOpError(op, name, f"shape {tuple(value.shape)} must be {list(want[name])}")
    cdt = chk.compute_dtype(torch.float64 if torch.float64 in (x.dtype, post.dtype) else torch.float32)
    out = post.to(cdt).unsqueeze(-1) * x.to(cdt).unsqueeze(-2) + torch.sum(
        comb.to(cdt).unsqueeze(-1) * residual.to(cdt).unsqueeze(-2), dim=2)
    return out.to(x.dtype)


# ------------------------------------------------------------------ the quantized lightning indexer and its metadata

QLI_HEADS_Q = 64  # custom-npu_quant_lightning_indexer.md: "N1仅支持64"; its metadata: "num_heads_q ... 目前仅支持64"
QLI_HEADS_K = 1  # custom-npu_quant_lightning_indexer_metadata.md: "num_heads_k ... 目前仅支持1"
QLI_DIM = 128  # "参数query中的D和参数key中的D值相等为128"
QLI_CMP_RATIOS = (1, 2, 4, 8, 16, 32, 64, 128)  # "cmp_ratio ... 支持1/2/4/8/16/32/64/128"
QLI_QUANT_MODES = (0,)  # query_quant_mode / key_quant_mode: "当前支持Per-Token-Head量化模式,当前仅支持传入0"
QLI_SCALE_DTYPES = (torch.float16,)  # weights / query_dequant_scale / key_dequant_scale: "数据类型支持float16"
QLI_MAX_BLOCK_SIZE = 1024  # "block_size取值为16的整数倍,最大支持到1024"
FLOAT16_MAX = float(torch.finfo(torch.float16).max)  # "要求W ⊙ Scale_Q的结果在float16的表示范围内"


def _qli_fixed(op: str, *, query_quant_mode, key_quant_mode, layout_query, layout_key, sparse_count, sparse_mode,
               pre_tokens, next_tokens, cmp_ratio) -> None:
    """The rules the quantized indexer and its metadata op share (each doc states them alike)."""
    chk.choice(op, "query_quant_mode", query_quant_mode, QLI_QUANT_MODES)
    chk.choice(op, "key_quant_mode", key_quant_mode, QLI_QUANT_MODES)
    chk.choice(op, "layout_query", layout_query, tuple(_LAYOUT_CODES))
    chk.choice(op, "layout_key", layout_key, ("PA_BSND",))  # "当前仅支持传入PA_BSND" (the signature's 'BSND' too)
    chk.integer(op, "sparse_count", sparse_count, low=1, high=SPARSE_COUNT_MAX)  # "支持[1, 2048]"
    chk.choice(op, "sparse_mode", sparse_mode, SPARSE_MODES)  # "支持0/3"
    for name, value in (("pre_tokens", pre_tokens), ("next_tokens", next_tokens)):
        if isinstance(value, bool) or value != INT64_MAX:
            raise NpuOpError(op, name, f"{value!r}: only the default 2^63-1 is supported (the doc: 仅支持默认值)")
    chk.choice(op, "cmp_ratio", cmp_ratio, QLI_CMP_RATIOS)


def _qli_lengths(op: str, layout_query: str, actual_q, actual_k) -> tuple[list[int] | None, list[int], int]:
    """(per-request query counts or None, per-request ORIGINAL key counts, batch) from the two length tensors:
    ``actual_seq_lengths_query`` prefix sums for TND ("前缀和"), per request for BSND (None: every request has S1);
    ``actual_seq_lengths_key`` per request, required (PA_BSND: "该入参必须传入")."""
    if actual_q is None and actual_k is None:
        raise NpuOpError(op, "actual_seq_lengths_key", "every length tensor is None (the doc: Tensor不能全传None)")
    if layout_query == "TND" and actual_q is None:
        raise NpuOpError(op, "actual_seq_lengths_query", "is required when layout_query is TND (该入参必须传入)")
    if actual_k is None:
        raise NpuOpError(op, "actual_seq_lengths_key", "is required when layout_key is PA_BSND (该入参必须传入)")
    k_lens = _lengths(op, "actual_seq_lengths_key", actual_k, None, prefix_sum=False)
    q_lens = _lengths(op, "actual_seq_lengths_query", actual_q, len(k_lens), prefix_sum=layout_query == "TND")
    return q_lens, k_lens, len(k_lens)


# kvcache's encoding of what an npu_quant_lightning_indexer_metadata result was built for (the device's [1024] int32
# task list per core, which nobody reads): the scene's fields, then each length list's count (-1: None) and digest,
# so the indexer refuses a metadata built for another call or a stale step, as npu_sparse_attn_sharedkv does.
QLI_METADATA_TAG = 0x11D
QLI_METADATA_SIZE = 1024  # custom-npu_quant_lightning_indexer.md, metadata: "shape大小为[1024]"
QLI_METADATA_FIELDS = ("num_heads_q", "num_heads_k", "head_dim", "layout_query", "sparse_count", "sparse_mode",
                       "cmp_ratio", "batch_size", "max_seqlen_q", "max_seqlen_k")


def _digest(values: list[int] | None) -> tuple[int, int]:
    """(count, crc32) of a length list as passed (count -1 for None): what a metadata result remembers of it."""
    if values is None:
        return -1, 0
    return len(values), zlib.crc32(",".join(map(str, values)).encode()) >> 1  # 31 bits: an int32 element


def npu_quant_lightning_indexer_metadata(num_heads_q, num_heads_k, head_dim, query_quant_mode, key_quant_mode, *,
                                         actual_seq_lengths_query=None, actual_seq_lengths_key=None, batch_size=0,
                                         max_seqlen_q=0, max_seqlen_k=0, layout_query="BSND", layout_key="BSND",
                                         sparse_count=2048, sparse_mode=3, pre_tokens=INT64_MAX,
                                         next_tokens=INT64_MAX, cmp_ratio=1, device="npu:0"):
    """custom-npu_quant_lightning_indexer_metadata.md: the task list ``npu_quant_lightning_indexer`` takes as
    ``metadata``, its arguments held to the doc's rules (N1 64, N2 1, quant modes 0, PA_BSND keys, the length tensors
    int32 and not both None, prefix sums for TND, the indexer's shared rules). The emulation returns the call it
    describes (``QLI_METADATA_TAG``, ``QLI_METADATA_FIELDS``, the length lists' digests) in an int32 ``[1024]``,
    which the indexer checks against its own call.

    Readings: ``batch_size`` 0 (the signature's default; the doc's "默认值为None") and ``max_seqlen_q`` /
    ``max_seqlen_k`` 0 mean "not given", as upstream deepseek_v4 calls it (generate_li_metadata_kwargs passes none of
    them); a value given must be the batch (the key lengths' count) and the largest per-request query / ORIGINAL key
    count (the doc's example: ``actual_seq_lengths_*.max()``), else refused: the kernel's split would not cover the
    call."""
    op = "custom.npu_quant_lightning_indexer_metadata"
    chk.choice(op, "num_heads_q", num_heads_q, (QLI_HEADS_Q,))
    chk.choice(op, "num_heads_k", num_heads_k, (QLI_HEADS_K,))
    chk.integer(op, "head_dim", head_dim, low=1)
    _qli_fixed(op, query_quant_mode=query_quant_mode, key_quant_mode=key_quant_mode, layout_query=layout_query,
               layout_key=layout_key, sparse_count=sparse_count, sparse_mode=sparse_mode, pre_tokens=pre_tokens,
               next_tokens=next_tokens, cmp_ratio=cmp_ratio)
    if not isinstance(device, str):
        raise NpuOpError(op, "device", f"must be a str such as 'npu:0', got {type(device).__name__}")
    q_lens, k_lens, batch = _qli_lengths(op, layout_query, actual_seq_lengths_query, actual_seq_lengths_key)
    chk.integer(op, "batch_size", batch_size, low=0)
    if batch_size and batch_size != batch:
        raise NpuOpError(op, "batch_size", f"{batch_size} for {batch} actual_seq_lengths_key lengths")
    chk.integer(op, "max_seqlen_q", max_seqlen_q, low=0)
    chk.integer(op, "max_seqlen_k", max_seqlen_k, low=0)
    for name, given, lens in (("max_seqlen_q", max_seqlen_q, q_lens), ("max_seqlen_k", max_seqlen_k, k_lens)):
        if given and lens is not None and given != max(lens, default=0):
            raise NpuOpError(op, name, f"{given} is not the largest per-request count {max(lens, default=0)}")
    values = {"num_heads_q": num_heads_q, "num_heads_k": num_heads_k, "head_dim": head_dim,
              "layout_query": _LAYOUT_CODES[layout_query], "sparse_count": sparse_count, "sparse_mode": sparse_mode,
              "cmp_ratio": cmp_ratio, "batch_size": batch, "max_seqlen_q": max_seqlen_q, "max_seqlen_k": max_seqlen_k}
    raw_q = None if actual_seq_lengths_query is None else [int(v) for v in actual_seq_lengths_query]
    head = [QLI_METADATA_TAG, *(values[f] for f in QLI_METADATA_FIELDS), *_digest(raw_q), *_digest(k_lens)]
    out = torch.zeros(QLI_METADATA_SIZE, dtype=torch.int32)
    out[:len(head)] = torch.tensor(head, dtype=torch.int32)
    return out


def _check_qli_metadata(op: str, metadata, call: dict) -> None:
    """The indexer's ``metadata`` was built for this call (npu_quant_lightning_indexer_metadata): same scene, batch and
    lengths; else the device runs another call's task list."""
    n = len(QLI_METADATA_FIELDS)
    if not (isinstance(metadata, torch.Tensor) and metadata.dtype == torch.int32 and metadata.dim() == 1
            and metadata.numel() == QLI_METADATA_SIZE and int(metadata[0]) == QLI_METADATA_TAG):
        raise NpuOpError(op, "metadata", "not a result of custom.npu_quant_lightning_indexer_metadata (build it for "
                                         "this call)")
    got = [int(v) for v in metadata[:1 + n + 4]]
    built = dict(zip(QLI_METADATA_FIELDS, got[1:1 + n], strict=True))
    want = {**call, "layout_query": _LAYOUT_CODES[call["layout_query"]]}
    for field in QLI_METADATA_FIELDS:
        if field.startswith("max_seqlen"):
            if built[field] and built[field] != want[field]:
                raise NpuOpError(op, "metadata", f"built for {field} {built[field]}, this call's largest count is "
                                                 f"{want[field]} (a stale step's metadata)")
        elif built[field] != want[field]:
            raise NpuOpError(op, "metadata", f"built for {field} {built[field]}, this call has {want[field]}: the "
                                             "device would run another call's task list")
    for name, pair in (("actual_seq_lengths_query", got[1 + n:3 + n]), ("actual_seq_lengths_key", got[3 + n:5 + n])):
        if tuple(pair) != _digest(call[name]):
            raise NpuOpError(op, "metadata", f"built for other {name} than this call's {call[name] and call[name][:6]} "
                                             "(a stale step's metadata)")


QLI_CHUNK = 256  # query rows scored at once: [rows, 64, entries] float64 stays small on long prefills


def _qli_scores(q, w, q_scale, k, k_scale) -> torch.Tensor:
    """The doc's formula in float64 for query rows ``q [rows, N1, D]`` (int8) against keys ``k [c, D]``:
    ``sum_h W[h] * ReLU((Scale_Q[h] * Scale_K[w]) * (Q[h] . K[w]))`` -> ``[rows, c]``."""
    cdt = torch.float64
    dots = q.to(cdt) @ k.T  # [rows, N1, c], exact: |int8 . int8| over 128 lanes < 2^21
    scale = q_scale.to(cdt)[..., None] * k_scale
    return (w.to(cdt)[..., None] * (scale * dots).relu()).sum(dim=1)


def npu_quant_lightning_indexer(query, key, weights, query_dequant_scale, key_dequant_scale, *,
                                actual_seq_lengths_query=None, actual_seq_lengths_key=None, block_table=None,
                                metadata=None, query_quant_mode=0, key_quant_mode=0, layout_query="BSND",
                                layout_key="BSND", sparse_count=2048, sparse_mode=3, pre_tokens=INT64_MAX,
                                next_tokens=INT64_MAX, cmp_ratio=1, return_value=False):
    """custom-npu_quant_lightning_indexer.md: per query token, ``score_w = sum over the 64 query heads h of
    W[h] * ReLU(Scale_Q[h] * Scale_K[w] * (Q_int8[h] . K_int8[w]))`` over the compressed keys of its request, and the
    entries of the ``sparse_count`` largest scores; ``(sparse_indices int32 [T1, 1, k] / [B, S1, 1, k], sparse_values)``.
    Read as follows (each also what transformers' DeepseekV4Indexer selects, which the tests compare with):

    * request ``b``'s compressed keys are entries ``0 .. n // m - 1`` (``n = actual_seq_lengths_key[b]``, the
      ORIGINAL token count; ``m = cmp_ratio``), entry ``w`` at ``key[block_table[b, w // bs], w % bs, 0]``, its scale
      at ``key_dequant_scale[...same...]``;
    * a request's queries are its last ``q_len`` tokens (``t = n - q_len + i``); sparse_mode 3 (rightDownCausal)
      lets ``t`` see entries ``w < (t + 1) // m`` (``_visible_entries``), sparse_mode 0 every entry;
    * the row: the visible entries by descending score, equal scores by ascending entry (the doc fixes no tie
      order; a deterministic one), then -1 up to ``sparse_count`` (the doc does not say what fills a row with fewer
      visible entries; -1 is what transformers' indexer writes and npu_sparse_attn_sharedkv reads as "no entry",
      as the torch_npu indexer's emulation fills). Rows no request covers stay -1;
    * the arithmetic in float64 (the int8 products exact); ``sparse_values`` is not returned (目前暂不支持): NaN.

    Refused: what the doc rules out, a ``W ⊙ Scale_Q`` outside float16 ("要求...在float16的表示范围内"), a NaN score
    ("对NAN排序是未定义行为"), and a ``metadata`` built for another call (the argument is optional)."""
    op = "custom.npu_quant_lightning_indexer"
    _qli_fixed(op, query_quant_mode=query_quant_mode, key_quant_mode=key_quant_mode, layout_query=layout_query,
               layout_key=layout_key, sparse_count=sparse_count, sparse_mode=sparse_mode, pre_tokens=pre_tokens,
               next_tokens=next_tokens, cmp_ratio=cmp_ratio)
    if return_value is not False:
        raise NpuOpError(op, "return_value", f"{return_value!r}: only the default False is supported "
                                             "(目前暂不支持返回sparse_values)")
    tnd = layout_query == "TND"
    chk.tensor(op, "query", query, dims=(3,) if tnd else (4,), dtypes=(torch.int8,))
    chk.tensor(op, "key", key, dims=(4,), dtypes=(torch.int8,))
    chk.tensor(op, "weights", weights, dtypes=QLI_SCALE_DTYPES)
    chk.tensor(op, "query_dequant_scale", query_dequant_scale, dtypes=QLI_SCALE_DTYPES)
    chk.tensor(op, "key_dequant_scale", key_dequant_scale, dims=(3,), dtypes=QLI_SCALE_DTYPES)
    _contiguous(op, query=query, key=key, weights=weights, query_dequant_scale=query_dequant_scale,
                key_dequant_scale=key_dequant_scale)
    n1, d = query.shape[-2], query.shape[-1]
    if n1 != QLI_HEADS_Q or d != QLI_DIM:
        raise NpuOpError(op, "query", f"shape {tuple(query.shape)}: N1 must be {QLI_HEADS_Q} and D {QLI_DIM}")
    blocks, block_size, n2, kd = key.shape
    if n2 != QLI_HEADS_K or kd != QLI_DIM:
        raise NpuOpError(op, "key", f"shape {tuple(key.shape)} must be [block_count, block_size, N2 {QLI_HEADS_K}, "
                                    f"D {QLI_DIM}]")
    if blocks < 1 or block_size % 16 or block_size > QLI_MAX_BLOCK_SIZE:
        raise NpuOpError(op, "key", f"block size {block_size} must be a multiple of 16, at most {QLI_MAX_BLOCK_SIZE}")
    for name, t in (("weights", weights), ("query_dequant_scale", query_dequant_scale)):
        if tuple(t.shape) != tuple(query.shape[:-1]):
            raise NpuOpError(op, name, f"shape {tuple(t.shape)} must be {list(query.shape[:-1])} ([B,S1,N1] / [T,N1])")
    if tuple(key_dequant_scale.shape) != (blocks, block_size, n2):
        raise NpuOpError(op, "key_dequant_scale", f"shape {tuple(key_dequant_scale.shape)} must be [block_count, "
                                                  f"block_size, N2] = [{blocks}, {block_size}, {n2}]")
    _, k_lens, batch = _qli_lengths(op, layout_query, actual_seq_lengths_query, actual_seq_lengths_key)
    if not tnd and query.shape[0] != batch:
        raise NpuOpError(op, "actual_seq_lengths_key", f"{batch} lengths for query's batch {query.shape[0]}")
    q_lens, q_starts, _ = _query_rows(op, query, layout_query, actual_seq_lengths_query)  # per request, S1 if None
    if block_table is None:
        raise NpuOpError(op, "block_table", "is required when layout_key is PA_BSND")
    chk.tensor(op, "block_table", block_table, dims=(2,), dtypes=(torch.int32,))
    if block_table.shape[0] != batch:
        raise NpuOpError(op, "block_table", f"{block_table.shape[0]} rows for {batch} batch(es) (第一维长度需要等于B)")
    n_cmp = [n // cmp_ratio for n in k_lens]
    need = max([-(-c // block_size) for c in n_cmp] + [0])
    if block_table.shape[1] < need:
        raise NpuOpError(op, "block_table", f"{block_table.shape[1]} columns; the longest request's "
                                            f"{max(n_cmp)} compressed keys need {need} (maxBlockNumPerSeq)")
    table = block_table.tolist()
    for b, c in enumerate(n_cmp):
        used = table[b][:-(-c // block_size)] if c else []
        if any(not 0 <= blk < blocks for blk in used):
            raise NpuOpError(op, "block_table", f"batch {b} names a block outside key's {blocks}: {used[:8]}")
    if sparse_mode == 3:
        for b, (s1, n) in enumerate(zip(q_lens, k_lens, strict=True)):
            if n < s1:
                raise NpuOpError(op, "actual_seq_lengths_key", f"batch {b}: {n} key tokens for {s1} queries "
                                                               "(rightDownCausal: the queries are the last tokens)")
    if metadata is not None:
        _check_qli_metadata(op, metadata, {
            "num_heads_q": n1, "num_heads_k": n2, "head_dim": d, "layout_query": layout_query,
            "sparse_count": sparse_count, "sparse_mode": sparse_mode, "cmp_ratio": cmp_ratio, "batch_size": batch,
            "max_seqlen_q": max(q_lens, default=0), "max_seqlen_k": max(k_lens, default=0),
            "actual_seq_lengths_query": (None if actual_seq_lengths_query is None
                                         else [int(v) for v in actual_seq_lengths_query]),
            "actual_seq_lengths_key": k_lens})

    cdt = torch.float64
    flat_q = query.reshape(-1, n1, d)
    w_q = weights.reshape(-1, n1).to(cdt) * query_dequant_scale.reshape(-1, n1).to(cdt)
    out = torch.full((flat_q.shape[0], n2, sparse_count), INVALID, dtype=torch.int32)
    for b in range(batch):
        s1, c = q_lens[b], n_cmp[b]
        rows = slice(q_starts[b], q_starts[b] + s1)
        if s1 == 0 or c == 0:
            continue
        wq = w_q[rows]
        if not bool(torch.isfinite(wq).all()) or bool((wq.abs() > FLOAT16_MAX).any()):
            raise NpuOpError(op, "weights", f"batch {b}: W ⊙ Scale_Q leaves the float16 range (the doc: 要求W⊙Scale_Q"
                                            "的结果在float16的表示范围内)")
        k = _paged_rows(op, "block_table", key, table[b], c).to(cdt)  # [c, D]
        k_scale = _paged_rows(op, "block_table", key_dequant_scale, table[b], c).to(cdt)  # [c]
        chunks = [slice(a, min(a + QLI_CHUNK, rows.stop)) for a in range(rows.start, rows.stop, QLI_CHUNK)]
        scores = torch.cat([_qli_scores(flat_q[r], weights.reshape(-1, n1)[r], query_dequant_scale.reshape(-1, n1)[r],
                                        k, k_scale) for r in chunks])  # [s1, c]
        for i in range(s1):
            seen = c if sparse_mode == 0 else min(c, _visible_entries(k_lens[b] - s1 + i, cmp_ratio))
            row = scores[i, :seen]
            if bool(row.isnan().any()):
                raise UnemulatedFeatureError(op, "key_dequant_scale", f"batch {b} query {i}: a NaN score (the doc: "
                                                                      "TopK过程对NAN排序是未定义行为)")
            order = torch.sort(row, descending=True, stable=True).indices[:sparse_count]
            out[q_starts[b] + i, 0, :order.numel()] = order.to(torch.int32)
    if not tnd:
        out = out.view(query.shape[0], query.shape[1], n2, sparse_count)
    return out, torch.full(out.shape, float("nan"), dtype=torch.float32)


# ---------------------------------------------------------------------------------------- indexer_compress_epilog

EPILOG_DIM = 4096  # custom-npu_indexer_compress_epilog.md 约束说明: "d 取值固定为: 4096"
EPILOG_GROUP = 128  # "两种量化均为每128个数进行一次量化"
EPILOG_SCALES = -(-EPILOG_DIM // EPILOG_GROUP)  # "scale_factor 取值为d / 128向上取整,固定为32"
EPILOG_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
EPILOG_SCALE_DTYPES = {1: torch.float32, 0: torch.float8_e8m0fnu}  # quant_mode 1: float32, 0 (Mx): float8_e8m0
EPILOG_X_DTYPES = (torch.float16, torch.bfloat16, torch.float64)  # float64: the CPU validation mode


def indexer_compress_epilog(indexer_compress_cache, indexer_compress_scale, x, slot_mapping, *, quant_mode=1,
                            round_scale=True) -> None:
    """custom-npu_indexer_compress_epilog.md: each row ``x[i]`` whose ``slot_mapping[i]`` is not -1 quantized per
    group of 128 lanes and written in place, ``indexer_compress_cache[slot] = value``, ``indexer_compress_scale[slot]
    = scale``. ``DynamicQuant`` read as torch_npu's ``npu_dynamic_quant`` formula per group: ``scale = max|x_g| /
    DTYPE_MAX`` (448 for float8_e4m3fn, 57344 for float8_e5m2), ``value = x_g / scale`` cast to the cache dtype, so
    ``value * scale`` is the dequantized row; computed in float32 (float64 for float64 ``x``).

    Readings: ``slot_mapping``'s range ``[-1, T)`` bounds a slot by the cache's rows (the doc names both the cache's
    and x's rows T). Refused: what the doc rules out (d 4096, scale_factor 32, the dtypes, 2-D operands, slots below
    -1 or past the cache); quant_mode 0 (Mx, an e8m0 scale: the doc gives neither its exponent rule nor what
    ``round_scale`` rounds); a slot written twice and an all-zero group (scale 0): the doc does not say which write
    lands or what 0 / 0 quantizes to. A NaN row (the compressor's pad) written to a slot stays NaN there."""
    op = "custom.indexer_compress_epilog"
    chk.choice(op, "quant_mode", quant_mode, (1,), documented=(0,))
    if not isinstance(round_scale, bool):
        raise NpuOpError(op, "round_scale", f"must be a bool, got {type(round_scale).__name__}")
    cache = chk.tensor(op, "indexer_compress_cache", indexer_compress_cache, dims=(2,), dtypes=EPILOG_CACHE_DTYPES)
    scales = chk.tensor(op, "indexer_compress_scale", indexer_compress_scale, dims=(2,),
                        dtypes=(EPILOG_SCALE_DTYPES[quant_mode],))
    chk.tensor(op, "x", x, dims=(2,), dtypes=EPILOG_X_DTYPES)
    chk.tensor(op, "slot_mapping", slot_mapping, dims=(1,), dtypes=(torch.int32,))
    _contiguous(op, indexer_compress_cache=cache, indexer_compress_scale=scales, x=x, slot_mapping=slot_mapping)
    t, d = x.shape
    if d != EPILOG_DIM:
        raise NpuOpError(op, "x", f"shape {tuple(x.shape)}: d must be {EPILOG_DIM} (the doc: d 取值固定为4096)")
    if cache.shape[1] != d:
        raise NpuOpError(op, "indexer_compress_cache", f"shape {tuple(cache.shape)} must be [slots, d = {d}]")
    if tuple(scales.shape) != (cache.shape[0], EPILOG_SCALES):
        raise NpuOpError(op, "indexer_compress_scale", f"shape {tuple(scales.shape)} must be [slots, scale_factor] = "
                                                       f"[{cache.shape[0]}, {EPILOG_SCALES}]")
    if slot_mapping.shape[0] != t:
        raise NpuOpError(op, "slot_mapping", f"{slot_mapping.shape[0]} slots for x's {t} rows (shape [T])")
    slots = slot_mapping.to(torch.int64)
    if t and (int(slots.min()) < -1 or int(slots.max()) >= cache.shape[0]):
        raise NpuOpError(op, "slot_mapping", f"values {int(slots.min())}..{int(slots.max())} leave [-1, "
                                             f"{cache.shape[0]}) (the doc: 取值范围为[-1, T))")
    keep = slots != -1  # "slot_mapping 的值为 -1 时,表示无效,不执行更新"
    kept = slots[keep]
    if kept.unique().numel() != kept.numel():
        raise UnemulatedFeatureError(op, "slot_mapping", "two rows to one slot: the doc does not say which lands")
    groups = x[keep].to(chk.compute_dtype(x.dtype)).view(-1, EPILOG_SCALES, EPILOG_GROUP)
    absmax = groups.abs().amax(dim=-1)
    if bool((absmax == 0).any()):
        raise UnemulatedFeatureError(op, "x", "an all-zero group of 128: its scale is 0 and the doc does not say what "
                                              "0 / 0 quantizes to")
    scale = absmax / torch.finfo(cache.dtype).max
    cache[kept] = (groups / scale[..., None]).view(-1, d).to(cache.dtype)
    scales[kept] = scale.to(scales.dtype)


CUSTOM_OPS = {
    "npu_sparse_attn_sharedkv": npu_sparse_attn_sharedkv,
    "npu_moe_gating_top_k": npu_moe_gating_top_k,
    "npu_hc_pre": npu_hc_pre,
    "npu_hc_post": npu_hc_post,
    "npu_sparse_attn_sharedkv_metadata": npu_sparse_attn_sharedkv_metadata,
    "compressor": compressor,
    "scatter_nd_update_asc": scatter_nd_update_asc,
    "inplace_partial_rotary_mul": inplace_partial_rotary_mul,
    "npu_quant_lightning_indexer": npu_quant_lightning_indexer,
    "npu_quant_lightning_indexer_metadata": npu_quant_lightning_indexer_metadata,
    "indexer_compress_epilog": indexer_compress_epilog,
}
