"""Paged attention: extend/prefill (causal or tree mask), split-KV decode, and frozen-KV draft attention.

KV cache layout per layer: ``k_cache, v_cache: [num_blocks, page_size, Hkv, D]`` (same shape and strides, last
dim contiguous, any float dtype). Token j of request b lives at block ``block_table[b, j // page_size]``,
offset ``j % page_size``. Both paths use exactly rows [0, seq_len) of each request (with a sliding window,
only the visible ones): whatever lies in the rest of the last block or in block-table entries past the
request's blocks (the dummy block 0, recycled blocks, NaN/inf) never reaches the output; the Triton paths mask
their loads, the references zero such rows before any product. GQA: query head h reads kv head
``h // (Hq // Hkv)``. Softmax and accumulation run in fp32; outputs have q's dtype.

Sliding window (``sliding_window=W``, HF Gemma 4 ``sliding_window_overlay`` on the causal mask): a query at
absolute position p sees the key at position j iff j <= p and p - j < W. None means full attention.

Each op has a torch reference (``*_ref``, the CPU engine path and the test oracle) and a Triton path
(``*_triton``); the public function picks one with ``use_triton(q)``. The Triton paths take only host ints for
launch sizes, so they never sync (except ``decode_attention(num_splits=None)``, which reads the max length
once).
"""

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import use_triton

_LOG2E = 1.4426950408889634
_NO_WINDOW = 1 << 30  # "no sliding window" inside the kernels: farther than any position


def _check(q, k_cache, v_cache, block_table) -> int:
    """Validate shapes shared by all ops; return the GQA group size Hq // Hkv."""
    if q.dim() != 3 or k_cache.dim() != 4 or block_table.dim() != 2:
        raise ValueError(
            f"expected q [T,Hq,D], cache [NB,P,Hkv,D], block_table [B,W]; got {tuple(q.shape)}, "
            f"{tuple(k_cache.shape)}, {tuple(block_table.shape)}"
        )
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError(
            "k_cache and v_cache must have the same shape and strides, with a contiguous last dim"
        )
    if k_cache.shape[3] != q.shape[2]:
        raise ValueError(f"head_dim mismatch: q {q.shape[2]} vs cache {k_cache.shape[3]}")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"query heads {q.shape[1]} not a multiple of kv heads {k_cache.shape[2]}")
    return q.shape[1] // k_cache.shape[2]


def _window(sliding_window, tree_size=0) -> int:
    """Validated window as a host int (None -> _NO_WINDOW); a tree needs W >= its node count N."""
    if sliding_window is None:
        return _NO_WINDOW
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
        raise TypeError(f"sliding_window must be an int or None, got {type(sliding_window).__name__}")
    if sliding_window < max(1, tree_size):
        raise ValueError(
            f"sliding_window must be >= {max(1, tree_size)} (1, and the tree size N with a tree "
            f"mask), got {sliding_window}"
        )
    return min(sliding_window, _NO_WINDOW)


