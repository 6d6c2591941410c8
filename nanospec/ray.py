"""Data-parallel nanospec on Ray (docs/scaling.md): N engines, one per Ray actor, for batch inference over a
Ray Data set (``LLMPredictor``) or behind one endpoint with Ray Serve (``build_app``), as vLLM's
``ray.data.llm`` and Ray Serve LLM do. Each engine is the in-process ``LLM`` (tensor parallelism inside an
actor as in one process); Ray schedules, routes and restarts. Needs ``pip install 'nanospec[ray]'``."""

from dataclasses import fields

import numpy as np

from . import default_model
from .config import EngineConfig
from .llm import LLM
from .sampling_params import SamplingParams

INPUT_COLUMNS = ("prompt", "messages", "prompt_token_ids")
# build_app's options: the LLM's and Serve's per replica
OPTION_TYPES = {f.name: f.type for f in fields(EngineConfig)} | dict(
    num_replicas=int, max_n=int, max_waiting=int, num_cpus=float, num_gpus=float | None
)


class LLMPredictor:
    """A callable class for Ray Data's ``map_batches``: one ``LLM`` per actor, built once.

        ds.map_batches(LLMPredictor, fn_constructor_kwargs=dict(model=DIR, assistant=None,
                       sampling_params=dict(temperature=0, max_tokens=64), **LLM options),
                       concurrency=N, batch_size=B, num_gpus=tensor_parallel_size)   # num_gpus on GPUs only

    ``sampling_params``: the keyword arguments of one ``SamplingParams`` for every row (or one). A batch holds
    exactly one input column: ``prompt`` (str, tokenized as given, as ``LLM.generate``), ``messages`` (a
    chat, a list of {role, content}, rendered with the tokenizer's chat template and generation prompt as
    ``nanospec-serve``'s /v1/chat/completions) or ``prompt_token_ids`` (ints). Returned: the batch's columns
    and, per row in order, ``generated_text`` (str), ``generated_token_ids`` (ints), ``num_generated_tokens``,
    ``finish_reason`` ("stop" | "length") and, with an assistant, ``accept_lengths`` (per verify step:
    accepted drafts + 1). A bad option is a ValueError / TypeError naming it before any weights load; a
    batch without exactly one input column, or with a bad row, a ValueError / TypeError naming it.
    """

    def __init__(self, model: str | None = None, sampling_params: dict | SamplingParams | None = None, **llm):
        if isinstance(sampling_params, dict):
            try:
                sampling_params = SamplingParams(**sampling_params)
            except TypeError as e:  # an unknown key: Python's message names it
                raise TypeError(f"sampling_params: {e}") from None
        if not isinstance(sampling_params, (SamplingParams, type(None))):
            raise TypeError(f"sampling_params must be a dict or SamplingParams, got {sampling_params!r}")
        self.params = sampling_params or SamplingParams()
        self.llm = LLM(model, **llm)

    def __call__(self, batch: dict) -> dict:
        given = [c for c in INPUT_COLUMNS if c in batch]
        if len(given) != 1:
            raise ValueError(f"a batch needs exactly one of the columns {INPUT_COLUMNS}, got {sorted(batch)}")
        rows = list(batch[given[0]])
        if given[0] == "messages":
            chat = dict(tokenize=False, add_generation_prompt=True)
            rows = [self.llm.tokenizer.apply_chat_template([dict(m) for m in r], **chat) for r in rows]
        elif given[0] == "prompt_token_ids":
            rows = [np.asarray(r).tolist() for r in rows]
        outs = self.llm.generate(rows, self.params, use_tqdm=False)
        out = dict(batch)
        out["generated_text"] = [o["text"] for o in outs]
        out["generated_token_ids"] = [o["token_ids"] for o in outs]
        out["num_generated_tokens"] = [len(o["token_ids"]) for o in outs]
        out["finish_reason"] = [o["finish_reason"] for o in outs]
        if self.llm.config.speculative:
            out["accept_lengths"] = [o["accept_lengths"] for o in outs]
        return out


def _typed(name: str, value):
    """``value`` of option ``name`` as its type: ``serve run`` passes every ``name=value`` as a string
    ("none" for None, "true" / "false"); others pass as given. ValueError naming the option."""
    kind = OPTION_TYPES.get(name, str)
    if not isinstance(value, str) or kind in (str, object):
        return value
    if value.lower() == "none":  # an option that may be None (for others the engine names the bad value)
        return None
    if kind == str | None:
        return value
    if kind in (bool, bool | None):
        if value.lower() not in ("true", "false"):
            raise ValueError(f"{name} must be true or false, got {value!r}")
        return value.lower() == "true"
    number = float if kind in (float, float | None) else int
    what = "a number" if number is float else "an int"
    try:
        return number(value)
    except ValueError:
        raise ValueError(f"{name} must be {what}, got {value!r}") from None


def build_app(args: dict):
    """A Ray Serve application (Serve's application-builder convention): ``num_replicas`` replicas, each one
    ``LLM`` behind ``nanospec-serve``'s OpenAI app (``serve.app.build_app``: the same endpoints, streaming,
    metrics, limits and API key), Serve routing the requests.

        serve run nanospec.ray:build_app model=DIR num_replicas=4 [api_key=KEY] [LLM option=value ...]
        serve.run(build_app({"model": DIR, "num_replicas": 4, ...}))     # from Python

    ``args``: ``model`` (None: the default model), ``num_replicas`` (1), and per replica ``api_key``,
    ``max_n`` (16) and ``max_waiting`` (1024) as ``nanospec-serve``'s options, Ray
    resources per replica ``num_cpus`` (1) and ``num_gpus`` (default: ``tensor_parallel_size`` when the
    engine runs on CUDA, else 0), and any ``LLM`` option. All are checked here, before any replica starts
    (ValueError / TypeError naming the field). Each response carries the header ``x-nanospec-replica``: the
    Serve replica that answered."""
    from ray import serve

    from .serve.app import build_app as openai_app

    options = {k: _typed(k, v) for k, v in args.items()}
    model = options.pop("model", None)
    api_key = options.pop("api_key", None)
    num_replicas = options.pop("num_replicas", 1)
    max_n = options.pop("max_n", 16)
    max_waiting = options.pop("max_waiting", 1024)
    num_cpus = options.pop("num_cpus", 1)
    num_gpus = options.pop("num_gpus", None)
    for field, value in dict(num_replicas=num_replicas, max_n=max_n, max_waiting=max_waiting).items():
        if type(value) is not int or value < 1:
            raise ValueError(f"{field} must be an int >= 1, got {value!r}")
    config = EngineConfig.from_kwargs(model, options)
    if num_gpus is None:
        num_gpus = config.tensor_parallel_size if config.torch_device().type == "cuda" else 0
    name = model or default_model.DEFAULT_MODEL_NAME

    def replica_app():  # runs in each replica: its engine and the app over it
        replica = serve.get_replica_context().replica_id.unique_id.encode()
        app = openai_app(LLM(model, **options), name, api_key, max_n, max_waiting)

        async def tagged(scope, receive, send):  # the app, its responses tagged with the replica
            async def send_tagged(message):
                if message["type"] == "http.response.start":
                    message["headers"] = [*message.get("headers", []), (b"x-nanospec-replica", replica)]
                await send(message)

            await app(scope, receive, send_tagged)

        return tagged

    resources = dict(num_cpus=num_cpus, num_gpus=num_gpus)
    deployment = serve.deployment(serve.ingress(replica_app)(), name="nanospec", ray_actor_options=resources)
    return deployment.options(num_replicas=num_replicas, max_ongoing_requests=config.max_num_seqs).bind()
