"""The engine's GEMMs besides ``F.linear`` itself: the fp32 GEMM of a few rows on a CPU, and the
batch-invariant matmul of deterministic mode.

**A few rows on a CPU** (:func:`linear`, which every GEMM of the engine goes through). ``F.linear(x, w)`` with
a row-major ``w`` [N, K] and a few rows of ``x`` hands MKL's fp32 GEMM a wide product whose small-m kernel
reads the weight about once per row: the GEMMs of a SmolLM2-135M forward (its 30 layers and the LM head, one
thread, weights out of cache) measured 34-36 ms at 1 row, 58-67 ms at 2, 82-87 ms at 3, 44-57 ms at 4 (its
kernel choice steps with the row count). The same product taken the other way round, ``(w @ x.t()).t()``
with ``x`` contiguous (so ``x.t()`` is column-major) and an even row count, streams the weight once: 25-27 ms
at 1 or 2 rows, 30-33 ms at 4, 56-57 ms at 6; past 6 rows it is no faster than ``F.linear``. (Column-major
weights, kept here before, gave 25 ms at 1 row but 41-48 ms at 2.) A verify step of s + 1 <= 4 rows then
costs about what a decode row costs (6 rows about twice), which is what lets speculation pay on a CPU. CUDA
and other dtypes go to ``F.linear`` untouched.

**oneDNN weights on a CPU** (:func:`to_onednn`, ``linear``'s ``onednn_weight``). From 3 rows on, oneDNN's GEMM
on a copy of the weight that oneDNN has reordered once into its own blocked layout (``torch.ops.mkldnn``, what
torch.compile's CPU freezing uses) beats both products above. The same SmolLM2-135M GEMMs, in ms (this way /
the transposed product / ``F.linear``; ``OMP_NUM_THREADS=1 python scripts/cpu_gemm.py``, best of 5): 3 rows
37 / 56 / 104, 4 rows 35 / 56 / 64, 6 rows 35 / 75 / 73, 8 rows 45 / 76 / 74, 16 rows 58 / 97 / 95, 64 rows
171 / 229 / 227. At 1 or 2 rows it is slower than the transposed product (44 vs 33 ms at 1 row, 50 vs 33 at
2), which keeps them. ``parallel.use_onednn_weights`` gives every target GEMM such a copy (the weights then
take twice their memory); a step of 3 rows or more (plain decode of 3+ requests, every verify step, every
prefill) goes through it.

**Batch-invariant** (:func:`linear_invariant`): each output row is bitwise a function of its own input row,
whatever the number of rows M (the other rows, a batch of 1 or of 256, one decode row or N verify rows).
Triton: one kernel with one fixed tile config, no split-K: every output tile accumulates its K tiles in the
same order, and a GPU's tensor-core dot treats every row of a tile alike, so a row goes through the same
instruction sequence for every M (Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025).
Under the CPU interpreter ``tl.dot`` is a BLAS call whose results depend on a row's slot in the tile
(OpenBLAS: slots 0-5 and 6-11 differ), so there the kernel sums products over K in order instead.
Torch (the CPU path): one :func:`linear` call per row (fp32: the row twice, ``(w @ rows.t()).t()``). MKL and
oneDNN pick their kernel by shape (fp32 here: one result for M < 4, another for M >= 4) and need not treat a
tile's rows alike, so each row is multiplied alone, the same call for every row.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .attention_common import dot_precision
from .backend import use_triton

FEW_ROWS = 6  # the most rows that take the transposed product (measured above)
ONEDNN_FROM_ROWS = 3  # with a oneDNN weight, the fewest rows that go through it (measured above)
ONEDNN_ROWS = 8  # the row count oneDNN lays its weight out for
_TILES = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=64)  # one config for every M; narrow N: more programs


def to_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's reordered copy of ``weight`` [N, K] for :func:`linear`'s ``onednn_weight`` (an opaque
    tensor of the same size), or None unless ``weight`` is fp32 on a CPU with oneDNN (module docstring)."""
    cpu_fp32 = weight.device.type == "cpu" and weight.dtype == torch.float32
    if not cpu_fp32 or not torch.backends.mkldnn.is_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ONEDNN_ROWS)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, onednn_weight=None):
    """``F.linear(x, weight, bias)`` (x [..., K], weight [N, K], bias [N] or None -> [..., N], x's dtype),
    equal to it to fp32 rounding. With ``onednn_weight`` (:func:`to_onednn`'s copy of ``weight``) an ``x``
    of at least ``ONEDNN_FROM_ROWS`` rows goes through oneDNN's GEMM on that copy; otherwise an fp32 CPU
    ``x`` of at most ``FEW_ROWS`` rows is computed as ``(weight @ x.t()).t()`` over an even number of rows
    (the last row repeated). Module docstring: why."""
    rows = x.reshape(-1, x.shape[-1])
    m = len(rows)
    if onednn_weight is not None and m >= ONEDNN_FROM_ROWS:
        out = torch.ops.mkldnn._linear_pointwise(rows, onednn_weight, bias, "none", [], "")
        return out.view(*x.shape[:-1], -1)
    if x.device.type != "cpu" or x.dtype != torch.float32 or not 0 < m <= FEW_ROWS:
        return F.linear(x, weight, bias)
    if m % 2:
        rows = torch.cat([rows, rows[-1:]])
    out = (weight @ rows.contiguous().t()).t()[:m].contiguous()
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], -1)


