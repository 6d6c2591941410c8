"""Sampling: the position-keyed Gumbel argmax. Triton (interpreter) == torch reference == a brute-force race
over the whole vocabulary; the noise is tl.rand's Philox bit for bit; samples follow HF's warped softmax."""

import math

import pytest
import torch
import triton
import triton.language as tl

from nanospec.kernels import sampling

# rows: sampling-off, greedy, top-k only, top-p only, both, k >= V (off), k = 1, tight top_p,
# T = 0 with filters
TEMP = [1.0, 0.0, 0.7, 1.3, 0.9, 1.0, 2.0, 0.5, 0.0]
TOPK = [0, 5, 50, 0, 200, 100000, 1, -1, 3]
TOPP = [1.0, 0.9, 1.0, 0.8, 0.6, 0.95, 1.0, 0.05, 0.5]


def params(device=None):  # None: the default device (CUDA under NANOSPEC_TEST_DEVICE=cuda)
    return (
        torch.tensor(TEMP, device=device),
        torch.tensor(TOPK, dtype=torch.int32, device=device),
        torch.tensor(TOPP, device=device),
    )


def keys(R, seed=0):
    seeds = torch.arange(R, dtype=torch.int64) * 1_000_003 + seed + 2**62
    positions = torch.arange(R, dtype=torch.int64) * 17 + 5
    return seeds, positions


@pytest.fixture
def small_block(monkeypatch):
    """Several vocabulary chunks per pass (the last one partial) at interpreter-friendly sizes."""
    monkeypatch.setattr(sampling, "_BLOCK", 1024)


@triton.jit
def _rand_kernel(seed_ptr, pos_ptr, ids_ptr, out_ptr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    idx = tl.arange(0, BLOCK)
    token = tl.load(ids_ptr + row * BLOCK + idx).to(tl.int64)
    position = tl.load(pos_ptr + row).to(tl.int64)
    u = tl.rand(tl.load(seed_ptr + row), (position << 32) | token)
    tl.store(out_ptr + row * BLOCK + idx, u)


def test_philox_uniform_is_tl_rand(triton_backend):
    """The torch reference's noise is bit for bit Triton's tl.rand at offset (position << 32) | token id, over
    seeds up to 2**63 - 1, positions up to 2**31 - 1 and token ids up to 2**32 - 1."""
    seeds = torch.tensor([0, 1, 2**32 + 5, 2**62 + 12345, 2**63 - 1], dtype=torch.int64)
    positions = torch.tensor([0, 7, 2**31 - 1, 100, 4096], dtype=torch.int64)
    ids = torch.randint(0, 2**32, (5, 64), generator=torch.Generator().manual_seed(0))
    ids[:, 0] = 0
    ids[0, 1] = 2**32 - 1
    got = torch.empty(5, 64)
    _rand_kernel[(5,)](seeds, positions, ids, got, BLOCK=64)
    want = sampling.philox_uniform(seeds[:, None], positions[:, None], ids)
    assert torch.equal(got, want)
    assert 0 <= float(want.min()) and float(want.max()) < 1
    g = sampling.gumbel_noise(seeds[:, None], positions[:, None], ids)
    assert float(g.max()) <= sampling._GUMBEL_MAX


def brute_force(logits, temp, top_k, top_p, seeds, positions):
    """The definition: argmax of z + g over HF's kept set, noise drawn for every token."""
    R, V = logits.shape
    out = logits.argmax(-1)
    for r in range(R):
        if temp[r] <= 0:
            continue
        z = logits[r].float() / temp[r]
        zs, order = z.sort(descending=True)
        k = int(top_k[r]) if 0 < int(top_k[r]) < V else V
        drop = torch.arange(V) >= k
        ps = zs.masked_fill(drop, float("-inf")).softmax(-1)
        drop |= ((ps.cumsum(-1) - ps) >= top_p[r]) & (top_p[r] < 1)
        kept = torch.zeros(V, dtype=torch.bool).scatter(0, order, ~drop)
        g = sampling.gumbel_noise(seeds[r], positions[r], torch.arange(V))
        out[r] = torch.where(kept, z + g, float("-inf")).argmax()
    return out


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])
def test_sample_ref_equals_the_whole_vocabulary_race(scale):
    """The reference draws noise only for tokens still in the race (a flat row: all of them; a peaked one:
    few) and filters on that prefix alone: the same tokens as the definition, over 4 seeds per row."""
    torch.manual_seed(int(scale))
    logits = torch.randn(len(TEMP), 3000) * scale
    for seed in range(4):
        s, p = keys(len(TEMP), seed)
        got = sampling.sample_ref(logits, *params(), s, p)
        assert torch.equal(got, brute_force(logits, *params(), s, p))
        # no row filters: the race's best score is taken without sorting
        temp, top_k, top_p = params()
        unfiltered = (temp, torch.where(top_k < 100000, 0, top_k), torch.ones_like(top_p))
        got = sampling.sample_ref(logits, *unfiltered, s, p)
        assert torch.equal(got, brute_force(logits, *unfiltered, s, p))


