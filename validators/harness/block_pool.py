"""Physical block pool: FIFO free queue plus free set, block 0 reserved as the null block."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class BlockPool:
    """Hands out block ids of one manager's cache tensors.

    The first id of the queue (0) becomes the null block: it pads block tables and
    stands for logical blocks with no storage (e.g. slid-out sliding-window blocks).
    It is never handed out and freeing it is a no-op, as in the framework.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free_block_queue: deque[int] = deque(range(num_blocks))
        self._null_block = self._free_block_queue.popleft()
        self._free_block_set: set[int] = set(self._free_block_queue)

    def get_num_free_blocks(self) -> int:
        return len(self._free_block_queue)

    def get_null_block(self) -> int:
        return self._null_block

    def get_block(self, block_id: int) -> int:
        if block_id < 0 or block_id >= self.num_blocks:
            raise IndexError(f"block_id {block_id} is out of range [0, {self.num_blocks})")
        return block_id

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        if num_blocks < 0:
            raise ValueError("num_blocks must be non-negative")
        if num_blocks > len(self._free_block_queue):
            raise ValueError(
                f"requested {num_blocks} blocks, but only {len(self._free_block_queue)} are available"
            )
        taken = [self._free_block_queue.popleft() for _ in range(num_blocks)]
        self._free_block_set.difference_update(taken)
        return taken

    def free_blocks(self, blocks: Iterable[int]) -> None:
        """Return blocks to the tail of the queue; a double free raises and changes nothing."""
        to_free = []
        seen: set[int] = set()
        for block_id in blocks:
            self.get_block(block_id)
            if block_id == self._null_block:
                continue
            if block_id in self._free_block_set or block_id in seen:
                raise ValueError(f"block_id {block_id} is already free")
            seen.add(block_id)
            to_free.append(block_id)
        # Validated as a whole first so a bad list leaves the pool untouched.
        self._free_block_queue.extend(to_free)
        self._free_block_set.update(to_free)

    # Introspection used by invariant checks and poisoning.
    def free_block_ids(self) -> list[int]:
        """Free ids in hand-out order (head of the queue first)."""
        return list(self._free_block_queue)

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free_block_set
