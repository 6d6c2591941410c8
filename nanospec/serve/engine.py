"""The engine thread of nanospec-serve and vLLM's Prometheus metrics, which it keeps.

One thread owns the ``LLM`` and loops: take the adds and aborts that handlers queued, run one ``step()``,
then hand every handler its updates with ONE wake-up per event loop (``call_soon_threadsafe`` with the whole
batch), whatever the number of requests. Handlers never call the engine."""

import queue
import threading
import time

from .protocol import ApiError

# vLLM's histogram buckets (s): time to first token, then per-token latencies
# fmt: off
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20,
                40, 80, 160, 640, 2560]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80]
# fmt: on


class Metrics:
    """vLLM's Prometheus metrics, by its names and meanings (vllm/v1/metrics/loggers.py and
    vllm/v1/spec_decode/metrics.py), labelled ``model_name`` and ``engine``; the spec-decode counters exist
    only with an assistant (``num_positions`` = num_steps). The time-per-output-token histogram is
    ``inter_token_latency_seconds``, vLLM's name for it since 0.11 (one observation per engine step that
    delivers tokens). ``num_preemptions``: preemptions by recompute (``LLM.stats()``'s count, read after every
    step). Plus ``nanospec:num_draft_inputs`` (requests holding a next input, under speculation: 0 when
    idle)."""

    def __init__(self, model_name: str, num_positions: int):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = reg = CollectorRegistry()
        labels = {"model_name": model_name, "engine": "0"}
        self.speculative = num_positions > 0

        def make(cls, name, doc, extra=(), **kw):
            m = cls(name if ":" in name else "vllm:" + name, doc, [*labels, *extra], registry=reg, **kw)
            return m if extra else m.labels(**labels)

        self.running = make(Gauge, "num_requests_running", "Number of requests in model execution batches.")
        self.waiting = make(Gauge, "num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = make(Gauge, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.draft_inputs = make(Gauge, "nanospec:num_draft_inputs", "Requests holding a next input.")
        self.prompt_tokens = make(Counter, "prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = make(Counter, "generation_tokens", "Number of generation tokens processed.")
        self.queries = make(Counter, "prefix_cache_queries", "Prefix cache queries, in queried tokens.")
        self.hits = make(Counter, "prefix_cache_hits", "Prefix cache hits, in cached tokens.")
        success = make(Counter, "request_success", "Count of processed requests.", ["finished_reason"])
        self.success = {r: success.labels(**labels, finished_reason=r) for r in ("stop", "length", "abort")}
        self.preemptions = make(Counter, "num_preemptions", "Cumulative number of preemptions.")
        self.ttft = make(Histogram, "time_to_first_token_seconds", "Time to 1st token.", buckets=TTFT_BUCKETS)
        self.itl = make(Histogram, "inter_token_latency_seconds", "Inter-token latency.", buckets=ITL_BUCKETS)
        if self.speculative:
            self.drafts = make(Counter, "spec_decode_num_drafts", "Number of spec decoding drafts.")
            self.draft_tokens = make(Counter, "spec_decode_num_draft_tokens", "Number of draft tokens.")
            self.accepted = make(Counter, "spec_decode_num_accepted_tokens", "Number of accepted tokens.")
            name, doc = "spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position."
            per_pos = make(Counter, name, doc, ["position"])
            self.per_pos = [per_pos.labels(**labels, position=str(i)) for i in range(num_positions)]


class Choice:
    """One choice of a ``Job``: its own engine request. ``sent``: tokens handed to the handler so far;
    ``t_last``: when it last got tokens (until then: when the request came)."""

    def __init__(self, job, index: int, prompt_ids: list[int], params):
        self.job = job
        self.index = index
        self.prompt_ids = prompt_ids
        self.params = params
        self.request_id = None
        self.req = None  # the engine's Request (LLM.get_request) while it runs
        self.sent = 0
        self.num_accept = 0
        self.t_last = time.perf_counter()


class Job:
    """One HTTP completion request on the engine side: one ``Choice`` per SamplingParams (``params`` holds n
    per prompt, in choice order). The engine thread answers through ``messages``, an asyncio.Queue of
    ``loop``: ("ok",), ("bad" | "busy" | "fault", message), ("tokens", choice index, new token ids, their
    logprob dicts (None unless asked), the prompt's logprob dicts (with the first tokens, when asked), the
    choice's ``LLM.output_dict`` once it has finished, else None)."""

    def __init__(self, prompts: list[list[int]], params: list, loop, messages):
        n = len(params) // len(prompts)
        self.choices = [Choice(self, i, prompts[i // n], p) for i, p in enumerate(params)]
        self.loop = loop
        self.messages = messages


def deliver(items: list) -> None:
    """On the handlers' event loop: put each (queue, message) of one engine step."""
    for q, message in items:
        q.put_nowait(message)


class Engine:
    """The thread that owns the ``LLM`` (``start()`` starts it): it takes adds and aborts from ``inbox``
    (blocking there when idle), runs one ``step()``, collects every live choice's new tokens, wakes each
    handler loop once with all of them, again. An add that would leave more than ``max_waiting`` requests
    waiting is refused ("busy"). ``dead``: the exception that ended the thread, or None; every handler then
    waiting (running, queued, or in the middle of its add) is told ("fault")."""

    def __init__(self, llm, metrics: Metrics, max_waiting: int = 1024):
        self.llm = llm
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.live = {}  # request id -> Choice, until it finishes or is aborted
        self.inbox = queue.SimpleQueue()
        self.outbox = {}  # event loop -> [(queue, message)] of this turn
        self.adding = None  # the Job being added
        self.num_preemptions = 0  # the engine's preemptions counted in the metric so far
        self.dead = None

    def start(self) -> "Engine":
        threading.Thread(target=self._run, name="nanospec-engine", daemon=True).start()
        return self

    def put(self, kind: str, job: Job) -> None:
        """Queue "add" or "abort" for ``job``; ApiError 500 once the engine thread has died."""
        self.inbox.put((kind, job))
        if self.dead is not None:  # the dying thread sets ``dead`` before its last look at the inbox
            raise ApiError(500, f"the engine stopped: {self.dead!r}")

    def _run(self) -> None:
        try:
            while True:
                self._drain(block=not self.llm.has_unfinished())
                self.llm.step()
                self._publish()
                self._flush()
        except BaseException as e:
            self.dead = e  # a put after this raises: each job queued before it is told here
            jobs = [c.job for c in self.live.values()] + [self.adding] * (self.adding is not None)
            while not self.inbox.empty():
                kind, job = self.inbox.get()
                jobs += [job] * (kind == "add")
            for job in dict.fromkeys(jobs):
                self._post(job, "fault", f"the engine failed: {e!r}")
            self._flush()
            raise

    def _drain(self, block: bool) -> None:
        while block or not self.inbox.empty():  # waits for the first message only when idle
            kind, job = self.inbox.get()
            block = False
            if kind == "abort":
                self.metrics.success["abort"].inc(self._cancel(job))
            else:
                self.adding = job
                self._add(job)
                self.adding = None

    def _add(self, job: Job) -> None:
        waiting = self.llm.stats()["num_waiting"]
        if waiting + len(job.choices) > self.max_waiting:
            message = f"{waiting} requests wait (--max-waiting {self.max_waiting}): retry later"
            self._post(job, "busy", message)
            return
        try:
            for c in job.choices:
                c.request_id = self.llm.add_request(c.prompt_ids, c.params)
                c.req = self.llm.get_request(c.request_id)
                self.live[c.request_id] = c
            self._post(job, "ok")
        except (ValueError, TypeError) as e:  # the engine's check of one prompt: none of the job runs
            self._cancel(job)
            self._post(job, "bad", str(e))

    def _cancel(self, job: Job) -> int:
        """Abort the job's choices still running (finished ones have left ``live``); returns how many."""
        count = 0
        for c in job.choices:
            if self.live.pop(c.request_id, None) is not None:
                count += self.llm.abort_request(c.request_id)
        return count

    def _publish(self) -> None:
        llm = self.llm
        m = self.metrics
        now = time.perf_counter()
        for rid, c in list(self.live.items()):
            r = c.req
            new = r.output_token_ids[c.sent :]  # its undelivered tokens
            if not new and not r.is_finished:
                continue
            (m.itl if c.sent else m.ttft).observe(now - c.t_last)  # the first tokens: since the arrival
            if c.sent == 0:  # its prefill is done: vLLM counts the prompt and the prefix-cache lookup here
                m.prompt_tokens.inc(len(r.prompt_token_ids))
                m.queries.inc(len(r.prompt_token_ids))
                m.hits.inc(r.num_cached_tokens or 0)
            c.sent += len(new)
            c.t_last = now
            m.generation_tokens.inc(len(new))
            if m.speculative:  # a draft per speculative step, a - 1 of its tokens accepted
                acc = r.accept_lengths[c.num_accept :]
                m.drafts.inc(len(acc))
                m.draft_tokens.inc(sum(r.draft_token_counts[c.num_accept :]))
                m.accepted.inc(sum(acc) - len(acc))
                for pos, counter in enumerate(m.per_pos):
                    counter.inc(sum(a - 1 > pos for a in acc))
                c.num_accept = len(r.accept_lengths)
            # built while the choice is in ``live``: if this raises, its handler is still told
            final = llm.output_dict(r) if r.is_finished else None
            if r.is_finished:
                del self.live[rid]
                m.success[r.finish_reason].inc()
            logprobs = None if r.logprobs is None else r.logprobs[c.sent - len(new) : c.sent]
            prompt_logprobs = r.prompt_logprobs if c.sent == len(new) else None  # with the first tokens
            self._post(c.job, "tokens", c.index, new, logprobs, prompt_logprobs, final)
        stats = llm.stats()
        m.preemptions.inc(stats["num_preemptions"] - self.num_preemptions)
        self.num_preemptions = stats["num_preemptions"]
        m.waiting.set(stats["num_waiting"])
        m.kv_usage.set(stats["kv_cache_usage"])
        m.draft_inputs.set(stats["num_draft_inputs"])
        m.running.set(stats["num_running"])  # last: a reader that sees it sees this step's other gauges

    def _post(self, job: Job, *message) -> None:
        self.outbox.setdefault(job.loop, []).append((job.messages, message))

    def _flush(self) -> None:
        """One wake-up per event loop for everything this turn produced."""
        for loop, items in self.outbox.items():
            try:
                loop.call_soon_threadsafe(deliver, items)
            except RuntimeError:  # that loop has closed: nobody waits there any more
                pass
        self.outbox = {}