def test_sample_triton_equals_ref(small_block, triton_backend):
    torch.manual_seed(2)
    logits = torch.randn(len(TEMP), 2500) * 2
    for seed in range(2):
        s, p = keys(len(TEMP), seed)
        got = sampling.sample_triton(logits, *params(), s, p)
        want = sampling.sample_ref(logits, *params(), s, p)
        assert got.dtype == torch.int64 and torch.equal(got, want)
        unfiltered = (params()[0], torch.zeros(len(TEMP), dtype=torch.int32), torch.ones(len(TEMP)))
        got = sampling.sample_triton(logits, *unfiltered, s, p)
        assert torch.equal(got, sampling.sample_ref(logits, *unfiltered, s, p))
        greedy_rows = torch.tensor(TEMP) == 0
        assert torch.equal(got[greedy_rows], logits.argmax(-1)[greedy_rows])


def test_sample_over_a_candidate_set(small_block, triton_backend):
    """``token_ids``: column j is token ids[r, j] (a drafter's candidates); the noise is that token's, so the
    result equals sampling the full vocabulary with every other token at -inf."""
    torch.manual_seed(4)
    V, M = 3000, 40
    ids = torch.stack([torch.randperm(V)[:M] for _ in TEMP])
    cand = torch.randn(len(TEMP), M) * 2
    full = torch.full((len(TEMP), V), float("-inf")).scatter(1, ids, cand)
    s, p = keys(len(TEMP), 1)
    want = sampling.sample_ref(full, *params(), s, p)
    assert torch.equal(sampling.sample_ref(cand, *params(), s, p, ids), want)
    assert torch.equal(sampling.sample_triton(cand, *params(), s, p, ids), want)


def random_bitmask(R, V, keep, gen):
    """An int32 [R, ceil(V / 32)] bitmask allowing each token with probability ``keep`` (at least one)."""
    allowed = torch.rand(R, V, generator=gen) < keep
    allowed[:, 7] = True
    padded = torch.zeros(R, -(-V // 32) * 32, dtype=torch.int64)
    padded[:, :V] = allowed.long()
    words = (padded.view(R, -1, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).int(), allowed


@pytest.mark.parametrize("keep", [0.002, 0.3, 0.9])
def test_bitmask_is_sampling_with_the_other_tokens_at_minus_inf(keep, small_block, triton_backend):
    """Structured output: a packed bitmask (bit v & 31 of word v >> 5) gives the token that sampling logits
    with every disallowed token at -inf gives: greedy, top-k, top-p and sampled rows, Triton == reference,
    over the full vocabulary and over a candidate set."""
    gen = torch.Generator().manual_seed(int(keep * 1000))
    V, M = 2500, 300
    logits = torch.randn(len(TEMP), V, generator=gen) * 2
    bitmask, allowed = random_bitmask(len(TEMP), V, keep, gen)
    masked = logits.masked_fill(~allowed, float("-inf"))
    assert torch.equal(sampling.mask_logits(logits, bitmask), masked)
    for seed in range(2):
        s, p = keys(len(TEMP), seed)
        want = sampling.sample_ref(masked, *params(), s, p)
        assert allowed.gather(1, want[:, None]).all()
        assert torch.equal(sampling.sample_ref(logits, *params(), s, p, bitmask=bitmask), want)
        assert torch.equal(sampling.sample_triton(logits, *params(), s, p, bitmask=bitmask), want)
    ids = torch.stack(
        [torch.cat([torch.tensor([7]), torch.randperm(V, generator=gen)[: M - 1] + V]) % V for _ in TEMP]
    )
    cand = logits.gather(1, ids)
    want = sampling.sample_ref(masked.gather(1, ids), *params(), s, p, ids)
    assert torch.equal(sampling.sample_ref(cand, *params(), s, p, ids, bitmask), want)
    assert torch.equal(sampling.sample_triton(cand, *params(), s, p, ids, bitmask), want)


def test_greedy_ties_lowest_index_and_triton_tie_rule(triton_backend):
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, -1.0]])
    s, p = keys(1)
    z = torch.zeros(1)
    off = torch.zeros(1, dtype=torch.int32)
    assert sampling.sample_triton(logits, z, off, torch.ones(1), s, p) == 1
    assert sampling.sample_ref(logits, z, off, torch.ones(1), s, p) == 1
    # documented: at a tied top-k threshold the Triton path keeps every tied token
    one = torch.ones(1, dtype=torch.int32)
    picked = set()
    for i in range(30):
        picked.add(int(sampling.sample_triton(logits, torch.ones(1), one, torch.ones(1), *keys(1, i))))
    assert picked == {1, 2, 4}


