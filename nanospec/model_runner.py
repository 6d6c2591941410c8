"""The target side of the engine: builds the target, allocates its paged KV pools, turns scheduled batches
into tensors and runs prefill / decode forwards (eagerly or through CUDA graphs, decided by
``GraphRunner.run``)."""

import sys

import torch

from . import loader
from .config import EngineConfig
from .context import AttnMetadata, attn_metadata
from .cuda_graph import GraphRunner, graph_batch_sizes
from .kernels.attention import KV_SPLIT_SIZE, num_kv_splits
from .kernels.matmul import linear_invariant
from .kernels.sampling import mask_logits, sample
from .kv_cache import DUMMY_BLOCK, BlockAllocator, cdiv, slot_mapping
from .logprobs import emitted_logprobs, score_prompts
from .models import init_random_weights, load_weights, target_class
from .parallel import SINGLE, TensorParallel, linear
from .persistent_batch import PersistentBatch, StepInput
from .request import Request
from .scheduler import Batch
from .transfer import PrefillOutput, StepOutput, to_device


def build_target(cfg, device, dtype, max_position: int, model_dir=None, seed=0, tp=SINGLE, gemm=linear):
    """Construct the target (``models.target_class``: Llama/Qwen3 or Gemma 4, config checked first) on the
    meta device as rank ``tp.rank`` of ``tp.size``, its GEMMs through ``gemm``; materialise it on ``device``
    in ``dtype``, then load the checkpoint in ``model_dir`` (or random weights when None)."""
    cls, text_config = target_class(cfg)
    with torch.device("meta"):
        # materialised in dtype: no fp32 copy of the weights
        model = cls(text_config, max_position, tp, gemm).to(dtype)
    model.to_empty(device=device)
    if model_dir is None:
        init_random_weights(model, seed)
    else:
        skip = ("lm_head.",) if model.tied else ()
        load_weights(model, loader.iter_safetensors(model_dir), skip, loader.safetensors_names(model_dir))
    model.eval().requires_grad_(False)
    model.init_buffers(device)
    return model


def memory_plan(total: int, used: int, peak: int, step_logits: int, config) -> dict[str, int]:
    """Bytes of a GPU of ``total`` bytes, ``used`` of them taken (weights, the CUDA context): what the
    engine reserves besides its weights and what is left for the KV cache, within
    ``config.gpu_memory_utilization``. ``peak``: the activations of the largest prefill chunk and of the
    largest decode or verify step with its logits and sampling (on CUDA profiled, ``_profile_peak``; without
    a GPU estimated, ``scripts/memory_plan.py``); ``step_logits``: that step's logits alone
    (``ModelRunner.step_logits_bytes``), a floor under the peak. Eager steps take the larger of the two; the
    CUDA graphs' one memory pool, which holds the largest captured step's activations (an ``mtp:{s}`` or
    ``decode`` step), is reserved as much again, an upper bound (their static outputs are a few MB)."""
    activations = max(peak, step_logits)
    graph_pool = 0 if config.enforce_eager else activations
    kv_cache = int(total * config.gpu_memory_utilization) - used - activations - graph_pool
    return dict(total=total, used=used, activations=activations, graph_pool=graph_pool, kv_cache=kv_cache)


def sample_tokens(
    reqs: list[Request], logits: torch.Tensor, positions: torch.Tensor, persistent_batch, bitmask=None
) -> torch.Tensor:
    """The token each row produces [B] int64, from logits [B, V]: ``kernels.sampling.sample``'s
    position-keyed Gumbel argmax, a function of the request's seed, the token's absolute position and the
    target's logits at that row, whatever step, batch or draft produced the row (DESIGN §5, "Seeds").
    ``positions`` [B] int64: the absolute positions of those tokens; the requests' sampling parameters come
    from their rows in ``persistent_batch`` (``PersistentBatch.sampling``); ``bitmask`` [B, W] int32
    (structured output): the tokens each row may produce, or None. A batch of greedy rows only takes the
    argmax (no parameters)."""
    if all(r.params.greedy for r in reqs):
        return mask_logits(logits, bitmask).argmax(-1)
    return sample(logits, *persistent_batch.sampling(reqs), positions, bitmask=bitmask)


