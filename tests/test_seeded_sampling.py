"""A sampled request is a function of itself: the token at position t is the target's position-keyed Gumbel
argmax (``kernels.sampling.sample``), so a request's tokens are the same run twice, alone or in a batch of 8,
with overlap on or off, across preemption, under any draft-length schedule, chain or tree, and with
speculation on or off (fp32 here; bf16 with ``deterministic=True`` in tests/test_deterministic.py).

The drafts are really accepted: an oracle drafter proposes each request's spec-off continuation from the
device's committed length (right at most depths, wrong at some), and the tests assert how often drafts were
accepted; a vocab-8 target with a real random assistant checks the engine's own coupled drafts."""

import itertools

import pytest
import torch
from conftest import vocab8_target
from helpers import PROMPTS, install_drafter, make_llm

from nanospec import SamplingParams
from nanospec.mtp.draft import DraftTree, chain_tree
from nanospec.mtp.worker import DraftLength

MODES = {"chain": {"num_steps": 3}, "tree": {"num_steps": 2, "topk": 2, "num_draft_tokens": 5}}
SCHEDULES = {"chain": [0, 3, 1, 2], "tree": [0, 2, 2]}
# eight requests: distinct prompts (3 to 30 tokens) and seeds, mixed filters
BATCH = [list(p) for p in PROMPTS] + [[5, 6, 7, 8], [9, 9], list(range(300, 311)), [42] * 6]
PARAMS = [
    SamplingParams(
        temperature=(0.8, 1.0, 0.6, 1.3)[i % 4],
        top_p=(1.0, 0.9, 0.95, 1.0)[i % 4],
        top_k=(-1, -1, 50, 20)[i % 4],
        max_tokens=10 + i,
        ignore_eos=True,
        seed=100 + i,
    )
    for i in range(len(BATCH))
]


def run(llm, arrivals):
    """``arrivals[k]`` = (prompt, params) pairs added before step k; returns {request id: Request}."""
    done, k = {}, 0
    while k < len(arrivals) or llm.has_unfinished():
        for p, sp in arrivals[k] if k < len(arrivals) else []:
            llm.add_request(p, sp)
        done.update({r.request_id: r for r in llm.step()})
        k += 1
    return done


def tokens(done):
    return [done[i].output_token_ids for i in sorted(done)]


def accept_lengths(done):
    return [a for r in done.values() for a in r.accept_lengths]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """prompt -> its spec-off sampled continuation (each request alone, its own seed)."""
    llm = make_llm(tiny_llama_dir)
    return {tuple(p): llm.generate([p], sp, use_tqdm=False)[0]["token_ids"] for p, sp in zip(BATCH, PARAMS)}


@pytest.fixture
def oracle(monkeypatch, reference):
    """Drafts = each request's reference continuation after its device committed length L; at an L divisible
    by 4 the last draft is wrong. Trees hang a decoy sibling beside every right node (the right one first or
    second by L), so verify walks siblings and compacts the accepted path's KV."""

    def draft(self, reqs, block_table, seq_lens, num_splits=None, num_steps=None, sampling=None):
        S = self.num_steps if num_steps is None else num_steps
        bonus = self.persistent_batch.take(reqs).bonus_tokens
        rows = []
        for r, L in zip(reqs, seq_lens.tolist()):
            ref = reference[tuple(r.prompt_token_ids)]
            n_out = L - len(r.prompt_token_ids) + 1
            d = (ref[n_out : n_out + S] + [0] * S)[:S]
            if L % 4 == 0 and S:
                d[-1] = (d[-1] + 1) % 49152
            rows.append(d)
        truth = torch.tensor(rows, dtype=torch.long).view(len(reqs), S)
        if self.topk == 1 or S == 0:
            return chain_tree(bonus, truth)
        return _tree_with_decoys(bonus, truth, seq_lens)

    install_drafter(monkeypatch, draft)


def _tree_with_decoys(bonus, truth, seq_lens):
    """Depth d holds the right token and a decoy, both children of the right node at depth d - 1."""
    B, S = truth.shape
    N = 1 + 2 * S
    toks = torch.zeros(B, N, dtype=torch.long)
    parents = torch.full((B, N), -1)
    depth = torch.zeros(B, N, dtype=torch.long)
    toks[:, 0] = bonus
    right = torch.zeros(B, dtype=torch.long)
    first = (seq_lens % 2 == 0).long()  # which slot holds the right token
    for d in range(S):
        for j in range(2):
            i = 1 + 2 * d + j
            toks[:, i] = torch.where(first == j, truth[:, d], (truth[:, d] + 7) % 49152)
            parents[:, i] = right
            depth[:, i] = d + 1
        right = 1 + 2 * d + first
    mask = torch.zeros(B, N, N, dtype=torch.bool)
    for i in range(N):
        mask[:, i, i] = True
        if i:
            mask[:, i] |= mask[torch.arange(B), parents[:, i]]
    return DraftTree(toks, parents, depth, mask)


