"""Paged attention: torch references vs a dense SDPA oracle; Triton kernels (interpreter) vs references."""

import pytest
import torch
import torch.nn.functional as F

from nanospec.kernels import attention as A
from nanospec.kernels import attention_decode, attention_extend
from nanospec.kernels.backend import set_backend, using_backend


def cdiv(a, b):
    return -(-a // b)


def make_paged(lens, hkv, d, page, dtype=torch.float32, seed=0):
    """Per-request contiguous K/V scattered into a paged cache through a random permutation of blocks.

    Unused block-table entries hold an out-of-range id, so any read of them would fail or show."""
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    nblk = [cdiv(L, page) for L in lens]
    nb = sum(nblk) + 3
    perm = torch.randperm(nb, generator=g)
    kc = torch.randn(nb, page, hkv, d, generator=g).to(dtype)
    vc = torch.randn(nb, page, hkv, d, generator=g).to(dtype)
    bt = torch.full((len(lens), max(nblk + [0]) + 2), nb + 1000, dtype=torch.int32)
    ks, vs, i = [], [], 0
    for b, L in enumerate(lens):
        blocks = perm[i : i + nblk[b]]
        i += nblk[b]
        bt[b, : nblk[b]] = blocks.int()
        ks.append(kc[blocks].flatten(0, 1)[:L].clone())
        vs.append(vc[blocks].flatten(0, 1)[:L].clone())
    return kc, vc, bt, ks, vs


def dense(q, k, v, allowed, scale):
    """Independent oracle: SDPA over one request's contiguous K/V with an explicit bool mask [n, L]."""
    g = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    o = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=allowed,
        scale=scale,
    )
    return o[0].transpose(0, 1)


def random_tree(n, g):
    """Node 0 is the root, each node's parent precedes it; mask = ancestors + self."""
    m = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        p = int(torch.randint(0, i, (1,), generator=g))
        m[i] |= m[p]
    return m


def extend_inputs(lens, ns, hq, hkv, d, page, dtype=torch.float32, seed=0, tree=False):
    kc, vc, bt, ks, vs = make_paged(lens, hkv, d, page, dtype, seed)
    g = torch.Generator(torch.get_default_device()).manual_seed(seed + 1)
    cu = torch.tensor([0] + list(torch.tensor(ns).cumsum(0).tolist()), dtype=torch.int32)
    q = torch.randn(sum(ns), hq, d, generator=g).to(dtype)
    tm = torch.stack([random_tree(ns[0], g) for _ in lens]) if tree else None
    return q, kc, vc, bt, cu, torch.tensor(lens, dtype=torch.int32), tm, ks, vs


# ---------------------------------------------------------------- references vs the dense oracle


def test_extend_ref_matches_dense_causal():
    lens, ns = [9, 16, 23, 5], [9, 4, 7, 0]  # prefill, chunked prefill (prefix 12 / 16), empty request
    q, kc, vc, bt, cu, sl, _, ks, vs = extend_inputs(lens, ns, 6, 2, 16, 4)
    o = A.extend_attention_ref(q, kc, vc, bt, cu, sl, 0.37, max(ns))
    for b, (L, n) in enumerate(zip(lens, ns)):
        if n == 0:
            continue
        pre = L - n
        allowed = torch.arange(L)[None, :] <= (pre + torch.arange(n))[:, None]
        want = dense(q[cu[b] : cu[b + 1]], ks[b], vs[b], allowed, 0.37)
        torch.testing.assert_close(o[cu[b] : cu[b + 1]], want, atol=1e-5, rtol=1e-5)


def test_extend_ref_matches_dense_tree():
    lens, N = [11, 6, 20], 6
    q, kc, vc, bt, cu, sl, tm, ks, vs = extend_inputs(lens, [N] * 3, 4, 2, 32, 4, seed=3, tree=True)
    assert not tm.all()  # a real tree, not the full mask
    o = A.extend_attention_ref(q, kc, vc, bt, cu, sl, 0.2, N, tree_mask=tm)
    for b, L in enumerate(lens):
        allowed = torch.cat([torch.ones(N, L - N, dtype=torch.bool), tm[b]], 1)
        want = dense(q[b * N : (b + 1) * N], ks[b], vs[b], allowed, 0.2)
        torch.testing.assert_close(o[b * N : (b + 1) * N], want, atol=1e-5, rtol=1e-5)


