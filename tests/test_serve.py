"""nanospec-serve over HTTP (CPU). Two servers run in subprocesses on free loopback ports (``--port 0``: each
prints its URL once listening): one with a random assistant (2 draft steps) and an API key, one with neither.
They serve a tiny Llama in which the byte-level tokens of "中é🙂!" form a greedy cycle, so its multi-byte
characters always span several tokens (and chunks). Answers are checked against the in-process engine, the
Prometheus counters against exact counts, and the disconnect test against the engine's idle state."""

import asyncio
import json
import os
import shutil
import socket
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from urllib.parse import urlparse

import httpx
import openai
import pytest
import torch
from helpers import make_llm

from nanospec import SamplingParams
from nanospec.tools import bench, serve_bench

KEY = "test-key"
TEXT = "中é🙂!"  # 10 bytes, all different: 10 byte-level tokens, each with one successor
ENGINE = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "600"]
AUTH = {"Authorization": f"Bearer {KEY}"}
VLLM_NAMES = """num_requests_running num_requests_waiting kv_cache_usage_perc prompt_tokens_total
generation_tokens_total prefix_cache_queries_total prefix_cache_hits_total request_success_total
time_to_first_token_seconds_count inter_token_latency_seconds_count
spec_decode_num_drafts_total spec_decode_num_draft_tokens_total spec_decode_num_accepted_tokens_total
spec_decode_num_accepted_tokens_per_pos_total""".split()  # vLLM's documented names (+ _total / _count)


def byte_tokens(tok, text: str) -> list[int]:
    """The byte-level token of each UTF-8 byte of ``text``."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return [tok.convert_tokens_to_ids(bytes_to_unicode()[b]) for b in text.encode()]


@pytest.fixture(scope="module")
def cycle_dir(tmp_path_factory, tiny_llama_dir, smollm2_tokenizer):
    """The tiny Llama with TEXT's byte tokens made a greedy cycle: their embeddings are large one-hot rows
    (the final hidden then points along one axis whatever the layers add) and the LM-head row of each token's
    successor reads that axis. Other prompts still get the random model's varied text."""
    from safetensors.torch import load_file, save_file

    d = tmp_path_factory.mktemp("cycle")
    for f in tiny_llama_dir.iterdir():
        shutil.copy(f, d / f.name)
    w = load_file(d / "model.safetensors")
    emb, head, cyc = w["model.embed_tokens.weight"], w["lm_head.weight"], byte_tokens(smollm2_tokenizer, TEXT)
    for k, t in enumerate(cyc):
        succ = cyc[(k + 1) % len(cyc)]
        emb[t], head[succ] = 0, 0
        emb[t, k], head[succ, k] = 50.0, 2.0
    save_file(w, d / "model.safetensors", metadata={"format": "pt"})
    return d


@pytest.fixture(scope="module")
def cycle(cycle_dir, smollm2_tokenizer):
    return byte_tokens(smollm2_tokenizer, TEXT)


@pytest.fixture(scope="module")
def ref(cycle_dir):
    """(prompt ids, max_tokens, **SamplingParams) -> the in-process engine's output alone (no assistant;
    greedy and ignore_eos unless given), cached."""
    llm, cache = make_llm(cycle_dir, max_model_len=256), {}

    def run(ids, max_tokens=24, **kw):
        key = (tuple(ids), max_tokens, tuple(sorted(kw.items())))
        if key not in cache:
            params = SamplingParams(**dict(temperature=0.0, ignore_eos=True) | kw, max_tokens=max_tokens)
            cache[key] = llm.generate([list(ids)], params, use_tqdm=False)[0]
        return cache[key]

    run.tokenizer = llm.tokenizer
    return run


@pytest.fixture(scope="module")
def servers(cycle_dir, asst_dir):
    """{"spec": url, "plain": url, "model": name}, started together; stopped (killed if need be) after."""
    spec = [str(cycle_dir), *ENGINE, "--assistant", str(asst_dir), "--num-steps", "2", "--api-key", KEY]
    spec.append("--no-adaptive-speculation")  # every step drafts 2: accept lengths and counters are exact
    plain = [str(cycle_dir), *ENGINE, "--assistant", "none"]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    with ThreadPoolExecutor(2) as pool:
        started = [pool.submit(serve_bench.launch, argv, 240, env=env) for argv in (spec, plain)]
    try:
        (_, spec_url), (_, plain_url) = (f.result() for f in started)
        yield {"spec": spec_url, "plain": plain_url, "model": str(cycle_dir)}
    finally:
        for f in started:
            if f.exception() is None:
                serve_bench.stop(f.result()[0])