def force(monkeypatch, schedule):
    it = itertools.cycle(schedule)
    monkeypatch.setattr(DraftLength, "choose", lambda self, bs, sampled=False: (next(it), None))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_seeded_request_is_a_function_of_itself(
    tiny_llama_dir, asst_dir, reference, oracle, monkeypatch, mode
):
    """Spec-on == spec-off, alone == in a batch of 8 == run twice == requests arriving mid-run, overlap on
    and off, draft lengths forced through a schedule (0, 3, 1, 2 for chains); drafts accepted on most
    steps."""
    force(monkeypatch, SCHEDULES[mode])
    want = [reference[tuple(p)] for p in BATCH]
    first_half = list(zip(BATCH[:4], PARAMS[:4]))
    staggered = [first_half, []] + [[x] for x in zip(BATCH[4:], PARAMS[4:])]
    for overlap in (False, True):
        kw = dict(overlap_schedule=overlap, adaptive_speculation=True, max_num_seqs=8, **MODES[mode])
        llm = make_llm(tiny_llama_dir, asst_dir, **kw)
        batched = run(llm, [list(zip(BATCH, PARAMS))])
        assert tokens(batched) == want
        assert tokens(run(llm, [list(zip(BATCH, PARAMS))])) == want  # run twice, same engine
        assert tokens(run(llm, staggered)) == want
        alone = [tokens(run(llm, [[(p, sp)]]))[0] for p, sp in zip(BATCH, PARAMS)]
        assert alone == want
        acc = accept_lengths(batched)
        assert sum(a > 1 for a in acc) > 0.5 * len(acc) and max(acc) == 1 + MODES[mode]["num_steps"]
        a = llm.runner.allocator
        assert a.num_free == a.num_usable and len(llm.persistent_batch) == 0


@pytest.mark.parametrize("mode", sorted(MODES))
def test_seeded_tokens_survive_preemption(tiny_llama_dir, asst_dir, reference, oracle, mode):
    """A small pool preempts requests mid-run (recompute): each request's tokens still equal its spec-off
    continuation, overlap on and off."""
    want = [reference[tuple(p)] for p in BATCH[:4]]
    for overlap in (False, True):
        llm = make_llm(
            tiny_llama_dir,
            asst_dir,
            page_size=4,
            max_model_len=64,
            num_kv_blocks=22,
            enable_prefix_caching=False,
            overlap_schedule=overlap,
            **MODES[mode],
        )
        done = run(llm, [list(zip(BATCH[:4], PARAMS[:4]))])
        assert tokens(done) == want
        assert llm.scheduler.num_preemptions > 0
        acc = accept_lengths(done)
        assert sum(a > 1 for a in acc) > 0.5 * len(acc)


def test_engine_seed_fixes_unseeded_requests(tiny_llama_dir):
    """A request without a seed gets one from the engine's generator: ``LLM(seed=...)`` fixes a whole run,
    another engine seed gives other samples."""
    sp = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    runs = []
    for seed in (3, 3, 4):
        llm = make_llm(tiny_llama_dir, seed=seed)
        runs.append([o["token_ids"] for o in llm.generate(BATCH[:3], sp, use_tqdm=False)])
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert len({tuple(t) for t in runs[0]}) == 3


@pytest.mark.parametrize("topk", [1, 2])
def test_real_coupled_drafts_on_vocab8(tmp_path, smollm2_tokenizer, topk):
    """The engine's own drafter (a random assistant, no oracle) on a vocab-8 target at T = 1: 64 seeded
    requests, spec on == spec off token for token, and drafts were accepted on many steps. The draft length is
    fixed, so how many steps accept does not hang on measured times."""
    from test_spec_lossless import make_assistant

    d = vocab8_target(tmp_path / "v8", smollm2_tokenizer)
    asst = make_assistant(tmp_path / "a8", d, seed=8, std=0.5, hidden_size=32)
    params = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=s) for s in range(64)]
    prompts = [[3, 1, 4, s % 8] for s in range(64)]
    kw = dict(max_model_len=32, max_num_seqs=64, num_kv_blocks=200, page_size=4)
    off = make_llm(d, **kw).generate(prompts, params, use_tqdm=False)
    spec = dict(num_steps=3) if topk == 1 else dict(num_steps=2, topk=2, num_draft_tokens=5)
    on = make_llm(d, asst, **spec, **kw).generate(prompts, params, use_tqdm=False)
    assert [o["token_ids"] for o in on] == [o["token_ids"] for o in off]
    acc = [a for o in on for a in o["accept_lengths"]]
    assert sum(a > 1 for a in acc) > 0.15 * len(acc)  # measured: 122 / 585 (chain), 138 / 572 (tree)


def test_has_unfinished_tracks_returned_results(tiny_llama_dir):
    """``has_unfinished`` is True while an aborted request has not come back from ``step``; an engine with no
    unfinished work has no step in flight (overlap drains a step whose requests all finished)."""
    sp = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=1)
    llm = make_llm(tiny_llama_dir, overlap_schedule=True)
    llm.generate([PROMPTS[0], PROMPTS[1]], sp, use_tqdm=False)
    assert not llm.has_unfinished() and llm._inflight is None
    rid = llm.add_request(PROMPTS[2], SamplingParams(temperature=1.0, max_tokens=20, seed=2))
    llm.step()
    llm.step()
    assert llm.abort_request(rid)
    assert llm.has_unfinished()
    returned = []
    while llm.has_unfinished():
        returned += llm.step()
    assert [(r.request_id, r.finish_reason) for r in returned] == [(rid, "abort")]
    assert llm._inflight is None
    a = llm.runner.allocator
    assert a.num_free == a.num_usable and not any(a.ref_count)
