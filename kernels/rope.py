"""NeoX-style rotary embedding (``rotate_half`` pairing, as HF Llama/Qwen3) and the paged KV store.

``cos_sin`` is a ``[max_position, rotary_dim]`` fp32 table holding ``cat(cos, sin)`` of the ``rotary_dim //
2`` frequencies. Rotation applies to the first ``rotary_dim`` dims of each head; the rest pass through
unchanged. The paged KV cache is ``[num_blocks, page_size, Hk, D]`` (viewed flat as ``[num_slots, Hk, D]``);
token ``t`` goes to slot ``slot_mapping[t] = block * page_size + offset``, and a negative slot means "do not
store this token".
"""

import math

import torch
import triton
import triton.language as tl

from .backend import last_dim_contiguous, use_triton


# ---- cos/sin table -------------------------------------------------------------------------------------
def rope_cos_sin(rotary_dim, max_position, base, scaling=None, device=None):
    """The ``[max_position, rotary_dim]`` fp32 table ``cat(cos(p·f), sin(p·f))`` for positions ``p``.

    ``f`` are the inverse frequencies ``base^(-2i/rotary_dim)``, rescaled per ``scaling`` (HF ``rope_scaling``
    / ``rope_parameters`` dict): None / ``rope_type`` "default" (no change), "linear" (``f / factor``),
    "llama3" (exactly HF ``_compute_llama3_parameters``) or "proportional" (HF
    ``_compute_proportional_rope_parameters``, Gemma 4; pass ``rotary_dim = head_dim``, the dict's
    ``partial_rotary_factor`` zeroes the trailing frequencies). For other types a partial rotary factor is the
    caller's: pass ``rotary_dim = int(head_dim * factor)``. Raises ValueError for an odd ``rotary_dim`` or any
    other ``rope_type``.
    """
    if rotary_dim % 2:
        raise ValueError(f"rope: rotary_dim must be even, got {rotary_dim}")
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    rope_type = "default" if not scaling else scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        factor = scaling["factor"]
        lo_f = scaling["low_freq_factor"]
        hi_f = scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / lo_f, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo_f) / (hi_f - lo_f)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / hi_f) & ~(wavelen > old_len / lo_f)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif rope_type == "proportional":
        # Gemma 4: rotary_dim = head_dim, the last frequencies are zero (identity)
        angles = int(scaling.get("partial_rotary_factor", 1.0) * rotary_dim // 2)
        zeros = torch.zeros(rotary_dim // 2 - angles)
        inv_freq = torch.cat([inv_freq[:angles], zeros]) / scaling.get("factor", 1.0)
    elif rope_type != "default":
        raise ValueError(
            f"rope_scaling.rope_type {rope_type!r} is not supported "
            "(use default, linear, llama3 or proportional)"
        )
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


# ---- torch reference -----------------------------------------------------------------------------------
def _rotate_ref(x, positions, cos_sin):
    rd = cos_sin.shape[1]
    half = rd // 2
    cs = cos_sin.index_select(0, positions.long()).float()
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]
    xf = x.float()
    x1 = xf[..., :half]
    x2 = xf[..., half:rd]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, xf[..., rd:]], dim=-1).to(x.dtype)


def _check(q, k, positions, cos_sin):
    rd = cos_sin.shape[1]
    bad_k = k is not None and (k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2])
    if q.dim() != 3 or bad_k:
        raise ValueError("rope: q must be [T, Hq, D] and k [T, Hk, D] with the same T and D")
    if rd % 2 or rd > q.shape[2]:
        raise ValueError(f"rope: rotary_dim {rd} must be even and <= head_dim {q.shape[2]}")
    if positions.shape != (q.shape[0],):
        raise ValueError(f"rope: positions shape {tuple(positions.shape)} != ({q.shape[0]},)")


def _check_rope_store(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping):
    """The checks of :func:`rope_store_kv`: :func:`_check`'s, then k, v and the caches fit each other."""
    _check(q, k, positions, cos_sin)
    fits = tuple(k_cache.shape[-2:]) == tuple(k.shape[1:])
    if v.shape != k.shape or k_cache.shape != v_cache.shape or not fits:
        raise ValueError(
            f"rope_store_kv: k/v {tuple(k.shape)}, {tuple(v.shape)} do not fit caches "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"rope_store_kv: slot_mapping shape {tuple(slot_mapping.shape)} != ({k.shape[0]},)")


def apply_rope_ref(q, k, positions, cos_sin):
    """Torch reference of :func:`apply_rope`."""
    _check(q, k, positions, cos_sin)
    return _rotate_ref(q, positions, cos_sin), None if k is None else _rotate_ref(k, positions, cos_sin)


