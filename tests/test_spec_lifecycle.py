"""Frozen-KV MTP lifecycle contract (DESIGN §4, rules 1-6), preemption under speculation, and bad input.

One test (or a small group) per rule; each comment names the production bug it guards (the SGLang issue or
pull request, by number). fp32 on CPU with a tiny random Llama target (conftest's
``tiny_llama_dir``) and a tiny random ``gemma4_assistant`` saved with HF ``save_pretrained``.

Several tests install an *oracle drafter*: ``FrozenKVMTPWorker.draft`` is replaced by one that proposes the
target's own greedy continuation (computed spec-off) as a chain, optionally corrupted from a chosen depth on,
so one verify commits many tokens (rule 5) and rows of one batch accept different counts (rule 6). The oracle
also checks, on every draft, that each row's seed is the request's own last token and that L is its own
committed length.
"""

import copy
import hashlib
from types import SimpleNamespace

import pytest
import torch
from conftest import save_assistant
from helpers import HB, P_DISTINCT, PROMPTS, greedy, install_drafter, make_llm

import nanospec.models.gemma4_assistant as g4
import nanospec.mtp.draft as draft_mod
from nanospec.config import EngineConfig
from nanospec.context import AttnMetadata, attn_metadata
from nanospec.kernels.attention import decode_attention, draft_attention
from nanospec.loader import build_target
from nanospec.model_runner import ModelRunner
from nanospec.mtp.draft import DraftTree, accept, chain_tree, compact_accepted_kv, emitted_tokens, run_draft
from nanospec.mtp.worker import FrozenKVMTPWorker
from nanospec.persistent_batch import PersistentBatch, StepInput
from nanospec.sampling_params import SamplingParams
from nanospec.scheduler import Batch

V, S = 49152, 5  # vocab; draft steps of the oracle tests


@pytest.fixture
def oracle(monkeypatch, reference):
    """``install(wrong_at=None)``: replace the drafter by the reference continuation as a chain.

    ``wrong_at(prompt, n_out) -> j`` makes drafts j.. wrong (so that step accepts j drafts + the bonus).
    """

    def install(wrong_at=None):
        def draft(self, reqs, block_table, seq_lens, num_splits=None, num_steps=None, sampling=None):
            seed = self.persistent_batch.take(reqs)
            assert seed.req_ids == [r.request_id for r in reqs]
            # own, fresh seed per row
            assert seed.bonus_tokens.tolist() == [r.all_token_ids[-1] for r in reqs]
            assert seq_lens.tolist() == [r.num_tokens - 1 for r in reqs]  # own L: all but the bonus in KV
            S = self.num_steps if num_steps is None else num_steps
            rows = []
            for r in reqs:
                n, ref = len(r.output_token_ids), reference(r.prompt_token_ids)
                assert r.output_token_ids == ref[:n]
                d = (ref[n : n + S] + [0] * S)[:S]
                j = S if wrong_at is None else wrong_at(r.prompt_token_ids, n)
                rows.append([t if i < j else (t + 1) % V for i, t in enumerate(d)])
            drafts = torch.tensor(rows, dtype=torch.long).view(len(reqs), S)
            return chain_tree(seed.bonus_tokens, drafts)

        install_drafter(monkeypatch, draft)

    return install


def first_occurrence(ref, k):
    assert ref[k] not in ref[:k], "test setup: pick a position whose token is new"
    return ref[k]


def straddle(tok, ids, i):
    """A short string that starts inside token i's text and is first complete when token i+1 is appended."""
    head, full = tok.decode(ids[: i + 1]), tok.decode(ids[: i + 2])
    b = len(head)
    assert full.startswith(head) and len(full) > b
    s = full[b - 2 : b + 2]
    assert s not in head and len(s) >= 3
    return s


