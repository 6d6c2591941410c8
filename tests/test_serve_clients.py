"""nanospec-serve under the requests real clients send, and under load (CPU).

One server runs in a subprocess on a free loopback port: the tiny Llama with a random assistant (2 draft
steps), 16 running requests at most and 64 waiting. The request bodies are those of lm-eval 0.4.13
(`local-completions`: ``prompt`` as a list of token-id lists, /tokenizer_info + /tokenize + /detokenize as its
remote tokenizer), guidellm 0.8 (chat with text content parts, ``stream_options`` with
``continuous_usage_stats``, ``ignore_eos``, ``stop: null``) and the openai client. Answers are checked against
the in-process engine. The engine thread itself is tested in process over a stand-in LLM: the waiting limit,
a death mid-add or mid-step, one wake-up per step."""

import asyncio
import contextlib
import json
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from operator import itemgetter
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient
from helpers import make_llm, running_server

from nanospec import SamplingParams
from nanospec.serve.app import build_app
from nanospec.serve.engine import Engine, Job, Metrics
from nanospec.serve.protocol import MAX_BODY
from nanospec.serve.server import parse_args

MAX_WAITING = 64
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
GAUGES += ("nanospec:num_draft_inputs",)


@pytest.fixture(scope="module")
def server(tiny_llama_dir, asst_dir):
    argv = [str(tiny_llama_dir), "--device", "cpu", "--dtype", "float32", "--max-model-len", "256"]
    argv += ["--num-kv-blocks", "600", "--assistant", str(asst_dir), "--num-steps", "2"]
    argv += ["--no-adaptive-speculation", "--max-num-seqs", "16", "--max-waiting", str(MAX_WAITING)]
    with running_server(argv) as url:
        yield SimpleNamespace(url=url, model=str(tiny_llama_dir))


def post(server, path: str, body: dict, status: int = 200) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def sse(server, path: str, body: dict) -> list[dict]:
    """The JSON events of a streamed answer (it must end with [DONE])."""
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def random_prompts(n, seed, length=12):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(300, 40000, (length,), generator=g).tolist() for _ in range(n)]


def gauges(server) -> dict:
    """The engine's gauges from /metrics: running, waiting, KV usage, draft inputs."""
    out = {}
    for line in httpx.get(server.url + "/metrics", timeout=60).text.splitlines():
        if line.partition("{")[0] in GAUGES:
            out[line.partition("{")[0]] = float(line.rsplit(" ", 1)[1])
    return out


def wait_idle(server, timeout=120.0) -> None:
    """Poll until nothing runs or waits and no KV block or draft input is held; fails loudly after timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any((g := gauges(server)).values()):
            return
    raise AssertionError(f"the engine never went idle: {g}")


def test_lm_eval_local_completions(server, ref_llm):
    """lm-eval's generate_until body with its defaults (a batch of token-id lists, temperature 0, stop with
    the EOS string, seed 1234): each choice equals the in-process engine. With n = 2 sampled, choice
    p * n + j equals prompt p alone with seed + j."""
    prompts = random_prompts(3, seed=11)
    body = dict(prompt=prompts, model=server.model, max_tokens=16, temperature=0, stop=["\n\n", "<|im_end|>"])
    got = post(server, "/v1/completions", body | {"seed": 1234})
    want = ref_llm.generate(prompts, SamplingParams(max_tokens=16, stop=body["stop"]), use_tqdm=False)
    assert [c["text"] for c in sorted(got["choices"], key=itemgetter("index"))] == [w["text"] for w in want]
    assert got["usage"]["prompt_tokens"] == 36
    assert got["usage"]["completion_tokens"] == sum(len(w["token_ids"]) for w in want)
    sampled = body | {"temperature": 1.0, "seed": 5, "max_tokens": 6}
    texts = {c["index"]: c["text"] for c in post(server, "/v1/completions", sampled | {"n": 2})["choices"]}
    for p in range(3):
        for j in range(2):
            alone = post(server, "/v1/completions", sampled | {"prompt": prompts[p], "seed": 5 + j})
            assert texts[p * 2 + j] == alone["choices"][0]["text"]
    assert len(set(texts.values())) == 6


def test_lm_eval_remote_tokenizer(server, smollm2_tokenizer):
    """What lm-eval's remote tokenizer reads: /tokenizer_info (eos_token, chat_template), /tokenize
    {prompt, add_special_tokens: false} -> tokens, /detokenize {tokens} -> prompt; vLLM's other fields."""
    tok = smollm2_tokenizer
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    ids = tok.encode("tést <|im_end|>", add_special_tokens=False)
    got = post(server, "/tokenize", {"prompt": "tést <|im_end|>", "add_special_tokens": False})
    assert got == {"count": len(ids), "max_model_len": 256, "tokens": ids, "token_strs": None}
    strs = post(server, "/tokenize", {"prompt": "tést", "return_token_strs": True})["token_strs"]
    assert strs == tok.convert_ids_to_tokens(tok.encode("tést", add_special_tokens=False))
    assert post(server, "/detokenize", {"tokens": ids}) == {"prompt": tok.decode(ids)}
    messages = [{"role": "user", "content": "Hi"}]
    chat = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert post(server, "/tokenize", {"messages": messages})["count"] == chat["usage"]["prompt_tokens"]
    assert post(server, "/detokenize", {"tokens": [-1]}, 400)["error"]["param"] == "tokens"
    assert post(server, "/tokenize", {"prompt": 5}, 400)["error"]["param"] == "prompt"


