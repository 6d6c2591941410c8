"""CPU-only tuning applied once when the engine is built: the fp32 GEMM weight layout and the thread count.

``F.linear(x, w)`` multiplies by ``w.t()``. With a row-major ``w`` [N, K], MKL's fp32 GEMM takes its
transposed-B path, whose cost steps up every 3 rows of ``x`` (4-15 rows measured 1.3-2.4x slower than the same
product with a contiguous ``w.t()``; equal at 1 row, 0.8x at 2-3 rows, equal from ~256 rows). Storing
``w`` column-major (the same [N, K] tensor with strides (1, N)) hands MKL the plain kernel with no change to
any model code: verify (B*N rows), batched decode and top-k drafting get faster. CUDA is never touched.
"""
import os

import torch
from torch import nn

from . import loader


def gemm_layout(w: torch.Tensor) -> torch.Tensor:
    """``w`` [N, K] with the same values stored column-major (strides (1, N)) if it is a 2-D fp32 CPU tensor;
    any other tensor (CUDA, other dtypes, other ranks, already column-major) is returned unchanged.

    ``F.linear(x, gemm_layout(w))`` equals ``F.linear(x, w)`` to fp32 rounding (another summation order).
    """
    if w.device.type != "cpu" or w.dtype != torch.float32 or w.dim() != 2 or w.stride() == (1, w.shape[0]):
        return w
    return w.t().contiguous().t()


def use_cpu_gemm_layout(*models: nn.Module) -> int:
    """Re-lay out in place, through :func:`gemm_layout`, the weight of every ``nn.Linear`` in ``models`` and
    the ``lm_head_weight`` of a model that has one (the target's tied embedding is its LM head), except a
    centroid LM head (``rows_gathered``), whose cluster rows are gathered, not multiplied whole.

    Call it before anything keeps an alias of a weight (the assistant's ``bind_target`` takes the target's LM
    head). Returns how many weights changed: 0 on CUDA or for non-fp32 models.
    """
    weights = {}
    for model in models:
        for m in model.modules():
            if isinstance(m, nn.Linear) and not getattr(m, "rows_gathered", False):
                weights[id(m.weight)] = m.weight
        head = getattr(model, "lm_head_weight", None)
        if isinstance(head, nn.Parameter):
            weights[id(head)] = head
    changed = 0
    for p in weights.values():
        old = p.data  # each .data access is a new alias: compare against one
        new = gemm_layout(old)
        if new is not old:
            p.data = new
            changed += 1
    return changed


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


def prepare_cpu_engine(device: torch.device, *models: nn.Module) -> None:
    """What ``LLM`` runs once on CPU before the KV pool exists: :func:`default_cpu_threads` and
    :func:`use_cpu_gemm_layout` of the target and the drafter. Does nothing on CUDA."""
    if device.type != "cpu":
        return
    default_cpu_threads()
    use_cpu_gemm_layout(*models)