def api(servers, kind="spec"):
    return openai.OpenAI(base_url=servers[kind] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def complete(servers, kind="spec", **body):
    """One non-streamed completion through the openai client."""
    body = dict(model=servers["model"], max_tokens=24, temperature=0) | body
    extra = {k: body.pop(k) for k in ("ignore_eos", "cache_salt", "top_k") if k in body}
    return api(servers, kind).completions.create(**body, extra_body=extra | {"ignore_eos": True})


def streamed(servers, kind="spec", **body):
    """The same, streamed: (text per choice index, every non-empty delta, usage, finish_reason per index)."""
    body = dict(model=servers["model"], max_tokens=24, temperature=0) | body
    extra = {k: body.pop(k) for k in ("ignore_eos", "cache_salt") if k in body} | {"ignore_eos": True}
    chunks = api(servers, kind).completions.create(
        **body, stream=True, extra_body=extra, stream_options={"include_usage": True}
    )
    texts, deltas, usage, finish = {}, [], None, {}
    for chunk in chunks:
        assert usage is None  # the usage chunk is the last one
        usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            deltas += [c.text] if c.text else []
            finish[c.index] = c.finish_reason
    assert usage is not None and not chunk.choices
    return texts, deltas, usage, finish


def metrics(url) -> dict:
    """/metrics as {"name" or 'name{label="v"}': value}, the model_name and engine labels dropped."""
    out = {}
    for line in httpx.get(url + "/metrics", headers=AUTH).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            base, _, labels = name.partition("{")
            keep = [
                x for x in labels.rstrip("}").split(",") if x and not x.startswith(("model_name=", "engine="))
            ]
            out[base + ("{" + ",".join(keep) + "}" if keep else "")] = float(value)
    return out


def wait_for(url, cond, timeout=60.0):
    """Poll /metrics (a bounded number of readings) until ``cond(reading)``; returns that reading."""
    for _ in range(int(timeout * 50)):  # a reading takes > 20 ms: at most ~timeout s
        if cond(m := metrics(url)):
            return m
    raise AssertionError(f"/metrics never satisfied the condition: {m}")


def random_prompts(n, seed, length=20):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(300, 40000, (length,), generator=g).tolist() for _ in range(n)]