# =============================================================================================== rule 1
# Bug: sglang #27007 (fixed by PR #26859). When every request finished in the same verify, the v1 worker
# skipped the seed step and left the *verify* input in spec_info; merging the next prefill crashed
# (AttributeError, VerifyInput has no merge_batch). Rule: the batch is left with an idle (0-row) StepInput.
@pytest.mark.parametrize("drafter", ["real", "oracle"])
def test_rule1_all_finish_in_one_verify_leaves_idle_input(
    tiny_llama_dir, asst_dir, reference, oracle, drafter
):
    if drafter == "oracle":
        oracle()  # one verify commits 4 tokens; both requests trim inside it
    n_len = 2 if drafter == "real" else 3
    llm = make_llm(tiny_llama_dir, asst_dir, num_steps=3)
    pa, pb, pc = PROMPTS[0], P_DISTINCT, PROMPTS[2]
    ra, rb, rc = reference(pa), reference(pb), reference(pc)
    llm.add_request(pa, greedy(n_len))  # length
    llm.add_request(pb, greedy(20, stop_token_ids=[first_occurrence(rb, n_len - 1)]))  # stop token (EOS-like)
    assert llm.step() == []  # both prefills
    assert llm.persistent_batch.inputs.req_ids == [0, 1]
    done = llm.step()  # one verify: both finish in it
    assert sorted((r.request_id, r.finish_reason) for r in done) == [(0, "length"), (1, "stop")]
    assert [r.output_token_ids for r in sorted(done, key=lambda r: r.request_id)] == [ra[:n_len], rb[:n_len]]
    assert not llm.has_unfinished()
    seeds = llm.persistent_batch.inputs
    assert type(seeds) is StepInput  # never a verify object / tree
    assert len(seeds) == 0 and seeds.req_ids == []
    assert seeds.bonus_tokens.shape == (0,) and seeds.bonus_tokens.dtype == torch.long
    assert seeds.hidden.shape == (0, HB) and seeds.hidden.dtype == torch.float32
    # the next prefill merges into the idle input and generation goes on
    rid = llm.add_request(pc, greedy(12))
    assert llm.step() == []
    seeds = llm.persistent_batch.inputs
    assert seeds.req_ids == [rid] and seeds.bonus_tokens.shape == (1,) and seeds.hidden.shape == (1, HB)
    out = []
    while llm.has_unfinished():
        out += llm.step()
    assert [r.output_token_ids for r in out] == [rc[:12]]
    assert len(llm.persistent_batch) == 0 and llm.persistent_batch.inputs.hidden.shape == (0, HB)


# Same bug family (spec_info filter/merge during batch surgery, brief §4 "filter_batch / merge_batch" and the
# preempt -> re-prefill path): births, takes in any order, releases and re-births over the persistent
# slots keep real shapes [B] / [B, Hb], batch order, and one row per request (a re-prefilled request's new
# seed wins).
def test_rule1_next_input_slots_survive_batch_surgery():
    Hb = 8
    slots = PersistentBatch(6, 4, Hb, "cpu", torch.float32)

    def reqs(ids):
        params = SamplingParams()
        return [
            SimpleNamespace(request_id=r, prefill_len=100 + r, block_table=[], params=params, seed=r)
            for r in ids
        ]

    def born(ids, bonus=None):  # row of request r: bonus 10*r, hidden filled with r, L = 100 + r
        bonus = [10 * r for r in ids] if bonus is None else bonus
        hidden = torch.tensor([[float(r)] * Hb for r in ids]).reshape(len(ids), Hb)
        slots.block_tables(reqs(ids))  # the row its first prefill chunk takes
        slots.on_prefill_done(reqs(ids), torch.tensor(bonus, dtype=torch.long), hidden)

    def release(ids, reason):
        for r in reqs(ids):
            slots.release(r, reason)

    def check(x, ids):
        assert type(x) is StepInput and x.req_ids == list(ids)
        assert x.bonus_tokens.shape == (len(ids),) and x.hidden.shape == (len(ids), Hb)
        assert x.bonus_tokens.dtype == torch.long and x.hidden.dtype == torch.float32
        assert x.bonus_tokens.tolist() == [10 * r for r in ids]
        assert x.hidden.tolist() == [[float(r)] * Hb for r in ids]
        assert x.num_computed_tokens.dtype == torch.int32 and x.num_computed_tokens.tolist() == [
            100 + r for r in ids
        ]

    check(slots.inputs, [])  # idle: real 0-row shapes
    check(slots.take([]), [])
    born([5, 6])
    born([1, 2, 3])
    check(slots.inputs, [5, 6, 1, 2, 3])
    check(slots.take(reqs([6, 2])), [6, 2])  # batch order
    release([5, 9], "finished")  # unknown ids skipped
    check(slots.inputs, [6, 1, 2, 3])
    with pytest.raises(RuntimeError, match="no next input"):
        slots.take(reqs([5]))
    # a step replaces its rows only
    rows = slots.take(reqs([3, 1]))
    slots.advance(
        StepInput(rows.req_ids, rows.bonus_tokens + 1, rows.hidden * 2, rows.num_computed_tokens + 4)
    )
    assert slots.take(reqs([1, 2, 3])).bonus_tokens.tolist() == [11, 20, 31]
    assert slots.take(reqs([1, 2, 3])).num_computed_tokens.tolist() == [105, 102, 107]
    # preempt -> re-prefill: request 2's new seed replaces its old row, no duplicate
    release([2], "preempted")
    born([2], bonus=[99])
    assert len(slots) == 4 and slots.take(reqs([2])).bonus_tokens.tolist() == [99]
    born([7, 8])
    with pytest.raises(AssertionError, match="max_num_seqs"):
        born([4])  # more running requests than max_num_seqs
    release([6, 1, 2, 3, 7, 8], "finished")
    assert not slots.row and sorted(slots.free) == list(range(6))
    check(slots.inputs, [])


