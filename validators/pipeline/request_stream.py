"""The request stream every validation drives: mixed prompt lengths, early finishes, late admits.

Every driver steps it under a ``Watchdog``: a step count derived from the stream (each request needs at
most one prefill and one decode step per new token) and a wall-clock allowance per forward step. A run
past either stops with ``StreamStalled`` naming the step and the requests it was serving, never a hang.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a tensor is made: `kvcache validate --help` reads STEP_SECONDS
    import torch

# One forward step of a tiny model takes well under a second on CPU (DeepSeek-V3's 128 heads in float64:
# about 2 s); a step still running after this many seconds is stuck (a render that never returns).
STEP_SECONDS = 120.0
STEP_PARAMETERS = 100_000_000  # a bigger tiny model gets STEP_SECONDS per this many parameters (Scenario.sized_for)
# The check a stopped stream fails (rendered and checkout mode alike).
STREAM_BUDGET_CHECK = "request stream finishes within its step budget"


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
    step_seconds: float = STEP_SECONDS  # wall-clock allowance of one forward step (Watchdog)

    def prompts(self, seed: int) -> list[tuple[list[int], int]]:
        import torch

        g = torch.Generator().manual_seed(seed)
        return [(torch.randint(0, self.vocab, (n,), generator=g).tolist(), new) for n, new in self.first + self.late]

    def one_batch(self) -> Scenario:
        """Every request in the first wave, as many at once as there are requests, and no release run: a Legacy
        model's cache rows are the batch's rows (the engine never hands a finished request's row to another)."""
        every = self.first + self.late
        return replace(self, first=every, late=(), max_concurrency=len(every), release_requests=0)

    def crossing(self, window: int, block_size: int) -> Scenario:
        """This stream with its longest prompts stretched to cross ``window`` by two blocks on both paths."""
        need = window + 2 * block_size
        longest = max(n for n, _ in self.first)
        if longest >= need:
            return self
        grow = need - longest + 8
        first = tuple((n + grow, new) if n >= longest - 16 else (n, new) for n, new in self.first)
        return replace(self, first=first)

    def crossing_window_of(self, manifest) -> Scenario:
        """This stream stretched past the manifest's sliding window by two blocks (itself without one)."""
        window = manifest.sliding_window()
        return self.crossing(window, manifest.block_size) if window else self

    def crossing_chunks_of(self, manifest) -> Scenario:
        """This stream with its late requests placed on the chunk boundaries of the manifest's chunked layers
        (itself without them): one decodes across the boundary at 2 x chunk, one has a prompt of exactly one chunk
        (its first decoded token starts a new chunk). The early prompts already cross chunks in prefill."""
        chunk = manifest.attention_chunk_size()
        if not chunk:
            return self
        return replace(self, late=((2 * chunk - 3, 8), (chunk, 8)))

    def crossing_of(self, manifest) -> Scenario:
        """This stream past the manifest's sliding window and across its chunk boundaries (each where it has one),
        every request within the model's positions."""
        return self.crossing_window_of(manifest).crossing_chunks_of(manifest).within_positions(
            manifest.model.max_position_embeddings)

    def within_positions(self, max_positions: int | None) -> Scenario:
        """This stream with each prompt cut so that prompt + new tokens fit ``max_positions`` (a learned position
        table of that many rows: CTRL's 256 would be indexed past its end by the 300-token prompts)."""
        requests = self.first + self.late
        if not max_positions or all(n + new <= max_positions for n, new in requests):
            return self

        def fit(pairs):
            return tuple((max(1, min(n, max_positions - new)), new) for n, new in pairs)

        return replace(self, first=fit(self.first), late=fit(self.late))

    def uniform_prefill(self) -> Scenario:
        """This stream with every prompt as long as its longest (new tokens and admission order kept): every
        prefill batch then holds requests of one length, for a model that refuses variable-length prefill
        batches (upstream gemma_4's check at its prefill entry). Decode still sees different KV lengths: the
        late requests are admitted after the early finishes."""
        longest = max(n for n, _ in self.first + self.late)
        return replace(self, first=tuple((longest, new) for _, new in self.first),
                       late=tuple((longest, new) for _, new in self.late))

    @property
    def max_model_len(self) -> int:
        return max(n + new for n, new in self.first + self.late) + 8

    def max_steps(self) -> int:
        """Forward steps the stream can take at most: one prefill per request, one decode per new token
        (MTP verify steps and padded decode rows included: they advance at least one token), with room
        for the release run's requests (one prefill and two decodes each)."""
        requests = self.first + self.late
        return len(requests) + sum(new for _, new in requests) + 3 * self.release_requests + 16

    def sized_for(self, parameters: int) -> Scenario:
        """This stream with the default step allowance grown with the tiny model's size: STEP_SECONDS per
        STEP_PARAMETERS parameters (a step's cost is its tokens times the weights). Ergo's tiny model (64 heads x 128
        at a tied hidden size: 634M parameters) took over 120 s for its first step, 780 prompt tokens in float64 on a
        shared core: the watchdog called it stuck. An allowance set by the caller is kept."""
        if self.step_seconds != STEP_SECONDS or parameters <= STEP_PARAMETERS:
            return self
        return replace(self, step_seconds=STEP_SECONDS * -(-parameters // STEP_PARAMETERS))

    def watchdog(self, what: str) -> Watchdog:
        return Watchdog(self.max_steps(), self.step_seconds, what)


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
        import torch

        return torch.cumsum(torch.tensor(self.q_lens), 0) - 1


class StreamStalled(Exception):
    """A request stream past its step budget: the message names the step and the requests it served."""


@dataclass
class Watchdog:
    """Bounds a driver loop: at most ``max_steps`` forward steps, each within ``step_seconds`` of wall time.

    The time limit interrupts Python code (a render looping forever) through SIGALRM, so it is armed only
    in the main thread of a process (ranks of a multi-rank run are processes of their own).
    """

    max_steps: int
    step_seconds: float
    what: str = "request stream"
    steps: int = 0

    @contextlib.contextmanager
    def step(self, index: int | str, request_ids) -> object:
        self.steps += 1
        requests = ", ".join(str(r) for r in list(request_ids)[:8])
        if self.steps > self.max_steps:
            raise StreamStalled(f"{self.what}: step {index} (requests {requests}) is past the stream's budget of "
                                f"{self.max_steps} forward steps: a request never finishes")
        timed = self.step_seconds > 0 and threading.current_thread() is threading.main_thread() and \
            hasattr(signal, "setitimer")
        if not timed:
            yield
            return

        def expired(signum, frame):
            raise StreamStalled(f"{self.what}: step {index} (requests {requests}) still running after "
                                f"{self.step_seconds:g} s: the step never returns")

        previous = signal.signal(signal.SIGALRM, expired)
        signal.setitimer(signal.ITIMER_REAL, self.step_seconds)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            # None: a handler installed outside Python, which signal.signal cannot put back
            signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)