@pytest.mark.parametrize("kind", ["spec", "plain"])
def test_completions_and_chat_equal_the_engine(servers, ref, kind):
    """Greedy (fp32) over HTTP, with the assistant and without it, equals the in-process engine without it."""
    for ids in random_prompts(3, seed=1):
        got = complete(servers, kind, prompt=ids)
        assert got.choices[0].text == ref(ids)["text"] and got.choices[0].finish_reason == "length"
        assert (got.usage.prompt_tokens, got.usage.completion_tokens, got.usage.total_tokens) == (20, 24, 44)
        acc = getattr(got.choices[0], "accept_lengths", None)  # nanospec's extension field, under speculation
        assert (acc is not None) == (kind == "spec") and (acc is None or 1 + sum(acc) >= 24)
    chat, tok = [{"role": "user", "content": "Name three colors."}], ref.tokenizer
    got = api(servers, kind).chat.completions.create(
        model=servers["model"], messages=chat, max_completion_tokens=16, temperature=0
    )
    ids = tok.encode(
        tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    assert got.choices[0].message.content == ref(ids, 16, ignore_eos=False)["text"]
    assert got.usage.prompt_tokens == len(ids) and got.choices[0].message.role == "assistant"


@pytest.mark.parametrize("kind", ["spec", "plain"])
def test_stream_equals_whole_and_never_splits_a_character(servers, ref, cycle, kind):
    """The deltas add up to the non-streamed text (greedy and seeded sampling, prompts that start inside the
    cycle, mid-character, or elsewhere), no delta holds a broken character, and include_usage's last chunk
    counts what was delivered."""
    cases = [
        dict(prompt=[cycle[-1]], max_tokens=20),
        dict(prompt=[cycle[0]], max_tokens=21),
        dict(prompt=[7, 8]),
    ]
    cases += [dict(prompt=p, temperature=1.0, seed=5) for p in random_prompts(2, seed=2)]
    for case in cases:
        whole = complete(servers, kind, **case)
        texts, deltas, usage, finish = streamed(servers, kind, **case)
        assert texts == {0: whole.choices[0].text} and finish == {0: "length"}
        assert (usage.prompt_tokens, usage.completion_tokens) == (
            whole.usage.prompt_tokens,
            case.get("max_tokens", 24),
        )
    texts, deltas, _, _ = streamed(servers, kind, prompt=[cycle[-1]], max_tokens=20)
    assert texts[0] == TEXT * 2 == ref([cycle[-1]], 20)["text"]
    # after cycle[0] come the 2 other bytes of 中 (broken: U+FFFD each) ... and 2 bytes of 中 left at the end
    texts, deltas2, _, _ = streamed(servers, kind, prompt=[cycle[0]], max_tokens=21)
    assert texts[0] == ref([cycle[0]], 21)["text"] == "\ufffd\ufffdé🙂!中é🙂!\ufffd"
    if kind == "plain":  # one token a step: each character goes out whole once its last byte is in, no sooner
        assert deltas == list(TEXT * 2) and deltas2 == ["\ufffd\ufffdé", *"🙂!中é🙂!", "\ufffd"]


@pytest.mark.parametrize("kind", ["spec", "plain"])
def test_stop_strings_cut_across_chunks_and_characters(servers, cycle, kind):
    """A stop string spanning several multi-byte characters (and so several tokens and chunks) cuts the
    text before it, streamed or not; completion_tokens counts the tokens up to the one that completed it."""
    for stop, text, tokens in (("🙂!中", "中é", 13), (["!中é", "é🙂"], "中", 9), ("é🙂!中é🙂", "中", 19)):
        whole = complete(servers, kind, prompt=[cycle[-1]], max_tokens=40, stop=stop)
        texts, deltas, usage, finish = streamed(servers, kind, prompt=[cycle[-1]], max_tokens=40, stop=stop)
        assert whole.choices[0].text == texts[0] == text and finish == {0: "stop"}
        assert (
            whole.choices[0].finish_reason == "stop"
            and whole.usage.completion_tokens == usage.completion_tokens == tokens
        )


def test_n_choices_with_seeds(servers, ref):
    """n = 3: choice i samples with seed + i, so it equals a request with that seed alone (and, without the
    assistant, the in-process engine); the three differ. Streamed, each index adds up to its choice."""
    ids, kw = random_prompts(1, seed=3)[0], dict(temperature=1.0, max_tokens=12)
    for kind in ("spec", "plain"):
        got = complete(servers, kind, prompt=ids, seed=40, n=3, **kw)
        texts = [c.text for c in sorted(got.choices, key=lambda c: c.index)]
        alone = [complete(servers, kind, prompt=ids, seed=40 + i, **kw).choices[0].text for i in range(3)]
        assert texts == alone and len(set(texts)) == 3 and got.usage.completion_tokens == 36
        if kind == "plain":
            assert texts == [ref(ids, seed=40 + i, **kw)["text"] for i in range(3)]
        assert streamed(servers, kind, prompt=ids, seed=40, n=3, **kw)[0] == dict(enumerate(texts))


BAD = [  # (body fields, the field the 400 names, a piece of its message)
    (dict(temperature=-1), "temperature", "must be 0 (greedy) or in"),
    (dict(top_p=0), "top_p", "must be in (0, 1]"),
    (dict(top_k=-2), "top_k", "-1 (off) or in [1, 2**31)"),
    (dict(top_k=2**70), "top_k", "-1 (off) or in [1, 2**31)"),  # an int32 on the device
    (dict(max_tokens=0), "max_tokens", "must be >= 1"),
    (dict(max_tokens=300), "max_tokens", "prompt's 20 tokens + max_tokens 300 exceed max_model_len 256"),
    (dict(prompt=list(range(1, 301))), "prompt", "the prompt has 300 tokens; max_model_len is 256"),
    (dict(prompt=[10**9]), "prompt", "prompt token ids must be in [0, 49152)"),
    (dict(prompt=""), "prompt", "prompt must be a non-empty string, list of strings, list of token ids"),
    (dict(n=0), "n", "n must be an int in [1, 16]"),
    (dict(n=17), "n", "n must be an int in [1, 16]"),
    (dict(stop=["a"] * 17), "stop", "<= 16 strings of <= 256 chars"),
    (dict(stop="x" * 257), "stop", "<= 16 strings of <= 256 chars"),
    (dict(stop=[""]), "stop", "non-empty strings"),
    (dict(stop_token_ids=[10**9]), "stop_token_ids", "must be in [0, 49152)"),
    (dict(stop_token_ids=5), "stop_token_ids", "must be a list of int, got 5"),
    (dict(stop=5), "stop", "strings of <= 256 chars, got 5"),
    (dict(seed=-1), "seed", "must be in [0, 2**63)"),
    (dict(seed="7"), "seed", "must be an int"),
    (dict(ignore_eos="yes"), "ignore_eos", "must be a bool"),
    (dict(cache_salt=5), "cache_salt", "must be a non-empty str"),
    (dict(stream="yes"), "stream", "stream must be a bool"),
    (dict(logprobs=21), "logprobs", "must be in [0, 20]"),
    (dict(echo="yes"), "echo", "echo must be a bool"),
    (dict(prompt_logprobs=1), "prompt_logprobs", "not supported"),
    (dict(best_of=3), "best_of", "not supported"),
    (dict(tools=[{"type": "function"}]), "tools", "tools are served on /v1/chat/completions"),
]


def test_every_bad_field_is_a_400_and_disturbs_no_one(servers, ref):
    """Each bad field: a 400 in the OpenAI error schema naming the field and the allowed range (the engine's
    own message); an unknown model 404; unknown fields are ignored. A stream running meanwhile is intact."""
    ids, url = random_prompts(1, seed=4)[0], servers["spec"]
    running = api(servers).completions.create(
        model=servers["model"],
        prompt=ids,
        max_tokens=64,
        stream=True,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    first = next(iter(running)).choices[0].text
    for fields, param, message in BAD + [(dict(model="nope"), "model", "does not exist")]:
        r = httpx.post(url + "/v1/completions", headers=AUTH, json=dict(prompt=ids, max_tokens=8) | fields)
        err = r.json()["error"]
        assert (r.status_code, err["code"], err["param"]) == (
            (404,) * 2 if param == "model" else (400,) * 2
        ) + (param,)
        assert message in err["message"] and err["type"] in ("BadRequestError", "NotFoundError"), err
    chat = dict(model=servers["model"], max_tokens=4)
    for messages in ([], [{"role": "user"}], "hi"):
        r = httpx.post(url + "/v1/chat/completions", headers=AUTH, json=chat | {"messages": messages})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    ok = dict(
        prompt=ids, max_tokens=4, temperature=0, repetition_penalty=1.0, logprobs=None, anything={"x": 1}
    )
    assert httpx.post(url + "/v1/completions", headers=AUTH, json=ok).status_code == 200
    for body, message in ((b"{not json", "not valid JSON"), (b'["a list"]', "must be a JSON object")):
        r = httpx.post(url + "/v1/completions", headers=AUTH, content=body)
        assert r.status_code == 400 and message in r.json()["error"]["message"]
    big = httpx.post(servers["plain"] + "/v1/completions", json=dict(prompt="x" * (1 << 22)))  # over 4 MiB
    chunked = httpx.post(
        servers["plain"] + "/v1/completions", content=iter([b'{"prompt": "hi"}'])
    )  # no length
    for r in (big, chunked):
        assert (
            r.status_code == 400 and "Content-Length of at most 4194304 bytes" in r.json()["error"]["message"]
        )
    assert first + "".join(c.choices[0].text for c in running) == ref(ids, 64)["text"]


def test_api_key(servers):
    """--api-key: every endpoint but /health answers 401 without the right bearer key; no key, no check."""
    url = servers["spec"]
    assert httpx.get(url + "/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions")):
            r = httpx.request(method, url + path, headers=headers, json=dict(prompt="hi"))
            assert r.status_code == 401 and r.json()["error"]["code"] == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(url + "/v1/models", headers=AUTH).json()["data"][0]["id"] == servers["model"]
    assert httpx.get(servers["plain"] + "/v1/models").status_code == 200


def test_sixteen_concurrent_clients_each_equal_alone(servers, ref):
    """16 clients at once (half streaming), with speculation: each gets exactly its greedy text alone."""
    prompts = random_prompts(16, seed=5, length=12)
    aio = openai.AsyncOpenAI(base_url=servers["spec"] + "/v1", api_key=KEY, max_retries=0, timeout=120)

    async def one(i):
        kw = dict(model=servers["model"], prompt=prompts[i], max_tokens=24, temperature=0, stream=i % 2 == 1)
        out = await aio.completions.create(**kw, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in out if c.choices]) if i % 2 else out.choices[0].text

    async def all_of_them():
        return await asyncio.gather(*map(one, range(16)))

    assert asyncio.run(all_of_them()) == [ref(p)["text"] for p in prompts]


