"""Sampling for the target: per-request parameter tensors, seeded noise, and the sample itself."""

import torch

from .kernels.sampling import sample
from .request import Request


class Sampler:
    """Turns logits into tokens for a batch of requests; used by the model runner (prefill, decode) and by the
    Frozen-KV MTP worker (verify), which both pass the requests explicitly.

    Noise comes from the engine generator (``seed``), or for a request with ``SamplingParams.seed`` from its
    own generator keyed by (seed, sampling-call index), so its samples do not depend on the batch it runs in
    nor on the schedule: the index counts the request's sampling calls launched before this one (its prefill's
    first token, then one per decode or verify step), which the host knows before any earlier step commits.
    """

    def __init__(self, device: torch.device, seed: int):
        self.device, self.generator = device, torch.Generator(device).manual_seed(seed)

    def tensors(self, reqs: list[Request]):
        """(temperature [B] fp32, top_k [B] int32, top_p [B] fp32) of the requests' SamplingParams."""
        p = [r.params for r in reqs]
        temperature = torch.tensor([x.temperature for x in p], dtype=torch.float32)
        top_k = torch.tensor([x.top_k for x in p], dtype=torch.int32)
        top_p = torch.tensor([x.top_p for x in p], dtype=torch.float32)
        return tuple(t.to(self.device, non_blocking=True) for t in (temperature, top_k, top_p))

    def noise(self, reqs: list[Request], width: int) -> torch.Tensor:
        """Uniform (0, 1) noise [len(reqs), width] fp32."""
        u = torch.rand(len(reqs), width, generator=self.generator, device=self.device)
        for i, r in enumerate(reqs):
            if r.params.seed is not None:
                key = (r.params.seed * 1_000_003 + r.num_samples_launched) % 2**63
                g = torch.Generator(self.device).manual_seed(key)
                u[i] = torch.rand(width, generator=g, device=self.device)
        return u.clamp_(min=1e-20)

    def sample(self, reqs: list[Request], logits: torch.Tensor) -> torch.Tensor:
        """Next token per request [B] int64 from logits [B, V]: argmax when every row is greedy, else
        temperature / top-k / top-p sampling (``kernels.sampling.sample``)."""
        if all(r.params.greedy for r in reqs):
            return logits.argmax(-1)
        temperature, top_k, top_p = self.tensors(reqs)
        return sample(logits, temperature, top_k, top_p, self.noise(reqs, logits.shape[-1]))
