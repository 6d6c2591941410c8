"""The per-request input of the next decode step, kept on the device as real-shaped batch tensors (DESIGN
§4 rule 1). Under speculation it is the drafter's "draft input" (bonus token + seed hidden + committed
length), and only ``FrozenKVMTPWorker`` creates, filters, merges or releases those; plain decode keeps the
same rows with an empty hidden in the model runner. Keeping them on the device is what lets the host plan
step n+1 before it has read step n's tokens (overlap scheduling)."""

from dataclasses import dataclass, fields

import torch


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
        idx = torch.tensor(rows, dtype=torch.long, device=self.hidden.device)
        picked = {k: None if t is None else t[idx] for k, t in self._tensors().items()}
        return DraftInput([self.req_ids[i] for i in rows], **picked)

    def merge(self, other: "DraftInput") -> "DraftInput":
        """Append ``other``'s rows; a request present in both keeps ``other``'s (newer) row."""
        mine = self.filter([r for r in self.req_ids if r not in set(other.req_ids)])
        theirs = other._tensors()
        cat = {k: None if t is None else torch.cat([t, theirs[k]]) for k, t in mine._tensors().items()}
        return DraftInput(mine.req_ids + other.req_ids, **cat)
