"""The step path's host-to-device transfers, in one place (DESIGN §5, "Overlap scheduling").

Everything a step sends to the device (the blocks a step adds to the block tables and the rows it gathers,
next-input row indices, sampling parameters, prefill token ids, positions and row indices) is made by
``to_device``. On CUDA the host values are staged in pinned memory and copied with ``non_blocking=True`` on
the current stream: the host does not wait, and the copy is ordered before every kernel launched after it, so
nothing reads it before it lands. A copy from pageable memory would instead wait for the stream, that is for
the step in flight, and overlap scheduling could not plan step n + 1 while step n runs. PyTorch's caching host
allocator keeps a pinned buffer until the copy reading it has run. On a CPU it is ``torch.tensor``.
"""

import torch


def to_device(data, dtype: torch.dtype, device) -> torch.Tensor:
    """``data`` (a number, a nested list or a host tensor) as a tensor of ``dtype`` on ``device``, sent
    without blocking the host."""
    if isinstance(data, torch.Tensor):
        data = data.to(dtype)
        if torch.device(device).type != "cuda":
            return data.to(device)
        return data.pin_memory().to(device, non_blocking=True)
    if torch.device(device).type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
