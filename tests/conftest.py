import os

# Triton's interpreter must be chosen before any kernel is first launched; CPU tensors only run through it.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def triton_backend():
    """Force every kernel through Triton (the interpreter on CPU) for one test."""
    from nanospec.kernels import get_backend, set_backend

    old = get_backend()
    set_backend("triton")
    yield
    set_backend(old)