def test_empty_and_dispatch(triton_backend):
    e = torch.empty(0, 10)
    args = (torch.empty(0), torch.empty(0, dtype=torch.int32), torch.empty(0))
    k0 = (torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
    assert sampling.sample(e, *args, *k0).shape == (0,)
    assert sampling.sample_ref(e, *args, *k0).shape == (0,)
    two = [x[:2] for x in params()]
    with pytest.raises(ValueError, match="seeds"):
        sampling.sample(torch.randn(2, 10), *two, *keys(3))
    with pytest.raises(ValueError, match="token_ids"):
        sampling.sample(torch.randn(2, 10), *two, *keys(2), torch.zeros(2, 9).long())
    with pytest.raises(ValueError, match="bitmask"):
        sampling.sample(torch.randn(2, 10), *two, *keys(2), bitmask=torch.zeros(2, 1))


def _hf_probs(logits, temp, top_k, top_p):
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    x = TemperatureLogitsWarper(temp)(None, logits.float()[None])
    if 0 < top_k < x.shape[-1]:
        x = TopKLogitsWarper(top_k)(None, x)
    if top_p < 1:
        x = TopPLogitsWarper(top_p)(None, x)
    return x.softmax(-1)[0].double()


# chi-square critical values at p = 0.001 for 1..7 degrees of freedom (used when scipy is absent)
_CHI2_CRIT_001 = [10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322]


def _chi2_ok(observed, expected):
    keep = expected > 0
    stat = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    df = int(keep.sum()) - 1
    try:
        from scipy.stats import chi2
    except ImportError:
        return stat < _CHI2_CRIT_001[df - 1], stat
    return chi2.sf(stat, df) > 1e-3, stat


@pytest.mark.parametrize(
    "backend,t,k,p",
    [
        ("torch", 1.0, 0, 1.0),
        ("torch", 0.8, 6, 0.9),
        ("torch", 1.5, 0, 0.7),
        ("triton", 1.0, 0, 1.0),  # the filters' passes are checked against the reference above
    ],
)
def test_samples_follow_the_warped_softmax(backend, t, k, p):
    """One seed, many positions (the noise a request meets along its tokens): token frequencies match HF's
    temperature / top-k / top-p softmax (chi-square), and no filtered token is ever drawn."""
    from nanospec.kernels.backend import using_backend

    n = 20000 if backend == "torch" else 1500  # the interpreter runs one program per row
    row = torch.tensor([2.0, 1.5, 1.0, 0.7, 0.3, 0.0, -0.5, -1.0])
    V = len(row)
    seeds = torch.full((n,), 12345, dtype=torch.int64)
    positions = torch.arange(n, dtype=torch.int64) + 1000
    temp = torch.full((n,), t)
    top_k = torch.full((n,), k, dtype=torch.int32)
    top_p = torch.full((n,), p)
    with using_backend(backend):
        tokens = sampling.sample(row.expand(n, V), temp, top_k, top_p, seeds, positions)
    probs = _hf_probs(row, t, k, p)
    counts = torch.bincount(tokens, minlength=V).double()
    assert counts[probs == 0].sum() == 0
    ok, stat = _chi2_ok(counts, probs * n)
    assert ok, f"chi-square {stat:.2f}: counts {counts.tolist()} vs expected {(probs * n).tolist()}"
    assert math.isclose(float(probs.sum()), 1.0, abs_tol=1e-6)
