"""Structured output and tool calls, the request and answer shapes without a model: what a body becomes
(``parse`` -> SamplingParams.structured_outputs, vLLM's mapping of tools), the 400 for each malformed field
(before any work), and the tool-call parser that streamed and whole answers share."""

import json

import jsonschema
import pytest

from nanospec.serve.protocol import ApiError, parse
from nanospec.serve.tools import CallStream, ToolCalls, calls_schema, field_error, gemma4_call

MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
DAYS = {"type": "object", "properties": {"days": {"type": "integer", "minimum": 1}}, "required": ["days"]}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "Now", "parameters": CITY}},
    {"type": "function", "function": {"name": "forecast", "parameters": DAYS}},
]


def parsed(tok, chat=True, **body):
    body = {"messages": MESSAGES, "max_tokens": 8} | body
    if not chat:
        body = {"prompt": "Hi", "max_tokens": 8} | {k: v for k, v in body.items() if k != "messages"}
    return parse(body, chat, tok, "m", 256, 4, 64)


def constraint(tok, **body):
    """The request's StructuredOutputsParams as a dict of its set fields (every choice shares it)."""
    p = parsed(tok, **body)
    assert len({id(x.structured_outputs) for x in p.params}) == 1
    so = p.params[0].structured_outputs
    return None if so is None else {k: v for k, v in vars(so).items() if v is not None}


def test_response_format_and_structured_outputs_map(smollm2_tokenizer):
    """response_format text / json_object / json_schema, vLLM's structured_outputs and guided_* fields."""
    tok = smollm2_tokenizer
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    json_schema = {"name": "A", "schema": schema, "strict": True}
    assert constraint(tok, response_format={"type": "text"}) is None
    assert constraint(tok, response_format={"type": "json_object"}) == {"json_object": True}
    assert constraint(tok, response_format={"type": "json_schema", "json_schema": json_schema}) == {
        "json": schema
    }
    assert constraint(tok, structured_outputs={"regex": "[ab]+"}) == {"regex": "[ab]+"}
    assert constraint(tok, structured_outputs={"choice": ["x", "y"], "json": None}) == {"choice": ["x", "y"]}
    assert constraint(tok, guided_grammar='start: "a"') == {"grammar": 'start: "a"'}
    assert constraint(tok, guided_json=schema, n=3) == {"json": schema}
    p = parsed(tok, chat=False, response_format={"type": "json_object"})  # completions too (as vLLM)
    assert vars(p.params[0].structured_outputs)["json_object"] is True and p.tools is None


def test_tool_choice_maps_as_vllm(smollm2_tokenizer):
    """A named function: its parameters schema; "required": an array of {name, parameters} (maxItems 1
    without parallel_tool_calls); "auto" (the default with tools) and "none": no constraint."""
    tok = smollm2_tokenizer
    named = {"type": "function", "function": {"name": "forecast"}}
    assert constraint(tok, tools=TOOLS, tool_choice=named) == {"json": DAYS}
    assert parsed(tok, tools=TOOLS, tool_choice=named).tools.mode == "named"
    array = constraint(tok, tools=TOOLS, tool_choice="required")["json"]
    assert array == calls_schema({"weather": CITY, "forecast": DAYS}, True)
    assert array["minItems"] == 1 and "maxItems" not in array
    items = array["items"]["anyOf"]
    assert [i["properties"]["name"] for i in items] == [
        {"type": "string", "enum": [n]} for n in ("weather", "forecast")
    ]
    assert [i["properties"]["parameters"] for i in items] == [CITY, DAYS]
    assert all(i["required"] == ["name", "parameters"] for i in items)
    single = constraint(tok, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)["json"]
    assert single["maxItems"] == 1
    for choice in (None, "auto", "none"):
        assert constraint(tok, tools=TOOLS, tool_choice=choice) is None
    assert parsed(tok, tools=TOOLS).tools.mode == "auto"
    assert parsed(tok, tools=TOOLS, tool_choice="none").tools is None
    assert parsed(tok, tools=[], tool_choice="auto").tools is None  # what clients send by default
    assert parsed(tok, chat=False, tools=[], tool_choice="none").tools is None  # on completions too
    no_params = [{"type": "function", "function": {"name": "now"}}]
    assert constraint(tok, tools=no_params, tool_choice="required")["json"]["items"]["anyOf"][0][
        "properties"
    ]["parameters"] == {"type": "object", "properties": {}}


