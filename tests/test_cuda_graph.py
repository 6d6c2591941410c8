"""CPU checks of the CUDA-graph machinery: buckets, static buffers, padding rows, eager fallback.

On CPU ``BucketGraphs.run`` calls the phase function eagerly on the padded static buffers, which is exactly
what a graph replays on the GPU; so padding and static-shape logic are tested here, capture itself on the GPU.
"""

import contextlib
import gc
import weakref

import pytest
import torch
from helpers import prepare_decode

from nanospec import LLM, SamplingParams
from nanospec.kv_cache import DUMMY_BLOCK
from nanospec.model_runner import GraphRunner, StaticBuffers, graph_batch_sizes, select_bucket


def test_bucket_sizes_and_choice():
    assert graph_batch_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_batch_sizes(5) == [1, 2, 4, 5] and graph_batch_sizes(1) == [1]
    sizes = graph_batch_sizes(40)
    assert [select_bucket(b, sizes) for b in (1, 3, 8, 9, 33, 40)] == [1, 4, 8, 16, 40, 40]
    assert select_bucket(41, sizes) is None and select_bucket(0, sizes) is None  # eager fallback


def test_static_buffers_pad_rows():
    buf = StaticBuffers("cpu", 4, {"bt": ((1, 5), torch.int32, DUMMY_BLOCK), "x": ((1,), torch.long, 7)})
    assert buf.bt.shape == (4, 5) and buf.x.shape == (4,)
    buf.fill("bt", torch.tensor([[3, 4], [5, 6]], dtype=torch.int32))
    assert buf.bt.tolist() == [[3, 4, 0, 0, 0], [5, 6, 0, 0, 0]] + [[0] * 5] * 2
    buf.x.fill_(-1)
    buf.fill("x", torch.tensor([1, 2, 3]))
    assert buf.x.tolist() == [1, 2, 3, 7]


def _engine(model_dir, **kw):
    return LLM(
        str(model_dir), dtype="float32", device="cpu", max_model_len=128, max_num_seqs=8, page_size=4, **kw
    )


PROMPTS = [[1, 2, 3, 4, 5], [9] * 11, [40, 41, 42]]


def with_buckets(llm, sizes):
    """Give the engine's graph runners these buckets: on CPU their phases run eagerly on padded buffers."""
    for owner in (llm.runner, llm.worker):
        if owner is not None and owner.graphs is not None:
            g = owner.graphs
            owner.graphs = GraphRunner(g.phases, g.buffer_specs, sizes, g.num_splits, llm.runner.device)


def _decode_batch(llm, n_prompts=3):
    for p in PROMPTS[:n_prompts]:
        llm.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True))
    while True:  # run prefills until the next plan is a decode
        batch = llm.scheduler.schedule()
        if batch.kind == "decode":
            return batch
        # launched, then committed: a step without overlap
        tokens = llm.runner.prefill(batch, llm.persistent_batch).tokens
        llm.scheduler.on_launch(batch)
        llm.scheduler.commit(batch, tokens)


