"""Model definitions (the Llama-family and Gemma 4 targets, the Frozen-KV MTP drafter) and which class builds
a target (their weights load through ``nanospec.loader``)."""

from torch import nn


def target_class(hf_config) -> tuple[type[nn.Module], object]:
    """The target model class for an HF config and the (text) config to build it from.

    llama / qwen3 -> ``LlamaForCausalLM``; gemma4_text (``Gemma4ForCausalLM``) and gemma4
    (``Gemma4ForConditionalGeneration``, its ``text_config``) -> ``Gemma4ForCausalLM``, whose config is
    checked here (before any weights load). Raises ValueError naming ``model_type`` for anything else, or the
    unsupported Gemma 4 field (:func:`gemma4.check_config`).
    """
    from .gemma4 import Gemma4ForCausalLM, check_config
    from .llama import LlamaForCausalLM

    mt = getattr(hf_config, "model_type", None)
    if mt in ("llama", "qwen3"):
        return LlamaForCausalLM, hf_config
    if mt in ("gemma4", "gemma4_text"):
        tc = hf_config.get_text_config() if mt == "gemma4" else hf_config
        check_config(tc)
        return Gemma4ForCausalLM, tc
    raise ValueError(f"model_type: {mt!r} is not supported; use llama, qwen3, gemma4_text or gemma4")
