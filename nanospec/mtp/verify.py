"""Verify acceptance over a draft tree (DESIGN §3, "Verify"), and the accepted path's KV compaction.

The walk is tensor code over the whole batch: the Python loop runs over tree depth, never over requests.
``path[b, d]`` is the tree index of the node accepted at depth d (-1 past the accepted length).
"""

import torch

from ..kv_cache import slot_mapping
from .draft import DraftTree


def _children(tree: DraftTree, cur: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """[B, N] bool: the children of each row's current node (rows that stopped have none)."""
    return (tree.parents == cur[:, None]) & active[:, None]


def accept(tree: DraftTree, target_tokens: torch.Tensor, max_depth: int):
    """From the root, accept the child whose token equals the target's token at the current node.

    target_tokens [B, N] int64: the token the target produces after every node (its argmax, or its
    position-keyed Gumbel sample: ``kernels.sampling.sample``). Siblings hold distinct tokens, so at most one
    child matches. Lossless by construction: every emitted token is the target's own token at its position,
    the same a step without speculation produces there. Returns (path [B, D+1], accept_length [B], bonus [B])
    where accept_length = 1 + accepted drafts and bonus = the target's token at the last accepted node.
    ``max_depth`` (the draft's length s) bounds the walk: known on the host, so no sync and the walk can be
    graph-captured.
    """
    B, N = tree.tokens.shape
    cur = torch.zeros(B, dtype=torch.long, device=tree.tokens.device)
    active = torch.ones(B, dtype=torch.bool, device=cur.device)
    path = [cur]
    for _ in range(max_depth):
        want = target_tokens.gather(1, cur[:, None])
        match = _children(tree, cur, active) & (tree.tokens == want)
        has = match.any(1)
        cur = torch.where(has, match.int().argmax(1), cur)
        active &= has
        path.append(torch.where(has, cur, -1))
    path = torch.stack(path, 1)
    accept_length = (path >= 0).sum(1)
    return path, accept_length, target_tokens.gather(1, cur[:, None]).squeeze(1)


def emitted_tokens(tree: DraftTree, path: torch.Tensor, accept_length: torch.Tensor, bonus: torch.Tensor):
    """[B, D+1] tokens each request emits (accepted drafts, then the bonus), -1 padded; one host copy
    later."""
    out = torch.where(path[:, 1:] >= 0, tree.tokens.gather(1, path[:, 1:].clamp(min=0)), -1)
    out = torch.cat([out, torch.full_like(bonus[:, None], -1)], 1)
    return out.scatter(1, (accept_length - 1)[:, None], bonus[:, None])


def compact_accepted_kv(
    kv_pools, block_table, num_computed_tokens, path, accept_length, page_size: int
) -> None:
    """topk > 1: move the accepted path's K/V rows (written at L + tree index) to rows L + depth.

    kv_pools: the target's pools, each [layers, 2, blocks, page_size, Hkv, D]; num_computed_tokens [B] =
    committed L before this verify. Rows that need no move copy onto themselves, so the op is shape-static
    (no host sync). Rejected rows beyond the new length are garbage that the next verify overwrites.
    """
    B, D1 = path.shape
    if B == 0 or D1 < 2:
        return
    d = torch.arange(1, D1, device=path.device).expand(B, -1)
    L = num_computed_tokens.long()[:, None]
    valid = d < accept_length[:, None]
    rows = torch.arange(B, device=path.device)[:, None]
    src = slot_mapping(block_table, rows, L + torch.where(valid, path[:, 1:], d), page_size).flatten()
    dst = slot_mapping(block_table, rows, L + d, page_size).flatten()
    for pool in kv_pools:
        flat = pool.view(pool.shape[0], 2, -1, *pool.shape[4:])
        flat[:, :, dst] = flat[:, :, src]
