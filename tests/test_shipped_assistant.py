"""The shipped assistant on the default model, as a user runs them (fp32 CPU, adaptive draft length): a
drafter bug that silently zeroes acceptance fails here, not only in a benchmark, and a seeded sampled request
gives the tokens it gives without speculation, alone or batched."""

import json

import pytest
from helpers import chat_texts

from nanospec import LLM, SamplingParams
from nanospec.default_model import DEFAULT_ASSISTANT

ASSETS = DEFAULT_ASSISTANT.parent


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    """The first 4 of the benchmark's chat prompts (nanospec/assets/chat_prompts.json), chat-templated."""
    questions = json.loads((ASSETS / "chat_prompts.json").read_text())[:4]
    return chat_texts(smollm2_tokenizer, questions)


def mean_accept(outs):
    acc = [a for o in outs for a in o["accept_lengths"]]
    return sum(acc) / len(acc)


@pytest.mark.parametrize(
    "temperature,floor",
    [
        (0.0, 1.1),  # measured 1.39 (4 prompts x 32 tokens, S = 3, 90 verify steps)
        (0.7, 1.1),  # measured 1.45 (88 verify steps)
    ],
)
def test_shipped_assistant_acceptance_floor(smollm2_dir, prompts, temperature, floor):
    """Mean accept length at a fixed S = 3 (policy off) over fixed prompts, greedy and T = 0.7 (seeded)."""
    if not (DEFAULT_ASSISTANT / "config.json").exists():
        pytest.skip("no shipped assistant")
    sp = SamplingParams(temperature=temperature, top_p=0.95, max_tokens=32, ignore_eos=True, seed=11)
    llm = LLM(
        None,
        device="cpu",
        dtype="float32",
        max_model_len=256,
        assistant="default",
        num_steps=3,
        adaptive_speculation=False,
    )
    assert mean_accept(llm.generate(prompts, sp, use_tqdm=False)) >= floor


def test_shipped_assistant_seeded_sampling_spec_on_equals_off(smollm2_dir, prompts):
    """The user's case: T = 0.8, top_p 0.95, one seed per request, 24 tokens; the default engine with its
    assistant (adaptive draft length) gives the plain engine's tokens, alone and batched."""
    if not (DEFAULT_ASSISTANT / "config.json").exists():
        pytest.skip("no shipped assistant")
    sp = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=1234 + i) for i in range(4)]
    kw = dict(device="cpu", dtype="float32", max_model_len=256)
    off = [o["token_ids"] for o in LLM(None, **kw).generate(prompts, sp, use_tqdm=False)]
    llm = LLM(None, assistant="default", **kw)
    on = llm.generate(prompts, sp, use_tqdm=False)
    assert [o["token_ids"] for o in on] == off
    alone = [llm.generate([p], [s], use_tqdm=False)[0]["token_ids"] for p, s in zip(prompts, sp)]
    assert alone == off
    assert mean_accept(on) > 1.1  # a drafter that is never accepted gives 1.0