# =============================================================================================== rule 2
# Bug: sglang #29021 -> #29616. FrozenKVMTPDraftWorker.__init__ read the target's memory pool, so the target
# pool had to be allocated before the draft worker existed (a scheduler special case, KV sizing outside
# load -> profile -> allocate). Rule: construct (no pool) -> allocate the target pool -> bind views into it;
# the drafter allocates no KV of its own.
def test_rule2_construct_then_allocate_then_bind(tiny_llama_dir, asst_dir, target_cfg, monkeypatch):
    cpu, f32 = torch.device("cpu"), torch.float32
    cfg = EngineConfig(
        device="cpu",
        dtype="float32",
        assistant=str(asst_dir),
        num_steps=2,
        max_model_len=64,
        num_kv_blocks=12,
        page_size=8,
    )
    target = build_target(target_cfg, cpu, f32, 128, tiny_llama_dir)
    assert all(layer.self_attn.k_cache is None for layer in target.layers)  # no pool anywhere
    persistent_batch = PersistentBatch(4, 8, HB, cpu, f32)
    worker = FrozenKVMTPWorker(cfg, target, asst_dir, persistent_batch)  # no pool needed
    assert worker.assistant._kv is None and len(persistent_batch) == 0
    md = AttnMetadata.draft(torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32))
    with attn_metadata(md), pytest.raises(RuntimeError):  # forward before bind
        worker.assistant(torch.tensor([1]), torch.zeros(1, HB), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="allocate"):  # bind before the pool exists
        worker.bind([])

    events = []
    orig_init, orig_alloc, orig_bind = (
        FrozenKVMTPWorker.__init__,
        ModelRunner.allocate_kv_cache,
        FrozenKVMTPWorker.bind,
    )

    def rec(name, fn):
        def wrapped(self, *a, **k):
            events.append(name)
            return fn(self, *a, **k)

        return wrapped

    monkeypatch.setattr(FrozenKVMTPWorker, "__init__", rec("construct", orig_init))
    monkeypatch.setattr(ModelRunner, "allocate_kv_cache", rec("allocate", orig_alloc))
    monkeypatch.setattr(FrozenKVMTPWorker, "bind", rec("bind", orig_bind))
    llm = make_llm(tiny_llama_dir, asst_dir, num_steps=2, max_model_len=64, num_kv_blocks=12, page_size=8)
    assert events == ["construct", "allocate", "bind"]

    runner = llm.runner
    pool, tgt, a = runner.kv_pools[0], runner.model, llm.worker.assistant
    n_layers = target_cfg.num_hidden_layers
    assert pool.shape[:3] == (n_layers, 2, 12)  # the pool holds the target's layers only
    assert a.layer_map(tgt.kv_layer_types) == [n_layers - 1] * len(a.model.layers) == [1, 1]
    assert len(a._kv) == len(a.model.layers)
    base = pool.untyped_storage().data_ptr()
    lo, hi = pool.data_ptr(), pool.data_ptr() + pool.numel() * pool.element_size()
    for k, v in a._kv:  # views into the target pool at the mapped (last) layer
        assert k.untyped_storage().data_ptr() == base and v.untyped_storage().data_ptr() == base
        assert lo <= k.data_ptr() < hi and lo <= v.data_ptr() < hi
        assert k.data_ptr() == pool[n_layers - 1, 0].data_ptr() == tgt.layers[-1].self_attn.k_cache.data_ptr()
        assert v.data_ptr() == pool[n_layers - 1, 1].data_ptr() == tgt.layers[-1].self_attn.v_cache.data_ptr()
        assert k.shape == pool.shape[2:] and v.shape == pool.shape[2:]
    # no KV of its own: no module of the drafter holds a cache, and every non-parameter tensor it references
    # is the target's (pool views, RoPE table, embedding / LM head)
    target_ptrs = {t.untyped_storage().data_ptr() for t in [*tgt.parameters(), tgt.cos_sin, pool]}
    params = {id(p) for p in a.parameters()}
    seen = []

    def walk(x, depth=0):
        if isinstance(x, torch.Tensor):
            if id(x) not in params:
                seen.append(x)
        elif isinstance(x, (list, tuple)) and depth < 4:
            for y in x:
                walk(y, depth + 1)

    for m in a.modules():
        assert getattr(m, "k_cache", None) is None and getattr(m, "v_cache", None) is None
        assert not list(m.buffers(recurse=False))
        for val in vars(m).values():
            walk(val)
    assert len(seen) >= 2 * len(a.model.layers)
    assert all(t.untyped_storage().data_ptr() in target_ptrs for t in seen)


