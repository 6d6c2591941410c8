"""The target side of the engine: builds the target, allocates its paged KV pools (sized by ``memory``),
turns scheduled batches into tensors, runs prefill / decode forwards and samples each row's token; and the
CUDA graphs per batch-size bucket that plain decode and the speculative step replay (``GraphRunner.run``, the
one place that decides graph or eager)."""

from collections.abc import Callable
from functools import partial

import torch

from . import loader, memory
from .config import EngineConfig
from .context import AttnMetadata, attn_metadata
from .kernels.attention import KV_SPLIT_SIZE, num_kv_splits
from .kernels.matmul import linear_invariant
from .kernels.sampling import mask_logits, sample
from .kv_cache import DUMMY_BLOCK, BlockAllocator, cdiv, slot_mapping
from .logprobs import emitted_logprobs, score_prompts
from .parallel import SINGLE, TensorParallel, linear, use_onednn_weights
from .persistent_batch import PersistentBatch, StepInput
from .request import Request
from .scheduler import Batch
from .transfer import PrefillOutput, StepOutput, to_device


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
        self.model = loader.build_target(
            hf_config, self.device, self.dtype, max_pos, weights, config.seed, tp, gemm
        )
        self.split_size = KV_SPLIT_SIZE if config.deterministic else None
        if not config.deterministic:
            use_onednn_weights(self.model)  # a CPU in fp32 only
        self.vocab_size = self.model.config.vocab_size
        self.lookahead = config.num_draft_tokens if config.speculative else 1
        self.kv_pools: list[torch.Tensor] = []
        self.allocator: BlockAllocator | None = None
        self.graphs: GraphRunner | None = None

    # ---- KV pools
    # --------------------------------------------------------------------------------------------------
    def allocate_kv_cache(self) -> BlockAllocator:
        """Size, allocate and bind the pools (after profiling the largest steps on CUDA); returns the block
        allocator."""
        if self.device.type == "cuda":
            memory.profile_peak(self)
        n = memory.num_kv_blocks(self)
        self.bind_pools(n)
        self.allocator = BlockAllocator(n, self.config.page_size, self.config.enable_prefix_caching)
        return self.allocator

    def bind_pools(self, num_blocks: int) -> None:
        """One pool ``[layers, 2, num_blocks, page_size, Hkv, D]`` per KV geometry of the KV-owning layers
        (one block table serves all of them); the target's layers are bound to their views."""
        geometry = self.model.kv_geometry
        pools = {}
        for g in sorted({g for g in geometry if g is not None}):
            shape = (sum(x == g for x in geometry), 2, num_blocks, self.config.page_size, *g)
            pools[g] = torch.zeros(shape, dtype=self.dtype, device=self.device)
        layers = {g: iter(pool) for g, pool in pools.items()}  # each layer's [2, blocks, page, H, D] view
        caches = [None if g is None else tuple(next(layers[g])) for g in geometry]  # (k_cache, v_cache)
        self.kv_pools = list(pools.values())
        self.model.bind_kv_cache(caches)

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
        seq_lens = self._tensor(lens, torch.int32)
        cu_seqlens_q = self._tensor(cu, torch.int32)
        md = AttnMetadata.prefill(
            block_table, seq_lens, slots, cu_seqlens_q, max(batch.num_new), self.split_size
        )
        return self._tensor(ids), positions, md, [c - 1 for c in cu[1:]]

    # ---- running
    # -----------------------------------------------------------------------------------------------------
    def sample_tokens(
        self, reqs: list[Request], logits: torch.Tensor, positions: torch.Tensor, persistent_batch, bitmask
    ) -> tuple:
        """The token each row produces [B] int64, from logits [B, V], and its ``emitted_logprobs`` (or None):
        ``kernels.sampling.sample``'s position-keyed Gumbel argmax, a function of the request's seed, the
        token's absolute position and the target's logits at that row, whatever step, batch or draft produced
        the row (DESIGN §5, "Seeds"); rank 0's tokens on every rank (DESIGN §4 rule 8). ``positions`` [B]
        int64: the absolute positions of those tokens; the requests' sampling parameters come from their rows
        in ``persistent_batch`` (``PersistentBatch.sampling``); ``bitmask`` [B, W] int32 (structured output):
        the tokens each row may produce, or None. A batch of greedy rows only takes the argmax (no
        parameters)."""
        if all(r.params.greedy for r in reqs):
            tokens = mask_logits(logits, bitmask).argmax(-1)
        else:
            tokens = sample(logits, *persistent_batch.sampling(reqs), positions, bitmask=bitmask)
        self.tp.agree(tokens)
        return tokens, emitted_logprobs(reqs, logits, tokens, bitmask)

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
            sampled, logprobs = self.sample_tokens(reqs, logits, positions, persistent_batch, bitmask)
            bonus[self._tensor([done.index(i) for i in new])] = sampled
        done_reqs = [batch.reqs[i] for i in done]
        done_hidden = hidden[self._tensor([last[i] for i in done])]
        prompt_logprobs, prompt_rows = score_prompts(self.model, batch, hidden, last)
        return PrefillOutput(
            len(batch.reqs), done, new, done_reqs, bonus, done_hidden, logprobs, prompt_logprobs, prompt_rows
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
        inputs = dict(
            ids=inp.bonus_tokens, pos=pos, slots=slots, block_table=bt, seq_lens=inp.num_computed_tokens + 1
        )
        logits = self.graphs.run("decode", inputs, num_kv_splits(bound))
        bitmask = None if masks is None else masks.root(range(len(reqs)))
        toks, logprobs = self.sample_tokens(reqs, logits, pos + 1, persistent_batch, bitmask)  # at L + 1
        persistent_batch.advance(StepInput(inp.req_ids, toks, inp.hidden, inp.num_computed_tokens + 1))
        return StepOutput(torch.stack([torch.ones_like(toks), toks], 1), logprobs=logprobs)


# ---- CUDA graphs per batch-size bucket: plain decode here, the whole speculative step in mtp/worker.py
def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Buckets: 1, 2, 4, 8, then steps of 16 up to max_num_seqs (and max_num_seqs itself)."""
    return [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16)) + [max_num_seqs]


def select_bucket(batch_size: int, sizes: list[int]) -> int | None:
    """Smallest bucket holding ``batch_size`` rows; None means eager fallback (too big, or an empty batch)."""
    if batch_size <= 0:
        return None
    return next((s for s in sizes if s >= batch_size), None)


def front(buf: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The view of ``buf`` where a tensor of ``shape`` goes: its first ``shape[i]`` entries in each dim."""
    return buf[tuple(slice(0, d) for d in shape)]


class StaticBuffers:
    """Named static tensors of ``max_rows`` rows; each spec is (a row's shape ``(1, *trailing)``, dtype, pad).

    ``fill(name, live)`` copies the live rows to the front and writes the buffer's pad value into the rest, so
    a captured graph always sees a fully defined batch.
    """

    def __init__(self, device, max_rows: int, specs: dict[str, tuple[tuple[int, ...], torch.dtype, float]]):
        self.pads = {name: pad for name, (_, _, pad) in specs.items()}
        for name, (shape, dtype, pad) in specs.items():
            setattr(self, name, torch.full((max_rows, *shape[1:]), pad, dtype=dtype, device=device))

    def fill(self, name: str, live: torch.Tensor) -> None:
        buf = getattr(self, name)
        buf.fill_(self.pads[name])
        front(buf, live.shape).copy_(live)  # live rows may be narrower (block tables)


class StaticOutputs:
    """The static outputs of every captured phase and bucket: per output position one tensor of the largest
    bucket's rows, each trailing dim the largest any phase returns there. A graph copies its outputs into
    views of them (``write``), so a capture keeps one set of outputs alive, not one per phase and bucket.
    A position where a phase returns None (a tensor only an eager call returns) stays None."""

    def __init__(self, samples: list[tuple], rows: int):
        self.buffers = []
        for column in zip(*samples):
            kept = [x for x in column if x is not None]
            if not kept:
                self.buffers.append(None)
                continue
            trailing = [max(dims) for dims in zip(*(x.shape[1:] for x in kept))]
            self.buffers.append(torch.empty(rows, *trailing, dtype=kept[0].dtype, device=kept[0].device))

    def write(self, outputs: tuple) -> tuple:
        """Copy ``outputs`` (one phase's) into their views; returns the views."""
        views = tuple(None if x is None else front(buf, x.shape) for buf, x in zip(self.buffers, outputs))
        for view, x in zip(views, outputs):
            if x is not None:
                view.copy_(x)
        return views


class BucketGraphs:
    """``fn(bs)`` (reading static buffers, returning a tuple of tensors and Nones) captured as one
    CUDA graph per bucket.

    ``capture(pool, outputs)`` warms every kernel specialization with an eager call first (a JIT compile
    inside capture invalidates it), then captures largest-first into the memory ``pool`` that every phase
    shares, the graph writing its outputs into views of the shared ``StaticOutputs``. ``run(bs)`` replays the
    bucket's graph and returns those views; with no graph for ``bs`` it calls ``fn(bs)`` eagerly.
    """

    def __init__(self, fn: Callable[[int], object], sizes: list[int]):
        self.fn = fn
        self.sizes = sizes
        self.graphs = {}
        self.views = {}

    def capture(self, pool, outputs: StaticOutputs) -> None:
        for bs in sorted(self.sizes, reverse=True):
            self.fn(bs)  # warm-up: compile every kernel variant outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.views[bs] = outputs.write(self.fn(bs))
            self.graphs[bs] = g

    def run(self, bs: int):
        if bs in self.graphs:
            self.graphs[bs].replay()
            return self.views[bs]
        return self.fn(bs)


class GraphRunner:
    """Phases run through bucketed graphs or eagerly: the one place that decides (``run``).

    CUDA graphs per batch-size bucket for the hot phases: plain decode and the whole speculative step.

    Each phase is a pure tensor function of named inputs (no host syncs). ``GraphRunner.run`` is the one
    place that decides graph or eager. A batch of constrained rows with their masks runs eagerly (the
    speculative step runs such rows apart from the others, which keep their graph: DESIGN §5). A batch
    that fits a bucket is copied into the first rows of static buffers and the bucket's graph replays
    (padding rows point at the reserved dummy block 0, so their K/V writes land there and they read one
    dummy key: they never touch a live request's KV); a batch larger than every bucket, or a phase with no
    buckets (CPU, ``enforce_eager``), runs the same function eagerly on the live tensors. On CPU, tests
    give buckets explicitly: the function then runs eagerly on the padded static buffers, exactly what a
    graph would replay.

    ``phases``: name -> (fn, input names); ``fn(num_splits=..., **inputs)`` is pure tensor code. ``buffers``
    declares every static input: name -> (per-row shape, dtype, pad value). Block tables are
    ``ceil((max_model_len + lookahead) / page_size)`` wide so a live table always fits; the split-KV count is
    fixed (``num_splits``, from max_model_len) so captured graphs never sync. ``sizes`` empty = always eager.
    """

    def __init__(self, phases, buffers, sizes, num_splits, device):
        self.phases = phases
        self.sizes = sizes
        self.num_splits = num_splits
        self.buffer_specs = buffers
        self.buf = StaticBuffers(device, sizes[-1], buffers) if sizes else None
        self.graphs = {name: BucketGraphs(partial(self._static_call, name), sizes) for name in phases}
        self.outputs: StaticOutputs | None = None

    def _static_call(self, phase: str, bs: int) -> tuple:
        """The phase over the first ``bs`` rows of the static buffers; its outputs as a tuple."""
        fn, names = self.phases[phase]
        out = fn(num_splits=self.num_splits, **{k: getattr(self.buf, k)[:bs] for k in names})
        return out if isinstance(out, tuple) else (out,)

    def capture(self) -> None:
        """Capture every phase for every bucket into one memory pool, their outputs into one set of static
        outputs (CUDA only: elsewhere, and with ``enforce_eager``, there are no buckets and nothing to
        capture). Each phase first runs eagerly at the largest bucket, which sizes the static outputs."""
        if not self.sizes:
            return
        rows = self.sizes[-1]
        self.outputs = StaticOutputs([self._static_call(name, rows) for name in self.phases], rows)
        pool = torch.cuda.graph_pool_handle()
        for g in self.graphs.values():
            g.capture(pool, self.outputs)
        torch.cuda.synchronize()

    def run(self, phase: str, inputs: dict[str, torch.Tensor], num_splits: int | None, eager=None):
        """The phase's outputs for the live batch (padding rows dropped): the same function on the same named
        tensors, eager or replayed. ``num_splits`` serves only the eager call (a graph has its own fixed
        split count). ``eager``: further arguments that only an eager call takes (structured output's masks,
        which the host computes between draft steps; the logits that logprobs read), or None. A replay
        returns views of the shared static outputs: read them before the next replay of any phase."""
        bs = next(iter(inputs.values())).shape[0]
        bucket = None if eager else select_bucket(bs, self.sizes)
        if bucket is None:
            return self.phases[phase][0](num_splits=num_splits, **(eager or {}), **inputs)
        for name, t in inputs.items():
            self.buf.fill(name, t)
        out = tuple(None if x is None else x[:bs] for x in self.graphs[phase].run(bucket))
        return out[0] if len(out) == 1 else out  # a phase returning one tensor (decode) gets it back