def raw_post(url, body, stream):
    """A POST on a bare socket (so the test decides when the client goes away); a streaming one returns once
    its first text chunk has arrived."""
    u = urlparse(url)
    sock, data = (
        socket.create_connection((u.hostname, u.port), timeout=60),
        json.dumps(body | {"stream": stream}),
    )
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {u.netloc}\r\nAuthorization: Bearer {KEY}\r\n"
    sock.sendall(
        f"{head}Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n{data}".encode()
    )
    got = b""
    while stream and b'"text": "' not in got.partition(b"data: ")[2]:
        got += sock.recv(65536)
    return sock


def test_disconnects_free_every_block_and_draft_input(servers):
    """8 streaming and 4 non-streaming clients go away mid-generation: all 12 are aborted (none runs on to
    max_tokens), and the engine is then idle with every KV block free or cached-evictable and no draft
    input left. The server serves on."""
    url, prompts = servers["spec"], random_prompts(12, seed=6)
    before = wait_for(url, lambda m: m["vllm:num_requests_running"] == 0)
    body = dict(model=servers["model"], max_tokens=200, temperature=0, ignore_eos=True)
    socks = [raw_post(url, body | {"prompt": p}, stream=i < 8) for i, p in enumerate(prompts)]
    mid = wait_for(url, lambda m: m["vllm:num_requests_running"] == 12)  # all 12 decoding
    assert (
        mid["vllm:kv_cache_usage_perc"] > 0 and mid["nanospec:num_draft_inputs"] == 12
    )  # set before running
    for s in socks:
        s.close()
    abort = 'vllm:request_success_total{finished_reason="abort"}'
    after = wait_for(url, lambda m: m[abort] - before[abort] == 12 and m["vllm:num_requests_running"] == 0)
    assert after["vllm:num_requests_waiting"] == 0 and after["vllm:kv_cache_usage_perc"] == 0
    assert after["nanospec:num_draft_inputs"] == 0
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert (
        generated < 12 * 200
        and after['vllm:request_success_total{finished_reason="length"}']
        == before['vllm:request_success_total{finished_reason="length"}']
    )
    assert complete(servers, prompt=prompts[0], max_tokens=4).choices[0].finish_reason == "length"


