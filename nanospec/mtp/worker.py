"""Frozen-KV MTP worker: the one owner of the drafter, its CUDA graphs and its draft-length policy.

The lifecycle, hook by hook, in the order ``LLM`` calls them (DESIGN §4 rule in brackets). Each request's next
input (bonus token, committed length, seed hidden: what its next draft starts from) lives in its row of
``LLM``'s ``PersistentBatch``, beside its block table and sampling parameters: born at the end of the
request's prefill, dropped at its release; a step reads and replaces it there.

1. ``FrozenKVMTPWorker(config, target, assistant_path, persistent_batch, split_size, trace)``:
   load the assistant (``LLM`` checked its config against the target's first); no KV pool yet.    [rule 2]
2. ``bind(kv_pools)``: after the target's pool is allocated and bound, attach the assistant's layers to the
   target layers they read.                                                                       [rule 2]
3. ``capture_graphs(sizes, num_splits, width)``: the ``mtp:{s}`` phases (``draft_verify``: tensors in,
   tensors out, the same code eager or captured), one per draft length the policy may choose, once
   everything is bound.
4. ``plan(reqs)`` (rank 0, at launch) -> ``step(reqs, plan) -> StepOutput``: one speculative decode step for
   every running request, drafting the plan's s steps from exactly KV rows [0, L), writing nothing [rule 3];
   verify the tree, writing rows [L, L + N); accept per row [rule 6]; the next input is each row's
   bonus token and the hidden of its last accepted node, also when s = 0 [rules 1, 7]. An empty batch does
   nothing [rule 4]. The scheduler then commits ``tokens`` and ``accept_lengths`` [rule 5].
5. ``observe(out)`` (at commit): the step's accept lengths and time, for the policy.

The draft-length policy (the end of this file, DESIGN §3 "Draft length"): each speculative step ``plan`` asks
``DraftLength`` for the number of draft steps s in 0..num_steps (0: a plain decode step through the verify
path) that maximises expected committed tokens per second, E(s) / cost(s, B), from the acceptance and step
times it has measured.

``trace`` (a callable ``(event, fields)``, or None; ``LLM`` wraps the user's ``(step, event, fields)``)
receives "draft" and "verify" per request and one "draft_len" per step ("prefill_done" and "release" come from
``PersistentBatch``). With None nothing is computed for it.
"""

import time
from collections import Counter
from functools import partial

import torch

from .. import trace
from ..context import AttnMetadata, attn_metadata
from ..kernels.attention import num_kv_splits
from ..kernels.sampling import mask_logits, sample
from ..kv_cache import DUMMY_BLOCK, slot_mapping
from ..logprobs import emitted_logprobs
from ..model_runner import GraphRunner
from ..models.gemma4_assistant import Gemma4Assistant
from ..persistent_batch import StepInput
from ..transfer import StepOutput
from .draft import accept, compact_accepted_kv, emitted_tokens, run_draft


