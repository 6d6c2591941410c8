"""RMSNorm, RoPE (+ paged KV store), gated activations: Triton (interpreter) vs torch reference vs HF."""

import pytest
import torch
import torch.nn.functional as F

from nanospec.kernels import activation, norm, rope

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def close(a, b, tol):
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


# --------------------------------------------------------------------------------------------------- RMSNorm
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("with_res", [False, True])
@pytest.mark.parametrize("fp32_weight", [False, True])
def test_rms_norm_triton_vs_ref(dtype, tol, with_res, fp32_weight):
    x = torch.randn(2, 3, 37).to(dtype)  # leading dims flatten into 6 rows of an odd hidden size
    w = (torch.randn(37) * 0.5 + 1).to(dtype)
    res = torch.randn_like(x) if with_res else None
    got = norm.rms_norm_triton(x, w, 1e-6, res, fp32_weight)
    want = norm.rms_norm_ref(x, w, 1e-6, res, fp32_weight)
    if with_res:
        (got, got_r), (want, want_r) = got, want
        assert got_r.dtype == dtype and got_r.shape == x.shape
        close(got_r, want_r, tol)
    assert got.dtype == dtype and got.shape == x.shape
    close(got, want, tol)


def test_rms_norm_empty_no_weight_and_dispatch(triton_backend):
    out, r = norm.rms_norm(torch.empty(0, 8), torch.ones(8), 1e-6, torch.empty(0, 8))
    assert out.shape == (0, 8) and r.shape == (0, 8)
    x = torch.randn(5, 16)
    close(norm.rms_norm(x, None, 1e-5), norm.rms_norm_ref(x, None, 1e-5), 1e-5)
    with pytest.raises(ValueError, match="weight"):
        norm.rms_norm(x, torch.ones(15), 1e-5)


def test_rms_norm_ref_matches_hf():
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    for dtype, tol in DTYPES:
        x, r = torch.randn(7, 48).to(dtype), torch.randn(7, 48).to(dtype)
        hf = LlamaRMSNorm(48, eps=1e-5).to(dtype)
        torch.nn.init.normal_(hf.weight, 1.0, 0.3)
        with torch.no_grad():
            close(norm.rms_norm_ref(x, hf.weight, 1e-5), hf(x), tol * 0.01)
            out, new_r = norm.rms_norm_ref(x, hf.weight, 1e-5, r)
            close(new_r, x + r, tol)
            close(out, hf(x + r), tol)
            g = Gemma4RMSNorm(48, eps=1e-6).to(dtype)
            torch.nn.init.normal_(g.weight, 1.0, 0.3)
            close(norm.rms_norm_ref(x, g.weight, 1e-6, fp32_weight=True), g(x), tol)  # HF uses pow(-0.5)
            g0 = Gemma4RMSNorm(48, eps=1e-6, with_scale=False)
            close(norm.rms_norm_ref(x, None, 1e-6), g0(x), tol)


# ------------------------------------------------------------------------------------------------------ RoPE
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("rotary_dim,with_k", [(24, True), (16, False)])
def test_apply_rope_triton_vs_ref(dtype, tol, rotary_dim, with_k):
    cs = rope.rope_cos_sin(rotary_dim, 64, 10000.0)
    q = torch.randn(5, 3, 24).to(dtype)
    k = torch.randn(5, 1, 24).to(dtype) if with_k else None
    pos = torch.tensor([0, 7, 63, 7, 31], dtype=torch.int32)
    qa, ka = rope.apply_rope_triton(q, k, pos, cs)
    qb, kb = rope.apply_rope_ref(q, k, pos, cs)
    assert qa.dtype == dtype
    close(qa, qb, tol)
    if with_k:
        close(ka, kb, tol)
    else:
        assert ka is None and kb is None
    if rotary_dim < 24:  # dims past rotary_dim pass through untouched
        assert torch.equal(qa[..., rotary_dim:], q[..., rotary_dim:])


def _hf_config(scaling):
    from transformers import LlamaConfig

    params = {"rope_type": "default", "rope_theta": 500000.0, **(scaling or {})}
    return LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_parameters=params,
    )


SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
    {"rope_type": "proportional", "partial_rotary_factor": 0.25},
]


