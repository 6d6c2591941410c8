"""One device row per running request, from its first prefill chunk to its release (vLLM's persistent batch,
SGLang's req-to-token pool): the request's block table, its sampling parameters and, once its prefill is done,
the input of its next decode step (its newest token, the bonus token under speculation; its committed length;
under speculation the target's hidden at its last committed row, the drafter's seed). ``PersistentBatch`` is
the one owner of these rows (DESIGN §4 rule 1): nothing else creates, reads, replaces or releases one. Keeping
them on the device is what lets the host plan step n+1 before it has read step n's tokens (overlap
scheduling), and what leaves a step's host-to-device traffic at a few row indices."""

from dataclasses import dataclass

import torch

from .kv_cache import DUMMY_BLOCK
from .request import Request
from .transfer import to_device


@dataclass
class StepInput:
    """Inputs of one step: one row per request of the batch, in batch order.

    req_ids: request ids; bonus_tokens [B] int64: last token sampled by the target (not in KV yet);
    hidden [B, Hb]: target post-final-norm hidden of the last accepted token ([B, 0] for plain decode);
    num_computed_tokens [B] int32: committed KV length L of each row (None where the caller tracks it).
    Always real-shaped, also with 0 rows.
    """

    req_ids: list[int]
    bonus_tokens: torch.Tensor
    hidden: torch.Tensor
    num_computed_tokens: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.req_ids)