# =============================================================================================== rule 3
# Bug: sglang #28264 (PR #28817, folded into #29616). The eager draft path (num_steps 1, no graph) reused the
# prefill's out_cache_loc: "output with shape [1] doesn't match the broadcast shape [276]" on the first decode
# after a 276-token prompt. Rule: a draft forward carries no write slots and never changes the target pool.
def _pool_digest(kv):
    return kv.abs().sum().item(), hashlib.sha256(kv.contiguous().numpy().tobytes()).hexdigest()


@pytest.fixture
def record_draft_metadata(monkeypatch):
    """Every AttnMetadata the assistant reads, and every one run_draft opens."""
    seen = {"assistant": [], "run_draft": []}
    orig_get, orig_ctx = g4.get_attn_metadata, draft_mod.attn_metadata

    def get():
        md = orig_get()
        seen["assistant"].append(md)
        return md

    def ctx(md):
        seen["run_draft"].append(md)
        return orig_ctx(md)

    monkeypatch.setattr(g4, "get_attn_metadata", get)
    monkeypatch.setattr(draft_mod, "attn_metadata", ctx)
    return seen


@pytest.mark.parametrize("topk,n_draft", [(1, None), (3, 6)])
def test_rule3_draft_writes_no_kv(tiny_llama_dir, asst_dir, record_draft_metadata, topk, n_draft):
    llm = make_llm(
        tiny_llama_dir,
        asst_dir,
        num_steps=3,
        topk=topk,
        num_draft_tokens=n_draft,
        page_size=4,
        num_kv_blocks=40,
    )
    for p in PROMPTS[:3]:
        llm.add_request(p, greedy(10))
    llm.step()  # prefill (leaves a prefill slot_mapping behind as the last forward's metadata)
    llm.step()  # one verify
    reqs = list(llm.scheduler.running)
    for r in reqs:  # reserve the verify rows as the scheduler does, so garbage rows beyond L exist too
        llm.runner.allocator.allocate(r, r.num_computed_tokens + llm.runner.lookahead)
    worker, kv = llm.worker, llm.runner.kv_pools[0]
    for v in record_draft_metadata.values():
        v.clear()
    before = _pool_digest(kv)
    L = torch.tensor([r.num_computed_tokens for r in reqs], dtype=torch.int32)
    tree = worker.draft(llm.persistent_batch.take(reqs), llm.persistent_batch.block_tables(reqs), L)
    assert _pool_digest(kv) == before
    assert tree.tokens.shape == (len(reqs), llm.config.num_draft_tokens)
    mds = record_draft_metadata["assistant"]
    assert len(mds) == 3 and record_draft_metadata["run_draft"]
    for md in mds + record_draft_metadata["run_draft"]:
        assert md.mode == "draft" and md.slot_mapping is None
        assert md.seq_lens.tolist() == L.tolist()  # attends exactly rows [0, L)


def test_rule3_write_slots_make_the_assistant_raise(tiny_llama_dir, asst_dir):
    llm = make_llm(tiny_llama_dir, asst_dir, num_steps=1)
    llm.add_request(PROMPTS[1], greedy(4))
    llm.step()
    a, (r,) = llm.worker.assistant, llm.scheduler.running
    bt, L = llm.persistent_batch.block_tables([r]), torch.tensor([r.num_computed_tokens], dtype=torch.int32)
    args = (torch.tensor([r.all_token_ids[-1]]), torch.zeros(1, HB), L.long() - 1)
    kv = llm.runner.kv_pools[0]
    before = _pool_digest(kv)
    # no named constructor builds draft metadata with write slots: force one to see the assistant refuse it
    with attn_metadata(AttnMetadata("draft", bt, L, slot_mapping=torch.arange(len(r.prompt_token_ids)))):
        with pytest.raises(RuntimeError, match="slot_mapping"):
            a(*args)
    with attn_metadata(
        AttnMetadata.prefill(bt, L, torch.arange(7), torch.tensor([0, 7], dtype=torch.int32), 7)
    ):
        with pytest.raises(RuntimeError, match="draft"):
            a(*args)
    with attn_metadata(AttnMetadata.draft(bt, L)):
        logits, h = a(*args)
    assert logits.shape == (1, V) and h.shape == (1, HB)
    assert _pool_digest(kv) == before


