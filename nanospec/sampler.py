"""Sampling for the target: the requests' sampling parameters as device tensors, and the tokens rows produce.

Every token a request produces is ``kernels.sampling.sample``'s position-keyed Gumbel argmax: a function of
the request's seed, the token's absolute position and the target's logits at that row, whatever step, batch
or draft produced the row (DESIGN §5, "Seeds").
"""

import torch

from .kernels.sampling import mask_logits, sample
from .request import Request
from .transfer import to_device


def sampling_tensors(reqs: list[Request], device) -> tuple[torch.Tensor, ...]:
    """(temperature [B] fp32, top_k [B] int32, top_p [B] fp32, seeds [B] int64) of ``reqs``, on ``device``."""
    temperature = to_device([r.params.temperature for r in reqs], torch.float32, device)
    top_k = to_device([r.params.top_k for r in reqs], torch.int32, device)
    top_p = to_device([r.params.top_p for r in reqs], torch.float32, device)
    seeds = to_device([r.seed for r in reqs], torch.int64, device)
    return temperature, top_k, top_p, seeds


def sample_tokens(
    reqs: list[Request], logits: torch.Tensor, positions: torch.Tensor, bitmask=None
) -> torch.Tensor:
    """The token each row produces [B] int64, from logits [B, V]; ``positions`` [B] int64 are the absolute
    positions of those tokens; ``bitmask`` [B, W] int32 (structured output) the tokens each row may produce,
    or None. A batch of greedy rows only takes the argmax (no parameter tensors)."""
    if all(r.params.greedy for r in reqs):
        return mask_logits(logits, bitmask).argmax(-1)
    return sample(logits, *sampling_tensors(reqs, logits.device), positions, bitmask=bitmask)
