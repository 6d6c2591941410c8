"""Sampling as greedy over position-keyed Gumbel noise: one token per row, no noise tensor, no host sync.

The token a row produces is ``argmax_v (logits[v] / T + g(seed, t, v))`` over the vocabulary kept by top-k and
top-p, where ``t`` is the absolute position of the token being produced and ``g`` is standard Gumbel noise
drawn from a counter-based generator: Philox4x32-10 keyed by the request's ``seed``, counter ``(v, t, 0, 0)``
(exactly Triton's ``tl.rand(seed, (t << 32) | v)``), turned into ``-log(-log(u))``. By the Gumbel-max trick
this is one sample from the filtered softmax, and it is a pure function of (seed, t, logits): speculation, the
draft length, the batch and the schedule cannot change it. ``temperature <= 0`` is greedy: the argmax of the
raw logits (lowest index on ties), no noise.

Filtering follows vLLM / HF (``TemperatureLogitsWarper`` -> ``TopKLogitsWarper`` -> ``TopPLogitsWarper``):
keep the ``top_k`` largest scaled logits, then the smallest set of most likely tokens whose renormalised mass
reaches ``top_p`` (the token that crosses ``top_p`` is kept). ``top_k <= 0`` or ``>= V`` and ``top_p >= 1``
disable them. A packed allowed-token ``bitmask`` (structured output: int32 ``[R, ceil(V / 32)]``, bit
``v & 31`` of word ``v >> 5`` set when token v is allowed) sets the logits of the other tokens to ``-inf``
first, so greedy, sampled and filtered rows all see the masked distribution; the kernel tests the bits as
it loads the logits. ``mask_logits`` (greedy rows, draft rows, logprobs) unpacks the bits into a ``[R, V]``
mask instead.

The reference sorts each sampled row. The Triton kernel (one program per row) never holds a row in registers:
it streams the vocabulary in BLOCK chunks: a max / argmax / sum-exp pass, then two bisections (<= 32
counting passes each) over the order-preserving int32 image of the fp32 scaled logits, which find the exact
top-k value and top-p crossing value, then a final pass that draws the noise and takes the argmax. Ties: where
several tokens share the threshold value, the Triton path keeps all of them while the sort-based reference
keeps exactly ``top_k`` (in sort order); the results agree whenever logits are tie-free. Rows of all ``-inf``
or with NaN logits are unsupported.
"""

import torch
import triton
import triton.language as tl

from .backend import last_dim_contiguous, use_triton

_BLOCK = 4096  # vocabulary chunk per pass (tests lower it to exercise chunking under the interpreter)

# Philox4x32 constants and tl.rand's uint32 -> [0, 1) scale (triton/language/random.py)
_KEY_A = 0x9E3779B9
_KEY_B = 0xBB67AE85
_ROUND_A = 0xD2511F53
_ROUND_B = 0xCD9E8D57
_MASK32 = 0xFFFFFFFF
_UNIFORM_SCALE = 4.6566127342e-10


