"""Structured output and tool calls in the OpenAI shapes, mapped as vLLM's server maps them (docs/serving.md,
"Structured output and tool calls").

The request side: ``response_format``, vLLM's ``structured_outputs`` (and its older ``guided_*`` fields)
and ``tools`` with ``tool_choice`` and ``parallel_tool_calls`` become at most one ``StructuredOutputsParams``,
checked before any work (a 400 naming the field). The answer side: ``ToolCalls.split`` reads a reply's tool
calls from its whole text so far, never from one delta, and ``CallStream`` sends what changed: streamed
fragments and the whole answer come from the same parse."""

import json
import re
import secrets
from itertools import groupby

from ..sampling_params import SamplingParams
from .errors import ApiError

GUIDED = {f"guided_{field}": field for field in ("json", "regex", "choice", "grammar")}  # vLLM's older names
HERMES = ("<tool_call>", "</tool_call>")  # SmolLM2, Qwen3: <tool_call>{"name", "arguments"}</tool_call>
GEMMA4 = ("<|tool_call>", "<tool_call|>")  # <|tool_call>call:NAME{key:value,...}<tool_call|>
QUOTE = '<|"|>'  # Gemma 4 writes a string value between two of these, its text unescaped
LITERAL = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?|true|false|null")  # a JSON number or literal
# a piece of Gemma 4's arguments: a quoted string, a mark, or a bare key, number or literal
PIECE = re.compile(r'<\|"\|>(.*?)<\|"\|>|([\[\]{},:])|([^\[\]{},:<]+)', re.S)
# an item of tool_choice "required"'s array, up to its parameters (keys in schema order)
ITEM = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"parameters"\s*:\s*')
DEFINITIONS = ("$defs", "definitions")  # where a JSON schema keeps the subschemas its "$ref"s name
FUNCTION = "{type: 'function', function: {name, parameters}}"  # a tool's shape
FORMATS = (
    "{type: 'text'}, {type: 'json_object'} or {type: 'json_schema', json_schema: {name, schema, strict}}"
)


def compiled(where: str, constraint: dict):
    """The ``StructuredOutputsParams`` of ``constraint`` (compiled by the engine's own check); its ValueError
    or TypeError is ``field_error``'s 400."""
    try:
        return SamplingParams(structured_outputs=constraint).structured_outputs
    except (ValueError, TypeError) as e:
        raise field_error(e, where) from None


def field_error(e: Exception, where: str) -> ApiError:
    """A 400 for the engine's error ``e`` about the constraint the request field ``where`` gave: the message
    (its first line: a Rust panic's backtrace stays out) and ``param`` name that field."""
    sub_field = "" if where == "structured_outputs" else r"[.\w]*"  # structured_outputs keeps its own
    message = re.sub(r"^SamplingParams\.structured_outputs" + sub_field, where, str(e).split("\n")[0])
    return ApiError(400, message[:1000], where)


def tool_schemas(tools) -> dict:
    """{function name: its parameters schema} of a request's ``tools``; a 400 naming the first malformed
    one (not a function, no name, a name given twice, parameters that are not an object schema)."""
    if not isinstance(tools, list):
        raise ApiError(400, f"tools must be a list of {FUNCTION}", "tools")
    schemas = {}
    for k, tool in enumerate(tools):
        where = f"tools[{k}].function"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function":
            raise ApiError(400, f"tools[{k}] must be {FUNCTION}", where)
        name = function.get("name")
        if not isinstance(name, str) or not name or name in schemas:
            message = f"{where}.name must be a non-empty string of its own, got {name!r}"
            raise ApiError(400, message, where + ".name")
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            message = f"{where}.parameters must be a JSON schema of type object, got {parameters!r:.80}"
            raise ApiError(400, message, where + ".parameters")
        compiled(where + ".parameters", {"json": parameters})
        schemas[name] = parameters
    return schemas


