"""What a launched step leaves for the host: its tokens (and logprobs) still on the device, each with one host
copy queued at launch and read when the step commits (overlap scheduling commits step n after launching step
n + 1, so reading step n waits for step n only)."""

from dataclasses import dataclass

import torch

from .kernels.sampling import mask_logits
from .request import Request
from .transfer import to_device


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


class TokenLogprobs:
    """Logprobs of R tokens: the log-softmax of the target's raw logits (before temperature, top-k, top-p;
    vLLM's default) at each token, and its top ``k`` entries, computed on the device, copied to the host.

    logits [R, V]: the rows that decided the tokens; tokens [R] int64.
    """

    def __init__(self, logits: torch.Tensor, tokens: torch.Tensor, k: int):
        lp = torch.log_softmax(logits.float(), dim=-1)
        chosen = lp.gather(1, tokens[:, None]).squeeze(1)
        top_values, top_ids = lp.topk(k, dim=-1)
        self.copies = [HostCopy(chosen), HostCopy(top_ids), HostCopy(top_values)]

    def dicts(self, tokens: list[int], ks: list[int]) -> list[dict[int, float]]:
        """One dict per row: {token id: logprob} of its top ``ks[r]`` in descending order, then its token if
        it is not among them."""
        chosen, top_ids, top_values = (c.tolist() for c in self.copies)
        out = []
        for c, ids, values, token, k in zip(chosen, top_ids, top_values, tokens, ks):
            # a token a grammar forbids (logprob -inf) is not among the top ones
            entry = {i: v for i, v in zip(ids[:k], values[:k]) if v > float("-inf")}
            entry.setdefault(token, c)
            out.append(entry)
        return out


def emitted_logprobs(reqs: list[Request], logits: torch.Tensor, tokens: torch.Tensor, bitmask=None):
    """``TokenLogprobs`` of the tokens a step may emit for the requests that asked
    (``SamplingParams.logprobs``), or None when none did (nothing computed). logits [B, K, V] decided tokens
    [B, K] (-1: not emitted); ``bitmask`` [B, K, W] int32 (structured output, or None): the logprobs are
    those of the masked logits."""
    wanted = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
    if not wanted:
        return None
    idx = to_device(wanted, torch.long, logits.device)
    k = max(reqs[i].params.logprobs for i in wanted)
    rows = logits[idx].flatten(0, 1)
    if bitmask is not None:
        rows = mask_logits(rows, bitmask[idx].flatten(0, 1))
    return TokenLogprobs(rows, tokens[idx].clamp(min=0).flatten(), k)


def logprobs_per_request(logprobs, reqs, tokens: list[list[int]], width: int) -> list:
    """Split ``emitted_logprobs``' rows (``width`` per request that asked) over the batch: per request None,
    or one dict per token it emitted (``tokens[i]``)."""
    out = [None] * len(reqs)
    if logprobs is None:
        return out
    wanted = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
    row_tokens = []
    ks = []
    for i in wanted:
        row_tokens += (tokens[i] + [0] * width)[:width]  # rows past what a request emitted are not read
        ks += [reqs[i].params.logprobs] * width
    dicts = logprobs.dicts(row_tokens, ks)
    for j, i in enumerate(wanted):
        out[i] = dicts[j * width : j * width + len(tokens[i])]
    return out


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