@torch.inference_mode()
def test_padding_rows_never_touch_live_blocks(tiny_llama_dir):
    llm = _engine(tiny_llama_dir)
    r = llm.runner
    with_buckets(llm, [8])  # 3 live rows + 5 padding rows
    batch = _decode_batch(llm)
    before = r.kv_pools[0].clone()
    ids, pos, md = prepare_decode(llm, batch.reqs)
    inputs = {
        "ids": ids,
        "pos": pos,
        "slots": md.slot_mapping,
        "block_table": md.block_table,
        "seq_lens": md.seq_lens,
    }
    logits = r.graphs.run("decode", inputs, md.num_splits)
    from nanospec.context import attn_metadata

    with attn_metadata(md):
        ref = r.model.compute_logits(r.model(ids, pos))
    assert logits.shape == ref.shape and torch.allclose(logits, ref, atol=1e-5)
    changed = (r.kv_pools[0] != before).flatten(start_dim=4).any(-1)  # [layers, 2, blocks, page_size]
    live = {(s // 4, s % 4) for s in md.slot_mapping.tolist()}
    touched = {(b, o) for b, o in changed.any(0).any(0).nonzero().tolist()}
    # padding writes land in the dummy block only
    assert touched - live <= {(DUMMY_BLOCK, o) for o in range(4)}
    assert live <= touched


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize(
    "spec",
    [
        None,
        {"num_steps": 3},
        {"num_steps": 2, "topk": 2, "num_draft_tokens": 4},
        {"num_steps": 3, "centroids": True},
        {"num_steps": 2, "topk": 2, "num_draft_tokens": 4, "centroids": True},
    ],
)
def test_static_graph_path_matches_eager(tiny_llama_dir, tmp_path, spec, temperature):
    """Whole generations through the static (padded) graph functions equal plain eager runs, with a bucket
    smaller than the batch too (eager fallback), spec on and off, dense and centroid LM heads (as the shipped
    assistant has), greedy and sampled (the sampling tensors and seeds are static inputs of the "mtp:{s}"
    phases too)."""
    kw = {}
    if spec:
        from test_spec_lossless import make_assistant

        spec = dict(spec)
        head = (
            dict(use_ordered_embeddings=True, num_centroids=64, centroid_top_k=4)
            if spec.pop("centroids", 0)
            else {}
        )
        path = make_assistant(tmp_path / "a", tiny_llama_dir, hidden_size=32, num_heads=4, **head)
        kw = dict(assistant=path, **spec)
    sp = [
        SamplingParams(max_tokens=10, ignore_eos=True, temperature=temperature, top_k=50, seed=i)
        for i in range(len(PROMPTS))
    ]
    ref = [o["token_ids"] for o in _engine(tiny_llama_dir, **kw).generate(PROMPTS, sp, use_tqdm=False)]
    for sizes in ([4], [2]):  # [2] < 3 requests: the full batch falls back to eager, late batches use graphs
        llm = _engine(tiny_llama_dir, **kw)
        with_buckets(llm, sizes)
        out = llm.generate(PROMPTS, sp, use_tqdm=False)
        assert [o["token_ids"] for o in out] == ref
        al = llm.runner.allocator
        assert al.num_free == al.num_usable


class StandInGraph:
    """A stand-in for ``torch.cuda.CUDAGraph`` on a CPU: capture runs the phase, replay does nothing."""

    def replay(self):
        pass


@pytest.fixture
def stand_in_capture(monkeypatch):
    """``torch.cuda``'s graph calls replaced by stand-ins; returns the pool each capture was given."""
    pools = []

    @contextlib.contextmanager
    def graph(g, pool=None):
        pools.append(pool)
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", StandInGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", object)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    return pools


def test_capture_keeps_one_set_of_static_outputs(stand_in_capture):
    """Capture at the defaults (max_num_seqs 256: 20 buckets; S = 5: phases mtp:0..5), each phase returning
    fresh outputs shaped as the speculative step's (tree tokens [bs, N], emitted [bs, s + 1], accept length,
    bonus, hidden [bs, H], path [bs, s + 1]; the verify's logits only from an eager call): afterwards the
    tensors still alive are one set of static outputs for the largest bucket, not one per phase and bucket,
    and every capture used the same memory pool. A replay returns views of those outputs."""
    hidden_size = 64
    made = []  # weak references to every tensor a phase returned

    def phase(s):
        def fn(bonus, L, num_splits=None, keep_logits=False):
            bs = len(bonus)
            outs = [torch.ones(bs, s + 1, dtype=torch.long), torch.ones(bs, s + 1, dtype=torch.long)]
            outs += [torch.ones(bs, dtype=torch.long), torch.ones(bs, dtype=torch.long)]
            outs += [torch.ones(bs, hidden_size), torch.ones(bs, s + 1, dtype=torch.long)]
            made.extend(weakref.ref(x) for x in outs)
            logits = torch.ones(bs, s + 1, 49152) if keep_logits else None
            return (*outs, logits)

        return fn

    sizes = graph_batch_sizes(256)
    buffers = {"bonus": ((1,), torch.long, 0), "L": ((1,), torch.int32, 0)}
    phases = {f"mtp:{s}": (phase(s), ["bonus", "L"]) for s in range(6)}
    runner = GraphRunner(phases, buffers, sizes, 16, "cpu")
    runner.capture()
    gc.collect()
    alive = sum(r().nbytes for r in made if r() is not None)
    one_set = sum(x.nbytes for x in phases["mtp:5"][0](torch.zeros(256), None) if x is not None)
    assert len(sizes) == 20 and len(stand_in_capture) == 6 * 20
    assert len({id(pool) for pool in stand_in_capture}) == 1  # one pool for every phase and bucket
    assert alive == 0 and sum(b.nbytes for b in runner.outputs.buffers if b is not None) == one_set
    out = runner.run("mtp:2", {"bonus": torch.zeros(3, dtype=torch.long), "L": torch.zeros(3)}, None)
    assert out[1].shape == (3, 3) and out[6] is None
    assert out[1].untyped_storage().data_ptr() == runner.outputs.buffers[1].untyped_storage().data_ptr()


def test_no_decode_graphs_under_speculation(tiny_llama_dir, asst_dir, monkeypatch):
    """With an assistant every decode step is the worker's: only the ``mtp:{s}`` phases are captured (the
    plain ``decode`` phase would never replay); without one, ``decode`` is."""
    captured = []
    monkeypatch.setattr(GraphRunner, "capture", lambda self: captured.append(sorted(self.phases)))
    _engine(tiny_llama_dir, assistant=str(asst_dir), num_steps=2, adaptive_speculation=False)
    assert captured == [["mtp:0", "mtp:1", "mtp:2"]] or captured == [["mtp:2"]]
    captured.clear()
    _engine(tiny_llama_dir)
    assert captured == [["decode"]]
