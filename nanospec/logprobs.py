"""Logprobs and prompt logprobs (``SamplingParams.logprobs``, ``prompt_logprobs``), a layer beside the core:
the steps hand it the logits that decided their tokens; nothing here runs for a request that asks for none.
The values are vLLM's by default: the log-softmax of the target's raw logits (before temperature, top-k,
top-p), masked by the grammar under structured output."""

import torch

from .kernels.sampling import mask_logits
from .request import Request
from .transfer import HostCopy, to_device


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
    [B, K] (-1: not emitted), or logits [B, V] one token [B] each; ``bitmask`` [B, K, W] (or [B, W]) int32
    (structured output, or None): the logprobs are those of the masked logits."""
    wanted = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
    if not wanted:
        return None
    idx = to_device(wanted, torch.long, logits.device)
    k = max(reqs[i].params.logprobs for i in wanted)
    rows = logits[idx].flatten(0, -2)
    if bitmask is not None:
        rows = mask_logits(rows, bitmask[idx].flatten(0, -2))
    return TokenLogprobs(rows, tokens[idx].clamp(min=0).flatten(), k)


def per_request(logprobs, rows, n: int) -> list:
    """Split ``logprobs``' rows over a batch of ``n`` requests: per request None, or one dict per row it has.
    ``rows``: (batch index, the row tokens, k) per request that has rows, in row order (or None when
    ``logprobs`` is None: no request asked)."""
    out = [None] * n
    if logprobs is None:
        return out
    tokens = [t for _, ids, _ in rows for t in ids]
    ks = [k for _, ids, k in rows for _ in ids]
    dicts = iter(logprobs.dicts(tokens, ks))
    for i, ids, _ in rows:
        out[i] = [next(dicts) for _ in ids]  # its rows, next in row order
    return out


def step_logprobs(reqs: list[Request], out) -> list:
    """A decode or speculative step's (``out``: its ``transfer.StepOutput``, whose ``logprobs`` has
    ``width`` = K rows per request that asked): per request None, or one dict per token it emitted."""
    tokens = out.tokens
    width = out.rows.shape[1] - 1
    rows = [
        (i, (tokens[i] + [0] * width)[:width], r.params.logprobs)  # rows past what it emitted are not read
        for i, r in enumerate(reqs)
        if r.params.logprobs is not None
    ]
    dicts = per_request(out.logprobs, rows, len(reqs))
    return [None if d is None else d[: len(t)] for d, t in zip(dicts, tokens)]


def prefill_logprobs(reqs: list[Request], out) -> tuple[list, list]:
    """A prefill step's (``out``: its ``transfer.PrefillOutput``), per request of the batch: (None, or the
    dict of the first token it emits; None, or one dict per prompt token this chunk scored)."""
    tokens = out.tokens
    asked = [i for i in out.new_idx if reqs[i].params.logprobs is not None]
    firsts = [(i, tokens[i], reqs[i].params.logprobs) for i in asked]  # a new request's first token
    logprobs = per_request(out.logprobs, firsts, out.num_reqs)
    prompt_logprobs = per_request(out.prompt_logprobs, out.prompt_logprob_rows, out.num_reqs)
    return logprobs, prompt_logprobs


def score_prompts(model, batch, hidden: torch.Tensor, last: list[int]) -> tuple:
    """``SamplingParams.prompt_logprobs``: the logprobs of the prompt tokens a prefill ``batch``'s rows
    predict (the row at position p scores token p + 1; ``hidden`` [T, H]: the target's hidden of every row,
    ``last``: each request's last row, ``model.compute_logits`` their logits), as ``PrefillOutput``'s
    (``prompt_logprobs``, ``prompt_logprob_rows``); (None, None) when no request asks. A request recomputed
    after preemption was scored in its first prefill."""
    rows = []
    scored = []
    for i, (req, n) in enumerate(zip(batch.reqs, batch.num_new)):
        if req.params.prompt_logprobs is None or req.output_token_ids:
            continue
        start = req.num_computed_tokens
        count = min(start + n, len(req.prompt_token_ids) - 1) - start
        first_row = last[i] - n + 1
        rows += range(first_row, first_row + count)
        scored.append((i, req.prompt_token_ids[start + 1 : start + 1 + count], req.params.prompt_logprobs))
    if not rows:
        return None, None
    tokens = to_device([t for _, ids, _ in scored for t in ids], torch.int64, hidden.device)
    logits = model.compute_logits(hidden[to_device(rows, torch.int64, hidden.device)])
    return TokenLogprobs(logits, tokens, max(k for _, _, k in scored)), scored