class FrozenKVMTPWorker:
    """Speculation for one target (the hooks and their order: see the module docstring)."""

    def __init__(self, config, target, assistant_path, persistent_batch, split_size=None, trace=None):
        self.target = target
        self.tp = target.tp  # the assistant is split over the target's ranks
        self.persistent_batch = persistent_batch
        self.trace = trace
        self.num_steps = config.num_steps
        self.topk = config.topk
        self.num_draft_tokens = config.num_draft_tokens
        self.position_offset = config.draft_position_offset
        self.page_size = config.page_size
        self.split_size = split_size  # deterministic mode's KV split size (the model runner's), or None
        self.device = device = config.torch_device()
        dtype = next(target.parameters()).dtype
        self.assistant = Gemma4Assistant.from_pretrained(assistant_path, device, dtype, self.tp)
        self.kv_pools = None
        self.graphs = None
        # chains can stop after any step; a tree of N nodes needs all its steps
        lengths = list(range(self.num_steps + 1)) if self.topk == 1 else [0, self.num_steps]
        self.policy = DraftLength(lengths, config.adaptive_speculation)

    # ---- 2, 3: bind after allocation, then capture ---------------------------------------------------------
    def bind(self, kv_pools: list[torch.Tensor]) -> None:
        """Attach the assistant to the target's allocated pools (RuntimeError if the target has none
        bound)."""
        self.assistant.bind_target(self.target)
        self.kv_pools = kv_pools

    def capture_graphs(self, sizes: list[int], num_splits: int, width: int) -> None:
        """The ``mtp:{s}`` phases for every draft length the policy may choose, with their static inputs
        (``model_runner.GraphRunner``: bucket ``sizes``, empty for eager; block tables ``width`` blocks wide).
        Padding rows are greedy: no sampling work."""
        buffers = {
            "bonus": ((1,), torch.long, 0),
            "hidden": ((1, self.target.config.hidden_size), self.persistent_batch.hidden.dtype, 0),
            "block_table": ((1, width), torch.int32, DUMMY_BLOCK),
            "L": ((1,), torch.int32, 0),
            "temperature": ((1,), torch.float32, 0.0),
            "top_k": ((1,), torch.int32, -1),
            "top_p": ((1,), torch.float32, 1.0),
            "seeds": ((1,), torch.long, 0),
        }
        phases = {}
        for s in self.policy.candidates:
            phases[f"mtp:{s}"] = (partial(self.draft_verify, draft_length=s), list(buffers))
        self.graphs = GraphRunner(phases, buffers, sizes, num_splits, self.device)
        self.graphs.capture()

    # ---- 4, 5: one speculative step, then its observation -------------------------------------------------
    def plan(self, reqs) -> tuple[int, float | None]:
        """(draft length s, its estimated tokens/s) for a step of ``reqs`` (``DraftLength.choose``); a batch
        with a sampled row is timed and counted apart from an all-greedy one (its acceptance differs)."""
        return self.policy.choose(len(reqs), _is_sampled(reqs))

    @torch.inference_mode()
    def step(self, reqs, plan, masks=None) -> StepOutput:
        """Draft, verify over the tree, accept, and keep the next inputs (see the module docstring).
        ``plan`` = (s, estimate) from ``self.plan`` (on rank 0, at launch). The inputs, committed lengths
        included, are gathered on the device: no host sync until the output is read. ``masks`` (structured
        output: the batch's ``structured.StepMasks``, or None): the constrained rows run eagerly, the host
        masking each draft step and every verify node, the others through their graphs (``_run``, DESIGN
        §5)."""
        if not reqs:  # DESIGN §4 rule 4
            return StepOutput(torch.zeros(0, 2, dtype=torch.long))
        s, estimate = plan
        timer = StepTimer(self.device)
        inp = self.persistent_batch.take(reqs)
        L = inp.num_computed_tokens
        bound = max(r.num_computed_tokens + r.num_inflight * self.num_draft_tokens for r in reqs)
        temperature, top_k, top_p, seeds = self.persistent_batch.sampling(reqs)
        inputs = {
            "bonus": inp.bonus_tokens,
            "hidden": inp.hidden,
            "block_table": self.persistent_batch.block_tables(reqs),
            "L": L,
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "seeds": seeds,
        }
        wants_logprobs = any(r.params.logprobs is not None for r in reqs)
        outputs = self._run(s, inputs, num_kv_splits(bound), masks, wants_logprobs)
        tree_tokens, out, accept_length, bonus, hidden, path, logits = outputs
        logprobs = None
        if wants_logprobs:  # emitted token j: the target's at node path[j]
            node_logits = logits[torch.arange(len(reqs), device=self.device)[:, None], path.clamp(min=0)]
            logprobs = emitted_logprobs(reqs, node_logits, out)
        # a step that drafts nothing (s = 0) verifies the bonus token alone: the next input stays fresh
        self.persistent_batch.advance(StepInput(inp.req_ids, bonus, hidden, L + accept_length.int()))
        result = StepOutput(
            torch.cat([accept_length[:, None], out], 1),
            draft_length=s,
            num_drafted=tree_tokens.shape[1] - 1,
            timer=timer.stop(),
            sampled=_is_sampled(reqs),
            logprobs=logprobs,
        )
        if self.trace is not None:
            expected = self.policy.expected_accept(s, _is_sampled(reqs))
            tree = self.topk > 1 and s > 0
            trace.speculative_step(
                self.trace, reqs, s, tree, expected, estimate, L.tolist(), tree_tokens.tolist(), result.tokens
            )
        return result

    def _run(self, s: int, inputs: dict, num_splits: int, masks=None, logprobs: bool = False) -> tuple:
        """The ``mtp:{s}`` phase's outputs for the batch, in batch order. Rows without a constraint go
        through the graphs; constrained rows (``masks``) run apart, eagerly, with their draft masks (DESIGN
        §5), so one constrained request does not take the batch off its graphs. A batch with a request for
        logprobs runs eagerly and keeps the verify's logits (a graph returns none: DESIGN §3)."""
        phase = f"mtp:{s}"
        if logprobs:
            return self.graphs.run(phase, inputs, num_splits, dict(masks=masks, keep_logits=True))
        if masks is None:
            return self.graphs.run(phase, inputs, num_splits)
        return masks.run_apart(lambda part, eager: self.graphs.run(phase, part, num_splits, eager), inputs)

    def observe(self, out: StepOutput) -> None:
        """A committed step's accept lengths and measured time, for the draft-length policy."""
        if out.timer is not None:
            accepted = out.accept_lengths
            self.policy.observe(out.draft_length, len(accepted), accepted, out.timer.seconds(), out.sampled)

    def draft(self, inp, block_table, L, num_splits=None, draft_length=None, sampling=None, masks=None):
        """The draft tree of the rows of ``inp`` (their bonus tokens and seed hiddens; reads KV rows [0, L),
        L = the rows' ``num_computed_tokens``, writes nothing): ``draft_length`` steps (default:
        ``num_steps``, all) of ``num_draft_tokens`` nodes, or a chain of s + 1 nodes when s is shorter;
        ``sampling`` and ``masks`` as ``run_draft``'s. The one draft path, eager or captured
        (``draft_verify``)."""
        s = self.num_steps if draft_length is None else draft_length
        num_nodes = self.num_draft_tokens if s == self.num_steps else s + 1
        return run_draft(
            self.assistant,
            inp,
            block_table,
            L,
            s,
            self.topk,
            num_nodes,
            self.position_offset,
            num_splits,
            sampling,
            masks,
        )

    def verify(self, tree, block_table, L, sampling, draft_length, masks=None):
        """Target forward over the tree (K/V written to rows [L, L+N)), the target's token at every node,
        accept, compact, next seed hidden.

        The target's token at a node of depth d is the one it produces at position L + d + 1
        (``kernels.sampling.sample``: greedy, or the position-keyed Gumbel argmax), exactly what a step
        without speculation would produce there; a child is accepted iff it equals its parent's target
        token, and the target token at the last accepted node is the bonus token (DESIGN §3, "Verify").
        Pure tensor code with no host sync (graph-capturable): slots come from the block table on device.
        ``sampling`` = (temperature [B] fp32, top_k [B] int32, top_p [B] fp32, seeds [B] int64);
        ``draft_length``: the tree's depth (s); ``masks`` (structured output, or None): every node's token is
        sampled inside the grammar after its path (and the returned logits are masked when a request asked
        for logprobs).
        Returns (emitted [B, S+1] tokens padded with -1, accept_length [B], bonus [B], next seed hidden
        [B, Hb], path [B, S+1] (``accept``'s), logits [B, N, V]).
        """
        B, N = tree.tokens.shape
        dev = tree.tokens.device
        self.tp.agree(tree.tokens, *(() if tree.is_chain else (tree.parents, tree.depth, tree.tree_mask)))
        rows = torch.arange(B, device=dev)[:, None]
        start = L.long()[:, None]  # each row's first verify position
        slots = slot_mapping(block_table, rows, start + torch.arange(N, device=dev), self.page_size)
        positions = (start + tree.depth).flatten()
        md = AttnMetadata.verify(block_table, L, slots.flatten(), N, tree.tree_mask, self.split_size)
        fetched = None if masks is None else masks.fetch(tree.tokens, tree.parents)  # read after the launch
        with attn_metadata(md):
            hidden = self.target(tree.tokens.flatten(), positions)
        logits = self.target.compute_logits(hidden).view(B, N, -1)
        per_node = [x.repeat_interleave(N) for x in sampling]
        bitmask = None
        if masks is not None:
            bitmask = masks.tree(*fetched)  # computed while the target's forward runs
            if masks.logprobs:  # logprobs read the masked logits: mask them once, here
                logits = mask_logits(logits.view(B * N, -1), bitmask).view(B, N, -1)
                bitmask = None
        target_tokens = sample(logits.view(B * N, -1), *per_node, positions + 1, bitmask=bitmask).view(B, N)
        path, accept_length, bonus = accept(tree, target_tokens, draft_length)
        self.tp.agree(path, accept_length, bonus)  # rank 0's walk (tensor parallelism: DESIGN §4 rule 8)
        if not tree.is_chain:
            compact_accepted_kv(self.kv_pools, block_table, L, path, accept_length, self.page_size)
        last = path.gather(1, (accept_length - 1)[:, None]).squeeze(1)
        seed_hidden = hidden.view(B, N, -1)[torch.arange(B, device=dev), last]
        emitted = emitted_tokens(tree, path, accept_length, bonus)
        return emitted, accept_length, bonus, seed_hidden, path, logits

    def draft_verify(
        self,
        bonus,
        hidden,
        block_table,
        L,
        temperature,
        top_k,
        top_p,
        seeds,
        draft_length,
        num_splits=None,
        masks=None,
        keep_logits=False,
    ):
        """One whole speculative step of ``draft_length`` draft steps (s) from tensors (bonus [B], hidden
        [B, Hb]) and the rows' sampling tensors (``PersistentBatch.sampling``): the ``mtp:{s}`` phase, the
        same code whether a CUDA graph captures it or it runs eagerly (always eagerly with ``masks`` or
        ``keep_logits``). Returns (tree tokens [B, N], then ``verify``'s outputs, its logits None unless
        ``keep_logits``: a graph keeps only what the host reads)."""
        sampling = (temperature, top_k, top_p, seeds)
        inp = StepInput([], bonus, hidden)
        tree = self.draft(inp, block_table, L, num_splits, draft_length, sampling, masks)
        *outputs, logits = self.verify(tree, block_table, L, sampling, draft_length, masks)
        return (tree.tokens, *outputs, logits if keep_logits else None)


