"""Plain helpers shared by the speculative-engine tests (their fixtures live in conftest.py)."""

import contextlib
import os

import torch

from nanospec import LLM, SamplingParams
from nanospec.context import AttnMetadata
from nanospec.kernels.attention import num_kv_splits
from nanospec.kv_cache import slot_mapping
from nanospec.loader import build_target, load_config
from nanospec.mtp.worker import FrozenKVMTPWorker
from nanospec.tools import serve_bench

HB = 64  # hidden size of conftest's tiny Llama target
REF_LEN = 48
P_DISTINCT = [100, 200, 300, 400, 500, 600, 700]  # its greedy continuation has no repeated token early on
PROMPTS = [[11, 22, 33], P_DISTINCT, list(range(1000, 1017)), list(range(5000, 5030))]  # 3, 7, 17, 30 tokens


def make_llm(model_dir, assistant=None, **kw):
    """A small fp32 CPU engine; speculation drafts a fixed num_steps (tests of the adaptive draft length pass
    ``adaptive_speculation=True``)."""
    base = dict(device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=128, page_size=16)
    base["adaptive_speculation"] = False
    if assistant is not None:
        base["assistant"] = str(assistant)
    return LLM(str(model_dir), **{**base, **kw})


def greedy(max_tokens=REF_LEN, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


TRAIN_ENGINE = dict(dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=200, page_size=4)
TRAIN_ENGINE["adaptive_speculation"] = False  # acceptance is measured at a fixed num_steps


def tiny_target(model_dir):
    """The trainer's view of a target dir: nanospec's fp32 CPU model (max_model_len 256), no engine."""
    return build_target(load_config(model_dir), "cpu", torch.float32, 256, model_dir)


def chat_texts(tokenizer, questions):
    """Each question as a one-turn chat prompt (text, generation prompt added) in the tokenizer's template."""
    chat = dict(tokenize=False, add_generation_prompt=True)
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], **chat) for q in questions]


def next_inputs(llm):
    """``LLM.collective_rpc`` probe: this rank's next-step inputs (request ids, bonus tokens, committed
    lengths, seed hiddens of the draft inputs, or the plain-decode rows) and its KV pool's block count."""
    inp = llm.persistent_batch.inputs
    return (
        inp.req_ids,
        inp.bonus_tokens.tolist(),
        inp.num_computed_tokens.tolist(),
        inp.hidden.tolist(),
        [p.shape[2] for p in llm.runner.kv_pools],
    )


def rank_min(llm):
    """``LLM.collective_rpc`` probe: the rank's ``TensorParallel.all_reduce`` MIN (the KV pool's block count
    agreement) of a value that differs per rank."""
    tp = llm.runner.tp
    return int(tp.all_reduce(torch.tensor([100 - tp.rank]), torch.distributed.ReduceOp.MIN))


def prepare_decode(llm, reqs):
    """Decode inputs built on the host from the requests (the engine keeps them on the device): each one's
    last token at position ``num_computed_tokens``; returns (ids, positions, AttnMetadata)."""
    runner = llm.runner
    bt = llm.persistent_batch.block_tables(reqs)
    pos = torch.tensor([r.num_computed_tokens for r in reqs], device=runner.device)
    slots = slot_mapping(bt, torch.arange(len(reqs), device=runner.device), pos, runner.config.page_size)
    md = AttnMetadata.decode(
        bt, (pos + 1).int(), slots, num_kv_splits(max(r.num_computed_tokens for r in reqs) + 1)
    )
    return torch.tensor([r.last_token for r in reqs], device=runner.device), pos, md


def record_step_reqs(worker):
    """Wrap this ``worker``'s ``step`` to keep each step's requests in ``worker.step_reqs``: a test drafter
    that must know whose rows it drafts reads them there (``draft`` itself sees tensors only)."""
    step = worker.step

    def recording(reqs, plan=None, masks=None):
        worker.step_reqs = reqs
        return step(reqs, plan, masks)

    worker.step = recording


def install_drafter(monkeypatch, fn):
    """Replace every worker's drafter by ``fn(worker, reqs, block_table, seq_lens, num_splits=None,
    num_steps=None, sampling=None) -> DraftTree``, an oracle that reads the step's requests (their reference
    continuation): ``FrozenKVMTPWorker.step`` records its requests on the worker, ``draft`` hands them on."""
    step = FrozenKVMTPWorker.step

    def recording_step(self, reqs, plan=None, masks=None):
        self.step_reqs = reqs
        return step(self, reqs, plan, masks)

    def draft(self, inp, block_table, seq_lens, num_splits=None, num_steps=None, sampling=None, masks=None):
        return fn(self, self.step_reqs, block_table, seq_lens, num_splits, num_steps, sampling)

    monkeypatch.setattr(FrozenKVMTPWorker, "step", recording_step)
    monkeypatch.setattr(FrozenKVMTPWorker, "draft", draft)


@contextlib.contextmanager
def running_server(argv: list[str], timeout: float = 240):
    """``nanospec-serve *argv`` in a subprocess on a free loopback port (``serve_bench.launch``: 127.0.0.1,
    ``--port 0``), one thread per process; yields its URL. A start that takes over ``timeout`` s is killed;
    the server is stopped (killed if need be) when the block ends, also when a test fails."""
    proc, url = serve_bench.launch(argv, timeout, env=os.environ | {"OMP_NUM_THREADS": "1"})
    try:
        yield url
    finally:
        serve_bench.stop(proc)
