"""Scheduler, block allocator, request finish rules and sampling reproducibility (CPU, fp32, a micro random
Llama with a 512-token vocabulary: prompts are token-id lists)."""

import pytest
import torch

from nanospec import LLM, SamplingParams
from nanospec.kv_cache import DUMMY_BLOCK, BlockAllocator, slot_mapping
from nanospec.persistent_batch import PersistentBatch
from nanospec.request import Request, Status

PAGE = 4


def _engine(model_dir, **kw):
    opts = dict(dtype="float32", device="cpu", page_size=PAGE, max_model_len=48, max_num_seqs=8)
    return LLM(str(model_dir), **{**opts, **kw})


def _prompts(n, lens, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (lens[i % len(lens)],), generator=g).tolist() for i in range(n)]


def _drive(llm, prompts, params, max_steps=2000):
    """add_request + step() until done, with a step bound so that a scheduler deadlock fails, not hangs."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    for _ in range(max_steps):
        for r in llm.step():
            done[r.request_id] = llm.output_dict(r)
        if not llm.has_unfinished():
            break
    else:
        pytest.fail(
            f"engine made no progress: {len(done)}/{len(ids)} done after {max_steps} steps, "
            f"waiting={len(llm.scheduler.waiting)} running={len(llm.scheduler.running)} "
            f"free={llm.runner.allocator.num_free}/{llm.runner.allocator.num_usable}"
        )
    return [done[i] for i in ids]


def _all_free(llm):
    """Every block is free or cached-and-free, no block is held (ref counts 0), no block is listed twice."""
    a = llm.runner.allocator
    free = sorted([*a.free_blocks, *a.evictable])
    return a.num_free == a.num_usable and free == list(range(1, a.num_blocks)) and not any(a.ref_count)


GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(micro_llama_dir):
    """Greedy outputs of 5 prompts with a big pool and no chunking."""
    prompts = _prompts(5, (9, 13, 7, 22, 11))
    llm = _engine(micro_llama_dir)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.scheduler.num_preemptions == 0 and _all_free(llm)
    return prompts, [o["token_ids"] for o in outs]


# ------------------------------------------------------------------------------------------ engine behaviour
def test_preemption_by_recompute_keeps_greedy_output(micro_llama_dir, reference):
    prompts, ref = reference
    # one request needs ceil((48 + 1) / 4) = 13 blocks;
    # 14 usable blocks cannot hold 5 requests of up to 38 tokens
    llm = _engine(micro_llama_dir, num_kv_blocks=14)
    assert llm.runner.allocator.num_usable == 13
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0
    assert [o["token_ids"] for o in outs] == ref
    assert all(o["finish_reason"] == "length" and len(o["token_ids"]) == 16 for o in outs)
    assert [o["prompt_token_ids"] for o in outs] == prompts
    assert _all_free(llm) and not llm.scheduler.waiting and not llm.scheduler.running


def test_chunked_prefill_equals_unchunked(micro_llama_dir, reference):
    prompts, ref = reference
    llm = _engine(micro_llama_dir, max_num_batched_tokens=5)
    steps = []
    orig = llm.scheduler.schedule

    def spy():
        b = orig()
        if b is not None and b.kind == "prefill":
            steps.append(list(b.num_new))
        return b

    llm.scheduler.schedule = spy
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == ref
    total = sum(map(len, prompts))
    assert max(map(sum, steps)) == 5 and sum(map(sum, steps)) == total and len(steps) == -(-total // 5)
    assert min(map(len, prompts)) > 5  # so every prompt really was split
    assert _all_free(llm)


def test_chunked_prefill_under_preemption_makes_progress(micro_llama_dir, reference):
    """Chunked prompts and a pool so small that decode must preempt while a prompt is half prefilled: the
    engine never stalls (a half-prefilled request that holds blocks must not starve requests queued ahead)."""
    prompts, ref = reference
    llm = _engine(micro_llama_dir, num_kv_blocks=14, max_num_batched_tokens=6)
    outs = _drive(llm, prompts, GREEDY)
    assert [o["token_ids"] for o in outs] == ref
    assert llm.scheduler.num_preemptions > 0 and _all_free(llm)


def test_long_prompt_and_long_generation_contend(micro_llama_dir):
    """A long generation decodes while a long chunked prompt arrives, in a pool that fits only one of them."""
    llm_ref = _engine(micro_llama_dir)
    prompts = _prompts(2, (8, 36), seed=3)
    params = [SamplingParams(max_tokens=38, ignore_eos=True), SamplingParams(max_tokens=8, ignore_eos=True)]
    ref = [o["token_ids"] for o in llm_ref.generate(prompts, params, use_tqdm=False)]
    llm = _engine(micro_llama_dir, num_kv_blocks=14, max_num_batched_tokens=8)
    assert [o["token_ids"] for o in _drive(llm, prompts, params)] == ref
    assert _all_free(llm)


def test_batched_equals_alone_greedy(micro_llama_dir, reference):
    """DESIGN §4 rule 6: a request's greedy output does not depend on its batch."""
    prompts, ref = reference
    llm = _engine(micro_llama_dir)
    for p, r in zip(prompts[:2], ref[:2]):
        assert llm.generate([p], GREEDY, use_tqdm=False)[0]["token_ids"] == r


