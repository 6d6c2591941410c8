"""The progress rule under KV pressure (DESIGN §4 rule 10), as a property of the real ``LLM.step``
ordering, the real ``Scheduler``, ``BlockAllocator`` and ``PersistentBatch``, with the model replaced by a
fake that reads and writes the next inputs on the "device" the way the real runner and worker do.

The fake emits, at position p of request r, the token ``token_at(r, p)``, computed from the device-side next
inputs (committed length L): so a stale, lost or duplicated next input shows up as a wrong token, and a
missing one as ``RuntimeError("a decode request has no next input")``. Thousands of random tiny pools (at and
just above the smallest the engine accepts), page sizes 1-16, lookaheads 1-6 with random accept lengths,
shared prefixes, chunked prefill, overlap on and off, aborts at random steps. Against the scheduler before
this rule, it finds both the livelock (two requests preempting each other forever) and the lost next input
of a request preempted and re-prefilled in one step.
"""

import random

import torch

from nanospec.config import EngineConfig
from nanospec.kv_cache import DUMMY_BLOCK, BlockAllocator, cdiv
from nanospec.llm import LLM
from nanospec.parallel import SINGLE, Ranks
from nanospec.persistent_batch import PersistentBatch, StepInput
from nanospec.request import Request
from nanospec.sampling_params import SamplingParams
from nanospec.scheduler import Scheduler
from nanospec.transfer import PrefillOutput, StepOutput

VOCAB = 50
# The oldest unfinished request advances (a prefill chunk or a committed token) within this many steps
# (DESIGN §4 rule 10): a prefill step and a decode step alternate, and a decode row with a step in flight
# that does not fit twice waits one step for its commit.
PROGRESS_WINDOW = 6


def token_at(request_id: int, position: int) -> int:
    return (request_id * 31 + position * 7) % VOCAB


def take_block_tables(persistent_batch: PersistentBatch, reqs) -> None:
    """Take the block-table rows as ``ModelRunner`` and the worker do; they hold each request's table."""
    width = max((len(r.block_table) for r in reqs), default=1) or 1
    want = [r.block_table + [DUMMY_BLOCK] * (width - len(r.block_table)) for r in reqs]
    assert persistent_batch.block_tables(reqs).tolist() == want


class FakeRunner:
    """Prefill: a new request's first token; a resumed one's next input from its newest token. Plain decode:
    one token from the device-side committed length, as ``ModelRunner.decode``."""

    tp = SINGLE  # one rank

    def prefill(self, batch, persistent_batch, masks=None) -> PrefillOutput:
        take_block_tables(persistent_batch, batch.reqs)
        done = [i for i in range(len(batch.reqs)) if batch.completes(i)]
        new = [i for i in done if not batch.reqs[i].output_token_ids]
        bonus = [batch.reqs[i].last_token for i in done]
        for j, i in enumerate(done):
            if i in new:
                r = batch.reqs[i]
                bonus[j] = token_at(r.request_id, r.num_tokens)
        done_reqs = [batch.reqs[i] for i in done]
        hidden = torch.zeros(len(done), 0)
        return PrefillOutput(
            len(batch.reqs), done, new, done_reqs, torch.tensor(bonus, dtype=torch.long), hidden
        )

    def decode(self, reqs, persistent_batch: PersistentBatch, masks=None) -> StepOutput:
        take_block_tables(persistent_batch, reqs)
        inp = persistent_batch.take(reqs)
        ids = torch.tensor(inp.req_ids)
        toks = (ids * 31 + (inp.num_computed_tokens.long() + 1) * 7) % VOCAB
        persistent_batch.advance(StepInput(inp.req_ids, toks, inp.hidden, inp.num_computed_tokens + 1))
        return StepOutput(torch.stack([torch.ones_like(toks), toks], 1))


class FakeWorker:
    """A speculative step that accepts a random 1..max_accept tokens per row (drafts + the bonus token) and
    leaves each row's next input from the device-side committed length, as ``FrozenKVMTPWorker.step``."""

    def __init__(self, persistent_batch, lookahead: int, max_accept: int, rng: random.Random):
        self.persistent_batch = persistent_batch
        self.lookahead = lookahead
        self.max_accept = max_accept
        self.rng = rng

    def plan(self, reqs):
        return self.max_accept - 1, None

    def observe(self, out) -> None:
        pass

    def step(self, reqs, plan=None, masks=None) -> StepOutput:
        take_block_tables(self.persistent_batch, reqs)
        inp = self.persistent_batch.take(reqs)
        acc = torch.tensor([self.rng.randint(1, self.max_accept) for _ in reqs])
        ids = torch.tensor(inp.req_ids)[:, None]
        positions = inp.num_computed_tokens.long()[:, None] + 1 + torch.arange(self.lookahead)
        out = (ids * 31 + positions * 7) % VOCAB
        bonus = out[torch.arange(len(reqs)), acc - 1]
        self.persistent_batch.advance(
            StepInput(inp.req_ids, bonus, inp.hidden, inp.num_computed_tokens + acc.int())
        )
        return StepOutput(torch.cat([acc[:, None], out], 1), num_drafted=self.lookahead - 1)


