"""Request state: tokens, KV bookkeeping, and the finish rules over multi-token commits (DESIGN §4 rule 5)."""

import random
from enum import Enum, auto

from .sampling_params import SamplingParams


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Request:
    """One generation request.

    ``num_computed_tokens`` counts the tokens whose K/V are committed in the target pool (L in DESIGN §3).
    While decoding, the last output token (the bonus token under speculation) is not in KV yet, so
    ``num_computed_tokens == num_tokens - 1``. ``block_table`` lists the request's KV blocks in order.
    ``seed`` keys the sampling noise of every token the request produces (``kernels.sampling``): its
    ``SamplingParams.seed``, or one the engine drew for it. ``matcher`` (structured output): the llguidance
    matcher of ``SamplingParams.structured_outputs``, advanced by every committed output token; the request
    then ends at an end token even with ``ignore_eos`` (the grammar allows one only where it is complete),
    or with finish_reason "abort" where its grammar goes past one of llguidance's limits.
    """

    def __init__(
        self,
        request_id: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: set[int],
        tokenizer=None,
        matcher=None,
    ):
        self.request_id = request_id
        self.params = params
        self.seed = 0  # drawn when the request is queued (draw_seed)
        self.status = Status.WAITING
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.block_table: list[int] = []
        # num_inflight: decode steps launched but not yet committed (overlap scheduling: 0 or 1)
        self.num_computed_tokens = self.num_inflight = 0
        self.epoch = 0  # bumped by preemption: a step launched in an earlier epoch is dropped
        self.finish_reason: str | None = None
        self.stop_str_index: int | None = None  # where the text is cut, when a stop string matched
        # SamplingParams.logprobs / prompt_logprobs: one {token id: logprob} per output / prompt token
        self.logprobs: list[dict] | None = None if params.logprobs is None else []
        self.prompt_logprobs: list[dict | None] | None = None if params.prompt_logprobs is None else [None]
        self.accept_lengths: list[int] = []
        self.draft_token_counts: list[int] = []  # draft tokens verified in each of those steps
        self.num_cached_tokens: int | None = None  # prompt tokens whose KV came from the prefix cache
        # chained sha256 keys of the full blocks of all_token_ids (prefix caching)
        self.block_hashes: list[bytes] = []
        self.matcher = matcher
        ends_at_eos = not params.ignore_eos or matcher is not None
        self._stop_ids = set(params.stop_token_ids) | (set(eos_token_ids) if ends_at_eos else set())
        self._tokenizer = tokenizer

    def draw_seed(self, rng: random.Random) -> None:
        """Fix ``seed`` when the request is queued: its ``SamplingParams.seed``, or one drawn from the
        engine's generator ``rng`` (``LLM(seed=...)`` fixes a run)."""
        self.seed = self.params.seed if self.params.seed is not None else rng.randrange(2**63)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token(self) -> int:
        """The newest token (not in KV while decoding); no list copy on the decode hot path."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def prefill_len(self) -> int:
        """Tokens a prefill must put in KV: the whole prompt when new; all but the last token when resumed
        after preemption (that token, already emitted, is the next step's input / bonus token, so nothing is
        resampled)."""
        return self.num_tokens - (1 if self.output_token_ids else 0)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    def append_tokens(self, tokens: list[int], logprobs: list[dict] | None = None) -> int:
        """Commit sampled tokens (and their ``logprobs`` dicts, one per token, when the request asked for
        them), checking every one in order: stop string > stop token > max_tokens.

        Tokens after the first stop are dropped. Returns how many of ``tokens`` were kept.
        """
        p = self.params
        for i, tok in enumerate(tokens):
            if self.matcher is not None and (not self.matcher.consume_token(tok) or self.matcher.is_error()):
                # its grammar went past one of llguidance's limits (the matcher stopped): end this request
                self.finish_reason = "abort"
                self.status = Status.FINISHED
                return i
            self.output_token_ids.append(tok)
            if self.logprobs is not None:
                self.logprobs.append(logprobs[i])
            if (p.stop and self._match_stop_string()) or tok in self._stop_ids:
                self.finish_reason = "stop"
            elif len(self.output_token_ids) >= p.max_tokens:
                self.finish_reason = "length"
            if self.finish_reason is not None:
                self.status = Status.FINISHED
                return i + 1
        return len(tokens)

    def _match_stop_string(self) -> bool:
        # A stop string first appears in full at the token that completes it, so decoding a tail window that
        # holds it is enough: each token adds >= 1 byte (byte-level tokens: a character can take 4), hence
        # the window in UTF-8 bytes, plus slack.
        longest = max(len(s.encode()) for s in self.params.stop)
        tail = self._tokenizer.decode(self.output_token_ids[-(longest + 8) :], skip_special_tokens=True)
        if not any(s in tail for s in self.params.stop):
            return False
        text = self._tokenizer.decode(self.output_token_ids, skip_special_tokens=True)
        self.stop_str_index = min(text.find(s) for s in self.params.stop if s in text)
        return True

    def for_ranks(self) -> "Request":
        """The copy rank 0 sends to the other tensor-parallel ranks with each step (``Ranks.message``; any
        other pickle of a request is whole), of a size that does not grow with the output (DESIGN §9): no
        tokenizer, block hashes, logprobs or accept / draft lengths;
        while the request waits to prefill, its tokens and whole block table; once it runs, no tokens (a
        decode step reads none) and no block table (each rank keeps its own copy,
        ``parallel.Ranks.block_tables``; the step's plan carries the blocks it added,
        ``Batch.new_blocks``)."""
        drop = dict(_tokenizer=None, matcher=None, block_hashes=[], accept_lengths=[], draft_token_counts=[])
        drop |= dict(logprobs=None, prompt_logprobs=None)  # the ranks read params.logprobs only
        if self.status is not Status.WAITING:
            drop |= dict(prompt_token_ids=[], output_token_ids=[], block_table=[])
        slim = object.__new__(Request)
        slim.__dict__ = self.__dict__ | drop
        return slim

    def output_text(self) -> str:
        """The decoded output; cut before a matched stop string (``stop_str_index`` None: not cut)."""
        return self._tokenizer.decode(self.output_token_ids, skip_special_tokens=True)[: self.stop_str_index]
