"""Batched temperature / top-k / top-p sampling with per-row parameters and no host sync.

Semantics (vLLM / HF ``TemperatureLogitsWarper`` → ``TopKLogitsWarper`` → ``TopPLogitsWarper``): scale the
logits by ``1 / temperature``; keep the ``top_k`` largest; of those keep the smallest set of most likely
tokens whose renormalised mass reaches ``top_p`` (the token that crosses ``top_p`` is kept, so at least one
token survives); renormalise. ``temperature <= 0`` is greedy: a one-hot at the argmax of the logits (lowest
index on ties). ``top_k <= 0`` or ``>= V`` disables top-k; ``top_p >= 1`` disables top-p.

Sampling uses the exponential race (Gumbel-max): ``argmax(probs / E)`` with ``E = -log(noise)``, where
``noise`` is caller-supplied uniform (0, 1) — per-request seeds live in the caller's generators.

The references sort each row. The Triton kernels (one program per row) never hold a row in registers: they
stream the vocabulary in BLOCK chunks — a max / argmax / sum-exp pass, then two bisections (≤ 32 counting
passes each) over the order-preserving int32 image of the fp32 scaled logits, which find the exact top-k value
and top-p crossing value, then a final pass that writes probabilities or takes the race argmax. Ties: where
several tokens share the threshold value, the Triton path keeps all of them while the sort-based reference
keeps exactly ``top_k`` (in sort order); the results agree whenever logits are tie-free. Rows of all ``-inf``
or with NaN logits are unsupported.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import use_triton

_BLOCK = 4096  # vocabulary chunk per pass (tests lower it to exercise chunking under the interpreter)


# --------------------------------------------------------------------------------------------- torch
# reference
def filtered_probs_ref(logits, temperature, top_k, top_p):
    """Torch reference of :func:`filtered_probs` (sort based)."""
    R, V = _check(logits, temperature, top_k, top_p)
    x = logits.float()
    greedy = temperature <= 0
    z = x / torch.where(greedy, torch.ones_like(temperature), temperature).float()[:, None]
    zs, order = z.sort(dim=-1, descending=True)
    k = top_k.long()
    k = torch.where((k <= 0) | (k >= V), torch.full_like(k, V), k)
    drop = torch.arange(V, device=x.device)[None, :] >= k[:, None]
    ps = zs.masked_fill(drop, float("-inf")).softmax(-1)
    p = top_p.float()[:, None]
    drop |= ((ps.cumsum(-1) - ps) >= p) & (p < 1)  # mass strictly above a token already reaches top_p
    ps = zs.masked_fill(drop, float("-inf")).softmax(-1)
    probs = torch.zeros_like(ps).scatter_(1, order, ps)
    onehot = F.one_hot(x.argmax(-1), V).float() if R else probs
    return torch.where(greedy[:, None], onehot, probs)


def sample_ref(logits, temperature, top_k, top_p, noise):
    """Torch reference of :func:`sample`."""
    _check(logits, temperature, top_k, top_p, noise)
    probs = filtered_probs_ref(logits, temperature, top_k, top_p)
    tok = (probs / (-noise.float().log())).argmax(-1)
    return torch.where(temperature <= 0, logits.argmax(-1), tok)


def greedy(logits):
    """Argmax over the last dim as int64 (lowest index on ties)."""
    return logits.argmax(-1)


# ------------------------------------------------------------------------------------------------------
# Triton
@triton.jit
def _key(z):
    """Order-preserving map of fp32 values to int32 (monotone for all non-NaN floats)."""
    b = z.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def _chunk(lrow, off, V, t, BLOCK: tl.constexpr):
    idx = off + tl.arange(0, BLOCK)
    mask = idx < V
    x = tl.load(lrow + idx, mask=mask, other=float("-inf")).to(tl.float32)
    z = x / t
    return idx, mask, x, z, _key(z)


@triton.jit
def _sampling_kernel(
    logits_ptr,
    temp_ptr,
    topk_ptr,
    topp_ptr,
    noise_ptr,
    out_ptr,
    V,
    s_l,
    s_n,
    s_o,
    SAMPLE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    lrow = logits_ptr + row * s_l
    temp = tl.load(temp_ptr + row).to(tl.float32)
    k = tl.load(topk_ptr + row).to(tl.int32)
    p = tl.load(topp_ptr + row).to(tl.float32)
    is_greedy = temp <= 0
    t = tl.where(is_greedy, 1.0, temp)

    # pass 1: max / first argmax of the raw logits; max, min and online sum of exp(z - max z) of the scaled
    # ones
    m = float("-inf")
    arg = 0
    mz = float("-inf")
    mnz = float("inf")
    s = 0.0
    for off in range(0, V, BLOCK):
        idx, mask, x, z, kz = _chunk(lrow, off, V, t, BLOCK)
        cm = tl.max(x, axis=0)
        arg = tl.where(cm > m, tl.min(tl.where(mask & (x == cm), idx, V), axis=0), arg)
        m = tl.maximum(m, cm)
        mz_new = tl.maximum(mz, tl.max(z, axis=0))
        s = s * tl.where(mz_new == mz, 1.0, tl.exp(mz - mz_new))
        s += tl.sum(tl.where(mask & (z > float("-inf")), tl.exp(z - mz_new), 0.0), axis=0)
        mz = mz_new
        mnz = tl.minimum(mnz, tl.min(tl.where(mask, z, float("inf")), axis=0))
    top = _key(mz).to(tl.int64) + 1  # no token has a key >= top
    thr = _key(mnz).to(tl.int64)  # every token has a key >= thr
    mass = s  # sum of exp(z - mz) over the kept tokens (key >= thr)

    # top-k: the largest key with count(key >= thr) >= k, by bisection (invariant: lo passes, hi fails)
    if (temp > 0) & (k > 0) & (k < V):
        lo = thr
        hi = top
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            cnt = 0
            ms = 0.0
            for off in range(0, V, BLOCK):
                idx, mask, x, z, kz = _chunk(lrow, off, V, t, BLOCK)
                sel = mask & (kz >= mid)
                cnt += tl.sum(sel.to(tl.int32), axis=0)
                ms += tl.sum(tl.where(sel, tl.exp(z - mz), 0.0), axis=0)
            ok = cnt >= k
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
            mass = tl.where(ok, ms, mass)
        thr = lo

    # top-p: the largest key whose mass(key >= it) still reaches top_p of the top-k mass
    if (temp > 0) & (p < 1.0):
        target = p * mass
        lo = thr
        hi = top
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            ms = 0.0
            for off in range(0, V, BLOCK):
                idx, mask, x, z, kz = _chunk(lrow, off, V, t, BLOCK)
                ms += tl.sum(tl.where(mask & (kz >= mid), tl.exp(z - mz), 0.0), axis=0)
            ok = ms >= target
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
            mass = tl.where(ok, ms, mass)
        thr = lo

    # final pass: the exponential race, or the normalised probabilities
    if SAMPLE:
        best = -1.0
        best_i = arg
        if temp > 0:
            nrow = noise_ptr + row * s_n
            for off in range(0, V, BLOCK):
                idx, mask, x, z, kz = _chunk(lrow, off, V, t, BLOCK)
                u = tl.load(nrow + idx, mask=mask, other=0.5)
                score = tl.where(mask & (kz >= thr), (tl.exp(z - mz) / mass) / (-tl.log(u)), -1.0)
                cb = tl.max(score, axis=0)
                ci = tl.min(tl.where(score == cb, idx, V), axis=0)
                best_i = tl.where(cb > best, ci, best_i)
                best = tl.maximum(best, cb)
        tl.store(out_ptr + row, best_i.to(tl.int64))
    else:
        orow = out_ptr + row * s_o
        for off in range(0, V, BLOCK):
            idx, mask, x, z, kz = _chunk(lrow, off, V, t, BLOCK)
            pr = tl.where(kz >= thr, tl.exp(z - mz) / mass, 0.0)
            pr = tl.where(is_greedy, tl.where(idx == arg, 1.0, 0.0), pr)
            tl.store(orow + idx, pr, mask=mask)


def _check(logits, temperature, top_k, top_p, noise=None):
    if logits.dim() != 2:
        raise ValueError(f"sampling: logits must be [R, V], got {tuple(logits.shape)}")
    R, V = logits.shape
    for name, x in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        if x.shape != (R,):
            raise ValueError(f"sampling: {name} shape {tuple(x.shape)} != ({R},)")
    if noise is not None and noise.shape != (R, V):
        raise ValueError(f"sampling: noise shape {tuple(noise.shape)} != ({R}, {V})")
    return R, V


def _launch(logits, temperature, top_k, top_p, noise, out, sample):
    R, V = logits.shape
    if R == 0:
        return out
    lg = logits if logits.stride(-1) == 1 else logits.contiguous()
    nz = lg if noise is None else (noise if noise.stride(-1) == 1 else noise.contiguous())
    _sampling_kernel[(R,)](
        lg,
        temperature.contiguous(),
        top_k.contiguous(),
        top_p.contiguous(),
        nz,
        out,
        V,
        lg.stride(0),
        nz.stride(0),
        out.stride(0),
        SAMPLE=sample,
        BLOCK=min(triton.next_power_of_2(V), _BLOCK),
        num_warps=8,
    )
    return out


def filtered_probs_triton(logits, temperature, top_k, top_p):
    """Triton implementation of :func:`filtered_probs` (one program per row, chunked vocabulary passes)."""
    R, V = _check(logits, temperature, top_k, top_p)
    out = torch.empty((R, V), dtype=torch.float32, device=logits.device)
    return _launch(logits, temperature, top_k, top_p, None, out, False)


def sample_triton(logits, temperature, top_k, top_p, noise):
    """Triton implementation of :func:`sample`: the filtering passes fused with the race argmax."""
    R, V = _check(logits, temperature, top_k, top_p, noise)
    out = torch.empty((R,), dtype=torch.int64, device=logits.device)
    return _launch(logits, temperature, top_k, top_p, noise, out, True)


# ------------------------------------------------------------------------------------------------ public ops
def filtered_probs(logits, temperature, top_k, top_p):
    """The sampling distribution after temperature, top-k and top-p (see the module docstring).

    Args:
        logits: ``[R, V]`` float logits (any float dtype).
        temperature: ``[R]`` fp32; ``<= 0`` means greedy (one-hot at the argmax).
        top_k: ``[R]`` int32; ``<= 0`` or ``>= V`` disables it.
        top_p: ``[R]`` fp32 in (0, 1]; 1 disables it.

    Returns:
        ``[R, V]`` fp32 probabilities, each row summing to 1.

    Raises:
        ValueError: when the parameter shapes do not match ``logits``.
    """
    fn = filtered_probs_triton if use_triton(logits) else filtered_probs_ref
    return fn(logits, temperature, top_k, top_p)


def sample(logits, temperature, top_k, top_p, noise):
    """One token per row from :func:`filtered_probs`, by the race ``argmax(probs / -log(noise))``.

    ``noise`` is ``[R, V]`` fp32 uniform in (0, 1), drawn by the caller. Greedy rows return the argmax of the
    logits. Returns ``[R]`` int64; ``R == 0`` launches nothing. Raises ValueError on mismatched shapes.
    """
    fn = sample_triton if use_triton(logits) else sample_ref
    return fn(logits, temperature, top_k, top_p, noise)
