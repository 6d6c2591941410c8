"""nanospec: a nano LLM inference engine built around Frozen-KV MTP speculative decoding."""

from .llm import LLM
from .sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