def test_rule3_long_prompt_num_steps_1(tiny_llama_dir, asst_dir, record_draft_metadata, monkeypatch):
    g = torch.Generator().manual_seed(276)
    prompt = torch.randint(3, V, (276,), generator=g).tolist()
    kw = dict(max_model_len=300, num_kv_blocks=48)
    ref = make_llm(tiny_llama_dir, **kw).generate([prompt], greedy(8), use_tqdm=False)[0]["token_ids"]
    llm = make_llm(tiny_llama_dir, asst_dir, num_steps=1, **kw)
    digests, orig = [], FrozenKVMTPWorker.draft

    def checked(self, inp, bt, L, num_splits=None, num_steps=None, sampling=None, masks=None):
        before = _pool_digest(llm.runner.kv_pools[0])  # pool checksum around every draft
        out = orig(self, inp, bt, L, num_splits, num_steps, sampling, masks)
        digests.append(before == _pool_digest(llm.runner.kv_pools[0]))
        return out

    monkeypatch.setattr(FrozenKVMTPWorker, "draft", checked)
    out = llm.generate([prompt], greedy(8), use_tqdm=False)[0]
    assert out["token_ids"] == ref
    assert len(digests) == len(out["accept_lengths"]) >= 4 and all(digests)
    mds = record_draft_metadata["assistant"]
    assert mds and all(md.mode == "draft" and md.slot_mapping is None for md in mds)


# =============================================================================================== rule 4
# Bug: sglang #33892. A DP rank with no requests still stepped in a non-IDLE mode and the frozen-KV metadata
# init took seq_lens.max() of an empty tensor ("max(): Expected reduction dim to be specified for
# input.numel() == 0"). Rule: a step with zero rows returns cleanly; no max()/cumsum over empty tensors
# anywhere on the path.
def test_rule4_zero_row_step_engine(tiny_llama_dir, asst_dir):
    llm = make_llm(tiny_llama_dir, asst_dir, num_steps=3)
    assert llm.step() == [] and not llm.has_unfinished()
    assert llm.worker.step([], None).tokens == [] and llm.runner.decode([], llm.persistent_batch).tokens == []
    assert llm.runner.prefill(Batch("prefill", []), llm.persistent_batch).tokens == []
    assert len(llm.persistent_batch) == 0
    llm.add_request(PROMPTS[0], greedy(5))
    out = []
    while llm.has_unfinished():
        out += llm.step()
    assert len(out[0].output_token_ids) == 5
    assert llm.step() == []


@pytest.mark.parametrize("topk,n_draft", [(1, 4), (3, 6)])
def test_rule4_zero_row_draft_and_accept(tiny_llama_dir, asst_dir, topk, n_draft):
    llm = make_llm(
        tiny_llama_dir, asst_dir, num_steps=3, topk=topk, num_draft_tokens=n_draft if topk > 1 else None
    )
    worker, kv = llm.worker, llm.runner.kv_pools[0]
    idle = StepInput(
        [], torch.zeros(0, dtype=torch.long), torch.zeros(0, HB), torch.zeros(0, dtype=torch.int32)
    )
    bt0, L0 = torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    tree = run_draft(worker.assistant, idle, bt0, L0, 3, topk, n_draft)
    assert (
        tree.tokens.shape == (0, n_draft)
        and tree.parents.shape == (0, n_draft)
        and tree.depth.shape == (0, n_draft)
    )
    assert tree.is_chain == (topk == 1)
    if topk > 1:
        assert tree.tree_mask.shape == (0, n_draft, n_draft)
    assert worker.draft(idle, llm.persistent_batch.block_tables([]), L0).tokens.shape == (0, n_draft)
    path, acc, bonus = accept(tree, torch.zeros(0, n_draft, dtype=torch.long), 3)
    assert path.shape[0] == 0 and acc.shape == (0,) and bonus.shape == (0,)
    assert emitted_tokens(tree, path, acc, bonus).shape[0] == 0
    before = _pool_digest(kv)
    compact_accepted_kv(
        [kv], bt0, L0, torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, dtype=torch.long), 16
    )
    assert _pool_digest(kv) == before


