"""Adaptive draft length (``LLM(adaptive_speculation=True)``, the default): each speculative step drafts s in
0..num_steps tokens (0: the bonus token is verified alone, a plain decode step). Greedy output is unchanged by
any schedule of s (forced schedules here), accept_lengths counts only the steps that drafted, and every switch
leaves each request a fresh draft input (DESIGN §4 rule 7): its bonus token, its committed length and the
target's hidden at its last committed row, checked against HF after every step."""

import itertools

import pytest
import torch
from helpers import PROMPTS, greedy, install_drafter, make_llm
from transformers import AutoModelForCausalLM

from nanospec.mtp.draft import chain_tree
from nanospec.mtp.worker import DraftLength

CHAIN = {"num_steps": 3}
TREE = {"num_steps": 2, "topk": 2, "num_draft_tokens": 4}


@pytest.fixture
def oracle(monkeypatch, reference):
    """Chain drafts = the target's own continuation after each row's device L (all accepted)."""

    def draft(self, reqs, block_table, seq_lens, num_splits=None, num_steps=None, sampling=None):
        S = self.num_steps if num_steps is None else num_steps
        rows = []
        for r, L in zip(reqs, seq_lens.tolist()):
            ref, n_out = reference(r.prompt_token_ids), L - len(r.prompt_token_ids) + 1
            rows.append((ref[n_out : n_out + S] + [0] * S)[:S])
        bonus = self.persistent_batch.take(reqs).bonus_tokens
        return chain_tree(bonus, torch.tensor(rows, dtype=torch.long).view(len(reqs), S))

    install_drafter(monkeypatch, draft)


def force(monkeypatch, schedule):
    """Make every engine's policy choose the draft lengths of ``schedule``, cycled; returns the log."""
    it = itertools.cycle(schedule)
    log = []
    monkeypatch.setattr(
        DraftLength, "choose", lambda self, bs, sampled=False: (log.append(s := next(it)), (s, None))[1]
    )
    return log


def run(llm, arrivals, check=None):
    done, k = {}, 0
    while k < len(arrivals) or llm.has_unfinished():
        for p, sp in arrivals[k] if k < len(arrivals) else []:
            llm.add_request(p, sp)
        done.update({r.request_id: r for r in llm.step()})
        if check is not None:
            check(llm)
        k += 1
    return done


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_forced_schedules_keep_greedy_output(tiny_llama_dir, asst_dir, reference, monkeypatch, mode, overlap):
    """Schedules starting with 0 right after prefill; requests arriving mid-run; a shared prefix (cached)."""
    spec = CHAIN if mode == "chain" else TREE
    schedule = [0, 3, 0, 0, 1, 2, 3, 0] if mode == "chain" else [0, 2, 0, 0, 2]
    log = force(monkeypatch, schedule)
    p = [list(x) for x in PROMPTS]
    prompts = [p[3], p[1], p[3][:20] + [5] * 10, p[0]]
    lens = (20, 9, 13, 7)
    arrivals = [[(prompts[0], greedy(20)), (prompts[1], greedy(9))], [], [(prompts[2], greedy(13))]]
    arrivals.append([(prompts[3], greedy(7))])
    llm = make_llm(tiny_llama_dir, asst_dir, overlap_schedule=overlap, adaptive_speculation=True, **spec)
    done = run(llm, arrivals)
    assert [done[i].output_token_ids for i in range(4)] == [reference(q)[:n] for q, n in zip(prompts, lens)]
    assert done[2].num_cached_tokens == 16  # its first block came from the prefix cache
    assert set(log) == set(schedule)
    for r in done.values():
        assert all(1 <= a <= 1 + spec["num_steps"] for a in r.accept_lengths)


@pytest.mark.parametrize("overlap", [False, True])
def test_oracle_schedule_exact_accept_lengths(
    tiny_llama_dir, asst_dir, reference, oracle, monkeypatch, overlap
):
    """With every draft right, a step drafting s commits s + 1 tokens: accept_lengths follow the schedule."""
    force(monkeypatch, [0, 3, 0, 1, 2])
    llm = make_llm(tiny_llama_dir, asst_dir, overlap_schedule=overlap, adaptive_speculation=True, **CHAIN)
    (r,) = run(llm, [[(PROMPTS[1], greedy(1 + 1 + 4 + 1 + 2 + 3 + 1))]]).values()
    assert r.output_token_ids == reference(PROMPTS[1])[:13]
    assert r.accept_lengths == [4, 2, 3]  # the plain steps (s = 0) emit one token each, uncounted


