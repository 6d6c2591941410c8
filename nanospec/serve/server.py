"""nanospec-serve: the OpenAI API over one nanospec engine (FastAPI + uvicorn, Prometheus metrics).

    nanospec-serve [MODEL_DIR] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--assistant DIR|default|none]
    python -m nanospec.serve ...           # the same; every LLM option is a --kebab-case flag (--help)

--assistant auto (the default) is the shipped assistant on the default model and none on any other.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health (200; 503 once the
engine thread has died), GET /metrics (vLLM's metric names). With --api-key (or NANOSPEC_API_KEY) every
endpoint but /health needs `Authorization: Bearer KEY`.

One engine thread owns the LLM and loops ``step()``; HTTP handlers never call the engine: they put work on a
thread-safe queue and read their request's updates from an asyncio queue that the engine thread fills through
``loop.call_soon_threadsafe``. A client that goes away (streaming or not) is aborted before the next engine
step, which releases its KV blocks and draft input. Every option is checked before any weights load. The
handlers check the JSON themselves with the engine's own checks, so bad input is a 400 (FastAPI's 422 never
comes up).
"""

import argparse
import asyncio
import functools
import importlib
import json
import os
import queue
import secrets
import socket
import threading
import time
from dataclasses import fields

from ..config import EngineConfig
from ..sampling_params import SamplingParams
from ..tools.cli import number, or_error, parser

MAX_BODY, MAX_STOP, MAX_STOP_LEN = 1 << 22, 16, 256  # request body bytes, stop strings, characters per stop
# fields that would change the output and that nanospec does not implement, with the values that mean "off"
OFF = dict.fromkeys("logprobs top_logprobs prompt_logprobs echo suffix tools functions logit_bias min_tokens "
                    "presence_penalty frequency_penalty use_beam_search response_format".split(),
                    (None, 0, "", [], {}, {"type": "text"}))  # fmt: skip
# vLLM's histogram buckets (s): time to first token, then per-token latencies
TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1,
    2.5,
    5,
    7.5,
    10,
    20,
    40,
    80,
    160,
    640,
    2560,
]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80]


