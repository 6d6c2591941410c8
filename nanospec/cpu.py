"""The CPU thread policy: how many intra-op threads torch uses, decided once per process, here only.

Two ways in, one decision. A script may probe at start-up (:func:`configure_cpu_threads`: example.py,
bench.py, the server and the tools do); ``LLM`` then applies its own default (:func:`default_cpu_threads`: one
thread on a machine with at most 2 cores) only when neither a probe nor the user (``OMP_NUM_THREADS``,
``torch.set_num_threads``) chose. CUDA runs are never touched.
"""

import os
import sys
import time

import torch
import torch.nn.functional as F

_probed = False  # configure_cpu_threads ran in this process: its thread count stands


def _time_small_gemms(threads: int, limit_s: float, reps: int = 10) -> float:
    """Seconds for ``reps`` MLP blocks of SmolLM2's width on 16 rows (a decode step's op sizes) with
    ``threads`` threads; stops early (returning what it took so far) once past ``limit_s``."""
    torch.set_num_threads(threads)
    x = torch.full((16, 576), 0.1)
    w_up = torch.full((1536, 576), 0.01)
    w_down = torch.full((576, 1536), 0.01)
    F.linear(x, w_up)
    t0 = time.perf_counter()
    for _ in range(reps):
        F.linear(F.silu(F.linear(x, w_up)), w_down)
        if time.perf_counter() - t0 > limit_s:
            break
    return time.perf_counter() - t0


def configure_cpu_threads(probe=_time_small_gemms) -> int:
    """Pick torch's intra-op CPU thread count for this process at start-up and return it.

    With torch's default (one OpenMP thread per core), every op of a small model ends on a barrier that waits
    for the slowest thread; when other processes keep a core busy, that thread waits for a time slice and
    decoding slows down 5-20x (measured on a loaded 2-core machine: `python example.py` 0.9-3 tok/s with 2
    threads, 10-16 with one; idle, 31 vs 21). So 1, 2, 4 ... up to the current count n threads are timed on
    decode-sized GEMMs (``probe(threads, limit_s) -> seconds``, giving up past ``limit_s``; tens of ms, ~1 s
    on a loaded machine) and the most threads that are not 25% slower than fewer are kept; fewer than n is
    printed on stderr. Nothing changes when n is 1, when OMP_NUM_THREADS / MKL_NUM_THREADS set it, or when
    CUDA is available (GPU runs barely use the CPU).
    """
    global _probed
    _probed = True  # LLM's own default (default_cpu_threads) then leaves the count alone
    n = torch.get_num_threads()
    if n == 1 or torch.cuda.is_available() or {"OMP_NUM_THREADS", "MKL_NUM_THREADS"} & os.environ.keys():
        return n
    best = 1
    best_seconds = probe(1, float("inf"))
    threads = 1
    while threads < n:  # more threads unless clearly slower (idle, 2 threads decode ~1.5x faster than one)
        threads = min(2 * threads, n)
        seconds = probe(threads, 1.25 * best_seconds)
        if seconds < 1.25 * best_seconds:
            best = threads
            best_seconds = seconds
    torch.set_num_threads(best)
    if best < n:
        print(
            f"nanospec: {best} torch thread(s), not {n}: more were slower just now (other processes keep "
            "the CPU busy); set OMP_NUM_THREADS to choose",
            file=sys.stderr,
            flush=True,
        )
    return best


def default_cpu_threads() -> int:
    """On a machine with at most 2 cores, set torch's intra-op threads to 1 unless the count was chosen
    (``OMP_NUM_THREADS`` set, ``torch.set_num_threads`` called with a value other than the default, or
    :func:`configure_cpu_threads` run first, as example.py and bench.py do: their start-up probe decides).

    Why: with 2 threads on 2 cores every op ends in an OpenMP barrier that waits for a thread the OS has
    descheduled whenever anything else runs on the other core; engine throughput measured 0.13-0.42x of one
    thread (OMP_WAIT_POLICY unset), 0.78-1.06x (PASSIVE). Returns the thread count in use.
    """
    cores = os.cpu_count() or 1
    chosen = _probed or "OMP_NUM_THREADS" in os.environ  # a script's probe or the user decided
    if cores <= 2 and not chosen and torch.get_num_threads() == cores:
        torch.set_num_threads(1)
    return torch.get_num_threads()
