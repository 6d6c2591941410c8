"""The serving benchmark (``bench.py --serve`` / ``--base-url URL``) and the server launcher it shares with
the tests.

Requests go to ``/v1/completions`` as token-id prompts with ``stream`` and ``include_usage``, arriving as a
Poisson process at ``--request-rate`` (inf: all at once), at most ``--max-concurrency`` in flight. The figures
follow vLLM's serving benchmark: TTFT (request sent -> first chunk with choices), ITL (gaps between chunks),
TPOT ((E2E - TTFT) / (output tokens - 1) per request, output tokens from ``usage``; the per-token figure under
speculation), E2E latency, each as mean / median / p99 in ms, plus request throughput and output tokens/s.
"""

import asyncio
import json
import math
import queue
import random
import re
import subprocess
import sys
import threading
import time

import numpy as np

SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos")  # sent per request


def launch(argv: list[str], timeout: float = 600.0, **popen):
    """Start ``python -m nanospec.serve *argv`` on a free loopback port (``--port 0``: the server prints its
    URL once it listens, so there is no port race; ``popen``: more Popen arguments). Returns (process, base
    URL); RuntimeError, the process stopped, if it exits or ``timeout`` s pass first."""
    cmd = [sys.executable, "-m", "nanospec.serve", *argv, "--host", "127.0.0.1", "--port", "0"]
    proc, lines = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, **popen), queue.SimpleQueue()
    threading.Thread(target=lambda: [*map(lines.put, proc.stdout), lines.put("")], daemon=True).start()
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0))
        except queue.Empty:
            line = ""
        if m := re.search(r"listening on (http://\S+)", line):
            return proc, m[1]
        if not line:
            stop(proc)
            raise RuntimeError(f"nanospec-serve did not start in {timeout:.0f} s (exit {proc.returncode})")
        print(line, end="")


def stop(proc) -> None:
    """SIGTERM, then SIGKILL after 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def one_request(client, body: dict) -> dict:
    """One streamed completion: TTFT, ITLs and E2E in s, output tokens (RuntimeError on an error)."""
    t0 = last = time.perf_counter()
    ttft, itl, tokens = None, [], 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data, now = json.loads(line[6:]), time.perf_counter()
            if "error" in data:
                raise RuntimeError(data["error"]["message"])
            if data.get("choices"):
                ttft, itl = (now - t0, itl) if ttft is None else (ttft, itl + [now - last])
                last = now
            tokens = (data.get("usage") or {}).get("completion_tokens", tokens)
    return dict(ttft=ttft, itl=itl, e2e=time.perf_counter() - t0, tokens=tokens)


async def run_load(base_url, prompts, params, request_rate=math.inf, max_concurrency=0, seed=0, api_key=None):
    """Send every request (token ids, SamplingParams) after a warm-up one; returns (results, duration s)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=None, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        base, keys = dict(model=model, stream=True, stream_options={"include_usage": True}), SAMPLING_KEYS
        bodies = [base | {k: getattr(sp, k) for k in keys} | {"prompt": p} for p, sp in zip(prompts, params)]
        await one_request(client, bodies[0] | {"max_tokens": min(8, params[0].max_tokens)})
        slots, rng, tasks = asyncio.Semaphore(max_concurrency or len(bodies)), random.Random(seed), []

        async def limited(body):
            async with slots:
                return await one_request(client, body)

        t0 = time.perf_counter()
        for body in bodies:
            tasks.append(asyncio.ensure_future(limited(body)))
            if math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def summarize(results: list[dict], duration: float) -> dict:
    """vLLM's serving figures (module docstring) from ``run_load``'s results."""
    total = sum(r["tokens"] for r in results)
    res = dict(completed=len(results), duration_s=duration, total_output_tokens=total)
    res.update(request_throughput=len(results) / duration, output_throughput=total / duration)
    tpot = [(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
    series = dict(ttft=[r["ttft"] for r in results], tpot=tpot, itl=sum((r["itl"] for r in results), []))
    for name, vals in (series | {"e2el": [r["e2e"] for r in results]}).items():
        vals = np.asarray(vals or [math.nan]) * 1000
        res.update({f"mean_{name}_ms": vals.mean(), f"median_{name}_ms": np.median(vals)})
        res[f"p99_{name}_ms"] = np.percentile(vals, 99)
    return res


def report(res: dict, label: str = "") -> None:
    print(f"{f' Serving Benchmark Result {label}':=^60}")
    for k, v in res.items():
        print(f"{k:<40}{v:>20.2f}" if isinstance(v, float) else f"{k:<40}{v:>20}")


def run(args, model_dir, assistant, prompts, params) -> dict:
    """``bench.py --serve`` (start the server with bench.py's engine options, assistant DIR or None) or
    ``--base-url URL``; ``--compare-spec`` with ``--serve``: servers with and without the assistant, rounds
    on, off, on, off, and the spec/plain ratios of the best round (by output tokens/s) of each side."""
    load = dict(request_rate=args.request_rate, max_concurrency=args.max_concurrency, seed=args.seed)
    load["api_key"] = args.api_key
    if args.base_url:
        res = summarize(*asyncio.run(run_load(args.base_url, prompts, params, **load)))
        report(res)
        return res
    engine = [str(model_dir), "--device", args.device, "--dtype", args.dtype, "--seed", str(args.seed)]
    spec = ["num_steps", "topk", "num_draft_tokens"] if assistant else []
    for k in ["max_model_len", "max_num_seqs", "max_num_batched_tokens", *spec]:
        engine += [f"--{k.replace('_', '-')}", str(getattr(args, k))] if getattr(args, k) is not None else []
    engine += ["--enforce-eager"] * args.enforce_eager + ["--load-format", "dummy"] * bool(args.shape)
    sides = [assistant, None] if args.compare == "assistant" else [assistant]
    servers = [launch(engine + ["--assistant", side or "none"]) for side in sides]
    try:
        rounds = [[], []]
        for _ in range(len(sides)):  # --compare-spec: on, off, on, off
            for side, (_, url) in enumerate(servers):
                rounds[side].append(summarize(*asyncio.run(run_load(url, prompts, params, **load))))
                report(rounds[side][-1], f"(assistant {'on' if side == 0 and assistant else 'off'}) ")
    finally:
        for proc, _ in servers:
            stop(proc)
    best = [max(r, key=lambda x: x["output_throughput"]) for r in rounds if r]
    res = best[0] | dict(rounds=rounds)
    if len(best) == 2:
        keys = ("output_throughput", "mean_tpot_ms", "mean_ttft_ms", "mean_itl_ms", "mean_e2el_ms")
        res["spec_over_plain"] = {k: best[0][k] / best[1][k] for k in keys}
        print("spec / plain: " + ", ".join(f"{k} {v:.2f}x" for k, v in res["spec_over_plain"].items()))
    return res
