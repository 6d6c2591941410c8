"""Model definitions (the Llama-family and Gemma 4 targets, the Frozen-KV MTP drafter), weight loading."""

import logging
from collections.abc import Iterable

import torch
from torch import nn

from .. import parallel

logger = logging.getLogger(__name__)


def load_weights(
    model: nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor]],
    skip: tuple[str, ...] = (),
    names: Iterable[str] | None = None,
) -> None:
    """Copy checkpoint tensors into ``model`` by HF name, packing q/k/v and gate/up through the model's
    ``packed_modules_mapping`` (shard i goes to its offset in the ``parallel.Linear``'s ``shard_sizes``); a
    tensor-parallel layer takes this rank's piece (``parallel.shard_of``).

    The first of a model's ``strip_prefix`` (a tuple tried in order, e.g. ("model.",)) that a checkpoint name
    starts with is removed from it. Names in ``skip`` (substrings) and rotary caches are ignored; so are names
    matching the model's ``unused_weights`` (a tuple of substrings, e.g. a multimodal checkpoint's vision
    tower), counted in one info line.
    Raises ValueError naming the tensor when a checkpoint tensor has no parameter (or no shard) or the wrong
    shape, or when a parameter (or one shard of a packed one) gets no tensor; given every checkpoint name in
    ``names`` (``loader.safetensors_names``), the last two are checked before any tensor is read.
    """
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())

    def num_parts(param):  # the packed parts of the linear holding ``param``; 1 for any other module
        module = modules[param.rsplit(".", 1)[0]]
        return len(module.shard_sizes) if isinstance(module, parallel.Linear) else 1

    def place(name):  # (name without prefix, parameter, packed shard or None), or None: not loaded
        if "rotary_emb" in name or any(s in name for s in skip + model.unused_weights):
            return None
        name = next((name.removeprefix(p) for p in model.strip_prefix if name.startswith(p)), name)
        target = name
        shard = None
        for src, (dst, idx) in model.packed_modules_mapping.items():
            if f".{src}." in name:
                target = name.replace(f".{src}.", f".{dst}.")
                shard = idx
                break
        if target not in params or (shard is not None and shard >= num_parts(target)):  # v_proj of k_eq_v
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}")
        return name, target, shard

    def check_complete(loaded):
        missing = [
            n
            for n in params
            if (n, None) not in loaded and not all((n, i) in loaded for i in range(num_parts(n)))
        ]
        if missing:
            more = " ..." if len(missing) > 5 else ""
            raise ValueError(f"checkpoint is missing weights for {missing[:5]}{more}")

    if names is not None:
        check_complete({where[1:] for where in map(place, names) if where is not None})
    loaded = set()
    skipped = []
    for name, t in tensors:
        where = place(name)
        if where is None:
            if any(s in name for s in model.unused_weights):
                skipped.append(name)
            continue
        name, target, shard = where
        module = modules.get(target.rsplit(".", 1)[0])
        p = params[target]
        t = parallel.shard_of(module, target, t, shard or 0)
        if shard is not None:
            p = p.data.narrow(0, sum(module.shard_sizes[:shard]), module.shard_sizes[shard])
        if p.shape != t.shape:
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(p.shape)}"
            )
        with torch.no_grad():
            p.copy_(t)
        loaded.add((target, shard))
    check_complete(loaded)
    if skipped:
        logger.info(
            "%s: skipped %d checkpoint tensors it does not use, e.g. %r",
            type(model).__name__,
            len(skipped),
            skipped[0],
        )


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
    raise ValueError(
        f"model_type: {mt!r} is not supported; allowed values: llama, qwen3, gemma4_text, gemma4"
    )


def init_random_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights for shape-only runs (bench ``--shape``): N(0, std) matrices, unit norms, zero biases."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)