def _is_sampled(reqs) -> bool:
    return not all(r.params.greedy for r in reqs)


# ---- the draft length per step (DESIGN §3, "Draft length")
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
        self, candidates, adaptive=True, decay=0.95, alpha=0.02, probe_every=16, beta=0.25, clip=1.2
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
        e = 1.0
        p = 1.0
        for j in range(1, s + 1):
            p *= (self.hits[sampled][j] + 0.5) / (self.tries[sampled][j] + 1.0)
            e += p
        return e

    def choose(self, batch_size: int, sampled: bool = False) -> tuple[int, float | None]:
        """(s, estimated tokens per second per request, None while warming up or probing) for a batch of
        ``batch_size`` requests, ``sampled`` if any of them samples."""
        b = (1 << (batch_size - 1).bit_length(), sampled)
        self.steps[b] += 1
        todo = [s for s in self.candidates if (s, b) not in self.cost]
        estimate = None
        if not self.adaptive or todo:
            s = self.candidates[-1] if not self.adaptive else todo[-1]
        elif self.steps[b] % self.probe_every == 0:
            s = min(self.candidates, key=lambda c: self.measured_at[c, b])
        else:
            s = max(self.candidates, key=lambda c: self.expected_accept(c, sampled) / self.cost[c, b])
            estimate = self.expected_accept(s, sampled) / (self.cost[s, b] * self.pace[b])
        self.counts[s] += 1
        return s, estimate

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
