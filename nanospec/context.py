"""Per-forward attention metadata and how layers find it.

Convention (one for the target and the drafter): the caller builds an ``AttnMetadata`` with one of the named
constructors and makes it current with ``with attn_metadata(md):`` around the forward; attention layers read
it with ``get_attn_metadata()``. As in nano-vllm, this keeps every model's ``forward(ids, positions)``
HF-shaped, and a CUDA graph captures the same static tensors the eager path reads. The constructors are the
only place a mode's fields are chosen: ``draft`` takes no write slots at all, so the drafter cannot write KV
by construction (DESIGN §4 rule 3). ``paged_attention`` is the one place a target layer's attention kernel is
chosen from the metadata.
"""

from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from .kernels.attention import decode_attention, extend_attention


@dataclass(frozen=True)
class AttnMetadata:
    """What attention layers need for one forward.

    mode: what the forward is: "prefill" (causal extend over a paged prefix), "decode" (one query per
    request), "verify" (tree tokens over the paged prefix + tree mask) or "draft" (frozen-KV queries; nothing
    is written). Which attention kernel a target layer runs is ``paged_attention``'s choice, not the mode.
    block_table [B, W] int32; seq_lens [B] int32: KV length per request including the new tokens (per query
    row, [T, W] and [T], when ``split_size`` is set outside decode);
    slot_mapping [T] int64: pool slot each new token's K/V goes to; None for "draft";
    cu_seqlens_q [B+1] int32 and max_seqlen_q (host int) for prefill/verify; tree_mask [B, N, N] bool for a
    tree verify (None: causal chain); row_to_req [R] int32 maps draft query rows to requests (None: row b is
    request b); num_splits: split-KV count for decode/draft (None: chosen from seq_lens, one host sync);
    split_size: None, or deterministic mode's fixed KV split size (each row a decode row: ``prefill``).
    """

    mode: str
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    max_seqlen_q: int = 1
    tree_mask: torch.Tensor | None = None
    row_to_req: torch.Tensor | None = None
    num_splits: int | None = None
    split_size: int | None = None

    @classmethod
    def prefill(
        cls, block_table, seq_lens, slot_mapping, cu_seqlens_q, max_seqlen_q, split_size=None
    ) -> "AttnMetadata":
        """Chunks of new tokens per request (``cu_seqlens_q``) over each request's cached prefix, causal.

        Deterministic mode (``split_size``, DESIGN §4 rule 9): every new token is a decode row over keys
        [0, its position + 1) of its request (block-table row gathered), reduced in fixed splits of
        ``split_size`` keys, so a row's attention is one computation whether it prefills, decodes or verifies.
        """
        if not split_size:
            return cls("prefill", block_table, seq_lens, slot_mapping, cu_seqlens_q, max_seqlen_q)
        T = slot_mapping.numel()
        n = cu_seqlens_q.diff()
        req = torch.repeat_interleave(torch.arange(n.numel(), device=n.device), n, output_size=T)
        pos = torch.arange(T, device=n.device) - cu_seqlens_q[req] + (seq_lens - n)[req]
        return cls("prefill", block_table[req], (pos + 1).int(), slot_mapping, split_size=split_size)

    @classmethod
    def decode(cls, block_table, seq_lens, slot_mapping, num_splits=None, split_size=None) -> "AttnMetadata":
        """One new token per request at position ``seq_lens - 1``."""
        return cls(
            "decode", block_table, seq_lens, slot_mapping, num_splits=num_splits, split_size=split_size
        )

    @classmethod
    def verify(
        cls, block_table, num_computed_tokens, slot_mapping, num_tokens, tree_mask=None, split_size=None
    ) -> "AttnMetadata":
        """``num_tokens`` tree tokens per request after ``num_computed_tokens`` [B] int32 cached rows; the
        tree mask (None for a chain) says which tree tokens each one sees. A chain with ``split_size`` has
        ``prefill``'s rows (deterministic mode: token j of request b is the decode row of L_b + j + 1
        keys)."""
        B = num_computed_tokens.shape[0]
        dev = num_computed_tokens.device
        cu = torch.arange(0, (B + 1) * num_tokens, num_tokens, dtype=torch.int32, device=dev)
        seq_lens = num_computed_tokens + num_tokens
        if split_size and tree_mask is None:
            rows = cls.prefill(block_table, seq_lens, slot_mapping, cu, num_tokens, split_size)
            return replace(rows, mode="verify")
        return cls("verify", block_table, seq_lens, slot_mapping, cu, num_tokens, tree_mask)

    @classmethod
    def draft(cls, block_table, num_computed_tokens, row_to_req=None, num_splits=None) -> "AttnMetadata":
        """Frozen-KV draft queries over exactly rows [0, L) of each request; no write slots exist."""
        return cls("draft", block_table, num_computed_tokens, row_to_req=row_to_req, num_splits=num_splits)


_current: AttnMetadata | None = None


def get_attn_metadata() -> AttnMetadata:
    """The metadata of the forward in progress; RuntimeError outside ``attn_metadata``."""
    if _current is None:
        raise RuntimeError("no attention metadata set: run the model through the model runner")
    return _current


def paged_attention(q, k_cache, v_cache, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """A target layer's attention in the forward in progress: q [T, Hq, D] over the layer's paged K/V
    (``k_cache`` / ``v_cache``, its pool views) -> [T, Hq, D]. The decode kernel in decode, and for every
    row of every mode in deterministic mode (``split_size``: DESIGN §4 rule 9); else the extend kernel
    (prefill and verify: causal over the paged prefix, or the tree mask)."""
    md = get_attn_metadata()
    if md.mode == "decode" or md.split_size is not None:
        return decode_attention(
            q,
            k_cache,
            v_cache,
            md.block_table,
            md.seq_lens,
            scale,
            sliding_window=sliding_window,
            num_splits=md.num_splits,
            split_size=md.split_size,
        )
    return extend_attention(
        q,
        k_cache,
        v_cache,
        md.block_table,
        md.cu_seqlens_q,
        md.seq_lens,
        scale,
        md.max_seqlen_q,
        md.tree_mask,
        sliding_window=sliding_window,
    )


@contextmanager
def attn_metadata(md: AttnMetadata):
    """Make ``md`` current for the forwards inside the block."""
    global _current
    prev = _current
    _current = md
    try:
        yield md
    finally:
        _current = prev
