"""Data-parallel nanospec on Ray (docs/scaling.md): N engines, one per Ray actor, for batch inference over a
Ray Data set (``LLMPredictor``) or behind one endpoint with Ray Serve (``build_app``), as vLLM's
``ray.data.llm`` and Ray Serve LLM do. Each engine is the in-process ``LLM`` (tensor parallelism inside an
actor as in one process); Ray schedules, routes and restarts. Needs ``pip install 'nanospec[ray]'``."""

import numpy as np

from .llm import LLM
from .sampling_params import SamplingParams

INPUT_COLUMNS = ("prompt", "messages", "prompt_token_ids")


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
