"""Gated MLP activations: ``act(x[:, :I]) * x[:, I:]`` for SiLU (Llama/Qwen3) and tanh-GELU (Gemma).

Both compute in fp32 and return ``x.dtype``; the Triton kernel runs a ``(rows, cdiv(I, BLOCK))`` grid.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .backend import last_dim_contiguous, use_triton


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, N, sx, so, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    a = tl.load(x_ptr + row * sx + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + row * sx + N + offs, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        # 0.5·a·(1 + tanh(y)) == a·sigmoid(2y), y = sqrt(2/π)·(a + 0.044715·a³)
        y = 1.5957691216057308 * (a + 0.044715 * a * a * a)  # 2·sqrt(2/π)
        act = a / (1.0 + tl.exp(-y))
    else:
        act = a / (1.0 + tl.exp(-a))
    tl.store(out_ptr + row * so + offs, (act * b).to(out_ptr.dtype.element_ty), mask=mask)


def _split(x):
    if x.shape[-1] % 2:
        raise ValueError(f"act_and_mul: last dim must be even (gate | up), got {x.shape[-1]}")
    return x.shape[-1] // 2


def silu_and_mul_ref(x):
    """Torch reference of :func:`silu_and_mul`."""
    N = _split(x)
    xf = x.float()
    return (F.silu(xf[..., :N]) * xf[..., N:]).to(x.dtype)


def gelu_and_mul_ref(x):
    """Torch reference of :func:`gelu_and_mul`."""
    N = _split(x)
    xf = x.float()
    return (F.gelu(xf[..., :N], approximate="tanh") * xf[..., N:]).to(x.dtype)


def _act_and_mul_triton(x, gelu):
    N = _split(x)
    x2 = last_dim_contiguous(x.reshape(-1, 2 * N))
    out = torch.empty((x2.shape[0], N), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and N > 0:
        BLOCK = min(triton.next_power_of_2(N), 1024)
        _act_and_mul_kernel[(x2.shape[0], triton.cdiv(N, BLOCK))](
            x2, out, N, x2.stride(0), out.stride(0), GELU=gelu, BLOCK=BLOCK, num_warps=4
        )
    return out.view(*x.shape[:-1], N)


def silu_and_mul_triton(x):
    """Triton implementation of :func:`silu_and_mul`."""
    return _act_and_mul_triton(x, False)


def gelu_and_mul_triton(x):
    """Triton implementation of :func:`gelu_and_mul`."""
    return _act_and_mul_triton(x, True)


def silu_and_mul(x):
    """SwiGLU gate: ``x [..., 2I]`` → ``silu(x[..., :I]) * x[..., I:]`` (HF Llama MLP ``act_fn(gate) * up``).

    Computed in fp32, returned in ``x.dtype``. Raises ValueError for an odd last dim.
    """
    return silu_and_mul_triton(x) if use_triton(x) else silu_and_mul_ref(x)


def gelu_and_mul(x):
    """GeGLU gate with the tanh GELU (HF ``gelu_pytorch_tanh``, Gemma MLPs): ``gelu(x[..., :I]) * x[...,
    I:]``.

    Computed in fp32, returned in ``x.dtype``. Raises ValueError for an odd last dim.
    """
    return gelu_and_mul_triton(x) if use_triton(x) else gelu_and_mul_ref(x)
