"""The Frozen-KV MTP worker's lifecycle hooks fire in the documented order (``nanospec/mtp/worker.py``),
recorded through ``LLM(trace=...)``: prefill, decode (draft + verify), finish, all-finish-in-verify,
preemption and abort. A release must free the request's KV blocks and its draft input in the same call."""

import io
import re
from collections import Counter

import pytest
from helpers import HB, PROMPTS, greedy, install_drafter, make_llm

from nanospec import LLM, trace


class Recorder:
    """Collects (step, event, req) and checks, at every release, that blocks and draft input are both gone."""

    def __init__(self):
        self.events, self.reasons, self.draft_lens, self.llm = [], [], [], None

    def __call__(self, step, event, fields):
        if event == "draft_len":  # one per step, not per request (tests/test_adaptive_speculation.py)
            self.draft_lens.append((step, fields["s"]))
            return
        self.events.append((step, event, fields["req"]))
        if event == "release":
            self.reasons.append(fields["reason"])
            req = self.find(fields["req"])
            assert req.block_table == []  # the KV blocks went in the same call ...
            assert fields["req"] not in self.llm.persistent_batch.inputs.req_ids  # ... as the draft input
        if event == "verify":
            assert fields["committed_L"] == fields["kv_rows"][0] + fields["accept_length"]

    def find(self, rid):
        s = self.llm.scheduler
        return next(r for r in [*s.waiting, *s.running, *self.seen] if r.request_id == rid)

    def kinds(self, rid):
        return [e for _, e, r in self.events if r == rid]


def traced(model_dir, assistant, **kw):
    rec = Recorder()
    rec.seen = []
    llm = make_llm(model_dir, assistant, trace=rec, **kw)
    rec.llm = llm
    orig = llm.scheduler.add
    llm.scheduler.add = lambda r: (rec.seen.append(r), orig(r))[1]
    return llm, rec


def run_all(llm):
    out = []
    while llm.has_unfinished():
        out += llm.step()
    return out


def test_hooks_prefill_decode_finish_in_order(tiny_llama_dir, asst_dir):
    llm, rec = traced(tiny_llama_dir, asst_dir, num_steps=2)
    llm.add_request(PROMPTS[1], greedy(9))
    (req,) = run_all(llm)
    kinds = rec.kinds(0)
    n_verify = len(req.accept_lengths)
    assert kinds == ["prefill_done"] + ["draft", "verify"] * n_verify + ["release"]
    steps = [s for s, _, _ in rec.events]
    assert steps == sorted(steps) and steps[0] == 1  # prefill in step 1, one draft + verify per later step
    assert [s for s, e, _ in rec.events if e == "verify"] == list(range(2, 2 + n_verify))
    assert len(llm.persistent_batch) == 0


def test_hooks_all_finish_in_one_verify_then_new_prefill(tiny_llama_dir, asst_dir):
    llm, rec = traced(tiny_llama_dir, asst_dir, num_steps=3)
    llm.add_request(PROMPTS[0], greedy(2))
    llm.add_request(PROMPTS[1], greedy(2))
    assert llm.step() == []
    done = llm.step()  # one verify commits >= 1 token + the bonus: both reach max_tokens=2 in it
    assert len(done) == 2
    assert [e for _, e, _ in rec.events] == ["prefill_done"] * 2 + ["draft", "verify"] * 2 + ["release"] * 2
    assert len(llm.persistent_batch) == 0 and llm.persistent_batch.inputs.hidden.shape == (
        0,
        HB,
    )  # idle input
    llm.add_request(PROMPTS[2], greedy(3))
    run_all(llm)
    assert rec.kinds(2)[0] == "prefill_done" and rec.kinds(2)[-1] == "release"


