"""Builds the models, allocates the paged KV pool, turns scheduled batches into tensors and runs forwards."""
import torch

from . import loader
from .config import EngineConfig
from .context import AttnMetadata, attn_metadata
from .cuda_graph import GraphRunner
from .kernels.attention import num_kv_splits
from .kernels.sampling import sample
from .kv_cache import BlockAllocator, block_table_tensor
from .models import init_random_weights, load_weights
from .models.llama import LlamaForCausalLM
from .request import Request
from .scheduler import Batch
from .spec.worker import FrozenKVMTPWorker, resolve_assistant


def build_target(cfg, device, dtype, max_position: int, model_dir=None, seed: int = 0) -> LlamaForCausalLM:
    """Construct the target on the meta device, materialise it on ``device`` in ``dtype``, then load the
    checkpoint in ``model_dir`` (or random weights when None)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_position)
    model.to_empty(device=device)
    if model_dir is None:
        init_random_weights(model, seed)
    else:
        load_weights(model, loader.iter_safetensors(model_dir), skip=("lm_head.",) if model.tied else ())
    model.to(dtype).eval().requires_grad_(False)
    model.init_buffers(device)
    return model


class ModelRunner:
    """Owns the target model (and, under speculation, the drafter), the KV pool and the sampler.

    Order (DESIGN §4 rule 2): construct models -> allocate the pool -> bind layers to pool views.
    ``run(batch)`` returns, per request of the batch, the list of tokens it emits this step.
    """

    def __init__(self, config: EngineConfig, hf_config=None, model_dir=None, target_is_default: bool = False):
        self.config = config
        self.device, self.dtype = config.torch_device(), config.torch_dtype()
        self.hf_config = hf_config
        # options are checked before the target's weights load: a bad assistant path fails at once
        assistant = resolve_assistant(config.assistant, target_is_default) if config.spec else None
        max_pos = config.max_model_len + (config.num_draft_tokens or 1)  # verify rows sit past the last token
        weights = None if config.load_format == "dummy" else model_dir
        self.model = build_target(hf_config, self.device, self.dtype, max_pos, weights, config.seed)
        self.vocab_size = hf_config.vocab_size
        self.lookahead, self.spec = 1, None
        if config.spec:  # construct the drafter before the pool exists; bind after allocation
            self.spec = FrozenKVMTPWorker(config, self.model, assistant, self.device, self.dtype)
            self.lookahead = config.num_draft_tokens
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        self.kv_cache, self.graphs = None, None
        self.allocator = self.allocate_kv_cache()
        if self.device.type == "cuda" and not config.enforce_eager:
            self.graphs = GraphRunner(self)
            self.graphs.capture()

    # ---- KV pool -------------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        m = self.model
        return (len(m.layers) * 2 * self.config.page_size * m.num_kv_heads * m.head_dim
                * torch.finfo(self.dtype).bits // 8)

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
        if n - 1 < per_req:
            raise ValueError(f"the KV budget holds {max(n - 1, 0)} blocks of {c.page_size} tokens, but one request "
                             f"of max_model_len={c.max_model_len} needs {per_req}: lower max_model_len or raise "
                             f"gpu_memory_utilization / cpu_kv_cache_gb / num_kv_blocks")
        return n

    def allocate_kv_cache(self) -> BlockAllocator:
        if self.device.type == "cuda":
            self._profile_peak()
        n = self.num_kv_blocks()
        self.bind_pool(n)
        return BlockAllocator(n, self.config.page_size)

    def bind_pool(self, num_blocks: int) -> None:
        """Allocate a pool ``[layers, 2, num_blocks, page_size, Hkv, D]`` and bind the models to it."""
        m = self.model
        self.kv_cache = torch.zeros(len(m.layers), 2, num_blocks, self.config.page_size, m.num_kv_heads,
                                    m.head_dim, dtype=self.dtype, device=self.device)
        self.bind_kv_cache()

    def bind_kv_cache(self) -> None:
        self.model.bind_kv_cache(self.kv_cache)
        if self.spec is not None:
            self.spec.bind()

    @torch.inference_mode()
    def _profile_peak(self) -> None:
        """One prefill of the largest chunk over a scratch pool, so the KV budget leaves room for activations."""
        c = self.config
        T = min(c.max_num_batched_tokens, c.max_model_len)
        blocks = -(-T // c.page_size) + 1
        self.bind_pool(blocks)
        torch.cuda.reset_peak_memory_stats(self.device)
        ids = torch.zeros(T, dtype=torch.long, device=self.device)
        md = AttnMetadata("prefill", torch.arange(1, blocks, dtype=torch.int32, device=self.device)[None],
                          torch.tensor([T], dtype=torch.int32, device=self.device),
                          torch.arange(c.page_size, c.page_size + T, device=self.device),
                          torch.tensor([0, T], dtype=torch.int32, device=self.device), T)
        with attn_metadata(md):
            self.model.compute_logits(self.model(ids, torch.arange(T, device=self.device))[-1:])
        self.kv_cache = None
        torch.cuda.synchronize(self.device)

    # ---- batch preparation ---------------------------------------------------------------------------
    def _tensor(self, data, dtype=torch.int64):
        return torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)

    def prepare_prefill(self, batch: Batch):
        """Token ids, positions and metadata for one chunk of each request's prompt (+ outputs on resume)."""
        ids, pos, slots, cu, lens = [], [], [], [0], []
        for req, n in zip(batch.reqs, batch.num_new):
            s = req.num_computed
            ids += req.all_token_ids[s:s + n]
            pos += range(s, s + n)
            slots += self.allocator.slots(req, s, s + n)
            cu.append(cu[-1] + n)
            lens.append(s + n)
        md = AttnMetadata("prefill", block_table_tensor(batch.reqs, self.device), self._tensor(lens, torch.int32),
                          self._tensor(slots), self._tensor(cu, torch.int32), max(batch.num_new))
        last = [cu[i + 1] - 1 for i in range(len(batch.reqs))]
        return self._tensor(ids), self._tensor(pos), md, last

    def prepare_decode(self, reqs: list[Request]):
        """One query per request: its last token at position ``num_computed``."""
        pos = [r.num_computed for r in reqs]
        slots = [self.allocator.slots(r, p, p + 1)[0] for r, p in zip(reqs, pos)]
        md = AttnMetadata("decode", block_table_tensor(reqs, self.device), self._tensor([p + 1 for p in pos],
                          torch.int32), self._tensor(slots), num_splits=num_kv_splits(max(pos) + 1))
        return self._tensor([r.last_token for r in reqs]), self._tensor(pos), md

    # ---- running -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, batch: Batch) -> list[list[int]]:
        """Run one scheduled step; returns each request's new tokens (empty for an unfinished chunk)."""
        if not batch.reqs:  # DESIGN §4 rule 4: an empty step never reaches attention metadata
            return []
        if batch.kind == "prefill":
            ids, pos, md, last = self.prepare_prefill(batch)
            done = [i for i in range(len(batch.reqs)) if batch.completes(i)]
        elif self.spec is not None:
            return self.spec.step(self, batch.reqs)
        else:
            ids, pos, md = self.prepare_decode(batch.reqs)
            if self.graphs is not None and self.graphs.has_decode(len(batch.reqs)):
                logits = self.graphs.run_decode(ids, pos, md)
            else:
                with attn_metadata(md):
                    logits = self.model.compute_logits(self.model(ids, pos))
            return [[t] for t in self.sample(batch.reqs, logits).tolist()]
        with attn_metadata(md):
            hidden = self.model(ids, pos)
        out = [[] for _ in batch.reqs]
        new = [i for i in done if not batch.reqs[i].output_token_ids]  # resumed requests emit nothing
        if new:
            toks = self.sample([batch.reqs[i] for i in new], self.model.compute_logits(hidden[[last[i] for i in new]]))
            for i, t in zip(new, toks.tolist()):
                out[i] = [t]
        if self.spec is not None and done:  # seed: (first / last emitted token, hidden of the last prefill row)
            bonus = [out[i][0] if out[i] else batch.reqs[i].output_token_ids[-1] for i in done]
            self.spec.add_seeds([batch.reqs[i].request_id for i in done], self._tensor(bonus),
                                hidden[[last[i] for i in done]])
        return out

    def release(self, reqs: list[Request]) -> None:
        """Forget finished requests' drafter seeds."""
        if self.spec is not None and reqs:
            self.spec.release([r.request_id for r in reqs])

    def sampling_tensors(self, reqs: list[Request]):
        p = [r.params for r in reqs]
        return (self._tensor([x.temperature for x in p], torch.float32), self._tensor([x.top_k for x in p],
                torch.int32), self._tensor([x.top_p for x in p], torch.float32))

    def noise(self, reqs: list[Request], width: int, offset: int = 0) -> torch.Tensor:
        """Uniform (0, 1) noise [len(reqs), width]. A seeded request draws from its own generator keyed by
        (seed, output index + offset), so its samples do not depend on the batch it runs in."""
        u = torch.rand(len(reqs), width, generator=self.generator, device=self.device)
        for i, r in enumerate(reqs):
            if r.params.seed is not None:
                g = torch.Generator(self.device).manual_seed(
                    (r.params.seed * 1_000_003 + len(r.output_token_ids) + offset) % 2**63)
                u[i] = torch.rand(width, generator=g, device=self.device)
        return u.clamp_(min=1e-20)

    def sample(self, reqs: list[Request], logits: torch.Tensor) -> torch.Tensor:
        """Next token per request [B] int64: argmax for greedy rows, else temperature/top-k/top-p sampling."""
        if all(r.params.greedy for r in reqs):
            return logits.argmax(-1)
        t, k, p = self.sampling_tensors(reqs)
        return sample(logits, t, k, p, self.noise(reqs, logits.shape[-1]))
