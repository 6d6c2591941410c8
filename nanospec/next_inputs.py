"""The per-request input of the next decode step, kept on the device as real-shaped batch tensors (DESIGN
§4 rule 1): the request's newest token (the bonus token under speculation), its committed length and, under
speculation, the target's hidden at its last committed row (the drafter's seed). ``NextInputs`` is the one
owner for plain and speculative decoding alike: nothing else creates, filters, merges or releases a row.
Keeping them on the device is what lets the host plan step n+1 before it has read step n's tokens (overlap
scheduling)."""

from dataclasses import dataclass, fields

import torch

from .transfer import to_device


@dataclass
class DraftInput:
    """Inputs of the next step: one row per running request.

    req_ids: request ids, row order; bonus_tokens [B] int64: last token sampled by the target (not in KV yet);
    hidden [B, Hb]: target post-final-norm hidden of the last accepted token ([B, 0] for plain decode);
    seq_lens [B] int32: committed KV length L of each row (None where the caller tracks it). Always
    real-shaped, so ``filter``/``merge`` work on any mix of prefill inputs, decode inputs and idle (0-row)
    inputs.
    """

    req_ids: list[int]
    bonus_tokens: torch.Tensor
    hidden: torch.Tensor
    seq_lens: torch.Tensor | None = None

    @classmethod
    def idle(cls, hidden_size: int, device, dtype) -> "DraftInput":
        """The 0-row input left when no request is running (never a verify input)."""
        return cls(
            [],
            torch.zeros(0, dtype=torch.long, device=device),
            torch.zeros(0, hidden_size, dtype=dtype, device=device),
            torch.zeros(0, dtype=torch.int32, device=device),
        )

    def __len__(self) -> int:
        return len(self.req_ids)

    def _tensors(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "req_ids"}

    def filter(self, keep_ids) -> "DraftInput":
        """Rows whose request id is in ``keep_ids``, in ``keep_ids`` order (ids absent here are skipped)."""
        pos = {r: i for i, r in enumerate(self.req_ids)}
        rows = [pos[r] for r in keep_ids if r in pos]
        idx = to_device(rows, torch.long, self.hidden.device)
        picked = {k: None if t is None else t[idx] for k, t in self._tensors().items()}
        return DraftInput([self.req_ids[i] for i in rows], **picked)

    def merge(self, other: "DraftInput") -> "DraftInput":
        """Append ``other``'s rows; a request present in both keeps ``other``'s (newer) row."""
        mine = self.filter([r for r in self.req_ids if r not in set(other.req_ids)])
        theirs = other._tensors()
        cat = {k: None if t is None else torch.cat([t, theirs[k]]) for k, t in mine._tensors().items()}
        return DraftInput(mine.req_ids + other.req_ids, **cat)


class NextInputs:
    """Every running request's next-step input, from its prefill to its release, in the order it happens:

    1. ``on_prefill_done(reqs, first_tokens, hidden)``: a request's prefill ends; its input is born from the
       token it emits first (or its newest, when recomputed after preemption), its prompt length and the
       target's hidden at its last prompt row (kept only under speculation: ``hidden_size`` > 0).  [rule 1]
    2. ``take(reqs)`` and ``advance(rows)`` around every decode or speculative step: a step reads the inputs
       of its requests in batch order and leaves each one's next input (its new bonus token, committed
       length and hidden), also when it drafted nothing (s = 0).                                 [rules 1, 7]
    3. ``on_release(reqs, reason)``: a request leaves the running set (finished, aborted, preempted); its
       input goes in the same call that frees its KV blocks. When none is left, the idle input remains.

    ``trace`` (a callable ``(event, fields)``, or None) receives "prefill_done" and "release" per request.
    """

    def __init__(self, hidden_size: int, device, dtype, trace=None):
        self.hidden_size = hidden_size
        self.rows = DraftInput.idle(hidden_size, device, dtype)
        self.trace = trace

    def __len__(self) -> int:
        return len(self.rows)

    def on_prefill_done(self, reqs, first_tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        """Birth of the inputs of ``reqs`` (first_tokens [B] int64, hidden [B, H]); a request recomputed after
        preemption gets a fresh row."""
        L = to_device([r.prefill_len for r in reqs], torch.int32, hidden.device)
        born = DraftInput([r.request_id for r in reqs], first_tokens, hidden[:, : self.hidden_size], L)
        self.rows = self.rows.merge(born)
        if self.trace is not None:
            for r, t in zip(reqs, first_tokens.tolist()):
                self.trace("prefill_done", {"req": r.request_id, "bonus": t, "L": r.prefill_len})

    def take(self, reqs) -> DraftInput:
        """The inputs of ``reqs``, in batch order; RuntimeError if one is missing."""
        rows = self.rows.filter([r.request_id for r in reqs])
        if len(rows) != len(reqs):
            raise RuntimeError("a decode request has no next input")
        return rows

    def advance(self, rows: DraftInput) -> None:
        """A step's results: ``rows`` replace those requests' inputs."""
        self.rows = self.rows.merge(rows)

    def on_release(self, reqs, reason: str) -> None:
        """Drop the inputs of ``reqs`` (reason: "finished" | "aborted" | "preempted")."""
        gone = {r.request_id for r in reqs}
        self.rows = self.rows.filter([i for i in self.rows.req_ids if i not in gone])
        if self.trace is not None:
            for r in reqs:
                self.trace("release", {"req": r.request_id, "reason": reason})