def fake_engine(cfg: dict, rng: random.Random) -> LLM:
    """An ``LLM`` whose steps run the real plan -> launch -> commit code over the fakes above."""
    lookahead = cfg["lookahead"]
    config = EngineConfig(
        max_num_seqs=cfg["max_num_seqs"],
        max_num_batched_tokens=cfg["max_num_batched_tokens"],
        max_model_len=cfg["max_model_len"],
        page_size=cfg["page_size"],
    )
    llm = LLM.__new__(LLM)
    llm.config = config
    width = cdiv(cfg["max_model_len"] + lookahead, cfg["page_size"])  # the graphs' width, as ModelRunner
    llm.runner = FakeRunner()
    llm.persistent_batch = PersistentBatch(cfg["max_num_seqs"], width, 0, torch.device("cpu"), torch.float32)
    llm.worker = None
    if lookahead > 1:
        llm.worker = FakeWorker(llm.persistent_batch, lookahead, cfg["max_accept"], rng)
    allocator = BlockAllocator(cfg["num_blocks"], cfg["page_size"], cfg["prefix_caching"])
    llm.scheduler = Scheduler(config, allocator, lookahead, llm._on_release)
    llm.overlap = cfg["overlap"]
    llm.num_steps_run = 0
    llm._inflight = None
    llm._stash = []
    llm.ranks = Ranks(SINGLE)
    return llm


def random_config(rng: random.Random) -> dict:
    page_size = rng.choice([1, 2, 3, 4, 8, 16])
    lookahead = rng.randint(1, 6)
    max_model_len = rng.randint(4, 40)
    per_req = cdiv(max_model_len + lookahead, page_size)  # the engine's own pool check (ModelRunner)
    return dict(
        page_size=page_size,
        lookahead=lookahead,
        max_accept=rng.randint(1, lookahead),  # a tree accepts at most its depth + 1
        max_model_len=max_model_len,
        num_blocks=per_req + 1 + rng.choice([0, 0, 1, 2, 3]),
        max_num_seqs=rng.randint(1, 6),
        max_num_batched_tokens=rng.randint(1, 12),
        prefix_caching=rng.random() < 0.5,
        overlap=rng.random() < 0.5,
        num_requests=rng.randint(1, 8),
        abort_rate=rng.choice([0.0, 0.0, 0.05]),
    )


def random_requests(cfg: dict, rng: random.Random) -> list[tuple[list[int], int]]:
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, cfg["max_model_len"]))] for _ in range(2)]
    out = []
    for _ in range(cfg["num_requests"]):
        total = rng.randint(2, cfg["max_model_len"])
        prompt_len = rng.randint(1, total - 1)
        prompt = (rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(total)])[:prompt_len]
        out.append((prompt, total - prompt_len))
    return out


