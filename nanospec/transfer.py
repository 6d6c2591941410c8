"""The step path's transfers between host and device, in one place (DESIGN §5, "Overlap scheduling"):
``to_device`` for everything a step sends, ``HostCopy`` for what the host reads back from a step.

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


class HostCopy:
    """A device tensor's values for the host, copied without blocking the stream: on CUDA a non-blocking copy
    into pinned memory and an event, queued when the step is launched, so reading it later (``tolist``) waits
    for that step only, never for the steps launched after it (overlap scheduling). On CPU the tensor
    itself."""

    def __init__(self, t: torch.Tensor):
        self.t = t
        self.event = None
        if t.is_cuda:
            self.t = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.t.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def tolist(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.t.tolist()
