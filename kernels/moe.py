"""Fused mixture of experts (Gemma 4 26B-A4B's routed experts): the router's top-k and the experts' two
grouped GEMMs as Triton kernels, each op with a torch reference of the same signature (the CPU path and the
test oracle).

How a fused MoE runs (the scheme of vLLM's and SGLang's ``fused_moe``), for T tokens, E experts of
intermediate size I, hidden size H, top-k routing:

1. **Route** (:func:`moe_route`, one program per token): fp32 softmax over the token's E router scores, the k
   most probable experts (the lowest index first among equal probabilities), their probabilities
   renormalised to sum 1, times ``per_expert_scale`` (HF ``Gemma4TextRouter``).
2. **Align** (``_align``, torch ops): the T*k (token, slot) pairs, numbered ``p = token * k + slot``, are
   sorted by expert (stable: token order within an expert), and each expert's run is padded to a multiple of
   BLOCK_M with the sentinel ``P = T*k``. Every BLOCK_M-row block then holds pairs of one expert only, so a
   block is a plain dense GEMM against that expert's weights. The buffers have the worst case's size
   (``P + min(E, P) * (BLOCK_M - 1)`` rows), never the data's: nothing waits for the host, and a CUDA graph
   captures decode and prefill alike. Grid rows past the used blocks return at once.
3. **Gate|up GEMM** (one launch): a program takes one block (expert e) and BLOCK_N columns of I, gathers its
   pairs' token rows of x, multiplies them by the gate rows and the up rows of ``w13[e]`` ([2I, H]) in two
   accumulators, and stores ``gelu_tanh(gate) * up`` to row p of the intermediate [P, I].
4. **Down GEMM** (one launch): the same blocks over ``w2[e]`` ([H, I]); each row is multiplied by its
   routing weight and stored to row p of [P, H].
5. **Combine**: a token's k rows summed in fp32, in slot order.

Numerics follow the unfused path (HF ``Gemma4TextExperts``: linear, activation, linear, times the weight):
gate, up and down are rounded to x's dtype as a GEMM's output would be, the activation and the weighting run
in fp32. Tiles (``_tiles``) depend only on the token count and the dtype: decode-sized batches (T <= E, few
tokens per expert) take 16-row blocks, prefill 64-row ones.
"""

import torch
import triton
import triton.language as tl

from .backend import last_dim_contiguous, use_triton


