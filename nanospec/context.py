"""Per-forward attention metadata, set by the model runner and read by attention layers (as nano-vllm does)."""
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class AttnMetadata:
    """What attention layers need for one forward.

    mode: "prefill" (causal extend over a paged prefix), "decode" (one query per request), "verify" (tree
    tokens over the paged prefix + tree mask) or "draft" (frozen-KV queries; nothing is written).
    slot_mapping [T] int64: pool slot each new token's K/V goes to (-1 = skip); always None for "draft".
    block_table [B, W] int32; seq_lens [B] int32: KV length per request including the new tokens;
    cu_seqlens_q [B+1] int32 and max_seqlen_q (host int) for prefill/verify; tree_mask [B, N, N] bool for
    verify; row_to_req [R] int32 maps draft query rows to requests; num_splits: split-KV count for decode/draft.
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


_current: AttnMetadata | None = None


def get_attn_metadata() -> AttnMetadata:
    if _current is None:
        raise RuntimeError("no attention metadata set: run the model through the model runner")
    return _current


@contextmanager
def attn_metadata(md: AttnMetadata):
    """Make ``md`` current for the forwards inside the block."""
    global _current
    prev, _current = _current, md
    try:
        yield md
    finally:
        _current = prev
