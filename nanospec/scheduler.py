"""Continuous batching: waiting/running queues, chunked prefill and decode steps alternating (``schedule``),
preemption by recompute; the one release of a request (``_release``: its KV blocks, then ``on_release``) and
the one commit of a step's tokens (``commit``)."""

from collections import deque
from dataclasses import dataclass, field, replace

from .config import EngineConfig
from .kv_cache import BlockAllocator
from .request import Request, Status


@dataclass
class Batch:
    """One step's plan. kind "prefill": compute ``num_new[i]`` prompt tokens of ``reqs[i]`` starting at its
    ``num_computed_tokens``; kind "decode": one decode (or draft + verify) step for every request (``num_new``
    is empty: every request writes the lookahead's KV rows); ``new_blocks[i]`` the blocks request i's table
    gained in this plan (all a step message carries of a running request's table: DESIGN §9)."""

    kind: str
    reqs: list[Request]
    num_new: list[int] = field(default_factory=list)
    new_blocks: list[list[int]] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)  # each request's epoch at launch (set by on_launch)
    # prefill: whether request i's prompt completes (set by on_launch)
    done: list[bool] = field(default_factory=list)

    def for_ranks(self) -> "Batch":
        """This batch as the step message carries it to the other ranks: its requests' ``Request.for_ranks``
        copies."""
        return replace(self, reqs=[r.for_ranks() for r in self.reqs])

    def completes(self, i: int) -> bool:
        """Whether request i's prefill finishes this step (a new request then samples its first token); valid
        until ``on_launch`` advances ``num_computed_tokens``."""
        r = self.reqs[i]
        return self.kind == "decode" or r.num_computed_tokens + self.num_new[i] == r.prefill_len


