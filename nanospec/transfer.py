"""The step path's transfers between host and device, in one place (DESIGN §5, "Overlap scheduling"):
``to_device`` for everything a step sends, ``HostCopy`` for what the host reads back from a step, and the
outputs a launched step leaves for the host (``StepOutput``, ``PrefillOutput``): its tokens (and logprobs)
still on the device, each with one host copy queued at launch and read when the step commits (overlap
scheduling commits step n after launching step n + 1, so reading step n waits for step n only).

Everything a step sends to the device (the blocks a step adds to the block tables and the rows it gathers,
next-input row indices, sampling parameters, prefill token ids, positions and row indices) is made by
``to_device``. On CUDA the host values are staged in pinned memory and copied with ``non_blocking=True`` on
the current stream: the host does not wait, and the copy is ordered before every kernel launched after it, so
nothing reads it before it lands. A copy from pageable memory would instead wait for the stream, that is for
the step in flight, and overlap scheduling could not plan step n + 1 while step n runs. PyTorch's caching host
allocator keeps a pinned buffer until the copy reading it has run. On a CPU it is ``torch.tensor``.
"""

from dataclasses import dataclass
from functools import cached_property

import torch


def to_device(data, dtype: torch.dtype, device) -> torch.Tensor:
    """``data`` (a number, a nested list or a host tensor) as a tensor of ``dtype`` on ``device``, sent
    without blocking the host."""
    data = torch.as_tensor(data, dtype=dtype)
    if torch.device(device).type != "cuda":
        return data.to(device)
    return data.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """A device tensor's values for the host, copied without blocking the stream: on CUDA a non-blocking copy
    into pinned memory and an event, queued when the step is launched, so reading it later (``tolist``) waits
    for that step only, never for the steps launched after it (overlap scheduling). On CPU the tensor
    itself."""

    def __init__(self, t: torch.Tensor):
        self.t = t
        self.event = None
        if t.is_cuda:
            self.t = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def tolist(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.t.tolist()


@dataclass
class StepOutput:
    """What a decode step emits, still on the device: ``rows`` [B, 1 + K] int64 = (accept_length, then that
    many tokens: the accepted drafts and the bonus token; plain decode: 1 and the sampled token). ``tokens``
    and ``accept_lengths`` read the step's one host copy (``HostCopy``, queued at launch) on first use;
    ``logprobs``: ``emitted_logprobs`` of the step (K rows per request that asked), or None."""

    rows: torch.Tensor
    draft_length: int = 0  # this step's draft steps s (0: plain decode, or a verify of the bonus token alone)
    num_drafted: int = 0  # draft tokens it verified per request (tree nodes but the root; 0 when s is 0)
    timer: object = None  # the step's StepTimer (speculation), read when the step commits
    sampled: bool = False  # a row of the step sampled (the draft-length policy books it apart)
    logprobs: object = None  # logprobs.TokenLogprobs, or None

    def __post_init__(self):
        self._copy = HostCopy(self.rows)

    @cached_property
    def _rows(self) -> list[list[int]]:
        return self._copy.tolist()

    @property
    def tokens(self) -> list[list[int]]:
        return [row[1 : 1 + row[0]] for row in self._rows]

    @property
    def accept_lengths(self) -> list[int]:
        return [row[0] for row in self._rows]


@dataclass
class PrefillOutput:
    """A prefill step's results, still on the device. ``done``: the requests whose prefill ended; ``bonus``
    [len(done)] int64: each one's newest token (sampled now for a new request, its last output for a resumed
    one): the bonus token of its first draft; ``hidden`` [len(done), H]: the target's hidden at its last row;
    ``tokens`` (host, on first use): what each request of the batch emits (its first token, or nothing).
    ``logprobs``: ``emitted_logprobs`` of the new requests' first tokens; ``prompt_logprobs``: the logprobs of
    the prompt tokens this chunk scored, for requests with ``SamplingParams.prompt_logprobs``
    (``prompt_logprob_rows`` says which rows are whose)."""

    num_reqs: int
    done_idx: list[int]
    new_idx: list[int]
    done: list  # of Request
    bonus: torch.Tensor
    hidden: torch.Tensor
    logprobs: object = None  # logprobs.TokenLogprobs, or None
    prompt_logprobs: object = None  # logprobs.TokenLogprobs, or None
    prompt_logprob_rows: list | None = None  # (batch index, prompt token ids scored, k) per request

    def __post_init__(self):
        self._copy = HostCopy(self.bonus)  # queued at launch: reading it waits for this step only

    @property
    def tokens(self) -> list[list[int]]:
        out = [[] for _ in range(self.num_reqs)]
        if self.new_idx:
            toks = self._copy.tolist()
            for i in self.new_idx:
                out[i] = [toks[self.done_idx.index(i)]]  # its first token: its bonus, in done order
        return out