def test_max_num_seqs_caps_the_running_batch(micro_llama_dir, reference):
    prompts, ref = reference
    llm = _engine(micro_llama_dir, max_num_seqs=2)
    sizes = []
    orig = llm.scheduler.schedule
    llm.scheduler.schedule = lambda: (b := orig(), sizes.append(len(b.reqs) if b else 0))[0]
    assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == ref
    assert max(sizes) == 2 and _all_free(llm)


def test_empty_step_returns_nothing(micro_llama_dir):
    """DESIGN §4 rule 4: a step with no requests never reaches attention metadata and returns []."""
    llm = _engine(micro_llama_dir)
    llm.runner.model.forward = lambda *a, **k: pytest.fail("an empty step ran the model")
    assert llm.step() == [] and llm.step() == []
    assert llm.scheduler.schedule() is None and not llm.has_unfinished()
    assert llm.generate([], GREEDY, use_tqdm=False) == []
    assert _all_free(llm)


def test_step_after_finish_is_empty(micro_llama_dir):
    llm = _engine(micro_llama_dir)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0]["token_ids"]) == 2
    assert llm.step() == [] and _all_free(llm)


def test_generate_keeps_requests_it_does_not_own(micro_llama_dir):
    """A request queued by add_request() that finishes inside generate() is handed out by the next step()."""
    llm = _engine(micro_llama_dir)
    rid = llm.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    out = llm.generate([[4, 5, 6]], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(out[0]["token_ids"]) == 6
    got = llm.step()
    assert [(r.request_id, len(r.output_token_ids)) for r in got] == [(rid, 3)]
    assert llm.step() == [] and _all_free(llm)


# ------------------------------------------------------------------------------------------ sampling seeds
SEEDED = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=10, ignore_eos=True, seed=1234)


def test_seeded_sampling_is_batch_independent(micro_llama_dir):
    prompt = _prompts(1, (11,), seed=7)[0]
    others = _prompts(3, (6, 19, 9), seed=8)
    alone = _engine(micro_llama_dir, seed=0).generate([prompt], SEEDED, use_tqdm=False)[0]["token_ids"]
    mix = [
        SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True),
        GREEDY,
        SamplingParams(temperature=0.7, top_p=0.5, max_tokens=12, ignore_eos=True, seed=9),
    ]
    outs = _engine(micro_llama_dir, seed=5).generate(
        [others[0], prompt, others[1], others[2]], [mix[0], SEEDED, mix[1], mix[2]], use_tqdm=False
    )
    assert outs[1]["token_ids"] == alone
    # ... and under preemption / chunking, where the request is recomputed and sampled in a prefill step
    small = _engine(micro_llama_dir, seed=6, num_kv_blocks=14, max_num_batched_tokens=6)
    outs2 = _drive(small, [others[0], prompt, others[1], others[2]], [mix[0], SEEDED, mix[1], mix[2]])
    assert outs2[1]["token_ids"] == alone
    # a different seed samples something else (the distribution is broad: 10 draws out of top-50)
    other_seed = SamplingParams(**{**SEEDED.__dict__, "seed": 4321})
    assert _engine(micro_llama_dir).generate([prompt], other_seed, use_tqdm=False)[0]["token_ids"] != alone