def test_switches_keep_the_draft_input_fresh(tiny_llama_dir, asst_dir, reference, monkeypatch):
    """DESIGN §4 rule 7, after every step of a forced schedule with preemption (a small pool): each running
    request's draft input holds its last token, its committed length and the target's post-norm hidden at its
    last committed row (HF); a preempted request's input is gone until it prefills again."""
    force(monkeypatch, [0, 3, 0, 0, 1])
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    checked = []

    def check(llm):
        inp = llm.persistent_batch.inputs
        rows = {rid: i for i, rid in enumerate(inp.req_ids)}
        assert set(rows) == {r.request_id for r in llm.scheduler.running}
        for r in llm.scheduler.running:
            i = rows[r.request_id]
            assert inp.bonus_tokens[i].item() == r.last_token
            assert inp.num_computed_tokens[i].item() == r.num_computed_tokens == r.num_tokens - 1
            with torch.no_grad():
                h = hf.model(torch.tensor([r.all_token_ids[:-1]])).last_hidden_state[0, -1]
            torch.testing.assert_close(inp.hidden[i], h, atol=2e-4, rtol=1e-4)
            checked.append(r.request_id)

    prompts = [list(p[:12]) for p in PROMPTS]
    llm = make_llm(
        tiny_llama_dir,
        asst_dir,
        page_size=4,
        max_model_len=64,
        num_kv_blocks=19,
        enable_prefix_caching=False,
        adaptive_speculation=True,
        **CHAIN,
    )
    done = run(llm, [[(p, greedy(n)) for p, n in zip(prompts, (30, 26, 34, 22))]], check)
    assert llm.scheduler.num_preemptions > 0 and len(set(checked)) == 4
    assert [done[i].output_token_ids for i in range(4)] == [
        reference(p)[:n] for p, n in zip(prompts, (30, 26, 34, 22))
    ]
    assert len(llm.persistent_batch) == 0


def test_policy_warm_up_choice_and_probes():
    """Warm-up tries every candidate once per batch-size bucket, largest first; then argmax E(s) / cost(s);
    every 16th step of a bucket probes its least recently measured candidate."""
    pol = DraftLength([0, 1, 2, 3], decay=1.0)
    cost = {0: 1.0, 1: 1.2, 2: 1.4, 3: 3.0}
    for want in (3, 2, 1, 0):  # warm-up
        s, est = pol.choose(1)
        assert (s, est) == (want, None)
        pol.observe(s, 1, [min(s, 2) + 1], cost[s])  # drafts 1 and 2 are always accepted, 3 never
    assert pol.expected_accept(0) == 1.0
    assert pol.expected_accept(1) == pytest.approx(1 + 3.5 / 4)  # position 1: 3 of 3 reached, prior 1/2
    assert pol.expected_accept(3) == pytest.approx(1 + (3.5 / 4) * (1 + 2.5 / 3 * (1 + 0.5 / 2)))
    rates = {s: pol.expected_accept(s) / cost[s] for s in cost}
    best = max(rates, key=rates.get)
    assert best == 2
    for step in range(5, 16):
        s, est = pol.choose(1)
        assert (s, est) == (best, pytest.approx(rates[best]))
        pol.cost[s, (1, False)] = cost[s]
        pol.measured_at[s, (1, False)] = step
    assert pol.choose(1) == (3, None)  # step 16: the least recently measured candidate
    assert pol.choose(3) == (3, None)  # batch of 3: bucket 4 warms up on its own
    pol.observe(3, 3, [1, 1, 1], 2.0)
    assert pol.choose(4) == (2, None)
    assert sum(pol.counts.values()) == 18 and pol.counts[2] == 13


def test_policy_notices_a_change_in_acceptance():
    """Decayed counts: after 30 steps of every draft accepted, 30 steps of none bring E(1) near 1."""
    pol = DraftLength([0, 1], decay=0.8)
    for a in [2] * 30:
        pol.observe(1, 1, [a], 1.0)
    assert pol.expected_accept(1) > 1.8
    for a in [1] * 30:
        pol.observe(1, 1, [a], 1.0)
    assert pol.expected_accept(1) < 1.1  # 0.5 / 6: the prior's weight against 5 decayed tries


def test_policy_cost_is_the_mean_of_the_first_steps_then_a_running_mean():
    """cost(s, B): the plain mean of a candidate's first 1 / alpha timed steps, then weight alpha per step
    (pace held at 1 by beta = 0, no clipping)."""
    pol = DraftLength([0, 1], alpha=0.25, beta=0.0, clip=float("inf"))
    for t in (1.0, 2.0, 3.0, 6.0):
        pol.observe(1, 1, [1], t)
    assert pol.cost[1, (1, False)] == pytest.approx(3.0)  # (1 + 2 + 3 + 6) / 4
    pol.observe(1, 1, [1], 7.0)
    assert pol.cost[1, (1, False)] == pytest.approx(3.0 + 0.25 * 4.0)
    pol.observe(1, 2, [1, 1], 5.0)  # another bucket starts its own mean
    assert pol.cost[1, (2, False)] == 5.0 and pol.cost[1, (1, False)] == pytest.approx(4.0)