def test_decode_ref_matches_dense():
    lens = [7, 16, 30]
    kc, vc, bt, ks, vs = make_paged(lens, 1, 32, 16, seed=5)
    r2r = torch.tensor([0, 0, 2, 1, 2, 1], dtype=torch.int32)
    q = torch.randn(6, 3, 32)
    o = A.decode_attention_ref(q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32), 0.5, r2r)
    for r, b in enumerate(r2r.tolist()):
        want = dense(q[r : r + 1], ks[b], vs[b], torch.ones(1, lens[b], dtype=torch.bool), 0.5)
        torch.testing.assert_close(o[r : r + 1], want, atol=1e-5, rtol=1e-5)


def window_oracle(q, k, v, pos, W, scale, extra=None):
    """Dense fp32 masked softmax for queries at positions ``pos`` [n] over contiguous keys at positions
    0..L-1: key j is visible iff j <= pos_i and pos_i - j < W (HF sliding_window_overlay on the causal mask);
    ``extra`` [n, L] bool replaces the causal part (a tree mask)."""
    j = torch.arange(k.shape[0])
    allowed = (j[None, :] <= pos[:, None]) if extra is None else extra
    allowed = allowed & (pos[:, None] - j[None, :] < W)
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("ihd,jhd->hij", q.float(), k.float().repeat_interleave(g, 1)) * scale
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
    return torch.einsum("hij,jhd->ihd", p, v.float().repeat_interleave(g, 1))


@pytest.mark.parametrize("ns", [[9, 4, 7, 30], [4, 4, 4, 4]])  # per-request loop; one batched pass (verify)
@pytest.mark.parametrize("W", [1, 3, 5, 64])
def test_extend_ref_window_matches_dense_causal(W, ns):
    lens = [9, 16, 23, 30]  # prefill, chunked prefill with prefix 12 / 16; page 4
    q, kc, vc, bt, cu, sl, _, ks, vs = extend_inputs(lens, ns, 6, 2, 16, 4, seed=W)
    o = A.extend_attention_ref(q, kc, vc, bt, cu, sl, 0.37, max(ns), sliding_window=W)
    for b, (L, n) in enumerate(zip(lens, ns)):
        want = window_oracle(q[cu[b] : cu[b + 1]], ks[b], vs[b], L - n + torch.arange(n), W, 0.37)
        torch.testing.assert_close(o[cu[b] : cu[b + 1]], want, atol=1e-5, rtol=1e-5)
    if W < 4:  # the window changes the result
        assert (o - A.extend_attention_ref(q, kc, vc, bt, cu, sl, 0.37, max(ns))).abs().max() > 1e-2


@pytest.mark.parametrize("W", [6, 9])
def test_extend_ref_window_matches_dense_tree(W):
    lens, N = [11, 20, 6], 6
    q, kc, vc, bt, cu, sl, tm, ks, vs = extend_inputs(lens, [N] * 3, 4, 2, 32, 4, seed=W, tree=True)
    o = A.extend_attention_ref(q, kc, vc, bt, cu, sl, 0.2, N, tree_mask=tm, sliding_window=W)
    for b, L in enumerate(lens):
        depth = tm[b].sum(-1) - 1  # ancestors + self, minus self
        tree_part = torch.cat([torch.ones(N, L - N, dtype=torch.bool), tm[b]], 1)
        want = window_oracle(q[b * N : (b + 1) * N], ks[b], vs[b], L - N + depth, W, 0.2, extra=tree_part)
        torch.testing.assert_close(o[b * N : (b + 1) * N], want, atol=1e-5, rtol=1e-5)
    assert (o - A.extend_attention_ref(q, kc, vc, bt, cu, sl, 0.2, N, tree_mask=tm)).abs().max() > 1e-2


@pytest.mark.parametrize("W", [1, 5, 16, 100])
def test_decode_ref_window_matches_dense(W):
    lens = [7, 16, 30, 1]
    kc, vc, bt, ks, vs = make_paged(lens, 1, 32, 4, seed=W)
    r2r = torch.tensor([0, 2, 2, 1, 3, 1], dtype=torch.int32)
    q = torch.randn(6, 3, 32)
    o = A.decode_attention_ref(
        q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32), 0.5, r2r, sliding_window=W
    )
    for r, b in enumerate(r2r.tolist()):
        want = window_oracle(q[r : r + 1], ks[b], vs[b], torch.tensor([lens[b] - 1]), W, 0.5)
        torch.testing.assert_close(o[r : r + 1], want, atol=1e-5, rtol=1e-5)


