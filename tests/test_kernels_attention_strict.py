"""Paged attention reads exactly rows [0, seq_len) of each request: non-finite values anywhere else in the
pool (the rest of the last block, later block-table entries, the dummy block 0) change nothing."""

import pytest
import torch

from nanospec.kernels import attention as A
from nanospec.kernels.backend import using_backend


def poisoned_pool(lens, hkv, d, page, seed=0, spare=2, starts=None):
    """(clean pool, poisoned pool, block_table): block 0 is the dummy block; requests own random other blocks;
    table entries past a request's blocks point at block 0 or spare blocks. Every row that is not a row
    starts[b] <= j < L of some request (starts default 0) holds finite noise in the clean pool and NaN /
    +inf / -inf in the poisoned one."""
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-L // page) for L in lens]
    nb = 1 + sum(nblk) + spare
    perm = 1 + torch.randperm(nb - 1, generator=g)
    width = max(nblk) + 2
    bt = torch.zeros(len(lens), width, dtype=torch.int32)
    live = torch.zeros(nb, page, dtype=torch.bool)
    i = 0
    for b, L in enumerate(lens):
        own = perm[i : i + nblk[b]]
        i += nblk[b]
        bt[b, : nblk[b]] = own.int()
        bt[b, nblk[b] :] = torch.tensor([0, *perm[sum(nblk) :].tolist()] * width)[: width - nblk[b]].int()
        live.view(-1)[
            (own[:, None] * page + torch.arange(page)).flatten()[(starts or [0] * len(lens))[b] : L]
        ] = True
    kc, vc = torch.randn(2, nb, page, hkv, d, generator=g)
    bad = (
        torch.tensor([float("nan"), float("inf"), float("-inf")])
        .repeat(nb * page)[: nb * page]
        .view(nb, page)
    )
    dead = ~live[..., None, None]
    kp, vp = kc.where(~dead, bad[..., None, None]), vc.where(~dead, bad[..., None, None].flip(0))
    assert (~live).sum() > page  # poison in partial blocks, spare blocks and block 0
    return (kc, vc), (kp, vp), bt


def _same(fn, clean, poisoned):
    want, got = fn(*clean), fn(*poisoned)
    assert torch.isfinite(want).all()
    assert torch.equal(got, want)


@pytest.mark.parametrize("path", ["ref", "triton"])
@pytest.mark.parametrize("window", [None, 5])
# chunked prefill + prefill; uniform (one batched pass)
@pytest.mark.parametrize("ns", [[5, 6, 4], [4, 4, 4]])
def test_extend_ignores_rows_past_seq_len(path, window, ns):
    lens = [13, 6, 21]  # partial last blocks
    clean, poisoned, bt = poisoned_pool(lens, 2, 16, 4, seed=1)
    cu = torch.tensor([0, *torch.tensor(ns).cumsum(0).tolist()], dtype=torch.int32)
    sl = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(sum(ns), 4, 16, generator=torch.Generator().manual_seed(2))
    fn = getattr(A, f"extend_attention_{path}")
    _same(lambda k, v: fn(q, k, v, bt, cu, sl, 0.3, max(ns), sliding_window=window), clean, poisoned)


@pytest.mark.parametrize("path", ["ref", "triton"])
@pytest.mark.parametrize("window", [None, 6])
def test_tree_ignores_rows_past_seq_len(path, window):
    lens, N = [9, 15, 4], 4
    clean, poisoned, bt = poisoned_pool(lens, 1, 16, 4, seed=3)
    cu = torch.arange(0, 13, N, dtype=torch.int32)
    tm = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool).expand(
        3, N, N
    )
    q = torch.randn(12, 2, 16, generator=torch.Generator().manual_seed(4))
    fn = getattr(A, f"extend_attention_{path}")
    sl = torch.tensor(lens, dtype=torch.int32)
    _same(lambda k, v: fn(q, k, v, bt, cu, sl, 0.3, N, tm, sliding_window=window), clean, poisoned)


@pytest.mark.parametrize("path", ["ref", "triton"])
@pytest.mark.parametrize("window", [None, 3, 9])
def test_decode_and_draft_ignore_rows_past_seq_len(path, window):
    lens = [7, 1, 16, 10]  # partial block, one row, a page multiple
    clean, poisoned, bt = poisoned_pool(lens, 2, 16, 4, seed=5)
    sl = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(6))
    dec = getattr(A, f"decode_attention_{path}")
    _same(lambda k, v: dec(q, k, v, bt, sl, 0.25, sliding_window=window), clean, poisoned)
    r2r = torch.tensor([2, 0, 0, 3, 1, 2, 3, 0], dtype=torch.int32)  # topk rows per request, any order
    qd = torch.randn(8, 6, 16, generator=torch.Generator().manual_seed(7))
    for splits in (None, 3):
        _same(
            lambda k, v, s=splits: dec(qd, k, v, bt, sl, 1.0, r2r, s, sliding_window=window), clean, poisoned
        )


