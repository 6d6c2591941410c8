"""The target side of the engine: builds the target, allocates its paged KV pools, turns scheduled batches
into tensors and runs prefill / decode forwards (eagerly or through CUDA graphs, decided by
``GraphRunner.run``)."""

from dataclasses import dataclass
from functools import partial

import torch

from . import loader, parallel
from .config import EngineConfig
from .context import AttnMetadata, attn_metadata
from .cuda_graph import GraphRunner, graph_batch_sizes
from .kernels.attention import KV_SPLIT_SIZE, num_kv_splits
from .kernels.matmul import make_batch_invariant
from .kv_cache import DUMMY_BLOCK, BlockAllocator, block_table_tensor, slot_mapping
from .models import init_random_weights, load_weights, target_class
from .mtp.state import DraftInput
from .request import Request
from .sampler import Sampler
from .scheduler import Batch, HostCopy, StepOutput


def build_target(cfg, device, dtype, max_position: int, model_dir=None, seed: int = 0):
    """Construct the target (``models.target_class``: Llama/Qwen3 or Gemma 4, config checked first) on the
    meta device, materialise it on ``device`` in ``dtype``, then load the checkpoint in ``model_dir`` (or
    random weights when None)."""
    cls, text_config = target_class(cfg)
    with torch.device("meta"):
        model = cls(text_config, max_position).to(dtype)  # materialised in dtype: no fp32 copy of the weights
    model.to_empty(device=device)
    if model_dir is None:
        init_random_weights(model, seed)
    else:
        skip = ("lm_head.",) if model.tied else ()
        load_weights(model, loader.iter_safetensors(model_dir), skip, loader.safetensors_names(model_dir))
    model.eval().requires_grad_(False)
    model.init_buffers(device)
    return model


@dataclass
class PrefillOutput:
    """A prefill step's results, still on the device. ``done``: the requests whose prefill ended; ``bonus``
    [len(done)] int64: each one's newest token (sampled now for a new request, its last output for a resumed
    one): the bonus token of its first draft; ``hidden`` [len(done), H]: the target's hidden at its last row;
    ``tokens`` (host, on first use): what each request of the batch emits (its first token, or nothing)."""

    num_reqs: int
    done_idx: list[int]
    new_idx: list[int]
    done: list[Request]
    bonus: torch.Tensor
    hidden: torch.Tensor

    def __post_init__(self):
        self._copy = HostCopy(self.bonus)  # queued at launch: reading it waits for this step only

    @property
    def tokens(self) -> list[list[int]]:
        out = [[] for _ in range(self.num_reqs)]
        if self.new_idx:
            toks = self._copy.tolist()
            for j, i in enumerate(self.done_idx):
                if i in self.new_idx:
                    out[i] = [toks[j]]
        return out