def test_cache_salt_isolates_the_prefix_cache(servers):
    """cached_tokens: 0 for a prompt seen only under other salts (or none), its 2 full blocks within one."""
    ids = random_prompts(1, seed=7, length=40)[0]  # 2 full blocks of 16 can come from the cache
    cached = [
        complete(servers, prompt=ids, max_tokens=2, **kw).usage.prompt_tokens_details.cached_tokens
        for kw in (dict(cache_salt="alice"), dict(cache_salt="bob"), {}, dict(cache_salt="alice"), {})
    ]
    assert cached == [0, 0, 0, 32, 32]


def test_metrics_move_by_the_exact_counts(servers):
    """One request's deltas on vLLM's metric names: prompt and generation tokens, prefix-cache queries and
    hits, one success, one TTFT / TPOT observation, and the spec-decode counters from its accept lengths."""
    url, ids = servers["spec"], random_prompts(1, seed=8, length=36)[0]
    complete(servers, prompt=ids, max_tokens=2)  # caches its 2 full blocks
    before = metrics(url)
    assert {n.partition("{")[0].removeprefix("vllm:") for n in before if n.startswith("vllm:")} >= set(
        VLLM_NAMES
    )
    got = complete(servers, prompt=ids, max_tokens=12)
    after, acc = metrics(url), got.choices[0].accept_lengths
    d = {k: after[k] - before.get(k, 0) for k in after}
    assert got.usage.prompt_tokens_details.cached_tokens == 32
    assert (
        d["vllm:prompt_tokens_total"],
        d["vllm:prefix_cache_queries_total"],
        d["vllm:prefix_cache_hits_total"],
    ) == (36, 36, 32)
    assert (
        d["vllm:generation_tokens_total"] == 12
        and d['vllm:request_success_total{finished_reason="length"}'] == 1
    )
    assert (
        d["vllm:time_to_first_token_seconds_count"] == 1 and d["vllm:inter_token_latency_seconds_count"] >= 1
    )
    assert d["vllm:spec_decode_num_drafts_total"] == len(acc) and d[
        "vllm:spec_decode_num_draft_tokens_total"
    ] == 2 * len(acc)
    assert d["vllm:spec_decode_num_accepted_tokens_total"] == sum(a - 1 for a in acc)
    for pos in (0, 1):
        assert d[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{pos}"}}'] == sum(
            a - 1 > pos for a in acc
        )