# ------------------------------------------------------------------------------------------- torch reference
def _mul_hi_lo(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of ``a * b`` for uint32 values held in int64: int64 products wrap modulo
    2**64, so their 64 bits are exactly the unsigned product's."""
    product = a * b
    return (product >> 32) & _MASK32, product & _MASK32


def philox_uniform(seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Uniform [0, 1) fp32 noise, bit for bit what ``tl.rand(seed, (position << 32) | token_id)`` gives.

    Args broadcast together: ``seeds`` int64 in [0, 2**63), ``positions`` int64 in [0, 2**31), ``token_ids``
    int64 in [0, 2**32). Philox4x32-10 (Salmon et al., 2011) as Triton's ``philox``: key (seed low, seed
    high), counter (token_id, position, 0, 0); the first output word, mapped as ``uint_to_uniform_float``.
    """
    k0 = seeds & _MASK32
    k1 = (seeds >> 32) & _MASK32
    c0 = token_ids & _MASK32
    c1 = positions & _MASK32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    for _ in range(10):
        high_b, low_b = _mul_hi_lo(c2, _ROUND_B)
        high_a, low_a = _mul_hi_lo(c0, _ROUND_A)
        c0 = high_b ^ c1 ^ k0
        c1 = low_b
        c2 = high_a ^ c3 ^ k1
        c3 = low_a
        k0 = (k0 + _KEY_A) & _MASK32
        k1 = (k1 + _KEY_B) & _MASK32
    as_int31 = torch.where(c0 >= 2**31, _MASK32 - c0, c0)  # int32 bitcast, then ~x for negatives
    return as_int31.float() * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32, device=c0.device)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise ``g(seed, t, v) = -log(-log(u))`` fp32, u from :func:`philox_uniform` (the same
    broadcasting arguments). u = 0 gives -inf (that token never wins); u < 1 always, so g is finite above."""
    return -torch.log(-torch.log(philox_uniform(seeds, positions, token_ids)))


# the largest value gumbel_noise can take (u's largest value is 1 - 2**-24): a token whose scaled logit is
# more than this below the best score found so far cannot win
_GUMBEL_MAX = float(-torch.log(-torch.log(torch.tensor(2**31 - 1).float() * torch.tensor(_UNIFORM_SCALE))))


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor | None, token_ids=None) -> torch.Tensor:
    """``logits`` [R, V] with the tokens ``bitmask`` [R, W] int32 does not allow set to ``-inf`` (a copy;
    ``logits`` itself when ``bitmask`` is None). ``token_ids`` [R, V] int64: the token id of each column
    (None: column v is token v)."""
    if bitmask is None:
        return logits
    if token_ids is None:  # column v is token v: unpack the words' bits in order
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((bitmask[:, :, None] >> shifts) & 1).flatten(1)[:, : logits.shape[1]]
    else:
        allowed = (bitmask.gather(1, token_ids >> 5) >> (token_ids & 31)) & 1
    return logits.masked_fill(allowed == 0, float("-inf"))


def sample_ref(logits, temperature, top_k, top_p, seeds, positions, token_ids=None, bitmask=None):
    """Torch reference of :func:`sample` (the engine's CPU path).

    Sampled rows draw noise only for the tokens that can still win: ``g <= G`` (the noise's largest value)
    for every token, so a token whose scaled logit z falls more than G below the score z + g of the row's
    most likely token is out of the race. Those tokens lead the descending order of z, so the top-k /
    top-p filter (a prefix of that order too) is computed on that prefix alone, its mass normalised by the
    whole vocabulary's (or the top-k's) sum, exactly as a full sort would. Each row then draws noise for
    its own kept tokens in its race only (a row the grammar forces draws one). When no row filters (top-k
    and top-p off: the API defaults), nothing is sorted: each row's best score in its race wins.
    """
    R, V = _check(logits, temperature, top_k, top_p, seeds, positions, token_ids, bitmask)
    logits = mask_logits(logits, bitmask, token_ids)
    column = logits.argmax(-1)
    rows = (temperature > 0).nonzero().flatten()
    if rows.numel() > 0:
        ids = None if token_ids is None else token_ids[rows]
        params = (temperature[rows], top_k[rows], top_p[rows], seeds[rows], positions[rows])
        column = column.index_copy(0, rows, _sample_rows(logits[rows], *params, ids))
    if token_ids is None:
        return column
    return token_ids.gather(1, column[:, None]).squeeze(1)


