"""Adaptive draft length (DESIGN §3, "Draft length"): each speculative step the worker asks ``DraftLength``
for the number of draft steps s in 0..num_steps (0: a plain decode step through the verify path) that
maximises expected committed tokens per second, E(s) / cost(s, B), from the acceptance and step times it
has measured."""

import time
from collections import Counter

import torch


class StepTimer:
    """The duration of one launched step, read after its results reached the host: CUDA events on CUDA (no
    extra sync: the step's host copy has already waited for it), the host clock elsewhere (the CPU runs the
    step inside its launch)."""

    def __init__(self, device: torch.device):
        self.events = device.type == "cuda"
        self.start = torch.cuda.Event(enable_timing=True) if self.events else time.perf_counter()
        if self.events:
            self.start.record()

    def stop(self) -> "StepTimer":
        self.end = torch.cuda.Event(enable_timing=True) if self.events else time.perf_counter()
        if self.events:
            self.end.record()
        return self

    def seconds(self) -> float:
        if not self.events:
            return self.end - self.start
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3


class DraftLength:
    """Chooses s per step from ``candidates`` (0..num_steps for chains; 0 and num_steps for trees).

    E(s) = 1 + sum_{i<=s} prod_{j<=i} a_j, where a_j is the running rate at which a draft at position j is
    accepted when reached (prior 1/2; every step decays all counts by ``decay``, so a position not drafted for
    a while weighs little against its next probe). A step's seconds are modelled as pace(B) x cost(s, B) per
    batch-size bucket B (powers of two): pace, how much longer than their costs steps take now, is a running
    mean of weight ``beta`` of every step's seconds / cost (step times drift together over tens of steps:
    other processes, longer contexts), so a slow phase met while one s runs is not booked as that s being
    slow; pace cancels out of the choice and scales only the tokens/s estimate. cost(s, B) is the running
    mean of seconds / pace at that s: the plain mean of its first 1 / ``alpha`` steps, then weight ``alpha``
    per step. From its 5th sample on, a cost's sample (and every pace sample) is first clipped to within
    ``clip`` x the mean it updates: one step's time on a CPU varies by 20 % and a few take twice the median,
    and an s whose cost one such step inflated would not be run (nor re-measured) until its next probe.
    Warm-up: a bucket first tries every candidate once, largest first. Probing: every ``probe_every``-th step
    of a bucket runs its least recently measured candidate, so a change in the text or in costs is noticed.
    A bucket is (power-of-two batch size, sampled): a batch with a sampled row accepts less often and runs
    the sampling passes, so its acceptance counts and costs are kept apart from all-greedy batches.
    ``adaptive=False``: always num_steps. ``counts``: steps per s.
    """

    def __init__(
        self,
        candidates: list[int],
        adaptive: bool = True,
        decay: float = 0.95,
        alpha: float = 0.02,
        probe_every: int = 16,
        beta: float = 0.25,
        clip: float = 1.2,
    ):
        self.candidates = candidates
        self.adaptive = adaptive
        self.decay = decay
        self.alpha = alpha
        self.probe_every = probe_every
        self.beta = beta
        self.clip = clip
        self.pace: dict[tuple[int, bool], float] = {}
        # decayed acceptance counts per draft position, for greedy (False) and sampled (True) batches
        self.hits = {sampled: [0.0] * (max(candidates) + 1) for sampled in (False, True)}
        self.tries = {sampled: [0.0] * (max(candidates) + 1) for sampled in (False, True)}
        self.cost: dict[tuple[int, tuple[int, bool]], float] = {}
        self.measured_at: dict[tuple[int, tuple[int, bool]], int] = {}
        self.num_measured: Counter = Counter()  # steps timed per (s, bucket)
        self.steps: Counter = Counter()  # steps chosen per bucket
        self.counts: Counter = Counter()

    def expected_accept(self, s: int, sampled: bool = False) -> float:
        """E(s): expected tokens committed per request by a step drafting s tokens."""
        hits = self.hits[sampled]
        tries = self.tries[sampled]
        e = 1.0
        p = 1.0
        for j in range(1, s + 1):
            p *= (hits[j] + 0.5) / (tries[j] + 1.0)
            e += p
        return e

    def choose(self, batch_size: int, sampled: bool = False) -> tuple[int, float | None]:
        """(s, estimated tokens per second per request, None while warming up or probing) for a batch of
        ``batch_size`` requests, ``sampled`` if any of them samples."""
        b = (1 << (batch_size - 1).bit_length(), sampled)
        self.steps[b] += 1
        todo = [s for s in self.candidates if (s, b) not in self.cost]
        if not self.adaptive or todo:
            s = self.candidates[-1] if not self.adaptive else todo[-1]
        elif self.steps[b] % self.probe_every == 0:
            s = min(self.candidates, key=lambda c: self.measured_at[c, b])
        else:
            s = max(self.candidates, key=lambda c: self.expected_accept(c, sampled) / self.cost[c, b])
            self.counts[s] += 1
            return s, self.expected_accept(s, sampled) / (self.cost[s, b] * self.pace[b])
        self.counts[s] += 1
        return s, None

    def observe(
        self, s: int, batch_size: int, accept_lengths: list[int], seconds: float, sampled: bool = False
    ) -> None:
        """Book a committed step: its draft length, batch size, accept lengths, measured seconds, and whether
        a row of it sampled."""
        b = (1 << (batch_size - 1).bit_length(), sampled)
        key = (s, b)
        pace = self.pace.get(b, 1.0)
        self.num_measured[key] += 1
        seconds = max(seconds, 1e-9)  # a zero reading must not zero a cost
        old = self.cost.get(key, seconds / pace)
        clip = self.clip if self.num_measured[key] > 4 else float("inf")  # no mean to clip to yet
        rel = min(max(seconds / pace, old / clip), old * clip)
        self.cost[key] = old + max(self.alpha, 1 / self.num_measured[key]) * (rel - old)
        ratio = min(max(seconds / self.cost[key], pace / self.clip), pace * self.clip)
        self.pace[b] = pace + self.beta * (ratio - pace)
        self.measured_at[key] = self.steps[b]
        hits = self.hits[sampled]
        tries = self.tries[sampled]
        for j in range(1, len(hits)):
            tries[j] = self.decay * tries[j] + sum(a >= j for a in accept_lengths) * (j <= s)
            hits[j] = self.decay * hits[j] + sum(a > j for a in accept_lengths) * (j <= s)
