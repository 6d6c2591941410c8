"""The drafter's per-request input (the "draft input": bonus token + seed hidden), kept as real-shaped batch
tensors (DESIGN §4 rule 1). Only ``FrozenKVMTPWorker`` creates, filters, merges or releases them."""
from dataclasses import dataclass

import torch


@dataclass
class DraftInput:
    """Inputs of the next draft: one row per running request.

    req_ids: request ids, row order; bonus_tokens [B] int64: last token sampled by the target (not in KV yet);
    hidden [B, Hb]: target post-final-norm hidden of the last accepted token. Always real-shaped, so
    ``filter``/``merge`` work on any mix of prefill inputs, decode inputs and idle (0-row) inputs.
    """

    req_ids: list[int]
    bonus_tokens: torch.Tensor
    hidden: torch.Tensor

    @classmethod
    def idle(cls, hidden_size: int, device, dtype) -> "DraftInput":
        """The 0-row input left when no request is running (never a verify input)."""
        return cls([], torch.zeros(0, dtype=torch.long, device=device),
                   torch.zeros(0, hidden_size, dtype=dtype, device=device))

    def __len__(self) -> int:
        return len(self.req_ids)

    def filter(self, keep_ids) -> "DraftInput":
        """Rows whose request id is in ``keep_ids``, in ``keep_ids`` order (ids absent here are skipped)."""
        pos = {r: i for i, r in enumerate(self.req_ids)}
        rows = [pos[r] for r in keep_ids if r in pos]
        idx = torch.tensor(rows, dtype=torch.long, device=self.hidden.device)
        return DraftInput([self.req_ids[i] for i in rows], self.bonus_tokens[idx], self.hidden[idx])

    def merge(self, other: "DraftInput") -> "DraftInput":
        """Append ``other``'s rows; a request present in both keeps ``other``'s (newer) row."""
        mine = self.filter([r for r in self.req_ids if r not in set(other.req_ids)])
        return DraftInput(mine.req_ids + other.req_ids, torch.cat([mine.bonus_tokens, other.bonus_tokens]),
                          torch.cat([mine.hidden, other.hidden]))