def test_unseeded_sampling_follows_engine_seed(micro_llama_dir):
    prompts = _prompts(3, (5, 8, 12), seed=9)
    sp = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    a = [o["token_ids"] for o in _engine(micro_llama_dir, seed=0).generate(prompts, sp, use_tqdm=False)]
    a2 = [o["token_ids"] for o in _engine(micro_llama_dir, seed=0).generate(prompts, sp, use_tqdm=False)]
    b = [o["token_ids"] for o in _engine(micro_llama_dir, seed=1).generate(prompts, sp, use_tqdm=False)]
    assert a == a2  # same engine seed, same samples
    # 24 draws from a broad distribution over 512 tokens: two seeds agreeing on a whole request is ~impossible
    assert sum(x != y for x, y in zip(a, b)) == 3
    assert len({t for seq in a for t in seq}) > 12  # samples, not an argmax in disguise


# ------------------------------------------------------------------------------------------ block allocator
def _req(n=3, **kw):
    return Request(0, list(range(n)), SamplingParams(**kw), set())


def _slots(reqs, i, start, end, page_size=4):
    width = max(len(r.block_table) for r in reqs)
    bt = torch.tensor([r.block_table + [DUMMY_BLOCK] * (width - len(r.block_table)) for r in reqs])
    return slot_mapping(bt, torch.tensor(i), torch.arange(start, end), page_size).tolist()


def test_allocator_slots_cross_pages():
    a = BlockAllocator(8, 4)
    assert (a.num_usable, a.num_free) == (7, 7)
    r = _req()
    a.allocate(r, 9)  # 9 slots -> 3 blocks
    assert r.block_table == [1, 2, 3] and a.num_free == 4 and DUMMY_BLOCK not in r.block_table
    assert _slots([r], 0, 0, 9) == [4, 5, 6, 7, 8, 9, 10, 11, 12]
    # requests whose blocks interleave: token j maps through the table, not through a contiguous range
    r2, r3 = _req(), _req()
    a.allocate(r2, 1)
    a.allocate(r3, 4)
    a.allocate(r2, 5)
    assert (r2.block_table, r3.block_table) == ([4, 6], [5])
    assert _slots([r2, r3], 0, 2, 6) == [4 * 4 + 2, 4 * 4 + 3, 6 * 4 + 0, 6 * 4 + 1]
    assert _slots([r2, r3], 1, 0, 4) == [20, 21, 22, 23]
    assert _slots([r2, r3], 0, 3, 3) == []