def test_hooks_preemption_releases_the_draft_input_at_once(tiny_llama_dir, asst_dir):
    llm, rec = traced(tiny_llama_dir, asst_dir, num_steps=3, page_size=4, max_model_len=64, num_kv_blocks=19)
    for p, n in zip(PROMPTS, (30, 26, 34, 22)):
        llm.add_request(p[:12], greedy(n))
    run_all(llm)
    assert llm.scheduler.num_preemptions > 0
    assert sorted(rec.reasons) == ["finished"] * 4 + ["preempted"] * llm.scheduler.num_preemptions
    for rid in range(4):
        kinds = rec.kinds(rid)
        # each life of a request: prefill_done, (draft, verify)*, release; a preempted life ends in release
        lives = " ".join(kinds).split("release")[:-1]
        assert len(lives) == kinds.count("release") >= 1
        for life in lives:
            words = life.split()
            if not words:
                continue  # preempted before its prompt was prefilled whole: its blocks go, no input was born
            assert words[0] == "prefill_done" and words[1:] == ["draft", "verify"] * ((len(words) - 1) // 2)
    assert llm.runner.allocator.num_free == llm.runner.allocator.num_usable


def test_hooks_abort_releases_blocks_and_draft_input(tiny_llama_dir, asst_dir):
    llm, rec = traced(tiny_llama_dir, asst_dir, num_steps=2)
    a = llm.add_request(PROMPTS[1], greedy(20))
    b = llm.add_request(PROMPTS[2], greedy(4))
    llm.step()
    llm.step()
    assert llm.abort_request(a) and not llm.abort_request(a) and not llm.abort_request(99)
    assert rec.kinds(a)[-1] == "release" and rec.reasons == ["aborted"]
    assert a not in llm.persistent_batch.inputs.req_ids
    done = run_all(llm)
    assert sorted((r.request_id, r.finish_reason) for r in done) == [(a, "abort"), (b, "length")]
    assert llm.runner.allocator.num_free == llm.runner.allocator.num_usable


def test_trace_true_prints_each_event_kind(tiny_llama_dir, asst_dir, capsys):
    """``trace=True``: the text view (``trace.TextView``), with marks when stdout is no terminal."""
    llm = make_llm(tiny_llama_dir, asst_dir, num_steps=2, trace=True)
    llm.generate([PROMPTS[0], PROMPTS[1]], greedy(5), use_tqdm=False)
    lines = capsys.readouterr().out.splitlines()
    for kind in ("prefill done, L=", "draft length 2 for", "accept_length", "released (finished)"):
        assert any(kind in line for line in lines), kind
    verify = next(line for line in lines if "accept_length" in line)
    assert " >'" in verify and "\033[" not in verify
    assert isinstance(llm.tracer, trace.TextView) and "(accepted / drafted)" in llm.tracer.histogram()


class DigitTokenizer:
    """Token t decodes to "t<t>": a text with no quote, space or mark in it."""

    def decode(self, ids):
        return "".join(f"t{i}" for i in ids)


def test_text_view_marks_agree_with_accept_lengths(tiny_llama_dir, asst_dir, device_oracle):
    """An oracle drafter that is accepted whole in some steps and rejected at depth 2 in others: each verify
    line marks accept_length - 1 drafts accepted, then the first rejected one (if any) and the ones never
    reached, then one bonus token; per request the lines' accept lengths are the output's; the histogram
    counts exactly the drafts the lines show."""
    out = io.StringIO()
    view = trace.TextView(DigitTokenizer(), out, colour=False)
    llm = make_llm(tiny_llama_dir, asst_dir, num_steps=3, adaptive_speculation=False, trace=view)
    outputs = llm.generate(PROMPTS[:3], greedy(16), use_tqdm=False)
    seen = {i: [] for i in range(3)}
    drafted = Counter()
    accepted = Counter()
    for line in out.getvalue().splitlines():
        if "accept_length" not in line:
            continue
        req = int(line.split("] req ")[1].split()[0])
        marks = re.findall(r"([+x.>])'t\d+'", line)
        a = int(line.split("accept_length ")[1].split(",")[0])
        seen[req].append(a)
        drafts = marks[:-1]
        assert marks[-1] == ">" and drafts.count(">") == 0
        assert drafts == ["+"] * (a - 1) + (["x"] + ["."] * (len(drafts) - a) if len(drafts) >= a else [])
        for j, mark in enumerate(drafts, 1):
            drafted[j] += 1
            accepted[j] += mark == "+"
    assert [seen[i] for i in range(3)] == [o["accept_lengths"] for o in outputs]
    all_accepted = [a for o in outputs for a in o["accept_lengths"]]
    assert 4 in all_accepted and 3 in all_accepted  # whole drafts accepted, and rejections at depth 3
    assert (view.drafted, view.accepted) == (drafted, accepted)
    assert f"({accepted[1]}/{drafted[1]})" in view.histogram()


def test_text_view_counts_a_tree_by_depth(monkeypatch, tiny_llama_dir, asst_dir, reference):
    """topk > 1 under an oracle tree drafter (``test_spec_lossless.oracle_draft``: the right token at a random
    sibling slot, wrong at some depths) that is accepted whole in some steps and not in others: a verify line
    shows the accepted path, the tree's draft count and the bonus token; the histogram counts depths 1..s,
    not tree nodes (the accepted path is no prefix of the node order)."""
    from test_spec_lossless import oracle_draft

    prompts = PROMPTS[:3]
    install_drafter(monkeypatch, oracle_draft([reference(p) for p in prompts], prompts, 2, 5))
    out = io.StringIO()
    view = trace.TextView(DigitTokenizer(), out, colour=False)
    tree = dict(num_steps=2, topk=2, num_draft_tokens=5, adaptive_speculation=False)
    llm = make_llm(tiny_llama_dir, asst_dir, trace=view, **tree)
    outputs = llm.generate(prompts, greedy(12), use_tqdm=False)
    lines = [line for line in out.getvalue().splitlines() if "accept_length" in line]
    accept_lengths = [int(line.split("accept_length ")[1].split(",")[0]) for line in lines]
    assert sorted(accept_lengths) == sorted(a for o in outputs for a in o["accept_lengths"])
    assert 3 in accept_lengths and min(accept_lengths) < 3  # whole trees accepted, and paths cut short
    for line, a in zip(lines, accept_lengths):
        marks = re.findall(r"([+x.>])'t\d+'", line)
        assert marks == ["+"] * (a - 1) + [">"] and "(a tree of 4 drafts)" in line, line
    assert sorted(view.drafted) == [1, 2] and view.drafted[1] == view.drafted[2] == len(lines)
    assert [view.accepted[j] for j in (1, 2)] == [sum(a > j for a in accept_lengths) for j in (1, 2)]


def test_text_view_colours_in_a_terminal():
    out = io.StringIO()
    view = trace.TextView(DigitTokenizer(), out, colour=True)
    view(1, "draft", {"req": 0, "L": 5, "tokens": [7, 8, 9], "tree": False})
    verify = {"req": 0, "kv_rows": (5, 9), "accepted": [7], "bonus": 3, "accept_length": 2, "committed_L": 7}
    view(1, "verify", verify)
    line = out.getvalue()
    for colour, text in (("32", "'t7'"), ("9;31", "'t8'"), ("2", "'t9'"), ("1;36", "'t3'")):
        assert f"\033[{colour}m{text}\033[0m" in line
    assert "+'" not in line and ">'" not in line


@pytest.mark.parametrize(
    "kw,err", [({"trace": 3}, TypeError), ({"trace": True, "assistant": None}, ValueError)]
)
def test_trace_bad_values(tiny_llama_dir, asst_dir, kw, err):
    base = {"assistant": str(asst_dir), "device": "cpu"}
    with pytest.raises(err, match="trace"):
        LLM(str(tiny_llama_dir), **{**base, **kw})
