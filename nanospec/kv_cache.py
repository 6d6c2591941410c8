"""Paged KV pool: the block allocator (each request's block table, the prefix cache) and the slot mapping."""

import hashlib
from array import array
from collections import OrderedDict, deque

import torch

from .request import Request

DUMMY_BLOCK = 0  # reserved: padding rows (CUDA graphs, idle slots) point here and never touch a live block


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for ints a >= 0, b > 0: the blocks of b slots that hold a slots."""
    return (a + b - 1) // b


def slot_mapping(block_table: torch.Tensor, rows: torch.Tensor, token_idx: torch.Tensor, page_size: int):
    """Pool slots of token ``token_idx`` of request row ``rows`` (broadcast together; int64 result).

    Token j of a request lives at slot ``block_table[row, j // page_size] * page_size + j % page_size``: the
    one place this formula is written (prefill, decode, verify writes and the tree compaction all use it).
    """
    return block_table.long()[rows, token_idx // page_size] * page_size + token_idx % page_size


class BlockAllocator:
    """Hands out fixed-size KV blocks of ``page_size`` tokens; block 0 is reserved as the dummy block.

    A request owns ``req.block_table`` (block ids in order); ``slot_mapping`` turns token indices into slots.

    Prefix caching (``enable_prefix_caching``): a full block written by a prefill is keyed by a hash of every
    token up to and including the block (chained, so equal keys mean equal prefixes) and can be shared. The
    key is sha256(parent key || the block's token ids as int64), as vLLM's sha256 option: a crafted prompt
    cannot collide with another's key and read its KV (Python's 64-bit ``hash`` could). The first block's
    parent is sha256 of the request's ``cache_salt`` ("" when None): different salts never share a block.
    Blocks are ref-counted; a block whose last owner leaves stays cached (free, evictable) and is evicted
    least recently freed first, only when the allocator needs blocks. Blocks that a decode or verify writes
    into (draft rows, rejected rows, the partial last block) are never registered, so they stay private.
    """

    def __init__(self, num_blocks: int, page_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free_blocks = deque(range(1, num_blocks))
        self.ref_count = [0] * num_blocks
        self.cached: dict[bytes, int] = {}  # prefix key -> block
        self.block_hash: dict[int, bytes] = {}  # block -> prefix key (registered blocks only)
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks with no owner, LRU first

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: never-used ones plus cached ones no request holds."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def blocks_needed(self, req: Request, num_slots: int) -> int:
        """Extra blocks ``req`` needs so that its table covers ``num_slots`` token slots."""
        return max(0, cdiv(num_slots, self.page_size) - len(req.block_table))

    def allocate(self, req: Request, num_slots: int) -> list[int]:
        """Grow ``req.block_table`` to cover ``num_slots`` slots; returns the blocks added. Raises
        RuntimeError when the pool is short."""
        n = self.blocks_needed(req, num_slots)
        if n > self.num_free:
            raise RuntimeError(f"KV pool exhausted: need {n} blocks, {self.num_free} free")
        for _ in range(n):
            if self.free_blocks:
                block = self.free_blocks.popleft()
            else:  # evict the least recently freed cached block
                block = self.evictable.popitem(last=False)[0]
                del self.cached[self.block_hash.pop(block)]
            self.ref_count[block] = 1
            req.block_table.append(block)
        return req.block_table[len(req.block_table) - n :]

    def free(self, req: Request) -> None:
        """Drop ``req``'s hold on every block (committed rows and any rejected-draft tail); a block no one
        holds goes back to the pool, or stays cached (evictable) if it is registered."""
        for block in req.block_table:
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                if block in self.block_hash:
                    self.evictable[block] = None
                else:
                    self.free_blocks.append(block)
        req.block_table = []

    # ---- prefix caching ----------------------------------------------------------------------------------
    def _hashes(self, req: Request, num_tokens: int) -> list[bytes]:
        """Chained 32-byte sha256 keys of the first ``num_tokens // page_size`` full blocks of ``req``'s
        tokens (kept on the request: its token prefix never changes, so each block is hashed once)."""
        ps = self.page_size
        out = req.block_hashes
        n = num_tokens // ps
        ids = req.all_token_ids
        for i in range(len(out), n):
            parent = out[-1] if out else hashlib.sha256((req.params.cache_salt or "").encode()).digest()
            out.append(hashlib.sha256(parent + array("q", ids[i * ps : (i + 1) * ps]).tobytes()).digest())
        return out[:n]

    def match_prefix(self, req: Request) -> int:
        """For a request with no blocks yet: take the cached blocks of its longest cached prefix (at most all
        but its last prefill token, which is always computed) and return how many tokens they hold."""
        if not self.enable_prefix_caching or req.block_table:
            return 0
        for h in self._hashes(req, req.prefill_len - 1):
            block = self.cached.get(h)
            if block is None:
                break
            self.evictable.pop(block, None)  # a cached block nobody held is no longer evictable
            self.ref_count[block] += 1
            req.block_table.append(block)
        return len(req.block_table) * self.page_size

    def register_prefill(self, req: Request, num_prefilled: int) -> None:
        """Make the full blocks among ``req``'s first ``num_prefilled`` tokens (all written by prefill)
        sharable. A prefix another block already holds keeps that block; this one stays private."""
        if not self.enable_prefix_caching:
            return
        for block, h in zip(req.block_table, self._hashes(req, num_prefilled)):
            if block not in self.block_hash and h not in self.cached:
                self.cached[h] = block
                self.block_hash[block] = h