@triton.jit
def _matmul_kernel(
    X,
    W,
    B,
    Y,
    M,
    N,
    K,
    sxm,
    sxk,
    swn,
    swk,
    sym,
    HAS_BIAS: tl.constexpr,
    PREC: tl.constexpr,
    ROWWISE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + rk < K
        x = tl.load(
            X + rm[:, None].to(tl.int64) * sxm + (k0 + rk)[None, :] * sxk,
            mask=(rm < M)[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            W + rn[None, :].to(tl.int64) * swn + (k0 + rk)[:, None] * swk,
            mask=k_ok[:, None] & (rn < N)[None, :],
            other=0.0,
        )
        if ROWWISE:  # the CPU interpreter (module docstring): products summed over K in order
            acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], 1)
        else:
            acc += tl.dot(x, w, input_precision=PREC)
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        Y + rm[:, None].to(tl.int64) * sym + rn[None, :],
        acc.to(Y.dtype.element_ty),
        mask=(rm < M)[:, None] & (rn < N)[None, :],
    )


def linear_invariant_ref(x2, weight, bias=None):
    """Torch path of :func:`linear_invariant` for x2 [M, K]: one :func:`linear` call per row (fp32 on a CPU:
    the row twice through ``weight @ rows.t()``, which reads a row-major weight once; else ``F.linear``)."""
    if len(x2) == 0:
        return F.linear(x2, weight, bias)
    return torch.cat([linear(row, weight, bias) for row in x2.split(1)])


def linear_invariant_triton(x2, weight, bias=None):
    """Triton path of :func:`linear_invariant` for x2 [M, K] (fixed tiles ``_TILES``, fp32 accumulation)."""
    M, K = x2.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    if M:
        grid = (triton.cdiv(M, _TILES["BLOCK_M"]), triton.cdiv(N, _TILES["BLOCK_N"]))
        _matmul_kernel[grid](
            x2,
            weight,
            weight if bias is None else bias,
            y,
            M,
            N,
            K,
            *x2.stride(),
            *weight.stride(),
            y.stride(0),
            HAS_BIAS=bias is not None,
            PREC=dot_precision(x2)["PREC"],
            ROWWISE=x2.device.type == "cpu",
            **_TILES,
            num_warps=4,
        )
    return y


def linear_invariant(x, weight, bias=None):
    """``F.linear(x, weight, bias)`` whose rows are bitwise independent of the other rows (module docstring).

    x: [..., K] float; weight: [N, K] (any strides); bias: [N]
    or None. Returns [..., N] in x's dtype (fp32 accumulation). Raises ValueError on mismatched shapes.
    """
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1] or bias is not None and len(bias) != len(weight):
        raise ValueError(
            f"linear_invariant: x [..., K], weight [N, K], bias [N]; got {tuple(x.shape)}, "
            f"{tuple(weight.shape)}, {None if bias is None else tuple(bias.shape)}"
        )
    fn = linear_invariant_triton if use_triton(x) else linear_invariant_ref
    return fn(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], -1)
