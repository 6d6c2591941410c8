"""Frozen-KV MTP worker: owns the assistant and the seeds, and runs draft -> verify -> accept per decode step."""
from pathlib import Path

import torch

from ..context import AttnMetadata, attn_metadata
from ..kernels.attention import num_kv_splits
from ..kernels.sampling import filtered_probs
from ..kv_cache import block_table_tensor
from ..models.gemma4_assistant import Gemma4Assistant
from .draft import run_draft
from .state import DraftInput
from .verify import accept_greedy, accept_sampling, compact_accepted_kv, emitted_tokens

DEFAULT_ASSISTANT = Path(__file__).resolve().parent.parent / "assets" / "smollm2-135m-instruct-assistant"


def resolve_assistant(assistant: str, target_is_default: bool) -> Path:
    """``"default"`` -> the shipped assistant of SmolLM2-135M-Instruct; anything else is a dir path.

    Raises ValueError when "default" is asked for another target, when it is not shipped, or when the dir
    does not exist.
    """
    if assistant == "default":
        if not target_is_default:
            raise ValueError("assistant='default' only exists for SmolLM2-135M-Instruct; pass assistant=DIR "
                             "(an HF gemma4_assistant checkpoint) for this target")
        if not (DEFAULT_ASSISTANT / "config.json").exists():
            raise ValueError(f"assistant='default': no trained assistant is shipped at {DEFAULT_ASSISTANT}; "
                             "train one with `python -m nanospec.train_assistant` and pass assistant=DIR")
        return DEFAULT_ASSISTANT
    path = Path(assistant)
    if not assistant or not path.is_dir():
        raise ValueError(f"assistant must be 'default', None or an existing dir, got {assistant!r}")
    return path