def test_rule4_empty_attention_metadata_no_max(tiny_llama_dir, asst_dir):
    llm = make_llm(tiny_llama_dir, asst_dir, num_steps=2)
    k, v = llm.runner.kv_pools[0][-1, 0], llm.runner.kv_pools[0][-1, 1]
    q = torch.zeros(0, 4, 16)
    bt0, L0 = torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    assert draft_attention(q, k, v, bt0, L0, None).shape == (0, 4, 16)
    assert draft_attention(q, k, v, bt0, L0, torch.zeros(0, dtype=torch.int32)).shape == (0, 4, 16)
    assert decode_attention(q, k, v, bt0, L0, 0.25).shape == (0, 4, 16)
    with attn_metadata(AttnMetadata.draft(bt0, L0)):  # a draft forward with 0 rows
        logits, h = llm.worker.assistant(
            torch.zeros(0, dtype=torch.long), torch.zeros(0, HB), torch.zeros(0, dtype=torch.long)
        )
    assert logits.shape == (0, V) and h.shape == (0, HB)


# =============================================================================================== rule 5
# Bugs: sglang #23802 + #25980 (follow-ups #27637, #28802, #30291/#31569/#33758). With multi-token commits the
# stop check looked at a fixed tail window / only the end of the run, emitted tokens past the stop, checked
# EOS before the stop string, and let the max_new_tokens check mask an in-run stop. Rule: every token of a
# commit is checked in order, stop string > stop token > length, cut at the first stop, `>=` length test,
# bonus never dropped.
@pytest.mark.parametrize("drafter", ["real", "oracle"])
def test_rule5_max_tokens_exact(tiny_llama_dir, asst_dir, reference, oracle, drafter):
    if drafter == "oracle":
        oracle()  # every verify accepts all S drafts + the bonus = 6 tokens
    llm = make_llm(tiny_llama_dir, asst_dir, num_steps=S)
    prompt = PROMPTS[1]
    ref = reference(prompt)
    for n in (1, 2, 3, 13):
        out = llm.generate([prompt], greedy(n), use_tqdm=False)[0]
        assert out["token_ids"] == ref[:n] and out["finish_reason"] == "length"
        acc = out["accept_lengths"]
        assert 1 + sum(acc) >= n
        if drafter == "oracle":
            assert acc == {1: [], 2: [S + 1], 3: [S + 1], 13: [S + 1, S + 1]}[n]
            assert (1 + sum(acc) == n) == (n in (1, 13))  # equality iff nothing was trimmed
        else:
            assert 1 + sum(acc) == n  # the random drafter commits one token per verify: nothing trimmed


def test_rule5_stop_token_inside_commit(tiny_llama_dir, asst_dir, reference, oracle):
    oracle()
    llm = make_llm(tiny_llama_dir, asst_dir, num_steps=S)
    ref = reference(P_DISTINCT)
    for k in (1, 3, 6, 8):  # first, middle, last token of commit 1 (tokens 1..6); inside commit 2
        out = llm.generate(
            [P_DISTINCT], greedy(40, stop_token_ids=[first_occurrence(ref, k)]), use_tqdm=False
        )[0]
        assert out["token_ids"] == ref[: k + 1] and out["finish_reason"] == "stop"
        assert out["accept_lengths"] == [S + 1] * (1 if k <= S + 1 else 2)
        assert 1 + sum(out["accept_lengths"]) >= k + 1


def test_rule5_stop_strings(tiny_llama_dir, asst_dir, reference, oracle):
    oracle()
    llm = make_llm(tiny_llama_dir, asst_dir, num_steps=S)
    tok, ref = llm.tokenizer, reference(P_DISTINCT)

    def run(**kw):
        return llm.generate([P_DISTINCT], greedy(**{"max_tokens": 40, **kw}), use_tqdm=False)[0]

    def text_cut(i, s):  # decoded ref[:i+1], cut before the first occurrence of s
        t = tok.decode(ref[: i + 1])
        return t[: t.index(s)]

    # inside one commit, far from its end: completes at token 2 of the 6-token commit 1..6
    s = straddle(tok, ref, 1)
    out = run(stop=[s])
    assert out["token_ids"] == ref[:3] and out["finish_reason"] == "stop" and out["text"] == text_cut(2, s)
    assert out["accept_lengths"] == [S + 1]
    # spanning two commits: starts in token 6 (end of commit 1), completes at token 7 (start of commit 2)
    s = straddle(tok, ref, 6)
    out = run(stop=["never-appears", s])
    assert out["token_ids"] == ref[:8] and out["finish_reason"] == "stop" and out["text"] == text_cut(7, s)
    assert out["accept_lengths"] == [S + 1, S + 1]


