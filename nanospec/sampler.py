"""Sampling for the target: the tokens rows produce.

Every token a request produces is ``kernels.sampling.sample``'s position-keyed Gumbel argmax: a function of
the request's seed, the token's absolute position and the target's logits at that row, whatever step, batch
or draft produced the row (DESIGN §5, "Seeds").
"""

import torch

from .kernels.sampling import mask_logits, sample
from .request import Request


def sample_tokens(
    reqs: list[Request], logits: torch.Tensor, positions: torch.Tensor, persistent_batch, bitmask=None
) -> torch.Tensor:
    """The token each row produces [B] int64, from logits [B, V]; ``positions`` [B] int64 are the absolute
    positions of those tokens; the requests' sampling parameters come from their rows in
    ``persistent_batch`` (``PersistentBatch.sampling``); ``bitmask`` [B, W] int32 (structured output) the
    tokens each row may produce, or None. A batch of greedy rows only takes the argmax (no parameters)."""
    if all(r.params.greedy for r in reqs):
        return mask_logits(logits, bitmask).argmax(-1)
    return sample(logits, *persistent_batch.sampling(reqs), positions, bitmask=bitmask)
