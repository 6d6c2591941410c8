"""What a launched step leaves for the host: its tokens (and logprobs) still on the device, each with one host
copy queued at launch and read when the step commits (overlap scheduling commits step n after launching step
n + 1, so reading step n waits for step n only)."""

from dataclasses import dataclass

import torch

from .logprobs import TokenLogprobs, logprobs_per_request
from .request import Request
from .transfer import HostCopy


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
    logprobs: TokenLogprobs | None = None
    _host: list | None = None

    def __post_init__(self):
        self._copy = HostCopy(self.rows)

    def _rows(self) -> list[list[int]]:
        if self._host is None:
            self._host = self._copy.tolist()
        return self._host

    @property
    def tokens(self) -> list[list[int]]:
        return [row[1 : 1 + row[0]] for row in self._rows()]

    @property
    def accept_lengths(self) -> list[int]:
        return [row[0] for row in self._rows()]

    def token_logprobs(self, reqs: list[Request]) -> list:
        """Per request of the step: None, or one logprob dict per token it emitted."""
        return logprobs_per_request(self.logprobs, reqs, self.tokens, self.rows.shape[1] - 1)


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
    done: list[Request]
    bonus: torch.Tensor
    hidden: torch.Tensor
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None
    prompt_logprob_rows: list | None = None  # (batch index, prompt token ids scored, k) per request

    def __post_init__(self):
        self._copy = HostCopy(self.bonus)  # queued at launch: reading it waits for this step only

    @property
    def tokens(self) -> list[list[int]]:
        out = [[] for _ in range(self.num_reqs)]
        if self.new_idx:
            toks = self._copy.tolist()
            for j, i in enumerate(self.done_idx):
                if i in self.new_idx:
                    out[i] = [toks[j]]
        return out

    def token_logprobs(self, reqs: list[Request]) -> list:
        """Per request of the batch: None, or the logprob dict of the first token it emits."""
        new = [reqs[i] for i in self.new_idx]
        firsts = logprobs_per_request(self.logprobs, new, [t for t in self.tokens if t], 1)
        out = [None] * self.num_reqs
        for i, entry in zip(self.new_idx, firsts):
            out[i] = entry
        return out

    def prompt_token_logprobs(self) -> list:
        """Per request of the batch: None, or one logprob dict per prompt token this chunk scored."""
        out = [None] * self.num_reqs
        if self.prompt_logprobs is None:
            return out
        tokens = [t for _, ids, _ in self.prompt_logprob_rows for t in ids]
        ks = [k for _, ids, k in self.prompt_logprob_rows for _ in ids]
        dicts = self.prompt_logprobs.dicts(tokens, ks)
        start = 0
        for i, ids, _ in self.prompt_logprob_rows:
            out[i] = dicts[start : start + len(ids)]
            start += len(ids)
        return out
