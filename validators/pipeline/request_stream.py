"""The request stream every validation drives: mixed prompt lengths, early finishes, late admits."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Scenario:
    # (prompt length, new tokens): some longer than a 128 block, some crossing a 128..160 window
    # (two of them by more than a block, in one prefill step, so a window's slid-out prompt blocks
    # share the null block), one finishing early so the late requests are admitted into its blocks.
    first: tuple[tuple[int, int], ...] = ((150, 17), (40, 5), (300, 17), (290, 17))
    late: tuple[tuple[int, int], ...] = ((200, 8), (60, 8))
    max_concurrency: int = 4
    release_requests: int = 50
    vocab: int = 512

    def prompts(self, seed: int) -> list[tuple[list[int], int]]:
        g = torch.Generator().manual_seed(seed)
        return [(torch.randint(0, self.vocab, (n,), generator=g).tolist(), new) for n, new in self.first + self.late]

    def crossing(self, window: int, block_size: int) -> Scenario:
        """This stream with its longest prompts stretched to cross ``window`` by two blocks on both paths."""
        need = window + 2 * block_size
        longest = max(n for n, _ in self.first)
        if longest >= need:
            return self
        grow = need - longest + 8
        first = tuple((n + grow, new) if n >= longest - 16 else (n, new) for n, new in self.first)
        return replace(self, first=first)

    @property
    def max_model_len(self) -> int:
        return max(n + new for n, new in self.first + self.late) + 8


DEFAULT = Scenario()
QUICK = Scenario(first=((150, 9), (40, 3), (300, 9)), late=((60, 4),), max_concurrency=3, release_requests=10)


@dataclass
class SimpleStep:
    """One forward step of a stream the pipeline drives itself (standalone and Legacy runs)."""

    index: int
    is_prefill: bool
    request_ids: list[int]
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    q_lens: list[int]

    def token_slices(self) -> dict[int, slice]:
        out, start = {}, 0
        for rid, n in zip(self.request_ids, self.q_lens, strict=True):
            out[rid] = slice(start, start + n)
            start += n
        return out

    def last_token_rows(self) -> torch.Tensor:
        return torch.cumsum(torch.tensor(self.q_lens), 0) - 1
