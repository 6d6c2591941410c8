"""CUDA graphs per batch-size bucket for the hot phases: plain decode and the whole speculative step.

Each phase is a pure tensor function of named inputs (no host syncs). ``GraphRunner.run`` is the one place
that decides graph or eager. A batch of constrained rows with their masks runs eagerly (the speculative step
runs such rows apart from the others, which keep their graph: DESIGN §5). A batch that fits a bucket is copied
into the first rows of static buffers and the bucket's graph replays (padding rows point at the reserved dummy
block 0, so their K/V writes land there and they read one dummy key: they never touch a live request's KV); a
batch larger than every bucket, or a phase with no buckets (CPU, ``enforce_eager``), runs the same function
eagerly on the live tensors. On CPU, tests give buckets explicitly: the function then runs eagerly on the
padded static buffers, exactly what a graph would replay.
"""

from collections.abc import Callable

import torch


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
    """Named static tensors of ``max_rows`` rows (times ``shape[0]`` for per-token buffers).

    ``fill(name, live)`` copies the live rows to the front and writes the buffer's pad value into the rest, so
    a captured graph always sees a fully defined batch.
    """

    def __init__(self, device, max_rows: int, specs: dict[str, tuple[tuple[int, ...], torch.dtype, float]]):
        self.pads = {}
        for name, (shape, dtype, pad) in specs.items():
            buf = torch.full((max_rows * shape[0], *shape[1:]), pad, dtype=dtype, device=device)
            setattr(self, name, buf)
            self.pads[name] = pad

    def fill(self, name: str, live: torch.Tensor) -> None:
        buf = getattr(self, name)
        n = live.shape[0]
        if live.dim() == buf.dim() and live.shape[1:] != buf.shape[1:]:  # narrower rows (block tables)
            buf[:n].fill_(self.pads[name])
            buf[:n, : live.shape[1]].copy_(live)
        else:
            buf[:n].copy_(live)
        buf[n:].fill_(self.pads[name])


class BucketGraphs:
    """``fn(bs)`` (reading static buffers, returning tensors) captured as one CUDA graph per bucket.

    ``capture()`` warms every kernel specialization with an eager call first (a JIT compile inside capture
    invalidates it), captures largest-first into one shared memory pool. ``run(bs)`` replays the bucket's
    graph and returns its static outputs; with no graph for ``bs`` it calls ``fn(bs)`` eagerly.
    """

    def __init__(self, fn: Callable[[int], object], sizes: list[int], device):
        self.fn = fn
        self.sizes = sizes
        self.device = device
        self.graphs = {}
        self.outputs = {}

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


class GraphRunner:
    """Phases run through bucketed graphs or eagerly: the one place that decides (``run``).

    ``phases``: name -> (fn, input names); ``fn(num_splits=..., **inputs)`` is pure tensor code. ``buffers``
    declares every static input: name -> (per-row shape, dtype, pad value). Block tables are
    ``ceil((max_model_len + lookahead) / page_size)`` wide so a live table always fits; the split-KV count is
    fixed (``num_splits``, from max_model_len) so captured graphs never sync. ``sizes`` empty = always eager.
    """

    def __init__(
        self,
        phases: dict[str, tuple[Callable, list[str]]],
        buffers: dict,
        sizes: list[int],
        num_splits: int,
        device,
    ):
        self.phases = phases
        self.sizes = sizes
        self.num_splits = num_splits
        self.buffer_specs = buffers
        self.buf = StaticBuffers(device, sizes[-1], buffers) if sizes else None
        self.graphs = {
            name: BucketGraphs(lambda bs, name=name: self._static_call(name, bs), sizes, device)
            for name in phases
        }

    def _static_call(self, phase: str, bs: int):
        fn, names = self.phases[phase]
        return fn(num_splits=self.num_splits, **{k: getattr(self.buf, k)[:bs] for k in names})

    def capture(self) -> None:
        """Capture every phase for every bucket (CUDA only; a no-op elsewhere)."""
        for g in self.graphs.values():
            g.capture()

    def run(self, phase: str, inputs: dict[str, torch.Tensor], num_splits: int | None, masks=None):
        """The phase's outputs for the live batch (padding rows dropped): the same function on the same named
        tensors, eager or replayed. ``num_splits`` serves only the eager call (a graph has its own fixed
        split count). ``masks`` (structured output's ``StepMasks`` of a batch of constrained rows, or None):
        such a batch runs eagerly, since the host computes each draft step's masks between its kernels."""
        bs = next(iter(inputs.values())).shape[0]
        bucket = None if masks is not None else select_bucket(bs, self.sizes)
        if bucket is None:
            extra = {} if masks is None else {"masks": masks}
            return self.phases[phase][0](num_splits=num_splits, **extra, **inputs)
        for name, t in inputs.items():
            self.buf.fill(name, t)
        out = self.graphs[phase].run(bucket)
        return out[:bs] if isinstance(out, torch.Tensor) else tuple(x[:bs] for x in out)
