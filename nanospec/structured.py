"""Structured output: a request's constraint (a JSON schema, a regex, a choice, a Lark grammar), the grammar
matcher that follows its committed tokens, and the allowed-token bitmasks of a step (DESIGN §5, "Structured
output").

The grammar library is llguidance: it has no Python dependencies, builds a matcher in microseconds for common
schemas, computes a mask in tens of microseconds, reports tokens the grammar forces, and rolls a matcher
back by any number of tokens, which is what masking the positions of a draft tree needs (walk a branch,
mask, roll back). A bitmask is packed int32, ``ceil(V / 32)`` words per row, bit ``v & 31`` of word
``v >> 5`` set when token v is allowed (llguidance's layout); ``kernels.sampling`` applies it.
"""

import copy
import json
from dataclasses import dataclass
from functools import cached_property, lru_cache

import llguidance
import llguidance.hf
import torch

from .transfer import to_device

# JSON is emitted without whitespace between its tokens: a model cannot loop on whitespace
JSON_OPTIONS = {"whitespace_flexible": False}
GRAMMAR_CACHE_SIZE = 64  # compiled grammars kept per model
# keywords whose value is a map of names to subschemas, one subschema, or a list of alternatives or parts
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
SCHEMA_ONE = ("items", "additionalProperties", "additionalItems")
COMBINATORS = ("anyOf", "oneOf", "allOf")
OBJECT_KEYWORDS = ("properties", "patternProperties")  # they make an object schema without a "type"