def _sample_rows(logits, temperature, top_k, top_p, seeds, positions, token_ids):
    """The sampled rows of :func:`sample_ref`: each one's winning column [R] int64."""
    R, V = logits.shape
    z = logits.float() / temperature.float()[:, None]
    ids = torch.arange(V, device=z.device).expand(R, V) if token_ids is None else token_ids
    best = z.argmax(-1, keepdim=True)
    g_best = gumbel_noise(seeds[:, None], positions[:, None], ids.gather(1, best))
    in_race = z + _GUMBEL_MAX >= z.gather(1, best) + g_best
    k = top_k.long()
    k_on = (k > 0) & (k < V)
    if not (k_on.any() or (top_p < 1).any()):  # no filter: the best score in the race wins, nothing sorted
        row, col = in_race.nonzero(as_tuple=True)
        g = gumbel_noise(seeds[row], positions[row], ids[row, col])
        return torch.full_like(z, float("-inf")).index_put_((row, col), z[row, col] + g).argmax(-1)
    n = int(max(in_race.sum(-1).max(), torch.where(k_on, k, 0).max()))
    zs, order = z.topk(n, dim=-1)  # descending: the race's tokens first
    top = zs[:, :1]
    mass = (z - top).exp().sum(-1, keepdim=True)  # the whole vocabulary's (k off)
    rank = torch.arange(n, device=z.device)[None]
    top_k_mass = torch.where(rank < k[:, None], (zs - top).exp(), 0.0).sum(-1, keepdim=True)
    mass = torch.where(k_on[:, None], top_k_mass, mass)
    probs = (zs - top).exp() / mass
    p = top_p.float()[:, None]
    drop = (rank >= torch.where(k_on, k, V)[:, None]) | (((probs.cumsum(-1) - probs) >= p) & (p < 1))
    # noise for the kept tokens still in the race only (each row's own prefix): a token out of the race
    # scores below the row's most likely token, which is always kept
    draw = ~drop & (zs + _GUMBEL_MAX >= top + g_best)
    row, col = draw.nonzero(as_tuple=True)
    g = gumbel_noise(seeds[row], positions[row], ids.gather(1, order)[row, col])
    score = torch.full_like(zs, float("-inf")).index_put_((row, col), zs[row, col] + g)
    return order.gather(1, score.argmax(-1, keepdim=True)).squeeze(1)