# ------------------------------------------------------------ a sliding window reads only the rows it can see


@pytest.mark.parametrize("path", ["ref", "triton"])
def test_extend_window_never_reads_rows_before_it(path):
    # prefix - W + 1 is the first key any query sees; 70 new tokens span several query and key tiles
    lens, ns, W = [90, 30, 12], [70, 3, 12], 9
    clean, poisoned, bt = poisoned_pool(
        lens, 1, 16, 4, seed=8, starts=[max(0, L - n - W + 1) for L, n in zip(lens, ns)]
    )
    cu = torch.tensor([0, 70, 73, 85], dtype=torch.int32)
    sl = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(85, 2, 16, generator=torch.Generator().manual_seed(9))
    fn = getattr(A, f"extend_attention_{path}")
    _same(lambda k, v: fn(q, k, v, bt, cu, sl, 0.3, 70, sliding_window=W), clean, poisoned)
    assert not torch.equal(
        fn(q, *clean, bt, cu, sl, 0.3, 70), fn(q, *clean, bt, cu, sl, 0.3, 70, sliding_window=W)
    )


@pytest.mark.parametrize("path", ["ref", "triton"])
def test_tree_window_never_reads_rows_before_it(path):
    lens, N, W = [41, 23], 4, 7
    clean, poisoned, bt = poisoned_pool(lens, 1, 16, 4, seed=10, starts=[L - N - W + 1 for L in lens])
    tm = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool).expand(
        2, N, N
    )
    q = torch.randn(8, 2, 16, generator=torch.Generator().manual_seed(11))
    args = (torch.tensor([0, 4, 8], dtype=torch.int32), torch.tensor(lens, dtype=torch.int32), 0.3, N, tm)
    fn = getattr(A, f"extend_attention_{path}")
    _same(lambda k, v: fn(q, k, v, bt, *args, sliding_window=W), clean, poisoned)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_and_draft_window_never_read_rows_before_it(backend):
    lens, W = [70, 9, 33], 10
    sl = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(12))
    r2r = torch.tensor([0, 0, 1, 2, 2, 1], dtype=torch.int32)
    qd = torch.randn(6, 4, 16, generator=torch.Generator().manual_seed(13))
    with using_backend(backend):
        clean, poisoned, bt = poisoned_pool(lens, 2, 16, 4, seed=14, starts=[max(0, L - W) for L in lens])
        for splits in (None, 4):
            _same(
                lambda k, v, s=splits: A.decode_attention(q, k, v, bt, sl, 0.25, None, s, sliding_window=W),
                clean,
                poisoned,
            )
        # a draft row sees W + 1 rows, [L - W - 1, L)
        clean, poisoned, bt = poisoned_pool(lens, 2, 16, 4, seed=15, starts=[max(0, L - W - 1) for L in lens])
        _same(lambda k, v: A.draft_attention(qd, k, v, bt, sl, r2r, sliding_window=W), clean, poisoned)


@pytest.mark.parametrize("speculative", [False, True])
def test_engine_ignores_nan_in_unwritten_kv_rows(tiny_llama_dir, tmp_path, speculative):
    """The defect end to end: a pool whose every unwritten row is NaN (recycled blocks, the dummy block) gives
    the same greedy tokens and the same drafts (accept lengths) as a clean pool, on the CPU torch path."""
    from nanospec import LLM, SamplingParams

    kw = dict(device="cpu", dtype="float32", page_size=4, max_model_len=64)
    if speculative:
        from test_spec_lossless import make_assistant

        kw.update(
            assistant=make_assistant(tmp_path / "a", tiny_llama_dir, hidden_size=32, num_heads=4),
            num_steps=3,
            adaptive_speculation=False,  # every step drafts 3: accept lengths independent of step timings
        )
    prompts, sp = [[1, 2, 3, 4, 5], [9] * 11, [40, 41, 42]], SamplingParams(max_tokens=12, ignore_eos=True)
    clean = LLM(str(tiny_llama_dir), **kw).generate(prompts, sp, use_tqdm=False)
    llm = LLM(str(tiny_llama_dir), **kw)
    for pool in llm.runner.kv_pools:
        pool.fill_(float("nan"))
    dirty = llm.generate(prompts, sp, use_tqdm=False)
    assert [o["token_ids"] for o in dirty] == [o["token_ids"] for o in clean]
    if speculative:
        assert [o["accept_lengths"] for o in dirty] == [o["accept_lengths"] for o in clean]