def test_rule5_precedence(tiny_llama_dir, asst_dir, reference, oracle):
    oracle()
    llm = make_llm(tiny_llama_dir, asst_dir, num_steps=S)
    tok, ref = llm.tokenizer, reference(P_DISTINCT)
    k = 3  # token 3 completes a stop string, is a stop token and reaches max_tokens, all inside commit 1
    s, t3 = straddle(tok, ref, k - 1), first_occurrence(ref, k)
    full = tok.decode(ref[: k + 1])
    cut = full[: full.index(s)]

    def run(**kw):
        return llm.generate([P_DISTINCT], greedy(**{"max_tokens": 40, **kw}), use_tqdm=False)[0]

    out = run(stop=[s], stop_token_ids=[t3], max_tokens=k + 1)  # stop string wins: text cut before it
    assert (out["token_ids"], out["finish_reason"], out["text"]) == (ref[: k + 1], "stop", cut)
    out = run(stop_token_ids=[t3], max_tokens=k + 1)  # stop token beats length
    assert (out["token_ids"], out["finish_reason"], out["text"]) == (ref[: k + 1], "stop", full)
    out = run(max_tokens=k + 1)
    assert (out["token_ids"], out["finish_reason"], out["text"]) == (ref[: k + 1], "length", full)
    # the first stop in the commit wins whatever its kind
    # token 2 < string at 4
    out = run(stop=[straddle(tok, ref, 3)], stop_token_ids=[first_occurrence(ref, 2)])
    assert (out["token_ids"], out["finish_reason"], out["text"]) == (ref[:3], "stop", tok.decode(ref[:3]))
    s1 = straddle(tok, ref, 1)  # completes at token 2, before the stop token at 4
    out = run(stop=[s1], stop_token_ids=[first_occurrence(ref, 4)], max_tokens=5)
    t = tok.decode(ref[:3])
    assert (out["token_ids"], out["finish_reason"], out["text"]) == (ref[:3], "stop", t[: t.index(s1)])
    assert out["accept_lengths"] == [S + 1]


# =============================================================================================== rule 6
# Bug class: per-request state shared across a batch (one L / accept length for all rows). Rule: rows
# accepting different counts keep their own L; greedy output of each request is identical batched (mixed
# lengths) or alone.
def _wrong_at(prompt, n):  # deterministic per (request, progress): rows of a batch accept different counts
    return ((len(prompt) * 131 + n * 31) * 2654435761 >> 11) % (S + 1)


def test_rule6_rows_independent(tiny_llama_dir, asst_dir, reference, oracle):
    oracle(_wrong_at)
    llm = make_llm(tiny_llama_dir, asst_dir, num_steps=S)
    params = [greedy(n) for n in (20, 25, 14, 30)]
    batched = llm.generate(PROMPTS, params, use_tqdm=False)
    alone = [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(PROMPTS, params)]
    for p, sp, b, a in zip(PROMPTS, params, batched, alone):
        assert b["token_ids"] == a["token_ids"] == reference(p)[: sp.max_tokens]
        assert b["accept_lengths"] == a["accept_lengths"]
    firsts = [b["accept_lengths"][0] for b in batched]
    assert len(set(firsts)) == len(firsts)  # rows accepted different counts in the same verify
    assert all(len(set(b["accept_lengths"])) > 1 for b in batched), [b["accept_lengths"] for b in batched]
    assert len(llm.persistent_batch) == 0 and llm.runner.allocator.num_free == llm.runner.allocator.num_usable


def test_rule6_rows_independent_tree(tiny_llama_dir, asst_dir, reference, monkeypatch):
    """topk 2 (S 2, N 5): rows of one verify take different tree paths (0->2->4, 0->2->3, or nothing
    accepted), each moving different K/V rows (tree index -> depth) at its own L: compact_accepted_kv must
    act per row."""
    m = torch.zeros(5, 5, dtype=torch.bool)
    for i, anc in enumerate([[0], [0, 1], [0, 2], [0, 2, 3], [0, 2, 4]]):
        m[i, anc] = True

    def draft(self, reqs, block_table, seq_lens, num_splits=None, num_steps=None, sampling=None):
        seed = self.persistent_batch.take(reqs)
        assert seed.bonus_tokens.tolist() == [r.all_token_ids[-1] for r in reqs]
        rows = []
        for r in reqs:
            n = len(r.output_token_ids)
            d1, d2 = (reference(r.prompt_token_ids) + [0, 0])[n : n + 2]
            w1, w2 = (d1 + 1) % V, (d2 + 1) % V
            rows.append(
                [[w1, d1, w2, d2], [w1, d1, d2, w2], [w1, w1, d2, d2]][_wrong_at(r.prompt_token_ids, n) % 3]
            )
        B = len(reqs)
        tokens = torch.cat([seed.bonus_tokens[:, None], torch.tensor(rows, dtype=torch.long).view(B, 4)], 1)
        return DraftTree(
            tokens,
            torch.tensor([-1, 0, 0, 2, 2]).expand(B, 5).clone(),
            torch.tensor([0, 1, 1, 2, 2]).expand(B, 5).clone(),
            m.expand(B, 5, 5).clone(),
        )

    install_drafter(monkeypatch, draft)
    llm = make_llm(tiny_llama_dir, asst_dir, num_steps=2, topk=2, num_draft_tokens=5, page_size=4)
    params = [greedy(n) for n in (20, 25, 14, 30)]
    batched = llm.generate(PROMPTS, params, use_tqdm=False)
    alone = [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(PROMPTS, params)]
    for p, sp, b, a in zip(PROMPTS, params, batched, alone):
        assert b["token_ids"] == a["token_ids"] == reference(p)[: sp.max_tokens]
        assert b["accept_lengths"] == a["accept_lengths"] and set(b["accept_lengths"]) <= {1, 3}
    assert sum(3 in b["accept_lengths"] for b in batched) >= 3 and any(
        1 in b["accept_lengths"] for b in batched
    )


