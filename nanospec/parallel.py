"""Tensor parallelism (Megatron-style, as nano-vllm and vLLM): the process group, the sharded layers and the
engine's ranks (docs/DESIGN.md §9).

Layers: ``ColumnLinear`` keeps this rank's output rows of each packed part (q | k | v, gate | up);
``RowLinear`` its input columns, summing the partial products with one all-reduce; ``VocabEmbedding`` and a
column-parallel LM head this rank's vocabulary rows (``gather`` joins the logits where sampling happens).
Heads are split evenly; KV heads fewer than the ranks are replicated (``span``: max(1, H / N) per rank, as
vLLM and SGLang). ``Linear`` is the replicated layer; every GEMM of the engine goes through ``linear``
(``kernels.matmul.linear``: ``F.linear``'s signature; up to 6 rows on a CPU cost about what one row costs).
Models build these from the ``TensorParallel`` (rank, size) they are given and never branch on the rank.

Process model: rank 0 is the caller's process and owns the scheduler; it sends each step (and each release
of a request's inputs) to the other ranks over a CPU (gloo) group, and every rank runs the same calls in the
same order (``Ranks.call``). Tokens are decided on rank 0 and broadcast (``agree``), so every rank ends a step
with the same inputs for the next one. A running request travels without its block table: the other ranks
keep it and append the blocks each plan adds (``Ranks.restore_block_tables``). The group comes from ``env://``
settings (torchrun) or, when the engine starts its own ranks, from a temporary file (no port to race for; the
ranks' sockets on loopback).
"""

import atexit
import contextlib
import os
import sys
import tempfile
from datetime import timedelta
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .config import layer_geometry
from .kernels.matmul import linear, to_onednn  # linear: the engine's one GEMM call
from .scheduler import Batch


class TensorParallel(NamedTuple):
    """This process's ``rank`` in a group of ``size`` ranks (``SINGLE``: rank 0 of 1). ``start`` returns it;
    the models and their sharded layers get it as an argument when built and keep it: the shares they hold
    (``span``) and the collectives they run."""

    rank: int = 0
    size: int = 1

    def span(self, n: int, unit: int = 1) -> tuple[int, int]:
        """(first row, rows) of this rank's share of ``n`` heads (or rows) of ``unit`` rows each: n / size of
        them, or one shared with the neighbouring ranks when size > n (replication)."""
        return self.rank * n // self.size * unit, max(1, n // self.size) * unit

    def all_reduce(self, x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Reduce ``x`` over the ranks in place (``op``: a ``dist.ReduceOp``, SUM by default)."""
        if self.size > 1:
            dist.all_reduce(x, op)
        return x

    def gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order (``x`` itself at size 1)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim)

    def agree(self, *tensors: torch.Tensor) -> None:
        """Overwrite each (contiguous) tensor with rank 0's values: what rank 0 decided (sampled tokens, the
        draft tree, the accepted path) is what every rank uses (DESIGN §4 rule 8)."""
        for t in tensors if self.size > 1 else ():
            dist.broadcast(t, 0)


SINGLE = TensorParallel()  # no tensor parallelism


class Linear(nn.Linear):
    """A replicated linear layer: every rank holds the whole weight (``tp_spans`` None). ``shard_sizes``: the
    output sizes of its packed parts in order (gate | up), one part unless given. ``gemm``: the function it
    multiplies through, of ``linear``'s signature (deterministic mode: ``matmul.linear_invariant``)."""

    tp_spans: list[tuple[int, int, int]] | None = None  # sharded kinds: (dim, first, rows) of each part

    def __init__(self, in_features: int, out_features: int, bias: bool = True, shard_sizes=None, gemm=linear):
        super().__init__(in_features, out_features, bias)
        self.shard_sizes: list[int] = shard_sizes or [out_features]
        self.gemm = gemm

    def forward(self, x):
        return self.gemm(x, self.weight, self.bias)

    def use_onednn(self) -> None:
        """Multiply through a oneDNN copy of the weight (``kernels.matmul.to_onednn``; None, and so no change,
        off a CPU or in another dtype)."""
        self.gemm = partial(linear, onednn_weight=to_onednn(self.weight))


class ColumnLinear(Linear):
    """Column-parallel linear over packed parts ``[(n, unit), ...]`` (n heads of ``unit`` rows, or n rows of
    1): this rank's ``tp.span`` of each part, concatenated; ``shard_sizes`` are the local part sizes."""

    def __init__(self, tp: TensorParallel, in_features: int, parts: list, bias=False, gemm=linear):
        spans = [tp.span(n, unit) for n, unit in parts]
        super().__init__(in_features, sum(s for _, s in spans), bias, [s for _, s in spans], gemm)
        self.tp = tp
        self.tp_spans = [(0, *s) for s in spans]