def test_guidellm_requests(server):
    """guidellm's defaults: GET /health and /v1/models, then streamed chat with text content parts and
    stream_options {include_usage, continuous_usage_stats}, max_completion_tokens, ignore_eos, stop null (and
    temperature 0 here, to compare): every chunk carries the usage so far; the text equals the same
    conversation with the parts joined by a newline; the same for its /v1/completions body."""
    assert httpx.get(server.url + "/health").status_code == 200
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    usage = {"include_usage": True, "continuous_usage_stats": True}
    base = dict(model=model, stream=True, stream_options=usage, stop=None, ignore_eos=True, temperature=0)
    parts = [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "a story"}]
    chat = dict(max_completion_tokens=12, messages=[{"role": "user", "content": parts}])
    joined = dict(messages=[{"role": "user", "content": "Tell me\na story"}])
    for path, body, whole in (
        ("/v1/chat/completions", chat, joined),
        ("/v1/completions", dict(max_tokens=12, prompt="Tell me a story"), {}),
    ):
        events = sse(server, path, base | body)
        counts = [e["usage"]["completion_tokens"] for e in events]
        assert counts == sorted(counts) and counts[-1] == 12 and not events[-1]["choices"]
        choices = [e["choices"][0] for e in events if e["choices"]]
        text = "".join(c["delta"].get("content", "") if "delta" in c else c["text"] for c in choices)
        alone = post(server, path, base | body | whole | {"stream": False})["choices"][0]
        assert text == alone.get("text", alone.get("message", {}).get("content"))


