"""RMSNorm with an optional fused residual add: a Triton kernel (one program per row) and its torch reference.

Numerics follow HF ``LlamaRMSNorm``: the row is normalised in fp32, cast back to the input dtype, then
multiplied by ``weight``: ``out = weight * (h * rsqrt(mean(h²) + eps)).to(dtype)``. With ``fp32_weight=True``
the weight multiply happens in fp32 before the cast instead, as HF ``Gemma4RMSNorm`` does (``weight=None`` is
its ``with_scale=False``).
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .backend import last_dim_contiguous, use_triton


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    H,
    sx,
    sr,
    so,
    sro,
    eps,
    HAS_RES: tl.constexpr,
    HAS_W: tl.constexpr,
    FP32_W: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    h = tl.load(x_ptr + row * sx + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        h += tl.load(res_ptr + row * sr + offs, mask=mask, other=0.0).to(tl.float32)
        h = h.to(res_out_ptr.dtype.element_ty)  # the new residual lives in x.dtype; normalise what is stored
        tl.store(res_out_ptr + row * sro + offs, h, mask=mask)
        h = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / H + eps)
    y = h * rstd
    if HAS_W:
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if FP32_W:
            y = y * w
        else:
            y = y.to(out_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + row * so + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x, weight, residual):
    if x.dim() < 1:
        raise ValueError("rms_norm: x needs at least one dimension")
    if weight is not None and weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} != ({x.shape[-1]},)")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")


def rms_norm_ref(x, weight, eps, residual=None, fp32_weight=False):
    """Torch reference of :func:`rms_norm` (same signature, same results up to fp32 rounding)."""
    _check(x, weight, residual)
    dtype = x.dtype
    if residual is not None:
        x = (x.float() + residual.float()).to(dtype)
        residual = x
    if dtype == torch.float32 and (weight is None or weight.dtype == torch.float32):
        # no casts, so both weight orders are x * rsqrt(mean(x^2) + eps) * w: one fused op (CPU engine path)
        out = F.rms_norm(x, (x.shape[-1],), weight, eps)
        return out if residual is None else (out, residual)
    h = x.float()
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float() if fp32_weight else y.to(dtype).float() * weight.float()
    out = y.to(dtype)
    return out if residual is None else (out, residual)


def rms_norm_triton(x, weight, eps, residual=None, fp32_weight=False):
    """Triton implementation of :func:`rms_norm`: one program per row, BLOCK = next_pow2(H)."""
    _check(x, weight, residual)
    H = x.shape[-1]
    x2 = last_dim_contiguous(x.reshape(-1, H))
    out = torch.empty_like(x2, memory_format=torch.contiguous_format)
    r2 = res_out = x2  # placeholders when there is no residual
    if residual is not None:
        r2 = last_dim_contiguous(residual.reshape(-1, H))
        res_out = torch.empty_like(out)
    T = x2.shape[0]
    if T > 0:
        _rms_norm_kernel[(T,)](
            x2,
            r2,
            weight if weight is not None else x2,
            out,
            res_out,
            H,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            res_out.stride(0),
            float(eps),
            HAS_RES=residual is not None,
            HAS_W=weight is not None,
            FP32_W=bool(fp32_weight),
            BLOCK=triton.next_power_of_2(H),
            num_warps=4 if H <= 4096 else 8,
        )
    out = out.view(x.shape)
    return out if residual is None else (out, res_out.view(x.shape))


def rms_norm(x, weight, eps, residual=None, fp32_weight=False):
    """RMSNorm over the last dim, optionally fused with a residual add (matches HF ``LlamaRMSNorm``).

    Args:
        x: ``[..., H]`` float tensor (leading dims are flattened into rows, e.g. a per-head norm on
        ``[T*heads, D]``). weight: ``[H]`` scale, or None for no scale.
        eps: added to ``mean(h²)`` before the rsqrt.
        residual: optional tensor shaped like ``x``. When given, ``new_residual = (x + residual)`` (added in
        fp32,
            cast to ``x.dtype``) is normalised and returned too.
        fp32_weight: multiply by ``weight`` in fp32 before casting (HF ``Gemma4RMSNorm`` order) instead of
        after
            (HF ``LlamaRMSNorm`` order).

    Returns:
        ``out`` (dtype of ``x``), or ``(out, new_residual)`` when ``residual`` is given. Zero rows launch
        nothing.

    Raises:
        ValueError: when ``weight`` or ``residual`` shapes do not match ``x``.
    """
    fn = rms_norm_triton if use_triton(x) else rms_norm_ref
    return fn(x, weight, eps, residual, fp32_weight)