class RowLinear(Linear):
    """Row-parallel linear: this rank's ``tp.span(n, unit)`` of the input features; one all-reduce sums the
    partial products (rank 0 adds the bias, once)."""

    def __init__(self, tp: TensorParallel, n: int, unit: int, out_features: int, bias=False, gemm=linear):
        super().__init__(tp.span(n, unit)[1], out_features, bias, gemm=gemm)
        self.tp = tp
        self.tp_spans = [(1, *tp.span(n, unit))]

    def forward(self, x):
        return self.tp.all_reduce(self.gemm(x, self.weight, self.bias if self.tp.rank == 0 else None))


def use_onednn_weights(model: nn.Module) -> None:
    """On a CPU in fp32 every GEMM of the target ``model`` (its ``Linear`` layers; its LM head: its ``gemm``
    over ``lm_head_weight``) multiplies 3 rows or more through a oneDNN copy of its weight
    (``kernels.matmul.to_onednn``: about 1.7x faster at 8 rows). The plain weights stay (1-2 rows, the
    embedding and the drafter read them): the weights take twice their memory. Elsewhere nothing changes."""
    for module in model.modules():
        if isinstance(module, Linear) and module is not getattr(model, "lm_head", None):
            module.use_onednn()
    model.gemm = partial(linear, onednn_weight=to_onednn(model.lm_head_weight))


class VocabEmbedding(nn.Embedding):
    """Vocabulary-parallel embedding: this rank's ``tp.span(num_embeddings)`` rows; tokens outside them embed
    as zeros and one all-reduce sums the ranks' rows."""

    def __init__(self, tp: TensorParallel, num_embeddings: int, embedding_dim: int):
        super().__init__(tp.span(num_embeddings)[1], embedding_dim)
        self.tp = tp
        self.tp_spans = [(0, *tp.span(num_embeddings))]

    def forward(self, ids):
        local = ids - self.tp_spans[0][1]
        ok = (local >= 0) & (local < self.num_embeddings)
        return self.tp.all_reduce(F.embedding(local * ok, self.weight) * ok[..., None])