def calls_schema(schemas: dict, parallel: bool) -> dict:
    """vLLM's schema for ``tool_choice`` "required": an array of at least one call (one at most without
    ``parallel_tool_calls``), each ``{"name": one of the tools, "parameters": that tool's schema}``."""
    items = []
    shared = {}  # the tools' $defs / definitions, moved to the root, where their "#/$defs/..." refs point
    for name, schema in schemas.items():
        for key in DEFINITIONS:
            for def_name, definition in schema.get(key, {}).items():
                if shared.setdefault(key, {}).setdefault(def_name, definition) != definition:
                    raise ApiError(400, f"tools define {key}/{def_name} twice, differently", "tools")
        parameters = {k: v for k, v in schema.items() if k not in DEFINITIONS}
        properties = {"name": {"type": "string", "enum": [name]}, "parameters": parameters}
        items.append(dict(type="object", properties=properties, required=["name", "parameters"]))
        items[-1]["additionalProperties"] = False  # nothing after the parameters: the item ends there
    array = {"type": "array", "minItems": 1, "items": {"anyOf": items}} | shared
    return array if parallel else array | {"maxItems": 1}


def format_constraint(fmt) -> dict:
    """{request field: constraint} of a ``response_format`` (empty for text); a 400 for another shape."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    spec = fmt.get("json_schema") if kind == "json_schema" else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"response_format": {"json_object": True}}
    shaped = isinstance(spec, dict) and isinstance(spec.get("name", ""), str)  # name: a string if given
    shaped = shaped and type(spec.get("strict")) in (bool, type(None))  # strict: a bool if given
    if not shaped or not isinstance(spec.get("schema"), dict):
        raise ApiError(400, f"response_format must be {FORMATS}, got {fmt!r:.80}", "response_format")
    return {"response_format.json_schema.schema": {"json": spec["schema"]}}


def read_tools(body: dict, chat: bool) -> tuple:
    """(the tools for the chat template or None, the ``ToolCalls`` that reads the reply or None, the request's
    one ``StructuredOutputsParams`` or None, the request field it came from or None). ``tool_choice``:
    "none" (tools only rendered), "auto" (the default with tools: rendered, calls parsed from the text),
    "required" or a named function (the output constrained to calls, as vLLM maps them). A 400 naming the
    field for any malformed one, for a ``tool_choice`` naming no given function, and for two constraints at
    once."""
    tools = None if body.get("tools") == [] else body.get("tools")  # an empty list, as clients send: no tools
    if tools is not None and not chat:
        raise ApiError(400, "tools are served on /v1/chat/completions", "tools")
    schemas = {} if tools is None else tool_schemas(tools)
    choice = body.get("tool_choice")
    choice = ("auto" if schemas else "none") if choice is None else choice
    parallel = True if body.get("parallel_tool_calls") is None else body["parallel_tool_calls"]
    if type(parallel) is not bool:
        raise ApiError(400, f"parallel_tool_calls must be a bool, got {parallel!r}", "parallel_tool_calls")
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    named = isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str)
    named = named and name in schemas
    known = named or choice in ("none", "auto") or (choice == "required" and schemas)
    if not known:
        named_shape = "{type: 'function', function: {name: one of tools}}"
        message = f"tool_choice must be 'none', 'auto', 'required' (with tools) or {named_shape}"
        raise ApiError(400, f"{message}, got {choice!r:.80}", "tool_choice")
    sources = {} if body.get("response_format") is None else format_constraint(body["response_format"])
    if body.get("structured_outputs") is not None:
        sources["structured_outputs"] = body["structured_outputs"]
    sources |= {key: {field: body[key]} for key, field in GUIDED.items() if body.get(key) is not None}
    if named:
        sources["tool_choice"] = {"json": schemas[name]}
    if choice == "required":
        sources["tool_choice"] = {"json": calls_schema(schemas, parallel)}
    if len(sources) > 1:
        raise ApiError(400, f"one constraint per request, got {list(sources)}", list(sources)[1])
    field = next(iter(sources), None)  # the request field that gave the constraint
    structured = None if field is None else compiled(field, sources[field])
    mode = "named" if named else {"auto": "auto", "required": "required"}.get(choice)
    calls = ToolCalls(mode, name, parallel) if schemas and mode else None
    return tools or None, calls, structured, field


class ToolCalls:
    """How a chat reply's text holds its tool calls. ``mode`` "named": the text is the arguments of the
    function ``name``; "required": a JSON array of ``{"name", "parameters"}`` (``calls_schema``; whitespace
    between tokens is read too); "auto": tagged calls anywhere in free text (the rest is content), Hermes's
    ``<tool_call>{"name", "arguments"}</tool_call>`` or Gemma 4's ``<|tool_call>call:NAME{...}<tool_call|>``.
    ``parallel`` False keeps only the first call of "auto"."""

    def __init__(self, mode: str, name: str | None, parallel: bool):
        self.mode = mode
        self.name = name
        self.parallel = parallel

    def split(self, text, final: bool, items: "ArrayItems", tags=HERMES) -> tuple[str, list[tuple[str, str]]]:
        """(content, [(function name, arguments as JSON text)]) of the reply's ``text`` so far (``items``: its
        array scan, "required"; ``tags``: "auto"'s, HERMES or GEMMA4). Before the end (``final`` False) only
        what more text cannot change: the content and each call's arguments only grow, so a stream sends
        their differences."""
        if self.mode == "named":
            return "", [(self.name, text)]
        if self.mode == "required":  # cut before its first call (max_tokens): the text stays content
            calls = items.calls(text)
            return "" if calls or not final else text, calls
        content, calls = tagged_calls(text, final, tags)
        return content, calls if self.parallel else calls[:1]


class ArrayItems:
    """The items of a "required" reply's JSON array, scanned as the text grows (each character once)."""

    def __init__(self):
        self.scanned = 0
        self.depth = 0
        self.quoted = False
        self.escaped = False
        self.spans = []  # [start, end or None] of each item

    def calls(self, text: str) -> list[tuple[str, str]]:
        """Each item's name once its "parameters" key has arrived, and the raw text of its parameters (a
        prefix of it while they arrive)."""
        for i in range(self.scanned, len(text)):
            ch = text[i]
            if self.quoted:
                self.quoted = self.escaped or ch != '"'
                self.escaped = not self.escaped and ch == "\\"
            elif ch == '"':
                self.quoted = True
            elif ch in "[{":
                self.depth += 1
                if self.depth == 2:
                    self.spans.append([i, None])
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1:
                    self.spans[-1][1] = i
        self.scanned = len(text)
        heads = [(ITEM.match(text, start), end) for start, end in self.spans]
        return [(json.loads(f'"{h[1]}"'), text[h.end() : end].rstrip()) for h, end in heads if h]