# =============================================================================================== preemption
# Preemption by recompute keeps working under speculation: lookahead N rows are reserved per decode, a
# preempted request's blocks (rejected tail included) are freed, its re-prefill seed replaces the stale one
# (the oracle asserts every seed is fresh), and the output equals spec-off greedy.
def test_preemption_with_speculation(tiny_llama_dir, asst_dir, reference, oracle):
    oracle(_wrong_at)
    llm = make_llm(tiny_llama_dir, asst_dir, num_steps=3, page_size=4, max_model_len=64, num_kv_blocks=19)
    params = [greedy(n) for n in (30, 26, 34, 22)]
    prompts = [p[:12] for p in PROMPTS]
    refs = [reference(p) for p in prompts]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0
    for ref, sp, o in zip(refs, params, outs):
        assert o["token_ids"] == ref[: sp.max_tokens] and o["finish_reason"] == "length"
        # a resumed request re-prefills all but its last token and emits nothing, so every token after the
        # first still comes from a verify step
        assert 1 + sum(o["accept_lengths"]) >= len(o["token_ids"])
    alloc = llm.runner.allocator
    assert alloc.num_free == alloc.num_usable
    assert len(llm.persistent_batch) == 0 and llm.persistent_batch.inputs.hidden.shape == (0, HB)
    assert not llm.has_unfinished()


# =============================================================================================== bad input
@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if the engine allocates its KV pool (config errors must come before building models)."""

    def boom(*a, **k):
        raise AssertionError("work started before validation")

    monkeypatch.setattr(ModelRunner, "allocate_kv_cache", boom)
    return monkeypatch


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(num_steps=0), "num_steps"),
        (dict(topk=0), "topk"),
        (dict(num_steps=2, num_draft_tokens=1), "num_draft_tokens"),
        (dict(num_steps=2, topk=2, num_draft_tokens=6), "num_draft_tokens"),  # > 1 + S*k = 5
        (dict(num_steps=2, topk=2), "num_draft_tokens"),  # topk > 1 needs N
        (dict(num_steps=3, topk=1, num_draft_tokens=3), "num_draft_tokens"),  # topk 1 needs N = S + 1
    ],
)
def test_bad_spec_options(tiny_llama_dir, asst_dir, no_work, kw, field):
    no_work.setattr("nanospec.loader.build_target", lambda *a, **k: pytest.fail("built a model"))
    with pytest.raises(
        ValueError, match=rf"^(with topk=1, )?{field} must"
    ):  # the message starts with the field
        make_llm(tiny_llama_dir, asst_dir, **kw)


def test_bad_assistant_dirs(tiny_llama_dir, target_cfg, tmp_path, no_work):
    with pytest.raises(ValueError, match="model_type"):  # another architecture (a Llama dir)
        make_llm(tiny_llama_dir, tiny_llama_dir)
    cfg = copy.deepcopy(target_cfg)
    cfg.vocab_size = 1000
    with pytest.raises(ValueError, match="vocab_size"):
        make_llm(tiny_llama_dir, save_assistant(tmp_path / "vocab", cfg))
    cfg = copy.deepcopy(target_cfg)
    cfg.head_dim = 8
    with pytest.raises(ValueError, match="head_dim"):
        make_llm(tiny_llama_dir, save_assistant(tmp_path / "geom", cfg))
    with pytest.raises(ValueError, match="default"):
        make_llm(tiny_llama_dir, "default")
    with pytest.raises(ValueError, match="assistant"):
        make_llm(tiny_llama_dir, tmp_path / "does-not-exist")
