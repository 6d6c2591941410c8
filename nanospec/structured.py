"""Structured output: a request's constraint (a JSON schema, a regex, a choice, a Lark grammar), the grammar
matcher that follows its committed tokens, and the allowed-token bitmasks of a step (DESIGN §5, "Structured
output").

The grammar library is llguidance: it has no Python dependencies, builds a matcher in microseconds for common
schemas, computes a mask in tens of microseconds, reports tokens the grammar forces, and rolls a matcher
back by any number of tokens, which is what masking the positions of a draft tree needs (walk a branch,
mask, roll back). A bitmask is packed int32, ``ceil(V / 32)`` words per row, bit ``v & 31`` of word
``v >> 5`` set when token v is allowed (llguidance's layout); ``kernels.sampling`` applies it.
"""

import json
from dataclasses import dataclass

import llguidance
import llguidance.hf

# JSON is emitted with json.dumps' separators and no other whitespace: a model cannot loop on whitespace,
# and the text reads as Python and JavaScript write JSON
JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass
class StructuredOutputsParams:
    """One constraint on a request's output; exactly one field is set (vLLM's ``StructuredOutputsParams``).

    ``json``: a JSON schema (a dict, or its JSON text); ``json_object``: True for any JSON object; ``regex``:
    a regular expression (Rust ``regex`` syntax, anchored at both ends); ``choice``: non-empty strings, the
    output is one of them; ``grammar``: a Lark grammar (llguidance's dialect; GBNF is accepted too).

    ``__post_init__`` compiles it (no tokenizer needed): ValueError / TypeError naming the field for a wrong
    type, none or several set, an invalid schema, an unsupported JSON-schema keyword, a bad regex or grammar,
    or one over llguidance's limits (docs/usage.md, "Structured output").
    """

    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self):
        where = "SamplingParams.structured_outputs"
        names = ("json", "json_object", "regex", "choice", "grammar")
        given = [name for name in names if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"{where}: set exactly one of json, json_object, regex, choice, grammar; got {given}"
            )
        name = given[0]
        value = getattr(self, name)
        kinds = {"json": (dict, str), "json_object": bool, "regex": str, "choice": list, "grammar": str}
        if not isinstance(value, kinds[name]):
            raise TypeError(f"{where}.{name} has the wrong type: {type(value).__name__}")
        if name == "choice" and (not value or any(not isinstance(s, str) or not s for s in value)):
            raise ValueError(f"{where}.choice must be non-empty strings, got {value!r}")
        try:
            grammar = self.to_grammar()
        except ValueError as e:
            raise ValueError(f"{where}.{name} is not valid: {e}") from None
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if failed:
            raise ValueError(f"{where}.{name} is not valid: {'; '.join(messages)}")

    def to_grammar(self) -> str:
        """The llguidance grammar text of this constraint."""
        if self.json is not None or self.json_object:
            schema = self.json if self.json is not None else {"type": "object"}
            schema = json.loads(schema) if isinstance(schema, str) else schema
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema is an object")
            return llguidance.grammar_from("json_schema", json.dumps({"x-guidance": JSON_OPTIONS, **schema}))
        if self.regex is not None:
            return llguidance.grammar_from("regex", self.regex)
        if self.choice is not None:
            return llguidance.grammar_from("choice", json.dumps(self.choice))
        return llguidance.grammar_from("grammar", self.grammar)
