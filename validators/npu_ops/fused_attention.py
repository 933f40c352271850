"""Front end shared by ``npu_fused_infer_attention_score`` (v1) and ``_v2``.

Validates a call the way the device does (every rejection names the argument, in the
operator's own spelling), turns the tensors into canonical views and runs ``fa_core.attend``.

Rules enforced, each paraphrasing the torch_npu 2.9.0 op documentation:

* ``input_layout`` must be one the operator knows; the query rank must match it.
* Heads: ``num_heads``/``num_query_heads`` > 0; ``num_key_value_heads`` 0 means "same as
  query heads"; query heads must be a multiple of KV heads, ratio at most 64 (MLA with one
  latent KV head: 1/2/4/8/16/32/64/128 query heads instead); for layouts
  with an N axis the head count must equal that axis ("otherwise the call fails").
* ``atten_mask`` dtype bool/int8/uint8 only. Modes 2/3/4 take the compressed 2048x2048 mask
  ((2048,2048), (1,2048,2048) or (1,1,2048,2048)); it is required, and it must be the causal
  template (True above the diagonal) - the device does not check the content but computes
  garbage otherwise, so the emulator refuses it. Mode 1 requires the full mask.
* ``sparse_mode`` 0-4 only (5-8 are documented as unsupported). Packed (TND-like) layouts
  accept only mode 0 without a mask, 3 or 4; there mode 3 needs q_len <= kv_len per request
  and mode 4 needs pre_tokens >= -q_len, next_tokens >= -kv_len, pre_tokens + next_tokens >= 0.
* ``query_rope`` and ``key_rope`` come together; their head dim is 64; with rope the query
  head dim is 512 or 128; at 512 the KV head count is 1 and sparse_mode is 0/3/4; at 128
  page attention is not available.
* Packed layouts need cumulative ``actual_seq_lengths``/``actual_seq_qlen`` (non-negative,
  non-decreasing, last value <= T); non-paged packed KV lengths are cumulative too.
* Page attention (``block_table`` given): ``block_table`` int32, 2-D, one row per request,
  wide enough for the longest KV length; KV lengths required and per-request; ``block_size``
  equal to the cache's block dim; BSH/BSND queries only take a ``[bn, bs, H]`` cache (the MLA rope
  path also an NZ one, its own section of the docs); an NZ cache is not accepted with BNSD; block size: 128..512 in steps of 128 when any query is
  longer than 1, otherwise 16-aligned (32 for int8) and at most 512; MLA rope path: 16 or
  128 (64 or 128 with sparse_mode 4); NZ never 16. Block ids must lie in the cache (the
  device does not check; an out-of-range id reads other memory).
* ``learnable_sink`` (v2): shape (Q_N,), packed layouts TND / NTD_TND only, value head dim <= 128.
* A value head dim other than the key's: only the pairs the packed layouts document (K_D 192 / V_D 128 with TND /
  NTD_TND), and only under the device reading ``value_head_dim=documented_pairs``.
* Quantization, pse, left padding and shared-prefix arguments are not emulated: passing one
  raises :class:`UnemulatedFeatureError` rather than being silently ignored.

Not enforced (documented device limits that need no emulation or would reject valid
framework setups): the total block count versus the sum of per-request blocks (sliding-window
pools are smaller), per-shape size limits (B <= 65536 etc.), the MLA query-length limit (1-16).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from model_infer_kvcache.analyzer.operators.fa_facts import (
    COMPRESSED_MASK_MODES,
    COMPRESSED_MASK_SHAPES,
    COMPRESSED_MASK_SIZE,
    FA_KEYWORDS,
    INT32_MAX,
    MAX_GQA_RATIO,
    MLA_QUERY_HEADS,
    MLA_ROPE_DIM,
    SPARSE_MODES,
    VALUE_DIM_LAYOUTS,
    VALUE_DIM_PAIRS,
    VALUE_DIM_SOURCE,
    FaKeywords,
)
from model_infer_kvcache.validators.npu_ops.errors import NpuOpError
from model_infer_kvcache.validators.npu_ops.fa_core import attend
from model_infer_kvcache.validators.npu_ops.fa_kv import DenseBatchKV, KVSource, PackedKV, PagedKV
from model_infer_kvcache.validators.npu_ops.fa_layouts import (
    LAYOUTS,
    QUERY_DIMS,
    Layout,
    batch_output,
    batch_view,
    heads_axis_size,
    packed_output,
    packed_view,
    parse_layout,
)
from model_infer_kvcache.validators.npu_ops.fa_masks import MASK_DTYPES, MaskSpec, causal_template
from model_infer_kvcache.validators.npu_ops.nz import nz_c0
from model_infer_kvcache.validators.npu_ops.readings import active_readings, consult

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_CHECKED_MASKS: dict[int, tuple] = {}


# How each version spells the renamed arguments (rejections name them in the operator's own spelling).
V1_NAMES = FA_KEYWORDS["v1"]
V2_NAMES = FA_KEYWORDS["v2"]


class _Checker:
    def __init__(self, names: FaKeywords) -> None:
        self.names = names

    def fail(self, argument: str, message: str) -> None:
        raise NpuOpError(self.names.op, argument, message)

    def int_list(self, value: Any, argument: str) -> list[int] | None:
        if value is None:
            return None
        if isinstance(value, torch.Tensor):
            if value.dim() != 1 or value.is_floating_point():
                self.fail(argument, f"expected a 1-D integer sequence, got tensor of shape {tuple(value.shape)}")
            return [int(x) for x in value.tolist()]
        if isinstance(value, (list, tuple, torch.Size)):
            out = []
            for x in value:
                if isinstance(x, bool) or not isinstance(x, (int, torch.SymInt)) and not (
                        isinstance(x, torch.Tensor) and x.dim() == 0):
                    self.fail(argument, f"expected integers, got {type(x).__name__}")
                out.append(int(x))
            return out
        self.fail(argument, f"expected a list of ints, got {type(value).__name__}")
        return None

    def per_request(self, values: list[int], batch: int, argument: str, upper: int, what: str) -> list[int]:
        # Documented rule: one value applies to every request; >= B values use the first B.
        if len(values) == 1:
            values = values * batch
        elif len(values) >= batch:
            values = values[:batch]
        else:
            self.fail(argument, f"has {len(values)} values for a batch of {batch} (allowed: 1 or >= batch)")
        for v in values:
            if v < 0 or v > upper:
                self.fail(argument, f"value {v} outside [0, {upper}] ({what})")
        return values

    def cumulative(self, values: list[int], argument: str, total: int, what: str) -> list[int]:
        prev = 0
        for i, v in enumerate(values):
            if v < prev:
                self.fail(argument, f"must be cumulative (non-decreasing, non-negative) for packed layouts; "
                                    f"element {i} is {v} after {prev}")
            prev = v
        if values and values[-1] > total:
            self.fail(argument, f"last cumulative length {values[-1]} exceeds the {what} ({total})")
        return [b - a for a, b in zip([0] + values[:-1], values, strict=True)]


def _check_mask_dtype(chk: _Checker, mask: torch.Tensor) -> None:
    if mask.dtype not in MASK_DTYPES:
        chk.fail("atten_mask", f"dtype {mask.dtype} is not supported (bool, int8 or uint8; True/1 = masked)")


def _same_bools(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal of two bool tensors of one shape, compared 8 bytes at a time where both allow it: a framework
    step builds a fresh 2048^2 mask, and torch.equal over bools took ~9 ms of every step (int64 words: ~1 ms)."""
    if all(t.is_contiguous() and t.storage_offset() % 8 == 0 and t.numel() % 8 == 0 for t in (a, b)):
        return torch.equal(a.reshape(-1).view(torch.int64), b.reshape(-1).view(torch.int64))
    return torch.equal(a, b)


