"""The draft tree: the Frozen-KV MTP draft loop that builds it (DESIGN §3, "Draft"), the verify's accept walk
over it and the accepted path's KV compaction (§3, "Verify").

The accept walk is tensor code over the whole batch: the Python loop runs over tree depth, never over
requests. ``path[b, d]`` is the tree index of the node accepted at depth d (-1 past the accepted length).
"""

from dataclasses import dataclass

import torch

from ..context import AttnMetadata, attn_metadata
from ..kv_cache import slot_mapping

# The drafter samples at half the request's temperature. A drafter flatter than the target (the usual case:
# distilled with a KL loss) proposes, under the shared noise, tokens the target rarely picks; sharpening it
# trades some coupling for confidence. Mean acceptance at T = 0.7 over S = 3 and 5 and two prompt sets: scale
# 1: 1.56, 0.75 and 0.5: 1.59, greedy drafts (scale 0): 1.52 (docs/benchmarks.md, "Sampled acceptance").
DRAFT_TEMPERATURE_SCALE = 0.5


@dataclass
class DraftTree:
    """N nodes per request, root (the bonus token) first, every parent before its children.

    tokens [B, N] int64; parents [B, N] int64 (tree index, -1 for the root); depth [B, N] int64;
    tree_mask [B, N, N] bool (node i sees node j iff j is i or an ancestor), None for a chain (plain causal).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    tree_mask: torch.Tensor | None = None

    @property
    def is_chain(self) -> bool:
        return self.tree_mask is None


def chain_tree(bonus: torch.Tensor, drafts: torch.Tensor) -> DraftTree:
    """topk = 1: the chain [b, d1..dS]."""
    B = bonus.shape[0]
    N = drafts.shape[1] + 1
    ar = torch.arange(N, device=bonus.device).expand(B, N)
    return DraftTree(torch.cat([bonus[:, None], drafts], 1), ar - 1, ar)


def build_tree(bonus, pool_tokens, pool_scores, pool_parents, pool_depth, num_draft_tokens: int) -> DraftTree:
    """Keep the best N-1 pool nodes by cumulative log-prob and root them at the bonus token.

    pool_* [B, P] list the candidates in step order (parents before children); pool_parents index the pool
    (-1 = child of the root). A child's score never exceeds its parent's (log-probs are <= 0) and the stable
    sort keeps the shallower node first on ties, so every kept node's parent is kept too.
    """
    B = bonus.shape[0]
    N = num_draft_tokens
    dev = bonus.device
    order = torch.sort(pool_scores, dim=1, descending=True, stable=True).indices[:, : N - 1]
    keep = torch.sort(order, dim=1).values  # back to pool order: parents first
    to_tree = torch.full_like(pool_tokens, -1).scatter_(1, keep, torch.arange(1, N, device=dev).expand(B, -1))
    par = pool_parents.gather(1, keep)
    par = torch.where(par < 0, 0, to_tree.gather(1, par.clamp(min=0)))
    parents = torch.cat([torch.full((B, 1), -1, device=dev, dtype=torch.long), par], 1)
    tokens = torch.cat([bonus[:, None], pool_tokens.gather(1, keep)], 1)
    depth = torch.cat([torch.zeros(B, 1, device=dev, dtype=torch.long), pool_depth.gather(1, keep)], 1)
    mask = torch.eye(N, dtype=torch.bool, device=dev).repeat(B, 1, 1)  # every node sees itself
    rows = torch.arange(B, device=dev)
    for i in range(1, N):  # and what its parent sees
        mask[:, i] |= mask[rows, parents[:, i]]
    return DraftTree(tokens, parents, depth, mask)


def run_draft(
    assistant,
    inp,
    block_table,
    num_computed_tokens,
    draft_length,
    topk,
    num_draft_tokens,
    position_offset=-1,
    num_splits=None,
    sampling=None,
    masks=None,
) -> DraftTree:
    """Draft ``draft_length`` tokens (topk 1: a chain) or a tree of N nodes (topk > 1) per row of ``inp``.

    block_table [B, W] int32, num_computed_tokens [B] int32: each request's committed target KV rows [0, L),
    read-only.
    Every step sits at RoPE position max(L + position_offset, 0) and sees exactly rows [0, L): nothing is
    appended between steps, so one metadata object serves all of them and no write slot exists.
    topk 1: draft step i samples the token at position L + i from the assistant's logits with the rows'
    ``sampling`` = (temperature, top_k, top_p, seeds [B]) and the same position-keyed Gumbel noise the
    target's verify uses there (greedy rows: the argmax), so a drafter close to the target proposes the
    target's own sample (coupled drafts), at ``DRAFT_TEMPERATURE_SCALE`` x the temperature; None: every row
    greedy.
    topk > 1: B*k independent single-token queries; per step keep the best k of k^2 children by cumulative
    log-prob, then keep the top N-1 of all candidates (as SGLang's
    select_top_k_tokens/organize_draft_results).
    ``masks`` (structured output: a ``structured.StepMasks``, or None): each step drafts inside the grammar,
    masked after the tokens drafted so far on its branch (read on the host: one sync per step), and a chain
    drafts a token the grammar forces whatever the drafter proposes.
    """
    B = inp.hidden.shape[0]
    k = topk
    L = num_computed_tokens.long()
    pos = (L + position_offset).clamp(min=0)
    tok = inp.bonus_tokens
    h = inp.hidden
    draft_sampling = None
    if sampling is not None:
        draft_sampling = (sampling[0] * DRAFT_TEMPERATURE_SCALE, *sampling[1:])
    if k == 1 or draft_length == 0:  # a chain (no draft at all for 0 steps)
        drafts = []
        with attn_metadata(AttnMetadata.draft(block_table, num_computed_tokens, num_splits=num_splits)):
            for i in range(1, draft_length + 1):
                bitmask = forced = None
                if masks is not None:
                    bitmask, forced = masks(torch.stack(drafts, 1) if drafts else tok.new_zeros(B, 0))
                tok, h = assistant.draft_token(tok, h, pos, draft_sampling, L + i, bitmask)
                if forced is not None:
                    tok = torch.where(forced >= 0, forced, tok)
                drafts.append(tok)
        return chain_tree(inp.bonus_tokens, torch.stack(drafts, 1) if drafts else tok.new_zeros(B, 0))
    dev = h.device
    bitmask = None if masks is None else masks.root(range(B))
    with attn_metadata(AttnMetadata.draft(block_table, num_computed_tokens, num_splits=num_splits)):
        # [B, k]: the seed step runs once per request
        scores, tok, h = assistant.propose(tok, h, pos, k, bitmask)
    h = h.repeat_interleave(k, 0)  # every later step has a query row per frontier node
    pos = pos.repeat_interleave(k)
    toks = [tok]
    scs = [scores]
    pars = [torch.full((B, k), -1, device=dev, dtype=torch.long)]
    frontier = torch.arange(k, device=dev).expand(B, k)  # pool index of each frontier node
    rows = torch.arange(B, device=dev, dtype=torch.int32).repeat_interleave(k)
    md = AttnMetadata.draft(block_table, num_computed_tokens, row_to_req=rows, num_splits=num_splits)
    paths = tok[..., None]  # [B, k, step]: each frontier node's drafted tokens (masks only)
    for step in range(1, draft_length):
        bitmask = None if masks is None else masks(paths.flatten(0, 1))[0]
        with attn_metadata(md):
            child_lp, child_tok, h = assistant.propose(tok.reshape(-1), h, pos, k, bitmask)
        cum = (scores[:, :, None] + child_lp.view(B, k, k)).view(B, k * k)
        toks.append(child_tok.view(B, k * k))
        scs.append(cum)
        pars.append(frontier.repeat_interleave(k, 1))
        scores, best = cum.topk(k, dim=-1)
        tok = toks[-1].gather(1, best)
        Hb = h.shape[-1]  # explicit: a 0-row (idle) input cannot infer a -1 dim (DESIGN §4 rule 4)
        h = h.view(B, k, Hb).gather(1, (best // k)[..., None].expand(-1, -1, Hb)).reshape(B * k, Hb)
        if masks is not None:
            paths = paths.gather(1, (best // k)[..., None].expand(-1, -1, step))
            paths = torch.cat([paths, tok[..., None]], 2)
        frontier = k + (step - 1) * k * k + best  # the pool: the seed step's k nodes, then k * k per step
    depth = torch.cat([torch.full_like(t, i + 1) for i, t in enumerate(toks)], 1)  # step i drafts depth i + 1
    return build_tree(
        inp.bonus_tokens, torch.cat(toks, 1), torch.cat(scs, 1), torch.cat(pars, 1), depth, num_draft_tokens
    )


# ---- verify: the accept walk and the accepted path's KV
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
    path = [cur]
    for _ in range(max_depth):
        want = target_tokens.gather(1, cur[:, None])
        # a row that stopped stays at its node, whose children did not match and will not
        match = (tree.parents == cur[:, None]) & (tree.tokens == want)
        has = match.any(1)
        cur = torch.where(has, match.int().argmax(1), cur)
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
