"""``LLM``'s CPU thread default: one intra-op thread on a machine with at most 2 cores, unless the count was
chosen (``OMP_NUM_THREADS``, ``torch.set_num_threads``, or the command-line tools' start-up probe,
``nanospec.tools.cli.configure_cpu_threads``, which records its choice as ``OMP_NUM_THREADS``). CUDA runs are
never touched.
"""

import os

import torch


def default_cpu_threads() -> int:
    """On a machine with at most 2 cores, set torch's intra-op threads to 1 unless the count was chosen
    (``OMP_NUM_THREADS`` set, by the user or by the tools' start-up probe, or ``torch.set_num_threads``
    called with a value other than the default).

    Why: with 2 threads on 2 cores every op ends in an OpenMP barrier that waits for a thread the OS has
    descheduled whenever anything else runs on the other core; engine throughput measured 0.13-0.42x of one
    thread (OMP_WAIT_POLICY unset), 0.78-1.06x (PASSIVE). Returns the thread count in use.
    """
    cores = os.cpu_count() or 1
    chosen = "OMP_NUM_THREADS" in os.environ  # the user or a tool's start-up probe decided
    if cores <= 2 and not chosen and torch.get_num_threads() == cores:
        torch.set_num_threads(1)
    return torch.get_num_threads()
