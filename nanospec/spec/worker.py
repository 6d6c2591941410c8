"""Frozen-KV MTP worker: owns the assistant and the seeds, and runs draft -> verify -> accept per decode step."""
from pathlib import Path

import torch

from ..context import AttnMetadata, attn_metadata
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
    if not path.is_dir():
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

    def draft(self, reqs, block_table, seq_lens):
        seed = self.seeds.filter([r.request_id for r in reqs])
        if len(seed) != len(reqs):
            raise RuntimeError("a decode request has no draft seed")
        return run_draft(self.assistant, seed, block_table, seq_lens, self.num_steps, self.topk,
                         self.num_draft_tokens, self.config.draft_position_offset)

    def step(self, runner, reqs) -> list[list[int]]:
        """Draft, verify over the tree, accept; returns each request's emitted tokens (accepted drafts + bonus)."""
        dev, B = runner.device, len(reqs)
        L = runner._tensor([r.num_computed for r in reqs], torch.int32)
        bt = block_table_tensor(reqs, dev)
        tree = self.draft(reqs, bt, L)
        N = tree.tokens.shape[1]
        slots = [s for r in reqs for s in runner.allocator.slots(r, r.num_computed, r.num_computed + N)]
        md = AttnMetadata("verify", bt, L + N, runner._tensor(slots),
                          torch.arange(0, (B + 1) * N, N, dtype=torch.int32, device=dev), N, tree.tree_mask)
        with attn_metadata(md):
            hidden = self.target(tree.tokens.flatten(), (L.long()[:, None] + tree.depth).flatten())
        logits = self.target.compute_logits(hidden).view(B, N, -1)
        if all(r.params.greedy for r in reqs):
            path, acc, bonus = accept_greedy(tree, logits.argmax(-1))
        else:
            V = logits.shape[-1]
            t, k, p = (x.repeat_interleave(N) for x in runner.sampling_tensors(reqs))
            probs = filtered_probs(logits.view(B * N, V), t, k, p).view(B, N, V)
            u = runner.noise(reqs, V + self.num_steps * self.topk)
            path, acc, bonus = accept_sampling(tree, probs, u[:, V:].view(B, self.num_steps, self.topk), u[:, :V])
        if not tree.is_chain:
            compact_accepted_kv(runner.kv_cache, bt, L, path, acc, runner.config.page_size)
        last = path.gather(1, (acc - 1)[:, None]).squeeze(1)
        self.seeds = self.seeds.merge(DraftInput([r.request_id for r in reqs], bonus,
                                                 hidden.view(B, N, -1)[torch.arange(B, device=dev), last]))
        out, acc = emitted_tokens(tree, path, acc, bonus).tolist(), acc.tolist()
        for r, a in zip(reqs, acc):
            r.accept_lengths.append(a)
        return [row[:a] for row, a in zip(out, acc)]