class Scheduler:
    """Plans steps (``schedule``), books them when they are launched (``on_launch``: prefill progress, which
    needs no result) and commits their results (``commit``: tokens, finish, release).

    With overlap scheduling the host plans step n+1 before it has committed step n: a decode request may then
    have one step in flight, so KV is reserved for two lookaheads and the step's inputs come from the device.
    A request that finished (or was preempted) after a step was launched is skipped when that step commits,
    so nothing past its stop is ever emitted. ``lookahead`` is how many KV rows beyond the committed length
    one decode step writes: 1 for plain decode, N (draft tokens verified) under speculation. Preempted
    requests free all their blocks, keep their outputs, and are recomputed by a later prefill over prompt +
    outputs (nothing is lost). ``_release`` is the one exit from the running set (finish, abort, preemption):
    it frees the request's KV blocks and calls ``on_release(req, reason)``, with which ``LLM`` frees the
    request's device rows (its next input and block-table row) at once.
    """

    def __init__(self, config: EngineConfig, allocator: BlockAllocator, lookahead: int = 1, on_release=None):
        self.config = config
        self.allocator = allocator
        self.lookahead = lookahead
        self.on_release = on_release or (lambda req, reason: None)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.last_kind: str | None = None

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, req: Request) -> None:
        """Drop a waiting or running request (its blocks and next input go)."""
        (self.waiting if req in self.waiting else self.running).remove(req)
        req.finish_reason = "abort"
        req.status = Status.FINISHED
        self._release(req, "aborted")

    def _release(self, req: Request, reason: str) -> None:
        """Free ``req``'s KV blocks, then its device rows (``on_release``; reason: finished / aborted /
        preempted)."""
        self.allocator.free(req)
        self.on_release(req, reason)

    def schedule(self) -> Batch | None:
        """Next step: a prefill batch or a decode batch; None when idle (or when every running request waits
        for its step in flight to commit).

        While requests are decoding, prefill and decode steps alternate: a waiting prompt gets at most one
        prefill step (up to ``max_num_batched_tokens`` tokens, longer prompts are chunked) between two decode
        steps, so running requests never wait longer than one prefill chunk for their next token. Mixing
        decode rows into the prefill forward (vLLM's chunked prefill) would need, under speculation, draft +
        tree-verify rows of varying tree masks inside the extend forward; alternating keeps every forward one
        mode and bounds the gap just as well (the figure: docs/benchmarks.md, "Prefix caching, prefill beside
        decode, overlap scheduling").

        Progress under KV pressure (DESIGN §4 rule 10): requests are ranked by arrival (``request_id``); a
        request that needs blocks may take them only from younger holders (running, or a waiting request
        holding blocks), youngest first, so the oldest request is never preempted and always advances.
        """
        decode_turn = bool(self.running) and self.last_kind == "prefill"
        batch = self._schedule_decode() if decode_turn else self._schedule_prefill()
        if batch is None:
            batch = self._schedule_prefill() if decode_turn else self._schedule_decode()
        self.last_kind = batch.kind if batch is not None else None
        return batch

    def _decode_need(self, req: Request) -> int:
        """KV slots ``req``'s next decode step writes up to: its step in flight (if any) and this one."""
        return req.num_computed_tokens + self.lookahead * (1 + req.num_inflight)

    def _make_room(self, req: Request, num_slots: int, reserve: int = 0) -> bool:
        """Preempt holders younger than ``req``, youngest first, until ``req`` can cover ``num_slots`` slots
        and ``reserve`` blocks stay free; False (nothing more preempted) when even that does not fit."""
        while self.allocator.blocks_needed(req, num_slots) + reserve > self.allocator.num_free:
            holders = [r for r in [*self.running, *self.waiting] if r.block_table]
            younger = [r for r in holders if r.request_id > req.request_id]
            if not younger:
                return False
            self._preempt(max(younger, key=lambda r: r.request_id))
        return True

    def _schedule_prefill(self) -> Batch | None:
        batch = Batch("prefill", [])
        budget = self.config.max_num_batched_tokens
        for req in list(self.waiting):
            if len(self.running) + len(batch.reqs) >= self.config.max_num_seqs or budget == 0:
                break
            # prefix caching: start after the longest cached prefix (a prompt to score is computed whole)
            if not req.block_table and req.params.prompt_logprobs is None:
                req.num_computed_tokens = self.allocator.match_prefix(req)
                if req.num_cached_tokens is None:
                    req.num_cached_tokens = min(req.num_computed_tokens, len(req.prompt_token_ids))
            chunk = min(req.prefill_len - req.num_computed_tokens, budget)
            end = req.num_computed_tokens + chunk
            # a prompt that completes here takes its first decode step's rows too, and is admitted only if
            # the older running requests' next decode steps still fit beside it: it is not preempted at once
            need = end + self.lookahead if end == req.prefill_len else end
            older = [r for r in self.running if r.request_id < req.request_id]
            reserve = sum(self.allocator.blocks_needed(r, self._decode_need(r)) for r in older)
            if not self._make_room(req, need, reserve):
                break
            self.allocator.allocate(req, need)
            batch.reqs.append(req)
            batch.num_new.append(chunk)
            budget -= chunk
            if end < req.prefill_len:
                break  # a chunked prompt goes on next step, before anything queued behind it
        return batch if batch.reqs else None

    def _schedule_decode(self) -> Batch | None:
        batch = Batch("decode", [])
        for req in sorted(self.running, key=lambda r: r.request_id):
            if req.status is Status.WAITING:
                continue  # preempted for an older request in this loop
            if req.num_inflight and len(req.output_token_ids) + self.lookahead >= req.params.max_tokens:
                continue  # its step in flight may end it: no step past max_model_len (nor its RoPE table)
            if req.matcher is not None and (req.num_inflight or not req.output_token_ids):
                continue  # its grammar masks need every token before this step committed (DESIGN §5)
            need = self._decode_need(req)
            if self._make_room(req, need):
                batch.new_blocks.append(self.allocator.allocate(req, need))
                batch.reqs.append(req)
            elif not req.num_inflight:
                self._preempt(req)  # the youngest holder left: its blocks go to the older ones
            # else: it waits for its step in flight to commit; alone it then fits (the pool check)
        return batch if batch.reqs else None

    def _preempt(self, req: Request) -> None:
        """Free a running request, or a waiting one holding blocks, for recompute by a later prefill over
        prompt + outputs (nothing is lost); it waits in arrival order."""
        self._release(req, "preempted")
        req.epoch += 1  # a step still in flight for it is dropped when it commits
        req.num_inflight = req.num_computed_tokens = 0
        if req.prompt_logprobs is not None and not req.output_token_ids:
            req.prompt_logprobs = [None]  # its prompt is scored again from the start
        if req.status is Status.RUNNING:
            self.running.remove(req)
            req.status = Status.WAITING
            older = sum(r.request_id < req.request_id for r in self.waiting)
            self.waiting.insert(older, req)
        self.num_preemptions += 1

    def on_launch(self, batch: Batch) -> None:
        """Book a launched step: prefill progress (a finished prompt moves its request to running, where the
        next plan can decode it before its first token reaches the host); decode rows are in flight."""
        batch.epochs = [r.epoch for r in batch.reqs]
        batch.done = [batch.completes(i) for i in range(len(batch.reqs))]
        for i, req in enumerate(batch.reqs):
            if batch.kind == "decode":
                req.num_inflight += 1
                continue
            req.num_computed_tokens += batch.num_new[i]
            self.allocator.register_prefill(req, req.num_computed_tokens)
            if batch.done[i]:
                self.waiting.remove(req)
                req.status = Status.RUNNING
                self.running.append(req)

    def commit(
        self,
        batch: Batch,
        new_tokens: list[list[int]],
        accept_lengths: list[int] | None = None,
        num_drafted: int = 0,
        logprobs: list | None = None,
        prompt_logprobs: list | None = None,
    ):
        """Commit a launched step's results; returns the requests that finished. ``new_tokens[i]`` are request
        i's sampled tokens (empty for an unfinished prefill chunk or a resumed request); under speculation the
        accepted drafts plus the bonus token, whose K/V rows (all but the bonus) the verify step committed,
        and, for a step that drafted (``num_drafted`` > 0), ``accept_lengths[i]`` is recorded in the request's
        ``accept_lengths`` (before any cut by a stop rule), with the ``num_drafted`` draft tokens verified in
        ``draft_token_counts``. ``logprobs[i]`` (None: not asked) holds one dict per token of
        ``new_tokens[i]``, ``prompt_logprobs[i]`` one per prompt token a prefill chunk scored. The one place
        tokens are committed; every token is checked for a stop (DESIGN §4 rule 5)."""
        finished = []
        for i, (req, toks) in enumerate(zip(batch.reqs, new_tokens)):
            if req.is_finished or req.epoch != batch.epochs[i]:
                continue  # finished, aborted or preempted after this step was launched: emit nothing
            if prompt_logprobs is not None and prompt_logprobs[i] is not None:
                # in prompt order; a prompt scored again (recomputed after preemption) keeps its first scores
                missing = len(req.prompt_token_ids) - len(req.prompt_logprobs)
                req.prompt_logprobs += prompt_logprobs[i][:missing]
            if batch.kind == "decode":
                req.num_inflight -= 1
                req.num_computed_tokens += len(toks)
                if num_drafted:
                    req.accept_lengths.append(accept_lengths[i])
                    req.draft_token_counts.append(num_drafted)
            elif not batch.done[i]:
                continue
            req.append_tokens(toks, None if logprobs is None else logprobs[i])
            if req.is_finished:
                self.running.remove(req)
                self._release(req, "finished")
                finished.append(req)
        return finished
