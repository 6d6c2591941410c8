"""Decode attention: one query per row over its request's paged KV, split-KV flash decoding (draft attention
is this op with a row -> request map). The op and its arguments: :func:`attention.decode_attention`.

The Triton path runs two kernels: ``_decode_split_kernel`` gives one program a row, a KV head and a split of
the row's keys (the G query heads of the KV head are the rows of one ``tl.dot``) and writes the split's
partial output and log-sum-exp; ``_decode_merge_kernel`` merges the splits in order. Deterministic mode
(``split_size``) cuts every row's keys at the same absolute positions, whatever the batch.
"""

import torch
import torch.nn.functional as F
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

KV_SPLIT_SIZE = 256  # deterministic mode: keys per KV split for every row of every batch (BLOCK_N divides it)


def num_kv_splits(max_len: int) -> int:
    """Split-KV count for a longest context of ``max_len`` keys (host int): one per 256 keys, in [1, 32]."""
    return min(32, max(1, triton.cdiv(max_len, 256)))


def decode_attention_ref(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    scale,
    row_to_req=None,
    num_splits=None,
    *,
    sliding_window=None,
    split_size=None,
):
    """Torch reference of :func:`decode_attention` (same signature and result; ``num_splits`` is ignored).

    One batched pass (no per-row host loop): each row gathers its whole block-table row (with a window, only
    the blocks that can hold rows [L - W, L)) and zeroes and masks every row outside [max(0, L - W), L).
    """
    check_shapes(q, k_cache, v_cache, block_table)
    W = window_size(sliding_window)
    R = q.shape[0]
    if R == 0 or block_table.shape[1] == 0:
        return torch.zeros_like(q)
    if row_to_req is None:
        bt = block_table[:R]
        lens = seq_lens[:R].long()
    else:
        bt = block_table[row_to_req.long()]
        lens = seq_lens.long()[row_to_req.long()]
    if not split_size:
        return paged_attention_ref(q[:, None], k_cache, v_cache, bt, lens, 1, W, scale)[:, 0].to(q.dtype)
    o = torch.zeros_like(q)
    # a row's key slots: whole splits, in whole blocks
    blocks = triton.cdiv(triton.cdiv(lens, split_size) * split_size, k_cache.shape[1])
    bt = F.pad(bt, (0, max(0, int(blocks.max()) - bt.shape[1])))  # the dummy block 0, its rows zeroed
    for n in blocks.unique().tolist():
        for i in (blocks == n).nonzero().squeeze(1).split(64):  # 64 rows a call bound the gathered K/V
            rows = paged_attention_ref(q[i, None], k_cache, v_cache, bt[i, :n], lens[i], 1, W, scale)
            o[i] = rows[:, 0].to(o.dtype)
    return o