class ApiError(Exception):
    """An error for the client: HTTP ``status``, the message, and the request field it is about."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param

    def body(self) -> dict:
        """The OpenAI error schema."""
        kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError"}.get(self.status)
        return {"error": dict(message=str(self), type=kind or "APIError", param=self.param, code=self.status)}


class Metrics:
    """vLLM's Prometheus metrics, by its names and meanings (vllm/v1/metrics/loggers.py and
    vllm/v1/spec_decode/metrics.py), labelled ``model_name`` and ``engine``; the spec-decode counters exist
    only with an assistant (``num_positions`` = num_steps). The time-per-output-token histogram is
    ``inter_token_latency_seconds``, vLLM's name for it since 0.11 (one observation per engine step that
    delivers tokens). Plus ``nanospec:num_draft_inputs`` (requests holding a draft input: 0 when idle)."""

    def __init__(self, model_name: str, num_positions: int):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = reg = CollectorRegistry()
        labels = {"model_name": model_name, "engine": "0"}

        def make(cls, name, doc, extra=(), **kw):
            m = cls(name if ":" in name else "vllm:" + name, doc, [*labels, *extra], registry=reg, **kw)
            return m if extra else m.labels(**labels)

        self.running = make(Gauge, "num_requests_running", "Number of requests in model execution batches.")
        self.waiting = make(Gauge, "num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = make(Gauge, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.draft_inputs = make(Gauge, "nanospec:num_draft_inputs", "Requests holding a draft input.")
        self.prompt_tokens = make(Counter, "prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = make(Counter, "generation_tokens", "Number of generation tokens processed.")
        self.queries = make(Counter, "prefix_cache_queries", "Prefix cache queries, in queried tokens.")
        self.hits = make(Counter, "prefix_cache_hits", "Prefix cache hits, in cached tokens.")
        success = make(Counter, "request_success", "Count of processed requests.", ["finished_reason"])
        self.success = {r: success.labels(**labels, finished_reason=r) for r in ("stop", "length", "abort")}
        self.ttft = make(Histogram, "time_to_first_token_seconds", "Time to 1st token.", buckets=TTFT_BUCKETS)
        self.itl = make(Histogram, "inter_token_latency_seconds", "Inter-token latency.", buckets=ITL_BUCKETS)
        if num_positions:
            self.drafts = make(Counter, "spec_decode_num_drafts", "Number of spec decoding drafts.")
            self.draft_tokens = make(Counter, "spec_decode_num_draft_tokens", "Number of draft tokens.")
            self.accepted = make(Counter, "spec_decode_num_accepted_tokens", "Number of accepted tokens.")
            name, doc = "spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position."
            per_pos = make(Counter, name, doc, ["position"])
            self.per_pos = [per_pos.labels(**labels, position=str(i)) for i in range(num_positions)]


class Choice:
    """One choice of one HTTP request (its own engine request): the handler's asyncio queue, and what the
    engine thread has sent of it (``t_last``: when it last sent tokens; until then when the request came).
    ``post`` (engine thread): "ok" (accepted), "bad" / "fault" (a 400 / 500 message) or "tokens" (new token
    ids, and once it has finished its ``LLM.output_dict``, else None)."""

    def __init__(self, index: int, prompt_ids: list[int], params: SamplingParams, q: asyncio.Queue, loop):
        self.prompt_ids, self.params, self.t_last = prompt_ids, params, time.perf_counter()
        self.req, self.sent, self.num_accept = None, 0, 0
        self.post = lambda kind, payload=None: loop.call_soon_threadsafe(q.put_nowait, (index, kind, payload))


class Engine:
    """The thread (started here) that owns the ``LLM``: takes the adds and aborts from ``inbox`` (blocking
    there when idle), runs one ``step()``, sends every live choice its new tokens, updates the metrics, again.
    ``dead``: the exception that ended it, or None."""

    def __init__(self, llm, metrics: Metrics):
        self.llm, self.metrics, self.live, self.inbox, self.dead = llm, metrics, {}, queue.SimpleQueue(), None
        threading.Thread(target=self._run, name="nanospec-engine", daemon=True).start()

    def put(self, kind: str, choices: list[Choice]) -> None:
        """Queue "add" or "abort" for ``choices``; ApiError 500 once the engine thread has died."""
        self.inbox.put((kind, choices))
        if self.dead is not None:  # the dying thread sets ``dead`` before its last look at the inbox
            raise ApiError(500, f"the engine stopped: {self.dead!r}")

    def _run(self) -> None:
        try:
            while True:
                self._drain(block=not self.llm.has_unfinished())
                self.llm.step()
                self._publish()
        except BaseException as e:
            self.dead, waiting = e, list(self.live.values())  # a put after this raises: each waiter is told
            while not self.inbox.empty():
                kind, choices = self.inbox.get()
                waiting += choices if kind == "add" else []
            for c in waiting:
                c.post("fault", f"the engine failed: {e!r}")
            raise

    def _drain(self, block: bool) -> None:
        while block or not self.inbox.empty():  # waits for the first message only when idle
            (kind, choices), block = self.inbox.get(), False
            if kind == "abort":  # those still running: finished ones have left ``live``
                aborted = [c.req.request_id for c in choices if c.req and self.live.pop(c.req.request_id, 0)]
                self.metrics.success["abort"].inc(sum(map(self.llm.abort_request, aborted)))
                continue
            try:  # the choices differ only in their seeds (checked by the handler): one fails, the first does
                for c in choices:
                    self.llm.add_request(c.prompt_ids, c.params)
                    c.req = self.llm.scheduler.waiting[-1]
                    self.live[c.req.request_id] = c
                choices[0].post("ok")
            except (ValueError, TypeError) as e:
                choices[0].post("bad", str(e))

    def _publish(self) -> None:
        llm, m, now = self.llm, self.metrics, time.perf_counter()
        for rid, c in list(self.live.items()):
            r, new = c.req, c.req.output_token_ids[c.sent :]  # the request and its undelivered tokens
            if not new and not r.is_finished:
                continue
            (m.itl if c.sent else m.ttft).observe(now - c.t_last)  # the first tokens: since the arrival
            if c.sent == 0:  # its prefill is done: vLLM counts the prompt and the prefix-cache lookup here
                m.prompt_tokens.inc(len(r.prompt_token_ids))
                m.queries.inc(len(r.prompt_token_ids))
                m.hits.inc(r.num_cached_tokens or 0)
            c.sent, c.t_last = c.sent + len(new), now
            m.generation_tokens.inc(len(new))
            if llm.worker is not None:  # a draft per speculative step, a - 1 of its tokens accepted
                acc, drafted = r.accept_lengths[c.num_accept :], r.draft_lengths[c.num_accept :]
                c.num_accept = len(r.accept_lengths)
                m.drafts.inc(len(acc))
                m.draft_tokens.inc(sum(drafted))
                m.accepted.inc(sum(acc) - len(acc))
                for pos, counter in enumerate(m.per_pos):
                    counter.inc(sum(a - 1 > pos for a in acc))
            if r.is_finished:
                del self.live[rid]
                m.success[r.finish_reason].inc()
            c.post("tokens", (new, llm.output_dict(r) if r.is_finished else None))
        m.waiting.set(len(llm.scheduler.waiting))
        m.kv_usage.set(1 - llm.scheduler.allocator.num_free / llm.scheduler.allocator.num_usable)
        m.draft_inputs.set(len(llm.worker.draft_inputs) if llm.worker is not None else 0)
        m.running.set(len(llm.scheduler.running))  # last: a reader that sees it sees this step's other gauges


class Detokenizer:
    """Incremental detokenization for streaming (vLLM's prefix / read offsets): an update decodes only the
    tokens since the last emitted text plus the window before them; text that ends in a partial UTF-8
    character waits, and so do the last ``max(len(stop)) - 1`` characters while a stop string could still cut
    them. At the end the engine's final text is sent on from where the deltas stopped: they add up to it."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tok, self.ids, self.prefix, self.read, self.text, self.sent = tokenizer, [], 0, 0, "", 0
        self.hold = max(map(len, stop), default=1) - 1

    def push(self, new_ids: list[int], final_text: str | None) -> str:
        """Add tokens; returns the text that is safe to send now (all the rest once ``final_text`` is set)."""
        self.ids += new_ids
        if final_text is None:
            before = self.tok.decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
            text = self.tok.decode(self.ids[self.prefix :], skip_special_tokens=True)
            if len(text) > len(before) and not text.endswith("\ufffd"):
                self.text += text[len(before) :]
                self.prefix, self.read = self.read, len(self.ids)
        text = self.text if final_text is None else final_text
        delta = text[self.sent : max(len(text) - (self.hold if final_text is None else 0), 0)]
        self.sent += len(delta)
        return delta


def build_app(engine: Engine, model_name: str, api_key: str | None = None, max_n: int = 16):
    """The FastAPI app over an ``Engine`` (its thread started by the caller): the module docstring's
    endpoints; README "Serving over HTTP" lists the fields, limits and metrics."""
    from fastapi import APIRouter, Depends, FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.exceptions import HTTPException

    tok, max_len, created = engine.llm.tokenizer, engine.llm.config.max_model_len, int(time.time())
    app = FastAPI(title="nanospec", openapi_url=None)
    fail = lambda e: JSONResponse(e.body(), e.status)  # noqa: E731
    app.add_exception_handler(ApiError, lambda _, e: fail(e))
    app.add_exception_handler(HTTPException, lambda _, e: fail(ApiError(e.status_code, str(e.detail))))
    app.add_exception_handler(Exception, lambda _, e: fail(ApiError(500, f"internal error: {e!r}")))

    def auth(request: Request):
        given = request.headers.get("authorization", "").encode()
        if api_key and not secrets.compare_digest(given, f"Bearer {api_key}".encode()):
            raise ApiError(401, "a valid API key is required: send the header 'Authorization: Bearer KEY'")

    api = APIRouter(dependencies=[Depends(auth)])
    app.get("/health")(lambda: Response(status_code=503 if engine.dead else 200))
    prom = lambda: Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)  # noqa: E731
    api.get("/metrics")(prom)
    card = dict(id=model_name, object="model", created=created, owned_by="nanospec", max_model_len=max_len)
    api.get("/v1/models")(lambda: {"object": "list", "data": [card]})

    def prompt_ids(prompt, chat: bool) -> list[int]:
        if chat:
            ok = isinstance(prompt, list) and prompt and all(type(m) is dict for m in prompt)
            if not (ok and all(type(m.get("role")) is type(m.get("content")) is str for m in prompt)):
                raise ApiError(400, "messages must be a list of {role: str, content: str}", "messages")
            if not tok.chat_template:
                raise ApiError(400, "this model has no chat template: use /v1/completions", "messages")
            try:  # the template holds its special tokens: encoded below as LLM.generate encodes a string
                prompt = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            except Exception as e:  # the template refuses the conversation (a Jinja error)
                raise ApiError(400, f"messages: the chat template refused them: {e}", "messages") from None
        if isinstance(prompt, str) and prompt:
            return tok.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt
        raise ApiError(400, "prompt must be a non-empty string or a non-empty list of token ids", "prompt")

    def field_of(message: str, max_tokens_key: str) -> str | None:
        """The request field an engine message names ("SamplingParams.top_p must ..." -> "top_p")."""
        name = message.partition("SamplingParams.")[2] or message  # the engine's: "prompt ..." or this
        return max_tokens_key if name.startswith("max_tokens") else name.partition(" ")[0]

    def parse(body, chat: bool):
        """(prompt ids, one SamplingParams per choice, stream, include_usage); ApiError naming a bad field
        (the engine's own checks and messages)."""
        if body.get("model") not in (None, model_name):
            raise ApiError(404, f"the model {body['model']!r} does not exist (here: {model_name})", "model")
        get = lambda k, default=None: default if body.get(k) is None else body[k]  # noqa: E731
        n, stream, opts, seed = get("n", 1), get("stream", False), get("stream_options", {}), get("seed")
        bad = [k for k, off in OFF.items() if body.get(k) not in off] + ["best_of"] * (get("best_of", n) != n)
        if bad:
            raise ApiError(400, f"not supported by nanospec (they would change the output): {bad}", bad[0])
        if type(n) is not int or not 1 <= n <= max_n:
            raise ApiError(400, f"n must be an int in [1, {max_n}] (--max-n), got {n!r}", "n")
        if type(stream) is not bool or not isinstance(opts, dict):
            raise ApiError(400, "stream must be a bool and stream_options an object", "stream")
        ids = prompt_ids(body.get("messages") if chat else body.get("prompt"), chat)
        key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
        max_tokens = get(key, max_len - len(ids))
        if len(ids) >= max_len:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; max_model_len is {max_len}", "prompt")
        if type(max_tokens) is int and len(ids) + max_tokens > max_len:
            raise ApiError(400, f"the prompt's {len(ids)} tokens + {key} {max_tokens} exceed max_model_len "
                           f"{max_len}", key)  # fmt: skip
        stop = [body["stop"]] if isinstance(body.get("stop"), str) else get("stop", [])
        if type(stop) is not list or len(stop) > MAX_STOP or any(len(str(x)) > MAX_STOP_LEN for x in stop):
            raise ApiError(400, f"stop: a string or <= {MAX_STOP} strings of <= {MAX_STOP_LEN} chars", "stop")
        kw = dict(
            temperature=get("temperature", 1.0),
            top_p=get("top_p", 1.0),
            top_k=get("top_k", -1) or -1,
            ignore_eos=get("ignore_eos", False),
            stop=stop,
            stop_token_ids=get("stop_token_ids"),
            cache_salt=get("cache_salt"),
            max_tokens=max_tokens,
        )  # OpenAI's defaults; top_k 0 is off
        try:  # choice i samples with seed + i: n different samples, each reproducible alone
            params = [SamplingParams(**kw, seed=seed + i if type(seed) is int else seed) for i in range(n)]
        except (TypeError, ValueError) as e:
            raise ApiError(400, str(e), field_of(str(e), key)) from None
        return ids, params, stream, opts.get("include_usage") is True

    async def serve(request: Request, chat: bool):
        if int(request.headers.get("content-length") or MAX_BODY + 1) > MAX_BODY:  # and h11 reads no more
            raise ApiError(400, f"the request body must have a Content-Length of at most {MAX_BODY} bytes")
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        ids, params, stream, include_usage = parse(body, chat)
        q, n, loop = asyncio.Queue(), len(params), asyncio.get_running_loop()
        choices, finals = [Choice(i, ids, p, q, loop) for i, p in enumerate(params)], [None] * n
        engine.put("add", choices)
        _, kind, message = await q.get()
        if kind != "ok":
            raise ApiError(400 if kind == "bad" else 500, message, field_of(message, "max_tokens"))
        obj = ("chat.completion" if chat else "text_completion") + (".chunk" if stream and chat else "")
        head = dict(id=f"cmpl-{secrets.token_hex(8)}", object=obj, created=int(time.time()), model=model_name)

        async def updates():
            while None in finals:
                i, kind, payload = await q.get()
                if kind == "fault":
                    raise ApiError(500, payload)
                new, finals[i] = payload
                yield i, new, finals[i]

        def choice(i, text, final):
            c = {"index": i, "finish_reason": final and final["finish_reason"]}
            if chat and stream:
                c["delta"] = {"content": text} if text else {}
            elif chat:
                c["message"] = {"role": "assistant", "content": text}
            else:
                c |= {"text": text, "logprobs": None}
            if final and engine.llm.worker is not None:
                c["accept_lengths"] = final["accept_lengths"]  # nanospec's extension: per verify step
            return c

        def usage():
            done = sum(len(f["token_ids"]) for f in finals)
            out = dict(prompt_tokens=len(ids), completion_tokens=done, total_tokens=len(ids) + done)
            return out | {"prompt_tokens_details": {"cached_tokens": finals[0]["num_cached_tokens"]}}

        def event(data: dict) -> dict:
            data = f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()
            return {"type": "http.response.body", "body": data, "more_body": True}

        class Reply(StreamingResponse):
            """Streamed: SSE events (an error after the start as one more event), then [DONE]. Not streamed:
            one JSON body, its status known once the answer is. Either way Starlette cancels the reply when
            the client disconnects, and what has not finished is aborted (its KV blocks and draft input go)
            before the next engine step."""

            async def __call__(self, scope, receive, send):
                try:
                    await super().__call__(scope, receive, send)
                finally:
                    if None in finals and engine.dead is None:
                        engine.put("abort", choices)

            async def stream_response(self, send):
                if not stream:
                    try:
                        async for _ in updates():
                            pass
                        out = [choice(i, f["text"], f) for i, f in enumerate(finals)]
                        status, out = 200, head | {"choices": out, "usage": usage()}
                    except ApiError as e:
                        status, out = e.status, e.body()
                    return await JSONResponse(out, status)({"type": "http"}, None, send)
                await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                detoks = [Detokenizer(tok, p.stop) for p in params]
                extra = {"usage": None} if include_usage else {}
                try:
                    for i in range(n) if chat else []:
                        c = {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                        await send(event(head | {"choices": [c]} | extra))
                    async for i, new, final in updates():
                        if (text := detoks[i].push(new, final and final["text"])) or final:
                            await send(event(head | {"choices": [choice(i, text, final)]} | extra))
                    if include_usage:
                        await send(event(head | {"choices": [], "usage": usage()}))
                except ApiError as e:
                    await send(event(e.body()))
                await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

        return Reply((), media_type="text/event-stream")

    for path, chat in (("/v1/completions", False), ("/v1/chat/completions", True)):
        api.post(path)(functools.partial(serve, chat=chat))
    app.include_router(api)
    return app


def make_app(llm, model_name: str, api_key: str | None = None, max_n: int = 16):
    """``build_app`` over ``llm``, its engine thread started: what ``nanospec-serve`` serves (and each Ray
    Serve replica of ``nanospec.ray.build_app``)."""
    engine = Engine(llm, Metrics(model_name, llm.config.num_steps if llm.worker is not None else 0))
    return build_app(engine, model_name, api_key, max_n)


def parse_args(argv=None):
    """``nanospec-serve``'s options; the engine's go through ``EngineConfig``'s own checks here, before any
    weights load. Returns (parser, args, LLM keyword arguments)."""
    from ..mtp.worker import DEFAULT_ASSISTANT

    ap, a = parser("nanospec-serve", __doc__)
    a("model", nargs="?", help="HF-format model dir (default: SmolLM2-135M-Instruct)")
    a("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    a("--port", type=number(int, 0), default=8000, help="0: any free port (printed once listening)")
    a("--api-key", default=os.environ.get("NANOSPEC_API_KEY"), help="bearer key (env NANOSPEC_API_KEY)")
    a("--max-n", type=number(int, 1), default=16, help="largest `n` of a request")
    engine_fields = [f for f in fields(EngineConfig) if f.name not in ("model", "trace")]
    for f in engine_fields:  # every LLM option, as --kebab-case; EngineConfig checks the values below
        typ = {int: int, int | None: int, float: float}.get(f.type, str)
        kw = dict(action=argparse.BooleanOptionalAction) if f.type in (bool, bool | None) else dict(type=typ)
        default = "auto" if f.name == "assistant" else f.default
        a("--" + f.name.replace("_", "-"), default=default, help=f"LLM({f.name}=...)", **kw)
    args = ap.parse_args(argv)
    kw = {f.name: getattr(args, f.name) for f in engine_fields}
    shipped = args.model is None and (DEFAULT_ASSISTANT / "config.json").exists()
    kw["assistant"] = dict(auto="default" if shipped else None, none=None).get(args.assistant, args.assistant)
    or_error(ap, "", EngineConfig, model=args.model, **kw)
    return ap, args, kw


def main(argv=None) -> None:
    """Check the options, bind the port, load the engine, then listen and print ``listening on URL``."""
    ap, args, kw = parse_args(argv)
    hint = "the server needs the `serve` extra (pip install -e '.[serve]'): "
    uvicorn = or_error(ap, hint, importlib.import_module, "uvicorn", errors=ImportError)

    from .. import LLM, loader

    # bound before the weights load (a taken port fails at once), listening once the engine is ready; a port
    # over 65535: OverflowError
    where, sock = f"cannot listen on --host {args.host} --port {args.port}: ", socket.socket()  # IPv4
    or_error(ap, where, sock.bind, (args.host, args.port), errors=(OSError, OverflowError))
    loader.configure_cpu_threads()
    llm = or_error(ap, "", LLM, args.model, errors=ValueError, **kw)
    name = args.model or loader.DEFAULT_MODEL_NAME  # what clients send as `model`
    app = make_app(llm, name, args.api_key, args.max_n)
    sock.listen(2048)
    host, port = sock.getsockname()
    print(f"nanospec-serve: {name} listening on http://{host}:{port}", flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
