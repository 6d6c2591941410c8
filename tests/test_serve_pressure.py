"""nanospec-serve under KV pressure (CPU), on the default model (fp32, its shipped assistant, 3 draft steps:
3 lookahead rows). What the tests prove (DESIGN §4 rule 10 over HTTP): every request finishes, with exactly
the text it gets when sent alone; /health answers 200 all the while; the server counts the preemptions; and
once the last answer is in, nothing runs or waits and every KV block and draft input is free.

- 32 streamed requests at once on a pool of 12 usable blocks of 4 tokens: one request (an 11-12 token prompt
  + 8 tokens + 3 lookahead rows: at most 6 blocks) fits twice; a request of ``max_model_len`` 40 (+ 3 rows:
  11 blocks) passes the engine's pool check.
- The configuration that livelocked the engine before the rule (two requests preempting each other forever;
  ``tests/test_scheduler_progress.py``): a pool at the engine's minimum, prompts sharing a prefix-cached
  prefix, prefill in chunks of 5 tokens.
"""

import asyncio
import json

import httpx
import pytest
from helpers import running_server

ENGINE = ["--device", "cpu", "--dtype", "float32", "--num-steps", "3", "--page-size", "4"]
MAX_TOKENS = 8
NUM_REQUESTS = 32
MAX_HEALTH_POLLS = 5000
TIMEOUT = 120.0  # s, for any one HTTP exchange
BURST_TIMEOUT = 300.0  # s, for all the requests of one phase
LIVELOCK_TIMEOUT = 60.0  # s, for the livelock configuration's requests (a few seconds when they progress)
# the livelock configuration: one request of max_model_len 19 + 3 rows needs 6 blocks, the 6 usable ones
LIVELOCK_ENGINE = ["--max-model-len", "19", "--num-kv-blocks", "7", "--max-num-batched-tokens", "5"]
LIVELOCK_ENGINE += ["--max-num-seqs", "4"]
LIVELOCK_PROMPTS = [
    [21, 40, 27, 45, 26, 43, 6, 12, 19],
    [7] * 6 + [26, 43, 1],
    [7] * 6 + [16],
    [7, 7, 18, 41],
    [7, 27, 15, 10, 17],
]
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
GAUGES += ("nanospec:num_draft_inputs", "vllm:num_preemptions_total")


@pytest.fixture(scope="module")
def server(smollm2_dir):
    """The default model, its assistant auto-selected; 12 usable blocks (block 0 is the engine's dummy
    block)."""
    with running_server([*ENGINE, "--max-model-len", "40", "--num-kv-blocks", "13"]) as url:
        yield url


@pytest.fixture(scope="module")
def livelock_server(smollm2_dir):
    with running_server([*ENGINE, *LIVELOCK_ENGINE]) as url:
        yield url


def story_prompts() -> list[str]:
    return [f"Tell me a short story about the number {i}." for i in range(NUM_REQUESTS)]


async def stream(client: httpx.AsyncClient, prompt, max_tokens: int = MAX_TOKENS) -> dict[int, tuple]:
    """One streamed greedy completion (ignore_eos): {choice index: (text, finish_reason)}. Fails on a status
    other than 200, an error event or a stream that does not end with [DONE]."""
    body = dict(prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True, stream=True)
    texts = {}
    finish_reasons = {}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        event = json.loads(line.removeprefix("data: "))
        assert "error" not in event, event
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            finish_reasons[choice["index"]] = choice["finish_reason"] or finish_reasons.get(choice["index"])
    return {i: (texts[i], finish_reasons[i]) for i in sorted(texts)}


async def burst_with_health_polls(url: str) -> tuple[list[tuple[str, str]], int]:
    """All requests at once while /health is polled until they are done: (their answers, number of polls).
    Every poll must answer 200."""
    limits = httpx.Limits(max_connections=NUM_REQUESTS + 1)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT, limits=limits) as client:
        burst = asyncio.gather(*(stream(client, p) for p in story_prompts()))
        polls = 0
        while not burst.done() and polls < MAX_HEALTH_POLLS:
            response = await client.get("/health")
            assert response.status_code == 200
            polls += 1
            await asyncio.sleep(0.02)
        answers = await burst
    return [answer[0] for answer in answers], polls


async def one_by_one(url: str, prompts: list, max_tokens: int = MAX_TOKENS) -> list[tuple[str, str]]:
    """Each prompt alone, in turn: its (text, finish_reason)."""
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        return [(await stream(client, p, max_tokens))[0] for p in prompts]


def gauges(url: str) -> dict[str, float]:
    """The engine's gauges and the preemption counter from /metrics."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=TIMEOUT).text.splitlines():
        name = line.partition("{")[0]
        if name in GAUGES:
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


def assert_idle(reading: dict[str, float]) -> None:
    for name in GAUGES[:4]:
        assert reading[name] == 0, reading


def test_32_streams_on_a_pool_of_two_finish_as_alone(server):
    """32 concurrent streams on a pool that holds two: each finishes ("length") with the text it gets alone,
    /health answers 200 throughout, preemptions happened, and the engine is idle right after (nothing
    leaks). The requests alone run one at a time and never preempt."""
    answers, polls = asyncio.run(asyncio.wait_for(burst_with_health_polls(server), BURST_TIMEOUT))
    after_burst = gauges(server)
    assert polls >= 1
    assert [finish_reason for _, finish_reason in answers] == ["length"] * NUM_REQUESTS
    assert after_burst["vllm:num_preemptions_total"] > 0
    assert_idle(after_burst)
    alone = asyncio.run(asyncio.wait_for(one_by_one(server, story_prompts()), BURST_TIMEOUT))
    after_alone = gauges(server)
    assert answers == alone
    assert len({text for text, _ in alone}) > 1
    assert after_alone["vllm:num_preemptions_total"] == after_burst["vllm:num_preemptions_total"]
    assert_idle(after_alone)


def test_livelock_configuration_finishes_as_alone(livelock_server):
    """The five prompts in one streamed request (so they arrive in order, before the engine's next step) on
    the pool that holds one of them: all finish with their text alone, after preemptions, and nothing leaks.
    Before the rule they preempted each other forever (this timed out)."""
    url = livelock_server
    token_prompts = [[1000 + t for t in p] for p in LIVELOCK_PROMPTS]  # ordinary tokens

    async def together():
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            return list((await stream(client, token_prompts, 10)).values())

    try:
        answers = asyncio.run(asyncio.wait_for(together(), LIVELOCK_TIMEOUT))
    except TimeoutError:
        pytest.fail(f"not finished within {LIVELOCK_TIMEOUT} s: {gauges(url)}")
    after = gauges(url)
    assert [finish_reason for _, finish_reason in answers] == ["length"] * len(token_prompts)
    assert after["vllm:num_preemptions_total"] > 0
    assert_idle(after)
    assert answers == asyncio.run(asyncio.wait_for(one_by_one(url, token_prompts, 10), LIVELOCK_TIMEOUT))
    assert_idle(gauges(url))