def test_tools_reach_the_chat_template(smollm2_tokenizer):
    """The tools go to apply_chat_template (SmolLM2's template ignores them); an assistant turn of tool calls
    with null content and a tool result are accepted."""
    tok = smollm2_tokenizer
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function"}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    plain = parsed(tok, messages=history).prompts
    assert parsed(tok, messages=history, tools=TOOLS).prompts == plain
    seen = {}

    class Recording:
        chat_template = "x"

        def apply_chat_template(self, conversation, tools=None, **kw):
            seen["tools"] = tools
            return "hi"

        def encode(self, text, add_special_tokens):
            return [1, 2]

    parsed(Recording(), tools=TOOLS, tool_choice="none")
    assert seen["tools"] == TOOLS


BAD = [
    (dict(tools=["get_weather"]), "tools[0].function"),
    (dict(response_format={"type": "yaml"}), "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format"),
    (dict(response_format="json"), "response_format"),
    (
        dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}),
        "response_format.json_schema.schema",
    ),
    (
        dict(
            response_format={
                "type": "json_schema",
                "json_schema": {"schema": {"type": "string", "format": "nope-format"}},
            }
        ),
        "response_format.json_schema.schema",
    ),
    (dict(structured_outputs={"regex": "(unclosed"}), "structured_outputs"),
    (dict(structured_outputs={"json": {}, "regex": "a"}), "structured_outputs"),
    (dict(structured_outputs={"whitespace": "x"}), "structured_outputs"),
    (dict(structured_outputs="json"), "structured_outputs"),
    (dict(guided_choice=[]), "guided_choice"),
    (dict(tools={"weather": {}}), "tools"),
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools[0].function.name"),
    (dict(tools=[{"type": "retrieval"}]), "tools[0].function"),
    (dict(tools=[TOOLS[0], TOOLS[0]]), "tools[1].function.name"),
    (
        dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]),
        "tools[0].function.parameters",
    ),
    (
        dict(tools=[{"type": "function", "function": {"name": "f", "parameters": [1]}}]),
        "tools[0].function.parameters",
    ),
    (
        dict(
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}},
                    },
                }
            ]
        ),
        "tools[0].function.parameters",
    ),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "missing"}}), "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "name": "weather"}), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="any"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice=["weather"]), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tool_choice={"type": "function", "function": {"name": "weather"}}), "tool_choice"),
    (dict(tools=TOOLS, parallel_tool_calls="yes"), "parallel_tool_calls"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
    (dict(response_format={"type": "json_object"}, guided_regex="a"), "guided_regex"),
    (dict(functions=[{"name": "f"}]), "functions"),
    *[(dict(tools=bad), "tools") for bad in ({}, "", 0, False)],
    *[(dict(tools=TOOLS, tool_choice=bad), "tool_choice") for bad in ([], {}, "", 0, False)],
    (
        dict(response_format={"type": "json_schema", "json_schema": {"name": 5, "schema": {}}}),
        "response_format",
    ),
    (
        dict(response_format={"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}),
        "response_format",
    ),
    (
        dict(response_format={"type": "json_schema", "json_schema": {"schema": {}, "strict": 1}}),
        "response_format",
    ),
    (dict(structured_outputs={"regex": 5}), "structured_outputs"),
    (
        dict(
            tool_choice="required",
            tools=[
                {
                    "type": "function",
                    "function": {"name": n, "parameters": {"$defs": {"A": a}, "type": "object"}},
                }
                for n, a in (("f", {"type": "string"}), ("g", {"type": "integer"}))
            ],
        ),
        "tools",
    ),
]


@pytest.mark.parametrize("body,field", BAD)
def test_bad_fields_are_400_naming_them(smollm2_tokenizer, body, field):
    with pytest.raises(ApiError) as e:
        parsed(smollm2_tokenizer, **body)
    assert e.value.status == 400 and e.value.param == field, str(e.value)
    assert field.partition(".")[0].partition("[")[0] in str(e.value)
    assert "SamplingParams" not in str(e.value)


def test_messages_name_the_sub_field_and_keep_one_line(smollm2_tokenizer):
    """structured_outputs keeps the name of its bad field; an engine error of several lines (a Rust panic
    with its backtrace, from compiling a grammar for the tokenizer) keeps its first, named after the
    request field that gave the constraint."""
    with pytest.raises(ApiError) as e:
        parsed(smollm2_tokenizer, structured_outputs={"regex": 5})
    assert str(e.value).startswith("structured_outputs.regex has the wrong type")
    panic = ValueError("SamplingParams.structured_outputs is not valid: panic: too big\n  0: backtrace")
    error = field_error(panic, "guided_choice")
    assert (str(error), error.param, error.status) == (
        "guided_choice is not valid: panic: too big",
        "guided_choice",
        400,
    )
    assert parsed(smollm2_tokenizer, guided_choice=["a", "b"]).constraint_field == "guided_choice"


def test_required_tools_with_shared_definitions(smollm2_tokenizer):
    """ "required" over a tool whose parameters name subschemas ($defs, as pydantic writes nested models):
    the definitions move to the array's root, where their refs point, and a nested call validates."""
    addr = {"type": "object", "properties": {"zip": {"type": "string"}}, "required": ["zip"]}
    params = {"$defs": {"Addr": addr}, "type": "object", "properties": {"address": {"$ref": "#/$defs/Addr"}}}
    tools = [{"type": "function", "function": {"name": "locate", "parameters": params}}, TOOLS[0]]
    array = constraint(smollm2_tokenizer, tools=tools, tool_choice="required")["json"]
    assert array["$defs"] == {"Addr": addr}
    assert "$defs" not in array["items"]["anyOf"][0]["properties"]["parameters"]
    jsonschema.validate([{"name": "locate", "parameters": {"address": {"zip": "75001"}}}], array)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "locate", "parameters": {"address": {"zip": 75001}}}], array)