def test_policy_books_a_slow_phase_to_the_pace_not_to_the_running_s():
    """Seconds = pace x cost(s): the machine slowing 2x while s = 1 runs mostly raises the pace, so s = 2,
    last measured before, does not look cheaper than s = 1 (booked per s, cost(1) would be the mean of
    10 x 1.0 and 20 x 2.0 = 1.67 > cost(2)). Every sample is clipped to 1.2 x the mean it updates."""
    pol = DraftLength([1, 2])  # alpha 0.02 (plain mean of the first 50), beta 0.25, clip 1.2
    pol.observe(2, 1, [1], 1.5)
    for _ in range(10):
        pol.observe(1, 1, [1], 1.0)
    assert pol.pace[1, False] == 1.0 and (pol.cost[1, (1, False)], pol.cost[2, (1, False)]) == (1.0, 1.5)
    pol.observe(1, 1, [1], 2.0)  # the same step now takes twice as long
    assert pol.cost[1, (1, False)] == pytest.approx(
        1 + (1.2 - 1) / 11
    )  # the 11th sample, clipped to 1.2 x 1.0
    assert pol.pace[1, False] == pytest.approx(1.05)  # 1 + 0.25 * (min(2 / 1.018, 1.2 * 1) - 1)
    for _ in range(19):
        pol.observe(1, 1, [1], 2.0)
    assert pol.pace[1, False] * pol.cost[1, (1, False)] == pytest.approx(2.0, rel=0.01)
    assert pol.pace[1, False] > 1.7 and pol.cost[1, (1, False)] < 1.2 < pol.cost[2, (1, False)]
    assert pol.choose(1)[0] == 1


def test_policy_clips_only_from_a_costs_fifth_sample():
    """An outlier first sample is averaged away (clipping it against itself would keep it for hundreds of
    steps); a zero reading does not zero a cost."""
    pol = DraftLength([0, 1], beta=0.0)
    for t in (2.0, 1.0, 1.0, 1.0):
        pol.observe(1, 1, [1], t)
    assert pol.cost[1, (1, False)] == pytest.approx(1.25)  # (2 + 1 + 1 + 1) / 4, nothing clipped
    pol.observe(1, 1, [1], 3.0)  # the 5th sample is clipped to 1.2 x 1.25
    assert pol.cost[1, (1, False)] == pytest.approx(1.25 + (1.5 - 1.25) / 5)
    pol.observe(0, 1, [1], 0.0)
    assert 0 < pol.cost[0, (1, False)] and pol.choose(1)[0] in (0, 1)


def test_policy_decays_the_acceptance_of_positions_it_does_not_draft():
    """Every step decays every position's counts, so the next probe of a long-unused depth outweighs what
    was measured long ago."""
    pol = DraftLength([0, 1, 2], decay=0.5)
    pol.observe(2, 1, [3], 1.0)  # both drafts accepted
    assert (pol.tries[False][1:], pol.hits[False][1:]) == ([1.0, 1.0], [1.0, 1.0])
    pol.observe(1, 1, [2], 1.0)  # position 1 accepted; position 2 not drafted, still decays
    assert (pol.tries[False][1:], pol.hits[False][1:]) == ([1.5, 0.5], [1.5, 0.5])
    pol.observe(0, 1, [1], 1.0)  # nothing drafted: everything decays
    assert (pol.tries[False][1:], pol.hits[False][1:]) == ([0.75, 0.25], [0.75, 0.25])
    a1, a2 = (0.75 + 0.5) / (0.75 + 1), (0.25 + 0.5) / (0.25 + 1)
    assert pol.expected_accept(2) == pytest.approx(1 + a1 + a1 * a2)


def test_policy_fixed_when_not_adaptive():
    pol = DraftLength([0, 1, 2], adaptive=False)
    assert [pol.choose(b)[0] for b in (1, 1, 7, 1)] == [2, 2, 2, 2]


def test_policy_candidates_and_option(tiny_llama_dir, asst_dir):
    assert make_llm(
        tiny_llama_dir, asst_dir, adaptive_speculation=True, **CHAIN
    ).worker.policy.candidates == [0, 1, 2, 3]
    assert make_llm(tiny_llama_dir, asst_dir, adaptive_speculation=True, **TREE).worker.policy.candidates == [
        0,
        2,
    ]
    with pytest.raises(TypeError, match="adaptive_speculation"):
        make_llm(tiny_llama_dir, asst_dir, adaptive_speculation="yes")


def test_adaptive_default_is_lossless_and_traced(tiny_llama_dir, asst_dir, reference):
    """The default policy (real timings) on the random assistant: greedy output unchanged; one draft_len
    trace event per speculative step, with the estimate once measured."""
    events = []
    llm = make_llm(
        tiny_llama_dir, asst_dir, adaptive_speculation=True, trace=lambda *e: events.append(e), **CHAIN
    )
    outs = llm.generate([PROMPTS[0], PROMPTS[2]], greedy(40), use_tqdm=False)
    assert [o["token_ids"] for o in outs] == [reference(PROMPTS[0])[:40], reference(PROMPTS[2])[:40]]
    lens = [f for _, e, f in events if e == "draft_len"]
    assert len(lens) == sum(llm.worker.policy.counts.values()) > 30
    assert {f["s"] for f in lens} <= {0, 1, 2, 3} and any(f["tok_per_s"] is not None for f in lens)
