"""Prefix caching (``LLM(enable_prefix_caching=True)``, the default): shared full prompt blocks are computed
once, outputs stay token-identical to the cache off (greedy, fp32, speculation on), ``num_cached_tokens`` is
exact, and at idle every block is free or cached-and-free with all ref counts 0."""

import pytest
import torch
from helpers import greedy, make_llm

PAGE = 16


def tokens(n, seed):
    return torch.randint(3, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def idle_exact(llm):
    a = llm.runner.allocator
    free = sorted([*a.free_blocks, *a.evictable])
    assert free == list(range(1, a.num_blocks)) and not any(a.ref_count) and a.num_free == a.num_usable
    assert set(a.evictable) <= set(a.block_hash) and len(a.cached) == len(a.block_hash)


def expected_cached(prompt, cached_prefix_len):
    """Tokens a request can take from a cache holding ``cached_prefix_len`` tokens of its prompt."""
    return min(cached_prefix_len, len(prompt) - 1) // PAGE * PAGE


def engines(model_dir, assistant, **kw):
    base = {
        **dict(num_steps=3, page_size=PAGE, max_model_len=512, num_kv_blocks=96, max_num_batched_tokens=64),
        **kw,
    }
    return (
        make_llm(model_dir, assistant, enable_prefix_caching=False, **base),
        make_llm(model_dir, assistant, **base),
    )


def test_two_requests_share_a_300_token_prefix(tiny_llama_dir, asst_dir):
    prefix = tokens(300, 0)
    prompts = [prefix + tokens(9, 1), prefix + tokens(23, 2)]
    off, on = engines(tiny_llama_dir, asst_dir)
    ref = off.generate(prompts, greedy(12), use_tqdm=False)
    got = on.generate(prompts, greedy(12), use_tqdm=False)
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in ref]
    assert [o["num_cached_tokens"] for o in ref] == [0, 0]
    # request 2 is scheduled beside request 1's last chunk (309 tokens in chunks of 64): by then request 1's
    # prefill has written 4 x 64 = 256 tokens = 16 full blocks, all of them shared prefix
    assert [o["num_cached_tokens"] for o in got] == [0, 256]
    idle_exact(on)
    again = on.generate(prompts[1:], greedy(12), use_tqdm=False)[0]  # after both finished: still cached
    assert again["token_ids"] == ref[1]["token_ids"]
    # its own 20 full prompt blocks
    assert again["num_cached_tokens"] == expected_cached(prompts[1], 323) == 320
    idle_exact(on)


def test_eight_concurrent_requests_reuse_one_prefix(tiny_llama_dir, asst_dir):
    prefix = tokens(70, 3)
    prompts = [prefix + tokens(5 + i, 10 + i) for i in range(8)]
    off, on = engines(tiny_llama_dir, asst_dir, max_num_batched_tokens=512)
    on.generate([prefix], greedy(2), use_tqdm=False)  # warm the cache with the prefix alone
    for p in prompts:
        on.add_request(p, greedy(6))
    on.step()  # one prefill step takes all eight (the budget holds them)
    a, shared = on.runner.allocator, on.scheduler.running[0].block_table[:4]
    assert all(r.block_table[:4] == shared for r in on.scheduler.running) and len(on.scheduler.running) == 8
    assert [a.ref_count[b] for b in shared] == [8] * 4  # 64 tokens = 4 blocks, held by all eight at once
    done = {}
    while on.has_unfinished():
        done.update({r.request_id: r for r in on.step()})
    ref = off.generate(prompts, greedy(6), use_tqdm=False)
    assert [done[i + 1].output_token_ids for i in range(8)] == [o["token_ids"] for o in ref]
    assert [done[i + 1].num_cached_tokens for i in range(8)] == [64] * 8
    idle_exact(on)


