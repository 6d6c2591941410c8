"""Paged KV pool: block allocator, per-request block tables and slot mapping."""
from collections import deque

import torch

from .request import Request

DUMMY_BLOCK = 0  # reserved: padding rows (CUDA graphs, idle slots) point here and never touch a live block


class BlockAllocator:
    """Hands out fixed-size KV blocks of ``page_size`` tokens; block 0 is reserved as the dummy block.

    A request owns ``req.block_table`` (block ids in order); token j of a request lives at slot
    ``block_table[j // page_size] * page_size + j % page_size`` of the pool.
    """

    def __init__(self, num_blocks: int, page_size: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks, self.page_size = num_blocks, page_size
        self.free_blocks = deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def blocks_needed(self, req: Request, num_slots: int) -> int:
        """Extra blocks ``req`` needs so that its table covers ``num_slots`` token slots."""
        return max(0, -(-num_slots // self.page_size) - len(req.block_table))

    def can_allocate(self, req: Request, num_slots: int) -> bool:
        return self.blocks_needed(req, num_slots) <= self.num_free

    def allocate(self, req: Request, num_slots: int) -> None:
        """Grow ``req.block_table`` to cover ``num_slots`` slots. Raises RuntimeError when the pool is short."""
        n = self.blocks_needed(req, num_slots)
        if n > self.num_free:
            raise RuntimeError(f"KV pool exhausted: need {n} blocks, {self.num_free} free")
        req.block_table.extend(self.free_blocks.popleft() for _ in range(n))

    def free(self, req: Request) -> None:
        """Return every block of ``req`` (the committed rows and any rejected-draft tail) to the pool."""
        self.free_blocks.extend(req.block_table)
        req.block_table = []

    def slots(self, req: Request, start: int, end: int) -> list[int]:
        """Pool slots of the request's token indices [start, end)."""
        ps, bt = self.page_size, req.block_table
        return [bt[j // ps] * ps + j % ps for j in range(start, end)]


def block_table_tensor(reqs: list[Request], device, width: int | None = None) -> torch.Tensor:
    """[B, W] int32 block tables, padded with the dummy block."""
    width = width or max((len(r.block_table) for r in reqs), default=1) or 1
    rows = [r.block_table + [DUMMY_BLOCK] * (width - len(r.block_table)) for r in reqs]
    return torch.tensor(rows, dtype=torch.int32).reshape(len(reqs), width).to(device)