def test_draft_window_follows_hf_assistant_mask():
    # The rows an HF Gemma 4 assistant sliding layer sees over L shared (committed) KV rows, from HF itself.
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4_assistant.modeling_gemma4_assistant import Gemma4AssistantForCausalLM

    W, lens = 4, [1, 3, 4, 5, 6, 12]
    cfg = Gemma4TextConfig(
        hidden_size=8,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=8,
        sliding_window=W,
        vocab_size=16,
        layer_types=["sliding_attention", "full_attention"],
    )
    cfg._attn_implementation = "eager"
    fake = type("Fake", (), {"config": cfg})()
    kc, vc, bt, ks, vs = make_paged(lens, 2, 16, 4, seed=17)
    q = torch.randn(len(lens), 4, 16)
    got = A.draft_attention(
        q,
        kc,
        vc,
        bt,
        torch.tensor(lens, dtype=torch.int32),
        torch.arange(len(lens), dtype=torch.int32),
        sliding_window=W,
    )
    for b, L in enumerate(lens):
        kv = torch.zeros(1, 1, L, 8)
        masks = Gemma4AssistantForCausalLM.create_attention_masks(
            fake,
            torch.zeros(1, 1, 8),
            torch.ones(1, L, dtype=torch.long),
            {"full_attention": (kv, kv), "sliding_attention": (kv, kv)},
        )
        m = masks["sliding_attention"]
        # additive mask: 0 = visible
        seen = torch.ones(L, dtype=torch.bool) if m is None else (m[0, 0, 0] == 0)
        want = dense(q[b : b + 1], ks[b], vs[b], seen[None], 1.0)
        torch.testing.assert_close(got[b : b + 1], want, atol=1e-5, rtol=1e-5)
        assert seen.sum() == min(L, W + 1) and seen[-1]  # the last W + 1 rows


# ---------------------------------------------------------------- Triton (interpreter) vs references

EXTEND_CASES = [
    # dtype, hq, hkv, d, page, lens, new tokens
    (torch.float32, 2, 2, 16, 4, [8, 7, 9, 1], [8, 7, 9, 1]),  # prefill at/around page multiples
    (torch.float32, 4, 2, 32, 16, [16, 33, 15, 17], [5, 16, 0, 17]),  # chunked prefill, empty request
    (torch.float32, 6, 2, 64, 4, [100, 12], [37, 12]),  # GQA 3, long prefix, several tiles
    (torch.float32, 2, 1, 128, 16, [31], [31]),
    (torch.float32, 1, 1, 256, 4, [20, 9], [3, 9]),
    (torch.bfloat16, 4, 2, 32, 16, [48, 17], [48, 4]),
    (torch.float16, 3, 1, 64, 4, [13, 4], [6, 4]),
]


@pytest.mark.parametrize("dtype,hq,hkv,d,page,lens,ns", EXTEND_CASES)
def test_extend_triton_matches_ref(dtype, hq, hkv, d, page, lens, ns):
    q, kc, vc, bt, cu, sl, _, _, _ = extend_inputs(lens, ns, hq, hkv, d, page, dtype, seed=d + page)
    scale = d**-0.5
    got = A.extend_attention_triton(q, kc, vc, bt, cu, sl, scale, max(ns))
    want = A.extend_attention_ref(q, kc, vc, bt, cu, sl, scale, max(ns))
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_extend_triton_strided_q():
    # q as a view of a fused qkv projection: row stride != Hq * D
    lens, ns = [10, 5], [4, 5]
    _, kc, vc, bt, cu, sl, _, _, _ = extend_inputs(lens, ns, 4, 2, 16, 4)
    qkv = torch.randn(9, 8, 16)
    q = qkv[:, :4]
    got = A.extend_attention_triton(q, kc, vc, bt, cu, sl, 0.25, 5)
    want = A.extend_attention_ref(q.contiguous(), kc, vc, bt, cu, sl, 0.25, 5)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(A.extend_attention_ref(q, kc, vc, bt, cu, sl, 0.25, 5), want)  # per-request loop
    cu4 = torch.tensor([0, 4, 8], dtype=torch.int32)  # 4 + 4 new tokens: one batched pass
    assert torch.equal(
        A.extend_attention_ref(q[:8], kc, vc, bt, cu4, sl, 0.25, 4),
        A.extend_attention_ref(q[:8].contiguous(), kc, vc, bt, cu4, sl, 0.25, 4),
    )


