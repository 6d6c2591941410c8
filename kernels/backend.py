"""The kernels' backend switch. Each op in this folder is a Triton kernel plus a pure-torch reference with the
same signature. The folder is imported only as ``nanospec.kernels`` (it has no __init__.py; DESIGN §1), never
as a top-level ``kernels``.

Backend choice: the Triton kernel runs for CUDA tensors, the torch reference for CPU tensors.
``set_backend("triton")`` forces the Triton path everywhere (with ``TRITON_INTERPRET=1`` set before the first
launch, CPU tensors then run through Triton's interpreter); ``set_backend("torch")`` forces the references.
The environment variable ``NANOSPEC_BACKEND`` sets the initial choice. :func:`last_dim_contiguous` is the
layout step the ops' Triton paths share.
"""

import contextlib
import os

import torch

_BACKENDS = ("auto", "torch", "triton")
_backend = os.environ.get("NANOSPEC_BACKEND", "auto")


def set_backend(name: str) -> None:
    """Select the kernel backend: "auto" (Triton on CUDA, torch on CPU), "torch" or "triton".

    Raises ValueError for any other name.
    """
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {name!r}")
    _backend = name


@contextlib.contextmanager
def using_backend(name: str):
    """``with using_backend("torch"): ...`` runs the block on that backend and restores the previous one (the
    trainer uses it: autograd flows through the torch references, not through Triton kernels)."""
    old = _backend
    set_backend(name)
    try:
        yield
    finally:
        set_backend(old)


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a unit stride on the last dim, as the kernels index it (copies only if needed)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def use_triton(t: torch.Tensor) -> bool:
    """True when an op on tensor ``t`` should run its Triton kernel."""
    return _backend == "triton" or (_backend == "auto" and t.is_cuda)
