"""Checkpoint I/O of the Frozen-KV MTP drafter (HF ``gemma4_assistant`` dirs: config.json + *.safetensors).

Names follow HF ``Gemma4AssistantForCausalLM``; the drafter's packed ``gate_up_proj`` is split back into
``gate_proj`` / ``up_proj``. With ``use_ordered_embeddings`` the drafter keeps its LM-head rows in cluster
order (row j holds token ``token_ordering[j]``, see ``Gemma4Assistant.set_token_ordering``); checkpoints hold
them in token order, as HF does, so loading reorders them once and ``hf_tensors`` puts them back (the
tensors ``nanospec.tools.checkpoints.save_assistant`` writes).
"""

import json
import pathlib

import torch

from .. import parallel

# Checkpoint tensors HF itself ignores for KV-shared layers (K/V come from the target).
_IGNORED = ("self_attn.k_proj.", "self_attn.v_proj.", "self_attn.k_norm.", "self_attn.v_norm.", "rotary_emb.")
_ORDER = "masked_embedding.token_ordering"


def _slots(model) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the model's storage (views; gate/up are the two halves of ``gate_up_proj``)."""
    slots = {}
    for name, p in model.named_parameters():
        if name.endswith("gate_up_proj.weight"):
            i = p.shape[0] // 2
            slots[name.replace("gate_up_proj", "gate_proj")] = p.data[:i]
            slots[name.replace("gate_up_proj", "up_proj")] = p.data[i:]
        else:
            slots[name] = p.data
    if model.masked_embedding is not None:
        slots[_ORDER] = model.masked_embedding.token_ordering
    return slots


def hf_tensors(model) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint of ``model`` holds, under HF names, LM-head rows in token order. Views of the
    model's storage, except the LM head of a centroid-head drafter (a copy put back in token order)."""
    out = _slots(model)
    if model.masked_embedding is not None and model.lm_head is not None:
        rows = out["lm_head.weight"]
        order = model.masked_embedding.token_ordering
        out["lm_head.weight"] = torch.empty_like(rows).index_copy_(0, order, rows)
    return out


def _copy(name, dst, t):
    if tuple(dst.shape) != tuple(t.shape):
        raise ValueError(
            f"assistant: checkpoint tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(dst.shape)}"
        )
    with torch.no_grad():
        dst.copy_(t)


def load_checkpoint(model, tensors) -> None:
    """Strict load of HF-named ``(name, tensor)`` pairs into ``model`` (freshly constructed): packs gate/up,
    takes ``lm_head`` from ``lm_head.weight`` or (tied) ``model.embed_tokens.weight``, then applies the
    checkpoint's ``token_ordering`` (which reorders the LM-head rows). Raises ValueError naming the tensor
    when one matches no parameter, has the wrong shape or is missing, or when ``token_ordering`` is not a
    permutation."""
    slots = _slots(model)
    modules = dict(model.named_modules())
    tied = bool(getattr(model.config, "tie_word_embeddings", True))
    got = set()
    embed = None
    order = None
    for name, t in tensors:
        if any(s in name for s in _IGNORED) or (name.startswith("masked_embedding.") and name not in slots):
            continue
        if name in ("lm_head.weight", "model.embed_tokens.weight") and model.lm_head is None:
            continue  # use_target_lm_head: the assistant's own table is unused
        if name == "model.embed_tokens.weight":
            embed = t  # only the LM head's (tied) source; HF never embeds with it here
            continue
        if name not in slots:
            raise ValueError(f"assistant: checkpoint tensor {name!r} matches no parameter")
        if name == _ORDER:  # applied last, to the rows loaded in token order (it moves them)
            order = t
        else:
            _copy(name, slots[name], parallel.shard_of(modules.get(name.rsplit(".", 1)[0]), name, t))
        got.add(name)
    if model.lm_head is not None and "lm_head.weight" not in got and tied and embed is not None:
        _copy("model.embed_tokens.weight", slots["lm_head.weight"], embed)
        got.add("lm_head.weight")
    missing = [n for n in slots if n not in got]
    if missing:
        hint = (
            ' (a checkpoint without an LM head must set "use_target_lm_head": true in config.json)'
            if "lm_head.weight" in missing
            else ""
        )
        raise ValueError(
            f"assistant: checkpoint is missing tensor {missing[0]!r}{hint}"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
        )
    if order is not None:
        model.masked_embedding.token_ordering.copy_(torch.arange(model.vocab_size))  # rows are in token order
        model.set_token_ordering(order)


def read_config(path):
    """The HF ``Gemma4AssistantConfig`` of a checkpoint dir, reading no tensor (for ``check_assistant_config``
    before any weights load). Raises ValueError naming the problem: not a dir with a config.json, wrong
    model_type, no *.safetensors."""
    from transformers import AutoConfig

    d = pathlib.Path(path).expanduser()
    if not (d / "config.json").is_file():
        raise ValueError(f"assistant: {str(path)!r} is not a directory with a config.json")
    model_type = json.loads((d / "config.json").read_text()).get("model_type")
    if model_type != "gemma4_assistant":
        raise ValueError(
            f"assistant: {str(path)!r} has model_type {model_type!r}, expected 'gemma4_assistant'"
        )
    if not any(d.glob("*.safetensors")):
        raise ValueError(f"assistant: {str(path)!r} has no *.safetensors weights")
    return AutoConfig.from_pretrained(str(d))


def load_assistant(cls, path, device="cpu", dtype=torch.float32, tp=parallel.SINGLE):
    """``cls.from_pretrained``: ``read_config``, construct ``cls(config, tp)`` (``tp``: this rank's
    ``parallel.TensorParallel``) on the meta device, materialise on ``device``, load the dir's tensors, cast
    floating tensors to ``dtype``. Raises ValueError naming the problem (those of ``read_config``,
    unsupported config, missing / mis-shaped / unexpected tensor)."""
    from ..loader import iter_safetensors

    config = read_config(path)
    with torch.device("meta"):
        model = cls(config, tp)
    model.to_empty(device=device)
    load_checkpoint(model, iter_safetensors(pathlib.Path(path).expanduser()))
    return model.to(dtype).eval()
