"""CUDA graphs per batch-size bucket for the three hot phases: plain decode, the draft loop, verify + accept.

Each phase is a pure tensor function of static input buffers (no host syncs), captured once per bucket and
replayed after the live batch is copied into the buffers' first rows. Padding rows point at the reserved dummy
block (block 0): their K/V writes land there and they read one dummy key, so they can never touch a live
request's KV. A batch larger than the largest bucket, or any phase not captured, runs eagerly.
"""
from collections.abc import Callable

import torch

from .kernels.attention import num_kv_splits
from .kv_cache import DUMMY_BLOCK


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Buckets: 1, 2, 4, 8, then steps of 16 up to max_num_seqs (and max_num_seqs itself)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16)) + [max_num_seqs]
    return sorted(set(sizes))


def select_bucket(batch_size: int, sizes: list[int]) -> int | None:
    """Smallest bucket holding ``batch_size`` rows; None means eager fallback (too big, or an empty batch)."""
    if batch_size <= 0:
        return None
    return next((s for s in sizes if s >= batch_size), None)


class StaticBuffers:
    """Named static tensors of ``max_rows`` rows (times ``rows_per_req`` for per-token buffers).

    ``fill(name, live, pad)`` copies the live rows to the front and writes ``pad`` into the rest, so a captured
    graph always sees a fully defined batch.
    """

    def __init__(self, device, max_bs: int, specs: dict[str, tuple[tuple[int, ...], torch.dtype, float]]):
        self.max_bs = max_bs
        self.pads = {}
        for name, (shape, dtype, pad) in specs.items():
            setattr(self, name, torch.full((max_bs * shape[0], *shape[1:]), pad, dtype=dtype, device=device))
            self.pads[name] = pad

    def fill(self, name: str, live: torch.Tensor) -> None:
        buf = getattr(self, name)
        n = live.shape[0]
        if live.dim() == buf.dim() and live.shape[1:] != buf.shape[1:]:  # narrower rows (block tables)
            buf[:n].fill_(self.pads[name])
            buf[:n, :live.shape[1]].copy_(live)
        else:
            buf[:n].copy_(live)
        buf[n:].fill_(self.pads[name])


class BucketGraphs:
    """``fn(bs)`` (reading static buffers, returning tensors) captured as one CUDA graph per bucket.

    ``capture()`` warms every kernel specialization with an eager call first (a JIT compile inside capture
    invalidates it), captures largest-first into one shared memory pool. ``run(bs)`` replays the bucket's graph
    and returns its static outputs; with no graph for ``bs`` it calls ``fn(bs)`` eagerly.
    """

    def __init__(self, fn: Callable[[int], object], sizes: list[int], device):
        self.fn, self.sizes, self.device = fn, sizes, device
        self.graphs, self.outputs = {}, {}

    def capture(self) -> None:
        if self.device.type != "cuda":
            return
        pool = None
        for bs in sorted(self.sizes, reverse=True):
            self.fn(bs)  # warm-up: compile every kernel variant outside the capture
            torch.cuda.synchronize(self.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.outputs[bs] = self.fn(bs)
            pool = g.pool()
            self.graphs[bs] = g
        torch.cuda.synchronize(self.device)

    def run(self, bs: int):
        if bs in self.graphs:
            self.graphs[bs].replay()
            return self.outputs[bs]
        return self.fn(bs)


def dummy_slot(page_size: int) -> int:
    """Pool slot of padding rows: the first slot of the reserved dummy block."""
    return DUMMY_BLOCK * page_size


class GraphRunner:
    """The model runner's graphs: plain decode (forward + logits) and, with an assistant, one graph per bucket
    holding the whole draft loop and the verify + greedy accept that consumes its tree.

    Static buffers are sized for the largest bucket; block tables are ``ceil((max_model_len + lookahead) /
    page_size)`` wide, so a live table always fits. Split-KV counts are fixed from max_model_len (no host sync).
    Sampling batches of the speculative step run eagerly (the noise and filtered distributions stay outside).
    """

    def __init__(self, runner, sizes: list[int] | None = None):
        c, m, dev = runner.config, runner.model, runner.device
        self.runner = runner
        self.sizes = sizes or graph_batch_sizes(c.max_num_seqs)
        width = -(-(c.max_model_len + runner.lookahead) // c.page_size)
        self.num_splits = num_kv_splits(c.max_model_len)
        i64, i32 = torch.long, torch.int32
        self.buf = StaticBuffers(dev, self.sizes[-1], {
            "ids": ((1,), i64, 0), "pos": ((1,), i64, 0), "slots": ((1,), i64, dummy_slot(c.page_size)),
            "block_table": ((1, width), i32, DUMMY_BLOCK), "seq_lens": ((1,), i32, 1), "L": ((1,), i32, 0),
            "bonus": ((1,), i64, 0), "hidden": ((1, m.config.hidden_size), runner.dtype, 0)})
        self.decode = BucketGraphs(self._decode, self.sizes, dev)
        self.spec = BucketGraphs(self._spec, self.sizes, dev) if runner.spec is not None else None

    def capture(self) -> None:
        self.decode.capture()
        if self.spec is not None:
            self.spec.capture()

    def _decode(self, bs: int) -> torch.Tensor:
        from .context import AttnMetadata, attn_metadata

        b = self.buf
        md = AttnMetadata("decode", b.block_table[:bs], b.seq_lens[:bs], b.slots[:bs], num_splits=self.num_splits)
        with attn_metadata(md):
            return self.runner.model.compute_logits(self.runner.model(b.ids[:bs], b.pos[:bs]))

    def _spec(self, bs: int):
        b = self.buf
        return self.runner.spec.draft_verify(b.bonus[:bs], b.hidden[:bs], b.block_table[:bs], b.L[:bs],
                                             self.runner.kv_cache, None, self.num_splits)

    def has_decode(self, bs: int) -> bool:
        return select_bucket(bs, self.sizes) is not None

    has_spec = has_decode

    def run_decode(self, ids, pos, md) -> torch.Tensor:
        """Logits [bs, V] of one plain decode step through the bucket's graph (padding rows dropped)."""
        bs = ids.shape[0]
        for name, t in (("ids", ids), ("pos", pos), ("slots", md.slot_mapping), ("block_table", md.block_table),
                        ("seq_lens", md.seq_lens)):
            self.buf.fill(name, t)
        return self.decode.run(select_bucket(bs, self.sizes))[:bs]

    def run_spec(self, bonus, hidden, block_table, L):
        """(emitted, accept_len, bonus, next hidden) of one greedy speculative step, padding rows dropped."""
        bs = bonus.shape[0]
        for name, t in (("bonus", bonus), ("hidden", hidden), ("block_table", block_table), ("L", L)):
            self.buf.fill(name, t)
        return tuple(x[:bs] for x in self.spec.run(select_bucket(bs, self.sizes)))