def test_openai_client_shapes(server, ref_llm):
    """The openai client: a list of string prompts (choice i for prompt i), chat content as text parts."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    prompts = ["Hello there", "The sky is"]
    out = client.completions.create(model=server.model, prompt=prompts, max_tokens=8, temperature=0)
    want = ref_llm.generate(prompts, SamplingParams(max_tokens=8), use_tqdm=False)
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [w["text"] for w in want]
    texts = []
    for content in (
        [{"type": "text", "text": "Name"}, {"type": "text", "text": "three colors."}],
        "Name\nthree colors.",
    ):
        messages = [{"role": "user", "content": content}]
        chat = client.chat.completions.create(
            model=server.model, messages=messages, max_tokens=8, temperature=0
        )
        texts.append((chat.choices[0].message.content, chat.usage.prompt_tokens))
    assert texts[0] == texts[1]


REFUSED = [  # (body, the field the 400 names, a piece of its message)
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages", "messages[0].content[0] has type 'image_url': only text parts are served"),
    (dict(messages=[{"role": "user", "content": "hi"}], tools=[{"type": "function"}]), "tools[0].function",
     "tools[0] must be {type: 'function', function: {name, parameters}}"),
    (dict(messages=[{"role": "user", "content": "hi"}], response_format={"type": "json_schema"}),
     "response_format", "response_format must be {type: 'text'}"),
    (dict(prompt="hi", repetition_penalty=1.2), "repetition_penalty", "not supported"),
    (dict(prompt=[[1, 2], []]), "prompt", "list of token-id lists"),
    (dict(prompt=[[1, 2], [10**9]]), "prompt", "prompt token ids must be in [0, 49152)"),
    (dict(prompt=[[1]] * 40, n=2), "prompt", "40 prompts x n 2 exceed --max-waiting 64"),
]  # fmt: skip


def test_refused_fields_and_bodies(server):
    """What would change the output and is not implemented is a 400 naming the field; the harmless fields
    clients send by default are accepted; a deeply nested body is a 400, not a 500."""
    for body, param, message in REFUSED:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        err = post(server, path, body | {"model": server.model, "max_tokens": 2}, 400)["error"]
        assert (err["param"], err["code"]) == (param, 400) and message in err["message"], err
    harmless = dict(prompt="hi", max_tokens=2, repetition_penalty=1.0, tool_choice="none", tools=[], user="u")
    harmless |= dict(logprobs=None, echo=False, response_format={"type": "text"}, stream_options={})
    assert post(server, "/v1/completions", harmless)["usage"]["completion_tokens"] == 2
    nested = b"[" * 100_000 + b"]" * 100_000
    r = httpx.post(server.url + "/v1/completions", content=nested, timeout=60)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    wait_idle(server)  # the prompt refused after its first was added left nothing behind


def test_load_disconnects_big_prompt_and_the_waiting_limit(server):
    """64 concurrent streaming clients (a quarter leave after their first chunk) and one 4 MiB prompt, while
    /health is polled: it answers 200 every time (10 s bound per answer), every client that stays gets its
    16 tokens, the big prompt is a 400, and the engine ends idle (nothing running or waiting, no KV block,
    no draft input). Then 12 streamed requests of n = 16 (192 choices; room for 16 running + 64 waiting):
    those past the limit get 503 + Retry-After, and the engine ends idle again."""
    prompts = random_prompts(64, seed=12)
    body = dict(model=server.model, max_tokens=16, temperature=0, ignore_eos=True, stream=True)
    body["stream_options"] = {"include_usage": True}

    async def client_stream(client, i):
        usage = None
        async with client.stream("POST", "/v1/completions", json=body | {"prompt": prompts[i]}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                data = json.loads(line[6:]) if line.startswith("data: {") else {}
                if i % 4 == 0 and data.get("choices"):
                    return "left"
                usage = data.get("usage") or usage
        return usage["completion_tokens"]

    async def big_prompt(client):
        r = await client.post(
            "/v1/completions", json=dict(prompt="hi " * ((MAX_BODY - 200) // 3), max_tokens=2)
        )
        return r.status_code, r.json()["error"]["param"]

    async def poll_health(client, done):
        codes = []
        while not done.is_set():
            codes.append((await client.get("/health", timeout=10)).status_code)
            with contextlib.suppress(asyncio.TimeoutError):  # about 20 polls a second
                await asyncio.wait_for(done.wait(), 0.05)
        return codes

    async def burst(client):
        statuses = []
        everyone = asyncio.Event()

        async def one(p):  # holds its stream until every status is known, then leaves
            big = body | {"prompt": p, "n": 16, "max_tokens": 200}
            async with client.stream("POST", "/v1/completions", json=big) as r:
                statuses.append((r.status_code, r.headers.get("retry-after")))
                if len(statuses) == 12:
                    everyone.set()
                await everyone.wait()

        await asyncio.gather(*map(one, prompts[:12]))
        return statuses

    async def run(phase):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            async with httpx.AsyncClient(base_url=server.url) as health:
                done = asyncio.Event()
                poller = asyncio.create_task(poll_health(health, done))
                try:
                    return await phase(client)
                finally:
                    done.set()
                    assert set(await poller) == {200}

    async def first_phase(client):
        return await asyncio.gather(big_prompt(client), *(client_stream(client, i) for i in range(64)))

    results = asyncio.run(run(first_phase))
    assert results[0] == (400, "prompt")
    assert results[1:] == ["left" if i % 4 == 0 else 16 for i in range(64)]
    wait_idle(server)
    statuses = asyncio.run(run(burst))
    assert {s for s, _ in statuses} == {200, 503} and all(r == "1" for s, r in statuses if s == 503)
    assert sum(s == 200 for s, _ in statuses) <= 5  # 5 x 16 = 80 choices: 16 running + 64 waiting
    wait_idle(server)


# ---------------------------------------------------------------- the engine thread, over a stand-in LLM
class FakeLLM:
    """The LLM API the server uses, over requests that never run: they wait until aborted. ``fail_add`` /
    ``fail_step``: raised by add_request / by step once a request waits."""

    def __init__(self, tokenizer, fail_add=None, fail_step=None, num_waiting=0):
        self.tokenizer = tokenizer
        self.config = SimpleNamespace(max_model_len=64, speculative=False, num_steps=0)
        self.waiting = {-i - 1: None for i in range(num_waiting)}
        self.fail_add = fail_add
        self.fail_step = fail_step
        self.next_id = 0

    def add_request(self, ids, params):
        if self.fail_add:
            raise self.fail_add
        rid = self.next_id
        self.next_id += 1
        self.waiting[rid] = SimpleNamespace(request_id=rid, output_token_ids=[], is_finished=False)
        return rid

    def get_request(self, rid):
        return self.waiting.get(rid)

    def abort_request(self, rid):
        return self.waiting.pop(rid, None) is not None

    def has_unfinished(self):
        return self.fail_step is not None and bool(self.waiting)

    def step(self):
        if self.fail_step and self.waiting:
            raise self.fail_step
        return []

    def stats(self):
        counts = dict(num_running=0, num_waiting=len(self.waiting), num_draft_inputs=0, num_preemptions=0)
        return dict(counts, kv_cache_usage=0.0)


BODY = dict(prompt=[1, 2], max_tokens=4)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the engine's raise
def test_engine_failure_is_a_500_and_health_503(smollm2_tokenizer):
    """An engine whose first step with work raises: a waiting request gets a 500 in the error schema (a
    stream already under way: one error event, then [DONE]), /health turns 503, later requests 500."""
    web = TestClient(build_app(FakeLLM(smollm2_tokenizer, fail_step=RuntimeError("boom")), "m"))
    assert web.get("/health").status_code == 200
    r = web.post("/v1/completions", json=BODY)
    assert r.status_code == 500 and "RuntimeError('boom')" in r.json()["error"]["message"]
    assert web.get("/health").status_code == 503
    r = web.post("/v1/completions", json=BODY | {"stream": True})
    assert r.status_code == 500 and r.json()["error"]["code"] == 500
    web = TestClient(build_app(FakeLLM(smollm2_tokenizer, fail_step=RuntimeError("boom")), "m"))
    r = web.post("/v1/completions", json=BODY | {"stream": True})
    events = [line for line in r.text.split("\n\n") if line]
    assert r.status_code == 200 and len(events) == 2 and events[1] == "data: [DONE]"
    assert json.loads(events[0].removeprefix("data: "))["error"]["code"] == 500


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the engine's raise
def test_engine_death_mid_add_answers_the_handler(smollm2_tokenizer):
    """add_request raising something unexpected kills the engine thread; the request it was adding still
    gets its 500 (bounded wait: a hang fails here)."""
    web = TestClient(build_app(FakeLLM(smollm2_tokenizer, fail_add=RuntimeError("lost")), "m"))
    pool = ThreadPoolExecutor(1)
    try:
        r = pool.submit(web.post, "/v1/completions", json=BODY).result(timeout=60)
    finally:
        pool.shutdown(wait=False)
    assert r.status_code == 500 and "RuntimeError('lost')" in r.json()["error"]["message"]


def test_waiting_limit(smollm2_tokenizer):
    """An add that would leave more than max_waiting requests waiting is refused whole (n choices count
    n); over HTTP that is a 503 with Retry-After."""
    engine = Engine(FakeLLM(smollm2_tokenizer), Metrics("m", 0), max_waiting=3).start()

    async def admit(n):
        job = Job([[1, 2]], [SamplingParams()] * n, asyncio.get_running_loop(), asyncio.Queue())
        engine.put("add", job)
        return (await asyncio.wait_for(job.messages.get(), 60))[0]

    async def admit_all():
        return [await admit(2), await admit(2), await admit(1), await admit(1)]

    assert asyncio.run(admit_all()) == ["ok", "busy", "ok", "busy"]
    web = TestClient(build_app(FakeLLM(smollm2_tokenizer, num_waiting=3), "m", max_waiting=3))
    r = web.post("/v1/completions", json=BODY)
    assert (r.status_code, r.headers["retry-after"], r.json()["error"]["code"]) == (503, "1", 503)


def test_one_wakeup_per_engine_step(tiny_llama_dir):
    """The engine thread wakes the handlers' event loop at most once per step, each time with every
    request's updates of that step."""
    llm = make_llm(tiny_llama_dir)
    step = llm.step
    steps = []
    wakeups = []

    def counted_step():
        steps.append(1)
        return step()

    class Loop:
        def call_soon_threadsafe(self, fn, items):
            wakeups.append(len(items))
            fn(items)

    llm.step = counted_step
    engine = Engine(llm, Metrics("m", 0)).start()
    loop = Loop()
    messages = queue.Queue()
    for p in random_prompts(8, seed=13):
        engine.put("add", Job([p], [SamplingParams(max_tokens=6, ignore_eos=True)], loop, messages))
    finished = 0
    while finished < 8:
        kind, *payload = messages.get(timeout=60)
        finished += kind == "tokens" and payload[-1] is not None  # its final output
    assert len(wakeups) <= len(steps) and max(wakeups) >= 8


def test_api_key_is_never_printed(monkeypatch, capsys):
    """--help names the environment variable but never shows its value; the value is used when no
    --api-key is given."""
    monkeypatch.setenv("NANOSPEC_API_KEY", "sekrit-123")
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    assert "sekrit" not in out and "NANOSPEC_API_KEY" in out
    assert parse_args(["--assistant", "none"])[1].api_key == "sekrit-123"
    assert parse_args(["--assistant", "none", "--api-key", "given"])[1].api_key == "given"
