"""Centroid ("ordered embeddings") LM head: logits of the tokens of the selected clusters only, a gather-GEMV.

The LM-head rows are stored once in cluster order, ``rows [C, S, H]`` (cluster c owns the S = V / C contiguous
rows ``rows[c]``), so each selected cluster is one contiguous [S, H] slice. For query row r and its j-th
selected cluster ``c = clusters[r, j]``: ``out[r, j * S + s] = hidden[r] . rows[c, s]``, accumulated in fp32.
Matches the candidate logits of HF ``Gemma4AssistantMaskedEmbedder.forward`` (before its scatter into the
vocabulary).
"""

import torch
import triton
import triton.language as tl

from .backend import last_dim_contiguous, use_triton


def _check(hidden, rows, clusters):
    if hidden.dim() != 2 or rows.dim() != 3 or clusters.dim() != 2 or clusters.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"centroid_logits: expected hidden [R, H], rows [C, S, H], clusters [R, K]; got "
            f"{tuple(hidden.shape)}, {tuple(rows.shape)}, {tuple(clusters.shape)}"
        )
    if rows.shape[2] != hidden.shape[1]:
        raise ValueError(
            f"centroid_logits: rows hidden size {rows.shape[2]} != hidden size {hidden.shape[1]}"
        )
    if clusters.is_floating_point():
        raise TypeError(f"centroid_logits: clusters must be an integer tensor, got {clusters.dtype}")


def centroid_logits_ref(hidden, rows, clusters):
    """Torch reference of :func:`centroid_logits` (same signature and result)."""
    _check(hidden, rows, clusters)
    R, K = clusters.shape
    # one row per cluster: a 2-D index_select (measured 3.5x faster on CPU than indexing the 3-D rows)
    picked = rows.flatten(1).index_select(0, clusters.long().flatten()).float()
    picked = picked.view(R, K * rows.shape[1], rows.shape[2])  # [R, K*S, H]
    return torch.bmm(picked, hidden.float()[:, :, None])[:, :, 0]


@triton.jit
def _centroid_kernel(
    X,
    W,
    CL,
    Out,
    H,
    S,
    stride_xr,
    stride_wc,
    stride_ws,
    stride_cr,
    stride_or,
    BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # One program: query row r, its j-th selected cluster, BLOCK_S of that cluster's S rows.
    r = tl.program_id(0)
    j = tl.program_id(1)
    sb = tl.program_id(2)
    c = tl.load(CL + r * stride_cr + j).to(tl.int64)
    offs_s = sb * BLOCK_S + tl.arange(0, BLOCK_S)
    s_ok = offs_s < S
    acc = tl.zeros([BLOCK_S], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs_h < H
        x = tl.load(X + r * stride_xr + offs_h, mask=h_ok, other=0.0).to(tl.float32)
        w = tl.load(
            W + c * stride_wc + offs_s[:, None] * stride_ws + offs_h[None, :],
            mask=s_ok[:, None] & h_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(w * x[None, :], 1)
    tl.store(Out + r * stride_or + j * S + offs_s, acc, mask=s_ok)


def centroid_logits_triton(hidden, rows, clusters):
    """Triton path of :func:`centroid_logits` (same signature and result)."""
    _check(hidden, rows, clusters)
    R, K = clusters.shape
    _, S, H = rows.shape
    out = torch.empty(R, K * S, dtype=torch.float32, device=hidden.device)
    if out.numel() == 0:
        return out
    hidden = last_dim_contiguous(hidden)
    rows = last_dim_contiguous(rows)
    BLOCK_S = min(64, triton.next_power_of_2(S))
    _centroid_kernel[(R, K, triton.cdiv(S, BLOCK_S))](
        hidden,
        rows,
        clusters,
        out,
        H,
        S,
        hidden.stride(0),
        rows.stride(0),
        rows.stride(1),
        clusters.stride(0),
        out.stride(0),
        BLOCK_S=BLOCK_S,
        BLOCK_H=min(128, triton.next_power_of_2(H)),
        num_warps=4,
    )
    return out


def centroid_logits(hidden, rows, clusters):
    """Logits of the tokens of each row's selected clusters.

    Args:
        hidden: [R, H] float, the drafter's final-normed hidden states.
        rows: [C, S, H] float, the LM-head rows in cluster order (last dim contiguous on the Triton path).
        clusters: [R, K] integer, selected cluster ids in [0, C) (not range-checked: that would sync).

    Returns:
        [R, K * S] fp32: entry ``j * S + s`` is the logit of row ``s`` of cluster ``clusters[r, j]``. R == 0
        or K == 0 returns an empty tensor without launching anything.

    Raises:
        ValueError on inconsistent ranks or sizes; TypeError for floating-point ``clusters``.
    """
    fn = centroid_logits_triton if use_triton(hidden) else centroid_logits_ref
    return fn(hidden, rows, clusters)
