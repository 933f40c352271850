"""A tiny framework-mode attention model for self-testing the harness and the validators.

It declares ``cache_entries`` per layer, answers ``get_cache_info()`` for any generation,
writes K/V through ``slot_mapping[key]`` and reads decode keys through
``block_table[key]``, like rendered framework code. ``reference_logits`` computes the same
network densely (no cache), so paged runs can be compared with it token for token.

Deliberate consumer bugs can be switched on to prove the checks catch them:

* ``table_choice="first"``: every layer reads the first table of the dict instead of its key;
* ``read_extra_keys=k``: sliding layers read ``W + k`` keys (the band off-by-one);
* ``prefill_reads_cache=True``: prefill reads keys back from the cache instead of fresh states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from model_infer_kvcache.analyzer.kv_cache_spec import FULL_ATTENTION

from .generations import get_generation
from .paged import read_positions, write_slots


@dataclass
class ToyLayerSpec:
    attn_type: str = FULL_ATTENTION  # or SLIDING_WINDOW
    sliding_window: int | None = None
    block_size: int = 4  # per entry in G2; G0/G1 use ToyModel.block_size
    manager_key: str | None = None  # G2 only


class ToyLayer:
    def __init__(self, spec: ToyLayerSpec, generation: str, hidden: int, num_heads: int, head_dim: int,
                 generator: torch.Generator):
        self.spec = spec
        self.attn_type = spec.attn_type
        self.sliding_window = spec.sliding_window
        self.num_heads, self.head_dim = num_heads, head_dim
        shape = (hidden, num_heads * head_dim)
        self.wq = torch.randn(shape, generator=generator) / math.sqrt(hidden)
        self.wk = torch.randn(shape, generator=generator) / math.sqrt(hidden)
        self.wv = torch.randn(shape, generator=generator)
        self.k_cache = torch.Tensor([])
        self.v_cache = torch.Tensor([])
        gen = get_generation(generation)
        extra = {}
        if gen.name == "G2":
            extra = {"block_size": spec.block_size, "manager_key": spec.manager_key}
        self.cache_entries = [
            gen.CacheEntry(
                cache_name=name, attn_type=spec.attn_type, dim=head_dim, num_head=num_heads,
                dtype=torch.float32, needs_block=True,
                tensor_setter=lambda t, layer=self, name=name: setattr(layer, name, t),
                sliding_window=spec.sliding_window, **extra,
            )
            for name in ("k_cache", "v_cache")
        ]
        self.key = self.cache_entries[0].group_key if gen.name == "G2" else spec.attn_type

    def visible_start(self, position: int, extra_keys: int) -> int:
        if self.sliding_window is None:
            return 0
        return max(0, position - (self.sliding_window + extra_keys) + 1)

    def project(self, x: torch.Tensor):
        t = x.shape[0]
        q = (x @ self.wq).view(t, self.num_heads, self.head_dim)
        k = (x @ self.wk).view(t, self.num_heads, self.head_dim)
        v = (x @ self.wv).view(t, self.num_heads, self.head_dim)
        return q, k, v


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    # q [H, D], keys/values [S, H, D]; float64 so paged and dense runs agree closely.
    q, keys, values = q.double(), keys.double(), values.double()
    scores = torch.einsum("hd,shd->hs", q, keys) / math.sqrt(q.shape[-1])
    return torch.einsum("hs,shd->hd", scores.softmax(dim=-1), values).reshape(-1)


class ToyModel:
    """``model(input_ids, position_ids, forward_metadata) -> logits [TotalTokens, vocab]``."""

    def __init__(
        self,
        layers: list[ToyLayerSpec],
        *,
        generation: str = "G2",
        block_size: int = 4,
        vocab: int = 23,
        hidden: int = 8,
        num_heads: int = 2,
        head_dim: int = 4,
        max_positions: int = 512,
        seed: int = 0,
        table_choice: str = "by_key",
        read_extra_keys: int = 0,
        prefill_reads_cache: bool = False,
    ):
        g = torch.Generator().manual_seed(seed)
        self.generation = get_generation(generation).name
        self.block_size = block_size
        self.embed = torch.randn((vocab, hidden), generator=g)
        self.pos_embed = torch.randn((max_positions, hidden), generator=g) * 0.5
        self.layers = [ToyLayer(s, self.generation, hidden, num_heads, head_dim, g) for s in layers]
        self.w_out = torch.randn((num_heads * head_dim, vocab), generator=g)
        self.table_choice = table_choice
        self.read_extra_keys = read_extra_keys
        self.prefill_reads_cache = prefill_reads_cache

    # ---------------------------------------------------------------- framework contract
    def get_cache_info(self):
        gen = get_generation(self.generation)
        infos = [gen.LayerCacheInfo(layer_idx=i, caches=list(layer.cache_entries)) for i, layer in enumerate(self.layers)]
        if gen.name == "G2":
            return gen.ModelCacheInfo(num_layers=len(infos), layer_infos=infos)
        return gen.ModelCacheInfo(num_layers=len(infos), block_size=self.block_size, layer_infos=infos)

    def layer_block_size(self, layer: ToyLayer) -> int:
        return layer.spec.block_size if self.generation == "G2" else self.block_size

    def _table(self, forward_metadata, layer: ToyLayer) -> torch.Tensor:
        tables = forward_metadata.block_table
        if self.table_choice == "first":
            return next(iter(tables.values()))
        if self.table_choice == "whole":
            return tables
        return tables[layer.key]

    def _inputs(self, input_ids, position_ids) -> torch.Tensor:
        return self.embed[input_ids.long()] + self.pos_embed[position_ids.long()]

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, forward_metadata) -> torch.Tensor:
        x = self._inputs(input_ids, position_ids)
        cu_q = [int(v) for v in forward_metadata.actual_seq_lengths_cu_q.tolist()]
        total = torch.zeros((x.shape[0], self.w_out.shape[0]), dtype=torch.float64)
        for layer in self.layers:
            q, k, v = layer.project(x)
            slots = forward_metadata.slot_mapping[layer.key]
            write_slots(layer.k_cache, slots, k)
            write_slots(layer.v_cache, slots, v)
            table = self._table(forward_metadata, layer)
            bs = self.layer_block_size(layer)
            start = 0
            for row, end in enumerate(cu_q):
                for t in range(start, end):
                    pos = int(position_ids[t])
                    first = layer.visible_start(pos, self.read_extra_keys)
                    if forward_metadata.is_prefill and not self.prefill_reads_cache:
                        lo = start + (first - int(position_ids[start]))
                        keys, values = k[lo : t + 1], v[lo : t + 1]
                    else:
                        positions = torch.arange(first, pos + 1)
                        keys = read_positions(layer.k_cache, table[row], positions, bs)
                        values = read_positions(layer.v_cache, table[row], positions, bs)
                    total[t] += _attend(q[t], keys, values)
                start = end
        return total @ self.w_out.double()

    # ---------------------------------------------------------------- dense reference
    def reference_logits(self, token_ids: list[int], *, extra_keys: int | None = None) -> torch.Tensor:
        """Logits for every position of one sequence, computed without any cache."""
        extra = self.read_extra_keys if extra_keys is None else extra_keys
        ids = torch.tensor(token_ids, dtype=torch.long)
        x = self._inputs(ids, torch.arange(len(token_ids)))
        total = torch.zeros((len(token_ids), self.w_out.shape[0]), dtype=torch.float64)
        for layer in self.layers:
            q, k, v = layer.project(x)
            for p in range(len(token_ids)):
                first = layer.visible_start(p, extra)
                total[p] += _attend(q[p], k[first : p + 1], v[first : p + 1])
        return total @ self.w_out.double()

    def reference_generate(self, prompt: list[int], max_new_tokens: int, *, extra_keys: int | None = None) -> list[int]:
        tokens = list(prompt)
        out = []
        for _ in range(max_new_tokens):
            nxt = int(self.reference_logits(tokens, extra_keys=extra_keys)[-1].argmax())
            out.append(nxt)
            tokens.append(nxt)
        return out


__all__ = ["ToyLayer", "ToyLayerSpec", "ToyModel"]
