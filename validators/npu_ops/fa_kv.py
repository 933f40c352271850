"""Key/value sources for the attention kernel: dense batch, packed (TND), and paged caches.

Every source hands out token-major chunks ``[B, L, N_kv, D]`` in the compute dtype for a key
range ``[t0, t1)`` of the *per-request* key axis. Paged sources gather whole blocks through
``block_table`` with one ``index_select`` per chunk (no per-token Python loops); chunks are
aligned to ``granularity`` (the block size) so a gather never splits a block.
"""

from __future__ import annotations

import torch

from validators.npu_ops.nz import nz_to_token_major


class KVSource:
    """Interface: ``num_keys``, ``granularity``, ``keys``, ``values``, ``key_rope``."""

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
        return self._k[:, t0:t1].to(self._dtype)

    def values(self, t0, t1):
        return self._v[:, t0:t1].to(self._dtype)

    def key_rope(self, t0, t1):
        return self._kr[:, t0:t1].to(self._dtype)


class PackedKV(KVSource):
    """Non-paged packed layouts: ``[T_kv, N_kv, D]`` tensors, request b owns rows ``starts[b]..``."""

    def __init__(self, k, v, k_rope, starts: torch.Tensor, num_keys: int, dtype: torch.dtype) -> None:
        self._k, self._v, self._kr = k, v, k_rope
        self._starts = starts.view(-1, 1)
        self._batch = starts.numel()
        self._rows = k.shape[0]
        self.num_keys = num_keys
        self.granularity = 1
        self.same_kv = k is v
        self._dtype = dtype

    def _gather(self, t: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
        # Rows past a request's length are clamped; the mask hides them.
        idx = (self._starts + torch.arange(t0, t1, dtype=torch.int64).view(1, -1)).clamp_(0, self._rows - 1)
        out = t.index_select(0, idx.reshape(-1))
        return out.view(self._batch, t1 - t0, *t.shape[1:]).to(self._dtype)

    def keys(self, t0, t1):
        return self._gather(self._k, t0, t1)

    def values(self, t0, t1):
        return self._gather(self._v, t0, t1)

    def key_rope(self, t0, t1):
        return self._gather(self._kr, t0, t1)


class PagedKV(KVSource):
    """Paged caches read through ``block_table``.

    Cache forms (as passed to the operator): ``[bn, bs, N*D]`` (ND, token-major),
    ``[bn, N, bs, D]`` (ND, head-major) and ``[bn, N, D/c0, bs, c0]`` (NZ).
    ``block_ids`` is ``[B, W]`` int64 with entries past a request's needed blocks already
    replaced by a valid id (they are gathered, then masked).
    """

    def __init__(self, k, v, k_rope, block_ids: torch.Tensor, block_size: int, num_heads: int,
                 num_keys: int, dtype: torch.dtype) -> None:
        self._k, self._v, self._kr = k, v, k_rope
        self._ids = block_ids
        self._bs = block_size
        self._n = num_heads
        self._batch = block_ids.shape[0]
        self.num_keys = num_keys
        self.granularity = block_size
        self.same_kv = k is v
        self._dtype = dtype

    def _gather(self, cache: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
        bs = self._bs
        c0, c1 = t0 // bs, -(-t1 // bs)
        ids = self._ids[:, c0:c1].reshape(-1)
        blocks = cache.index_select(0, ids)
        nb = c1 - c0
        if cache.dim() == 3:  # [bn, bs, N*D]
            out = blocks.view(self._batch, nb * bs, self._n, -1)
        elif cache.dim() == 4:  # [bn, N, bs, D]
            out = blocks.view(self._batch, nb, self._n, bs, -1).transpose(2, 3)
            out = out.reshape(self._batch, nb * bs, self._n, -1)
        else:  # NZ [bn, N, D/c0, bs, c0]
            out = nz_to_token_major(blocks.view(self._batch, nb, *cache.shape[1:]))
            out = out.reshape(self._batch, nb * bs, self._n, -1)
        start = t0 - c0 * bs
        return out[:, start:start + (t1 - t0)].to(self._dtype)

    def keys(self, t0, t1):
        return self._gather(self._k, t0, t1)

    def values(self, t0, t1):
        return self._gather(self._v, t0, t1)

    def key_rope(self, t0, t1):
        return self._gather(self._kr, t0, t1)
