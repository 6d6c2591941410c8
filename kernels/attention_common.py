"""What the extend and decode attention ops share (the ops themselves: :mod:`attention`).

- Input checks: :func:`check_shapes` (q, the KV cache and the block table) and :func:`window_size`.
- :func:`paged_attention_ref`: the torch core both references call (queries over their request's paged KV).
- Triton device functions: :func:`load_kv_tile` (a K/V tile through a block-table row) and :func:`dot`, with
  :func:`dot_precision` choosing its constexprs.
- The tile policy: :func:`attention_tiles` sizes the kernels' tiles to the GPU's shared memory per block;
  :func:`set_tile_target` picks the GPU class that CPU (interpreter) launches are sized for.
"""

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # the kernels' softmax uses exp2: scores are scaled by log2(e)
NO_WINDOW = 1 << 30  # "no sliding window" inside the kernels: farther than any position


def check_shapes(q, k_cache, v_cache, block_table) -> int:
    """Validate the shapes every attention op shares; return the GQA group size Hq // Hkv.

    q [T, Hq, D]; k_cache, v_cache [num_blocks, page_size, Hkv, D] (same shape and strides, contiguous last
    dim); block_table [B, W]. Raises ValueError naming the mismatch.
    """
    if q.dim() != 3 or k_cache.dim() != 4 or block_table.dim() != 2:
        raise ValueError(
            f"expected q [T,Hq,D], cache [NB,P,Hkv,D], block_table [B,W]; got {tuple(q.shape)}, "
            f"{tuple(k_cache.shape)}, {tuple(block_table.shape)}"
        )
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError(
            "k_cache and v_cache must have the same shape and strides, with a contiguous last dim"
        )
    if k_cache.shape[3] != q.shape[2]:
        raise ValueError(f"head_dim mismatch: q {q.shape[2]} vs cache {k_cache.shape[3]}")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"query heads {q.shape[1]} not a multiple of kv heads {k_cache.shape[2]}")
    return q.shape[1] // k_cache.shape[2]


def window_size(sliding_window, tree_size=0) -> int:
    """The validated window as a host int (None -> ``NO_WINDOW``); a tree needs W >= its node count N.

    Raises TypeError unless ``sliding_window`` is an int or None, ValueError when it is below max(1, N).
    """
    if sliding_window is None:
        return NO_WINDOW
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
        raise TypeError(f"sliding_window must be an int or None, got {type(sliding_window).__name__}")
    if sliding_window < max(1, tree_size):
        raise ValueError(
            f"sliding_window must be >= {max(1, tree_size)} (1, and the tree size N with a tree "
            f"mask), got {sliding_window}"
        )
    return min(sliding_window, NO_WINDOW)


def paged_attention_ref(q, k_cache, v_cache, bt, lens, n, W, scale, tree_mask=None):
    """Reference core: R rows of n queries each over their request's paged KV; fp32 result [R, n, Hq, D].

    q [R, n, Hq, D]; bt [R, width] block-table rows covering each row's length; lens [R] int64 KV lengths, the
    n queries being the last n positions (or tree nodes at prefix + depth, tree_mask [R, n, n]); W the window
    (``NO_WINDOW``: none). Gathers whole blocks (with a window only the ones that can hold visible keys) and
    zeroes every gathered row outside [lo, L), lo = max(0, L - n - W + 1), so stale values elsewhere in the
    pool (NaN/inf) never enter, not even as 0 * NaN.
    """
    R, _, Hq, D = q.shape
    NB, P, Hkv = k_cache.shape[:3]
    G = Hq // Hkv
    width = bt.shape[1]
    dev = q.device
    # entries past a request's blocks may hold anything: their rows are zeroed
    bt = bt.long().clamp(0, NB - 1)
    if W < NO_WINDOW:
        lo = (lens - (n + W - 1)).clamp(min=0)
        first = lo // P
        # the n + W - 1 visible keys start anywhere in a block
        num_blocks = min(width, triton.cdiv(n + W - 1 + P - 1, P))
        cols = first[:, None] + torch.arange(num_blocks, device=dev)
        bt = bt.gather(1, cols.clamp(max=width - 1))
        keys = first[:, None] * P + torch.arange(bt.shape[1] * P, device=dev)  # [R, S] positions
        dead = (keys < lo[:, None]) | (keys >= lens[:, None])
    else:
        keys = torch.arange(width * P, device=dev)[None]
        dead = keys >= lens[:, None]
    S = keys.shape[1]
    # index_fill_ is far cheaper than masked_fill_
    dead_rows = dead.expand(R, S).flatten().nonzero().squeeze(1)
    k = k_cache.index_select(0, bt.flatten()).view(R * S, -1).float().index_fill_(0, dead_rows, 0.0)
    v = v_cache.index_select(0, bt.flatten()).view(R * S, -1).float().index_fill_(0, dead_rows, 0.0)
    k = k.view(R, S, Hkv, D)
    v = v.view(R, S, Hkv, D)
    prefix = lens - n
    kk = keys[:, None, :]
    if tree_mask is None:  # causal: key <= position (< seq_len)
        pos = prefix[:, None] + torch.arange(n, device=dev)  # [R, n]
        seen = kk <= pos[..., None]
    else:  # node i sees the prefix plus its tree-mask row; keys >= seq_len read the padded False column n
        j = (kk - prefix[:, None, None]).clamp(0, n).expand(R, n, S)
        seen = (kk < prefix[:, None, None]) | F.pad(tree_mask, (0, 1)).gather(2, j)
        if W < NO_WINDOW:  # the window measures from node i's position prefix + depth_i
            pos = prefix[:, None] + (tree_mask.sum(-1) - 1).clamp(min=0)
    if W < NO_WINDOW:
        seen = seen & (pos[..., None] - kk < W)  # [R, n, S]
    bias = (
        torch.where(seen, 0.0, float("-inf"))[:, None, :, None].expand(R, 1, n, G, S).reshape(R, 1, n * G, S)
    )
    qh = q.float().reshape(R, n, Hkv, G, D).transpose(1, 2).reshape(R, Hkv, n * G, D)
    o = F.scaled_dot_product_attention(qh, k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias, scale=scale)
    o = o.view(R, Hkv, n, G, D).transpose(1, 2).reshape(R, n, Hq, D)
    # no visible key: 0 (torch < 2.5 SDPA gives NaN)
    return torch.where(seen.any(-1)[..., None, None], o, 0.0)


