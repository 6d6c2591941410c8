"""nanospec: a nano LLM inference engine built around Frozen-KV MTP speculative decoding.

``LLM`` and ``SamplingParams`` load on first use (PEP 562), so ``import nanospec.kernels.sampling`` imports
torch and triton, not the engine and transformers. ``nanospec/kernels`` is a link to the top-level
``kernels/`` folder (DESIGN §1)."""

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from .llm import LLM

        return LLM
    if name == "SamplingParams":
        from .sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'nanospec' has no attribute {name!r}")
