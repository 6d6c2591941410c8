"""Attention kernel micro-benchmark on a CUDA GPU: HBM bandwidth of decode, frozen-KV draft and tree-verify
attention against a device-to-device copy. ``python scripts/kernel_bench.py`` prints one line per kernel and
context, then the figures as one JSON line."""

import json
from functools import partial

import torch


def kernel_bench(dtype=torch.bfloat16, contexts=(8192, 16384, 32768)) -> list[dict]:
    """HBM bandwidth of decode, frozen-KV draft (topk 3) and tree-verify (12 nodes) attention for 8 requests
    of each context length, 32 query / 8 KV heads of 128, page size 16 (CUDA only, triton.testing.do_bench).

    Bytes counted = the K/V rows each kernel must read once (batch x context x 2 x Hkv x D x elt); the copy
    baseline is a device-to-device copy of the same size (read + write counted)."""
    from triton.testing import do_bench

    from nanospec.kernels.attention import decode_attention, draft_attention, extend_attention

    B = 8
    Hq = 32
    Hkv = 8
    D = 128
    page = 16
    k = 3
    N = 12
    rows = []
    dev = torch.device("cuda")
    i32 = dict(device="cuda", dtype=torch.int32)
    for ctx in contexts:
        kc, vc = (torch.randn(B * ctx // page + 1, page, Hkv, D, device=dev, dtype=dtype) for _ in range(2))
        bt = (1 + torch.arange(B * ctx // page, **i32)).view(B, -1)
        lens = torch.full((B,), ctx, **i32)
        kv_bytes = 2 * B * ctx * Hkv * D * kc.element_size()
        src = torch.empty(kv_bytes // 2, dtype=torch.int16, device=dev)
        copy_bw = 2 * kv_bytes / (do_bench(src.clone) * 1e-3)
        q, qd, qt = (torch.randn(b, Hq, D, device=dev, dtype=dtype) for b in (B, B * k, B * N))
        r2r = torch.arange(B, **i32).repeat_interleave(k)
        cu = torch.arange(0, (B + 1) * N, N, **i32)
        mask = torch.tril(torch.ones(N, N, dtype=torch.bool, device=dev)).expand(B, N, N).contiguous()
        splits = max(1, min(32, ctx // 256))
        runs = [("decode", partial(decode_attention, q, kc, vc, bt, lens, D**-0.5, num_splits=splits))]
        runs.append(("draft", partial(draft_attention, qd, kc, vc, bt, lens, r2r, 1.0, splits)))
        runs.append(("tree_verify", partial(extend_attention, qt, kc, vc, bt, cu, lens, D**-0.5, N, mask)))
        for name, fn in runs:
            ms = do_bench(fn)
            bw = kv_bytes / (ms * 1e-3)
            rows.append(dict(kernel=name, context=ctx, batch=B, ms=ms, bandwidth_tb_s=bw / 1e12))
            rows[-1].update(copy_tb_s=copy_bw / 1e12, fraction_of_copy=bw / copy_bw)
            print(f"{name:12s} ctx {ctx:6d}: {ms:.3f} ms, {bw / 1e12:.2f} TB/s = {bw / copy_bw:.0%} of copy")
    return rows


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("kernel_bench.py needs a CUDA GPU (triton.testing.do_bench)")
    print(json.dumps(kernel_bench()))