# ---- Triton device functions ---------------------------------------------------------------------------


@triton.jit
def load_kv_tile(
    K, V, BT_ROW, offs_n, n_ok, offs_d, d_ok, kvh, stride_kb, stride_kp, stride_kh, PAGE: tl.constexpr
):
    """K^T [D, N] and V [N, D] of key positions ``offs_n`` of one request, through its block-table row."""
    blk = tl.load(BT_ROW + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
    kv_off = blk * stride_kb + (offs_n % PAGE) * stride_kp + kvh * stride_kh
    k = tl.load(K + kv_off[None, :] + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
    v = tl.load(V + kv_off[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    return k, v


@triton.jit
def dot(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """``tl.dot(a, b)`` with the constexprs of :func:`dot_precision`."""
    if UPCAST:  # the interpreter multiplies bf16 as raw uint16 bits (triton#11584): upcast, exact
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PREC)
    return out


# constexprs only a CPU (interpreter) launch sets, with their GPU value (what scripts/kernel_specs.py records)
INTERPRETER_ONLY = {"UPCAST": False}


def dot_precision(q) -> dict:
    """The constexprs PREC and UPCAST of a launch on ``q``'s dtype and device: exact ("ieee") fp32 dots for
    fp32 inputs, else "tf32"; UPCAST (bf16 upcast to fp32) only under the CPU interpreter."""
    return {
        "PREC": "ieee" if q.dtype == torch.float32 else "tf32",
        "UPCAST": q.dtype == torch.bfloat16 and q.device.type == "cpu",
    }


# ---- the tile policy -----------------------------------------------------------------------------------

_tile_smem = 101376  # CPU / interpreter: tiles as if for this GPU (99 KB per block: sm_86, sm_89)


def set_tile_target(smem: int) -> None:
    """Size CPU (interpreter) launches' tiles as for a GPU with ``smem`` bytes of opt-in shared memory per
    block (CUDA launches always use their device's own). Raises ValueError below 48 KB."""
    global _tile_smem
    if isinstance(smem, bool) or not isinstance(smem, int) or smem < 49152:
        raise ValueError(f"smem must be an int >= 49152 bytes, got {smem!r}")
    _tile_smem = smem


def tile_target() -> int:
    """The shared memory per block (bytes) CPU launches' tiles are sized for (:func:`set_tile_target`)."""
    return _tile_smem


@functools.cache
def _device_smem(device) -> int:
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


class Tiles(NamedTuple):
    """Tile sizes and launch options of an attention kernel."""

    block_d: int  # the head dim padded to a power of two >= 16 (for tl.dot)
    block_n: int  # keys per K/V tile
    block_m: int  # the most query rows per program (the extend kernel packs queries x GQA heads)
    num_warps: int
    num_stages: int


def attention_tiles(q, tree=False) -> Tiles:
    """The tiles for q's head dim and dtype (``tree``: a tree-mask launch), sized to the shared memory per
    block (163 KB+: sm_80/90; 99 KB: sm_86/89) and checked by scripts/kernel_specs.py to fit and not spill.
    A key row of a K/V tile takes ``block_d * itemsize`` bytes. Exact fp32 dots (no tensor cores) and tree
    masks cost registers: fewer rows."""
    block_d = max(16, triton.next_power_of_2(q.shape[2]))
    row_bytes = block_d * q.element_size()
    big_smem = (_device_smem(q.device) if q.is_cuda else _tile_smem) >= 160 * 1024
    if q.dtype != torch.float32 and block_d <= 128:  # tensor-core dots
        if tree and block_d == 128:
            return Tiles(block_d, 32, 32, 8, 3)
        if tree:
            return Tiles(block_d, 64, 32, 4, 3)
        return Tiles(block_d, 64, 64, 4, 3)
    if block_d <= 64:  # fp32
        return Tiles(block_d, 32, 32, 4, 3)
    if block_d <= 128:  # fp32
        return Tiles(block_d, 16, 32, 8, 3)
    if row_bytes <= 1024:  # bf16 D 256 / 512, fp32 D 256: 32-key tiles only for 1 KB rows on 163 KB+
        if big_smem and row_bytes == 1024:
            return Tiles(block_d, 32, 32, 8, 3)
        return Tiles(block_d, 16, 32, 8, 3)
    if big_smem:  # fp32 D 512
        return Tiles(block_d, 16, 32, 8, 1)
    return Tiles(block_d, 16, 16, 8, 2)