class Experts(nn.Module):
    """Routed experts' weights in HF ``Gemma4TextExperts``' layout, ``gate_up_proj`` [E, 2I, H] (gate rows,
    then up rows) and ``down_proj`` [E, H, I], split along I like the dense MLP: this rank keeps its
    ``tp.span(I)`` of the gate rows, of the up rows and of the down columns, so its output
    (``kernels.moe.fused_moe``) is a partial sum for the caller's all-reduce."""

    def __init__(self, tp: TensorParallel, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.tp = tp
        self.intermediate = intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * tp.span(intermediate)[1], hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, tp.span(intermediate)[1]))

    def shard(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the checkpoint tensor of parameter ``name`` (``t`` itself when its I is not
        the config's: the caller's shape check names it)."""
        first, rows = self.tp.span(self.intermediate)
        if name.endswith("down_proj") and t.shape[-1] == self.intermediate:
            return t.narrow(2, first, rows)
        if name.endswith("gate_up_proj") and t.dim() == 3 and t.shape[1] == 2 * self.intermediate:
            return torch.cat([t.narrow(1, first, rows), t.narrow(1, self.intermediate + first, rows)], 1)
        return t


def shard_of(module, name: str, t: torch.Tensor, part: int = 0) -> torch.Tensor:
    """This rank's piece of checkpoint tensor ``t`` for parameter ``name`` of ``module`` (packed part
    ``part``): ``t`` itself at size 1 (the layer's ``tp``), for unsharded modules, row-parallel biases and
    tensors too small (the caller's shape check then names them)."""
    sharded = isinstance(module, (ColumnLinear, RowLinear, VocabEmbedding, Experts)) and module.tp.size > 1
    if sharded and isinstance(module, Experts):
        return module.shard(name, t)
    spans = module.tp_spans if sharded else None
    whole = spans is None or (spans[0][0] == 1 and name.endswith("bias"))
    return t if whole or t.shape[spans[part][0]] < sum(spans[part][1:]) else t.narrow(*spans[part])


def check_sizes(config, target, assistant=None) -> None:
    """ValueError naming the field unless n = ``config.tensor_parallel_size`` ranks fit: at most the visible
    GPUs on CUDA (unless launched by torchrun, which may span machines), and splitting the HF configs of the
    target (and the assistant): query heads, MLP (and MoE expert) and vocabulary sizes divisible by n, every
    layer's KV heads a multiple or a divisor of n (replicated then); the allowed values are listed."""
    n = config.tensor_parallel_size
    gpus = torch.cuda.device_count()
    if config.torch_device().type == "cuda" and n > gpus and "WORLD_SIZE" not in os.environ:
        raise ValueError(f"tensor_parallel_size must be in [1, {gpus}] (the visible GPUs), got {n}")
    t = target.get_text_config()
    fields = ("num_attention_heads", "intermediate_size", "vocab_size", "vocab_size_per_layer_input")
    fields += ("moe_intermediate_size",) if getattr(t, "enable_moe_block", False) else ()
    need = {f: getattr(t, f) for f in fields if getattr(t, f, None)}
    if assistant is not None:
        need["assistant num_attention_heads"] = assistant.get_text_config().num_attention_heads
    need |= {f"num_key_value_heads of layer {i}": layer_geometry(t, i)[1] for i in range(t.num_hidden_layers)}

    def bad(m):  # KV heads may also divide m (replicated)
        return [f"{k} = {v}" for k, v in need.items() if v % m and ("key_value" not in k or m % v)]

    if bad(n):
        ok = [m for m in range(1, 65) if not bad(m)]
        raise ValueError(f"tensor_parallel_size={n} does not split {bad(n)[0]} (allowed: {ok})")


def start(config, engine: type, model_dir: str, kwargs: dict) -> "Ranks":
    """Before a model is built, join the group of n = ``config.tensor_parallel_size`` ranks: torchrun's
    (``env://``), the one this rank was started into, or as rank 0 start ranks 1..n-1 (torch.multiprocessing
    spawn, each building ``engine(model_dir, **kwargs)``, the ``LLM`` class, without a trace; rendezvous
    through a temporary file, the ranks' sockets on loopback). Returns this process's ``Ranks`` (of
    ``SINGLE`` when n is 1), closed at interpreter exit at the latest.
    ValueError while another tensor-parallel LLM is open in this process, or when ``n`` is not the
    launcher's WORLD_SIZE."""
    n = config.tensor_parallel_size
    device_type = config.torch_device().type
    if dist.is_initialized():
        raise ValueError("a tensor-parallel LLM is open in this process: close() it before building another")
    if n == 1:
        return Ranks(SINGLE)
    procs = []
    rdzv = None
    if "RANK" not in os.environ:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo" if sys.platform == "linux" else "lo0")
        fd, rdzv = tempfile.mkstemp(prefix="nanospec-tp-")
        os.close(fd)
        ctx = torch.multiprocessing.get_context("spawn")
        args = (n, rdzv, engine, model_dir, kwargs | dict(trace=None))
        procs = [ctx.Process(target=_rank_main, args=(r, *args), daemon=True) for r in range(1, n)]
        for proc in procs:
            proc.start()
    elif os.environ["WORLD_SIZE"] != str(n):
        raise ValueError(f"tensor_parallel_size={n} != WORLD_SIZE {os.environ['WORLD_SIZE']} of the launcher")
    r = int(os.environ.get("RANK", 0))
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", r)))
    method = f"file://{rdzv}" if rdzv else os.environ.get("NANOSPEC_TP_INIT", "env://")
    # a collective whose peer died fails within 5 minutes at the latest; ranks > 0 wait 30 days for a call
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", method, timedelta(minutes=5), n, r)
    group = dist.new_group(backend="gloo", timeout=timedelta(days=30))
    ranks = Ranks(TensorParallel(r, n), group, procs, rdzv)
    atexit.register(ranks.close)
    return ranks


def _rank_main(r: int, n: int, rdzv: str, engine: type, model_dir: str, kwargs: dict) -> None:
    """A started rank: the same ``LLM`` (``engine``) as rank 0, serving rank 0's calls until it closes."""
    os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n), NANOSPEC_TP_INIT=f"file://{rdzv}")
    engine(model_dir, **kwargs)