def test_tools_on_completions_are_400(smollm2_tokenizer):
    with pytest.raises(ApiError) as e:
        parsed(smollm2_tokenizer, chat=False, tools=TOOLS)
    assert e.value.param == "tools"


def stream(calls: ToolCalls, pieces: list[str]) -> tuple[dict, dict]:
    """The streamed deltas of ``pieces`` joined per call as a client joins them, and the whole message."""
    s = CallStream(calls)
    content = ""
    joined = {}
    for k, piece in enumerate(pieces):
        delta = s.delta(piece, k == len(pieces) - 1)
        content += delta.get("content", "")
        for f in delta.get("tool_calls", []):
            if "id" in f:
                assert f["index"] == len(joined) and f["id"].startswith("call_") and f["type"] == "function"
                joined[f["index"]] = dict(name=f["function"]["name"], arguments="")
            joined[f["index"]]["arguments"] += f["function"]["arguments"]
    return {"content": content, "calls": list(joined.values())}, CallStream(calls).message("".join(pieces))


def calls_of(message: dict) -> list[dict]:
    return [
        dict(name=c["function"]["name"], arguments=c["function"]["arguments"])
        for c in message.get("tool_calls", [])
    ]


@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_required_calls_stream_whole_in_any_split(size):
    """A "required" reply cut into pieces of any size (several tokens a step under speculation): the
    fragments join into the same calls as the whole answer, each call's arguments its parameters' JSON."""
    text = (
        '[{"name":"weather","parameters":{"city":"Pa\\"ris}"}},{"name":"forecast","parameters":{"days":3}}]'
    )
    pieces = [text[k : k + size] for k in range(0, len(text), size)]
    streamed, whole = stream(ToolCalls("required", None, True), pieces)
    want = [
        dict(name="weather", arguments='{"city":"Pa\\"ris}"}'),
        dict(name="forecast", arguments='{"days":3}'),
    ]
    assert streamed == {"content": "", "calls": want} and calls_of(whole) == want
    assert whole["content"] is None
    assert [json.loads(c["arguments"]) for c in want] == [{"city": 'Pa"ris}'}, {"days": 3}]
    spaced = '[ {"name": "weather", "parameters": {"city": "Oslo"} } ]'  # json.dumps' separators read too
    pieces = [spaced[k : k + size] for k in range(0, len(spaced), size)]
    streamed, whole = stream(ToolCalls("required", None, True), pieces)
    assert streamed["calls"] == calls_of(whole) == [dict(name="weather", arguments='{"city": "Oslo"}')]


def test_required_cut_before_its_first_call_keeps_the_text():
    """max_tokens cut a "required" reply before its first call's parameters: the text is the content."""
    streamed, whole = stream(ToolCalls("required", None, True), ['[{"na', 'me":"get_w'])
    assert streamed == {"content": '[{"name":"get_w', "calls": []}
    assert whole == {"role": "assistant", "content": '[{"name":"get_w'}