def _check_compressed_mask(chk: _Checker, mask: torch.Tensor | None, mode: int) -> None:
    if mask is None:
        chk.fail("atten_mask", f"sparse_mode {mode} requires the compressed 2048x2048 causal mask")
    _check_mask_dtype(chk, mask)
    if tuple(mask.shape) not in COMPRESSED_MASK_SHAPES:
        chk.fail("atten_mask", f"sparse_mode {mode} needs shape (2048,2048), (1,2048,2048) or (1,1,2048,2048), "
                               f"got {tuple(mask.shape)}")
    # Every layer passes the same mask tensor: remember the tensor objects already found equal
    # to the template, with their in-place version counter (any later write invalidates).
    seen = _CHECKED_MASKS.get(id(mask))
    if seen is not None and seen[0]() is mask and seen[1] == mask._version:
        return
    if not _same_bools(mask.reshape(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE).to(torch.bool), causal_template()):
        chk.fail("atten_mask", "the compressed mask must be the causal template ~tril(ones(2048, 2048)) "
                               "(True above the diagonal); the device computes undefined results otherwise")
    if len(_CHECKED_MASKS) > 64:
        _CHECKED_MASKS.clear()
    _CHECKED_MASKS[id(mask)] = (weakref.ref(mask), mask._version)


