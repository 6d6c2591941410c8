"""The per-request input of the next decode step, kept on the device in persistent slots (DESIGN §4 rule 1):
the request's newest token (the bonus token under speculation), its committed length and, under speculation,
the target's hidden at its last committed row (the drafter's seed). ``NextInputs`` is the one owner for plain
and speculative decoding alike: nothing else creates, reads, replaces or releases a row. Keeping them on the
device is what lets the host plan step n+1 before it has read step n's tokens (overlap scheduling)."""

from dataclasses import dataclass

import torch

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

    @classmethod
    def idle(cls, hidden_size: int, device, dtype) -> "StepInput":
        """The 0-row input (no request running; never a verify input)."""
        return cls(
            [],
            torch.zeros(0, dtype=torch.long, device=device),
            torch.zeros(0, hidden_size, dtype=dtype, device=device),
            torch.zeros(0, dtype=torch.int32, device=device),
        )

    def __len__(self) -> int:
        return len(self.req_ids)


class NextInputs:
    """Every running request's next-step input, from its prefill to its release, in the order it happens:

    1. ``on_prefill_done(reqs, first_tokens, hidden)``: a request's prefill ends; its input is born in a free
       slot from the token it emits first (or its newest, when recomputed after preemption), its prompt
       length and the target's hidden at its last prompt row (kept only under speculation: ``hidden_size``
       > 0).                                                                                       [rule 1]
    2. ``take(reqs)`` and ``advance(rows)`` around every decode or speculative step: a step gathers the inputs
       of its requests in batch order and scatters each one's next input back into its slot (its new bonus
       token, committed length and hidden), also when it drafted nothing (s = 0).               [rules 1, 7]
    3. ``on_release(reqs, reason)``: a request leaves the running set (finished, aborted, preempted); its slot
       is free again, in the same call that frees its KV blocks. No device work.

    The slots are ``capacity`` rows of device tensors allocated once (``max_num_seqs``: no more requests run
    at once); batch surgery is a gather and a scatter with a slot index that ``transfer.to_device`` sends.
    ``trace`` (a callable ``(event, fields)``, or None) receives "prefill_done" and "release" per request.
    """

    def __init__(self, hidden_size: int, device, dtype, capacity: int, trace=None):
        self.hidden_size = hidden_size
        self.bonus_tokens = torch.zeros(capacity, dtype=torch.long, device=device)
        self.hidden = torch.zeros(capacity, hidden_size, dtype=dtype, device=device)
        self.num_computed_tokens = torch.zeros(capacity, dtype=torch.int32, device=device)
        self.slots: dict[int, int] = {}  # request id -> slot, in the order the inputs were born
        self.free = list(range(capacity))
        self.trace = trace

    def __len__(self) -> int:
        return len(self.slots)

    def _index(self, req_ids: list[int]) -> torch.Tensor:
        return to_device([self.slots[i] for i in req_ids], torch.long, self.hidden.device)

    @property
    def rows(self) -> StepInput:
        """Every live input, in birth order (for inspection and tests; a step uses ``take``)."""
        return self._gather(list(self.slots))

    def _gather(self, req_ids: list[int]) -> StepInput:
        idx = self._index(req_ids)
        return StepInput(req_ids, self.bonus_tokens[idx], self.hidden[idx], self.num_computed_tokens[idx])

    def on_prefill_done(self, reqs, first_tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        """Birth of the inputs of ``reqs`` (first_tokens [B] int64, hidden [B, H]). The scheduler never runs
        more requests than there are slots (``max_num_seqs``); an AssertionError says it did."""
        for r in reqs:
            if r.request_id not in self.slots:
                assert self.free, "more running requests than next-input slots (max_num_seqs)"
                self.slots[r.request_id] = self.free.pop()
        L = to_device([r.prefill_len for r in reqs], torch.int32, hidden.device)
        self.advance(StepInput([r.request_id for r in reqs], first_tokens, hidden[:, : self.hidden_size], L))
        if self.trace is not None:
            for r, t in zip(reqs, first_tokens.tolist()):
                self.trace("prefill_done", {"req": r.request_id, "bonus": t, "L": r.prefill_len})

    def take(self, reqs) -> StepInput:
        """The inputs of ``reqs``, in batch order; RuntimeError if one is missing."""
        if any(r.request_id not in self.slots for r in reqs):
            raise RuntimeError("a decode request has no next input")
        return self._gather([r.request_id for r in reqs])

    def advance(self, rows: StepInput) -> None:
        """A step's results: ``rows`` replace those requests' inputs in their slots."""
        idx = self._index(rows.req_ids)
        self.bonus_tokens[idx] = rows.bonus_tokens
        self.hidden[idx] = rows.hidden
        self.num_computed_tokens[idx] = rows.num_computed_tokens

    def on_release(self, reqs, reason: str) -> None:
        """Free the slots of ``reqs`` (reason: "finished" | "aborted" | "preempted"); unknown ids are
        skipped."""
        for r in reqs:
            slot = self.slots.pop(r.request_id, None)
            if slot is not None:
                self.free.append(slot)
            if self.trace is not None:
                self.trace("release", {"req": r.request_id, "reason": reason})