def run_config(cfg: dict, seed: int) -> dict:
    """Run one configuration to the end; assert the rules; return counts."""
    rng = random.Random(seed)
    llm = fake_engine(cfg, rng)
    sched = llm.scheduler
    allocator = sched.allocator
    reqs = {}
    for i, (prompt, max_tokens) in enumerate(random_requests(cfg, rng)):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        reqs[i] = Request(i, prompt, params, set())
        llm._next_id = i + 1
        sched.add(reqs[i])
    work = sum(len(r.prompt_token_ids) + r.params.max_tokens for r in reqs.values())
    max_steps = PROGRESS_WINDOW * (work + 1)
    finished = {}
    last_progress = (-1, -1, -1, -1)
    since = 0
    for _ in range(max_steps):
        if not sched.has_work() and llm._inflight is None:
            break
        if cfg["abort_rate"] and rng.random() < cfg["abort_rate"]:
            live = [r for r in reqs.values() if r.request_id not in finished]
            if live:
                llm.abort_request(rng.choice(live).request_id)
        for r in llm.step():
            assert r.request_id not in finished, "a request finished twice"
            finished[r.request_id] = r
        # every running request has exactly its one next input once its prefill was launched
        rows = llm.persistent_batch.inputs.req_ids
        assert len(rows) == len(set(rows))
        assert set(rows) == {r.request_id for r in sched.running}, "a row without its request or the reverse"
        # the oldest unfinished request advances within the window
        alive = [r for r in reqs.values() if r.request_id not in finished]
        if alive:
            oldest = min(alive, key=lambda r: r.request_id)
            progress = (
                oldest.request_id,
                oldest.epoch,
                len(oldest.output_token_ids),
                oldest.num_computed_tokens,
            )
            if progress[:2] == last_progress[:2]:
                assert progress >= last_progress, "the oldest request was preempted"
            since = 0 if progress != last_progress else since + 1
            last_progress = progress
            assert since <= PROGRESS_WINDOW, f"no progress for {since} steps: {cfg}"
    else:
        raise AssertionError(f"not finished within {max_steps} steps: {cfg}")
    assert sorted(finished) == sorted(reqs)
    for r in reqs.values():
        if r.finish_reason != "abort":
            assert r.finish_reason == "length"
            n = len(r.prompt_token_ids)
            assert r.output_token_ids == [token_at(r.request_id, n + j) for j in range(r.params.max_tokens)]
    # every block is back: free, or cached with no owner
    assert allocator.num_free == allocator.num_usable
    assert all(c == 0 for c in allocator.ref_count)
    assert len(llm.persistent_batch) == 0 and not sched.running and not sched.waiting
    assert not llm.persistent_batch.row  # every block-table row is free again
    return dict(steps=llm.num_steps_run, preemptions=sched.num_preemptions)


def test_progress_property_random_tiny_pools():
    """Thousands of random configurations (seconds each thousand): every request finishes with exactly its
    tokens, no step raises, the oldest request advances within the window, every block returns."""
    rng = random.Random(1234)
    for seed in range(3000):
        cfg = random_config(rng)
        run_config(cfg, seed)


def test_issue_livelock_configuration():
    """The configuration that livelocked the real engine (two requests preempting each other forever):
    page_size 4, 7 blocks, 5-token budget, max_model_len 19, lookahead 3."""
    cfg = dict(
        page_size=4,
        lookahead=3,
        max_accept=3,
        max_model_len=19,
        num_blocks=7,
        max_num_seqs=4,
        max_num_batched_tokens=5,
        prefix_caching=True,
        overlap=False,
        num_requests=5,
        abort_rate=0.0,
    )
    prompts = [[21, 40, 27, 45, 26, 43, 6, 12, 19], [7] * 6 + [26, 43, 1], [7] * 6 + [16], [7, 7, 18, 41]]
    prompts.append([7, 27, 15, 10, 17])
    max_tokens = [10, 1, 6, 12, 10]
    for overlap in (False, True):
        for max_accept in (1, 3):
            llm = fake_engine(dict(cfg, overlap=overlap, max_accept=max_accept), random.Random(0))
            for i, (p, m) in enumerate(zip(prompts, max_tokens)):
                llm.scheduler.add(Request(i, p, SamplingParams(max_tokens=m, ignore_eos=True), set()))
            done = []
            for _ in range(500):
                done += llm.step()
                if len(done) == 5:
                    break
            assert len(done) == 5
            for r in done:
                n = len(r.prompt_token_ids)
                assert r.output_token_ids == [
                    token_at(r.request_id, n + j) for j in range(r.params.max_tokens)
                ]


def test_preempted_and_reprefilled_in_one_step_keeps_its_next_input():
    """A request preempted while a step is planned and re-prefilled by that same step: its release comes
    before the launch, so the next input its prefill gives it survives, and its next decode finds it."""
    cfg = dict(page_size=4, lookahead=1, max_accept=1, max_model_len=16, num_blocks=9, max_num_seqs=2)
    cfg |= dict(max_num_batched_tokens=16, prefix_caching=False, overlap=False)
    llm = fake_engine(cfg, random.Random(0))
    req = Request(0, [1, 2, 3, 4, 5], SamplingParams(max_tokens=6, ignore_eos=True), set())
    llm.scheduler.add(req)
    llm.step()  # prefill: running, with its next input
    llm.step()  # one decode
    llm.scheduler._preempt(req)  # as a decode plan that gave its blocks away would
    llm.scheduler.last_kind = "decode"  # the step below plans a prefill, which takes the request again
    llm.step()
    assert llm.persistent_batch.inputs.req_ids == [0]
    done = []
    while not done:
        done = llm.step()
    assert req.output_token_ids == [token_at(0, 5 + j) for j in range(6)]