def test_eviction_under_a_tiny_pool(tiny_llama_dir, asst_dir):
    prompts = [tokens(60, 20 + i) for i in range(4)]
    off, on = engines(tiny_llama_dir, asst_dir, num_kv_blocks=12, max_model_len=96)  # 11 usable blocks
    for p in prompts:  # one at a time: each finished request leaves 3 cached blocks; 4 x 3 > 11 evicts some
        assert (
            on.generate([p], greedy(10), use_tqdm=False)[0]["token_ids"]
            == off.generate([p], greedy(10), use_tqdm=False)[0]["token_ids"]
        )
    a = on.runner.allocator
    assert len(a.cached) < 4 * 3 and len(a.cached) <= a.num_usable
    idle_exact(on)
    # the oldest prompt's blocks were evicted first (LRU): it gets fewer cached tokens than the newest
    first, last = (
        on.generate([p], greedy(2), use_tqdm=False)[0]["num_cached_tokens"] for p in (prompts[0], prompts[-1])
    )
    assert last == expected_cached(prompts[-1], 60) == 48 and first < last
    idle_exact(on)


@pytest.mark.parametrize("short_first", [True, False])
def test_a_prompt_that_is_a_prefix_of_another(tiny_llama_dir, asst_dir, short_first):
    long = tokens(50, 30)
    short = long[:40]
    order = [short, long] if short_first else [long, short]
    off, on = engines(tiny_llama_dir, asst_dir)
    outs = [on.generate([p], greedy(8), use_tqdm=False)[0] for p in order]
    refs = [off.generate([p], greedy(8), use_tqdm=False)[0] for p in order]
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in refs]
    # the second one reuses the first one's full prompt blocks (prefill blocks only: never its decode rows)
    assert outs[1]["num_cached_tokens"] == expected_cached(order[1], 32)
    idle_exact(on)


def test_prompt_length_an_exact_multiple_of_page_size(tiny_llama_dir, asst_dir):
    p = tokens(3 * PAGE, 40)
    off, on = engines(tiny_llama_dir, asst_dir)
    ref = off.generate([p], greedy(8), use_tqdm=False)[0]["token_ids"]
    first, second = (on.generate([p], greedy(8), use_tqdm=False)[0] for _ in range(2))
    assert first["token_ids"] == second["token_ids"] == ref
    # the last prompt token is always computed, so its whole block is: 2 of 3 blocks come from the cache
    assert (first["num_cached_tokens"], second["num_cached_tokens"]) == (0, 2 * PAGE)
    idle_exact(on)


def test_preempted_request_keeps_its_prefix_cached(tiny_llama_dir, asst_dir):
    prompts = [tokens(24, 50 + i) for i in range(4)]
    kw = dict(num_kv_blocks=19, max_model_len=64, page_size=4)
    off = make_llm(tiny_llama_dir, asst_dir, num_steps=3, enable_prefix_caching=False, **kw)
    on = make_llm(tiny_llama_dir, asst_dir, num_steps=3, **kw)
    params = [greedy(n) for n in (30, 26, 34, 22)]
    ref = off.generate(prompts, params, use_tqdm=False)
    got = on.generate(prompts, params, use_tqdm=False)
    assert on.scheduler.num_preemptions > 0
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in ref]
    a = on.runner.allocator
    assert not any(a.ref_count) and a.num_free == a.num_usable


def test_keys_are_chained_sha256_and_cache_salt_isolates(tiny_llama_dir):
    """Block keys are sha256(parent key || int64 token ids), the first parent sha256(cache_salt); a request
    shares cached blocks only with requests of the same salt, and a bad salt is refused before any work."""
    import hashlib
    from array import array

    llm = make_llm(tiny_llama_dir, max_model_len=128)
    prompt = tokens(40, 7)  # 2 full blocks (32 tokens) can be cached
    first = llm.generate([prompt], greedy(4, cache_salt="alice"), use_tqdm=False)[0]
    k0 = hashlib.sha256(hashlib.sha256(b"alice").digest() + array("q", prompt[:PAGE]).tobytes()).digest()
    k1 = hashlib.sha256(k0 + array("q", prompt[PAGE : 2 * PAGE]).tobytes()).digest()
    a = llm.runner.allocator
    assert k0 in a.cached and k1 in a.cached and len(a.cached) == 2
    salts = ("bob", None, "alice")
    outs = [llm.generate([prompt], greedy(4, cache_salt=s), use_tqdm=False)[0] for s in salts]
    assert [o["num_cached_tokens"] for o in [first, *outs]] == [0, 0, 0, 32]
    assert all(o["token_ids"] == first["token_ids"] for o in outs)
    for bad in ("", 5, b"x"):
        with pytest.raises(TypeError, match="SamplingParams.cache_salt must be a non-empty str"):
            greedy(4, cache_salt=bad)
    idle_exact(llm)
