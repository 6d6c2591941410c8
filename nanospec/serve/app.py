"""The ASGI app of nanospec-serve (FastAPI): the HTTP handlers over one engine thread. docs/serving.md is the
reference of what it serves.

``build_app(llm, model_name)`` is the factory a front end reuses (``nanospec-serve``'s ``main``, or a Ray
Serve replica that holds one ``LLM``): it starts the engine thread itself, which owns the LLM from then on."""

import asyncio
import json
import secrets
import time

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from .engine import Engine, Job, Metrics
from .logprobs import chat_logprobs, completion_logprobs
from .protocol import MAX_BODY, ApiError, Detokenizer, Parsed, field_of, parse, read_json, tokenize_ids
from .tools import CallStream, field_error


def event(data: dict) -> dict:
    """One server-sent event as an ASGI body message."""
    data = f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()
    return {"type": "http.response.body", "body": data, "more_body": True}


class Reply(StreamingResponse):
    """The answer to one completion request whose choices the engine has accepted. Streamed: SSE events (an
    error after the start as one more event), then [DONE]. Not streamed: one JSON body once every choice
    has finished. Either way Starlette cancels the reply when the client disconnects (it listens for that
    while a StreamingResponse runs, under ASGI spec < 2.4 as uvicorn advertises), and what has not finished
    is aborted (its KV blocks and next input go) before the next engine step."""

    def __init__(self, engine: Engine, job: Job, parsed: Parsed, chat: bool, model_name: str):
        super().__init__((), media_type="text/event-stream")
        self.engine = engine
        self.job = job
        self.parsed = parsed
        self.chat = chat
        self.tok = engine.llm.tokenizer
        self.finals = [None] * len(job.choices)  # each choice's LLM.output_dict once finished
        self.counts = [0] * len(job.choices)  # tokens received per choice
        self.offsets = [0] * len(job.choices)  # streamed completions: text_offset of the next token
        # a chat with tools: each choice's tool calls, read from its text (or token ids) as it grows
        self.calls = [parsed.tools and CallStream(parsed.tools, self.tok) for _ in job.choices]
        kind = "chat.completion" if chat else "text_completion"
        kind += ".chunk" if parsed.stream and chat else ""
        self.head = dict(id=f"cmpl-{secrets.token_hex(8)}", object=kind, created=int(time.time()))
        self.head["model"] = model_name

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            if None in self.finals and self.engine.dead is None:
                self.engine.put("abort", self.job)

    async def updates(self):
        """(choice index, new token ids, their logprob dicts, the prompt's (first update, echo), final output
        dict or None) as the engine sends them; with ``score_only`` the generated token is dropped."""
        while None in self.finals:
            kind, *payload = await self.job.messages.get()
            if kind == "fault":
                raise ApiError(500, payload[0])
            i, new, logprobs, prompt_logprobs, final = payload
            if self.parsed.score_only:  # echo with max_tokens 0: the token generated to score the prompt goes
                new = []
                logprobs = None if logprobs is None else []
                if final is not None:
                    final = final | dict(token_ids=[], text="", logprobs=logprobs)
            self.finals[i] = final
            self.counts[i] += len(new)
            yield i, new, logprobs, prompt_logprobs, final

    def choice(self, i: int, text: str, final: dict | None, ids=(), logprobs=None, prompt_logprobs=None):
        """One choice of the answer or of a chunk: its ``text`` (echo: the caller put the prompt first), the
        logprobs of its tokens ``ids`` (and of the prompt's, echo) when asked."""
        c = {"index": i, "finish_reason": final and final["finish_reason"]}
        calls = self.calls[i]
        if calls and self.parsed.stream:
            c["delta"] = calls.delta(text, final is not None, ids)
        elif calls:
            c["message"] = calls.message(text, ids)
        elif self.chat and self.parsed.stream:
            c["delta"] = {"content": text} if text else {}
        elif self.chat:
            c["message"] = {"role": "assistant", "content": text}
        else:
            c |= {"text": text, "logprobs": None}
        if logprobs is not None and self.chat:
            c["logprobs"] = {"content": chat_logprobs(self.tok, ids, logprobs, self.parsed.logprobs)}
        elif logprobs is not None:
            if prompt_logprobs is not None:
                ids = self.job.choices[i].prompt_ids + list(ids)
                logprobs = prompt_logprobs + logprobs
            c["logprobs"] = completion_logprobs(self.tok, ids, logprobs, self.offsets[i])
            self.offsets[i] += sum(map(len, c["logprobs"]["tokens"]))
        if calls and calls.sent and c["finish_reason"] == "stop":  # the reply ended after its tool calls
            c["finish_reason"] = "tool_calls"
        if final and "accept_lengths" in final:
            c["accept_lengths"] = final["accept_lengths"]  # nanospec's extension: per verify step
        return c

    def usage(self) -> dict:
        """Tokens delivered (a finished choice: its final count, after any stop cut)."""
        prompt = sum(map(len, self.parsed.prompts))
        done = sum(len(f["token_ids"]) if f else k for f, k in zip(self.finals, self.counts))
        out = dict(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)
        if None in self.finals:
            return out
        n = len(self.finals) // len(self.parsed.prompts)  # a prompt's cached tokens: its first choice's
        cached = sum(f["num_cached_tokens"] for f in self.finals[::n])
        return out | {"prompt_tokens_details": {"cached_tokens": cached}}

    def chunk(self, choices: list[dict]) -> dict:
        """One streamed chunk; with include_usage its ``usage`` is null, or the usage so far with
        ``continuous_usage_stats`` (vLLM's)."""
        if not self.parsed.include_usage:
            return event(self.head | {"choices": choices})
        usage = self.usage() if self.parsed.continuous_usage else None
        return event(self.head | {"choices": choices, "usage": usage})

    async def stream_response(self, send):
        if not self.parsed.stream:
            return await self.send_whole(send)
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        detokenizers = [Detokenizer(self.engine.llm.tokenizer, c.params.stop) for c in self.job.choices]
        try:
            for i in range(len(self.finals)) if self.chat else []:
                c = {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                await send(self.chunk([c]))
            echoed = [False] * len(self.finals)
            async for i, new, logprobs, prompt_logprobs, final in self.updates():
                text = detokenizers[i].push(new, final and final["text"])
                if self.parsed.echo and not echoed[i]:  # the prompt leads the choice's first chunk
                    echoed[i] = True
                    text = self.tok.decode(self.job.choices[i].prompt_ids) + text
                if text or final or logprobs or self.calls[i]:  # (tool calls: every token id is read)
                    c = self.choice(i, text, final, new, logprobs, prompt_logprobs)
                    if c.get("delta") != {} or final or logprobs:  # (tool-call text may be held back)
                        await send(self.chunk([c]))
            if self.parsed.include_usage:
                await send(event(self.head | {"choices": [], "usage": self.usage()}))
        except ApiError as e:
            await send(event(e.body()))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    async def send_whole(self, send) -> None:
        """The non-streamed answer: its status is known once every choice has finished (or failed)."""
        try:
            async for _ in self.updates():
                pass
            choices = []
            for i, f in enumerate(self.finals):
                text = f["text"]
                prompt_logprobs = f.get("prompt_logprobs") if self.parsed.echo else None
                if self.parsed.echo:
                    text = self.tok.decode(self.job.choices[i].prompt_ids) + text
                choices.append(self.choice(i, text, f, f["token_ids"], f.get("logprobs"), prompt_logprobs))
            status = 200
            body = self.head | {"choices": choices, "usage": self.usage()}
        except ApiError as e:
            status = e.status
            body = e.body()
        data = json.dumps(body, ensure_ascii=False).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})


