"""Paged KV pool: block allocator, per-request block tables and the slot mapping."""
from collections import deque

import torch

from .request import Request

DUMMY_BLOCK = 0  # reserved: padding rows (CUDA graphs, idle slots) point here and never touch a live block


def slot_mapping(block_table: torch.Tensor, rows: torch.Tensor, token_idx: torch.Tensor, page_size: int):
    """Pool slots of token ``token_idx`` of request row ``rows`` (broadcast together; int64 result).

    Token j of a request lives at slot ``block_table[row, j // page_size] * page_size + j % page_size``: the one
    place this formula is written (prefill, decode, verify writes and the tree compaction all use it).
    """
    return block_table.long()[rows, token_idx // page_size] * page_size + token_idx % page_size


def block_table_tensor(reqs: list[Request], device) -> torch.Tensor:
    """[B, W] int32 block tables, padded with the dummy block (W >= 1)."""
    width = max((len(r.block_table) for r in reqs), default=1) or 1
    rows = [r.block_table + [DUMMY_BLOCK] * (width - len(r.block_table)) for r in reqs]
    return torch.tensor(rows, dtype=torch.int32).reshape(len(reqs), width).to(device)


class BlockAllocator:
    """Hands out fixed-size KV blocks of ``page_size`` tokens; block 0 is reserved as the dummy block.

    A request owns ``req.block_table`` (block ids in order); ``slot_mapping`` turns token indices into slots.
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