class ModelRunner:
    """Owns the target model, its KV pools and the graph runner; a step's per-request rows (block tables,
    sampling parameters, next inputs) come from ``LLM``'s ``PersistentBatch``.

    ``LLM`` drives the order (DESIGN §4 rule 2): ``ModelRunner(...)`` builds the target;
    ``allocate_kv_cache()`` sizes the pools from the memory budget, allocates them and binds the target's
    layers; ``capture_graphs()`` captures decode once everything is bound (the MTP worker captures its own).
    """

    def __init__(self, config: EngineConfig, hf_config, model_dir=None, tp: TensorParallel = SINGLE):
        self.config = config
        self.tp = tp
        self.device = config.torch_device()
        self.dtype = config.torch_dtype()
        if config.deterministic and getattr(hf_config.get_text_config(), "enable_moe_block", False):
            raise ValueError("deterministic=True does not cover MoE targets (enable_moe_block): use False")
        max_pos = config.max_model_len + (config.num_draft_tokens or 1)  # verify rows sit past the last token
        weights = None if config.load_format == "dummy" else model_dir
        # deterministic mode is read here only (DESIGN §4 rule 9): batch-invariant GEMMs, and one KV split
        # size for every attention row, which the runner and the worker put in each forward's metadata
        gemm = linear_invariant if config.deterministic else linear
        self.model = build_target(hf_config, self.device, self.dtype, max_pos, weights, config.seed, tp, gemm)
        self.split_size = KV_SPLIT_SIZE if config.deterministic else None
        self.vocab_size = self.model.config.vocab_size
        self.lookahead = config.num_draft_tokens if config.speculative else 1
        self.kv_pools: list[torch.Tensor] = []
        self.allocator: BlockAllocator | None = None
        self.graphs: GraphRunner | None = None

    # ---- KV pools
    # --------------------------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        """Bytes of one block over every KV-owning layer (KV-shared layers own none)."""
        per_layer = [2 * self.config.page_size * h * d for h, d in filter(None, self.model.kv_geometry)]
        return sum(per_layer) * torch.finfo(self.dtype).bits // 8

    def num_kv_blocks(self) -> int:
        """Pool size from the memory budget (GPU: ``gpu_memory_utilization`` after weights and a profiled
        activation peak; CPU: ``cpu_kv_cache_gb``), capped at what ``max_num_seqs`` full requests need."""
        c = self.config
        per_block = self.kv_bytes_per_block()
        per_req = cdiv(c.max_model_len + self.lookahead, c.page_size)
        if c.num_kv_blocks is not None:
            n = c.num_kv_blocks
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
            plan = memory_plan(total, total - free, peak, self.step_logits_bytes(), c)
            n = min(int(plan["kv_cache"] // per_block), c.max_num_seqs * per_req + 1)
            figures = ", ".join(f"{name} {value / 2**30:.2f}" for name, value in plan.items())
            print(f"nanospec: memory plan (GiB): {figures}", file=sys.stderr, flush=True)
        else:
            n = min(int(c.cpu_kv_cache_gb * 2**30 // per_block), c.max_num_seqs * per_req + 1)
        # every rank's pool has as many blocks (they share the block tables): the smallest any rank offers
        n = int(self.tp.all_reduce(torch.tensor([n], device=self.device), torch.distributed.ReduceOp.MIN))
        if n - 1 < per_req:
            raise ValueError(
                f"the KV budget holds {max(n - 1, 0)} blocks of {c.page_size} tokens, but one "
                f"request of max_model_len={c.max_model_len} needs {per_req}: lower "
                "max_model_len or raise gpu_memory_utilization, cpu_kv_cache_gb, num_kv_blocks"
            )
        return n

    def step_logits_bytes(self) -> int:
        """Bytes of the largest decode or verify step's logits: ``max_num_seqs`` x (``num_draft_tokens`` or
        1) rows of the vocabulary, the LM head's output in the model dtype and its fp32 copy."""
        rows = self.config.max_num_seqs * self.lookahead
        return rows * self.vocab_size * (torch.finfo(self.dtype).bits // 8 + 4)

    def allocate_kv_cache(self) -> BlockAllocator:
        """Size, allocate and bind the pools (after profiling the largest steps on CUDA); returns the block
        allocator."""
        if self.device.type == "cuda":
            self._profile_peak()
        n = self.num_kv_blocks()
        self.bind_pools(n)
        self.allocator = BlockAllocator(n, self.config.page_size, self.config.enable_prefix_caching)
        return self.allocator

    def bind_pools(self, num_blocks: int) -> None:
        """One pool ``[layers, 2, num_blocks, page_size, Hkv, D]`` per KV geometry of the KV-owning layers
        (one block table serves all of them); the target's layers are bound to their views."""
        geometry = self.model.kv_geometry
        shapes = sorted({g for g in geometry if g is not None})
        pools = {
            g: torch.zeros(
                sum(x == g for x in geometry),
                2,
                num_blocks,
                self.config.page_size,
                *g,
                dtype=self.dtype,
                device=self.device,
            )
            for g in shapes
        }
        layers = {g: iter(pool) for g, pool in pools.items()}  # each layer's [2, blocks, page, H, D] view
        caches = [None if g is None else tuple(next(layers[g])) for g in geometry]  # (k_cache, v_cache)
        self.kv_pools = list(pools.values())
        self.model.bind_kv_cache(caches)

    @torch.inference_mode()
    def _profile_peak(self) -> None:
        """The largest steps the engine will run, over a scratch pool, so the KV budget leaves room for their
        activations (vLLM profiles its sampler the same way): a prefill of the largest chunk, then a step of
        ``max_num_seqs`` requests of ``lookahead`` tokens each (a verify, or a decode), its logits and sampled
        tokens. Only the target is bound to the scratch pool; the drafter, whose activations are far smaller
        (``topk`` rows per request at its own width), binds after the real allocation."""
        c = self.config
        dev = self.device
        T = min(c.max_num_batched_tokens, c.max_model_len)
        B = c.max_num_seqs
        N = self.lookahead
        blocks = cdiv(max(T, N), c.page_size) + 1
        self.bind_pools(blocks)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        table = torch.arange(1, blocks, dtype=torch.int32, device=dev)
        md = AttnMetadata.prefill(
            table[None],
            torch.tensor([T], dtype=torch.int32, device=dev),
            torch.arange(c.page_size, c.page_size + T, device=dev),
            torch.tensor([0, T], dtype=torch.int32, device=dev),
            T,
            self.split_size,
        )
        with attn_metadata(md):
            ids = torch.zeros(T, dtype=torch.long, device=dev)
            self.model.compute_logits(self.model(ids, torch.arange(T, device=dev))[-1:])
        # every request reads and writes the same scratch blocks: only the shapes count here
        L = torch.zeros(B, dtype=torch.int32, device=dev)
        positions = torch.arange(N, device=dev).repeat(B)
        md = AttnMetadata.verify(table.repeat(B, 1), L, c.page_size + positions, N, None, self.split_size)
        with attn_metadata(md):
            hidden = self.model(torch.zeros(B * N, dtype=torch.long, device=dev), positions)
        logits = self.model.compute_logits(hidden)
        greedy = torch.zeros(B * N, device=dev)
        sample(logits, greedy, greedy.int(), greedy + 1, positions, positions)
        self.kv_pools = []
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    # ---- graphs
    # ----------------------------------------------------------------------------------------------------
    def graph_shape(self) -> tuple[list[int], int, int]:
        """What every captured phase shares: (batch-size buckets, split-KV count, block-table width in
        blocks). Buckets exist only on CUDA without ``enforce_eager``; elsewhere every phase runs eagerly."""
        c = self.config
        use_graphs = self.device.type == "cuda" and not c.enforce_eager
        sizes = graph_batch_sizes(c.max_num_seqs) if use_graphs else []
        width = cdiv(c.max_model_len + self.lookahead, c.page_size)
        return sizes, num_kv_splits(c.max_model_len), width

    def capture_graphs(self) -> None:
        """The "decode" phase (the MTP worker captures its own phases)."""
        sizes, num_splits, width = self.graph_shape()
        buffers = {
            "ids": ((1,), torch.long, 0),
            "pos": ((1,), torch.long, 0),
            "slots": ((1,), torch.long, DUMMY_BLOCK * self.config.page_size),
            "block_table": ((1, width), torch.int32, DUMMY_BLOCK),
            "seq_lens": ((1,), torch.int32, 1),
        }
        phases = {"decode": (self._decode_logits, list(buffers))}
        self.graphs = GraphRunner(phases, buffers, sizes, num_splits, self.device)
        self.graphs.capture()

    def _decode_logits(self, ids, pos, slots, block_table, seq_lens, num_splits=None) -> torch.Tensor:
        with attn_metadata(AttnMetadata.decode(block_table, seq_lens, slots, num_splits, self.split_size)):
            return self.model.compute_logits(self.model(ids, pos))

    # ---- batch preparation
    # -------------------------------------------------------------------------------------------
    def _tensor(self, data, dtype=torch.int64) -> torch.Tensor:
        return to_device(data, dtype, self.device)

    def prepare_prefill(self, batch: Batch, block_table: torch.Tensor):
        """Token ids, positions and metadata for one chunk of each request's prompt (+ outputs on resume);
        ``block_table`` [B, W] int32: the batch's (``PersistentBatch.block_tables``). Returns (ids [T],
        positions [T], AttnMetadata, index of each request's last row)."""
        ids = []
        pos = []
        rows = []
        cu = [0]
        lens = []
        for i, (req, n) in enumerate(zip(batch.reqs, batch.num_new)):
            s = req.num_computed_tokens
            ids += req.all_token_ids[s : s + n]
            pos += range(s, s + n)
            rows += [i] * n
            cu.append(cu[-1] + n)
            lens.append(s + n)
        positions = self._tensor(pos)
        slots = slot_mapping(block_table, self._tensor(rows), positions, self.config.page_size)
        md = AttnMetadata.prefill(
            block_table,
            self._tensor(lens, torch.int32),
            slots,
            self._tensor(cu, torch.int32),
            max(batch.num_new),
            self.split_size,
        )
        return self._tensor(ids), positions, md, [c - 1 for c in cu[1:]]

    # ---- running
    # -----------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, batch: Batch, persistent_batch: PersistentBatch, masks=None) -> PrefillOutput:
        """Run one prefill step (chunks of several requests), no host sync; the requests' block tables and
        sampling parameters come from their rows in ``persistent_batch``. New requests whose prompt
        completes sample their first token (``masks``: the batch's ``structured.StepMasks``, or None);
        resumed ones (after preemption) emit nothing: their newest token is out."""
        if not batch.reqs:  # DESIGN §4 rule 4: an empty step never reaches attention metadata
            return PrefillOutput(0, [], [], [], torch.zeros(0, dtype=torch.long), torch.zeros(0))
        ids, pos, md, last = self.prepare_prefill(batch, persistent_batch.block_tables(batch.reqs))
        with attn_metadata(md):
            hidden = self.model(ids, pos)
        done = [i for i in range(len(batch.reqs)) if batch.completes(i)]
        new = [i for i in done if not batch.reqs[i].output_token_ids]
        bonus = self._tensor([batch.reqs[i].last_token for i in done])
        logprobs = None
        if new:
            reqs = [batch.reqs[i] for i in new]
            logits = self.model.compute_logits(hidden[self._tensor([last[i] for i in new])])
            bitmask = None if masks is None else masks.root(new)
            positions = self._tensor([r.num_tokens for r in reqs])
            sampled = sample_tokens(reqs, logits, positions, persistent_batch, bitmask)
            self.tp.agree(sampled)  # rank 0's tokens (DESIGN §4 rule 8)
            bonus[self._tensor([done.index(i) for i in new])] = sampled
            rows_bitmask = None if bitmask is None else bitmask[:, None]
            logprobs = emitted_logprobs(reqs, logits[:, None], sampled[:, None], rows_bitmask)
        done_reqs = [batch.reqs[i] for i in done]
        done_hidden = hidden[self._tensor([last[i] for i in done])]
        prompt_logprobs, prompt_logprob_rows = score_prompts(self.model, batch, hidden, last)
        return PrefillOutput(
            len(batch.reqs),
            done,
            new,
            done_reqs,
            bonus,
            done_hidden,
            logprobs,
            prompt_logprobs,
            prompt_logprob_rows,
        )

    # ---- plain decode
    # ------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, reqs: list[Request], persistent_batch: PersistentBatch, masks=None) -> StepOutput:
        """One plain decode step: each request's next token, its input read from and its next input left in
        its row of ``persistent_batch``, on the device (no host sync); ``masks``: the batch's
        ``structured.StepMasks``, or None."""
        if not reqs:  # DESIGN §4 rule 4
            return StepOutput(torch.zeros(0, 2, dtype=torch.long))
        inp = persistent_batch.take(reqs)
        bt = persistent_batch.block_tables(reqs)
        pos = inp.num_computed_tokens.long()
        slots = slot_mapping(bt, torch.arange(len(reqs), device=self.device), pos, self.config.page_size)
        bound = max(r.num_computed_tokens + r.num_inflight for r in reqs) + 1
        inputs = {
            "ids": inp.bonus_tokens,
            "pos": pos,
            "slots": slots,
            "block_table": bt,
            "seq_lens": inp.num_computed_tokens + 1,
        }
        logits = self.graphs.run("decode", inputs, num_kv_splits(bound))
        bitmask = None if masks is None else masks.root(range(len(reqs)))
        toks = sample_tokens(reqs, logits, pos + 1, persistent_batch, bitmask)  # the token at position L + 1
        self.tp.agree(toks)
        persistent_batch.advance(StepInput(inp.req_ids, toks, inp.hidden, inp.num_computed_tokens + 1))
        rows = torch.stack([torch.ones_like(toks), toks], 1)
        rows_bitmask = None if bitmask is None else bitmask[:, None]
        logprobs = emitted_logprobs(reqs, logits[:, None], toks[:, None], rows_bitmask)
        return StepOutput(rows, logprobs=logprobs)
