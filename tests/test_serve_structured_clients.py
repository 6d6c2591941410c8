"""Structured output and tool calls over HTTP, as real clients ask for them: the openai SDK's ``parse`` with a
Pydantic model (streamed and not), LangChain's ``with_structured_output`` and ``bind_tools(...,
tool_choice="required")``, and a two-tool parallel call streamed under speculation. The default model with its
shipped assistant (3 draft steps) on a loopback port; schemas bound their strings and numbers so that a
constrained answer completes within a few dozen tokens."""

import json

import httpx
import jsonschema
import openai
import pytest
from helpers import running_server
from pydantic import BaseModel, Field

ENGINE = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "200"]
MAX_TOKENS = 48
SEED = 1  # tool_choice "required" at T = 1 then calls get_weather, then get_time


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


class GetWeather(BaseModel):
    """The weather in a city now."""

    city: str = Field(max_length=12)


def tool(name: str, description: str, properties: dict) -> dict:
    parameters = dict(
        type="object", properties=properties, required=list(properties), additionalProperties=False
    )
    return {"type": "function", "function": dict(name=name, description=description, parameters=parameters)}


TOOLS = [
    tool("get_weather", "The weather in a city now.", {"city": {"type": "string", "maxLength": 12}}),
    tool("get_time", "The time in a city now.", {"city": {"type": "string", "maxLength": 12}}),
]
ASK = [{"role": "user", "content": "What are the weather and the time in Paris?"}]
# tools as Pydantic and LangChain write them: "required" lists, no "additionalProperties"
WEATHER_ADD = [
    {
        "type": "function",
        "function": dict(
            name=name,
            description=description,
            parameters=dict(type="object", properties=properties, required=list(properties)),
        ),
    }
    for name, description, properties in (
        ("get_weather", "The weather in a city.", {"city": {"type": "string"}, "unit": {"type": "string"}}),
        ("add", "Add two integers.", {"a": {"type": "integer"}, "b": {"type": "integer"}}),
    )
]


def serving(argv: list[str]):
    """(base URL, model name) of ``nanospec-serve *argv`` on a loopback port, stopped (killed if need be)
    after."""
    with running_server(argv) as url:
        yield url, httpx.get(url + "/v1/models", timeout=60).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def server(smollm2_dir):
    yield from serving([str(smollm2_dir), *ENGINE, "--assistant", "default", "--num-steps", "3"])


def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0, timeout=120)


def chat(server, **body) -> httpx.Response:
    body = dict(model=server[1], messages=ASK, max_tokens=MAX_TOKENS, temperature=0) | body
    return httpx.post(server[0] + "/v1/chat/completions", json=body, timeout=120)


def test_openai_parse_streamed_and_whole(server):
    """``chat.completions.parse(response_format=Person)`` (a strict json_schema): the message parses into a
    valid Person; streamed (``chat.completions.stream``) the same text, whole."""
    kw = dict(model=server[1], messages=[{"role": "user", "content": "Invent a person."}], temperature=0)
    kw |= dict(max_tokens=MAX_TOKENS, response_format=Person)
    whole = client(server).chat.completions.parse(**kw)
    person = whole.choices[0].message.parsed
    assert isinstance(person, Person) and whole.choices[0].finish_reason == "stop"
    with client(server).chat.completions.stream(**kw) as stream:
        deltas = [e.delta for e in stream if e.type == "content.delta"]
        streamed = stream.get_final_completion()
    assert streamed.choices[0].message.parsed == person
    assert "".join(deltas) == whole.choices[0].message.content
    assert json.loads(whole.choices[0].message.content) == person.model_dump()


def test_langchain_structured_output_and_required_tools(server):
    """LangChain's ``with_structured_output(Person)`` (json_schema by default) gives a Person;
    ``bind_tools([GetWeather], tool_choice="required")`` gives an AIMessage with one valid tool call."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=server[0] + "/v1", api_key="x", model=server[1], temperature=0, max_tokens=MAX_TOKENS
    )
    assert isinstance(llm.with_structured_output(Person).invoke("Invent a person."), Person)
    tooled = llm.bind_tools([GetWeather], tool_choice="required", parallel_tool_calls=False)
    message = tooled.invoke("What is the weather in Paris?")
    assert not message.invalid_tool_calls and len(message.tool_calls) == 1, message
    call = message.tool_calls[0]
    assert call["name"] == "GetWeather" and GetWeather(**call["args"]) and call["id"].startswith("call_")
    assert message.response_metadata["finish_reason"] == "tool_calls"


def test_required_tool_call_ends_after_its_listed_arguments(server):
    """Two tools whose parameters do not say ``additionalProperties`` (as Pydantic and LangChain write them),
    tool_choice "required", T 0, max_tokens 80: the model calls ``add`` with exactly ``a`` and ``b`` and the
    call ends ("tool_calls"), since an object schema allows only the properties it lists (vLLM's strict
    reading); through LangChain's ``bind_tools`` the same request gives a tool call that validates."""
    from langchain_openai import ChatOpenAI

    question = "What is 2 + 3?"
    body = dict(messages=[{"role": "user", "content": question}], tools=WEATHER_ADD, tool_choice="required")
    r = chat(server, **body, max_tokens=80)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "add" and set(json.loads(call["arguments"])) == {"a", "b"}, call
    llm = ChatOpenAI(base_url=server[0] + "/v1", api_key="x", model=server[1], temperature=0, max_tokens=80)
    message = llm.bind_tools(WEATHER_ADD, tool_choice="required").invoke(question)
    assert message.tool_calls and not message.invalid_tool_calls, message
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in WEATHER_ADD}
    for call in message.tool_calls:
        jsonschema.validate(call["args"], schemas[call["name"]] | {"additionalProperties": False})