class PersistentBatch:
    """Every running request's row, in the order its life runs:

    1. ``block_tables(reqs)`` at each step of a request, its first prefill chunk included: a request without a
       row takes a free one (its block-table columns reset to the dummy block, its sampling parameters
       written); the blocks each table gained since the request's last step are written into its row (a
       request's table only grows while it holds a row); the tables come back in batch order.
    2. ``on_prefill_done(reqs, first_tokens, hidden)``: a request's prefill ends; its next input is born from
       the token it emits first (or its newest, when recomputed after preemption), its prompt length and the
       target's hidden at its last prompt row (kept only under speculation: ``hidden_size`` > 0).  [rule 1]
    3. ``take(reqs)``, ``sampling(reqs)`` and ``advance(inputs)`` around every decode or speculative step: a
       step gathers its requests' inputs and sampling parameters in batch order and scatters each one's next
       input back into its row (its new bonus token, committed length and hidden), also when it drafted
       nothing (s = 0).                                                                          [rules 1, 7]
    4. ``release(req, reason)``: the request leaves the running set (finished, aborted, preempted); its row is
       free again, in the same call that frees its KV blocks (``Scheduler._release`` -> ``LLM._on_release``).
       No device work.

    ``capacity`` rows (``max_num_seqs``), allocated once: the running requests and the prompts whose prefill
    has begun never outnumber it, as the scheduler admits a prompt only while fewer run or are in its batch,
    and a begun prompt joins the batch before anything queued behind it. A table is ``width`` blocks (the
    graphs' width, ``cdiv(max_model_len + lookahead, page_size)``: every table fits). Gathers and scatters
    use row indices that ``transfer.to_device`` sends. ``trace`` (a callable ``(event, fields)``, or None)
    receives "prefill_done" and "release" per request.
    """

    def __init__(self, capacity: int, width: int, hidden_size: int, device, dtype, trace=None):
        self.hidden_size = hidden_size
        self.block_table = torch.full((capacity, width), DUMMY_BLOCK, dtype=torch.int32, device=device)
        self.temperature = torch.zeros(capacity, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(capacity, dtype=torch.int32, device=device)
        self.top_p = torch.ones(capacity, dtype=torch.float32, device=device)
        self.seeds = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.bonus_tokens = torch.zeros(capacity, dtype=torch.long, device=device)
        self.hidden = torch.zeros(capacity, hidden_size, dtype=dtype, device=device)
        self.num_computed_tokens = torch.zeros(capacity, dtype=torch.int32, device=device)
        self.row: dict[int, int] = {}  # request id -> its row
        self.blocks_written: dict[int, int] = {}  # request id -> blocks of its table in its row
        self.has_input: dict[int, None] = {}  # request ids whose next input is born, in birth order
        self.free = list(range(capacity))
        self.trace = trace
        self.sent_ids = None  # the request ids whose rows were sent last, and those rows on the device
        self.sent_rows = None

    def __len__(self) -> int:
        """Requests holding a next input."""
        return len(self.has_input)

    def _index(self, req_ids: list[int]) -> torch.Tensor:
        """The rows of ``req_ids`` on the device, sent once for the take, tables, sampling and advance of a
        step (a release sends them again: a preempted request's next row differs; a newborn request's id is in
        no rows sent before)."""
        if tuple(req_ids) != self.sent_ids:
            self.sent_ids = tuple(req_ids)
            self.sent_rows = to_device([self.row[i] for i in req_ids], torch.long, self.block_table.device)
        return self.sent_rows

    def block_tables(self, reqs: list[Request]) -> torch.Tensor:
        """[B, W] int32 block tables of ``reqs`` in batch order, padded with the dummy block; W is the longest
        table (at least 1). A request's first call gives it a row."""
        born = [r for r in reqs if r.request_id not in self.row]
        for r in born:
            assert self.free, "more requests hold rows than there are (max_num_seqs)"
            self.row[r.request_id] = self.free.pop()
        if born:
            idx = self._index([r.request_id for r in born])
            self.block_table[idx] = DUMMY_BLOCK  # none of the blocks of the row's last owner
            self.temperature[idx] = to_device([r.params.temperature for r in born], torch.float32, idx.device)
            self.top_k[idx] = to_device([r.params.top_k for r in born], torch.int32, idx.device)
            self.top_p[idx] = to_device([r.params.top_p for r in born], torch.float32, idx.device)
            self.seeds[idx] = to_device([r.seed for r in born], torch.int64, idx.device)
        writes = []  # (row, column, block) of every block the device does not hold yet
        for r in reqs:
            known = self.blocks_written.get(r.request_id, 0)  # none yet in a newborn row
            row = self.row[r.request_id]
            writes += [(row, j, block) for j, block in enumerate(r.block_table[known:], known)]
            self.blocks_written[r.request_id] = len(r.block_table)
        if writes:
            row, column, block = to_device(writes, torch.long, self.block_table.device).T
            self.block_table[row, column] = block.int()
        width = max((len(r.block_table) for r in reqs), default=1) or 1
        return self.block_table[self._index([r.request_id for r in reqs]), :width]

    def sampling(self, reqs: list[Request]) -> tuple[torch.Tensor, ...]:
        """(temperature [B] fp32, top_k [B] int32, top_p [B] fp32, seeds [B] int64) of ``reqs``."""
        idx = self._index([r.request_id for r in reqs])
        return self.temperature[idx], self.top_k[idx], self.top_p[idx], self.seeds[idx]

    @property
    def inputs(self) -> StepInput:
        """Every live next input, in birth order (for inspection and tests; a step uses ``take``)."""
        return self._gather(list(self.has_input))

    def _gather(self, req_ids: list[int]) -> StepInput:
        idx = self._index(req_ids)
        return StepInput(req_ids, self.bonus_tokens[idx], self.hidden[idx], self.num_computed_tokens[idx])

    def on_prefill_done(self, reqs, first_tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        """Birth of the next inputs of ``reqs`` (first_tokens [B] int64, hidden [B, H]), in the rows their
        prefill took."""
        self.has_input.update(dict.fromkeys(r.request_id for r in reqs))
        L = to_device([r.prefill_len for r in reqs], torch.int32, hidden.device)
        self.advance(StepInput([r.request_id for r in reqs], first_tokens, hidden[:, : self.hidden_size], L))
        if self.trace is not None:
            for r, t in zip(reqs, first_tokens.tolist()):
                self.trace("prefill_done", {"req": r.request_id, "bonus": t, "L": r.prefill_len})

    def take(self, reqs) -> StepInput:
        """The next inputs of ``reqs``, in batch order; RuntimeError if one is missing."""
        if any(r.request_id not in self.has_input for r in reqs):
            raise RuntimeError("a decode request has no next input")
        return self._gather([r.request_id for r in reqs])

    def advance(self, inputs: StepInput) -> None:
        """A step's results: ``inputs`` replace those requests' next inputs in their rows."""
        idx = self._index(inputs.req_ids)
        self.bonus_tokens[idx] = inputs.bonus_tokens
        self.hidden[idx] = inputs.hidden
        self.num_computed_tokens[idx] = inputs.num_computed_tokens

    def release(self, req: Request, reason: str) -> None:
        """Free ``req``'s row (reason: "finished" | "aborted" | "preempted"); a request without one is
        skipped."""
        row = self.row.pop(req.request_id, None)
        self.sent_ids = None
        if row is not None:
            self.free.append(row)
            del self.blocks_written[req.request_id]
        self.has_input.pop(req.request_id, None)
        if self.trace is not None:
            self.trace("release", {"req": req.request_id, "reason": reason})