def _store_kv_ref(k, v, k_cache, v_cache, slot_mapping):
    """Write ``k, v`` ``[T, Hk, D]`` to flat slots ``slot_mapping`` of the caches, cast to the cache dtype; a
    negative slot skips the token."""
    kc = k_cache.view(-1, *k.shape[1:])
    vc = v_cache.view(-1, *k.shape[1:])
    slots = slot_mapping.long()
    if not bool((slots >= 0).all()):  # boolean masks cost 3 ops more: only when a slot is skipped
        keep = slots >= 0
        slots = slots[keep]
        k = k[keep]
        v = v[keep]
    kc.index_copy_(0, slots, k.to(kc.dtype))
    vc.index_copy_(0, slots, v.to(vc.dtype))


def rope_store_kv_ref(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping):
    """Torch reference of :func:`rope_store_kv`."""
    _check_rope_store(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
    if q.dtype != k.dtype:
        q_out, k_out = apply_rope_ref(q, k, positions, cos_sin)
    else:  # one rotation over q and k side by side: the same elementwise math in half the ops
        qk = _rotate_ref(torch.cat([q, k], 1), positions, cos_sin)
        q_out = qk[:, : q.shape[1]].contiguous()
        k_out = qk[:, q.shape[1] :]
    _store_kv_ref(k_out, v, k_cache, v_cache, slot_mapping)
    return q_out


# ---- Triton --------------------------------------------------------------------------------------------
@triton.jit
def _rope_heads(
    src,
    s_h,
    dst,
    d_h,
    n_heads,
    cs_row,
    D,
    ROT,
    HALF,
    ROTATE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Rotate (or copy) ``n_heads`` rows of one token from ``src`` to ``dst``, in chunks of BLOCK_H heads."""
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    if ROTATE:
        is_rot = offs_d < ROT
        first = offs_d < HALF
        freq = tl.where(first, offs_d, offs_d - HALF)
        partner = tl.where(first, offs_d + HALF, offs_d - HALF)
        cos = tl.load(cs_row + freq, mask=is_rot, other=1.0)
        sin = tl.load(cs_row + HALF + freq, mask=is_rot, other=0.0)
        sin = tl.where(first, -sin, sin)
    for h0 in range(0, n_heads, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        m = (offs_h < n_heads)[:, None] & dmask[None, :]
        x = tl.load(src + offs_h[:, None] * s_h + offs_d[None, :], mask=m, other=0.0)
        if ROTATE:
            xp = tl.load(src + offs_h[:, None] * s_h + partner[None, :], mask=m & is_rot[None, :], other=0.0)
            x = x.to(tl.float32) * cos[None, :] + xp.to(tl.float32) * sin[None, :]
            x = x.to(src.dtype.element_ty)  # rotated values live in the input dtype, as in the reference
        tl.store(dst + offs_h[:, None] * d_h + offs_d[None, :], x.to(dst.dtype.element_ty), mask=m)


@triton.jit
def _rope_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    qo_ptr,
    ko_ptr,
    pos_ptr,
    cs_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    Hq,
    Hk,
    D,
    ROT,
    HALF,
    sq_t,
    sq_h,
    sk_t,
    sk_h,
    sv_t,
    sv_h,
    sqo_t,
    sqo_h,
    sko_t,
    sko_h,
    s_cs,
    sc_t,
    sc_h,
    DO_Q: tl.constexpr,
    DO_K: tl.constexpr,
    ROPE_K: tl.constexpr,
    STORE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cs_row = cs_ptr
    if DO_Q or ROPE_K:
        cs_row = cs_ptr + tl.load(pos_ptr + t).to(tl.int64) * s_cs
    if DO_Q:
        _rope_heads(
            q_ptr + t * sq_t,
            sq_h,
            qo_ptr + t * sqo_t,
            sqo_h,
            Hq,
            cs_row,
            D,
            ROT,
            HALF,
            True,
            BLOCK_H,
            BLOCK_D,
        )
    if DO_K:  # rotated k returned as a tensor (apply_rope)
        _rope_heads(
            k_ptr + t * sk_t,
            sk_h,
            ko_ptr + t * sko_t,
            sko_h,
            Hk,
            cs_row,
            D,
            ROT,
            HALF,
            True,
            BLOCK_H,
            BLOCK_D,
        )
    if STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            _rope_heads(
                k_ptr + t * sk_t,
                sk_h,
                kc_ptr + slot * sc_t,
                sc_h,
                Hk,
                cs_row,
                D,
                ROT,
                HALF,
                ROPE_K,
                BLOCK_H,
                BLOCK_D,
            )
            _rope_heads(
                v_ptr + t * sv_t,
                sv_h,
                vc_ptr + slot * sc_t,
                sc_h,
                Hk,
                cs_row,
                D,
                ROT,
                HALF,
                False,
                BLOCK_H,
                BLOCK_D,
            )


def _launch(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping):
    """Rotate ``q`` and, without caches, ``k`` into new tensors; with caches (``rope_store_kv``), rotate ``k``
    into ``k_cache`` and copy ``v`` into ``v_cache`` instead. Returns ``(q_out, k_out)``."""
    T, Hq, D = q.shape
    store = k_cache is not None
    Hk = k.shape[1] if k is not None else 1
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    do_k = k is not None and not store  # apply_rope returns the rotated k
    k_out = torch.empty_like(k, memory_format=torch.contiguous_format) if do_k else None
    kc = k_cache.view(-1, Hk, D) if store else q.new_empty(1, 1, 1)
    vc = v_cache.view(-1, Hk, D) if store else kc
    if T == 0:
        return q_out, k_out
    if store and (kc.stride(-1) != 1 or vc.stride() != kc.stride()):
        raise ValueError("rope_store_kv: caches must have unit last-dim stride and identical layouts")
    rot = cos_sin.shape[1]
    BLOCK_D = triton.next_power_of_2(D)
    BLOCK_H = min(triton.next_power_of_2(max(Hq, Hk)), max(1, 2048 // BLOCK_D))
    q_, k_, v_ = (last_dim_contiguous(x) if x is not None else q for x in (q, k, v))
    ko = k_out if do_k else q
    cs = cos_sin.float().contiguous()
    _rope_kv_kernel[(T,)](
        q_,
        k_,
        v_,
        q_out,
        ko,
        positions,
        cs,
        kc,
        vc,
        slot_mapping if store else positions,
        Hq,
        Hk,
        D,
        rot,
        rot // 2,
        q_.stride(0),
        q_.stride(1),
        k_.stride(0),
        k_.stride(1),
        v_.stride(0),
        v_.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        ko.stride(0),
        ko.stride(1),
        cs.stride(0),
        kc.stride(0),
        kc.stride(1),
        DO_Q=True,
        DO_K=do_k,
        ROPE_K=store,
        STORE=store,
        BLOCK_H=BLOCK_H,
        BLOCK_D=BLOCK_D,
        num_warps=8 if BLOCK_H * BLOCK_D >= 2048 else 4,
    )  # fewer spill on sm_90 (scripts/kernel_specs.py)
    return q_out, k_out


def apply_rope_triton(q, k, positions, cos_sin):
    """Triton implementation of :func:`apply_rope` (one program per token)."""
    _check(q, k, positions, cos_sin)
    return _launch(q, k, None, positions, cos_sin, None, None, None)


def rope_store_kv_triton(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping):
    """Triton implementation of :func:`rope_store_kv`: rope on q and k plus the KV store, fused per token."""
    _check_rope_store(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
    return _launch(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)[0]


# ---- public ops ----------------------------------------------------------------------------------------
def apply_rope(q, k, positions, cos_sin):
    """Rotary embedding, NeoX pairing (HF ``apply_rotary_pos_emb`` with ``rotate_half``).

    Args:
        q: ``[T, Hq, D]``; k: ``[T, Hk, D]`` or None (Q-only, e.g. the frozen-KV drafter).
        positions: ``[T]`` int32/int64 rows of ``cos_sin`` (must be < max_position; the kernel does not
        check). cos_sin: ``[max_position, rotary_dim]`` fp32 from :func:`rope_cos_sin`; dims ``>= rotary_dim``
        pass through.

    Returns:
        ``(q_out, k_out)``: new tensors in the input dtypes (math in fp32); ``k_out`` is None when ``k`` is.

    Raises:
        ValueError: on mismatched shapes or an odd / too large rotary_dim.
    """
    fn = apply_rope_triton if use_triton(q) else apply_rope_ref
    return fn(q, k, positions, cos_sin)


def rope_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping):
    """:func:`apply_rope` on ``q`` and ``k``, then the rotated ``k`` and ``v`` ``[T, Hk, D]`` written into the
    paged caches ``[num_blocks, page_size, Hk, D]`` in place; returns ``q_out``.

    Token ``t`` goes to flat slot ``slot_mapping[t]`` (int32/int64 ``[T]``); a negative slot skips the token.
    The rotated ``k`` is rounded to ``k.dtype`` before the cast to the cache dtype (as the two-step reference
    does). The Triton path fuses everything in one kernel, one program per token. Raises ValueError on
    mismatched shapes.
    """
    fn = rope_store_kv_triton if use_triton(q) else rope_store_kv_ref
    return fn(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
