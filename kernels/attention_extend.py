"""Extend attention: the new tokens of B packed requests over their paged KV (prefill, chunked prefill, chain
and tree verify), causal or with a tree mask. The op and its arguments: :func:`attention.extend_attention`.

The reference makes one batched pass when every request has the same number of new tokens, else loops over
the requests. The Triton kernel gives one program a request, a KV head and a block of its queries, their
G query heads packed into the rows of one ``tl.dot`` (each K/V tile is loaded once for the whole GQA group),
and skips key tiles that no query of the block can see (causal and sliding-window pruning).
"""

import torch
import triton
import triton.language as tl

from .attention_common import (
    INTERPRETER_ONLY,  # noqa: F401  (scripts/kernel_specs.py reads it from a kernel's module)
    LOG2E,
    attention_tiles,
    check_shapes,
    dot,
    dot_precision,
    load_kv_tile,
    paged_attention_ref,
    window_size,
)


def extend_attention_ref(
    q,
    k_cache,
    v_cache,
    block_table,
    cu_seqlens_q,
    seq_lens,
    scale,
    max_seqlen_q,
    tree_mask=None,
    *,
    sliding_window=None,
):
    """Torch reference of :func:`extend_attention` (same signature and result). When every request has the
    same number of new tokens (T == B * max_seqlen_q, or a tree) it runs one batched pass; otherwise it loops
    over requests on the host. Reads only rows [max(0, prefix - W + 1), seq_len) of each request."""
    check_shapes(q, k_cache, v_cache, block_table)
    T, Hq, D = q.shape
    o = torch.zeros_like(q)
    B = cu_seqlens_q.numel() - 1
    if T == 0 or B <= 0:
        return o
    n_tree = 0 if tree_mask is None else tree_mask.shape[-1]
    W = window_size(sliding_window, n_tree)
    if tree_mask is not None and (tree_mask.shape != (B, n_tree, n_tree) or T != B * n_tree):
        raise ValueError(f"tree_mask {tuple(tree_mask.shape)} needs shape [B, N, N] with T = B*N ({T} rows)")
    lens = seq_lens.long()
    P = k_cache.shape[1]
    n = n_tree or (max_seqlen_q if T == B * max_seqlen_q else 0)
    if n:  # every request has n new tokens: one pass over all of them
        if bool((lens[:B] < n).any()):
            raise ValueError(f"every seq_len must be >= its {n} new tokens, got seq_lens {lens.tolist()}")
        o = paged_attention_ref(
            q.reshape(B, n, Hq, D), k_cache, v_cache, block_table[:B], lens[:B], n, W, scale, tree_mask
        )
        return o.view(T, Hq, D).to(q.dtype)
    cu = cu_seqlens_q.tolist()
    lens_h = seq_lens.tolist()
    for b in range(B):
        n = cu[b + 1] - cu[b]
        L = lens_h[b]
        if n == 0:
            continue
        if L < n:
            raise ValueError(f"request {b}: seq_len {L} < number of new tokens {n}")
        ob = paged_attention_ref(
            q[cu[b] : cu[b + 1]][None],
            k_cache,
            v_cache,
            block_table[b : b + 1, : triton.cdiv(L, P)],
            lens[b : b + 1],
            n,
            W,
            scale,
        )
        o[cu[b] : cu[b + 1]] = ob[0].to(q.dtype)
    return o