def streamed_calls(server, **body) -> tuple[list[dict], str]:
    """A streamed chat's tool calls as a client joins the fragments, and its finish_reason."""
    body = dict(model=server[1], messages=ASK, max_tokens=MAX_TOKENS, temperature=0, stream=True) | body
    calls = {}
    finish = None
    with httpx.stream("POST", server[0] + "/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            finish = choice["finish_reason"] or finish
            assert choice["delta"].get("content") in (None, "")
            for f in choice["delta"].get("tool_calls", []):
                if "id" in f:
                    calls[f["index"]] = dict(id=f["id"], type=f["type"], function=dict(f["function"]))
                else:
                    calls[f["index"]]["function"]["arguments"] += f["function"]["arguments"]
    return [calls[k] for k in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_tool_calls_stream_whole_under_speculation(server, tool_choice):
    """tool_choice "required" with parallel calls (sampled at T = 1 with a seed under which the model calls
    both tools) and a named function: the streamed fragments (steps of several tokens: drafts accepted) join
    into the non-streamed calls, whose arguments parse and follow their tool's schema; finish "tool_calls"."""
    body = dict(tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=True, temperature=1.0, seed=SEED)
    whole = chat(server, **body)
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and message["content"] is None
    assert max(choice["accept_lengths"]) > 1  # drafts accepted: steps of several tokens
    calls = message["tool_calls"]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    names = [c["function"]["name"] for c in calls]
    assert names == (["get_weather", "get_time"] if tool_choice == "required" else ["get_time"])
    for c in calls:
        assert set(json.loads(c["function"]["arguments"])) == {"city"}
    got, finish = streamed_calls(server, **body)
    assert [c["function"] for c in got] == [c["function"] for c in calls] and finish == "tool_calls"


def test_auto_none_and_plain_answers(server):
    """tool_choice "auto" (the default with tools) on a model that writes no tool call: content, finish
    "length" or "stop"; "none": the same text as without tools (SmolLM2's template ignores them)."""
    plain = chat(server, max_tokens=8).json()["choices"][0]
    for choice in ("auto", "none"):
        got = chat(server, max_tokens=8, tools=TOOLS, tool_choice=choice).json()["choices"][0]
        assert got["message"] == plain["message"] and got["finish_reason"] == plain["finish_reason"]


@pytest.mark.parametrize(
    "body,param",
    [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": 5}}}), None),
        (dict(tools=[tool("f", "x", {"a": {"type": "strange"}})]), "tools[0].function.parameters"),
    ],
)
def test_bad_input_is_a_400_and_others_run(server, body, param):
    r = chat(server, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == (param or "response_format.json_schema.schema")
    assert chat(server, max_tokens=2).status_code == 200


def test_completions_constraints_and_length(server):
    """vLLM's structured_outputs on /v1/completions (a choice, a regex) and its guided_* names; a constraint
    cut by max_tokens ends with "length" and the partial text, a named call with partial arguments."""
    url, model = server
    body = dict(model=model, prompt="Is Paris in France? Answer:", max_tokens=8, temperature=0)
    for constraint, allowed in (
        ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"regex": "[0-9]{2}-[a-z]{3}"}}, lambda t: len(t) == 6 and t[2] == "-"),
        ({"guided_choice": ["maybe"]}, lambda t: t == "maybe"),
    ):
        got = httpx.post(url + "/v1/completions", json=body | constraint, timeout=120).json()["choices"][0]
        assert allowed(got["text"]) and got["finish_reason"] == "stop", got
    person = {"type": "json_schema", "json_schema": {"name": "P", "schema": Person.model_json_schema()}}
    cut = chat(server, max_tokens=3, response_format=person).json()["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["content"].startswith("{")
    named = {"type": "function", "function": {"name": "get_time"}}
    cut = chat(server, max_tokens=3, tools=TOOLS, tool_choice=named).json()["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["content"] is None
    assert cut["message"]["tool_calls"][0]["function"]["arguments"].startswith('{"')


@pytest.fixture(scope="module")
def gemma4_tags_server(tmp_path_factory, smollm2_dir):
    """(base URL, model name) of a server for a tiny random Llama whose tokenizer has Gemma 4's tool-call
    tags as special tokens (ids 49152-49154, as Gemma 4's tokenizer holds them)."""
    from conftest import make_tiny_model

    from nanospec.loader import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<|tool_call>", "<tool_call|>", '<|"|>']})
    model_dir = make_tiny_model(tmp_path_factory.mktemp("gemma4_tags"), tok, seed=3)
    yield from serving([str(model_dir), *ENGINE])


def test_gemma4_tool_calls_under_auto(gemma4_tags_server):
    """tool_choice "auto" on a model whose tokenizer has Gemma 4's tags: a reply that writes
    ``Sure. <|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>`` (a grammar over the tag tokens
    forces it, tags included as special tokens) answers content "Sure. " and the call, whole and streamed,
    with finish_reason "tool_calls"."""
    url, model = gemma4_tags_server
    grammar = 'start: "Sure. " <[49152]> "call:get_weather{city:" <[49154]> "Paris" <[49154]> "}" <[49153]>'
    body = dict(model=model, messages=ASK, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=0)
    body["structured_outputs"] = {"grammar": grammar}
    whole = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    call = whole["message"]["tool_calls"][0]["function"]
    assert call == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert whole["message"]["content"] == "Sure. " and whole["finish_reason"] == "tool_calls"
    content = ""
    arguments = ""
    finish = None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body | {"stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                finish = choice["finish_reason"] or finish
                content += choice["delta"].get("content") or ""
                arguments += "".join(
                    f["function"]["arguments"] for f in choice["delta"].get("tool_calls", [])
                )
    assert (content, arguments, finish) == ("Sure. ", '{"city": "Paris"}', "tool_calls")