def strict_schema(schema, close: bool = True):
    """A copy of the JSON schema ``schema`` in which an object schema that does not state
    ``additionalProperties`` allows only the properties it lists, and an array schema with ``prefixItems``
    but no ``items`` only those items: the strict reading of vLLM's default grammar backend (XGrammar), which
    tool and response-format schemas (Pydantic's, LangChain's) rely on to end. A schema that states them
    keeps what it states. Where properties may come from several schemas at one level, that level stays
    open and the schemas below it are read strictly: an object schema beside ``anyOf`` / ``oneOf`` /
    ``allOf``, those alternatives' own level, and the parts of an ``allOf`` of two or more. Values under
    ``enum``, ``const``, ``default`` and ``examples`` are data and stay as they are. ``close=False``: this
    level stays open."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_schema(s) for name, s in out[key].items()}
    for key in SCHEMA_ONE:
        if key in out:
            out[key] = strict_schema(out[key])
    own = any(k in out for k in OBJECT_KEYWORDS)
    for key in ("prefixItems",) + COMBINATORS:
        if isinstance(out.get(key), list):
            alone = key == "prefixItems" or (not own and (key != "allOf" or len(out[key]) == 1))
            out[key] = [strict_schema(part, alone) for part in out[key]]
    kinds = out["type"] if isinstance(out.get("type"), list) else [out.get("type")]
    is_object = "object" in kinds or (kinds == [None] and own)
    if close and is_object and not any(k in out for k in COMBINATORS) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    if close and "prefixItems" in out and not any(k in out for k in ("items", "additionalItems")):
        out["items"] = False
    return out


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

    @classmethod
    def of(cls, value) -> "StructuredOutputsParams | None":
        """``SamplingParams.structured_outputs`` as a user gives it (a ``StructuredOutputsParams``, a dict of
        its fields, or None), checked: ValueError naming an unknown field, TypeError for another kind."""
        if isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise ValueError(f"SamplingParams.structured_outputs: unknown field(s) {sorted(unknown)}")
            value = cls(**value)
        if value is not None and not isinstance(value, cls):
            raise TypeError(
                "SamplingParams.structured_outputs must be StructuredOutputsParams, a dict or None, "
                f"got {value!r}"
            )
        return value

    def __post_init__(self):
        where = "SamplingParams.structured_outputs"
        kinds = {"json": (dict, str), "json_object": bool, "regex": str, "choice": list, "grammar": str}
        given = [name for name in kinds if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"{where}: set exactly one of json, json_object, regex, choice, grammar; got {given}"
            )
        name = given[0]
        value = getattr(self, name)
        if not isinstance(value, kinds[name]):
            raise TypeError(f"{where}.{name} has the wrong type: {type(value).__name__}")
        if name == "choice" and (not value or any(not isinstance(s, str) or not s for s in value)):
            raise ValueError(f"{where}.choice must be non-empty strings, got {value!r}")
        try:
            grammar = self.to_grammar()
        except (ValueError, RecursionError) as e:
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
            if self.json is not None:  # json_object stays any object
                schema = strict_schema(schema)
            return llguidance.grammar_from("json_schema", json.dumps({"x-guidance": JSON_OPTIONS, **schema}))
        if self.regex is not None:
            return llguidance.grammar_from("regex", self.regex)
        if self.choice is not None:
            return llguidance.grammar_from("choice", json.dumps(self.choice))
        return llguidance.grammar_from("grammar", self.grammar)


class Grammars:
    """The grammar matchers of one model: llguidance's view of its tokenizer (built on first use), and each
    constraint's compiled matcher, cached by grammar text (agents send the same schema again and again); a
    request gets a copy. Safe to call from several threads, so a server compiles off the engine thread
    (``LLM.compile_grammar``). ``eos_token_ids``: the tokens that end a request; a grammar allows them only
    where it is complete.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.compiled = lru_cache(GRAMMAR_CACHE_SIZE)(self.compile)

    @cached_property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        return llguidance.hf.from_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)

    def compile(self, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(f"SamplingParams.structured_outputs is not valid: {matcher.get_error()}")
        return matcher

    def matcher(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher of ``params``' grammar, at the start of the output. ValueError naming the field
        when the grammar does not compile against this tokenizer."""
        return self.compiled(params.to_grammar()).deep_copy()


class StepMasks:
    """The allowed-token bitmasks of one step's rows, computed on the host by the requests' matchers.

    A row is a request and a draft path: the tokens drafted after its bonus token (the newest committed
    token), i.e. the row's position in the draft or verify tree. Its mask is the grammar's after the request's
    committed tokens and that path: the matcher walks the path, fills the row, and rolls back. A path that
    leaves the grammar or passes an end token is never accepted (the target's masked token cannot match it),
    so its row may allow anything: it allows token 0 alone, the cheapest row to sample, and a matcher is
    never asked past its end. Rows of requests without a constraint allow everything. Masks of a path seen
    before in the step are reused (a chain's draft masks are its verify masks).
    """

    def __init__(self, reqs, vocab_size: int, eos_token_ids, device):
        self.matchers = [r.matcher for r in reqs]
        self.logprobs = any(r.params.logprobs is not None for r in reqs)  # they read masked logits
        self.words = -(-vocab_size // 32)
        self.eos_token_ids = set(eos_token_ids)
        self.device = device
        self.seen: dict[tuple, tuple[torch.Tensor, int]] = {}

    def run_apart(self, run, inputs: dict) -> tuple:
        """One speculative step whose constrained rows run apart from the others, eagerly with their masks,
        so one constrained request does not take the batch off its CUDA graphs (DESIGN §5). ``inputs``: name
        -> [B, ...] tensor; ``run(part, eager)`` runs the step over the rows of ``part`` (``eager``: None, or
        the arguments only an eager call takes: these rows' masks). Returns its outputs in batch order."""
        constrained = [b for b, matcher in enumerate(self.matchers) if matcher is not None]
        if len(constrained) in (0, len(self.matchers)):
            return run(inputs, dict(masks=self) if constrained else None)
        free = sorted(set(range(len(self.matchers))) - set(constrained))
        rows = to_device(free + constrained, torch.long, self.device)  # one transfer for both parts
        free_inputs = {k: t.index_select(0, rows[: len(free)]) for k, t in inputs.items()}
        constrained_inputs = {k: t.index_select(0, rows[len(free) :]) for k, t in inputs.items()}
        parts = [run(free_inputs, None), run(constrained_inputs, dict(masks=self.select(constrained)))]
        order = rows.argsort()
        return tuple(None if a is None else torch.cat([a, b]).index_select(0, order) for a, b in zip(*parts))

    def select(self, rows: list[int]) -> "StepMasks":
        """The masks of these rows of the batch, as a batch of their own (``logprobs`` stays the batch's)."""
        part = copy.copy(self)
        part.matchers = [self.matchers[b] for b in rows]
        part.seen = {}
        return part

    def __call__(self, paths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Masks of the rows whose draft paths are ``paths`` [R, D] int64 (R a multiple of the batch size,
        each request's rows together; D may be 0): (bitmask [R, W] int32, forced [R] int64: the token the
        grammar forces there, -1 if none), on the device. Reads ``paths`` on the host (one sync)."""
        rows = paths.tolist()
        per_request = len(rows) // len(self.matchers)
        return self.rows([(i // per_request, path) for i, path in enumerate(rows)])

    def root(self, indices) -> torch.Tensor:
        """Bitmask [len(indices), W] int32 on the device of the requests at ``indices`` of the batch, after
        their committed tokens (the token a prefill or a plain decode step produces)."""
        return self.rows([(b, []) for b in indices])[0]

    def fetch(self, tokens: torch.Tensor, parents: torch.Tensor) -> tuple:
        """The arguments of ``tree`` for a draft tree on the device: host copies of its ``tokens`` and
        ``parents``, queued without waiting, and a CUDA event marking their arrival (None elsewhere). The
        verify launches the target's forward before it calls ``tree``, which then waits for the copies alone:
        the tree's masks are computed while the forward runs."""
        copied = torch.cuda.Event() if self.device.type == "cuda" else None
        host = [t.to("cpu", non_blocking=True) for t in (tokens, parents)]
        if copied is not None:
            copied.record()
        return (*host, copied)

    def tree(self, tokens: torch.Tensor, parents: torch.Tensor, copied=None) -> torch.Tensor:
        """Bitmask [B * N, W] int32 of every node of a draft tree (tokens, parents [B, N] int64: root first,
        parents before children; ``copied``: ``fetch``'s event), on the device: node j's path is its
        ancestors' tokens and its own."""
        if copied is not None:
            copied.synchronize()
        rows = []
        for b, (toks, pars) in enumerate(zip(tokens.tolist(), parents.tolist())):
            paths = [[]]
            for j in range(1, len(toks)):
                paths.append(paths[pars[j]] + [toks[j]])
            rows += [(b, path) for path in paths]
        return self.rows(rows)[0]

    def rows(self, rows: list[tuple[int, list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(bitmask, forced) of (request index, path) rows; see ``__call__``."""
        bitmask = torch.full((len(rows), self.words), -1, dtype=torch.int32)
        forced = [-1] * len(rows)
        for i, (b, path) in enumerate(rows):
            if self.matchers[b] is None:  # no constraint: the row allows everything
                continue
            key = (b, *path)
            if key not in self.seen:
                self.seen[key] = self.fill(self.matchers[b], path)
            bitmask[i], forced[i] = self.seen[key]
        return to_device(bitmask, torch.int32, self.device), to_device(forced, torch.long, self.device)

    def fill(self, matcher, path: list[int]) -> tuple[torch.Tensor, int]:
        row = torch.zeros(self.words, dtype=torch.int32)
        row[0] = 1  # a dead path: token 0 alone
        if self.eos_token_ids.intersection(path):
            return row, -1
        n = matcher.try_consume_tokens(path)
        forced = -1
        if n == len(path):
            # llguidance.torch's helper does this, but importing that module compiles a torch function
            matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
            forced = (matcher.compute_ff_tokens() or [-1])[0]
        matcher.rollback(n)
        return row, forced