class ModelRunner:
    """Owns the target model, its KV pools, the sampler and the graph runner.

    ``LLM`` drives the order (DESIGN §4 rule 2): ``ModelRunner(...)`` builds the target;
    ``allocate_kv_cache()`` sizes the pools from the memory budget, allocates them and binds the target's
    layers; ``capture_graphs(mtp=...)`` captures decode (and the speculative step) once everything is bound.
    """

    def __init__(self, config: EngineConfig, hf_config, model_dir=None):
        self.config, self.device, self.dtype = config, config.torch_device(), config.torch_dtype()
        if config.deterministic and getattr(hf_config.get_text_config(), "enable_moe_block", False):
            raise ValueError("deterministic=True does not cover MoE targets (enable_moe_block): use False")
        max_pos = config.max_model_len + (config.num_draft_tokens or 1)  # verify rows sit past the last token
        weights = None if config.load_format == "dummy" else model_dir
        self.model = build_target(hf_config, self.device, self.dtype, max_pos, weights, config.seed)
        # deterministic mode is read here only (DESIGN §4 rule 9): batch-invariant GEMMs, and one KV split
        # size for every attention row, which the runner and the worker put in each forward's metadata
        self.split_size = self.model.kv_split_size = KV_SPLIT_SIZE if config.deterministic else None
        if config.deterministic:
            make_batch_invariant(self.model)
        self.vocab_size = self.model.config.vocab_size
        self.lookahead = config.num_draft_tokens if config.speculative else 1
        self.sampler = Sampler(self.device, config.seed)
        self.kv_pools: list[torch.Tensor] = []
        self.allocator: BlockAllocator | None = None
        self.graphs: GraphRunner | None = None
        self.decode_inputs = DraftInput.idle(0, self.device, self.dtype)

    # ---- KV pools
    # --------------------------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        """Bytes of one block over every KV-owning layer (KV-shared layers own none)."""
        per_layer = [2 * self.config.page_size * h * d for h, d in filter(None, self.model.kv_geometry)]
        return sum(per_layer) * torch.finfo(self.dtype).bits // 8

    def num_kv_blocks(self) -> int:
        """Pool size from the memory budget (GPU: ``gpu_memory_utilization`` after weights and a profiled
        activation peak; CPU: ``cpu_kv_cache_gb``), capped at what ``max_num_seqs`` full requests need."""
        c, per_block = self.config, self.kv_bytes_per_block()
        per_req = -(-(c.max_model_len + self.lookahead) // c.page_size)
        if c.num_kv_blocks is not None:
            n = c.num_kv_blocks
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
            # graphs keep their own pool of activations (at most the profiled peak) beside the eager one
            budget = total * c.gpu_memory_utilization - (total - free) - peak * (1 if c.enforce_eager else 2)
            n = min(int(budget // per_block), c.max_num_seqs * per_req + 1)
        else:
            n = min(int(c.cpu_kv_cache_gb * 2**30 // per_block), c.max_num_seqs * per_req + 1)
        # every rank's pool has as many blocks (they share the block tables): the smallest any rank offers
        n = int(parallel.all_reduce(torch.tensor([n], device=self.device), parallel.dist.ReduceOp.MIN))
        if n - 1 < per_req:
            raise ValueError(
                f"the KV budget holds {max(n - 1, 0)} blocks of {c.page_size} tokens, but one "
                f"request of max_model_len={c.max_model_len} needs {per_req}: lower "
                "max_model_len or raise gpu_memory_utilization, cpu_kv_cache_gb, num_kv_blocks"
            )
        return n

    def allocate_kv_cache(self) -> BlockAllocator:
        """Size, allocate and bind the pools (after a profiled prefill on CUDA); returns the block
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
        """One prefill of the largest chunk over a scratch pool, so the KV budget leaves room for activations.
        Only the target is bound to the scratch pool; the drafter binds after the real allocation."""
        c = self.config
        T = min(c.max_num_batched_tokens, c.max_model_len)
        blocks = -(-T // c.page_size) + 1
        self.bind_pools(blocks)
        torch.cuda.reset_peak_memory_stats(self.device)
        dev = self.device
        md = AttnMetadata.prefill(
            torch.arange(1, blocks, dtype=torch.int32, device=dev)[None],
            torch.tensor([T], dtype=torch.int32, device=dev),
            torch.arange(c.page_size, c.page_size + T, device=dev),
            torch.tensor([0, T], dtype=torch.int32, device=dev),
            T,
            self.split_size,
        )
        with attn_metadata(md):
            ids = torch.zeros(T, dtype=torch.long, device=dev)
            self.model.compute_logits(self.model(ids, torch.arange(T, device=dev))[-1:])
        self.kv_pools = []
        torch.cuda.synchronize(dev)

    # ---- graphs
    # ----------------------------------------------------------------------------------------------------
    def capture_graphs(self, worker=None) -> GraphRunner:
        """Build the graph runner: phase "decode" and, with the MTP ``worker``, phases "mtp:{s}" (greedy
        batches, ``draft_verify``) and "mtp_sampled:{s}" (``draft_verify_sampled``) for every draft length s
        the worker's policy may choose. Buckets exist only on CUDA without
        ``enforce_eager``; elsewhere every phase runs eagerly."""
        c, dev = self.config, self.device
        use_graphs = dev.type == "cuda" and not c.enforce_eager
        width = -(-(c.max_model_len + self.lookahead) // c.page_size)
        i64, i32, dummy_slot = torch.long, torch.int32, DUMMY_BLOCK * c.page_size
        buffers = {
            "ids": ((1,), i64, 0),
            "pos": ((1,), i64, 0),
            "slots": ((1,), i64, dummy_slot),
            "block_table": ((1, width), i32, DUMMY_BLOCK),
            "seq_lens": ((1,), i32, 1),
            "L": ((1,), i32, 0),
            "bonus": ((1,), i64, 0),
            "hidden": ((1, self.model.config.hidden_size), self.dtype, 0),
        }
        phases = {"decode": (self._decode_logits, ["ids", "pos", "slots", "block_table", "seq_lens"])}
        if worker is not None:
            spec = ["bonus", "hidden", "block_table", "L"]
            sampled = spec + ["temperature", "top_k", "top_p", "noise"]
            for s in worker.policy.candidates:  # one graph per draft length the policy may choose
                phases[f"mtp:{s}"] = (partial(worker.draft_verify, num_steps=s), spec)
                phases[f"mtp_sampled:{s}"] = (partial(worker.draft_verify_sampled, num_steps=s), sampled)
            f32 = torch.float32
            buffers.update(
                temperature=((1,), f32, 1.0),
                top_k=((1,), i32, -1),
                top_p=((1,), f32, 1.0),
                noise=((1, worker.noise_width), f32, 0.5),
            )
        sizes = graph_batch_sizes(c.max_num_seqs) if use_graphs else []
        self.graphs = GraphRunner(phases, buffers, sizes, num_kv_splits(c.max_model_len), dev)
        self.graphs.capture()
        return self.graphs

    def _decode_logits(self, ids, pos, slots, block_table, seq_lens, num_splits=None) -> torch.Tensor:
        with attn_metadata(AttnMetadata.decode(block_table, seq_lens, slots, num_splits, self.split_size)):
            return self.model.compute_logits(self.model(ids, pos))

    # ---- batch preparation
    # -------------------------------------------------------------------------------------------
    def _tensor(self, data, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)

    def prepare_prefill(self, batch: Batch):
        """Token ids, positions and metadata for one chunk of each request's prompt (+ outputs on resume);
        returns (ids [T], positions [T], AttnMetadata, index of each request's last row)."""
        ids, pos, rows, cu, lens = [], [], [], [0], []
        for i, (req, n) in enumerate(zip(batch.reqs, batch.num_new)):
            s = req.num_computed
            ids += req.all_token_ids[s : s + n]
            pos += range(s, s + n)
            rows += [i] * n
            cu.append(cu[-1] + n)
            lens.append(s + n)
        bt = block_table_tensor(batch.reqs, self.device)
        positions = self._tensor(pos)
        slots = slot_mapping(bt, self._tensor(rows), positions, self.config.page_size)
        md = AttnMetadata.prefill(
            bt,
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
    def prefill(self, batch: Batch) -> PrefillOutput:
        """Run one prefill step (chunks of several requests), no host sync. New requests whose prompt
        completes sample their first token; resumed ones (after preemption) emit nothing: their newest token
        is out."""
        if not batch.reqs:  # DESIGN §4 rule 4: an empty step never reaches attention metadata
            return PrefillOutput(0, [], [], [], torch.zeros(0, dtype=torch.long), torch.zeros(0))
        ids, pos, md, last = self.prepare_prefill(batch)
        with attn_metadata(md):
            hidden = self.model(ids, pos)
        done = [i for i in range(len(batch.reqs)) if batch.completes(i)]
        new = [i for i in done if not batch.reqs[i].output_token_ids]
        bonus = self._tensor([batch.reqs[i].last_token for i in done])
        if new:
            reqs = [batch.reqs[i] for i in new]
            sampled = self.sampler.sample(reqs, self.model.compute_logits(hidden[[last[i] for i in new]]))
            parallel.agree(sampled)  # rank 0's tokens (DESIGN §4 rule 8)
            bonus[[done.index(i) for i in new]] = sampled
        return PrefillOutput(
            len(batch.reqs), done, new, [batch.reqs[i] for i in done], bonus, hidden[[last[i] for i in done]]
        )

    # ---- plain decode: next inputs on the device (as the MTP worker keeps its draft inputs)
    # ------------------------
    def on_prefill_done(self, reqs, first_tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        """Plain decode: each finished prefill's first input (its newest token at position L)."""
        L = self._tensor([r.prefill_len for r in reqs], torch.int32)
        self.decode_inputs = self.decode_inputs.merge(
            DraftInput([r.request_id for r in reqs], first_tokens, hidden[:, :0], L)
        )

    def on_release(self, reqs, reason: str) -> None:
        gone, inp = {r.request_id for r in reqs}, self.decode_inputs
        self.decode_inputs = inp.filter([i for i in inp.req_ids if i not in gone])

    @torch.inference_mode()
    def decode(self, reqs: list[Request]) -> StepOutput:
        """One plain decode step: each request's next token, inputs gathered on the device (no host sync)."""
        if not reqs:  # DESIGN §4 rule 4
            return StepOutput(torch.zeros(0, 2, dtype=torch.long))
        inp = self.decode_inputs.filter([r.request_id for r in reqs])
        bt = block_table_tensor(reqs, self.device)
        pos = inp.seq_lens.long()
        slots = slot_mapping(bt, torch.arange(len(reqs), device=self.device), pos, self.config.page_size)
        bound = max(r.num_computed + r.num_inflight for r in reqs) + 1
        inputs = {
            "ids": inp.bonus_tokens,
            "pos": pos,
            "slots": slots,
            "block_table": bt,
            "seq_lens": inp.seq_lens + 1,
        }
        toks = self.sampler.sample(reqs, self.graphs.run("decode", inputs, num_kv_splits(bound)))
        parallel.agree(toks)
        nxt = DraftInput(inp.req_ids, toks, inp.hidden, inp.seq_lens + 1)
        self.decode_inputs = self.decode_inputs.merge(nxt)
        return StepOutput(torch.stack([torch.ones_like(toks), toks], 1))
