"""The GEMMs of one SmolLM2-135M forward on a CPU, fp32, one thread, four ways (``kernels/matmul.py``):
``F.linear``; ``matmul.linear`` without a oneDNN weight (the transposed product up to 6 rows);
``matmul.linear`` with one (oneDNN's GEMM from 3 rows on); and oneDNN's GEMM alone at every row count. The
weights are random, one set per layer, so they come from memory as in a real forward, not from cache. Prints
milliseconds per forward, the best of ``--repeats`` passes, the four ways alternating.

    OMP_NUM_THREADS=1 python scripts/cpu_gemm.py --rows 1 2 3 4 6 8 16 64
"""

import argparse
import time

import torch
import torch.nn.functional as F

from nanospec.kernels import matmul

# SmolLM2-135M: q|k|v, o, gate|up, down per layer ([N, K]); 30 layers; the LM head
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
NUM_LAYERS = 30
LM_HEAD = (49152, 576)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    shapes = LAYER * NUM_LAYERS + [LM_HEAD]
    weights = [torch.randn(shape, generator=g) * 0.02 for shape in shapes]
    onednn = [matmul.to_onednn(w) for w in weights]
    ways = {
        "F.linear": lambda x, w, o: F.linear(x, w),
        "linear": lambda x, w, o: matmul.linear(x, w),
        "linear + oneDNN weight": lambda x, w, o: matmul.linear(x, w, onednn_weight=o),
        "oneDNN alone": lambda x, w, o: torch.ops.mkldnn._linear_pointwise(x, o, None, "none", [], ""),
    }
    print(f"ms per forward's GEMMs (torch {torch.__version__}, 1 thread, best of {args.repeats})")
    for m in args.rows:
        inputs = [torch.randn(m, w.shape[1], generator=g) for w in weights]
        best = dict.fromkeys(ways, float("inf"))
        for _ in range(args.repeats):
            for name, fn in ways.items():
                t0 = time.perf_counter()
                for x, w, o in zip(inputs, weights, onednn):
                    fn(x, w, o)
                best[name] = min(best[name], (time.perf_counter() - t0) * 1e3)
        print(f"{m:3d} rows: " + ", ".join(f"{name} {ms:.1f}" for name, ms in best.items()))


if __name__ == "__main__":
    main()
