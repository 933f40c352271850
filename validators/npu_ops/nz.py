"""FRACTAL_NZ cache arrangement shared by the cache writer and the attention reader.

A paged cache logically ``[block_num, block_size, N, D]`` stored in NZ keeps, for each
block and head, ``D / c0`` tiles of ``[block_size, c0]``: element ``(blk, pos, n, d)`` lives
at ``[blk, n, d // c0, pos, d % c0]`` of the 5-D view ``[block_num, N, D / c0, block_size, c0]``.
``c0`` is 32 bytes worth of elements on the device: 16 for float16/bfloat16, 32 for int8. The
emulation also uses 16 for float32/float64 caches (the device has no such caches), so a
float32 test cache is viewed exactly like the bfloat16 one the model uses.

Writing one arrangement and reading the other scrambles the data, as it does on the device.
"""

from __future__ import annotations

import torch


def nz_c0(dtype: torch.dtype) -> int:
    """Width of the innermost NZ tile for a cache of ``dtype``."""
    return 32 if dtype in (torch.int8, torch.uint8) else 16


def nz_view(cache: torch.Tensor) -> torch.Tensor:
    """View a ``[block_num, block_size, N, D]`` cache allocation as its 5-D NZ form."""
    if cache.dim() != 4:
        raise ValueError(f"expected a 4-D [block_num, block_size, N, D] cache, got shape {tuple(cache.shape)}")
    bn, bs, n, d = cache.shape
    c0 = nz_c0(cache.dtype)
    if d % c0:
        raise ValueError(f"NZ needs D ({d}) to be a multiple of {c0} for {cache.dtype}")
    return cache.view(bn, n, d // c0, bs, c0)

