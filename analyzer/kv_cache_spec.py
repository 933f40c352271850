"""Cache-group kinds and their block arithmetic: the one definition of the framework's block math.

One small frozen spec per kind of cache group (the manager the framework builds for it), the
arithmetic on the spec. The analyzer's memory plan (``analyzer.memory``) and the framework harness
(``validators.harness.cache_utils``) both size their pools with these, so they agree by
construction. Formulas are the framework's (references/framework.md, 'block 的数量与 null block',
cache_utils.calculate_block_num): block 0 of every pool is the null block; fixed-block groups
(SlidingWindow, Mamba) are reserved first; growing groups take the rest of the budget in tokens.
Torch-free: sizes are plain ints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

NULL_BLOCKS = 1  # block 0 of every pool: never holds data, every padded table entry points at it
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "int8": 1}  # a cache dtype's itemsize

# The framework's attn_type of each kind: the one place these strings are spelled (the harness, which mirrors
# upstream's managers, included). Everything else names a kind through these constants or asks its spec.
FULL_ATTENTION = "FullAttention"
SLIDING_WINDOW = "SlidingWindow"
MAMBA = "Mamba"
# Chunked local attention (Llama-4): a kind of its own in the manifest. Upstream has no manager of that name (its
# ATTN_TYPE_MANAGER_MAP holds FullAttention, SlidingWindow and Mamba), so the layer registers its CacheEntry in the
# SlidingWindow manager with window C (``manager_attn_type``): see ChunkedLocalSpec.
CHUNKED_LOCAL = "ChunkedLocal"
# Cross-attention (the decoder of an encoder-decoder model: BART, Whisper, TrOCR...): one slot per request holding the
# K/V of its encoder states. Upstream has no manager of that name: the entries are MambaCacheEntry (a fixed shape per
# request, block size 1) grouped under manager_key CrossAttention, so the framework's Mamba manager keeps them in a
# pool of their own (see CrossAttentionSpec).
CROSS_ATTENTION = "CrossAttention"


def token_bytes(numel_per_head: int, num_head: int, itemsize: int, compress_ratio: int = 1) -> int:
    """Bytes one token of one cache occupies: ``dims x num_head x itemsize // compress_ratio``."""
    return int(numel_per_head * num_head * itemsize // compress_ratio)


@dataclass(frozen=True)
class FullAttentionSpec:
    """A group whose cache grows with the sequence: blocks by tokens, one pool."""

    group_key: str
    num_layers: int  # reporting only: the layers whose caches the group pools
    per_token_bytes: float  # every HBM cache of the group, one rank
    block_size: int

    attn_type: ClassVar[str] = FULL_ATTENTION
    layer_kind: ClassVar[str] = "full"  # what a config calls a layer of this kind (config_loader's layer kinds)
    windowed: ClassVar[bool] = False  # attends through a band of the last W keys (sparse_mode 4, pre_tokens)
    fixed: ClassVar[bool] = False  # block count set by memory (False) or by attention semantics (True)
    state: ClassVar[bool] = False  # a fixed-size state per request: block tables, no token slot mapping
    chunked: ClassVar[bool] = False  # attends within its chunk [floor(p / C) * C, p] (not a band)

    @property
    def block_bytes(self) -> float:
        return self.per_token_bytes * self.block_size

    def blocks_per_request(self, seq_len: int) -> int:
        return math.ceil(seq_len / self.block_size)

    def blocks_offline(self, max_len: int, concurrency: int) -> int:
        """``ceil(max_len / bs) x concurrency`` plus the null block."""
        return self.blocks_per_request(max_len) * concurrency + NULL_BLOCKS

    def blocks_for_tokens(self, max_tokens: int) -> int:
        """Budget path: the pool of ``max_tokens`` tokens (the null block is inside the count)."""
        return max_tokens // self.block_size

    def usable_blocks(self, blocks: int) -> int:
        """Blocks of a pool of ``blocks`` that can hold data (the null block holds none)."""
        return blocks - NULL_BLOCKS

    def usable_tokens(self, blocks: int) -> int:
        return self.usable_blocks(blocks) * self.block_size

    def reported(self, default_block_size: int) -> dict:
        """What the manifest's memory group states beyond the common fields: a block size other than the plan's."""
        return {"block_size": self.block_size} if self.block_size != default_block_size else {}


@dataclass(frozen=True)
class CompressedSpec(FullAttentionSpec):
    """A growing group of compressed entries (DeepSeek-V4's CSA / HCA branch): every ``compress_ratio`` tokens of a
    request become one cache row, so a block spans ``block_size`` tokens in ``block_size / compress_ratio`` rows.

    The framework keeps it a FullAttention manager of its own (upstream ``CacheEntry(compress_ratio=r,
    block_size=bs * r)``, manager ``c{r}a_cmp_kv``): ``per_token_bytes`` is each entry's row bytes // r
    (cache_utils.calculate_block_num), and its block count is ``max_tokens // block_size`` like any growing group,
    a block here spanning r times the tokens.
    """

    compress_ratio: int = 1

    def __post_init__(self):
        if self.compress_ratio < 1 or self.block_size % self.compress_ratio:
            # the framework's CacheEntry.storage_block_size refuses the same (block_size must divide into rows)
            raise ValueError(f"{self.group_key}: block_size {self.block_size} is not a multiple of compress_ratio "
                             f"{self.compress_ratio}")

    @property
    def rows_per_block(self) -> int:
        """Physical rows of one block (the framework's storage_block_size)."""
        return self.block_size // self.compress_ratio

    def reported(self, default_block_size: int) -> dict:
        return {**super().reported(default_block_size), "compress_ratio": self.compress_ratio}


def sliding_blocks_per_request(window: int, block_size: int, next_n: int = 0) -> int:
    """Sliding-window blocks one request holds at once.

    ``ceil((W + 2*next_n) / block_size)`` for the window plus the speculative (MTP) tokens the
    main model verifies and the draft model adds, plus one: a window generally straddles a block
    boundary.
    """
    return math.ceil((window + 2 * next_n) / block_size) + 1


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """A group that keeps only a window: a fixed number of blocks per request."""

    window: int = 0
    next_n: int = 0  # speculative (MTP) tokens per step

    attn_type: ClassVar[str] = SLIDING_WINDOW
    layer_kind: ClassVar[str] = "sliding"
    windowed: ClassVar[bool] = True
    fixed: ClassVar[bool] = True

    def blocks_per_request(self, seq_len: int = 0) -> int:
        return sliding_blocks_per_request(self.window, self.block_size, self.next_n)

    def fixed_blocks(self, concurrency: int) -> int:
        """Reserved up front (offline too): ``concurrency x blocks_per_request`` plus the null block."""
        return concurrency * self.blocks_per_request() + NULL_BLOCKS

    def fixed_formula(self, concurrency: int) -> str:
        return (f"{concurrency} x (ceil(({self.window} + 2x{self.next_n})/{self.block_size}) + 1) + 1 "
                f"= {self.fixed_blocks(concurrency)} blocks")


@dataclass(frozen=True)
class ChunkedLocalSpec(SlidingWindowSpec):
    """Chunked local attention (Llama-4's RoPE layers, ``attention_chunk_size`` C): a query at position p reads the
    keys in [floor(p / C) * C, p], its own chunk. Not a band (the chunk start jumps by C, a window slides by one), so
    it is a kind of its own; but every key it reads lies within the last C tokens (p - floor(p / C) * C < C), so the
    blocks before ``p - C + 1`` are never read again and the request keeps at most the blocks of a window of C.

    The framework keeps it in its SlidingWindow manager with ``sliding_window = C`` (upstream
    single_type_kv_cache_manager.SlidingWindowManager: ``get_num_skipped_tokens = num_computed - C + 1`` releases
    exactly the blocks before the chunk of the next token; its prefill maps the prompt blocks before
    ``last_token - C`` to the null block). FullAttention would also be exact but keeps every block of the prefix: C
    is the memory the chunk needs. Its block arithmetic is therefore the window's with ``window = C``
    (calculate_fixed_block_memory_bytes); ``window`` here is C.
    """

    attn_type: ClassVar[str] = CHUNKED_LOCAL
    layer_kind: ClassVar[str] = "chunked"
    windowed: ClassVar[bool] = False
    fixed: ClassVar[bool] = True
    chunked: ClassVar[bool] = True
    manager: ClassVar[str] = SLIDING_WINDOW  # the upstream manager (CacheEntry attn_type) the layer registers in
    manager_reason: ClassVar[str] = (
        "upstream has no chunked manager; every key a chunk reads lies within the last C tokens, so its "
        "SlidingWindowManager with sliding_window = C keeps them (get_num_skipped_tokens = num_computed - C + 1 "
        "releases only blocks before the next token's chunk); FullAttention would be exact too but keep the whole "
        "prefix. Reads: prefill splits each request at its chunk boundaries (virtual requests, causal), decode "
        "shifts the block table by chunk_start // block_size with kv length p - chunk_start + 1")

    def fixed_formula(self, concurrency: int) -> str:
        return (f"{concurrency} x (ceil((chunk {self.window} + 2x{self.next_n})/{self.block_size}) + 1) + 1 "
                f"= {self.fixed_blocks(concurrency)} blocks (the SlidingWindow manager with window = chunk)")


@dataclass(frozen=True)
class MambaSpec:
    """A state-space group: one state block per request, plus one per speculative token."""

    group_key: str
    state_bytes: int  # one state block of every HBM cache of the group
    next_n: int = 0
    num_layers: int = 0  # reporting only: the linear layers whose states one block holds

    attn_type: ClassVar[str] = MAMBA
    layer_kind: ClassVar[str] = "linear"
    windowed: ClassVar[bool] = False
    fixed: ClassVar[bool] = True
    state: ClassVar[bool] = True
    per_token_bytes: ClassVar[int] = 0  # nothing grows with the sequence

    @property
    def block_bytes(self) -> int:
        return self.state_bytes

    def blocks_per_request(self, seq_len: int = 0) -> int:
        return 1 + self.next_n

    def fixed_blocks(self, concurrency: int) -> int:
        return concurrency * self.blocks_per_request() + NULL_BLOCKS

    def fixed_formula(self, concurrency: int) -> str:
        return f"{concurrency} x (1 + {self.next_n}) + 1 = {self.fixed_blocks(concurrency)} state blocks"

    def reported(self, default_block_size: int) -> dict:
        return {"state_bytes": self.state_bytes}


@dataclass(frozen=True)
class CrossAttentionSpec(MambaSpec):
    """The cross-attention K/V of an encoder-decoder model's decoder: one slot per request, sized by the longest
    encoder output (``slot_tokens``: the maximum encoder length rounded up to whole FA blocks).

    The K/V of a request's encoder states are static: written once at its prefill (the decoder's k_proj / v_proj of
    encoder_hidden_states), then read by every decode step without a causal mask. Nothing grows with the decoded
    sequence, so the group is fixed like a Mamba group: one block per request (no speculative blocks: a verify step
    reads the same encoder K/V), reserved up front. The framework registers the entries as MambaCacheEntry (block size
    1, ``shape`` the slot) under ``manager_key = CrossAttention``: its Mamba manager, a pool of its own.
    """

    slot_tokens: int = 0  # encoder positions one slot holds (the maximum encoder length, rounded up to FA blocks)

    attn_type: ClassVar[str] = CROSS_ATTENTION
    layer_kind: ClassVar[str] = "cross"
    manager: ClassVar[str] = MAMBA  # the upstream manager (CacheEntry attn_type) its entries register in

    def fixed_formula(self, concurrency: int) -> str:
        return (f"{concurrency} x 1 + 1 = {self.fixed_blocks(concurrency)} cross-attention slots of "
                f"{self.slot_tokens} encoder positions")

    def reported(self, default_block_size: int) -> dict:
        return {"state_bytes": self.state_bytes}


Spec = FullAttentionSpec | CompressedSpec | SlidingWindowSpec | ChunkedLocalSpec | MambaSpec | CrossAttentionSpec
# The kinds a CacheEntry may name as its attn_type (CrossAttention's entries name Mamba: not among them).
SPEC_BY_ATTN_TYPE: dict[str, type] = {kind.attn_type: kind for kind in (FullAttentionSpec, SlidingWindowSpec,
                                                                        ChunkedLocalSpec, MambaSpec)}
# Attention types whose block count does not grow with the sequence.
FIXED_BLOCK_ATTN_TYPES = frozenset(name for name, kind in SPEC_BY_ATTN_TYPE.items() if kind.fixed)
# The kinds the analyzer plans layers as (the manifest's attn_type values): paged attention layers and the
# linear layers' recurrent states (Mamba group, G3 framework).
PLANNED_ATTN_TYPES: tuple[str, ...] = (FULL_ATTENTION, SLIDING_WINDOW, MAMBA, CHUNKED_LOCAL)
# The kinds of a memory group: the planned layers' and the cross-attention slots (a manifest section of its own,
# beside the layers: each decoder layer's self-attention is planned as a layer, its cross-attention in the section).
GROUP_ATTN_TYPES: tuple[str, ...] = (*PLANNED_ATTN_TYPES, CROSS_ATTENTION)


def spec_for_layer_kind(layer_kind: str) -> type:
    """The spec of a config layer kind (sliding -> SlidingWindow, chunked -> ChunkedLocal, linear -> Mamba, else
    full)."""
    return {SlidingWindowSpec.layer_kind: SlidingWindowSpec, ChunkedLocalSpec.layer_kind: ChunkedLocalSpec,
            MambaSpec.layer_kind: MambaSpec}.get(layer_kind, FullAttentionSpec)


def manager_attn_type(attn_type: str) -> str:
    """The framework manager (``CacheEntry.attn_type``, the block_table / slot_mapping key) a layer of this
    attn_type registers in: its own, but ChunkedLocal's, which upstream keeps in its SlidingWindow manager."""
    kind = SPEC_BY_ATTN_TYPE.get(attn_type)
    return getattr(kind, "manager", None) or attn_type


def is_chunked(attn_type: str) -> bool:
    """A layer of this attn_type attends within its chunk (chunked local attention); an attn_type no spec defines
    does not."""
    return _chunked(SPEC_BY_ATTN_TYPE.get(attn_type))


def layer_kind_is_chunked(layer_kind: str) -> bool:
    """A config layer kind the ChunkedLocal spec plans (``chunked``)."""
    return _chunked(spec_for_layer_kind(layer_kind))


def _chunked(kind: type | None) -> bool:
    return bool(getattr(kind, "chunked", False))  # MambaSpec (no chunk) defines no flag


def serves_layer_kind(attn_type: str, layer_kind: str) -> bool:
    """The planned attn_type is the spec of the config's layer kind (False for a kind planned as full attention
    because kvcache does not plan it: chunked local attention, a linear family without state shapes; a blocker
    says why)."""
    kind = SPEC_BY_ATTN_TYPE.get(attn_type)
    return bool(kind and kind.layer_kind == layer_kind)


def holds_state(attn_type: str) -> bool:
    """A group of this attn_type keeps one fixed-size state block per request (no token slots, no KV rows); an
    attn_type no spec defines is not one."""
    kind = SPEC_BY_ATTN_TYPE.get(attn_type)
    return bool(kind and kind.state)


def _planned(state: bool) -> tuple[str, ...]:
    return tuple(t for t in PLANNED_ATTN_TYPES if holds_state(t) == state)


def is_windowed(attn_type: str) -> bool:
    """A layer of this attn_type attends through a window (band), not the whole prefix; an attn_type no spec
    defines does not."""
    kind = SPEC_BY_ATTN_TYPE.get(attn_type)
    return bool(kind and kind.windowed)


def fixed_bytes(specs, concurrency: int) -> float:
    """Bytes the fixed-block groups reserve for ``concurrency`` requests."""
    return sum(s.fixed_blocks(concurrency) * s.block_bytes for s in specs if s.fixed)


def max_tokens_in(left_bytes: float, per_token_bytes: float) -> int:
    """Tokens of every growing group together that ``left_bytes`` holds (the framework's floor division)."""
    return int(left_bytes // per_token_bytes)


def pool_bytes(specs, blocks: dict[str, int]) -> float:
    """Bytes the pools take: blocks x block bytes of the group, summed."""
    return sum(blocks[s.group_key] * s.block_bytes for s in specs)


# The manifest's two kinds of layer plan, tagged by attn_type: attention layers (a paged KV cache, an FA call) and
# state layers (a fixed-size recurrent state per request).
ATTENTION_ATTN_TYPES = _planned(state=False)
STATE_ATTN_TYPES = _planned(state=True)