@pytest.mark.parametrize(
    "dtype,hq,hkv", [(torch.float32, 2, 2), (torch.float32, 6, 2), (torch.bfloat16, 4, 2)]
)
def test_tree_triton_matches_ref(dtype, hq, hkv):
    lens, N = [5, 12, 16, 21], 5  # prefix 0, 7, 11 and 16 (a page multiple)
    q, kc, vc, bt, cu, sl, tm, _, _ = extend_inputs(lens, [N] * 4, hq, hkv, 32, 4, dtype, seed=hq, tree=True)
    got = A.extend_attention_triton(q, kc, vc, bt, cu, sl, 0.3, N, tree_mask=tm)
    want = A.extend_attention_ref(q, kc, vc, bt, cu, sl, 0.3, N, tree_mask=tm)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    # the tree mask matters: a causal pass over the same rows differs
    causal = A.extend_attention_ref(q, kc, vc, bt, cu, sl, 0.3, N)
    assert (causal.float() - want.float()).abs().max() > 1e-2


def test_tree_triton_general_mask():
    # any bool mask is honoured as given (here the root key is hidden from some rows; a row may see nothing)
    lens, N = [4, 9, 12], 4
    q, kc, vc, bt, cu, sl, _, _, _ = extend_inputs(lens, [N] * 3, 2, 1, 16, 4, seed=7)
    tm = torch.rand(3, N, N, generator=torch.Generator(torch.get_default_device()).manual_seed(7)) < 0.5
    tm[0, 1] = False  # prefix 0: query 1 of request 0 sees no key -> zeros
    tm[1:, :, 0] = False
    got = A.extend_attention_triton(q, kc, vc, bt, cu, sl, 0.3, N, tree_mask=tm)
    want = A.extend_attention_ref(q, kc, vc, bt, cu, sl, 0.3, N, tree_mask=tm)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.all(got[1] == 0) and torch.isfinite(got).all()


DECODE_CASES = [
    # dtype, hq, hkv, d, page, lens, row_to_req (None = identity)
    (torch.float32, 2, 2, 16, 4, [8, 7, 9, 1], None),
    # k=3 rows per request, seq_len 0
    (torch.float32, 4, 2, 32, 16, [33, 0, 16], [0, 0, 0, 1, 1, 1, 2, 2, 2]),
    (torch.float32, 6, 2, 64, 4, [97, 12], [1, 0, 1, 0, 1, 0]),
    (torch.bfloat16, 3, 1, 64, 16, [40, 17], [0, 1, 1]),
    (torch.float16, 4, 4, 32, 4, [5, 64], None),
]


@pytest.mark.parametrize("dtype,hq,hkv,d,page,lens,r2r", DECODE_CASES)
def test_decode_triton_matches_ref(dtype, hq, hkv, d, page, lens, r2r):
    kc, vc, bt, _, _ = make_paged(lens, hkv, d, page, dtype, seed=d)
    sl = torch.tensor(lens, dtype=torch.int32)
    r2r = None if r2r is None else torch.tensor(r2r, dtype=torch.int32)
    R = len(lens) if r2r is None else len(r2r)
    q = torch.randn(R, hq, d).to(dtype)
    want = A.decode_attention_ref(q, kc, vc, bt, sl, d**-0.5, r2r)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    outs = [A.decode_attention_triton(q, kc, vc, bt, sl, d**-0.5, r2r, s) for s in (None, 1, 3, 8)]
    for got in outs:
        assert got.dtype == dtype and got.shape == q.shape
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    if dtype == torch.float32:  # splits only reorder fp32 sums
        for got in outs[2:]:
            torch.testing.assert_close(got, outs[1], atol=1e-5, rtol=1e-5)
    req = torch.arange(R) if r2r is None else r2r.long()
    zero_rows = sl[req] == 0
    for got in outs + [want]:
        assert torch.all(got[zero_rows] == 0) and torch.isfinite(got.float()).all()


WINDOW_CASES = [
    # dtype, hq, hkv, d, page, lens, new tokens, window
    (torch.float32, 2, 1, 16, 4, [100, 40, 9], [100, 5, 9], 7),  # prefill over many tiles; chunk; W < n
    (torch.float32, 6, 2, 32, 16, [70, 33], [37, 16], 33),  # window not a tile or page multiple
    (torch.bfloat16, 4, 2, 32, 4, [48, 17], [48, 4], 1),  # only the query itself
    (torch.float16, 3, 1, 64, 4, [13, 4], [6, 4], 200),  # window past every length
]


