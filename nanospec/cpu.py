"""CPU-only tuning: the fp32 GEMM of a few rows, and the thread count set once when the engine is built.

``F.linear(x, w)`` with a row-major ``w`` [N, K] and a few rows of ``x`` hands MKL's fp32 GEMM a wide product
whose small-m kernel reads the weight about once per row: the GEMMs of a SmolLM2-135M forward (its 30 layers
and the LM head, one thread, weights out of cache) measured 34-36 ms at 1 row, 58-67 ms at 2, 82-87 ms at 3,
44-57 ms at 4 (its kernel choice steps with the row count). The same product taken the other way round, ``(w @
x.t()).t()`` with ``x`` contiguous (so ``x.t()`` is column-major) and an even row count, streams the weight
once: 25-27 ms at 1 or 2 rows, 30-33 ms at 4, 56-57 ms at 6; past 6 rows it is no faster than ``F.linear``.
(Column-major weights, kept here before, gave 25 ms at 1 row but 41-48 ms at 2.) A verify step of s + 1 <= 4
rows then costs about what a decode row costs (6 rows about twice), which is what lets speculation pay on a
CPU. CUDA and other dtypes are never touched.
"""

import os

import torch
import torch.nn.functional as F

from . import loader

FEW_ROWS = 6  # the most rows that take the transposed product (measured above)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (x [..., K], weight [N, K], bias [N] or None -> [..., N], x's dtype); an
    fp32 CPU ``x`` of at most ``FEW_ROWS`` rows is computed as ``(weight @ x.t()).t()`` over an even number
    of rows (the last row repeated), equal to ``F.linear`` to fp32 rounding (module docstring: why)."""
    rows = x.reshape(-1, x.shape[-1])
    m = len(rows)
    if x.device.type != "cpu" or x.dtype != torch.float32 or not 0 < m <= FEW_ROWS:
        return F.linear(x, weight, bias)
    if m % 2:
        rows = torch.cat([rows, rows[-1:]])
    out = (weight @ rows.contiguous().t()).t()[:m].contiguous()
    out = out if bias is None else out + bias
    return out.view(*x.shape[:-1], -1)


def default_cpu_threads() -> int:
    """On a machine with at most 2 cores, set torch's intra-op threads to 1 unless the user chose a count
    (``OMP_NUM_THREADS`` set, ``torch.set_num_threads`` called with a value other than the default, or
    ``loader.configure_cpu_threads`` run first, as example.py and bench.py do: their start-up probe decides).

    Why: with 2 threads on 2 cores every op ends in an OpenMP barrier that waits for a thread the OS has
    descheduled whenever anything else runs on the other core; engine throughput measured 0.13-0.42x of one
    thread (OMP_WAIT_POLICY unset), 0.78-1.06x (PASSIVE). Returns the thread count in use.
    """
    cores = os.cpu_count() or 1
    chosen = loader.THREADS_CHOSEN or "OMP_NUM_THREADS" in os.environ  # a script's probe or the user decided
    if cores <= 2 and not chosen and torch.get_num_threads() == cores:
        torch.set_num_threads(1)
    return torch.get_num_threads()


def prepare_cpu_engine(device: torch.device) -> None:
    """What ``LLM`` runs once on CPU: :func:`default_cpu_threads`. Does nothing on CUDA."""
    if device.type == "cpu":
        default_cpu_threads()
