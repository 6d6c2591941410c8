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

    def write(self, outputs: tuple, bs: int) -> tuple:
        """Copy ``outputs`` (one phase's, ``bs`` rows) into their views; returns the views."""
        views = []
        for buf, x in zip(self.buffers, outputs):
            if x is None:
                views.append(None)
                continue
            view = buf[(slice(0, bs), *(slice(0, d) for d in x.shape[1:]))]
            view.copy_(x)
            views.append(view)
        return tuple(views)


def as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


class BucketGraphs:
    """``fn(bs)`` (reading static buffers, returning a tensor or a tuple of tensors and Nones) captured as one
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
                self.views[bs] = outputs.write(as_tuple(self.fn(bs)), bs)
            self.graphs[bs] = g

    def run(self, bs: int):
        if bs in self.graphs:
            self.graphs[bs].replay()
            return self.views[bs]
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
            name: BucketGraphs(lambda bs, name=name: self._static_call(name, bs), sizes) for name in phases
        }
        self.outputs: StaticOutputs | None = None

    def _static_call(self, phase: str, bs: int):
        fn, names = self.phases[phase]
        return fn(num_splits=self.num_splits, **{k: getattr(self.buf, k)[:bs] for k in names})

    def capture(self) -> None:
        """Capture every phase for every bucket into one memory pool, their outputs into one set of static
        outputs (CUDA only: elsewhere, and with ``enforce_eager``, there are no buckets and nothing to
        capture). Each phase first runs eagerly at the largest bucket, which sizes the static outputs."""
        if not self.sizes:
            return
        largest = self.sizes[-1]
        samples = [as_tuple(self._static_call(name, largest)) for name in self.phases]
        self.outputs = StaticOutputs(samples, largest)
        del samples
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
        out = self.graphs[phase].run(bucket)
        if isinstance(out, torch.Tensor):
            return out[:bs]
        out = tuple(None if x is None else x[:bs] for x in out)
        return out[0] if len(out) == 1 else out