def _paged_ref(q, k_cache, v_cache, bt, lens, n, W, scale, tree_mask=None):
    """Reference core: R rows of n queries each over their request's paged KV; fp32 result [R, n, Hq, D].

    q [R, n, Hq, D]; bt [R, width] block-table rows covering each row's length; lens [R] int64 KV lengths, the
    n queries being the last n positions (or tree nodes at prefix + depth, tree_mask [R, n, n]). Gathers whole
    blocks (with a window only the ones that can hold visible keys) and zeroes every gathered row outside
    [lo, L), lo = max(0, L - n - W + 1), so stale values elsewhere in the pool (NaN/inf) never enter, not
    even as 0 * NaN.
    """
    R, _, Hq, D = q.shape
    NB, P, Hkv = k_cache.shape[:3]
    G, width, dev = Hq // Hkv, bt.shape[1], q.device
    # entries past a request's blocks may hold anything: their rows are zeroed
    bt = bt.long().clamp(0, NB - 1)
    if W < _NO_WINDOW:
        lo = (lens - (n + W - 1)).clamp(min=0)
        first = lo // P
        cols = first[:, None] + torch.arange(min(width, -(-(n + W + P - 2) // P)), device=dev)
        bt = bt.gather(1, cols.clamp(max=width - 1))
        keys = first[:, None] * P + torch.arange(bt.shape[1] * P, device=dev)  # [R, S] positions
        dead = (keys < lo[:, None]) | (keys >= lens[:, None])
    else:
        keys = torch.arange(width * P, device=dev)[None]
        dead = keys >= lens[:, None]
    S = keys.shape[1]
    # index_fill_ is far cheaper than masked_fill_
    dead_rows = dead.expand(R, S).flatten().nonzero().squeeze(1)
    k = k_cache.index_select(0, bt.flatten()).view(R * S, -1).float().index_fill_(0, dead_rows, 0.0)
    v = v_cache.index_select(0, bt.flatten()).view(R * S, -1).float().index_fill_(0, dead_rows, 0.0)
    k, v = k.view(R, S, Hkv, D), v.view(R, S, Hkv, D)
    prefix = lens - n
    kk = keys[:, None, :]
    if tree_mask is None:  # causal: key <= position (< seq_len)
        pos = prefix[:, None] + torch.arange(n, device=dev)  # [R, n]
        seen = kk <= pos[..., None]
    else:  # node i sees the prefix plus its tree-mask row; keys >= seq_len read the padded False column n
        j = (kk - prefix[:, None, None]).clamp(0, n).expand(R, n, S)
        seen = (kk < prefix[:, None, None]) | F.pad(tree_mask, (0, 1)).gather(2, j)
        if W < _NO_WINDOW:  # the window measures from node i's position prefix + depth_i
            pos = prefix[:, None] + (tree_mask.sum(-1) - 1).clamp(min=0)
    if W < _NO_WINDOW:
        seen = seen & (pos[..., None] - kk < W)  # [R, n, S]
    bias = (
        torch.where(seen, 0.0, float("-inf"))[:, None, :, None].expand(R, 1, n, G, S).reshape(R, 1, n * G, S)
    )
    qh = q.float().reshape(R, n, Hkv, G, D).transpose(1, 2).reshape(R, Hkv, n * G, D)
    o = F.scaled_dot_product_attention(qh, k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias, scale=scale)
    o = o.view(R, Hkv, n, G, D).transpose(1, 2).reshape(R, n, Hq, D)
    # no visible key: 0 (torch < 2.5 SDPA gives NaN)
    return torch.where(seen.any(-1)[..., None, None], o, 0.0)


# ---- extend / prefill / tree verify ------------------------------------------------------------------------


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
    _check(q, k_cache, v_cache, block_table)
    T, Hq, D = q.shape
    o = torch.zeros_like(q)
    B = cu_seqlens_q.numel() - 1
    if T == 0 or B <= 0:
        return o
    n_tree = 0 if tree_mask is None else tree_mask.shape[-1]
    W = _window(sliding_window, n_tree)
    if tree_mask is not None and (tree_mask.shape != (B, n_tree, n_tree) or T != B * n_tree):
        raise ValueError(f"tree_mask {tuple(tree_mask.shape)} needs shape [B, N, N] with T = B*N ({T} rows)")
    lens, P = seq_lens.long(), k_cache.shape[1]
    n = n_tree or (max_seqlen_q if T == B * max_seqlen_q else 0)
    if n:  # every request has n new tokens: one pass over all of them
        if bool((lens[:B] < n).any()):
            raise ValueError(f"every seq_len must be >= its {n} new tokens, got seq_lens {lens.tolist()}")
        o = _paged_ref(
            q.reshape(B, n, Hq, D), k_cache, v_cache, block_table[:B], lens[:B], n, W, scale, tree_mask
        )
        return o.view(T, Hq, D).to(q.dtype)
    cu, lens_h = cu_seqlens_q.tolist(), seq_lens.tolist()
    for b in range(B):
        n, L = cu[b + 1] - cu[b], lens_h[b]
        if n == 0:
            continue
        if L < n:
            raise ValueError(f"request {b}: seq_len {L} < number of new tokens {n}")
        ob = _paged_ref(
            q[cu[b] : cu[b + 1]][None],
            k_cache,
            v_cache,
            block_table[b : b + 1, : -(-L // P)],
            lens[b : b + 1],
            n,
            W,
            scale,
        )
        o[cu[b] : cu[b + 1]] = ob[0].to(q.dtype)
    return o


@triton.jit
def _load_kv_tile(
    K, V, BT_ROW, offs_n, n_ok, offs_d, d_ok, kvh, stride_kb, stride_kp, stride_kh, PAGE: tl.constexpr
):
    """K^T [D, N] and V [N, D] of key positions ``offs_n`` of one request, through its block-table row."""
    blk = tl.load(BT_ROW + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
    kv_off = blk * stride_kb + (offs_n % PAGE) * stride_kp + kvh * stride_kh
    k = tl.load(K + kv_off[None, :] + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
    v = tl.load(V + kv_off[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    return k, v


@triton.jit
def _dot(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # the interpreter multiplies bf16 as raw uint16 bits (triton#11584): upcast, exact
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PREC)
    return out


# constexprs only a CPU (interpreter) launch sets, with their GPU value (what scripts/kernel_specs.py records)
INTERPRETER_ONLY = {"UPCAST": False}


def _prec(q):
    """(PREC, UPCAST) constexprs: exact fp32 dots for fp32 inputs; bf16 upcast under the CPU interpreter."""
    return {
        "PREC": "ieee" if q.dtype == torch.float32 else "tf32",
        "UPCAST": q.dtype == torch.bfloat16 and q.device.type == "cpu",
    }


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
    b, kvh, mb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
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
        k, v = _load_kv_tile(
            K, V, BT + b * stride_bt, offs_n, n_ok, offs_d, d_ok, kvh, stride_kb, stride_kp, stride_kh, PAGE
        )
        s = _dot(q, k, PREC, UPCAST) * qk_scale
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
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PREC, UPCAST)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        Out + (q0 + qi)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


_tile_smem = 101376  # CPU / interpreter: tiles as if for this GPU (99 KB per block: sm_86, sm_89)


def set_tile_target(smem: int) -> None:
    """Size CPU (interpreter) launches' tiles as for a GPU with ``smem`` bytes of opt-in shared memory per
    block (CUDA launches always use their device's own). Raises ValueError below 48 KB."""
    global _tile_smem
    if isinstance(smem, bool) or not isinstance(smem, int) or smem < 49152:
        raise ValueError(f"smem must be an int >= 49152 bytes, got {smem!r}")
    _tile_smem = smem


@functools.cache
def _device_smem(device) -> int:
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


def _tiles(q, tree=False):
    """(BLOCK_D, BLOCK_N, BLOCK_M cap, num_warps, num_stages) for q's head dim and dtype, sized to the
    shared memory per block (163 KB+: sm_80/90; 99 KB: sm_86/89) and checked by scripts/kernel_specs.py to
    fit and not spill. D is padded to a power of two >= 16 for tl.dot; a key row of a K/V tile takes
    BLOCK_D * itemsize bytes. Exact fp32 dots (no tensor cores) and tree masks cost registers: fewer rows."""
    bd = max(16, triton.next_power_of_2(q.shape[2]))
    row, fp32 = bd * q.element_size(), q.dtype == torch.float32
    big = (_device_smem(q.device) if q.is_cuda else _tile_smem) >= 160 * 1024
    if bd <= 128 and not fp32:  # tensor-core dots
        return (bd, 32, 32, 8, 3) if tree and bd == 128 else (bd, 64, 32 if tree else 64, 4, 3)
    if bd <= 128:
        return bd, 32 if bd <= 64 else 16, 32, 4 if bd <= 64 else 8, 3
    if row <= 1024:  # bf16 D 256 / 512, fp32 D 256: 32-key tiles only for 1 KB rows on 163 KB+
        return bd, 32 if big and row == 1024 else 16, 32, 8, 3
    return bd, 16, 32 if big else 16, 8, 1 if big else 2  # fp32 D 512


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
    G = _check(q, k_cache, v_cache, block_table)
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
    window = _window(sliding_window, 0 if tree_mask is None else n_tree)
    BLOCK_D, BLOCK_N, BLOCK_M, warps, stages = _tiles(q, tree_mask is not None)
    BLOCK_M = min(BLOCK_M, max(16, triton.next_power_of_2(max_seqlen_q * G)))
    BLOCK_M = max(BLOCK_M, triton.next_power_of_2(G))
    qpb = BLOCK_M // G
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
        scale * _LOG2E,
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
        **_prec(q),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_D=BLOCK_D,
        BLOCK_T=triton.next_power_of_2(n_tree),
        num_warps=warps,
        num_stages=stages,
    )
    return o


def extend_attention(
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
    """Attention of B packed requests' new tokens over their paged KV (prefill, chunked prefill, extend,
    verify).

    Args:
        q: [T, Hq, D] queries of B requests packed; request b owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``
            (n_b rows, may be 0).
        k_cache, v_cache: [num_blocks, page_size, Hkv, D], same dtype family as q; Hq % Hkv == 0.
        block_table: [B, W] int32 physical block ids per request.
        cu_seqlens_q: [B+1] int32 prefix sums of n_b.
        seq_lens: [B] int32 total KV length of each request, INCLUDING its n_b new tokens, whose K/V must
            already be stored in the cache. prefix_b = seq_lens[b] - n_b.
        scale: softmax scale (float).
        max_seqlen_q: host int >= max n_b; sizes the launch grid (queries beyond it are not computed).
        tree_mask: None for causal masking, where query i of request b (position prefix_b + i) sees keys
            [0, prefix_b + i]. Or a [B, N, N] bool tree mask (every n_b == N, so T == B*N): query i sees all
            prefix keys plus new key j iff tree_mask[b, i, j] (its ancestors and itself).
        sliding_window: None (full attention) or W >= 1 (HF Gemma 4 sliding layers): a query at position p
            also needs p - j < W for key j. Causal: query i sits at prefix_b + i. Tree: node i sits at
            prefix_b + depth_i, depth_i = (number of True in tree_mask[b, i]) - 1 (at least 0), so a prefix
            key j is visible iff prefix_b + depth_i - j < W; tree keys keep the tree mask (ancestors are
            within W since N <= W).

    Returns:
        o: [T, Hq, D] with q's dtype (fp32 accumulation). A query with no visible key gets zeros.
        T == 0 or B == 0 returns an empty tensor without launching anything.

    Raises:
        ValueError: on inconsistent shapes (ranks, head_dim, Hq not a multiple of Hkv, tree_mask not [B, N, N]
            with T == B*N), max_seqlen_q < 1 with T > 0 (Triton path), seq_len < n_b (reference), or
            sliding_window < 1 (< N with a tree mask).
        TypeError: sliding_window neither None nor an int.
    """
    fn = extend_attention_triton if use_triton(q) else extend_attention_ref
    return fn(
        q,
        k_cache,
        v_cache,
        block_table,
        cu_seqlens_q,
        seq_lens,
        scale,
        max_seqlen_q,
        tree_mask,
        sliding_window=sliding_window,
    )


# ---- decode (split-KV flash-decoding) and frozen-KV draft attention ----------------------------------------


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
    _check(q, k_cache, v_cache, block_table)
    W = _window(sliding_window)
    R = q.shape[0]
    if R == 0 or block_table.shape[1] == 0:
        return torch.zeros_like(q)
    bt, lens = block_table[:R], seq_lens[:R].long()
    if row_to_req is not None:
        bt, lens = block_table[row_to_req.long()], seq_lens.long()[row_to_req.long()]
    if not split_size:
        return _paged_ref(q[:, None], k_cache, v_cache, bt, lens, 1, W, scale)[:, 0].to(q.dtype)
    o, P = torch.zeros_like(q), k_cache.shape[1]
    blocks = -(-(-(-lens // split_size) * split_size) // P)  # a row's key slots: whole splits, whole blocks
    bt = F.pad(bt, (0, max(0, int(blocks.max()) - bt.shape[1])))  # the dummy block 0, its rows zeroed
    for n in blocks.unique().tolist():
        for i in (blocks == n).nonzero().squeeze(1).split(64):  # 64 rows a call bound the gathered K/V
            o[i] = _paged_ref(q[i, None], k_cache, v_cache, bt[i, :n], lens[i], 1, W, scale)[:, 0].to(o.dtype)
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
    r, kvh, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if HAS_MAP:
        req = tl.load(MAP + r)
    else:
        req = r
    seq_len = tl.load(SL + req)
    # sliding window: the splits cover only the visible keys [lo, seq_len)
    lo = tl.maximum(seq_len - WINDOW, 0)
    if SPLIT > 0:  # deterministic mode: split sp is keys [sp * SPLIT, (sp + 1) * SPLIT), whatever the batch
        first, chunk = 0, SPLIT
    else:  # per-row splits of whole tiles
        first, chunk = lo, tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
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
        k, v = _load_kv_tile(
            K, V, BT + req * stride_bt, offs_n, n_ok, offs_d, d_ok, kvh, stride_kb, stride_kp, stride_kh, PAGE
        )
        s = _dot(q, k, PREC, UPCAST) * qk_scale
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # every tile has >= 1 valid key, so m_new is finite
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PREC, UPCAST)
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
    r, h = tl.program_id(0), tl.program_id(1)
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


KV_SPLIT_SIZE = 256  # deterministic mode: keys per KV split for every row of every batch (BLOCK_N divides it)


def num_kv_splits(max_len: int) -> int:
    """Split-KV count for a longest context of ``max_len`` keys (host int): one per 256 keys, in [1, 32]."""
    return min(32, max(1, -(-max_len // 256)))


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
    G = _check(q, k_cache, v_cache, block_table)
    window = _window(sliding_window)
    R, Hq, D = q.shape
    if q.stride(2) != 1:
        q = q.contiguous()
    o = torch.empty(R, Hq, D, dtype=q.dtype, device=q.device)
    if R == 0:
        return o
    if split_size:  # enough fixed-size splits for the block table's keys: a host int, no sync
        num_splits = max(1, -(-block_table.shape[1] * k_cache.shape[1] // split_size))
    elif num_splits is None:  # from the longest context: one host read (a sync on GPU), so callers pass it
        num_splits = num_kv_splits(int(seq_lens.max()))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    BLOCK_D, BLOCK_N, _, warps, stages = _tiles(q)
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
        scale * _LOG2E,
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
        **_prec(q),
        BLOCK_H=max(16, triton.next_power_of_2(G)),
        BLOCK_N=BLOCK_N,
        BLOCK_D=BLOCK_D,
        num_warps=warps,
        num_stages=stages,
    )
    _decode_merge_kernel[(R, Hq)](
        mid_o, mid_l, o, o.stride(0), o.stride(1), Hq, D, num_splits, BLOCK_D=BLOCK_D
    )
    return o


def decode_attention(
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
    """One query token per row attending a request's paged KV (flash-decoding with split KV on the Triton
    path).

    Args:
        q: [R, Hq, D] one query per row.
        k_cache, v_cache: [num_blocks, page_size, Hkv, D]; Hq % Hkv == 0.
        block_table: [B, W] int32.
        seq_lens: [B] int32; row r attends keys [0, seq_lens[req]) of its request (the caller stores the
            current token's K/V first if it should be seen).
        scale: softmax scale (float).
        row_to_req: [R] int32 request of each row (several rows may share one request); None means identity
            (R == B).
        num_splits: KV splits per row (host int >= 1, fixed for CUDA graphs; no host sync then). None picks
            ceil(max seq_len / 256) clipped to [1, 32], which reads seq_lens on the host.
        sliding_window: None (full attention) or W >= 1: the query sits at position seq_len - 1 and sees keys
            [max(0, seq_len - W), seq_len) (HF Gemma 4 sliding layers); the splits divide only those keys.
        split_size: None, or deterministic mode (``KV_SPLIT_SIZE``): a row's result is bitwise a function of
            its own query and keys, whatever the batch. Triton: split s holds keys [s * split_size, (s + 1) *
            split_size), ``num_splits`` is ignored (the block table's width sets the launch), splits merge in
            order. Torch: each row attends exactly ceil(seq_len / split_size) * split_size key slots (rows
            grouped by that count), so its SDPA call has one shape whatever the batch.

    Returns:
        o: [R, Hq, D] with q's dtype; rows whose request has seq_len 0 are zeros. R == 0 returns an empty
        tensor without launching anything.

    Raises:
        ValueError: on inconsistent shapes, num_splits < 1 or sliding_window < 1.
        TypeError: sliding_window neither None nor an int.
    """
    fn = decode_attention_triton if use_triton(q) else decode_attention_ref
    return fn(
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        scale,
        row_to_req,
        num_splits,
        sliding_window=sliding_window,
        split_size=split_size,
    )


def draft_attention(
    q, k_cache, v_cache, block_table, seq_lens, row_to_req, scale=1.0, num_splits=None, *, sliding_window=None
):
    """Frozen-KV MTP draft attention: Q-only draft queries over the target's committed KV, read-only.

    R = B*k single-token query rows (k = topk); row r attends rows [0, L) of request ``row_to_req[r]`` in the
    mapped target layer's cache, L = ``seq_lens[req]`` (the committed length; nothing is appended during a
    draft). This is :func:`decode_attention` with a row->request map; it never writes k_cache/v_cache by
    construction (no store into the cache exists on either path). ``scale`` defaults to 1.0 (Gemma assistant:
    q is RMS-normed).

    ``sliding_window=W`` (an assistant sliding layer, W = its text config's ``sliding_window``): the row sees
    the last W + 1 committed rows, [max(0, L - W - 1), L). This follows HF
    ``Gemma4AssistantForCausalLM.create_attention_masks``: ``create_bidirectional_sliding_window_mask`` keeps
    kv index k of the single query (index 0) iff |0 - k| <= W, then flips the kv axis, so the last W + 1
    shared KV rows stay visible (one more than a target sliding layer's W). HF's rows are the target's
    post-verify KV cut to ``len(input_ids)``, which after a rejected draft also holds stale candidate rows;
    here exactly the committed rows are read. Computed as decode attention with window W + 1.

    Shapes, dtypes, results and errors are those of :func:`decode_attention`: q [R, Hq, D] -> o [R, Hq, D].
    """
    window = None if sliding_window is None else _window(sliding_window) + 1
    return decode_attention(
        q, k_cache, v_cache, block_table, seq_lens, scale, row_to_req, num_splits, sliding_window=window
    )
