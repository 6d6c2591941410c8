"""The serving benchmark (``bench.py --serve`` / ``--base-url URL``) and the server launcher it shares with
the tests.

Requests go to ``/v1/completions`` as token-id prompts with ``stream`` and ``include_usage``, arriving as a
Poisson process at ``--request-rate`` (unset: all at once), at most ``--max-concurrency`` in flight, after one
warm-up request. The figures
follow vLLM's serving benchmark: TTFT (request sent -> first chunk with choices), ITL (gaps between chunks),
TPOT ((E2E - TTFT) / (output tokens - 1) per request, output tokens from ``usage``; the per-token figure under
speculation), E2E latency, each as mean / median / p99 in ms, plus request throughput and output tokens/s.
"""

import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time

import numpy as np

from .cli import ENGINE, SPEC

SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos")  # sent per request


def launch(argv: list[str], timeout: float = 3600, **popen):
    """Start ``python -m nanospec.serve *argv`` on a free loopback port (``--port 0``: the server prints its
    URL once it listens, so there is no port race; ``popen``: more Popen arguments). Returns (process, base
    URL); RuntimeError if it exits, or is killed after ``timeout`` s, before listening."""
    cmd = [sys.executable, "-m", "nanospec.serve", *argv, "--host", "127.0.0.1", "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, **popen)
    watchdog = threading.Timer(timeout, proc.kill)
    watchdog.start()
    for line in proc.stdout:  # its start-up output, passed on, up to the URL (nothing follows on stdout)
        if url := line.partition(" listening on ")[2].strip():
            watchdog.cancel()
            return proc, url
        print(line, end="")
    watchdog.cancel()
    raise RuntimeError(f"nanospec-serve exited with code {proc.wait()} before listening")


def stop(proc) -> None:
    """SIGTERM, then SIGKILL after 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def one_request(client, body: dict, slots=None) -> dict:
    """One streamed completion (once one of ``slots`` is free): TTFT, ITLs and E2E in s, output tokens
    (RuntimeError on an error)."""
    async with slots or asyncio.Semaphore():
        stamps = []
        tokens = 0
        t0 = time.perf_counter()
        async with client.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                data = json.loads(line[6:]) if line.startswith("data: {") else {}
                if "error" in data:
                    raise RuntimeError(data["error"]["message"])
                if data.get("choices"):  # as vLLM's client: TTFT at the first chunk with choices, then gaps
                    stamps.append(time.perf_counter())
                tokens = (data.get("usage") or {}).get("completion_tokens", tokens)
        e2e = time.perf_counter() - t0
        return dict(ttft=stamps[0] - t0, itl=np.diff(stamps).tolist(), e2e=e2e, tokens=tokens)


async def run_load(base_url, prompts, params, request_rate=None, max_concurrency=None, seed=0, api_key=None):
    """Send every request (token ids, SamplingParams) after a warm-up one; returns (results, duration s)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"}
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=None, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        base = dict(model=model, stream=True, stream_options={"include_usage": True})
        sampling = [{k: getattr(sp, k) for k in SAMPLING_KEYS} for sp in params]
        bodies = [base | s | {"prompt": p} for p, s in zip(prompts, sampling)]
        await one_request(client, bodies[0] | {"max_tokens": min(8, params[0].max_tokens)})
        slots = asyncio.Semaphore(max_concurrency or len(bodies))
        rng = random.Random(seed)
        tasks = []
        t0 = time.perf_counter()
        for body in bodies:  # Poisson arrivals: exponential gaps (vLLM's burstiness 1)
            tasks.append(asyncio.ensure_future(one_request(client, body, slots)))
            await asyncio.sleep(rng.expovariate(request_rate) if request_rate else 0)
        return await asyncio.gather(*tasks), time.perf_counter() - t0


def summarize(results: list[dict], duration: float, label: str = "") -> dict:
    """vLLM's serving figures (module docstring) from ``run_load``'s results, printed after ``label``."""
    total = sum(r["tokens"] for r in results)
    res = dict(completed=len(results), duration_s=duration, total_output_tokens=total)
    res.update(request_throughput=len(results) / duration, output_throughput=total / duration)
    tpot = [(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
    series = dict(ttft=[r["ttft"] for r in results], tpot=tpot, itl=sum((r["itl"] for r in results), []))
    for name, vals in (series | {"e2el": [r["e2e"] for r in results]}).items():
        vals = np.asarray(vals or [float("nan")]) * 1000
        res |= {f"mean_{name}_ms": vals.mean(), f"median_{name}_ms": np.median(vals)}
        res[f"p99_{name}_ms"] = np.percentile(vals, 99)
    print(f"{label}Serving: " + ", ".join(f"{k} {v:.6g}" for k, v in res.items()))
    return res


def measure(args, model_dir, assistant, prompts, params, label="", phases=False, **option) -> dict:
    """bench.py's ``measure`` over HTTP: the workload against ``--base-url``, or against nanospec-serve
    started with bench.py's engine options, ``assistant`` (DIR or None) and the LLM ``option``s (stopped
    after), so ``--compare`` runs each round on a fresh server; ``phases`` is for the in-process engine
    only. Prints the figures after ``label``; returns them (``throughput_tok_s``: output tokens/s)."""
    given = {k: getattr(args, k) for k in ENGINE + SPEC * bool(assistant)} | option
    argv = [str(model_dir), "--assistant", assistant or "none", *["--load-format=dummy"] * bool(args.shape)]
    for k, v in given.items():  # a bool as --name / --no-name; None: the server's default
        flag = f"--{'no-' * (v is False)}{k.replace('_', '-')}"
        if v is not None:
            argv += [flag] if isinstance(v, bool) else [flag, str(v)]
    proc, url = launch(argv) if args.base_url is None else (None, args.base_url)
    load = dict(request_rate=args.request_rate, max_concurrency=args.max_concurrency, seed=args.seed)
    load["api_key"] = os.environ.get("NANOSPEC_API_KEY")  # the bearer key, as for nanospec-serve
    try:
        results, duration = asyncio.run(run_load(url, prompts, params, **load))
    finally:
        if proc:
            stop(proc)
    res = summarize(results, duration, label)
    return res | dict(throughput_tok_s=res["output_throughput"], total_tokens=res["total_output_tokens"])