def test_serving_benchmark(servers, monkeypatch, capsys, cycle_dir, asst_dir):
    """bench.py --base-url, and --serve --compare-spec with the launcher pointed at the running servers:
    every request completes with its max_tokens (ignore_eos); each round gets a server of its side, and the
    spec / plain ratios come out."""
    tiny = ["--model", str(cycle_dir), "--workload", "nanovllm", "--num-seqs", "4", "--max-input-len", "16"]
    tiny += ["--max-output-len", "8", "--max-concurrency", "2", "--device", "cpu", "--dtype", "float32"]
    expected = sum(bench.nanovllm_workload(4, 16, 8, 0)[1])
    monkeypatch.setenv("NANOSPEC_API_KEY", KEY)
    res = bench.main([*tiny, "--base-url", servers["spec"], "--request-rate", "100"])
    assert (res["completed"], res["total_output_tokens"]) == (4, expected) and res["mean_tpot_ms"] > 0
    assert "Serving: completed 4, " in capsys.readouterr().out
    launched = []

    def launch(argv, *a, **k):
        launched.append(argv)
        return SimpleNamespace(), servers["plain" if "none" in argv else "spec"]

    monkeypatch.setattr(serve_bench, "launch", launch)
    monkeypatch.setattr(serve_bench, "stop", lambda proc: None)
    res = bench.main([*tiny, "--serve", "--compare-spec", "--assistant", str(asst_dir), "--num-steps", "2"])
    assert [a[a.index("--assistant") + 1] for a in launched] == [str(asst_dir), "none"] * 2
    assert (
        launched[0][-3:] == ["--num-steps", "2", "--adaptive-speculation"]
        and "--num-steps" not in launched[1]
    )
    assert "--no-enforce-eager" in launched[0] and launched[0][launched[0].index("--dtype") + 1] == "float32"
    on, off = res["compare"]["on"], res["compare"]["off"]
    assert on["total_output_tokens"] == off["total_output_tokens"] == expected
    out = capsys.readouterr().out
    assert "assistant on/off throughput = " in out and "mean_tpot_ms on/off " in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-num-seqs", "0"], "max_num_seqs must be >= 1, got 0"),
        (["--num-steps", "2", "--assistant", "none"], "options num_steps only apply to speculative decoding"),
        (["--dtype", "fp8"], "dtype must be one of 'auto'"),
        (["--port", "-1"], "argument --port: must be an int >= 0"),
        (["--max-n", "0"], "argument --max-n: must be an int >= 1"),
    ],
)
def test_options_are_checked_before_any_weights_load(argv, message, capsys):
    """nanospec-serve's flags go through EngineConfig's checks (or argparse's) at parse time."""
    from nanospec.serve.server import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err