class Ranks:
    """The engine's process model, the seam ``LLM`` calls through (DESIGN §9): this process's place ``tp``
    in the group, the gloo ``group`` of the step messages, and, when this engine started its ranks, their
    processes ``procs`` and the rendezvous file ``rdzv``. Rank 0 sends each call with the requests it
    released since its last call (``call``); ranks > 0 run the calls in the order they arrive (``serve``)
    and keep their copy of the running requests' block tables (``restore_block_tables``). At size 1 a call
    runs here and nothing is sent."""

    def __init__(self, tp: TensorParallel, group=None, procs=(), rdzv: str | None = None):
        self.tp = tp
        self.group = group
        self.procs = list(procs)
        self.rdzv = rdzv
        self.unsent_releases: list = []  # (request, reason) released on rank 0 since its last call
        self.block_tables: dict[int, list[int]] = {}  # ranks > 0: request id -> its block ids

    def call(self, method, *args):
        """``method(*args)`` (a bound method of the engine) on every rank, rank 0 first sending its function
        (picklable by its qualified name: no dispatch on names) and the releases since its last call; a rank's
        death becomes a RuntimeError naming it (``raise_if_dead``)."""
        try:
            if self.tp.size > 1:  # one process sends nothing (and may call any callable)
                self.broadcast(self.message(method, args))
            self.unsent_releases = []
            return method(*args)
        except Exception:
            self.raise_if_dead()
            raise

    def message(self, method, args) -> tuple:
        """What ``call`` sends the other ranks: the method's function (picklable by its qualified name), its
        arguments (a batch as its ``Batch.for_ranks`` copy) and the releases since the last call."""
        args = [a.for_ranks() if isinstance(a, Batch) else a for a in args]
        return method.__func__, args, self.unsent_releases

    def release(self, req, reason: str) -> None:
        """Rank 0 released ``req`` (finished / aborted / preempted): the other ranks release it with the next
        call (one message per step)."""
        self.unsent_releases.append((req.for_ranks(), reason))

    def serve(self, engine, release) -> None:
        """Ranks > 0: run rank 0's calls on ``engine`` in its order until it closes (a None message), each
        after ``release(request, reason)`` of the requests rank 0 released since its last call; then exit."""
        while (msg := self.broadcast()) is not None:
            fn, args, released = msg
            for req, reason in released:
                release(req, reason)
                self.block_tables.pop(req.request_id, None)
            fn(engine, *args)
        os._exit(0)  # nothing of this rank outlives the group: skip the interpreter's teardown

    def restore_block_tables(self, batch) -> None:
        """Ranks > 0: each request of ``batch`` gets its whole block table. A step message carries of a
        running request's table only the blocks its step added (``Batch.new_blocks``); the rest is this
        rank's copy (dropped at release). Rank 0 has every table already."""
        if self.tp.rank == 0:
            return
        for i, req in enumerate(batch.reqs):
            if batch.kind == "decode":
                req.block_table = self.block_tables[req.request_id] + batch.new_blocks[i]
            self.block_tables[req.request_id] = req.block_table

    def broadcast(self, msg=None):
        """Rank 0's ``msg`` (a call, or None to stop) on every rank; ranks > 0 wait for it here (``msg``
        itself at size 1)."""
        box = [msg]
        if self.tp.size > 1:
            dist.broadcast_object_list(box, 0, group=self.group)
        return box[0]

    def gather_objects(self, obj) -> list | None:
        """Every rank's ``obj`` in rank order, on rank 0 (None elsewhere)."""
        if self.tp.size == 1:
            return [obj]
        out = [obj] * self.tp.size if self.tp.rank == 0 else None
        dist.gather_object(obj, out, group=self.group)
        return out

    def raise_if_dead(self) -> None:
        """After a failed step: if ranks this engine started have died (a second's grace to exit), close the
        engine and raise RuntimeError naming them; else return (the caller re-raises its own error)."""
        for proc in self.procs:
            proc.join(1)  # a second's grace to exit
        dead = [f"rank {r} (exit code {p.exitcode})" for r, p in enumerate(self.procs, 1) if not p.is_alive()]
        if dead:
            self.close()
            raise RuntimeError(f"tensor parallelism: {', '.join(dead)} died; the engine is closed")

    def close(self) -> None:
        """Stop the other ranks (rank 0), wait for them (10 s each, then kill), leave the group, remove the
        rendezvous file. Idempotent; runs at interpreter exit too."""
        if self.group is None:
            return
        if self.tp.rank == 0 and all(proc.is_alive() for proc in self.procs):
            with contextlib.suppress(RuntimeError):  # a rank is gone: the rest are killed below
                self.broadcast(None)
        for proc in self.procs:
            proc.join(10)
            proc.kill()
            proc.join()
        dist.destroy_process_group()
        if self.rdzv is not None:
            with contextlib.suppress(OSError):
                os.remove(self.rdzv)
        self.group = None
        self.procs = []