@pytest.mark.parametrize("scaling", SCALINGS)
def test_apply_rope_ref_matches_hf(scaling):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = _hf_config(scaling)
    cs = rope.rope_cos_sin(16, 512, 500000.0, scaling)
    assert cs.shape == (512, 16) and cs.dtype == torch.float32
    pos = torch.tensor([0, 1, 5, 100, 300, 511])
    q, k = torch.randn(6, 4, 16), torch.randn(6, 2, 16)
    cos, sin = LlamaRotaryEmbedding(cfg)(q, pos[None])  # [1, T, D]
    qh, kh = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    qo, ko = rope.apply_rope_ref(q, k, pos, cs)
    close(qo, qh[0].transpose(0, 1), 1e-5)
    close(ko, kh[0].transpose(0, 1), 1e-5)


def test_rope_errors():
    with pytest.raises(ValueError, match="rope_type"):
        rope.rope_cos_sin(16, 8, 1e4, {"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="rotary_dim"):
        rope.apply_rope_ref(
            torch.randn(2, 1, 8), None, torch.zeros(2, dtype=torch.long), rope.rope_cos_sin(16, 4, 1e4)
        )


# ------------------------------------------------------------------------------------------------- KV store
def _caches(dtype, blocks=3, page=4, hk=2, d=12):
    kc = torch.randn(blocks, page, hk, d).to(dtype)
    return kc, torch.randn_like(kc)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_rope_store_kv_triton_vs_ref(dtype, tol):
    cs = rope.rope_cos_sin(8, 32, 10000.0)  # partial rotary: 8 of 12 dims
    q, k, v = (torch.randn(6, h, 12).to(dtype) for h in (4, 2, 2))
    pos = torch.tensor([0, 1, 2, 3, 30, 31])
    slots = torch.tensor([-1, 1, 2, 3, 4, 5])
    kc, vc = _caches(dtype)
    kr, vr = kc.clone(), vc.clone()
    row0_k = kc.view(-1, 2, 12)[0].clone()
    q1 = rope.rope_store_kv_triton(q, k, v, pos, cs, kc, vc, slots)
    q2 = rope.rope_store_kv_ref(q, k, v, pos, cs, kr, vr, slots)
    close(q1, q2, tol)
    close(kc, kr, tol)
    assert torch.equal(vc, vr)
    assert torch.equal(kc.view(-1, 2, 12)[0], row0_k)  # slot -1 wrote nothing (slot 0 stays)
    _, k_rot = rope.apply_rope_ref(q, k, pos, cs)
    close(kc.view(-1, 2, 12)[5], k_rot[5], tol)


def test_rope_store_kv_empty(triton_backend):
    kc, vc = _caches(torch.float32)
    kc0 = kc.clone()
    e = torch.empty(0, 2, 12)
    q = rope.rope_store_kv(
        torch.empty(0, 4, 12),
        e,
        e,
        torch.empty(0, dtype=torch.long),
        rope.rope_cos_sin(12, 8, 1e4),
        kc,
        vc,
        torch.empty(0, dtype=torch.long),
    )
    assert q.shape == (0, 4, 12) and torch.equal(kc, kc0)


# ------------------------------------------------------------------------------------------------ activation
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_act_and_mul_triton_vs_ref_and_oracle(dtype, tol):
    x = (torch.randn(2, 5, 2 * 45) * 3).to(dtype)  # odd intermediate size, 3-D input
    a, b = x.float()[..., :45], x.float()[..., 45:]
    for tri, ref, oracle in [
        (activation.silu_and_mul_triton, activation.silu_and_mul_ref, a * torch.sigmoid(a) * b),
        (activation.gelu_and_mul_triton, activation.gelu_and_mul_ref, F.gelu(a, approximate="tanh") * b),
    ]:
        got, want = tri(x), ref(x)
        assert got.shape == (2, 5, 45) and got.dtype == dtype
        close(got, want, tol)
        close(want, oracle, tol)


def test_act_and_mul_empty_and_errors(triton_backend):
    assert activation.silu_and_mul(torch.empty(0, 8)).shape == (0, 4)
    assert activation.gelu_and_mul(torch.empty(0, 8)).shape == (0, 4)
    with pytest.raises(ValueError, match="even"):
        activation.silu_and_mul(torch.randn(2, 7))