@pytest.mark.parametrize("dtype,hq,hkv,d,page,lens,ns,W", WINDOW_CASES)
def test_extend_triton_window_matches_ref(dtype, hq, hkv, d, page, lens, ns, W):
    q, kc, vc, bt, cu, sl, _, _, _ = extend_inputs(lens, ns, hq, hkv, d, page, dtype, seed=W)
    got = A.extend_attention_triton(q, kc, vc, bt, cu, sl, d**-0.5, max(ns), sliding_window=W)
    want = A.extend_attention_ref(q, kc, vc, bt, cu, sl, d**-0.5, max(ns), sliding_window=W)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("W", [5, 8, 30])
def test_tree_triton_window_matches_ref(W):
    lens, N = [5, 12, 26, 41], 5  # prefix 0, 7, 21 and 36
    q, kc, vc, bt, cu, sl, tm, _, _ = extend_inputs(lens, [N] * 4, 4, 2, 32, 4, seed=W, tree=True)
    got = A.extend_attention_triton(q, kc, vc, bt, cu, sl, 0.3, N, tree_mask=tm, sliding_window=W)
    want = A.extend_attention_ref(q, kc, vc, bt, cu, sl, 0.3, N, tree_mask=tm, sliding_window=W)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("W", [1, 6, 40])
def test_decode_triton_window_matches_ref(W):
    lens = [97, 12, 0, 40]
    kc, vc, bt, _, _ = make_paged(lens, 2, 32, 4, seed=W)
    sl = torch.tensor(lens, dtype=torch.int32)
    r2r = torch.tensor([3, 0, 1, 2, 0, 3], dtype=torch.int32)
    q = torch.randn(6, 4, 32)
    want = A.decode_attention_ref(q, kc, vc, bt, sl, 0.2, r2r, sliding_window=W)
    for splits in (None, 1, 3, 8):
        got = A.decode_attention_triton(q, kc, vc, bt, sl, 0.2, r2r, splits, sliding_window=W)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.all(want[3] == 0)
    draft = A.draft_attention(q, kc, vc, bt, sl, r2r, 0.2, sliding_window=W)  # one more row than decode
    torch.testing.assert_close(
        draft, A.decode_attention_ref(q, kc, vc, bt, sl, 0.2, r2r, sliding_window=W + 1)
    )


def test_decode_many_splits_more_than_tiles():
    # 32 splits over 10 keys: most splits are empty and must merge to nothing (no NaN, no garbage)
    kc, vc, bt, _, _ = make_paged([10, 3], 2, 16, 4, seed=9)
    sl = torch.tensor([10, 3], dtype=torch.int32)
    q = torch.randn(2, 4, 16)
    got = A.decode_attention_triton(q, kc, vc, bt, sl, 0.5, None, 32)
    torch.testing.assert_close(got, A.decode_attention_ref(q, kc, vc, bt, sl, 0.5), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_draft_attention_is_readonly_decode(backend):
    lens = [13, 6]
    kc, vc, bt, _, _ = make_paged(lens, 2, 32, 4, seed=11)
    sl = torch.tensor(lens, dtype=torch.int32)
    r2r = torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.int32)  # B=2, k=3
    q = torch.randn(6, 4, 32)
    k0, v0 = kc.clone(), vc.clone()
    with using_backend(backend):
        got = A.draft_attention(q, kc, vc, bt, sl, r2r)
    assert torch.equal(kc, k0) and torch.equal(vc, v0)
    want = A.decode_attention_ref(q, kc, vc, bt, sl, 1.0, r2r)  # default scale is 1.0
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (got - A.decode_attention_ref(q, kc, vc, bt, sl, 32**-0.5, r2r)).abs().max() > 1e-3


def test_dispatch(monkeypatch, triton_backend):
    calls = []
    monkeypatch.setattr(A, "decode_attention_triton", lambda *a, **k: calls.append("triton") or "t")
    monkeypatch.setattr(A, "decode_attention_ref", lambda *a, **k: calls.append("ref") or "r")
    # explicit: "auto" must pick the reference for CPU tensors, also on GPU machines
    cpu = torch.device("cpu")
    kv = torch.zeros(1, 4, 1, 16, device=cpu)
    args = (
        torch.zeros(1, 1, 16, device=cpu),
        kv,
        kv,
        torch.zeros(1, 1, dtype=torch.int32, device=cpu),
        torch.ones(1, dtype=torch.int32, device=cpu),
        1.0,
    )
    assert A.decode_attention(*args) == "t"
    set_backend("torch")
    assert A.decode_attention(*args) == "r"
    set_backend("auto")  # CPU tensors -> reference
    assert A.decode_attention(*args) == "r" and calls == ["triton", "ref", "ref"]