@pytest.mark.parametrize("num_slots, blocks", [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_allocator_exact_block_counts(num_slots, blocks):
    a = BlockAllocator(5, 4)
    r = _req()
    assert a.blocks_needed(r, num_slots) == blocks
    a.allocate(r, num_slots)
    assert len(r.block_table) == blocks and a.num_free == 4 - blocks
    a.allocate(r, num_slots)  # idempotent: already covered
    assert len(r.block_table) == blocks and a.blocks_needed(r, num_slots) == 0
    assert a.blocks_needed(r, (blocks + 1) * 4) == 1 and a.blocks_needed(r, (blocks + 1) * 4 + 1) == 2


def test_allocator_growth_and_failure():
    a = BlockAllocator(4, 2)  # 3 usable blocks = 6 slots
    r1, r2 = _req(), _req()
    a.allocate(r1, 3)
    assert len(r1.block_table) == 2 and a.blocks_needed(r1, 5) == 1
    assert a.blocks_needed(r2, 2) <= a.num_free < a.blocks_needed(r2, 3)
    with pytest.raises(RuntimeError, match="exhausted"):
        a.allocate(r2, 3)
    assert r2.block_table == [] and a.num_free == 1  # a failed allocation takes nothing
    a.allocate(r2, 2)
    assert a.num_free == 0 and a.blocks_needed(r1, 5) > 0
    with pytest.raises(RuntimeError):
        a.allocate(r1, 5)
    a.free(r1)
    a.free(r2)
    assert r1.block_table == r2.block_table == [] and a.num_free == a.num_usable == 3
    assert sorted(a.free_blocks) == [1, 2, 3]
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(1, 4)


def test_block_tables_pad_with_dummy():
    r1, r2 = Request(1, [0], SamplingParams(), set()), Request(2, [0], SamplingParams(), set())
    r1.block_table, r2.block_table = [3, 1, 2], [5]
    tables = PersistentBatch(2, 4, 0, "cpu", torch.float32)
    t = tables.block_tables([r1, r2])
    assert t.dtype == torch.int32 and t.tolist() == [[3, 1, 2], [5, DUMMY_BLOCK, DUMMY_BLOCK]]
    assert tables.block_tables([]).shape == (0, 1)


def test_block_tables_grow_in_place_and_rows_are_reused_clean():
    """A row gains only the blocks its table gained; a released row serves the next request with none of its
    last owner's blocks or sampling parameters; a request takes its row in any batch order."""
    r1, r2 = (Request(i, [0], SamplingParams(), set()) for i in (1, 2))
    r3 = Request(3, [0], SamplingParams(temperature=0.5, top_k=7, top_p=0.9), set())
    r1.seed, r3.seed = 11, 33
    r1.block_table, r2.block_table = [3, 1, 2, 7], [5]
    tables = PersistentBatch(2, 4, 0, "cpu", torch.float32)
    tables.block_tables([r1, r2])
    r2.block_table += [6, 4]
    assert tables.block_tables([r2, r1]).tolist() == [[5, 6, 4, DUMMY_BLOCK], [3, 1, 2, 7]]
    assert [t.tolist() for t in tables.sampling([r1])] == [[0.0], [-1], [1.0], [11]]
    tables.release(r1, "finished")
    r3.block_table = [8]
    assert tables.block_tables([r3]).tolist() == [[8]]
    assert tables.block_table[tables.row[3]].tolist() == [8, DUMMY_BLOCK, DUMMY_BLOCK, DUMMY_BLOCK]
    assert [t.tolist() for t in tables.sampling([r3])] == [[0.5], [7], [pytest.approx(0.9)], [33]]
    with pytest.raises(AssertionError, match="max_num_seqs"):
        tables.block_tables([Request(4, [0], SamplingParams(), set())])
    for r in (r2, r3, r1):  # an unknown id is skipped
        tables.release(r, "finished")
    assert sorted(tables.free) == [0, 1] and not tables.row


# ------------------------------------------------------------------------------------------ finish rules
@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def _request(tok, eos=(), **kw):
    return Request(0, [1, 2, 3], SamplingParams(**kw), set(eos), tok)


def test_finish_stop_token_cuts_a_multi_token_commit(tok):
    r = _request(tok, eos={2}, max_tokens=10)
    assert r.append_tokens([100, 101]) == 2 and not r.is_finished
    assert r.append_tokens([102, 2, 103, 104]) == 2  # cut right after the stop token; it is kept
    assert r.output_token_ids == [100, 101, 102, 2]
    assert (r.finish_reason, r.status) == ("stop", Status.FINISHED)


def test_finish_stop_token_ids_and_ignore_eos(tok):
    r = _request(tok, eos={2}, max_tokens=10, ignore_eos=True, stop_token_ids=[77])
    assert r.append_tokens([2, 5, 2]) == 3 and not r.is_finished  # EOS ignored
    assert r.append_tokens([6, 77, 8]) == 2 and r.finish_reason == "stop"
    assert r.output_token_ids == [2, 5, 2, 6, 77]


def test_finish_length_is_ge_and_keeps_the_last_token(tok):
    r = _request(tok, max_tokens=4)
    assert r.append_tokens([10, 11, 12]) == 3 and not r.is_finished
    assert r.append_tokens([13, 14, 15]) == 1  # the 4th token finishes (>=), the rest are dropped
    assert r.output_token_ids == [10, 11, 12, 13] and r.finish_reason == "length"
    r1 = _request(tok, max_tokens=1)
    assert r1.append_tokens([9]) == 1 and r1.finish_reason == "length"


def test_finish_precedence_on_one_token(tok):
    # the token that reaches max_tokens is also a stop token: "stop" wins over "length"
    r = _request(tok, eos={2}, max_tokens=3)
    assert r.append_tokens([10, 11, 2, 12]) == 3 and r.finish_reason == "stop"
    # a token that completes a stop string and is a stop token at the length limit: the stop string wins
    ids = _ids(tok, "Hello world")
    r = _request(tok, max_tokens=len(ids), stop=["world"], stop_token_ids=[ids[-1]])
    r.append_tokens(ids)
    assert r.finish_reason == "stop" and r.stop_str_index == len("Hello ")
    assert r.output_text() == "Hello "


def test_finish_stop_string_cuts_text_and_tokens(tok):
    ids = _ids(tok, "The answer is 42. Done here and more text follows")
    stop_at = next(i for i in range(len(ids)) if "Done" in tok.decode(ids[: i + 1]))
    r = _request(tok, max_tokens=100, stop=["Done", "never matches"])
    kept = r.append_tokens(ids)
    assert kept == stop_at + 1 and r.output_token_ids == ids[: stop_at + 1]
    assert r.finish_reason == "stop" and r.output_text() == "The answer is 42. "
    assert "Done" not in r.output_text()


def test_finish_stop_string_of_multi_byte_characters_one_byte_token_each(tok):
    """A stop string of 6 characters in 16 byte-level tokens (one token per UTF-8 byte) is still found."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    text, stop = "x中é🙂!中é🙂!", "é🙂!中é🙂"
    ids = [tok.convert_tokens_to_ids(bytes_to_unicode()[b]) for b in text.encode()]
    r = _request(tok, max_tokens=100, stop=stop)
    assert r.append_tokens(ids) == len(ids) - 1 and r.finish_reason == "stop"  # the last "!" is dropped
    assert r.output_text() == "x中" and len(stop.encode()) == 16


def test_finish_stop_string_spanning_two_commits(tok):
    ids = _ids(tok, "alpha beta gamma delta")
    # stop string "beta gam" starts in the first commit and is completed by the second
    split = next(i for i in range(len(ids)) if "beta" in tok.decode(ids[: i + 1])) + 1
    r = _request(tok, max_tokens=100, stop="beta gam")
    assert r.append_tokens(ids[:split]) == split and not r.is_finished
    kept = r.append_tokens(ids[split:])
    assert r.is_finished and r.finish_reason == "stop"
    assert r.output_text() == "alpha "
    assert "gam" in tok.decode(r.output_token_ids) and "delta" not in tok.decode(r.output_token_ids)
    assert kept == len(r.output_token_ids) - split


def test_stop_string_end_to_end(micro_llama_dir):
    """A stop string chosen from the engine's own greedy text stops the request there, text cut before it."""
    llm = _engine(micro_llama_dir)
    prompt = _prompts(1, (6,), seed=11)[0]
    free = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    text = free["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3 and stop.strip()
    out = llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True, stop=stop), use_tqdm=False)[0]
    assert out["finish_reason"] == "stop"
    assert out["text"] == text[: text.find(stop)]
    assert free["token_ids"][: len(out["token_ids"])] == out["token_ids"]
    assert len(out["token_ids"]) < 16 and _all_free(llm)
