"""Sampling: Triton (interpreter) vs sort-based reference vs HF logits warpers, plus a distribution test."""

import math

import pytest
import torch

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


@pytest.fixture
def small_block(monkeypatch):
    """Several vocabulary chunks per pass (the last one partial) at interpreter-friendly sizes."""
    monkeypatch.setattr(sampling, "_BLOCK", 1024)


@pytest.mark.parametrize("V,dtype", [(3000, torch.float32), (1000, torch.bfloat16)])
def test_filtered_probs_triton_vs_ref(small_block, V, dtype):
    torch.manual_seed(0)
    # distinct values: keep the logits tie-free in bf16 too
    pool = (torch.randn(20 * V) * 3).to(dtype).unique()
    logits = torch.stack([pool[torch.randperm(len(pool))[:V]] for _ in TEMP])
    got = sampling.filtered_probs_triton(logits, *params())
    want = sampling.filtered_probs_ref(logits, *params())
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got > 0, want > 0)  # identical kept sets
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(got.sum(-1), torch.ones(len(TEMP)), atol=1e-5, rtol=0)
    assert (got[1] > 0).sum() == 1 and got[1, logits[1].float().argmax()] == 1  # greedy row is one-hot


def _hf_probs(logits, temp, top_k, top_p):
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    rows = []
    for x, t, k, p in zip(logits.float(), temp.tolist(), top_k.tolist(), top_p.tolist()):
        x = x[None]
        if t == 0:
            rows.append(torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).float()[0])
            continue
        x = TemperatureLogitsWarper(t)(None, x)
        if 0 < k < x.shape[-1]:
            x = TopKLogitsWarper(k)(None, x)
        if p < 1:
            x = TopPLogitsWarper(p)(None, x)
        rows.append(x.softmax(-1)[0])
    return torch.stack(rows)


def test_filtered_probs_ref_matches_hf_warpers():
    torch.manual_seed(1)
    logits = torch.randn(len(TEMP), 4000) * 2
    want = _hf_probs(logits, *params())
    got = sampling.filtered_probs_ref(logits, *params())
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_sample_triton_equals_ref(small_block):
    torch.manual_seed(2)
    logits = torch.randn(len(TEMP), 2500) * 2
    temp, top_k, top_p = params()
    for _ in range(2):
        noise = torch.rand(logits.shape).clamp_(1e-7, 1 - 1e-7)
        got = sampling.sample_triton(logits, temp, top_k, top_p, noise)
        want = sampling.sample_ref(logits, temp, top_k, top_p, noise)
        assert got.dtype == torch.int64 and torch.equal(got, want)
        greedy_rows = temp == 0
        assert torch.equal(got[greedy_rows], sampling.greedy(logits)[greedy_rows])
        probs = sampling.filtered_probs_ref(logits, temp, top_k, top_p)
        assert bool((probs.gather(1, got[:, None]) > 0).all())  # never a filtered-out token


def test_greedy_ties_lowest_index_and_triton_tie_rule():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, -1.0]])
    z = torch.zeros(1)
    assert sampling.greedy(logits).tolist() == [1]
    assert (
        sampling.sample_triton(logits, z, torch.zeros(1, dtype=torch.int32), torch.ones(1), torch.rand(1, 6))
        == 1
    )
    # documented: at a tied top-k threshold the Triton path keeps every tied token
    p = sampling.filtered_probs_triton(logits, torch.ones(1), torch.ones(1, dtype=torch.int32), torch.ones(1))
    torch.testing.assert_close(p, torch.tensor([[0, 1 / 3, 1 / 3, 0, 1 / 3, 0]]))


def test_empty_and_dispatch(triton_backend):
    e = torch.empty(0, 10)
    args = (torch.empty(0), torch.empty(0, dtype=torch.int32), torch.empty(0))
    assert sampling.sample(e, *args, e).shape == (0,)
    assert sampling.filtered_probs(e, *args).shape == (0, 10)
    assert sampling.sample_ref(e, *args, e).shape == (0,)
    with pytest.raises(ValueError, match="noise"):
        sampling.sample(
            torch.randn(2, 10),
            torch.ones(2),
            torch.zeros(2, dtype=torch.int32),
            torch.ones(2),
            torch.rand(2, 9),
        )


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


@pytest.mark.parametrize("t,k,p", [(1.0, 0, 1.0), (0.8, 6, 0.9), (1.5, 0, 0.7)])
def test_sample_distribution_matches_filtered_probs(t, k, p):
    gen = torch.Generator(torch.get_default_device()).manual_seed(3)
    n, V = 20000, 8
    row = torch.tensor([2.0, 1.5, 1.0, 0.7, 0.3, 0.0, -0.5, -1.0])
    logits = row.expand(n, V)
    temp, top_k, top_p = torch.full((n,), t), torch.full((n,), k, dtype=torch.int32), torch.full((n,), p)
    noise = torch.rand(n, V, generator=gen).clamp_(1e-12, 1 - 1e-7)
    tokens = sampling.sample_ref(logits, temp, top_k, top_p, noise)
    probs = sampling.filtered_probs_ref(logits[:1], temp[:1], top_k[:1], top_p[:1])[0].double()
    counts = torch.bincount(tokens, minlength=V).double()
    assert counts[probs == 0].sum() == 0
    ok, stat = _chi2_ok(counts, probs * n)
    assert ok, f"chi-square {stat:.2f}: counts {counts.tolist()} vs expected {(probs * n).tolist()}"
    assert math.isclose(float(probs.sum()), 1.0, abs_tol=1e-6)
