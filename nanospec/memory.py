"""The KV cache's size: how many blocks the memory budget holds, decided once before the first request
(DESIGN §3). On CUDA the engine first runs the largest steps it will ever run over a scratch pool and reserves
their activation peak (``profile_peak``), then gives the KV cache what ``memory_plan`` leaves of
``gpu_memory_utilization``; on a CPU the budget is ``cpu_kv_cache_gb``. The functions take the
``ModelRunner`` whose target and pools they size."""

import sys

import torch

from .context import AttnMetadata, attn_metadata
from .kernels.sampling import sample
from .kv_cache import cdiv


def memory_plan(total: int, used: int, peak: int, step_logits: int, config) -> dict[str, int]:
    """Bytes of a GPU of ``total`` bytes, ``used`` of them taken (weights, the CUDA context): what the
    engine reserves besides its weights and what is left for the KV cache, within
    ``config.gpu_memory_utilization``. ``peak``: the activations of the largest prefill chunk and of the
    largest decode or verify step with its logits and sampling (on CUDA profiled, ``profile_peak``; without
    a GPU estimated, ``scripts/memory_plan.py``); ``step_logits``: that step's logits alone
    (``step_logits_bytes``), a floor under the peak. Eager steps take the larger of the two; the
    CUDA graphs' one memory pool, which holds the largest captured step's activations (an ``mtp:{s}`` or
    ``decode`` step), is reserved as much again, an upper bound (their static outputs are a few MB)."""
    activations = max(peak, step_logits)
    graph_pool = 0 if config.enforce_eager else activations
    kv_cache = int(total * config.gpu_memory_utilization) - used - activations - graph_pool
    return dict(total=total, used=used, activations=activations, graph_pool=graph_pool, kv_cache=kv_cache)


def num_kv_blocks(runner) -> int:
    """Pool size from the memory budget (GPU: ``gpu_memory_utilization`` after weights and a profiled
    activation peak; CPU: ``cpu_kv_cache_gb``), capped at what ``max_num_seqs`` full requests need."""
    c = runner.config
    # bytes of one block over every KV-owning layer (KV-shared layers own none)
    per_layer = [2 * c.page_size * h * d for h, d in filter(None, runner.model.kv_geometry)]
    per_block = sum(per_layer) * torch.finfo(runner.dtype).bits // 8
    per_req = cdiv(c.max_model_len + runner.lookahead, c.page_size)
    if c.num_kv_blocks is not None:
        n = c.num_kv_blocks
    elif runner.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(runner.device)
        peak = torch.cuda.max_memory_allocated(runner.device) - torch.cuda.memory_allocated(runner.device)
        plan = memory_plan(total, total - free, peak, step_logits_bytes(runner), c)
        n = min(int(plan["kv_cache"] // per_block), c.max_num_seqs * per_req + 1)
        figures = ", ".join(f"{name} {value / 2**30:.2f}" for name, value in plan.items())
        print(f"nanospec: memory plan (GiB): {figures}", file=sys.stderr, flush=True)
    else:
        n = min(int(c.cpu_kv_cache_gb * 2**30 // per_block), c.max_num_seqs * per_req + 1)
    # every rank's pool has as many blocks (they share the block tables): the smallest any rank offers
    n = int(runner.tp.all_reduce(torch.tensor([n], device=runner.device), torch.distributed.ReduceOp.MIN))
    if n - 1 < per_req:
        raise ValueError(
            f"the KV budget holds {max(n - 1, 0)} blocks of {c.page_size} tokens, but one "
            f"request of max_model_len={c.max_model_len} needs {per_req}: lower "
            "max_model_len or raise gpu_memory_utilization, cpu_kv_cache_gb, num_kv_blocks"
        )
    return n


def step_logits_bytes(runner) -> int:
    """Bytes of the largest decode or verify step's logits: ``max_num_seqs`` x (``num_draft_tokens`` or
    1) rows of the vocabulary, the LM head's output in the model dtype and its fp32 copy."""
    rows = runner.config.max_num_seqs * runner.lookahead
    return rows * runner.vocab_size * (torch.finfo(runner.dtype).bits // 8 + 4)


@torch.inference_mode()
def profile_peak(runner) -> None:
    """The largest steps the engine will run, over a scratch pool, so the KV budget leaves room for their
    activations (vLLM profiles its sampler the same way): a prefill of the largest chunk, then a step of
    ``max_num_seqs`` requests of ``lookahead`` tokens each (a verify, or a decode), its logits and sampled
    tokens. Only the target is bound to the scratch pool; the drafter, whose activations are far smaller
    (``topk`` rows per request at its own width), binds after the real allocation."""
    c = runner.config
    dev = runner.device
    T = min(c.max_num_batched_tokens, c.max_model_len)
    B = c.max_num_seqs
    N = runner.lookahead
    blocks = cdiv(max(T, N), c.page_size) + 1
    runner.bind_pools(blocks)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    table = torch.arange(1, blocks, dtype=torch.int32, device=dev)
    seq_lens = torch.tensor([T], dtype=torch.int32, device=dev)
    slots = torch.arange(c.page_size, c.page_size + T, device=dev)
    cu_seqlens_q = torch.tensor([0, T], dtype=torch.int32, device=dev)
    md = AttnMetadata.prefill(table[None], seq_lens, slots, cu_seqlens_q, T, runner.split_size)
    with attn_metadata(md):
        ids = torch.zeros(T, dtype=torch.long, device=dev)
        runner.model.compute_logits(runner.model(ids, torch.arange(T, device=dev))[-1:])
    # every request reads and writes the same scratch blocks: only the shapes count here
    L = torch.zeros(B, dtype=torch.int32, device=dev)
    positions = torch.arange(N, device=dev).repeat(B)
    md = AttnMetadata.verify(table.repeat(B, 1), L, c.page_size + positions, N, None, runner.split_size)
    with attn_metadata(md):
        hidden = runner.model(torch.zeros(B * N, dtype=torch.long, device=dev), positions)
    logits = runner.model.compute_logits(hidden)
    greedy = torch.zeros(B * N, device=dev)
    sample(logits, greedy, greedy.int(), greedy + 1, positions, positions)
    runner.bind_pools(0)  # the scratch pool goes; the real one is sized next
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