def hermes_call(body: str) -> tuple[str, object] | None:
    """(name, arguments) of a Hermes tag's JSON body, None when it is not a call; ValueError if not JSON."""
    call = json.loads(body)
    if isinstance(call, dict) and isinstance(call.get("name"), str):
        return call["name"], call.get("arguments", call.get("parameters", {}))
    return None


def gemma4_call(body: str) -> tuple[str, object] | None:
    """(name, arguments) of Gemma 4's ``call:NAME{key:<|"|>text<|"|>,n:3,xs:[true,null]}``: keys bare, strings
    quoted by ``<|"|>`` and unescaped, numbers and literals bare; a bare value that is not one is a string.
    None when it is not a call; ValueError when the arguments do not parse."""
    name, brace, args = body.strip().partition("{")
    if not name.startswith("call:") or not brace:
        return None
    pieces = []
    for m in PIECE.finditer(brace + args):
        quoted, mark, bare = m.groups()
        word = (bare or "").strip()
        if mark or (LITERAL.fullmatch(word) and m.string[m.end() : m.end() + 1] != ":"):  # not a key
            pieces.append(mark or word)
        elif quoted is not None or word:
            pieces.append(json.dumps(quoted or word, ensure_ascii=False))
    return name[len("call:") :].strip(), json.loads("".join(pieces))


