"""Per-request sampling options (vLLM / nano-vllm names)."""

from dataclasses import dataclass

from .structured import StructuredOutputsParams

MAX_LOGPROBS = 20  # top logprobs per token (OpenAI's limit)


@dataclass
class SamplingParams:
    """How one request samples and when it stops; each field's default and meaning: docs/usage.md,
    "``SamplingParams``".

    ``__post_init__`` checks every field (ValueError / TypeError naming it) and turns ``stop`` and
    ``stop_token_ids`` into lists (``[]`` for None, ``[s]`` for one stop string).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 128
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    cache_salt: str | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | dict | None = None

    def __post_init__(self):
        def num(name, kinds):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, kinds):
                kind = "an int" if kinds is int else "a number"
                raise TypeError(f"SamplingParams.{name} must be {kind}, got {v!r}")
            return v

        # beyond [1e-6, 1e6], logits / temperature leave fp32's range (the sampling kernels divide in fp32)
        if not (num("temperature", (int, float)) == 0 or 1e-6 <= self.temperature <= 1e6):
            raise ValueError(
                f"SamplingParams.temperature must be 0 (greedy) or in [1e-06, 1e+06], got {self.temperature}"
            )
        if not 0 < num("top_p", (int, float)) <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if num("top_k", int) == 0 or not -1 <= self.top_k < 2**31:  # an int32 on the device
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or in [1, 2**31), got {self.top_k}")
        if num("max_tokens", int) < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not 0 <= num("seed", int) < 2**63:
            raise ValueError(f"SamplingParams.seed must be in [0, 2**63), got {self.seed}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is not None and not isinstance(stop, (list, tuple)):
            raise TypeError(f"SamplingParams.stop must be a str or a list of str, got {self.stop!r}")
        self.stop = list(stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"SamplingParams.stop must be non-empty strings, got {self.stop!r}")
        ids = self.stop_token_ids
        if ids is not None and not isinstance(ids, (list, tuple)):
            raise TypeError(f"SamplingParams.stop_token_ids must be a list of int, got {ids!r}")
        self.stop_token_ids = list(ids or [])
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"SamplingParams.stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= num(name, int) <= MAX_LOGPROBS:
                raise ValueError(f"SamplingParams.{name} must be in [0, {MAX_LOGPROBS}], got {k}")
        salt = self.cache_salt
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise TypeError(f"SamplingParams.cache_salt must be a non-empty str or None, got {salt!r}")

        self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
