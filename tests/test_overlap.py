"""Overlap scheduling (``LLM(overlap_schedule=True)``): the host plans and launches step n+1 before it commits
step n; next inputs stay on the device. On CPU torch is synchronous, so the same code path runs here: outputs
must be token-identical to overlap off for plain decode, chain and tree speculation, with stops inside
multi-token commits, max_tokens 1-3, preemption, all-finish-in-verify and requests arriving mid-run; blocks
exact at idle. The oracle drafter proposes the target's own continuation from the *device* committed length,
so it stays right when the host lags a step."""

import pytest
from helpers import PROMPTS, greedy, make_llm

MODES = {"plain": {}, "chain": {"num_steps": 3}, "tree": {"num_steps": 2, "topk": 2, "num_draft_tokens": 4}}


def run(llm, arrivals):
    """``arrivals[k]`` = list of (prompt, params) added before step k; returns {request id: output dict}."""
    done, k = {}, 0
    while k < len(arrivals) or llm.has_unfinished():
        for p, sp in arrivals[k] if k < len(arrivals) else []:
            llm.add_request(p, sp)
        done.update({r.request_id: llm.output_dict(r) for r in llm.step()})
        k += 1
    return done


def idle_exact(llm):
    a = llm.runner.allocator
    assert not any(a.ref_count) and a.num_free == a.num_usable and not llm.has_unfinished()
    inputs = llm.persistent_batch.inputs
    assert len(inputs) == 0 and inputs.num_computed_tokens.shape == (0,)


def both(model_dir, assistant, mode, arrivals, preempts=False, **kw):
    outs = []
    for overlap in (False, True):
        llm = make_llm(
            model_dir, assistant if mode != "plain" else None, overlap_schedule=overlap, **MODES[mode], **kw
        )
        outs.append(run(llm, arrivals))
        idle_exact(llm)
        assert (llm.scheduler.num_preemptions > 0) == preempts
    return outs


def workload(reference):
    p = [list(x) for x in PROMPTS]
    stop = reference(p[1])[5]  # a stop token that appears inside a multi-token commit
    first = [
        (p[0], greedy(1)),
        (p[1], greedy(20, stop_token_ids=[stop])),
        (p[2], greedy(2)),
        (p[3], greedy(3)),
    ]
    later = [(p[2][:9], greedy(11)), (p[0] + [7], greedy(17))]
    return [first, [], [later[0]], [], [], [later[1]]]  # two requests arrive while others run


@pytest.mark.parametrize("mode", sorted(MODES))
def test_overlap_matches_overlap_off(tiny_llama_dir, asst_dir, reference, mode, request):
    if mode == "chain":
        request.getfixturevalue("device_oracle")
    off, on = both(tiny_llama_dir, asst_dir, mode, workload(reference))
    assert on == off
    assert sorted(len(o["token_ids"]) for o in on.values())[:3] == [1, 2, 3]  # max_tokens 1-3 respected
    if mode == "chain":  # commits of several tokens did happen, and a stop cut one of them
        assert any(a >= 3 for o in on.values() for a in o["accept_lengths"])
        assert on[1]["finish_reason"] == "stop" and len(on[1]["token_ids"]) == 6


@pytest.mark.parametrize("mode", ["plain", "chain"])
def test_overlap_with_preemption(tiny_llama_dir, asst_dir, reference, device_oracle, mode):
    prompts = [list(p[:12]) for p in PROMPTS]
    arrivals = [[(p, greedy(n)) for p, n in zip(prompts, (30, 26, 34, 22))]]
    kw = dict(page_size=4, max_model_len=64, num_kv_blocks=19, enable_prefix_caching=False)
    off, on = both(tiny_llama_dir, asst_dir, mode, arrivals, preempts=True, **kw)
    assert on == off
    assert [on[i]["token_ids"] for i in range(4)] == [
        reference(p)[:n] for p, n in zip(prompts, (30, 26, 34, 22))
    ]


def test_overlap_all_finish_in_one_verify(tiny_llama_dir, asst_dir, reference, device_oracle):
    llm = make_llm(tiny_llama_dir, asst_dir, overlap_schedule=True, num_steps=3)
    llm.add_request(PROMPTS[0], greedy(3))
    llm.add_request(PROMPTS[1], greedy(3))
    out = []
    while llm.has_unfinished():
        out += llm.step()
    assert sorted(len(r.output_token_ids) for r in out) == [3, 3]
    assert [r.output_token_ids for r in sorted(out, key=lambda r: r.request_id)] == [
        reference(PROMPTS[0])[:3],
        reference(PROMPTS[1])[:3],
    ]
    idle_exact(llm)  # the idle 0-row draft input is left (DESIGN §4 rule 1) ...
    llm.add_request(PROMPTS[2], greedy(5))  # ... and the next prefill merges into it
    out = []
    while llm.has_unfinished():
        out += llm.step()
    assert out[0].output_token_ids == reference(PROMPTS[2])[:5]
    idle_exact(llm)


def test_overlap_option_defaults_off_on_cpu(tiny_llama_dir):
    assert make_llm(tiny_llama_dir).overlap is False
    assert make_llm(tiny_llama_dir, overlap_schedule=True).overlap is True