def test_empty_batches_launch_nothing(monkeypatch):
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("kernel launched on an empty batch")

    monkeypatch.setattr(attention_extend, "_extend_kernel", NoLaunch())
    monkeypatch.setattr(attention_decode, "_decode_split_kernel", NoLaunch())
    monkeypatch.setattr(attention_decode, "_decode_merge_kernel", NoLaunch())
    kc = vc = torch.zeros(2, 4, 1, 16, dtype=torch.bfloat16)
    q = torch.zeros(0, 2, 16, dtype=torch.bfloat16)
    empty_i = torch.zeros(0, dtype=torch.int32)
    for fn in (A.extend_attention_ref, A.extend_attention_triton):
        for bt, cu in (
            (torch.zeros(0, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)),
            (torch.zeros(2, 1, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)),
        ):  # B=0; B=2, T=0
            o = fn(
                q, kc, vc, bt, cu, empty_i if bt.shape[0] == 0 else torch.zeros(2, dtype=torch.int32), 1.0, 0
            )
            assert o.shape == (0, 2, 16) and o.dtype == torch.bfloat16
    for fn in (A.decode_attention_ref, A.decode_attention_triton):
        # empty seq_lens: no max() on it
        o = fn(q, kc, vc, torch.zeros(0, 1, dtype=torch.int32), empty_i, 1.0)
        assert o.shape == (0, 2, 16) and o.dtype == torch.bfloat16


def test_shape_errors():
    kc = vc = torch.zeros(2, 4, 2, 16)
    bt = torch.zeros(1, 2, dtype=torch.int32)
    sl = torch.tensor([3], dtype=torch.int32)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple"):
        A.decode_attention_ref(torch.zeros(1, 3, 16), kc, vc, bt, sl, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        A.extend_attention_triton(torch.zeros(3, 2, 32), kc, vc, bt, cu, sl, 1.0, 3)
    with pytest.raises(ValueError, match="tree_mask"):
        A.extend_attention_triton(
            torch.zeros(3, 2, 16), kc, vc, bt, cu, sl, 1.0, 3, tree_mask=torch.ones(1, 2, 2, dtype=torch.bool)
        )
    with pytest.raises(ValueError, match="tree_mask"):
        A.extend_attention_ref(
            torch.zeros(3, 2, 16), kc, vc, bt, cu, sl, 1.0, 3, tree_mask=torch.ones(1, 2, 2, dtype=torch.bool)
        )
    with pytest.raises(ValueError, match="max_seqlen_q"):
        A.extend_attention_triton(torch.zeros(3, 2, 16), kc, vc, bt, cu, sl, 1.0, 0)
    with pytest.raises(ValueError, match="seq_len"):
        A.extend_attention_ref(
            torch.zeros(3, 2, 16), kc, vc, bt, cu, torch.tensor([2], dtype=torch.int32), 1.0, 3
        )
    with pytest.raises(ValueError, match="num_splits"):
        A.decode_attention_triton(torch.zeros(1, 2, 16), kc, vc, bt, sl, 1.0, None, 0)


def test_sliding_window_errors():
    kc = vc = torch.zeros(2, 4, 2, 16)
    bt = torch.zeros(1, 2, dtype=torch.int32)
    sl = torch.tensor([3], dtype=torch.int32)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    q = torch.zeros(3, 2, 16)
    tm = torch.ones(1, 3, 3, dtype=torch.bool)
    for fn in (A.extend_attention_ref, A.extend_attention_triton):
        with pytest.raises(ValueError, match="sliding_window must be >= 1"):
            fn(q, kc, vc, bt, cu, sl, 1.0, 3, sliding_window=0)
        with pytest.raises(ValueError, match="sliding_window must be >= 3"):
            fn(q, kc, vc, bt, cu, sl, 1.0, 3, tm, sliding_window=2)  # a tree needs W >= N
        with pytest.raises(TypeError, match="sliding_window"):
            fn(q, kc, vc, bt, cu, sl, 1.0, 3, sliding_window=2.0)
    for fn in (A.decode_attention_ref, A.decode_attention_triton):
        with pytest.raises(ValueError, match="sliding_window must be >= 1"):
            fn(q[:1], kc, vc, bt, sl, 1.0, sliding_window=0)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        A.draft_attention(q[:1], kc, vc, bt, sl, torch.zeros(1, dtype=torch.int32), sliding_window=0)
