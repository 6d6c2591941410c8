"""Paged attention, the three ops the models call: :func:`extend_attention` (prefill, chunked prefill, extend,
chain and tree verify), :func:`decode_attention` (one query per row, split-KV flash decoding) and
:func:`draft_attention` (Frozen-KV MTP draft queries over the target's KV, read-only).

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
once). Where the code is: attention_extend.py and attention_decode.py (each op's reference and kernels),
attention_common.py (the shape checks, the torch core both references share, the Triton K/V tile loader, the
tile policy).
"""

from .attention_common import set_tile_target, window_size
from .attention_decode import KV_SPLIT_SIZE, decode_attention_ref, decode_attention_triton, num_kv_splits
from .attention_extend import extend_attention_ref, extend_attention_triton
from .backend import use_triton

__all__ = [
    "KV_SPLIT_SIZE",
    "decode_attention",
    "decode_attention_ref",
    "decode_attention_triton",
    "draft_attention",
    "extend_attention",
    "extend_attention_ref",
    "extend_attention_triton",
    "num_kv_splits",
    "set_tile_target",
]


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
    window = None if sliding_window is None else window_size(sliding_window) + 1
    return decode_attention(
        q, k_cache, v_cache, block_table, seq_lens, scale, row_to_req, num_splits, sliding_window=window
    )