def tagged_calls(text: str, final: bool, tags=HERMES) -> tuple[str, list[tuple[str, str]]]:
    """Content and calls of an "auto" reply: each closed tag (``tags``: HERMES or GEMMA4) whose body is a
    call is one (its arguments as JSON text); any other tag stays content. Before the end, the content stops
    at an open tag or at what may begin one."""
    opening, closing = tags
    parse = gemma4_call if tags == GEMMA4 else hermes_call
    content = ""
    calls = []
    pos = 0
    while (start := text.find(opening, pos)) >= 0 and (end := text.find(closing, start)) >= 0:
        try:
            call = parse(text[start + len(opening) : end])
        except (ValueError, RecursionError):
            call = None
        if call is not None:
            calls.append((call[0], json.dumps(call[1], ensure_ascii=False)))
            content += text[pos:start]
        else:
            content += text[pos : end + len(closing)]
        pos = end + len(closing)
    rest = text[pos:]
    if not final:
        rest = rest[: rest.find(opening)] if opening in rest else rest
        held = [k for k in range(1, len(opening)) if rest.endswith(opening[:k])]
        rest = rest[: len(rest) - max(held, default=0)]
    return content + rest, calls


class CallStream:
    """One choice's reply as tool calls, read from its text as it grows: ``delta`` returns the chat delta
    since the last call (``content``, and ``tool_calls`` fragments: a call's first carries its index, id,
    type and name with the arguments so far, later ones more of the arguments), ``message`` the whole
    answer's message. "auto" reads Gemma 4's tags when the tokenizer ``tok`` has them: they are special
    tokens, which the text drops, so the reply is then decoded here from its token ids with them kept."""

    def __init__(self, calls: ToolCalls, tok=None):
        self.calls = calls
        self.text = ""
        self.content = 0  # content characters sent
        self.sent = []  # arguments characters sent, per call
        self.items = ArrayItems()
        self.tok = tok
        self.ids = []
        self.gemma4 = {}  # {token id: text} of Gemma 4's tags, when "auto" and the tokenizer has them all
        if tok is not None and calls.mode == "auto":
            ids = {tok.convert_tokens_to_ids(tag): tag for tag in (*GEMMA4, QUOTE)}
            self.gemma4 = ids if len(ids.keys() - {None, tok.unk_token_id}) == 3 else {}

    def delta(self, new_text: str, final: bool, new_ids=()) -> dict:
        self.ids += new_ids
        self.text = text_with(self.tok, self.ids, self.gemma4) if self.gemma4 else self.text + new_text
        content, calls = self.calls.split(self.text, final, self.items, GEMMA4 if self.gemma4 else HERMES)
        delta = {"content": content[self.content :]} if len(content) > self.content else {}
        self.content = len(content)
        fragments = []
        for k, (name, arguments) in enumerate(calls):
            if k == len(self.sent):
                function = {"name": name, "arguments": arguments}
                call_id = f"call_{secrets.token_hex(12)}"
                fragments.append(dict(index=k, id=call_id, type="function", function=function))
                self.sent.append(len(arguments))
            elif len(arguments) > self.sent[k]:
                fragments.append({"index": k, "function": {"arguments": arguments[self.sent[k] :]}})
                self.sent[k] = len(arguments)
        return delta | ({"tool_calls": fragments} if fragments else {})

    def message(self, text: str, ids=()) -> dict:
        """The non-streamed message of the whole ``text`` (its token ``ids``): content null when there are
        only tool calls."""
        delta = self.delta(text, True, ids)
        content = delta.get("content", "")
        calls = [{k: v for k, v in f.items() if k != "index"} for f in delta.get("tool_calls", [])]
        message = {"role": "assistant", "content": None if calls and not content.strip() else content}
        return message | ({"tool_calls": calls} if calls else {})


def text_with(tok, ids: list[int], tags: dict[int, str]) -> str:
    """``ids`` decoded without special tokens, except the ``tags`` {token id: its text}, kept."""
    return "".join(
        "".join(tags[t] for t in run) if is_tag else tok.decode(list(run), skip_special_tokens=True)
        for is_tag, run in groupby(ids, lambda t: t in tags)
    )
