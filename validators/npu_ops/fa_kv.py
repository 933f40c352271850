"""Key/value sources for the attention kernel: dense batch, packed (TND), and paged caches.

Every source hands out *head-major* chunks ``[B, N_kv, L, D]`` (contiguous, compute dtype)
for a key range ``[t0, t1)`` of the per-request key axis. Paged sources gather whole blocks
through ``block_table`` with one ``index_select`` per chunk (no per-token Python loops);
chunks are aligned to ``granularity`` (the block size) so a gather never splits a block.

``PagedKV`` can also hand out *physical* blocks ``[n, N_kv, bs, D]`` (a range of the cache,
a view when the cache already is head-major in the compute dtype, or an explicit list of
block ids) for the block-major decode path, which never copies the whole KV working set.
"""

from __future__ import annotations

import torch


def _head_major(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, L, N, D]`` (any strides) -> contiguous ``[B, N, L, D]`` in ``dtype`` (one copy)."""
    out = torch.empty(t.shape[0], t.shape[2], t.shape[1], t.shape[3], dtype=dtype)
    out.copy_(t.transpose(1, 2))
    return out


class KVSource:
    """Interface: ``num_keys``, ``granularity``, ``same_kv`` and the three chunk getters."""

    num_keys: int
    granularity: int
    same_kv: bool

    def keys(self, t0: int, t1: int) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def values(self, t0: int, t1: int) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def key_rope(self, t0: int, t1: int) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError


class DenseBatchKV(KVSource):
    """Non-paged batch layouts: tensors already viewed as ``[B, S_kv, N_kv, D]``."""

    def __init__(self, k, v, k_rope, num_keys: int, dtype: torch.dtype) -> None:
        self._k, self._v, self._kr = k, v, k_rope
        self.num_keys = num_keys
        self.granularity = 1
        self.same_kv = k is v
        self._dtype = dtype

    def keys(self, t0, t1):
        return _head_major(self._k[:, t0:t1], self._dtype)

    def values(self, t0, t1):
        return _head_major(self._v[:, t0:t1], self._dtype)

    def key_rope(self, t0, t1):
        return _head_major(self._kr[:, t0:t1], self._dtype)


class PackedKV(KVSource):
    """Non-paged packed layouts: ``[T_kv, N_kv, D]`` tensors, request b owns rows ``starts[b]..``."""

    def __init__(self, k, v, k_rope, starts: torch.Tensor, num_keys: int, dtype: torch.dtype) -> None:
        self._k, self._v, self._kr = k, v, k_rope
        self._starts = starts.view(-1, 1)
        self._batch = starts.numel()
        self._rows = k.shape[0]
        self._uniform = self._batch > 0 and self._rows == self._batch * num_keys and bool(
            (starts == torch.arange(self._batch) * num_keys).all())
        self.num_keys = num_keys
        self.granularity = 1
        self.same_kv = k is v
        self._dtype = dtype

    def _gather(self, t: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
        if self._uniform:  # equal lengths tiling all rows: a strided view, no gather
            rows = t.reshape(self._batch, self.num_keys, *t.shape[1:])[:, t0:t1]
            return _head_major(rows, self._dtype)
        # Rows past a request's length are clamped; the mask hides them.
        idx = (self._starts + torch.arange(t0, t1, dtype=torch.int64).view(1, -1)).clamp_(0, max(self._rows - 1, 0))
        rows = t.index_select(0, idx.reshape(-1))
        return _head_major(rows.view(self._batch, t1 - t0, *t.shape[1:]), self._dtype)

    def keys(self, t0, t1):
        return self._gather(self._k, t0, t1)

    def values(self, t0, t1):
        return self._gather(self._v, t0, t1)

    def key_rope(self, t0, t1):
        return self._gather(self._kr, t0, t1)


def _blocks_head_major(blocks: torch.Tensor, cache_dim: int, n_kv: int, dtype: torch.dtype,
                       buffer: torch.Tensor | None = None) -> torch.Tensor:
    """Physical cache blocks in their stored form -> contiguous ``[n, N_kv, bs, D]`` in ``dtype``.

    Stored forms: 3-D ``[n, bs, N*D]``, 4-D ``[n, N, bs, D]``, NZ ``[n, N, D/c0, bs, c0]``.
    ``buffer`` (flat, large enough) is reused for the converted copy when given.
    """
    n = blocks.shape[0]
    if cache_dim == 3:
        bs = blocks.shape[1]
        src = blocks.view(n, bs, n_kv, -1).transpose(1, 2)
    elif cache_dim == 4:
        if blocks.dtype == dtype and blocks.is_contiguous():
            return blocks
        src = blocks
    else:
        # NZ tile (d // c0, pos, d % c0) -> (pos, d // c0, d % c0) = (pos, d)
        src = blocks.permute(0, 1, 3, 2, 4)
    numel = src.numel()
    if buffer is not None and buffer.numel() >= numel and buffer.dtype == dtype:
        out = buffer[:numel].view(src.shape)
    else:
        out = torch.empty(src.shape, dtype=dtype)
    out.copy_(src)
    return out.view(n, src.shape[1], src.shape[2], -1)


class PagedKV(KVSource):
    """Paged caches read through ``block_table``.

    Cache forms (as passed to the operator): ``[bn, bs, N*D]`` (ND, token-major),
    ``[bn, N, bs, D]`` (ND, head-major) and ``[bn, N, D/c0, bs, c0]`` (NZ).
    ``block_ids`` is ``[B, W]`` int64 with entries past a request's needed blocks already
    replaced by a valid id (they are gathered, then masked).
    """

    def __init__(self, k, v, k_rope, block_ids: torch.Tensor, block_size: int, num_heads: int,
                 num_keys: int, dtype: torch.dtype) -> None:
        self._caches = {"k": k, "v": v, "kr": k_rope}
        self.ids = block_ids
        self.block_size = block_size
        self.num_blocks = int(k.shape[0])
        self._n = num_heads
        self._batch = block_ids.shape[0]
        self.num_keys = num_keys
        self.granularity = block_size
        self.same_kv = k is v
        self._dtype = dtype

    # request-major chunks -------------------------------------------------------------
    def _gather(self, which: str, t0: int, t1: int) -> torch.Tensor:
        bs = self.block_size
        c0, c1 = t0 // bs, -(-t1 // bs)
        cache = self._caches[which]
        blocks = _blocks_head_major(cache.index_select(0, self.ids[:, c0:c1].reshape(-1)), cache.dim(), self._n,
                                    self._dtype)
        nb = c1 - c0
        hm = blocks.view(self._batch, nb, self._n, bs, -1).transpose(1, 2).reshape(self._batch, self._n, nb * bs, -1)
        start = t0 - c0 * bs
        return hm[:, :, start:start + (t1 - t0)]

    def keys(self, t0, t1):
        return self._gather("k", t0, t1)

    def values(self, t0, t1):
        return self._gather("v", t0, t1)

    def key_rope(self, t0, t1):
        return self._gather("kr", t0, t1)

    # physical blocks -----------------------------------------------------------------
    def block_range(self, which: str, a: int, b: int, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """Physical blocks ``a..b-1`` as ``[n, N_kv, bs, D]`` (a view when no conversion is needed)."""
        cache = self._caches[which]
        return _blocks_head_major(cache[a:b], cache.dim(), self._n, self._dtype, buffer)

    def token_major_ok(self, dtype: torch.dtype) -> bool:
        """True when every cache is ``[bn, bs, N*D]`` in ``dtype``: blocks can be used in place."""
        return all(c is None or (c.dim() == 3 and c.dtype == dtype) for c in self._caches.values())

    def head_major_ok(self, dtype: torch.dtype) -> bool:
        """True when every cache is a contiguous ``[bn, N, bs, D]`` in ``dtype``: ranges are views."""
        return all(c is None or (c.dim() == 4 and c.dtype == dtype and c.is_contiguous())
                   for c in self._caches.values())

    def token_major(self, which: str, where) -> torch.Tensor:
        """Blocks of a ``[bn, bs, N*D]`` cache as ``[n, bs, N_kv, D]``: a view for a range, a gather for ids."""
        cache = self._caches[which]
        blocks = cache[where[0]:where[1]] if isinstance(where, tuple) else cache.index_select(0, where)
        return blocks.view(blocks.shape[0], blocks.shape[1], self._n, -1)

    def block_list(self, which: str, ids: torch.Tensor, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """The listed physical blocks as ``[len(ids), N_kv, bs, D]``."""
        cache = self._caches[which]
        return _blocks_head_major(cache.index_select(0, ids), cache.dim(), self._n, self._dtype, buffer)
