"""Logprobs (``SamplingParams(logprobs=k, prompt_logprobs=k)``): the log-softmax of the target's raw logits at
every output and prompt token, with the top k, equal to HF transformers' (fp32); under speculation each
accepted draft and bonus token's logprob comes from its verify row and equals speculation off, also for the
last token before max_model_len; bitwise so with deterministic=True."""

import pytest
import torch
from helpers import PROMPTS, install_drafter, make_llm
from transformers import AutoModelForCausalLM

from nanospec import SamplingParams
from nanospec.mtp.draft import chain_tree

K = 3


def params(max_tokens=12, **kw):
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=K, prompt_logprobs=2, **kw)


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def hf_logprobs(hf, ids):
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def check_against_hf(hf, out, atol=1e-4):
    prompt, tokens = out["prompt_token_ids"], out["token_ids"]
    lp = hf_logprobs(hf, prompt + tokens)
    assert out["prompt_logprobs"][0] is None and len(out["prompt_logprobs"]) == len(prompt)
    for i in range(1, len(prompt)):
        entry = out["prompt_logprobs"][i]
        assert abs(entry[prompt[i]] - lp[i - 1, prompt[i]].item()) < atol
        assert list(entry)[:2] == lp[i - 1].topk(2).indices.tolist()
    assert len(out["logprobs"]) == len(tokens)
    for j, tok in enumerate(tokens):
        row = lp[len(prompt) + j - 1]
        entry = out["logprobs"][j]
        assert abs(entry[tok] - row[tok].item()) < atol
        assert list(entry)[:K] == row.topk(K).indices.tolist()
        torch.testing.assert_close(
            torch.tensor(list(entry.values())[:K]), row.topk(K).values, atol=atol, rtol=0
        )


@pytest.fixture
def oracle(monkeypatch, tiny_llama_dir):
    """Chain drafts = the spec-off continuation after each row's device L; wrong at depth 2 when
    L % 3 == 0."""
    ref = make_llm(tiny_llama_dir)
    cache = {}

    def continuation(prompt):
        if tuple(prompt) not in cache:
            out = ref.generate([prompt], SamplingParams(max_tokens=64, ignore_eos=True), use_tqdm=False)
            cache[tuple(prompt)] = out[0]["token_ids"]
        return cache[tuple(prompt)]

    def draft(self, reqs, block_table, seq_lens, num_splits=None, num_steps=None, sampling=None):
        S = self.num_steps if num_steps is None else num_steps
        rows = []
        for r, L in zip(reqs, seq_lens.tolist()):
            n_out = L - len(r.prompt_token_ids) + 1
            d = (continuation(r.prompt_token_ids)[n_out : n_out + S] + [0] * S)[:S]
            rows.append(d if L % 3 else d[:2] + [(t + 1) % 49152 for t in d[2:]])
        bonus = self.persistent_batch.take(reqs).bonus_tokens
        return chain_tree(bonus, torch.tensor(rows, dtype=torch.long).view(len(reqs), S))

    install_drafter(monkeypatch, draft)


def test_logprobs_equal_hf(tiny_llama_dir, hf):
    """Greedy and sampled requests, prompts chunked over several prefill steps (8 tokens a step)."""
    llm = make_llm(tiny_llama_dir, max_num_batched_tokens=8)
    sp = [params(), params(temperature=0.9, seed=3), params(top_k=5, temperature=1.0, seed=4), params()]
    for out in llm.generate(PROMPTS, sp, use_tqdm=False):
        check_against_hf(hf, out)


def test_prompt_logprobs_with_prefix_caching(tiny_llama_dir, hf):
    """A prompt whose first blocks are cached is still scored whole (recomputed, no cache hit); a request
    without prompt_logprobs still hits the cache."""
    llm = make_llm(tiny_llama_dir, page_size=4)
    prompt = PROMPTS[3]
    llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    scored = llm.generate([prompt], params(max_tokens=4), use_tqdm=False)[0]
    assert scored["num_cached_tokens"] == 0
    check_against_hf(hf, scored)
    plain = llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain["num_cached_tokens"] == 28


@pytest.mark.parametrize("overlap", [False, True])
def test_spec_logprobs_equal_spec_off_to_max_model_len(tiny_llama_dir, asst_dir, hf, oracle, overlap):
    """Accepted drafts, bonus tokens and the last token before max_model_len (prompt + max_tokens fills it):
    logprobs equal speculation off (1e-4, fp32) and HF."""
    prompts = [PROMPTS[1], PROMPTS[2]]
    sp = [params(max_tokens=64 - len(p)) for p in prompts]
    kw = dict(max_model_len=64, overlap_schedule=overlap)
    off = make_llm(tiny_llama_dir, **kw).generate(prompts, sp, use_tqdm=False)
    on = make_llm(tiny_llama_dir, asst_dir, num_steps=3, **kw).generate(prompts, sp, use_tqdm=False)
    for a, b in zip(off, on):
        assert a["token_ids"] == b["token_ids"] and len(b["prompt_token_ids"]) + len(b["token_ids"]) == 64
        for x, y in zip(a["logprobs"], b["logprobs"]):
            assert list(x) == list(y)
            torch.testing.assert_close(
                torch.tensor(list(y.values())), torch.tensor(list(x.values())), atol=1e-4, rtol=0
            )
        check_against_hf(hf, b)
    acc = [a for o in on for a in o["accept_lengths"]]
    assert max(acc) == 4  # a whole draft was accepted (the share depends on the CPU: not asserted)


def test_logprobs_cut_with_the_tokens_at_a_stop(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    full = llm.generate([PROMPTS[0]], params(max_tokens=10), use_tqdm=False)[0]["token_ids"]
    out = llm.generate([PROMPTS[0]], params(max_tokens=10, stop_token_ids=[full[4]]), use_tqdm=False)[0]
    assert len(out["logprobs"]) == len(out["token_ids"]) == full.index(full[4]) + 1
    assert "logprobs" not in llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2), use_tqdm=False)[0]


def test_spec_logprobs_bitwise_with_deterministic_mode(tiny_llama_dir, asst_dir, oracle):
    prompts = [PROMPTS[1], PROMPTS[3]]
    sp = params(max_tokens=16)
    kw = dict(dtype="bfloat16", deterministic=True)
    off = make_llm(tiny_llama_dir, **kw).generate(prompts, sp, use_tqdm=False)
    on = make_llm(tiny_llama_dir, asst_dir, num_steps=3, **kw).generate(prompts, sp, use_tqdm=False)
    assert [o["logprobs"] for o in on] == [o["logprobs"] for o in off]
    assert any(a > 1 for o in on for a in o["accept_lengths"])


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_bad_logprobs_values(field):
    for bad in (-1, 21):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: bad})
    with pytest.raises(TypeError, match=field):
        SamplingParams(**{field: True})
