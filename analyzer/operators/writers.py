"""The cache writers: which arguments of each writer operator hold the caches and the write positions.

One table for the linter (a slot mapping passed whole as the index, KV301/KV302) and for checkout mode's
recorder (which cache tensors a call wrote, at which slots). Argument names are the pinned schemas'.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheWriter:
    caches: tuple[str, ...]  # arguments holding the cache tensors the call writes
    index: str  # argument holding the positions it writes at
    paged: bool  # the index is a slot mapping (paged), not the rows' kv_len (Legacy scatter_update)


CACHE_WRITERS: dict[str, CacheWriter] = {
    "npu_scatter_nd_update_": CacheWriter(("self",), "indices", paged=True),
    "npu_scatter_nd_update": CacheWriter(("self",), "indices", paged=True),
    "scatter_update_": CacheWriter(("self",), "indices", paged=False),
    "scatter_update": CacheWriter(("self",), "indices", paged=False),
    "npu_kv_rmsnorm_rope_cache": CacheWriter(("k_cache", "ckv_cache"), "index", paged=True),
    "npu_kv_rmsnorm_rope_cache_v2": CacheWriter(("k_cache", "ckv_cache"), "index", paged=True),
    "npu_mla_prolog_v3": CacheWriter(("kv_cache", "kr_cache"), "cache_index", paged=True),
}