# ------------------------------------------------------------------------------------------------ Triton
@triton.jit
def _key(z):
    """Order-preserving map of fp32 values to int32 (monotone for all non-NaN floats)."""
    b = z.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def _chunk(lrow, irow, brow, off, V, t, HAS_IDS: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    idx = off + tl.arange(0, BLOCK)
    mask = idx < V
    x = tl.load(lrow + idx, mask=mask, other=float("-inf")).to(tl.float32)
    if HAS_MASK:  # structured output: a token the bitmask does not allow has logit -inf
        token = idx
        if HAS_IDS:
            token = tl.load(irow + idx, mask=mask, other=0)
        word = tl.load(brow + (token >> 5), mask=mask, other=0)
        x = tl.where(((word >> (token & 31)) & 1) != 0, x, float("-inf"))
    z = x / t
    return idx, mask, x, z, _key(z)


@triton.jit
def _sampling_kernel(
    logits_ptr,
    temp_ptr,
    topk_ptr,
    topp_ptr,
    seed_ptr,
    pos_ptr,
    ids_ptr,
    bitmask_ptr,
    out_ptr,
    V,
    s_l,
    s_i,
    s_b,
    HAS_IDS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    lrow = logits_ptr + row * s_l
    irow = ids_ptr + row * s_i
    brow = bitmask_ptr + row * s_b
    temp = tl.load(temp_ptr + row).to(tl.float32)
    k = tl.load(topk_ptr + row).to(tl.int32)
    p = tl.load(topp_ptr + row).to(tl.float32)
    t = tl.where(temp <= 0, 1.0, temp)

    # pass 1: max / first argmax of the raw logits; max, min and online sum of exp(z - max z) of the
    # scaled ones
    m = float("-inf")
    arg = 0
    mz = float("-inf")
    mnz = float("inf")
    s = 0.0
    for off in range(0, V, BLOCK):
        idx, mask, x, z, kz = _chunk(lrow, irow, brow, off, V, t, HAS_IDS, HAS_MASK, BLOCK)
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
                idx, mask, x, z, kz = _chunk(lrow, irow, brow, off, V, t, HAS_IDS, HAS_MASK, BLOCK)
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
                idx, mask, x, z, kz = _chunk(lrow, irow, brow, off, V, t, HAS_IDS, HAS_MASK, BLOCK)
                ms += tl.sum(tl.where(mask & (kz >= mid), tl.exp(z - mz), 0.0), axis=0)
            ok = ms >= target
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
            mass = tl.where(ok, ms, mass)
        thr = lo

    # final pass: the argmax of z + Gumbel noise over the kept tokens (greedy rows keep the raw argmax)
    best = float("-inf")
    best_i = arg
    if temp > 0:
        seed = tl.load(seed_ptr + row)
        position = tl.load(pos_ptr + row).to(tl.int64)
        for off in range(0, V, BLOCK):
            idx, mask, x, z, kz = _chunk(lrow, irow, brow, off, V, t, HAS_IDS, HAS_MASK, BLOCK)
            if HAS_IDS:
                token = tl.load(irow + idx, mask=mask, other=0).to(tl.int64)
            else:
                token = idx.to(tl.int64)
            u = tl.rand(seed, (position << 32) | token)
            score = tl.where(mask & (kz >= thr), z - tl.log(-tl.log(u)), float("-inf"))
            cb = tl.max(score, axis=0)
            ci = tl.min(tl.where(score == cb, idx, V), axis=0)
            best_i = tl.where(cb > best, ci, best_i)
            best = tl.maximum(best, cb)
    if HAS_IDS:  # the winning column's token id
        best_i = tl.load(irow + best_i)
    tl.store(out_ptr + row, best_i.to(tl.int64))


def sample_triton(logits, temperature, top_k, top_p, seeds, positions, token_ids=None, bitmask=None):
    """Triton implementation of :func:`sample` (one program per row, chunked vocabulary passes)."""
    R, V = _check(logits, temperature, top_k, top_p, seeds, positions, token_ids, bitmask)
    out = torch.empty((R,), dtype=torch.int64, device=logits.device)
    if R == 0:
        return out
    lg = last_dim_contiguous(logits)
    ids = lg if token_ids is None else token_ids.contiguous()
    words = out if bitmask is None else bitmask.contiguous()
    _sampling_kernel[(R,)](
        lg,
        temperature.contiguous(),
        top_k.contiguous(),
        top_p.contiguous(),
        seeds.contiguous(),
        positions.contiguous(),
        ids,
        words,
        out,
        V,
        lg.stride(0),
        ids.stride(0),
        words.stride(0),
        HAS_IDS=token_ids is not None,
        HAS_MASK=bitmask is not None,
        BLOCK=min(triton.next_power_of_2(V), _BLOCK),
        num_warps=8,
    )
    return out


def _check(logits, temperature, top_k, top_p, seeds, positions, token_ids, bitmask):
    if logits.dim() != 2:
        raise ValueError(f"sampling: logits must be [R, V], got {tuple(logits.shape)}")
    R, V = logits.shape
    rows = (("temperature", temperature), ("top_k", top_k), ("top_p", top_p))
    for name, x in (*rows, ("seeds", seeds), ("positions", positions)):
        if x.shape != (R,):
            raise ValueError(f"sampling: {name} shape {tuple(x.shape)} != ({R},)")
    if token_ids is not None and token_ids.shape != (R, V):
        raise ValueError(f"sampling: token_ids shape {tuple(token_ids.shape)} != ({R}, {V})")
    if bitmask is not None and (bitmask.dim() != 2 or bitmask.shape[0] != R or bitmask.dtype != torch.int32):
        raise ValueError(
            f"sampling: bitmask must be int32 [{R}, W], got {bitmask.dtype} {tuple(bitmask.shape)}"
        )
    return R, V


# ------------------------------------------------------------------------------------------------ public op
def sample(logits, temperature, top_k, top_p, seeds, positions, token_ids=None, bitmask=None):
    """One token per row: ``argmax(logits / T + g(seed, t, v))`` over the top-k / top-p kept tokens.

    Args:
        logits: ``[R, V]`` float logits (any float dtype).
        temperature: ``[R]`` fp32; ``<= 0`` means greedy (the argmax of the raw logits, no noise).
        top_k: ``[R]`` int32; ``<= 0`` or ``>= V`` disables it.
        top_p: ``[R]`` fp32 in (0, 1]; 1 disables it.
        seeds: ``[R]`` int64 in [0, 2**63): each row's request seed.
        positions: ``[R]`` int64: the absolute position of the token each row produces.
        token_ids: optional ``[R, V]`` int64: the token id of each column (a drafter's candidate set);
            None: column v is token v.
        bitmask: optional ``[R, W]`` int32, W >= ceil(max token id + 1 / 32): the tokens each row may
            produce (structured output); every row must allow at least one of its columns.

    Returns:
        ``[R]`` int64 token ids; ``R == 0`` launches nothing.

    Raises:
        ValueError: when a shape does not match ``logits``.
    """
    fn = sample_triton if use_triton(logits) else sample_ref
    return fn(logits, temperature, top_k, top_p, seeds, positions, token_ids, bitmask)