def test_named_and_auto_calls():
    """A named function: the whole text is its arguments. "auto": Hermes tags anywhere, the rest content
    (held back while a tag may be opening), a tag that is not a call stays content, an unclosed one too."""
    streamed, whole = stream(ToolCalls("named", "weather", True), ['{"ci', 'ty":"Rome"}'])
    assert streamed["calls"] == calls_of(whole) == [dict(name="weather", arguments='{"city":"Rome"}')]
    text = 'Sure.<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    text += "<tool_call>oops</tool_call> Done<tool"
    for size in (1, 4, 100):
        pieces = [text[k : k + size] for k in range(0, len(text), size)]
        streamed, whole = stream(ToolCalls("auto", None, True), pieces)
        assert streamed["content"] == whole["content"] == "Sure.<tool_call>oops</tool_call> Done<tool"
        assert streamed["calls"] == calls_of(whole) == [dict(name="weather", arguments='{"city": "Oslo"}')]
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b"}</tool_call>'
    _, whole = stream(ToolCalls("auto", None, True), [two])
    assert calls_of(whole) == [dict(name="a", arguments="{}"), dict(name="b", arguments="{}")]
    assert whole["content"] is None
    _, whole = stream(ToolCalls("auto", None, False), [two])
    assert calls_of(whole) == [dict(name="a", arguments="{}")]
    partial = CallStream(ToolCalls("auto", None, True))
    assert partial.delta("Hi <tool_", False) == {"content": "Hi "}
    assert partial.delta('call>{"name"', False) == {}
    assert partial.delta("", True) == {"content": '<tool_call>{"name"'}


GEMMA4_TAGS = ["<|tool_call>", "<tool_call|>", '<|"|>']


@pytest.fixture(scope="module")
def gemma4_tokenizer(smollm2_dir):
    """The SmolLM2 tokenizer with Gemma 4's tool-call tags added as special tokens (ids 49152-49154), as
    Gemma 4's tokenizer holds them: a text decoded without special tokens drops them."""
    from nanospec.loader import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    tok.add_special_tokens({"additional_special_tokens": GEMMA4_TAGS})
    return tok


def test_gemma4_arguments_become_json():
    """Gemma 4's argument syntax: bare keys, <|"|>-quoted unescaped strings (quotes, commas, braces and
    colons inside), bare numbers and literals, nested objects and arrays; a bare word is a string."""
    q = '<|"|>'
    body = f'call:get_weather{{city:{q}Paris, "FR": {{x}}{q},days:3,ratio:-1.5e2,metric:true,'
    body += f"unit:celsius,tags:[{q}a{q},null,[]],extra:{{k:false,empty:{q}{q}}}}}"
    name, arguments = gemma4_call(body)
    assert name == "get_weather"
    assert arguments == {
        "city": 'Paris, "FR": {x}',
        "days": 3,
        "ratio": -150.0,
        "metric": True,
        "unit": "celsius",
        "tags": ["a", None, []],
        "extra": {"k": False, "empty": ""},
    }
    assert gemma4_call("call:f{}") == gemma4_call("\n call:f {}\n") == ("f", {})
    assert gemma4_call("get_weather{}") is None
    with pytest.raises(ValueError):
        gemma4_call("call:f{city:")


@pytest.mark.parametrize("size", [1, 3, 100])
def test_gemma4_auto_calls_from_token_ids(gemma4_tokenizer, size):
    """ "auto" with a tokenizer that has Gemma 4's tags reads its calls from the token ids (the tags are
    special tokens the text drops), in any split: content around them, two calls, the end token not shown,
    a malformed call kept as content; without the tags the Hermes reader is used."""
    tok = gemma4_tokenizer
    q = '<|"|>'
    text = f"Sure. <|tool_call>call:get_weather{{city:{q}Paris{q}}}<tool_call|>"
    text += (
        f"<|tool_call>call:get_time{{city:{q}Rome{q},utc:true}}<tool_call|><|tool_call>oops<tool_call|> ok"
    )
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    stream = CallStream(ToolCalls("auto", None, True), tok)
    content = ""
    joined = {}
    for k in range(0, len(ids), size):
        piece = ids[k : k + size]
        delta = stream.delta(tok.decode(piece, skip_special_tokens=True), k + size >= len(ids), piece)
        content += delta.get("content", "")
        for f in delta.get("tool_calls", []):
            joined.setdefault(f["index"], dict(name=f["function"].get("name"), arguments=""))
            joined[f["index"]]["arguments"] += f["function"]["arguments"]
    want = [
        dict(name="get_weather", arguments='{"city": "Paris"}'),
        dict(name="get_time", arguments='{"city": "Rome", "utc": true}'),
    ]
    whole = CallStream(ToolCalls("auto", None, True), tok).message(
        tok.decode(ids, skip_special_tokens=True), ids
    )
    assert list(joined.values()) == calls_of(whole) == want
    assert content == whole["content"] == "Sure. <|tool_call>oops<tool_call|> ok"
    hermes = '<tool_call>{"name": "a"}</tool_call>'
    message = CallStream(ToolCalls("auto", None, True), tok).message(hermes, tok.encode(hermes))
    assert message == {"role": "assistant", "content": hermes}  # Gemma 4's reader: Hermes tags are content
    plain = CallStream(ToolCalls("auto", None, True), None).message(hermes)
    assert calls_of(plain) == [dict(name="a", arguments="{}")]