class Handlers:
    """The endpoints over one running ``Engine``; the tokenizer and chat template run off the event loop."""

    def __init__(self, engine: Engine, model_name: str, api_key: str | None, max_n: int):
        self.engine = engine
        self.tok = engine.llm.tokenizer
        self.max_len = engine.llm.config.max_model_len
        self.model_name = model_name
        self.api_key = api_key
        self.max_n = max_n
        self.card = dict(id=model_name, object="model", created=int(time.time()), owned_by="nanospec")
        self.card["max_model_len"] = self.max_len

    def auth(self, request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if self.api_key and not secrets.compare_digest(given, f"Bearer {self.api_key}".encode()):
            raise ApiError(401, "a valid API key is required: send the header 'Authorization: Bearer KEY'")

    async def read(self, request: Request) -> dict:
        """The JSON body (parsed on a worker thread: up to 4 MiB)."""
        if int(request.headers.get("content-length") or MAX_BODY + 1) > MAX_BODY:  # and h11 reads no more
            raise ApiError(400, f"the request body must have a Content-Length of at most {MAX_BODY} bytes")
        return await asyncio.to_thread(read_json, await request.body())

    async def complete(self, request: Request, chat: bool):
        body = await self.read(request)
        args = (body, chat, self.tok, self.model_name, self.max_len, self.max_n, self.engine.max_waiting)
        parsed = await asyncio.to_thread(parse, *args)
        if parsed.params[0].structured_outputs is not None:  # every choice shares it
            await asyncio.to_thread(self.compile_grammar, parsed.params[0], parsed.constraint_field)
        job = Job(parsed.prompts, parsed.params, asyncio.get_running_loop(), asyncio.Queue())
        self.engine.put("add", job)
        kind, *message = await job.messages.get()
        if kind == "busy":  # as servers behind load balancers answer: try again in a second
            raise ApiError(503, message[0], headers={"Retry-After": "1"})
        if kind != "ok":
            raise ApiError(400 if kind == "bad" else 500, message[0], field_of(message[0], "max_tokens"))
        return Reply(self.engine, job, parsed, chat, self.model_name)

    def compile_grammar(self, params, field: str) -> None:
        """Build the constraint's matcher for the model's tokenizer on a worker thread, before the request is
        queued: a slow compile never holds up the engine thread or the event loop. A 400 naming the request
        ``field`` that gave the constraint if it fails."""
        try:
            self.engine.llm.compile_grammar(params)
        except ValueError as e:
            raise field_error(e, field) from None

    async def completions(self, request: Request):
        return await self.complete(request, chat=False)

    async def chat_completions(self, request: Request):
        return await self.complete(request, chat=True)

    async def tokenize(self, request: Request) -> dict:
        """vLLM's /tokenize: {count, max_model_len, tokens, token_strs (with return_token_strs)}."""
        body = await self.read(request)
        ids = await asyncio.to_thread(tokenize_ids, self.tok, body)
        strs = self.tok.convert_ids_to_tokens(ids) if body.get("return_token_strs") else None
        return {"count": len(ids), "max_model_len": self.max_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, request: Request) -> dict:
        """vLLM's /detokenize: {tokens} -> {prompt} (special tokens kept)."""
        ids = (await self.read(request)).get("tokens")
        if not (isinstance(ids, list) and all(type(t) is int and 0 <= t < len(self.tok) for t in ids)):
            raise ApiError(400, f"tokens must be a list of token ids in [0, {len(self.tok)})", "tokens")
        return {"prompt": await asyncio.to_thread(self.tok.decode, ids)}

    def tokenizer_info(self) -> dict:
        """vLLM's /tokenizer_info (lm-eval reads eos_token and chat_template from it)."""
        special = {k: getattr(self.tok, k) for k in ("eos_token", "bos_token", "pad_token", "chat_template")}
        return special | {"tokenizer_class": type(self.tok).__name__, "model_max_length": self.max_len}

    def health(self) -> Response:
        return Response(status_code=503 if self.engine.dead else 200)

    def metrics(self) -> Response:
        return Response(generate_latest(self.engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def models(self) -> dict:
        return {"object": "list", "data": [self.card]}


def build_app(llm, model_name: str, api_key: str | None = None, max_n: int = 16, max_waiting: int = 1024):
    """The FastAPI app over ``llm`` (an ``LLM``, or anything with its ``add_request`` / ``get_request`` /
    ``abort_request`` / ``step`` / ``has_unfinished`` / ``stats`` / ``output_dict``, ``tokenizer`` and
    ``config``). Starts the engine thread (``app.state.engine``), which owns ``llm`` from then on. Clients
    name the model ``model_name``; ``api_key``: every endpoint but /health needs it; ``max_n``: the largest
    ``n``; ``max_waiting``: the most requests that may wait (more: 503)."""
    num_positions = llm.config.num_steps if llm.config.speculative else 0
    engine = Engine(llm, Metrics(model_name, num_positions), max_waiting).start()
    handlers = Handlers(engine, model_name, api_key, max_n)
    app = FastAPI(title="nanospec", openapi_url=None)
    app.state.engine = engine
    fail = lambda e: JSONResponse(e.body(), e.status, headers=e.headers)  # noqa: E731
    app.add_exception_handler(ApiError, lambda _, e: fail(e))
    app.add_exception_handler(HTTPException, lambda _, e: fail(ApiError(e.status_code, str(e.detail))))
    app.add_exception_handler(Exception, lambda _, e: fail(ApiError(500, f"internal error: {e!r}")))
    app.get("/health")(handlers.health)
    api = APIRouter(dependencies=[Depends(handlers.auth)])
    api.get("/metrics")(handlers.metrics)
    api.get("/v1/models")(handlers.models)
    api.post("/v1/completions")(handlers.completions)
    api.post("/v1/chat/completions")(handlers.chat_completions)
    api.post("/tokenize")(handlers.tokenize)
    api.post("/detokenize")(handlers.detokenize)
    api.get("/tokenizer_info")(handlers.tokenizer_info)
    app.include_router(api)
    return app
