"""Structured output: every token a constrained request produces is sampled inside its grammar, exactly as
plain decoding with the grammar's mask applied by a reference logits processor; speculation (chain and tree,
drafts masked too), overlap scheduling, preemption and batching change nothing; outputs parse and validate."""

import json
import re

import jsonschema
import llguidance
import llguidance.hf
import pytest
import torch
from llguidance.torch import allocate_token_bitmask, apply_token_bitmask_inplace, fill_next_token_bitmask
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from nanospec import LLM, SamplingParams
from nanospec.structured import StepMasks, StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
SCHEMAS = [
    PERSON,
    {  # nested objects
        "type": "object",
        "properties": {
            "city": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 10}},
                "required": ["name"],
                "additionalProperties": False,
            },
            "ok": {"type": "boolean"},
        },
        "required": ["city", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 99},
        "minItems": 1,
        "maxItems": 4,
    },
    {"enum": ["cat", "dog", "bird"]},
    {  # numbers with bounds, a required field among optional ones
        "type": "object",
        "properties": {"x": {"type": "integer", "minimum": 10, "maximum": 20}, "y": {"type": "boolean"}},
        "required": ["x"],
        "additionalProperties": False,
    },
]
DEEP = {"type": "integer"}
for _ in range(2000):  # nested deeper than Python's recursion limit
    DEEP = {"type": "array", "items": DEEP}
PROMPTS = [
    "Describe a person as JSON:",
    "Write a JSON object about a city.",
    "List some numbers in JSON:",
    "Which animal barks?",
]
CONSTRAINTS = [
    dict(json={k: v for k, v in PERSON.items() if k != "additionalProperties"}),  # strict: the same as PERSON
    dict(regex=r"[0-9]{3}-[a-z]{2,4}"),
    dict(choice=["yes", "no", "maybe"]),
    dict(grammar='start: "A" ("B" | "CD")+ "!"'),
    dict(json_object=True),
]


def engine(smollm2_dir, assistant=None, **kw):
    base = dict(device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=96, page_size=16)
    if assistant is not None:
        base |= dict(assistant=assistant, adaptive_speculation=False)
    return LLM(str(smollm2_dir), **{**base, **kw})


def constrained(i, max_tokens=16, **kw):
    """Request i's params: the constraints in turn, and every fifth request unconstrained."""
    so = None if i % 6 == 5 else StructuredOutputsParams(**CONSTRAINTS[i % len(CONSTRAINTS)])
    return SamplingParams(max_tokens=max_tokens, structured_outputs=so, **kw)


