"""Logprobs and echo over HTTP, as lm-eval's loglikelihood tasks and the openai client ask for them: the
default model with its shipped assistant (drafts really accepted) on a loopback port. Prompt scores equal HF
transformers' log-softmax of the same tokens; generated-token logprobs equal the in-process engine's without
speculation, up to the last token before max_model_len; streamed chunks carry the same logprobs."""

import httpx
import openai
import pytest
import torch
from helpers import running_server
from transformers import AutoModelForCausalLM

from nanospec import LLM, SamplingParams

MAX_LEN = 160
ENGINE = ["--device", "cpu", "--dtype", "float32", "--max-model-len", str(MAX_LEN), "--num-kv-blocks", "200"]


@pytest.fixture(scope="module")
def server(smollm2_dir):
    with running_server([str(smollm2_dir), *ENGINE, "--assistant", "default", "--num-steps", "3"]) as url:
        yield url


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def hf_logprobs(hf, ids):
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def post(url, body):
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


PROMPTS = [[1, 504, 3458, 314, 4914, 17, 5248, 253, 2795], [1, 9519, 28, 940, 359, 346, 47]]


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_loglikelihood_request_equals_hf(server, hf, smollm2_dir, max_tokens):
    """lm-eval's local-completions loglikelihood request (prompts as token-id lists, echo, logprobs 1,
    temperature 0): token_logprobs are HF's log-softmax of each prompt token (1e-3, fp32), the first null;
    max_tokens 0 scores the prompt only."""
    body = dict(prompt=PROMPTS, max_tokens=max_tokens, temperature=0, logprobs=1, echo=True, seed=1234)
    got = post(server, body)
    assert got.status_code == 200, got.text
    got = got.json()
    assert got["usage"]["completion_tokens"] == max_tokens * len(PROMPTS)
    for choice, ids in zip(sorted(got["choices"], key=lambda c: c["index"]), PROMPTS):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ref = hf_logprobs(hf, ids)
        want = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
        torch.testing.assert_close(
            torch.tensor(lp["token_logprobs"][1 : len(ids)]), torch.tensor(want), atol=1e-3, rtol=0
        )
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        assert all(len(top) in (1, 2) for top in lp["top_logprobs"][1:])  # the top 1, then the token itself
        if max_tokens == 1:  # the greedy continuation: its logprob is the largest
            top = lp["top_logprobs"][-1]
            assert lp["token_logprobs"][-1] == max(top.values())


def test_generated_logprobs_equal_speculation_off(server, smollm2_dir):
    """Greedy completions with logprobs 3 up to max_model_len: each token's logprob and top 3 equal the
    in-process engine's without an assistant (1e-4), tokens accepted from drafts and bonus tokens alike."""
    max_tokens = [MAX_LEN - len(p) for p in PROMPTS]
    body = dict(prompt=PROMPTS, max_tokens=max(max_tokens), temperature=0, logprobs=3, ignore_eos=True)
    got = []
    for p, n in zip(PROMPTS, max_tokens):
        r = post(server, body | dict(prompt=p, max_tokens=n))
        assert r.status_code == 200, r.text
        got.append(r.json()["choices"][0])
    llm = LLM(str(smollm2_dir), device="cpu", dtype="float32", max_model_len=MAX_LEN)
    sp = [SamplingParams(max_tokens=n, ignore_eos=True, logprobs=3) for n in max_tokens]
    ref = llm.generate(PROMPTS, sp, use_tqdm=False)
    for choice, want in zip(got, ref):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(want["token_ids"]) == MAX_LEN - len(want["prompt_token_ids"])
        expected = [entry[t] for entry, t in zip(want["logprobs"], want["token_ids"])]
        torch.testing.assert_close(
            torch.tensor(lp["token_logprobs"]), torch.tensor(expected), atol=1e-4, rtol=0
        )
        for top, entry in zip(lp["top_logprobs"], want["logprobs"]):
            assert sorted(top.values(), reverse=True)[:3] == pytest.approx(list(entry.values())[:3], abs=1e-4)
    acc = [a for c in got for a in c["accept_lengths"]]
    assert sum(a > 1 for a in acc) > 0.2 * len(acc)  # drafts were accepted


def test_chat_logprobs_streamed_and_whole(server):
    """Chat logprobs + top_logprobs (the openai client): one entry per token with its bytes and the top k in
    descending order; streamed deltas carry the same entries, in order, each token once (1e-4)."""
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)
    kw = dict(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "Name three colors."}],
        max_tokens=20,
    )
    kw |= dict(temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    for item in content:
        assert item.bytes == list(item.token.encode()) and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob >= -1e30
    streamed = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed += c.logprobs.content if c.logprobs else []
    assert [x.token for x in streamed] == [x.token for x in content]
    # another run: its verify rows may have other shapes (the draft length adapts), fp32 rounds them apart
    assert [x.logprob for x in streamed] == pytest.approx([x.logprob for x in content], abs=1e-4)


@pytest.mark.parametrize(
    "body,field",
    [
        (dict(prompt="Hi", logprobs=21), "logprobs"),
        (dict(prompt="Hi", logprobs=-1), "logprobs"),
        (dict(prompt="Hi", echo="yes"), "echo"),
        (dict(messages=[{"role": "user", "content": "Hi"}], top_logprobs=2), "logprobs"),
        (dict(messages=[{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=21), "top_logprobs"),
        (dict(prompt="Hi", prompt_logprobs=1), "prompt_logprobs"),
    ],
)
def test_bad_logprobs_fields(server, body, field):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    got = httpx.post(server + path, json=body | dict(max_tokens=2), timeout=60)
    assert got.status_code == 400 and got.json()["error"]["param"] == field, got.text