@triton.jit
def _route_kernel(
    Scores,
    Scale,
    TopW,
    TopIds,
    E,
    stride_s,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    s = tl.load(Scores + t * stride_s + e, mask=e < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(s - tl.max(s, 0))
    p = tl.where(e < E, p / tl.sum(p, 0), -1.0)  # padding lanes below any probability: never picked
    slot = tl.arange(0, BLOCK_K)
    top_p = tl.zeros([BLOCK_K], tl.float32)
    top_i = tl.zeros([BLOCK_K], tl.int32)
    for j in tl.static_range(TOP_K):
        best, i = tl.max(p, 0, return_indices=True, return_indices_tie_break_left=True)
        top_p = tl.where(slot == j, best, top_p)
        top_i = tl.where(slot == j, i, top_i)
        p = tl.where(e == i, -1.0, p)  # taken
    top_p = top_p / tl.sum(top_p, 0)
    scale = tl.load(Scale + top_i, mask=slot < TOP_K, other=0.0).to(tl.float32)
    tl.store(TopW + t * TOP_K + slot, top_p * scale, mask=slot < TOP_K)
    tl.store(TopIds + t * TOP_K + slot, top_i, mask=slot < TOP_K)


@triton.jit
def _moe_gemm_kernel(
    A,
    W,
    Out,
    RouteW,
    SortedPairs,
    BlockExpert,
    NumPadded,
    num_pairs,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    PAIRS_PER_ROW: tl.constexpr,
    GATED: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # One program: block pid_m of the aligned pairs (all routed to one expert) x BLOCK_N output columns.
    # A has a row per token (PAIRS_PER_ROW = k: x) or per pair (1: the intermediate). GATED: W is gate|up
    # [E, 2N, K], the output gelu_tanh(gate) * up; else W is [E, N, K], the output times the routing weight.
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(NumPadded):
        return  # past the last expert's padded run: the grid is sized for the worst case
    expert = tl.load(BlockExpert + pid_m).to(tl.int64)
    pairs = tl.load(SortedPairs + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    live = pairs < num_pairs  # padding rows hold the sentinel num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = A + (pairs // PAIRS_PER_ROW).to(tl.int64)[:, None] * stride_am + ks[None, :]
    w_ptrs = W + expert * stride_we + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None]  # [K, N] tile
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + ks < K
        a = tl.load(a_ptrs + k0, mask=live[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=k_ok[:, None] & (cols < N)[None, :], other=0.0)
        if UPCAST:  # the interpreter multiplies bf16 as raw bits (triton#11584): upcast, exact
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PREC)
        if GATED:  # the up rows sit N rows below the gate rows
            w = tl.load(w_ptrs + N * stride_wn + k0, mask=k_ok[:, None] & (cols < N)[None, :], other=0.0)
            if UPCAST:
                w = w.to(tl.float32)
            up = tl.dot(a, w, up, input_precision=PREC)
    acc = acc.to(Out.dtype.element_ty).to(tl.float32)  # a GEMM's output dtype, as the unfused path
    if GATED:
        # gelu_tanh(g) = 0.5·g·(1 + tanh(y)) = g·sigmoid(2y), y = sqrt(2/π)·(g + 0.044715·g³)
        y2 = 1.5957691216057308 * (acc + 0.044715 * acc * acc * acc)
        acc = acc / (1.0 + tl.exp(-y2)) * up.to(Out.dtype.element_ty).to(tl.float32)
    else:
        acc = acc * tl.load(RouteW + pairs, mask=live, other=0.0)[:, None]
    out_ptrs = Out + pairs.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=live[:, None] & (cols < N)[None, :])


# constexprs only a CPU (interpreter) launch sets, with their GPU value (what scripts/kernel_specs.py records)
INTERPRETER_ONLY = {"UPCAST": False}


def _check_route(scores, per_expert_scale, top_k):
    if scores.dim() != 2 or per_expert_scale.shape != (scores.shape[1],):
        raise ValueError(
            f"moe_route: scores [T, E] and per_expert_scale [E], got {tuple(scores.shape)}, "
            f"{tuple(per_expert_scale.shape)}"
        )
    if not 1 <= top_k <= scores.shape[1]:
        raise ValueError(f"moe_route: top_k must be in [1, {scores.shape[1]}] (the experts), got {top_k}")


def moe_route_ref(scores, per_expert_scale, top_k):
    """Torch reference of :func:`moe_route` (a stable sort: the lowest index first among ties)."""
    _check_route(scores, per_expert_scale, top_k)
    probs, ids = torch.softmax(scores.float(), -1).sort(dim=-1, descending=True, stable=True)
    top = probs[:, :top_k]
    ids = ids[:, :top_k]
    return top / top.sum(-1, keepdim=True) * per_expert_scale.float()[ids], ids.int()


def moe_route_triton(scores, per_expert_scale, top_k):
    """Triton path of :func:`moe_route`: one program per token."""
    _check_route(scores, per_expert_scale, top_k)
    T, E = scores.shape
    weights = torch.empty(T, top_k, dtype=torch.float32, device=scores.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=scores.device)
    if T:
        scores = last_dim_contiguous(scores)
        _route_kernel[(T,)](
            scores,
            per_expert_scale,
            weights,
            ids,
            E,
            scores.stride(0),
            TOP_K=top_k,
            BLOCK_E=triton.next_power_of_2(E),
            BLOCK_K=triton.next_power_of_2(top_k),
            num_warps=1 if E <= 256 else 4,
        )
    return weights, ids


def moe_route(scores, per_expert_scale, top_k):
    """Expert choice per token, as HF ``Gemma4TextRouter`` after its projection.

    scores: [T, E] router logits (any float dtype); per_expert_scale: [E]. Returns (weights [T, top_k] fp32,
    expert ids [T, top_k] int32): softmax in fp32 over all E, the top_k most probable in descending order
    (the lowest index first among equal probabilities), renormalised to sum 1, times
    ``per_expert_scale[id]``. ValueError on mismatched shapes or top_k outside [1, E].
    """
    fn = moe_route_triton if use_triton(scores) else moe_route_ref
    return fn(scores, per_expert_scale, top_k)


def _check_moe(x, w13, w2, topk_weights, topk_ids):
    E, two_i, H = w13.shape
    ok = x.dim() == 2 and x.shape[1] == H and w2.shape == (E, H, two_i // 2) and two_i % 2 == 0
    if not ok or topk_ids.shape != topk_weights.shape or topk_ids.shape[:1] != x.shape[:1]:
        raise ValueError(
            "fused_moe: x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights and topk_ids [T, k]; got "
            f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}, {tuple(topk_weights.shape)}, "
            f"{tuple(topk_ids.shape)}"
        )


def fused_moe_ref(x, w13, w2, topk_weights, topk_ids):
    """Torch reference of :func:`fused_moe`: the pairs grouped by expert, one GEMM pair per expert that
    received any (the group sizes are read on the host: the CPU path)."""
    _check_moe(x, w13, w2, topk_weights, topk_ids)
    T, k = topk_ids.shape
    flat = topk_ids.flatten().long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    out = torch.zeros(T * k, x.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        pairs = order[start : start + n]
        start += n
        if n:
            gate, up = torch.nn.functional.linear(x[pairs // k], w13[e]).float().chunk(2, -1)
            h = (torch.nn.functional.gelu(gate, approximate="tanh") * up).to(x.dtype)
            y = torch.nn.functional.linear(h, w2[e]).float() * topk_weights.flatten()[pairs, None]
            out[pairs] = y.to(x.dtype)
    return out.view(T, k, -1).sum(1, dtype=torch.float32).to(x.dtype)


def _tiles(num_tokens, num_experts, dtype):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): 16-row blocks while a batch has at most one token
    per expert on average (decode, verify), 64-row ones beyond; exact fp32 dots (no tensor cores) take
    smaller tiles. Checked by scripts/kernel_specs.py to fit every arch and not spill."""
    small = num_tokens <= num_experts
    if dtype == torch.float32:
        return (16, 32, 32, 4, 2) if small else (32, 32, 32, 4, 2)
    return (16, 64, 64, 4, 3) if small else (64, 64, 32, 4, 3)


def _align(topk_ids, num_experts, block_m):
    """Pairs sorted by expert, each expert's run padded to a multiple of ``block_m`` (module docstring, step
    2). Returns (sorted_pairs [max_padded] int32 with the sentinel P = T*k on padding rows, block_expert
    [max_padded / block_m] int32, num_padded [1] int32: the rows in use); torch ops only, no host sync."""
    flat = topk_ids.flatten().long()
    P = flat.numel()
    dev = flat.device
    num_blocks = triton.cdiv(P + min(num_experts, P) * (block_m - 1), block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    # the i-th pair in sorted order is the (i - pairs of lower experts)-th of its expert
    rows = (ends - padded)[expert] + torch.arange(P, device=dev) - (counts.cumsum(0) - counts)[expert]
    sorted_pairs = torch.full((num_blocks * block_m,), P, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, rows, order.int())
    block_start = torch.arange(num_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(ends, block_start, right=True).int()  # E past the used blocks
    return sorted_pairs, block_expert, ends[-1:].int()


def _grouped_gemm(a, w, out, routing, align, pairs_per_row, tiles):
    """One ``_moe_gemm_kernel`` launch: ``out[p] = act(a[p // pairs_per_row] @ w[e].T)`` for every aligned
    pair p of expert e; gate|up with the activation when ``w`` has twice ``out``'s columns, else times the
    routing weight."""
    N = out.shape[1]
    K = a.shape[1]
    grid = (len(align[1]), triton.cdiv(N, tiles["BLOCK_N"]))
    _moe_gemm_kernel[grid](
        a,
        w,
        out,
        routing,
        *align,
        N,
        K,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        PAIRS_PER_ROW=pairs_per_row,
        GATED=w.shape[1] == 2 * N,
        PREC="ieee" if a.dtype == torch.float32 else "tf32",
        UPCAST=a.dtype == torch.bfloat16 and a.device.type == "cpu",
        **tiles,
    )


def fused_moe_triton(x, w13, w2, topk_weights, topk_ids):
    """Triton path of :func:`fused_moe`: align, then one launch per GEMM (module docstring)."""
    _check_moe(x, w13, w2, topk_weights, topk_ids)
    T, k = topk_ids.shape
    E, two_i, H = w13.shape
    if T == 0:
        return x.new_zeros(0, H)
    x = last_dim_contiguous(x)
    tiles = dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"), _tiles(T, E, x.dtype)))
    align = (*_align(topk_ids, E, tiles["BLOCK_M"]), T * k)
    routing = topk_weights.float().contiguous()
    inter = torch.empty(T * k, two_i // 2, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, inter, routing, align, k, tiles)
    out = torch.empty(T * k, H, dtype=x.dtype, device=x.device)
    _grouped_gemm(inter, w2, out, routing, align, 1, tiles)
    return out.view(T, k, H).sum(1, dtype=torch.float32).to(x.dtype)


def fused_moe(x, w13, w2, topk_weights, topk_ids):
    """The routed experts' output, as HF ``Gemma4TextExperts``: for each token t and slot j with expert e =
    ``topk_ids[t, j]``, ``topk_weights[t, j] * w2[e] @ (gelu_tanh(gate) * up)`` with ``gate | up = w13[e] @
    x[t]``, summed over j in fp32.

    x: [T, H]; w13: [E, 2I, H] (gate rows then up rows; contiguous in H); w2: [E, H, I] (contiguous in I);
    topk_weights: [T, k] float; topk_ids: [T, k] int in [0, E). Returns [T, H] in x's dtype. Under tensor
    parallelism w13 and w2 hold this rank's share of I and the result is a partial sum. ValueError on
    mismatched shapes.
    """
    fn = fused_moe_triton if use_triton(x) else fused_moe_ref
    return fn(x, w13, w2, topk_weights, topk_ids)