@triton.jit
def _extend_kernel(
    Q,
    K,
    V,
    Out,
    BT,
    CU,
    SL,
    TM,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kp,
    stride_kh,
    stride_bt,
    N_TREE,
    D,
    WINDOW,
    G: tl.constexpr,
    QPB: tl.constexpr,
    PAGE: tl.constexpr,
    TREE: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # One program: request b, kv head kvh, QPB queries x G query heads packed into BLOCK_M rows (GQA packing,
    # so each K/V tile is loaded once for the whole group).
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    mb = tl.program_id(2)
    q0 = tl.load(CU + b)
    n = tl.load(CU + b + 1) - q0
    if mb * QPB >= n:
        return
    seq_len = tl.load(SL + b)
    prefix = seq_len - n
    rows = tl.arange(0, BLOCK_M)
    qi = mb * QPB + rows // G  # query index inside the request
    head = kvh * G + rows % G
    row_ok = (rows < QPB * G) & (qi < n)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q = tl.load(
        Q + (q0 + qi)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if TREE:  # node i sits at position prefix + depth_i, depth_i = |ancestors + itself| - 1
        offs_t = tl.arange(0, BLOCK_T)
        row = tl.load(
            TM + (b * N_TREE + qi[:, None]) * N_TREE + offs_t[None, :],
            mask=row_ok[:, None] & (offs_t < N_TREE)[None, :],
            other=0,
        )
        pos = prefix + tl.maximum(tl.sum((row != 0).to(tl.int32), 1) - 1, 0)
        kv_end = seq_len
        kv_start = prefix - WINDOW + 1
    else:  # causal tile pruning: no key past the tile's last query position
        pos = prefix + qi
        kv_end = prefix + tl.minimum(n, (mb + 1) * QPB)
        kv_start = prefix + mb * QPB - WINDOW + 1
    # sliding window: start at the first key the tile's earliest query can see (no wholly hidden tiles)
    for start in range(tl.maximum(kv_start, 0), kv_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_end
        k, v = load_kv_tile(
            K, V, BT + b * stride_bt, offs_n, n_ok, offs_d, d_ok, kvh, stride_kb, stride_kp, stride_kh, PAGE
        )
        s = dot(q, k, PREC, UPCAST) * qk_scale
        if TREE:
            j = offs_n - prefix
            tm = tl.load(
                TM + (b * N_TREE + qi[:, None]) * N_TREE + j[None, :],
                mask=row_ok[:, None] & (j >= 0)[None, :] & n_ok[None, :],
                other=0,
            )
            ok = (offs_n < prefix)[None, :] | (tm != 0)
        else:
            ok = offs_n[None, :] <= pos[:, None]
        ok = ok & (pos[:, None] - offs_n[None, :] < WINDOW)
        s = tl.where(ok & n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked rows: exp2(-inf) = 0, never NaN
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, PREC, UPCAST)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        Out + (q0 + qi)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def extend_attention_triton(
    q,
    k_cache,
    v_cache,
    block_table,
    cu_seqlens_q,
    seq_lens,
    scale,
    max_seqlen_q,
    tree_mask=None,
    *,
    sliding_window=None,
):
    """Triton path of :func:`extend_attention` (same signature and result)."""
    G = check_shapes(q, k_cache, v_cache, block_table)
    T, Hq, D = q.shape
    B = cu_seqlens_q.numel() - 1
    if q.stride(2) != 1:
        q = q.contiguous()
    o = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    if T == 0 or B <= 0:
        return o
    if max_seqlen_q <= 0:
        raise ValueError(f"max_seqlen_q must be >= max n_b >= 1 for {T} query rows, got {max_seqlen_q}")
    n_tree = 1
    if tree_mask is not None:
        n_tree = tree_mask.shape[-1]
        if tree_mask.shape != (B, n_tree, n_tree) or T != B * n_tree:
            raise ValueError(
                f"tree_mask {tuple(tree_mask.shape)} needs shape [B, N, N] with T = B*N ({T} rows)"
            )
        tree_mask = tree_mask.contiguous().view(torch.uint8)
    window = window_size(sliding_window, 0 if tree_mask is None else n_tree)
    tiles = attention_tiles(q, tree_mask is not None)
    # rows: queries x GQA heads, no more than the longest request needs, at least one query's heads
    block_m = min(tiles.block_m, max(16, triton.next_power_of_2(max_seqlen_q * G)))
    block_m = max(block_m, triton.next_power_of_2(G))
    qpb = block_m // G
    grid = (B, k_cache.shape[2], triton.cdiv(max_seqlen_q, qpb))
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        o,
        block_table,
        cu_seqlens_q,
        seq_lens,
        q if tree_mask is None else tree_mask,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        o.stride(0),
        o.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_table.stride(0),
        n_tree,
        D,
        window,
        G=G,
        QPB=qpb,
        PAGE=k_cache.shape[1],
        TREE=tree_mask is not None,
        **dot_precision(q),
        BLOCK_M=block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_D=tiles.block_d,
        BLOCK_T=triton.next_power_of_2(n_tree),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return o