def run(llm, prompts, params):
    return [(o["token_ids"], o["finish_reason"]) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain(smollm2_dir):
    return engine(smollm2_dir)


@pytest.fixture(scope="module")
def chain(smollm2_dir):
    return engine(smollm2_dir, "default", num_steps=3)


class GrammarProcessor(LogitsProcessor):
    """The reference: HF's generate with the grammar's mask applied to each step's logits by llguidance's
    own torch helpers, the matcher advanced by the token HF chose."""

    def __init__(self, matcher, vocab_size):
        self.matcher = matcher
        self.bitmask = allocate_token_bitmask(1, vocab_size)
        self.start = None

    def __call__(self, input_ids, scores):
        if self.start is None:
            self.start = input_ids.shape[1]
        elif input_ids.shape[1] > self.start:
            assert self.matcher.consume_token(int(input_ids[0, -1]))
        fill_next_token_bitmask(self.matcher, self.bitmask)
        apply_token_bitmask_inplace(scores, self.bitmask)
        return scores


def test_constrained_greedy_is_plain_decoding_under_a_reference_mask(smollm2_dir, plain):
    """fp32 greedy: nanospec's constrained tokens == HF generate with llguidance's mask as a logits
    processor, for a JSON schema and a regex."""
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tok = plain.tokenizer
    ll_tok = llguidance.hf.from_tokenizer(tok, plain.runner.vocab_size, sorted(plain.eos_token_ids))
    for so in (StructuredOutputsParams(json=PERSON), StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}")):
        prompt = tok.encode(PROMPTS[0], add_special_tokens=False)
        got = plain.generate([prompt], SamplingParams(max_tokens=30, structured_outputs=so), use_tqdm=False)[
            0
        ]
        proc = GrammarProcessor(llguidance.LLMatcher(ll_tok, so.to_grammar()), plain.runner.vocab_size)
        ids = torch.tensor([prompt])
        ref = hf.generate(
            ids,
            max_new_tokens=30,
            do_sample=False,
            logits_processor=LogitsProcessorList([proc]),
            eos_token_id=sorted(plain.eos_token_ids),
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert got["token_ids"] == ref
        assert got["finish_reason"] == "stop"


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_speculation_changes_no_token(smollm2_dir, plain, chain, kind):
    """Greedy and seeded sampling, a batch of 6 mixing every constraint kind and an unconstrained request:
    the assistant (drafts masked, every verify node masked) == no assistant, token for token; and drafts
    were accepted."""
    spec = (
        chain if kind == "chain" else engine(smollm2_dir, "default", num_steps=3, topk=2, num_draft_tokens=6)
    )
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(6)]
    for kw in (dict(), dict(temperature=0.8, top_p=0.95, seed=7)):
        params = [constrained(i, **kw) for i in range(6)]
        want = run(plain, prompts, params)
        outs = spec.generate(prompts, params, use_tqdm=False)
        assert [(o["token_ids"], o["finish_reason"]) for o in outs] == want
        accepted = sum(sum(o["accept_lengths"]) - len(o["accept_lengths"]) for o in outs)
        assert accepted > 0


def test_unconstrained_rows_keep_their_graphs(smollm2_dir, chain, monkeypatch):
    """7 unconstrained requests and 1 constrained one in a batch, greedy and seeded: every speculative step
    runs the 7 through the graph path (buckets given on CPU: the phase runs on padded static buffers, which a
    graph replays), the constrained one alone and eagerly with its draft masks; the tokens equal an all-eager
    engine's (no buckets), with drafts accepted."""
    from test_cuda_graph import with_buckets

    from nanospec.model_runner import BucketGraphs

    graphed = engine(smollm2_dir, "default", num_steps=3)
    with_buckets(graphed, [1, 2, 4, 8])
    replayed = []  # the seeds of the live rows in each replayed batch (padding rows have seed 0)
    replay = BucketGraphs.run

    def recording(self, bs):
        replayed.append(set(graphed.worker.graphs.buf.seeds[:bs].tolist()) - {0})
        return replay(self, bs)

    monkeypatch.setattr(BucketGraphs, "run", recording)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    so = StructuredOutputsParams(**CONSTRAINTS[0])
    for kw in (dict(), dict(temperature=0.8, top_p=0.95)):
        params = [SamplingParams(max_tokens=16, seed=100 + i, ignore_eos=True, **kw) for i in range(7)]
        params.append(SamplingParams(max_tokens=16, seed=107, structured_outputs=so, **kw))
        replayed.clear()
        outs = graphed.generate(prompts, params, use_tqdm=False)
        assert [(o["token_ids"], o["finish_reason"]) for o in outs] == run(chain, prompts, params)
        assert replayed and all(seeds <= set(range(100, 107)) for seeds in replayed)
        assert set(range(100, 107)) in replayed  # all 7 in one replay, beside the constrained row
        assert sum(sum(o["accept_lengths"]) - len(o["accept_lengths"]) for o in outs) > 0


def test_verify_masks_are_made_after_the_target_is_launched(chain, monkeypatch):
    """A constrained speculative step reads its draft tree on the host through ``StepMasks.fetch`` (copies
    queued before the target's forward) and makes the verify masks after the forward is launched: on a GPU
    they are computed while it runs, not in series with it. Call order, on a CPU."""
    events = []
    forward = type(chain.worker.target).forward
    monkeypatch.setattr(StepMasks, "fetch", record(events, "fetch", StepMasks.fetch))
    monkeypatch.setattr(StepMasks, "tree", record(events, "tree", StepMasks.tree))
    monkeypatch.setattr(type(chain.worker.target), "forward", record(events, "forward", forward))
    chain.generate([PROMPTS[0]], constrained(0, max_tokens=6), use_tqdm=False)
    verifies = [events[k : k + 3] for k in range(len(events)) if events[k] == "fetch"]
    assert verifies and all(v == ["fetch", "forward", "tree"] for v in verifies)


def record(events: list, name: str, fn):
    def call(*args, **kwargs):
        events.append(name)
        return fn(*args, **kwargs)

    return call


def test_alone_batched_overlap_and_preemption_agree(smollm2_dir, chain):
    """Seeded sampling with the assistant: a request alone == in the 8 batched (every constraint kind and an
    unconstrained one) == batched with overlap scheduling on a pool so small that requests are preempted and
    recomputed."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    params = [constrained(i, temperature=1.0, seed=100 + i) for i in range(8)]
    batched = run(chain, prompts, params)
    assert [run(chain, [p], [q])[0] for p, q in zip(prompts[:3], params[:3])] == batched[:3]
    tight = engine(
        smollm2_dir, "default", num_steps=3, max_model_len=64, num_kv_blocks=6, overlap_schedule=True
    )
    assert run(tight, prompts, params) == batched
    assert tight.scheduler.num_preemptions > 0


def test_outputs_parse_and_validate_at_temperature_one(plain):
    """T = 1.0: 5 schemas (nested objects, arrays, enums, bounded numbers, required fields), 8 samples each,
    every output parses and validates; regex and choice likewise; all in one batch. Plain decoding:
    speculation gives the same tokens (above). The 200-sample run with the assistant: ``bench.py
    --structured``."""
    n = 8
    checks = [(StructuredOutputsParams(json=schema), schema) for schema in SCHEMAS]
    checks += [(StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"), r"[0-9]{3}-[a-z]{2,4}")]
    checks += [(StructuredOutputsParams(choice=["yes", "no", "maybe"]), "yes|no|maybe")]
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=96, structured_outputs=so)
        for so, _ in checks
        for s in range(n)
    ]
    outs = plain.generate(["Answer:"] * len(params), params, use_tqdm=False)
    for k, out in enumerate(outs):
        check = checks[k // n][1]
        assert out["finish_reason"] == "stop", out["text"]
        if isinstance(check, dict):
            jsonschema.validate(json.loads(out["text"]), check)
        else:
            assert re.fullmatch(check, out["text"]), out["text"]


def test_length_logprobs_and_ignore_eos(plain):
    """A constraint that cannot complete within max_tokens ends with "length" and its partial text (a prefix
    the grammar accepts); logprobs see the masked distribution (only allowed tokens, no -inf); a finished
    grammar ends the request at its end token even with ignore_eos."""
    so = StructuredOutputsParams(json=PERSON)
    out = plain.generate([PROMPTS[0]], SamplingParams(max_tokens=5, structured_outputs=so), use_tqdm=False)[0]
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 5
    matcher = plain.grammars.matcher(so)
    assert matcher.try_consume_tokens(out["token_ids"]) == 5 and not matcher.is_error()
    so = StructuredOutputsParams(choice=["yes", "no"])
    params = SamplingParams(max_tokens=10, logprobs=5, ignore_eos=True, structured_outputs=so)
    req_id = plain.add_request(PROMPTS[3], params)
    while plain.has_unfinished():
        for req in plain.step():
            if req.request_id == req_id:
                out = plain.output_dict(req)
    assert out["text"] in ("yes", "no") and out["finish_reason"] == "stop"
    assert out["token_ids"][-1] in plain.eos_token_ids
    first = out["logprobs"][0]
    texts = [plain.tokenizer.decode([t]) for t in first]
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    assert all(v > float("-inf") for v in first.values())


def test_masks_of_paths_that_leave_the_grammar_or_end(plain):
    """StepMasks: a row's mask is the grammar's after the committed tokens and its draft path; a path that
    leaves the grammar or passes an end token allows token 0 alone (it is never accepted: any mask would
    do); forced tokens are reported; the matcher is back where it was afterwards."""
    tok = plain.tokenizer
    req = plain._make_request(
        "x", SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes!"]))
    )
    eos = sorted(plain.eos_token_ids)[0]
    yes = tok.encode("yes", add_special_tokens=False)
    masks = StepMasks([req], plain.runner.vocab_size, plain.eos_token_ids, "cpu")
    paths = [[], [tok.encode("no", add_special_tokens=False)[0]], [*yes, eos]]
    bitmask, forced = masks.rows([(0, p) for p in paths])
    allowed = [(bitmask[i, t >> 5] >> (t & 31)) & 1 for i, t in ((0, yes[0]), (0, eos))]
    assert allowed == [1, 0]
    assert (
        bitmask[1:, 0].tolist() == [1, 1] and (bitmask[1:, 1:] == 0).all() and forced[1:].tolist() == [-1, -1]
    )
    assert not req.matcher.is_error() and req.matcher.try_consume_tokens(yes) == len(yes)


def test_a_grammar_past_the_library_limits_ends_its_request_only(plain):
    """A choice of 2,000 strings passes every check, but its parser row outgrows llguidance's limit of 2,000
    items after the shared prefix: that request ends with "abort" (nothing outside its grammar is emitted),
    the one beside it in the batch finishes as alone, and the engine goes on."""
    huge = SamplingParams(max_tokens=16, structured_outputs=dict(choice=[f"option {i}" for i in range(2000)]))
    small = SamplingParams(max_tokens=8, structured_outputs=dict(choice=["yes", "no"]))
    alone = plain.generate([PROMPTS[3]], small, use_tqdm=False)[0]["token_ids"]
    outs = plain.generate([PROMPTS[0], PROMPTS[3]], [huge, small], use_tqdm=False)
    assert outs[0]["finish_reason"] == "abort" and outs[1]["token_ids"] == alone
    assert plain.stats()["num_running"] == 0
    assert plain.generate([PROMPTS[3]], small, use_tqdm=False)[0]["token_ids"] == alone
    # the same grammars again, from the compiled cache: each copy fails as the first did (a matcher in
    # error allows only an end token; that token must not end the request as "stop")
    regex = SamplingParams(max_tokens=16, structured_outputs=dict(regex="(b{1000}){1000}"))
    for _ in range(2):
        outs = plain.generate([PROMPTS[0]] * 2, [huge, regex], use_tqdm=False)
        assert [(o["finish_reason"], o["token_ids"]) for o in outs] == [("abort", [])] * 2


ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a"],
}


@pytest.mark.parametrize(
    "schema, text, allowed",
    [
        (ADD, '{"a":2,"b":3}', True),
        (ADD, '{"a":2,"b":3,"c":2}', False),  # a key the schema does not list
        (ADD | {"additionalProperties": True}, '{"a":2,"b":3,"c":2}', True),
        (ADD | {"additionalProperties": {"type": "string"}}, '{"a":2,"c":"x"}', True),
        (ADD | {"additionalProperties": {"type": "string"}}, '{"a":2,"c":2}', False),
        ({"type": "object", "properties": {"o": ADD}}, '{"o":{"a":1,"z":1}}', False),  # nested
        ({"properties": {"a": {}}}, '{"a":1,"b":1}', False),  # an object schema without "type"
        ({"type": "object"}, "{}", True),
        ({"type": "object"}, '{"k":1}', False),
        ({"$defs": {"A": ADD}, "type": "array", "items": {"$ref": "#/$defs/A"}}, '[{"a":1,"q":0}]', False),
        ({"type": "array", "prefixItems": [{"type": "integer"}]}, "[1]", True),
        ({"type": "array", "prefixItems": [{"type": "integer"}]}, "[1,2]", False),
        ({"type": "array", "items": {"type": "integer"}}, "[1,2,3]", True),
        ({"anyOf": [ADD, {"type": "integer"}]}, '{"a":1,"x":1}', False),
        ({"allOf": [ADD]}, '{"a":1,"z":1}', False),  # one part: closed
        ({"allOf": [ADD, {"properties": {"c": {}}}]}, '{"a":1,"c":1}', True),  # parts add up: open
        ({"allOf": [{"properties": {"o": ADD}}, {"properties": {"c": {}}}]}, '{"o":{"a":1,"z":1}}', False),
        ({"type": "object", "properties": {"q": {"allOf": [ADD]}}}, '{"q":{"a":1,"z":2}}', False),
        (
            ADD | {"anyOf": [{"properties": {"x": {}}, "required": ["x"]}]},
            '{"x":2,"a":1}',  # llguidance writes the alternatives' properties first
            True,
        ),  # beside anyOf
        (None, '{"k":1,"j":[1]}', True),  # json_object: any object
    ],
)
def test_object_schemas_allow_only_their_listed_properties(plain, schema, text, allowed):
    """vLLM's (XGrammar's) strict reading: an object schema without ``additionalProperties`` allows only the
    properties it lists, an array with ``prefixItems`` only those items; a schema that states
    ``additionalProperties`` keeps it; a level whose properties may come from several schemas (beside
    ``anyOf``, the parts of an ``allOf`` of two) stays open, the levels below it strict; ``json_object`` is
    any object."""
    so = StructuredOutputsParams(json_object=True) if schema is None else StructuredOutputsParams(json=schema)
    matcher = plain.grammars.matcher(so)
    tokens = plain.tokenizer.encode(text, add_special_tokens=False)
    whole = matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()
    assert whole == allowed
    assert so.json is None or so.json == schema  # the request keeps the schema it was given


@pytest.mark.parametrize(
    "so, field",
    [
        (dict(json={"type": "strin"}), "json"),
        (dict(json={"type": "object", "not": {}}), "json"),
        (dict(json="{not json"), "json"),
        (dict(regex="(a"), "regex"),
        (dict(grammar="start: x"), "grammar"),
        (dict(choice=[]), "choice"),
        (dict(choice="yes"), "choice"),
        (dict(json_object=True, regex="a"), "exactly one"),
        (dict(), "exactly one"),
        (dict(pattern="a"), "unknown field"),
        (dict(json=DEEP), "json"),
    ],
)
def test_bad_constraints_are_refused_naming_the_field(so, field):
    with pytest.raises((ValueError, TypeError), match=re.escape(field)):
        SamplingParams(structured_outputs=so)