class FrozenKVMTPWorker:
    """Speculation for one target: construct (load + validate the assistant, no pool yet), then ``bind`` once
    the target pool exists (DESIGN §4 rule 2). ``seeds`` holds one DraftInput row per running request."""

    def __init__(self, config, target, assistant_path: Path, device, dtype):
        self.target, self.config = target, config
        self.num_steps, self.topk, self.num_draft_tokens = config.num_steps, config.topk, config.num_draft_tokens
        self.assistant = Gemma4Assistant.from_pretrained(assistant_path, device, dtype)
        self.assistant.check_target(target.config, target.kv_layer_types, target.num_kv_heads, target.head_dim,
                                    target.rope_theta, target.rope_scaling)
        self.seeds = DraftInput.idle(target.config.hidden_size, device, dtype)

    def bind(self) -> None:
        self.assistant.bind_target(self.target)

    def add_seeds(self, req_ids: list[int], bonus: torch.Tensor, hidden: torch.Tensor) -> None:
        """Seeds after prefill: the sampled first token and the last prompt row's hidden."""
        self.seeds = self.seeds.merge(DraftInput(req_ids, bonus, hidden))

    def release(self, req_ids) -> None:
        """Drop finished requests; when all are gone the seeds are the idle 0-row input."""
        gone = set(req_ids)
        self.seeds = self.seeds.filter([r for r in self.seeds.req_ids if r not in gone])

    def seed_for(self, reqs) -> DraftInput:
        """The seeds of ``reqs``, in batch order; RuntimeError if one is missing."""
        seed = self.seeds.filter([r.request_id for r in reqs])
        if len(seed) != len(reqs):
            raise RuntimeError("a decode request has no draft seed")
        return seed

    def draft(self, reqs, block_table, seq_lens, num_splits=None):
        return run_draft(self.assistant, self.seed_for(reqs), block_table, seq_lens, self.num_steps, self.topk,
                         self.num_draft_tokens, self.config.draft_position_offset, num_splits)

    def verify(self, tree, block_table, L, kv_cache, sampling=None):
        """Target forward over the tree (K/V written to rows [L, L+N)), accept, compact, next seed hidden.

        Pure tensor code with no host sync (graph-capturable): slots come from the block table on device.
        ``sampling`` = (temperature, top_k, top_p [B], noise [B, V + S*k]) or None for greedy.
        Returns (emitted [B, S+1] tokens padded with -1, accept_len [B], bonus [B], next seed hidden [B, Hb]).
        """
        B, N = tree.tokens.shape
        ps, dev = self.config.page_size, tree.tokens.device
        j = L.long()[:, None] + torch.arange(N, device=dev)
        slots = (block_table.long().gather(1, j // ps) * ps + j % ps).flatten()
        md = AttnMetadata("verify", block_table, L + N, slots,
                          torch.arange(0, (B + 1) * N, N, dtype=torch.int32, device=dev), N, tree.tree_mask)
        with attn_metadata(md):
            hidden = self.target(tree.tokens.flatten(), (L.long()[:, None] + tree.depth).flatten())
        logits = self.target.compute_logits(hidden).view(B, N, -1)
        if sampling is None:
            path, acc, bonus = accept_greedy(tree, logits.argmax(-1), self.num_steps)
        else:
            V, (t, k, p, u) = logits.shape[-1], sampling
            probs = filtered_probs(logits.view(B * N, V), *(x.repeat_interleave(N) for x in (t, k, p)))
            path, acc, bonus = accept_sampling(tree, probs.view(B, N, V), u[:, V:].view(B, self.num_steps, -1),
                                               u[:, :V], self.num_steps)
        if not tree.is_chain:
            compact_accepted_kv(kv_cache, block_table, L, path, acc, ps)
        last = path.gather(1, (acc - 1)[:, None]).squeeze(1)
        seed_hidden = hidden.view(B, N, -1)[torch.arange(B, device=dev), last]
        return emitted_tokens(tree, path, acc, bonus), acc, bonus, seed_hidden

    def draft_verify(self, bonus, hidden, block_table, L, kv_cache, sampling=None, num_splits=None):
        """One whole speculative step from seed tensors (what a CUDA graph captures per bucket)."""
        tree = run_draft(self.assistant, DraftInput([], bonus, hidden), block_table, L, self.num_steps, self.topk,
                         self.num_draft_tokens, self.config.draft_position_offset, num_splits)
        return self.verify(tree, block_table, L, kv_cache, sampling)

    def step(self, runner, reqs) -> list[list[int]]:
        """Draft, verify over the tree, accept; returns each request's emitted tokens (accepted drafts + bonus).

        Greedy batches that fit a captured bucket replay one CUDA graph for the whole step; everything else
        runs ``draft`` then ``verify`` eagerly (the same tensor code).
        """
        if not reqs:  # DESIGN §4 rule 4
            return []
        L = runner._tensor([r.num_computed for r in reqs], torch.int32)
        bt = block_table_tensor(reqs, runner.device)
        sampling = None
        if not all(r.params.greedy for r in reqs):
            u = runner.noise(reqs, runner.vocab_size + self.num_steps * self.topk)
            sampling = (*runner.sampling_tensors(reqs), u)
        graphs = runner.graphs
        if sampling is None and graphs is not None and graphs.has_spec(len(reqs)):
            seed = self.seed_for(reqs)
            out, acc, bonus, hidden = graphs.run_spec(seed.bonus_tokens, seed.hidden, bt, L)
        else:
            tree = self.draft(reqs, bt, L, num_splits=num_kv_splits(max(r.num_computed for r in reqs)))
            out, acc, bonus, hidden = self.verify(tree, bt, L, runner.kv_cache, sampling)
        self.seeds = self.seeds.merge(DraftInput([r.request_id for r in reqs], bonus, hidden))
        rows = torch.cat([acc[:, None], out], 1).tolist()  # the one host copy of the step
        for r, row in zip(reqs, rows):
            r.accept_lengths.append(row[0])
        return [row[1:1 + row[0]] for row in rows]
