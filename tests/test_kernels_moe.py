"""The fused MoE (kernels/moe.py): router top-k and the grouped expert GEMMs, Triton (interpreter) vs the
torch references vs HF ``Gemma4TextRouter`` / ``Gemma4TextExperts``: experts that receive no token, one
token and every token; both tile classes (decode-sized and prefill-sized batches); fp32 and bf16; routing
ties; the alignment's static shapes."""

import pytest
import torch
from transformers import Gemma4TextConfig
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts, Gemma4TextRouter

from nanospec.kernels import moe

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)]


def close(a, b, tol):
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


def weights(E, H, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * n, H, generator=g) * H**-0.5).to(dtype)
    w2 = (torch.randn(E, H, n, generator=g) * n**-0.5).to(dtype)
    return w13, w2


def routing(T, E, k, seed=0):
    """Random distinct experts per token and weights (any positive values: the kernels do not renormalise)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int()
    return torch.rand(T, k, generator=g) + 0.1, ids


def coverage_routing(T, E):
    """Top-2 routing where expert 0 gets every token, expert 3 one token, experts 2, 4.. none, 1 the rest."""
    ids = torch.tensor([[0, 1]] * T, dtype=torch.int32)
    ids[T // 2, 1] = 3
    w = torch.linspace(0.2, 1.0, 2 * T).view(T, 2)
    return w, ids


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("T,E,k", [(3, 8, 2), (20, 6, 2), (9, 16, 4), (1, 8, 8)])
def test_fused_moe_triton_vs_ref(dtype, tol, T, E, k):
    # (3, 8, 2), (9, 16, 4), (1, 8, 8): decode tiles (T <= E), most experts idle; (20, 6, 2): prefill tiles
    H = 48  # H and I not multiples of the tiles: every mask matters
    x = torch.randn(T, H).to(dtype)
    w13, w2 = weights(E, H, 24, dtype)
    tw, ids = routing(T, E, k, seed=T)
    got = moe.fused_moe_triton(x, w13, w2, tw, ids)
    want = moe.fused_moe_ref(x, w13, w2, tw, ids)
    assert got.dtype == dtype and got.shape == (T, H)
    close(got, want, tol)


@pytest.mark.parametrize("T", [5, 40])
def test_experts_with_no_one_and_all_tokens(T):
    E, H = 6, 32
    x = torch.randn(T, H)
    w13, w2 = weights(E, H, 16, torch.float32, seed=1)
    tw, ids = coverage_routing(T, E)
    got = moe.fused_moe_triton(x, w13, w2, tw, ids)
    close(got, moe.fused_moe_ref(x, w13, w2, tw, ids), 1e-5)
    # each token by hand: its two experts' outputs, weighted
    for t in (0, T // 2, T - 1):
        want = 0
        for j in range(2):
            gate, up = (w13[ids[t, j]] @ x[t]).chunk(2)
            want = want + tw[t, j] * (
                w2[ids[t, j]] @ (torch.nn.functional.gelu(gate, approximate="tanh") * up)
            )
        close(got[t], want, 1e-5)


def test_matches_hf_experts():
    cfg = Gemma4TextConfig(hidden_size=32, num_experts=8, moe_intermediate_size=16, top_k_experts=2)
    hf = Gemma4TextExperts(cfg).float()
    torch.nn.init.normal_(hf.gate_up_proj, std=0.2)
    torch.nn.init.normal_(hf.down_proj, std=0.2)
    x = torch.randn(11, 32)
    tw, ids = routing(11, 8, 2, seed=3)
    with torch.no_grad():
        want = hf(x, ids.long(), tw)
        close(moe.fused_moe_ref(x, hf.gate_up_proj, hf.down_proj, tw, ids), want, 1e-5)
        close(moe.fused_moe_triton(x, hf.gate_up_proj, hf.down_proj, tw, ids), want, 1e-5)


@pytest.mark.parametrize("E,k", [(8, 2), (16, 4), (128, 8)])
def test_route_triton_vs_ref_vs_hf(E, k):
    cfg = Gemma4TextConfig(hidden_size=32, num_experts=E, top_k_experts=k, moe_intermediate_size=8)
    hf = Gemma4TextRouter(cfg).float()
    torch.nn.init.normal_(hf.proj.weight, std=0.5)
    torch.nn.init.normal_(hf.per_expert_scale, 1.0, 0.3)
    h = torch.randn(7, 32)
    with torch.no_grad():
        _, hf_w, hf_ids = hf(h)
        x = hf.norm(h) * hf.scale * hf.scalar_root_size
        scores = hf.proj(x)
    for fn in (moe.moe_route_ref, moe.moe_route_triton):
        w, ids = fn(scores, hf.per_expert_scale.detach(), k)
        assert ids.dtype == torch.int32 and w.dtype == torch.float32
        assert ids.tolist() == hf_ids.tolist()
        close(w, hf_w, 1e-6)


def test_route_ties_pick_lowest_index_first():
    scores = torch.tensor(
        [
            [0.0] * 8,  # all tied
            [1.0, 3.0, 3.0, 0.0, 3.0, 2.0, 2.0, -9.0],  # three tied at the top, two next
            [-1e4, 0.0, -1e4, -1e4, -1e4, -1e4, -1e4, -1e4],  # probabilities underflow to 0 after one
        ]
    )
    scale = torch.linspace(0.5, 1.2, 8)
    want_ids = [[0, 1, 2], [1, 2, 4], [1, 0, 2]]
    for fn in (moe.moe_route_ref, moe.moe_route_triton):
        w, ids = fn(scores, scale, 3)
        assert ids.tolist() == want_ids
        close(w[0], scale[:3] / 3, 1e-6)
        close(w[1], scale[[1, 2, 4]] / 3, 1e-6)
        close(w[2], torch.tensor([scale[1], 0.0, 0.0]), 1e-6)


def test_align_static_shapes_one_expert_per_block():
    tw, ids = coverage_routing(10, 6)
    for block_m in (16, 64):
        pairs, block_expert, used = moe._align(ids, 6, block_m)
        P = ids.numel()
        assert len(pairs) == len(block_expert) * block_m >= P + min(6, P) * (block_m - 1)
        # the same shapes whatever the routing: one expert for every pair
        same = moe._align(torch.zeros_like(ids), 6, block_m)
        assert [t.shape for t in same] == [pairs.shape, block_expert.shape, used.shape]
        n = int(used)
        assert n == block_m * 3 and (pairs[n:] == P).all()  # experts 0, 1, 3 get a block each
        flat = ids.flatten()
        for b in range(n // block_m):
            live = pairs[b * block_m : (b + 1) * block_m]
            live = live[live < P].long()
            assert (flat[live] == block_expert[b]).all() and live.tolist() == sorted(live.tolist())
        assert sorted(pairs[pairs < P].tolist()) == list(range(P))


def test_empty_batch_and_bad_shapes(triton_backend):
    w13, w2 = weights(4, 16, 8, torch.float32)
    empty = moe.fused_moe(
        torch.empty(0, 16), w13, w2, torch.empty(0, 2), torch.empty(0, 2, dtype=torch.int32)
    )
    assert empty.shape == (0, 16)
    w, ids = moe.moe_route(torch.empty(0, 4), torch.ones(4), 2)
    assert w.shape == ids.shape == (0, 2)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 4\]"):
        moe.moe_route(torch.randn(3, 4), torch.ones(4), 5)
    with pytest.raises(ValueError, match="fused_moe: x"):
        moe.fused_moe(torch.randn(3, 15), w13, w2, torch.ones(3, 2), torch.zeros(3, 2, dtype=torch.int32))