def _user_mask(chk: _Checker, mask: torch.Tensor, batch: int, q_s: int, need_keys: int) -> torch.Tensor:
    """Normalize a mode-0/1 mask to ``[Bm, Qm, Km]`` bool with Bm in (1, batch)."""
    _check_mask_dtype(chk, mask)
    if mask.dim() == 2:
        m = mask.view(batch, 1, -1) if (q_s == 1 and mask.shape[0] == batch) else mask.unsqueeze(0)
    elif mask.dim() == 3 and mask.shape[0] == 1:
        m = mask
    elif mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[0] in (1, batch):
        m = mask[:, 0]
    else:
        chk.fail("atten_mask", f"shape {tuple(mask.shape)} not accepted (Q_S,KV_S), (1,Q_S,KV_S), "
                               f"(B,1,Q_S,KV_S), (1,1,Q_S,KV_S), or (B,KV_S) when Q_S is 1")
    if m.shape[1] < q_s or m.shape[2] < need_keys:
        chk.fail("atten_mask", f"covers {tuple(m.shape[1:])} query x key positions, needs at least "
                               f"({q_s}, {need_keys})")
    return m.to(torch.bool)


def _block_size_rule(chk, block_size, cache_bs, dtype, is_nz, mla512, q_max, sparse_mode) -> None:
    if block_size != cache_bs:
        chk.fail("block_size", f"is {block_size} but the cache blocks hold {cache_bs} tokens")
    if is_nz and block_size == 16:
        chk.fail("block_size", "NZ caches do not support block_size 16")
    if mla512:
        allowed = (64, 128) if sparse_mode == 4 else (16, 128)
        if block_size not in allowed:
            chk.fail("block_size", f"{block_size} not supported with query_rope/key_rope (allowed {allowed})")
    elif q_max > 1:
        if not (128 <= block_size <= 512 and block_size % 128 == 0):
            chk.fail("block_size", f"{block_size} not supported when a query is longer than 1 token "
                                   f"(128..512, multiple of 128)")
    else:
        align = 32 if dtype == torch.int8 else 16
        if not (0 < block_size <= 512 and block_size % align == 0):
            chk.fail("block_size", f"{block_size} not supported (non-zero, <= 512, multiple of {align})")


