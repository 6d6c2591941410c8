"""The OpenAI request shapes nanospec-serve reads (the API reference's /v1/completions and
/v1/chat/completions, vLLM's /tokenize) and the text it streams back. Functions of the JSON body and the HF
tokenizer: no engine and no HTTP, so the server runs them off its event loop and tests call them directly."""

import json
from dataclasses import dataclass

from ..sampling_params import SamplingParams
from .errors import ApiError
from .tools import ToolCalls, read_tools

MAX_BODY = 1 << 22  # request body bytes
MAX_STOP = 16  # stop strings per request
MAX_STOP_LEN = 256  # characters per stop string
# fields that would change the output and that nanospec does not implement, with the values that mean "off"
REFUSED = dict.fromkeys(
    "prompt_logprobs suffix functions logit_bias min_tokens presence_penalty frequency_penalty min_p "
    "use_beam_search bad_words allowed_token_ids".split(),
    (None, 0, "", [], {}),
)
REFUSED["repetition_penalty"] = (None, 1)


@dataclass
class Parsed:
    """A checked completion request. ``params`` holds n SamplingParams per prompt, in choice order: choice
    ``prompt_index * n + j`` samples with seed + j (as vLLM numbers them). ``logprobs``: top logprobs per
    token (completions' ``logprobs``, chat's ``top_logprobs``), or None; ``echo``: the prompt comes first in
    the text and the logprobs; ``score_only``: ``max_tokens`` 0 with echo (the prompt is scored, nothing is
    generated); ``tools``: how the chat reply holds tool calls, or None (``serve/tools.py``);
    ``constraint_field``: the request field that gave the choices' structured-output constraint, or None."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    stream: bool
    include_usage: bool
    continuous_usage: bool
    logprobs: int | None = None
    echo: bool = False
    score_only: bool = False
    tools: ToolCalls | None = None
    constraint_field: str | None = None


def read_json(raw: bytes) -> dict:
    """The request body as a JSON object; ApiError 400 for a syntax error, a nesting deeper than Python's
    recursion limit (json raises RecursionError) or another JSON type."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def text_of(content, where: str) -> str:
    """A chat message's ``content`` as one string: a string as is, a list of text parts joined by newlines
    (as vLLM joins them); ApiError 400 naming any other part (images, audio, ...: text only here)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be a string or a list of content parts", "messages")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            message = f"{where}.content[{j}] has type {kind!r}: only text parts are served"
            raise ApiError(400, message + " ({'type': 'text', 'text': str})", "messages")
        texts.append(part["text"])
    return "\n".join(texts)


def chat_ids(tok, messages, tools: list | None = None) -> list[int]:
    """The token ids of ``messages`` through the tokenizer's chat template, with the generation prompt; the
    template renders ``tools`` as it wants them (or not at all)."""
    ok = isinstance(messages, list) and messages
    if not (ok and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
        raise ApiError(400, "messages must be a non-empty list of {role: str, content}", "messages")
    if not tok.chat_template:
        raise ApiError(400, "this model has no chat template: use /v1/completions", "messages")
    conversation = []
    for i, m in enumerate(messages):
        calls_only = m.get("content") is None and bool(m.get("tool_calls"))  # an assistant turn of tool calls
        content = "" if calls_only else text_of(m.get("content"), f"messages[{i}]")
        conversation.append(m | {"content": content})
    try:  # the template holds its special tokens: encoded below as LLM.generate encodes a string
        text = tok.apply_chat_template(conversation, tools=tools, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # the template refuses the conversation (a Jinja error)
        raise ApiError(400, f"messages: the chat template refused them: {e}", "messages") from None
    return tok.encode(text, add_special_tokens=False)


def is_ids(x) -> bool:
    return isinstance(x, list) and bool(x) and all(type(t) is int for t in x)


def prompt_ids(tok, body: dict, chat: bool, tools: list | None = None) -> list[list[int]]:
    """The request's prompts as token ids: the chat ``messages`` (with ``tools`` for the template), or
    ``prompt`` as a string, a list of strings, a list of token ids or a list of token-id lists (strings
    encoded as ``LLM.generate`` does)."""
    prompt = body.get("prompt")
    if chat:
        return [chat_ids(tok, body.get("messages"), tools)]
    if isinstance(prompt, str) and prompt:
        return [tok.encode(prompt, add_special_tokens=False)]
    if is_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) and p for p in prompt):
        return tok(prompt, add_special_tokens=False)["input_ids"]
    if isinstance(prompt, list) and prompt and all(map(is_ids, prompt)):
        return prompt
    kinds = "string, list of strings, list of token ids or list of token-id lists"
    raise ApiError(400, f"prompt must be a non-empty {kinds} (each non-empty)", "prompt")


def field_of(message: str, max_tokens_key: str) -> str | None:
    """The request field an engine message names ("SamplingParams.top_p must ..." -> "top_p")."""
    name = message.partition("SamplingParams.")[2] or message  # the engine's: "prompt ..." or this
    return max_tokens_key if name.startswith("max_tokens") else name.partition(" ")[0]


def parse(body: dict, chat: bool, tok, model_name: str, max_len: int, max_n: int, max_choices: int) -> Parsed:
    """Check a completion request (the engine's own checks and messages for the sampling fields); ApiError
    400 naming a bad field, 404 for another model."""
    if body.get("model") not in (None, model_name):
        raise ApiError(404, f"the model {body['model']!r} does not exist (here: {model_name})", "model")
    get = lambda k, default=None: default if body.get(k) is None else body[k]  # noqa: E731
    n = get("n", 1)
    stream = get("stream", False)
    opts = get("stream_options", {})
    seed = get("seed")
    bad = [k for k, off in REFUSED.items() if body.get(k) not in off] + ["best_of"] * (get("best_of", n) != n)
    if bad:
        raise ApiError(400, f"not supported by nanospec (they would change the output): {bad}", bad[0])
    if type(n) is not int or not 1 <= n <= max_n:
        raise ApiError(400, f"n must be an int in [1, {max_n}] (--max-n), got {n!r}", "n")
    if type(stream) is not bool or not isinstance(opts, dict):
        raise ApiError(400, "stream must be a bool and stream_options an object", "stream")
    logprobs, echo = logprob_options(body, chat)
    tools, calls, structured, field = read_tools(body, chat)
    prompts = prompt_ids(tok, body, chat, tools)
    if len(prompts) * n > max_choices:  # more than may ever wait: it could never be admitted
        raise ApiError(400, f"{len(prompts)} prompts x n {n} exceed --max-waiting {max_choices}", "prompt")
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    stop = [body["stop"]] if isinstance(body.get("stop"), str) else get("stop", [])
    if type(stop) is not list or len(stop) > MAX_STOP or any(len(str(x)) > MAX_STOP_LEN for x in stop):
        message = f"stop must be a str or <= {MAX_STOP} strings of <= {MAX_STOP_LEN} chars, got {stop!r:.60}"
        raise ApiError(400, message, "stop")
    kw = dict(
        temperature=get("temperature", 1.0),
        top_p=get("top_p", 1.0),
        top_k=get("top_k", -1) or -1,
        ignore_eos=get("ignore_eos", False),
        stop=stop,
        stop_token_ids=get("stop_token_ids"),
        cache_salt=get("cache_salt"),
        logprobs=logprobs,
        prompt_logprobs=logprobs if echo else None,
        structured_outputs=structured,
    )  # OpenAI's defaults; top_k 0 is off
    score_only = echo and get(key) == 0  # legacy OpenAI: score the prompt, generate nothing (one is dropped)
    params = []
    for ids in prompts:
        max_tokens = 1 if score_only else get(key, max_len - len(ids))  # omitted: what is left
        if len(ids) >= max_len:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; max_model_len is {max_len}", "prompt")
        if type(max_tokens) is int and len(ids) + max_tokens > max_len:
            message = f"the prompt's {len(ids)} tokens + {key} {max_tokens} exceed max_model_len {max_len}"
            raise ApiError(400, message, key)
        try:  # choice j samples with seed + j: n different samples, each reproducible alone
            params += [
                SamplingParams(**kw, max_tokens=max_tokens, seed=seed + j if type(seed) is int else seed)
                for j in range(n)
            ]
        except (TypeError, ValueError) as e:
            field = field_of(str(e), key)
            if chat and field == "logprobs":  # chat's k is top_logprobs
                field = "top_logprobs"
            raise ApiError(400, str(e), field) from None
    usage_opts = (opts.get("include_usage") is True, opts.get("continuous_usage_stats") is True)
    return Parsed(prompts, params, stream, *usage_opts, logprobs, echo, score_only, calls, field)


def logprob_options(body: dict, chat: bool) -> tuple:
    """(top logprobs per token k, or None; echo): completions ``logprobs: k`` and ``echo``; chat ``logprobs:
    true`` with ``top_logprobs: k`` (SamplingParams checks k); ApiError 400 naming a bad field."""
    if not chat:
        echo = body.get("echo") or False
        if type(echo) is not bool:
            raise ApiError(400, f"echo must be a bool, got {echo!r}", "echo")
        return body.get("logprobs"), echo
    wanted = body.get("logprobs") or False
    k = body.get("top_logprobs")
    if type(wanted) is not bool or (k is not None and not wanted):
        raise ApiError(400, f"logprobs must be a bool (true with top_logprobs), got {wanted!r}", "logprobs")
    return (k or 0) if wanted else None, False


def tokenize_ids(tok, body: dict) -> list[int]:
    """vLLM's /tokenize: ``messages`` (as /v1/chat/completions encodes them) or ``prompt`` (a string, with
    ``add_special_tokens`` default false: as /v1/completions encodes it, so ``count`` is prompt_tokens)."""
    if "messages" in body:
        return chat_ids(tok, body["messages"], body.get("tools") or None)
    special = body.get("add_special_tokens", False)
    if not isinstance(body.get("prompt"), str) or type(special) is not bool:
        raise ApiError(400, "give prompt (a string; add_special_tokens a bool) or messages", "prompt")
    return tok.encode(body["prompt"], add_special_tokens=special)


class Detokenizer:
    """Incremental detokenization for streaming (vLLM's prefix / read offsets): an update decodes only the
    tokens since the last emitted text plus the window before them; text that ends in a partial UTF-8
    character waits, and so do the last ``max(len(stop)) - 1`` characters while a stop string could still cut
    them. At the end the engine's final text is sent on from where the deltas stopped: they add up to it."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tok = tokenizer
        self.ids = []
        self.prefix = 0  # ids[prefix:read]: the window decoded again for context
        self.read = 0
        self.text = ""  # the text decoded so far
        self.sent = 0  # of which sent
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