@triton.jit
def _decode_split_kernel(
    Q,
    K,
    V,
    BT,
    SL,
    MAP,
    MID_O,
    MID_L,
    qk_scale,
    stride_qr,
    stride_qh,
    stride_kb,
    stride_kp,
    stride_kh,
    stride_bt,
    Hq,
    D,
    num_splits,
    WINDOW,
    G: tl.constexpr,
    PAGE: tl.constexpr,
    HAS_MAP: tl.constexpr,
    SPLIT: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program: row r, kv head kvh, split sp; all G query heads of kvh are the rows of one tl.dot.
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    if HAS_MAP:
        req = tl.load(MAP + r)
    else:
        req = r
    seq_len = tl.load(SL + req)
    # sliding window: the splits cover only the visible keys [lo, seq_len)
    lo = tl.maximum(seq_len - WINDOW, 0)
    if SPLIT > 0:  # deterministic mode: split sp is keys [sp * SPLIT, (sp + 1) * SPLIT), whatever the batch
        first = 0
        chunk = SPLIT
    else:  # per-row splits of whole tiles
        first = lo
        chunk = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = tl.maximum(first + sp * chunk, lo)
    end = tl.minimum(first + sp * chunk + chunk, seq_len)
    rows = tl.arange(0, BLOCK_H)
    head = kvh * G + rows
    h_ok = rows < G
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q = tl.load(
        Q + r * stride_qr + head[:, None] * stride_qh + offs_d[None, :],
        mask=h_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s0 in range(start, end, BLOCK_N):
        offs_n = s0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        k, v = load_kv_tile(
            K, V, BT + req * stride_bt, offs_n, n_ok, offs_d, d_ok, kvh, stride_kb, stride_kp, stride_kh, PAGE
        )
        s = dot(q, k, PREC, UPCAST) * qk_scale
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # every tile has >= 1 valid key, so m_new is finite
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, PREC, UPCAST)
        m_i = m_new
    # Empty splits (past the row's length) write acc 0 and lse -inf, so the merge gives them zero weight.
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    idx = (r * Hq + head) * num_splits + sp
    tl.store(MID_O + idx[:, None] * D + offs_d[None, :], out, mask=h_ok[:, None] & d_ok[None, :])
    tl.store(MID_L + idx, lse, mask=h_ok)


@triton.jit
def _decode_merge_kernel(MID_O, MID_L, Out, stride_or, stride_oh, Hq, D, num_splits, BLOCK_D: tl.constexpr):
    # Splits merge in order, one at a time: an empty split (weight 0, partial 0) adds exact zeros, so a row's
    # output does not depend on how many splits the launch had (deterministic mode sizes it from the batch).
    r = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    base = (r * Hq + h) * num_splits
    m = tl.load(MID_L + base)
    for s in range(1, num_splits):
        m = tl.maximum(m, tl.load(MID_L + base + s))
    m = tl.where(m == float("-inf"), 0.0, m)  # seq_len 0: all weights 0 -> output 0
    den = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(num_splits):
        w = tl.exp2(tl.load(MID_L + base + s) - m)
        den += w
        acc += w * tl.load(MID_O + (base + s) * D + offs_d, mask=d_ok, other=0.0)
    out = acc / tl.where(den > 0, den, 1.0)
    tl.store(Out + r * stride_or + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_ok)


def decode_attention_triton(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    scale,
    row_to_req=None,
    num_splits=None,
    *,
    sliding_window=None,
    split_size=None,
):
    """Triton path of :func:`decode_attention` (same signature and result): split-KV stage 1 + LSE merge."""
    G = check_shapes(q, k_cache, v_cache, block_table)
    window = window_size(sliding_window)
    R, Hq, D = q.shape
    if q.stride(2) != 1:
        q = q.contiguous()
    o = torch.empty(R, Hq, D, dtype=q.dtype, device=q.device)
    if R == 0:
        return o
    if split_size:  # enough fixed-size splits for the block table's keys: a host int, no sync
        num_splits = max(1, triton.cdiv(block_table.shape[1] * k_cache.shape[1], split_size))
    elif num_splits is None:  # from the longest context: one host read (a sync on GPU), so callers pass it
        num_splits = num_kv_splits(int(seq_lens.max()))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    tiles = attention_tiles(q)
    mid_o = torch.empty(R, Hq, num_splits, D, dtype=torch.float32, device=q.device)
    mid_l = torch.empty(R, Hq, num_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(R, k_cache.shape[2], num_splits)](
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        q if row_to_req is None else row_to_req,
        mid_o,
        mid_l,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_table.stride(0),
        Hq,
        D,
        num_splits,
        window,
        G=G,
        PAGE=k_cache.shape[1],
        HAS_MAP=row_to_req is not None,
        SPLIT=split_size or 0,
        **dot_precision(q),
        BLOCK_H=max(16, triton.next_power_of_2(G)),
        BLOCK_N=tiles.block_n,
        BLOCK_D=tiles.block_d,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    _decode_merge_kernel[(R, Hq)](
        mid_o, mid_l, o, o.stride(0), o.stride(1), Hq, D, num_splits, BLOCK_D=tiles.block_d
    )
    return o