def _paged_source(chk, layout: Layout, key, value, key_rope, block_table, block_size, kv_lens, n_kv,
                  q_dim, mla512, q_max, sparse_mode, cdt) -> tuple[KVSource, int, int, int]:
    """Validate the paged path; returns (source, value head dim, table width, block size)."""
    if block_table.dtype != torch.int32:
        chk.fail("block_table", f"dtype must be int32, got {block_table.dtype}")
    if block_table.dim() != 2:
        chk.fail("block_table", f"must be 2-D [batch, max_blocks], got shape {tuple(block_table.shape)}")
    batch = len(kv_lens)
    if block_table.shape[0] != batch:
        chk.fail("block_table", f"has {block_table.shape[0]} rows for a batch of {batch}")
    if key.dim() not in (3, 4, 5):
        chk.fail("key", f"a paged cache must be [bn, bs, H], [bn, N, bs, D] or NZ [bn, N, D/c0, bs, c0]; "
                        f"got shape {tuple(key.shape)}")
    if value.dim() != key.dim() or value.shape[0] != key.shape[0]:
        chk.fail("value", f"cache shape {tuple(value.shape)} does not match key cache {tuple(key.shape)}")
    # The MLA rope path (query head dim 512 with query_rope/key_rope) documents its own cache formats: ND or NZ
    # [blockNum, KV_N, D/16, blockSize, 16], with BSH/BSND queries but not BNSD (2.9.0 docs, "query_rope和key_rope
    # 参数约束": "当数据格式为NZ时input_layout不支持BNSD"); elsewhere BSH/BSND take only [bn, bs, H].
    if layout.query in ("BSH", "BSND") and key.dim() != 3 and not (mla512 and key.dim() == 5):
        chk.fail("key", f"{layout.query} queries only accept a [block_num, block_size, H] cache"
                        + (" (or, on the MLA rope path, NZ [bn, N, D/c0, bs, c0])" if mla512 else ""))
    is_nz = key.dim() == 5
    if is_nz and layout.query == "BNSD":
        chk.fail("key", "an NZ cache is not supported with a BNSD query")

    def dims(t: torch.Tensor, name: str) -> tuple[int, int]:
        """(block size, head dim) of one cache tensor."""
        if t.dim() == 3:
            if t.shape[2] % n_kv:
                chk.fail(name, f"H={t.shape[2]} is not divisible by num_key_value_heads={n_kv}")
            return int(t.shape[1]), int(t.shape[2]) // n_kv
        if t.shape[1] != n_kv:
            chk.fail("num_key_value_heads", f"is {n_kv} but the {name} cache has N={t.shape[1]}")
        if t.dim() == 4:
            return int(t.shape[2]), int(t.shape[3])
        if t.shape[4] != nz_c0(t.dtype):
            chk.fail(name, f"NZ cache last dim must be {nz_c0(t.dtype)} for {t.dtype}, got {t.shape[4]}")
        return int(t.shape[3]), int(t.shape[2] * t.shape[4])

    bs, dk = dims(key, "key")
    bs_v, dv = dims(value, "value")
    if bs_v != bs:
        chk.fail("value", "value cache block size differs from the key cache")
    if dk != q_dim:
        chk.fail("key", f"head dim {dk} does not match the query head dim {q_dim}")
    if key_rope is not None:
        if key_rope.dim() != key.dim() or key_rope.shape[0] != key.shape[0]:
            chk.fail("key_rope", f"cache shape {tuple(key_rope.shape)} does not match key cache {tuple(key.shape)}")
        bs_r, dr = dims(key_rope, "key_rope")
        if dr != MLA_ROPE_DIM:
            chk.fail("key_rope", f"rope head dim must be {MLA_ROPE_DIM}, got {dr}")
        if bs_r != bs:
            chk.fail("key_rope", "key_rope cache block size differs from the key cache")
    _block_size_rule(chk, block_size, bs, key.dtype, is_nz, mla512, q_max, sparse_mode)

    width = int(block_table.shape[1])
    need = [-(-n // bs) for n in kv_lens]
    if need and max(need) > width:
        chk.fail("block_table", f"has {width} columns but a KV length of {max(kv_lens)} needs {max(need)} "
                                f"blocks of {bs}")
    table = block_table.to(torch.int64)
    needed = torch.arange(width).view(1, -1) < torch.tensor(need, dtype=torch.int64).view(-1, 1)
    bad = needed & ((table < 0) | (table >= key.shape[0]))
    if bool(bad.any()):
        b, c = (int(x) for x in bad.nonzero()[0])
        chk.fail("block_table", f"entry [{b}, {c}] = {int(table[b, c])} is not a block of the cache "
                                f"(0..{key.shape[0] - 1})")
    ids = torch.where(needed, table, torch.zeros_like(table))
    num_keys = (max(need) if need else 0) * bs
    return PagedKV(key, value, key_rope, ids, bs, n_kv, num_keys, cdt), dv, width, bs


def _value_dim_rule(chk, layout: Layout, dk: int, dv: int) -> None:
    """Value heads of another width than the key's: only the (K_D, V_D) pairs the packed layouts document
    (fa_facts.VALUE_DIM_PAIRS), and only under the device reading that the op takes them (value_head_dim)."""
    if layout.name not in VALUE_DIM_LAYOUTS or (dk, dv) not in VALUE_DIM_PAIRS:
        pairs = ", ".join(f"K_D {k} / V_D {v}" for k, v in sorted(VALUE_DIM_PAIRS))
        chk.fail("value", f"head dim {dv} differs from the key's {dk}: documented only for {pairs} with "
                          f"{' / '.join(VALUE_DIM_LAYOUTS)} ({VALUE_DIM_SOURCE}), got {layout.name}")
    if consult("value_head_dim") == "equal_only":
        chk.fail("value", f"head dim {dv} differs from the key's {dk}: key and value shapes must be identical "
                          "(device reading value_head_dim=equal_only: torch_npu 2.14.0 _op_plugin_docs.py:8685)")


def _dense_source(chk, layout: Layout, key, value, key_rope, akv, batch: int, n_kv: int, q_dim: int,
                  cdt) -> tuple[KVSource, list[int], int, int]:
    """Validate the non-paged path; returns (source, KV lengths, value head dim, mask key extent)."""
    names = chk.names
    if layout.packed:
        k3 = packed_view(key, layout.query)
        v3 = value if value is key else packed_view(value, layout.query)
        for name, t in (("key", k3), ("value", v3)):
            if t.dim() != 3 or t.shape[1] != n_kv:
                chk.fail(name if t.dim() != 3 else "num_key_value_heads",
                         f"{name} {tuple(t.shape)} must be packed with N={n_kv} KV heads")
        if v3.shape[0] != k3.shape[0]:
            chk.fail("value", "value and key hold different numbers of tokens")
        if akv is None:
            chk.fail(names.kv_lens, f"is required for {layout.name}: cumulative KV lengths per request")
        if len(akv) != batch:
            chk.fail(names.kv_lens, f"has {len(akv)} values for {batch} requests")
        kv_lens = chk.cumulative(akv, names.kv_lens, int(k3.shape[0]), "key tokens")
        kr_view = packed_view(key_rope, layout.query) if key_rope is not None else None
        starts = torch.tensor([0] + akv[:-1], dtype=torch.int64)
        source = PackedKV(k3, v3, kr_view, starts, max(kv_lens, default=0), cdt)
        dk, dv, mask_keys = int(k3.shape[2]), int(v3.shape[2]), int(k3.shape[0])
    else:
        kb = batch_view(key, layout.query, n_kv)
        vb = kb if value is key else batch_view(value, layout.query, n_kv)
        for name, t in (("key", kb), ("value", vb)):
            if t.shape[0] != batch:
                chk.fail(name, f"batch {t.shape[0]} differs from the query batch {batch}")
            if t.shape[2] != n_kv:
                chk.fail("num_key_value_heads", f"is {n_kv} but {name} has {t.shape[2]} heads")
        if vb.shape[1] != kb.shape[1]:
            chk.fail("value", "value and key hold different sequence lengths")
        s_kv = int(kb.shape[1])
        kv_lens = [s_kv] * batch if akv is None else chk.per_request(akv, batch, names.kv_lens, s_kv, "key S")
        kr_view = batch_view(key_rope, layout.query, n_kv) if key_rope is not None else None
        source = DenseBatchKV(kb, vb, kr_view, max(kv_lens, default=0), cdt)
        dk, dv, mask_keys = int(kb.shape[3]), int(vb.shape[3]), s_kv
    if dk != q_dim:
        chk.fail("key", f"head dim {dk} does not match the query head dim {q_dim}")
    if kr_view is not None and int(kr_view.shape[-1]) != MLA_ROPE_DIM:
        chk.fail("key_rope", f"rope head dim must be {MLA_ROPE_DIM}, got {int(kr_view.shape[-1])}")
    return source, kv_lens, dv, mask_keys


def _assemble(layout: Layout, out_b: torch.Tensor, lse_b: torch.Tensor, q_lens: list[int],
              total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, S, N, Dv]`` results -> the operator's output layout and its lse shape.

    Packed layouts return ``[T, N, Dv]``-based tensors (tokens past the last cumulative length
    stay zero / -inf) and lse ``[T, N, 1]``; batch layouts return lse ``[B, N, S, 1]``.
    """
    if not layout.packed:
        return batch_output(out_b, layout.out), lse_b.permute(0, 2, 1).unsqueeze(-1)
    batch, q_s, num_heads, dv = out_b.shape
    used = sum(q_lens)
    if used == total == batch * q_s:  # equal lengths tiling every token: views
        out3, lse3 = out_b.reshape(total, num_heads, dv), lse_b.reshape(total, num_heads)
    else:
        lens = torch.tensor(q_lens, dtype=torch.int64)
        bidx = torch.repeat_interleave(torch.arange(batch), lens)
        ridx = torch.arange(used) - (torch.cumsum(lens, 0) - lens)[bidx]
        out3 = out_b.new_zeros(total, num_heads, dv)
        out3[:used] = out_b[bidx, ridx]
        lse3 = lse_b.new_full((total, num_heads), float("-inf"))
        lse3[:used] = lse_b[bidx, ridx]
    return packed_output(out3, layout.out), lse3.unsqueeze(-1)


def fused_infer_attention(
    names: FaKeywords,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    atten_mask: torch.Tensor | None,
    actual_q: Any,
    actual_kv: Any,
    block_table: torch.Tensor | None,
    query_rope: torch.Tensor | None,
    key_rope: torch.Tensor | None,
    learnable_sink: torch.Tensor | None,
    num_heads: int,
    num_key_value_heads: int,
    scale: float,
    pre_tokens: int,
    next_tokens: int,
    input_layout: str,
    sparse_mode: int,
    inner_precise: int,
    block_size: int,
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    chk = _Checker(names)
    layout = parse_layout(input_layout)
    if layout is None:
        chk.fail("input_layout", f"{input_layout!r} is not supported; accepted: {sorted(LAYOUTS)}")
    if query.dim() != QUERY_DIMS[layout.query]:
        chk.fail("query", f"layout {layout.query} needs a {QUERY_DIMS[layout.query]}-D query, "
                          f"got shape {tuple(query.shape)}")
    if query.dtype not in FLOAT_DTYPES:
        chk.fail("query", f"dtype {query.dtype} not emulated (float16/bfloat16, plus float32/float64 "
                          f"for CPU validation)")
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype:
            chk.fail(name, f"dtype {t.dtype} differs from query dtype {query.dtype}")
    cdt = torch.float64 if query.dtype == torch.float64 else torch.float32

    # Heads.
    if num_heads <= 0:
        chk.fail(names.num_heads, f"must be > 0, got {num_heads}")
    if num_key_value_heads < 0:
        chk.fail("num_key_value_heads", f"must be >= 0, got {num_key_value_heads}")
    n_kv = num_key_value_heads or num_heads
    if num_heads % n_kv:
        chk.fail("num_key_value_heads", f"{names.num_heads}={num_heads} is not a multiple of "
                                        f"num_key_value_heads={n_kv}")
    if query_rope is not None and key_rope is not None and n_kv == 1:
        if num_heads not in MLA_QUERY_HEADS:
            chk.fail(names.num_heads, f"MLA takes {MLA_QUERY_HEADS} query heads, got {num_heads}")
    elif num_heads // n_kv > MAX_GQA_RATIO:
        chk.fail("num_key_value_heads", f"query/KV head ratio {num_heads // n_kv} exceeds {MAX_GQA_RATIO}")
    group = num_heads // n_kv
    q_axis_heads = heads_axis_size(query, layout.query)
    if q_axis_heads is not None and q_axis_heads != num_heads:
        chk.fail(names.num_heads, f"is {num_heads} but the query's N axis has {q_axis_heads} heads")
    if layout.query == "BSH" and query.shape[2] % num_heads:
        chk.fail(names.num_heads, f"query H={query.shape[2]} is not divisible by {num_heads}")
    q_dim = query.shape[2] // num_heads if layout.query == "BSH" else int(query.shape[-1])

    # Sparse mode / layout combinations.
    if sparse_mode in (5, 6, 7, 8):
        chk.fail("sparse_mode", f"{sparse_mode} (prefix/global/dilated/block_local) is not supported")
    if sparse_mode not in SPARSE_MODES:
        chk.fail("sparse_mode", f"{sparse_mode} is not a sparse mode (0-4)")
    if layout.packed and (sparse_mode in (1, 2) or (sparse_mode == 0 and atten_mask is not None)):
        chk.fail("sparse_mode", f"{layout.name} supports sparse_mode 0 without a mask, 3 or 4 "
                                f"(got {sparse_mode}{' with a mask' if atten_mask is not None else ''})")
    if inner_precise not in (0, 1, 2, 3):
        chk.fail("inner_precise", f"must be 0..3, got {inner_precise}")

    # MLA rope split.
    if (query_rope is None) != (key_rope is None):
        chk.fail("key_rope" if key_rope is None else "query_rope",
                 "query_rope and key_rope must be given together")
    rope = query_rope is not None
    mla512 = False
    if rope:
        for name, t in (("query_rope", query_rope), ("key_rope", key_rope)):
            if t.dtype != query.dtype:
                chk.fail(name, f"dtype {t.dtype} differs from query dtype {query.dtype}")
        if query_rope.shape[:-1] != query.shape[:-1]:
            chk.fail("query_rope", f"shape {tuple(query_rope.shape)} must match the query {tuple(query.shape)} "
                                   f"except the last dim")
        rope_dim = query_rope.shape[-1] // num_heads if layout.query == "BSH" else query_rope.shape[-1]
        if rope_dim != MLA_ROPE_DIM:
            chk.fail("query_rope", f"rope head dim must be {MLA_ROPE_DIM}, got {rope_dim}")
        if q_dim not in (512, 128):
            chk.fail("query", f"with query_rope the query head dim must be 512 or 128, got {q_dim}")
        mla512 = q_dim == 512
        if mla512 and n_kv != 1:
            chk.fail("num_key_value_heads", f"MLA (query head dim 512 with rope) needs 1 KV head, got {n_kv}")
        if mla512 and sparse_mode not in (0, 3, 4):
            chk.fail("sparse_mode", f"MLA (query head dim 512 with rope) supports sparse_mode 0/3/4, "
                                    f"got {sparse_mode}")
        if q_dim == 128 and block_table is not None:
            chk.fail("block_table", "page attention is not supported with rope and query head dim 128")

    # Query lengths.
    paged = block_table is not None
    aq = chk.int_list(actual_q, names.q_lens)
    if layout.packed:
        q3 = packed_view(query, layout.query)
        total_q = int(q3.shape[0])
        if aq is None:
            chk.fail(names.q_lens, f"is required for {layout.name}: cumulative query lengths per request")
        q_lens = chk.cumulative(aq, names.q_lens, total_q, "query tokens")
        batch = len(q_lens)
        q_s = max(q_lens, default=0)
    else:
        qb = batch_view(query, layout.query, num_heads)
        batch, q_s = int(qb.shape[0]), int(qb.shape[1])
        if q_s == 1 or aq is None:  # documented: ignored when Q_S is 1
            q_lens = [q_s] * batch
        else:
            q_lens = chk.per_request(aq, batch, names.q_lens, q_s, "query S")

    # Rope (MLA) at Q_S 1: the op docs list the only supported combinations ("Q_S等于1时支持sparse=0且不传mask
    # 或sparse=4且传入mask, Q_S大于1时支持sparse=3或sparse=4且传入mask"). Mode 3 with its mask is the one the
    # upstream MLA models (kimi_k2_thinking) pass at decode: what the device does with it is the device question
    # mla_decode_sparse_mode3 (same_as_mode0: the rightDownCausal rule masks nothing at q_len 1; deviates: the
    # seed skill's report, emulated as the mask read from its top-left corner; rejected: the doc's rule).
    mla_decode_mode = sparse_mode
    if rope and q_s == 1 and sparse_mode == 3 and atten_mask is not None:
        reading = consult("mla_decode_sparse_mode3")
        if reading == "rejected":
            chk.fail("sparse_mode", "with query_rope and Q_S 1 (MLA decode) the op supports sparse_mode 0 without "
                                    "a mask or 4 with a mask; got 3 with a mask (Q_S > 1: 3 or 4; device reading "
                                    "mla_decode_sparse_mode3=rejected)")
        if reading == "deviates":
            mla_decode_mode = 2
    elif rope and q_s == 1 and not ((sparse_mode == 0 and atten_mask is None) or
                                    (sparse_mode == 4 and atten_mask is not None)):
        chk.fail("sparse_mode", f"with query_rope and Q_S 1 (MLA decode) the op supports sparse_mode 0 without a "
                                f"mask or 4 with a mask; got {sparse_mode} "
                                f"{'with' if atten_mask is not None else 'without'} a mask (Q_S > 1: 3 or 4)")

    # Keys/values.
    akv = chk.int_list(actual_kv, names.kv_lens)
    if paged:
        if akv is None:
            chk.fail(names.kv_lens, "is required on the paged path (per-request KV lengths)")
        if layout.packed:
            if len(akv) != batch:
                chk.fail(names.kv_lens, f"has {len(akv)} values; the paged path needs one per request ({batch})")
            if any(v < 0 for v in akv):
                chk.fail(names.kv_lens, "KV lengths must be non-negative")
            kv_lens = akv
        else:
            # The upper bound (table width x block size) is checked with the table itself.
            kv_lens = chk.per_request(akv, batch, names.kv_lens, INT32_MAX, "KV length")
        q_max = max(q_lens, default=0) if layout.packed else q_s
        source, dv, width, bs = _paged_source(chk, layout, key, value, key_rope, block_table, block_size,
                                              kv_lens, n_kv, q_dim, mla512, q_max, sparse_mode, cdt)
        mask_keys = width * bs
    else:
        source, kv_lens, dv, mask_keys = _dense_source(chk, layout, key, value, key_rope, akv, batch, n_kv,
                                                       q_dim, cdt)

    if dv != q_dim:
        _value_dim_rule(chk, layout, q_dim, dv)

    # Packed-layout interception rules.
    if layout.packed and sparse_mode == 3:
        for i, (ql, kl) in enumerate(zip(q_lens, kv_lens, strict=True)):
            if ql > kl:
                chk.fail(names.q_lens, f"sparse_mode 3 needs each query length <= its KV length; "
                                       f"request {i} has {ql} > {kl}")
    if layout.packed and sparse_mode == 4 and batch:
        if pre_tokens < -min(q_lens):
            chk.fail("pre_tokens", f"{pre_tokens} < -query length")
        if next_tokens < -min(kv_lens):
            chk.fail("next_tokens", f"{next_tokens} < -KV length")
        if pre_tokens + next_tokens < 0:
            chk.fail("next_tokens", f"pre_tokens + next_tokens must be >= 0, got {pre_tokens + next_tokens}")

    # Masks.
    user_mask = None
    if sparse_mode in COMPRESSED_MASK_MODES:
        _check_compressed_mask(chk, atten_mask, sparse_mode)
    elif sparse_mode == 1 and atten_mask is None:
        chk.fail("atten_mask", "sparse_mode 1 (allMask) requires the full mask")
    elif atten_mask is not None:
        user_mask = _user_mask(chk, atten_mask, batch, q_s, mask_keys)

    # Sinks.
    sinks = None
    if learnable_sink is not None:
        if layout.name not in ("TND", "NTD_TND"):
            chk.fail("learnable_sink", f"only supported with TND or NTD_TND layouts, got {layout.name}")
        if tuple(learnable_sink.shape) != (num_heads,):
            chk.fail("learnable_sink", f"shape must be ({num_heads},), got {tuple(learnable_sink.shape)}")
        if dv > 128:
            chk.fail("learnable_sink", f"needs a value head dim <= 128, got {dv}")
        sinks = learnable_sink.to(cdt).view(n_kv, group)

    readings = active_readings()
    q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
    kv_lens_t = torch.tensor(kv_lens, dtype=torch.int64)
    if readings.band_at_single_query == "ignored":
        band_ignored = (q_lens_t == 1) if layout.packed else torch.full((batch,), q_s == 1)
    else:
        band_ignored = torch.zeros(batch, dtype=torch.bool)
    spec = MaskSpec(mla_decode_mode, int(pre_tokens), int(next_tokens),
                    readings.window_pre_tokens == "inclusive", band_ignored, user_mask)

    # Canonical padded queries [B, S, N, D].
    def padded(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        if not layout.packed:
            return batch_view(t, layout.query, num_heads)
        t3 = packed_view(t, layout.query)
        if batch and all(n == q_s for n in q_lens) and t3.shape[0] == batch * q_s:
            return t3.reshape(batch, q_s, t3.shape[1], t3.shape[2])  # equal lengths: no gather
        starts = torch.tensor([0] + aq[:-1], dtype=torch.int64).view(-1, 1)
        idx = (starts + torch.arange(q_s, dtype=torch.int64).view(1, -1)).clamp_(0, max(t3.shape[0] - 1, 0))
        if t3.shape[0] == 0:
            return t3.new_zeros(batch, q_s, t3.shape[1], t3.shape[2])
        return t3.index_select(0, idx.reshape(-1)).view(batch, q_s, t3.shape[1], t3.shape[2])

    def heads_major(t: torch.Tensor) -> torch.Tensor:
        d = t.shape[-1]
        return (t.to(cdt) * scale).view(batch, q_s, n_kv, group, d).permute(0, 2, 1, 3, 4).contiguous()

    qhm = heads_major(padded(query))
    qrhm = heads_major(padded(query_rope)) if rope else None
    out5, lse4 = attend(qhm, qrhm, source, q_lens_t, kv_lens_t, spec, sinks, dv)
    out_b = out5.reshape(batch, q_s, num_heads, dv)  # token-major: a view
    lse_b = lse4.reshape(batch, q_s, num_heads)
    total = int(packed_view(query, layout.query).shape[0]) if layout.packed else 0
    out, lse = _assemble(layout, out_b, lse_b, q_lens, total)
    lse_dtype = torch.float64 if cdt == torch.float64 else torch.float32
    out = out.to(query.dtype).contiguous()
    lse = lse.to(lse_dtype).contiguous() if return_lse else torch.empty(0, dtype=lse_dtype)
    return out, lse
