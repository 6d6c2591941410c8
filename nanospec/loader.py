"""Loading, a layer beside the core (it runs once, before the first request): HF-format dirs (config,
tokenizer, safetensors), the target's checkpoint tensors by HF name (``load_weights``) and the Frozen-KV MTP
drafter's checkpoints (``load_assistant``). No model hub is ever contacted; the default model
(``model=None``) comes from ``default_model``.

The drafter's checkpoints (HF ``gemma4_assistant`` dirs: config.json + *.safetensors) follow HF
``Gemma4AssistantForCausalLM``'s names; its packed ``gate_up_proj`` is split back into ``gate_proj`` /
``up_proj``. With ``use_ordered_embeddings`` the drafter keeps its LM-head rows in cluster order (row j holds
token ``token_ordering[j]``, see ``set_token_ordering``); checkpoints hold them in token
order, as HF does, so loading reorders them once and ``nanospec.tools.checkpoints.hf_tensors`` puts them
back (the tensors ``save_assistant`` writes)."""

from __future__ import annotations

import json
import logging
import os
import pathlib
from collections.abc import Iterable, Iterator

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig

from . import default_model, parallel
from .models import target_class
from .parallel import SINGLE, linear

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "gemma4_text", "gemma4")  # gemma4: Gemma4ForConditionalGeneration


def resolve_model_dir(model: str | os.PathLike | None, need_weights: bool = True) -> pathlib.Path:
    """Return the HF-format directory for `model`.

    `None` (or the bare name DEFAULT_MODEL_NAME when no such local path exists) selects the default model,
    converted into the cache on first use. Anything else must be an existing dir with `config.json` and >= 1
    `*.safetensors` (weights are not required when `need_weights` is False, for random-weight runs).

    Raises:
        ValueError: `model` is not a dir, or lacks config.json / *.safetensors files.
        RuntimeError: the default model is not cached and cannot be obtained (offline, pip failure); says what
        to do.
    """
    if model is None or (str(model) == default_model.DEFAULT_MODEL_NAME and not os.path.exists(model)):
        return default_model.model_dir()
    d = pathlib.Path(model).expanduser()
    if not str(model) or not d.is_dir():  # "" would be Path("."): the working directory
        raise ValueError(f"model: {str(model)!r} is not an existing directory (expected an HF model dir)")
    missing = []
    if not (d / "config.json").is_file():
        missing.append("config.json")
    if need_weights and not any(d.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if missing:
        raise ValueError(f"model: directory {str(d)!r} is missing {' and '.join(missing)}")
    return d


def load_config(model_dir: str | os.PathLike) -> PretrainedConfig:
    """Load the model config via AutoConfig.

    Raises:
        ValueError: `model_type` is not one of SUPPORTED_MODEL_TYPES.
    """
    config = AutoConfig.from_pretrained(str(model_dir))
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type: {config.model_type!r} in {str(model_dir)!r} is not supported; "
            f"allowed values: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return config


def eos_token_ids(model_dir, hf_config, tokenizer) -> set[int]:
    """EOS ids from config.json, generation_config.json (if any) and the tokenizer."""
    try:
        gen = GenerationConfig.from_pretrained(model_dir)
    except OSError:
        gen = None
    ids = set()
    for e in (getattr(src, "eos_token_id", None) for src in (hf_config, gen, tokenizer)):
        ids |= set(e if isinstance(e, (list, tuple)) else [] if e is None else [e])
    return ids


def load_tokenizer(model_dir: str | os.PathLike):
    """Load the tokenizer of `model_dir` via AutoTokenizer (errors are transformers')."""
    return AutoTokenizer.from_pretrained(str(model_dir))


def iter_safetensors(model_dir: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of every `*.safetensors` file in `model_dir` (sorted by file
    name)."""
    for path in sorted(pathlib.Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def safetensors_names(model_dir: str | os.PathLike) -> list[str]:
    """The name of every tensor in the `*.safetensors` files of `model_dir` (from the headers: no tensor is
    read)."""
    names = []
    for path in sorted(pathlib.Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names += f.keys()
    return names


# ---- the target's weights
def build_target(cfg, device, dtype, max_position: int, model_dir=None, seed=0, tp=SINGLE, gemm=linear):
    """Construct the target (``models.target_class``: Llama/Qwen3 or Gemma 4, config checked first) on the
    meta device as rank ``tp.rank`` of ``tp.size``, its GEMMs through ``gemm``; materialise it on ``device``
    in ``dtype``, then load the checkpoint in ``model_dir`` (or random weights when None)."""
    cls, text_config = target_class(cfg)
    with torch.device("meta"):
        # materialised in dtype: no fp32 copy of the weights
        model = cls(text_config, max_position, tp, gemm).to(dtype)
    model.to_empty(device=device)
    if model_dir is None:
        init_random_weights(model, seed)
    else:
        skip = ("lm_head.",) if model.tied else ()
        load_weights(model, iter_safetensors(model_dir), skip, safetensors_names(model_dir))
    model.eval().requires_grad_(False)
    model.init_buffers(device)
    return model


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
        p = params[target].data
        t = parallel.shard_of(module, target, t, shard or 0)
        if shard is not None:
            p = p.narrow(0, sum(module.shard_sizes[:shard]), module.shard_sizes[shard])
        _copy_checked(p, t, name)
        loaded.add((target, shard))
    check_complete(loaded)
    if skipped:
        message = "%s: skipped %d checkpoint tensors it does not use, e.g. %r"
        logger.info(message, type(model).__name__, len(skipped), skipped[0])


def _copy_checked(dst: torch.Tensor, t: torch.Tensor, name: str, who: str = "") -> None:
    """Copy checkpoint tensor ``t`` (named ``name``) into ``dst``, a ``.data`` view; ValueError naming it when
    the shapes differ (``who``: the message's prefix)."""
    if dst.shape != t.shape:
        raise ValueError(
            f"{who}checkpoint tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(dst.shape)}"
        )
    dst.copy_(t)


def init_random_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights for shape-only runs (bench ``--shape``): N(0, std) matrices, unit norms, zero biases."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():  # through .data: no autograd
        if p.dim() >= 2:
            p.data.copy_(torch.randn(p.shape, generator=g) * std)
        elif name.endswith("bias"):
            p.data.zero_()
        else:
            p.data.fill_(1.0)


# ---- the drafter's checkpoints
# Checkpoint tensors HF itself ignores for KV-shared layers (K/V come from the target).
_IGNORED = ("self_attn.k_proj.", "self_attn.v_proj.", "self_attn.k_norm.", "self_attn.v_norm.", "rotary_emb.")
_ORDER = "masked_embedding.token_ordering"


def assistant_slots(model) -> dict[str, torch.Tensor]:
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


@torch.no_grad()
def set_token_ordering(model, order: torch.Tensor) -> None:
    """Set the clusters of drafter ``model``'s centroid head: ``order [V]`` int, a permutation of range(V);
    cluster c holds tokens ``order[c*S:(c+1)*S]``. Its own LM head's rows move along (row j holds token
    ``order[j]``, so a cluster is one contiguous slice); a bound target LM head is gathered again. ValueError
    if ``order`` is not a permutation of range(V) or the drafter has no centroid head."""
    me = model.masked_embedding
    if me is None:
        raise ValueError("assistant: use_ordered_embeddings is false: there is no token_ordering to set")
    order = order.to(me.token_ordering.device, torch.long)
    V = model.vocab_size
    if order.shape != (V,) or not torch.equal(order.sort().values, torch.arange(V, device=order.device)):
        raise ValueError(
            f"assistant: masked_embedding.token_ordering must be a permutation of range({V}); got one of "
            f"shape {tuple(order.shape)} that is not"
        )
    if model.lm_head is not None:
        w = model.lm_head.weight
        w.copy_(torch.empty_like(w).index_copy_(0, me.token_ordering, w)[order])
    me.token_ordering.copy_(order)
    model.gather_target_rows()


def load_checkpoint(model, tensors) -> None:
    """Strict load of HF-named ``(name, tensor)`` pairs into ``model`` (freshly constructed): packs gate/up,
    takes ``lm_head`` from ``lm_head.weight`` or (tied) ``model.embed_tokens.weight``, then applies the
    checkpoint's ``token_ordering`` (which reorders the LM-head rows). Raises ValueError naming the tensor
    when one matches no parameter, has the wrong shape or is missing, or when ``token_ordering`` is not a
    permutation."""
    slots = assistant_slots(model)
    modules = dict(model.named_modules())
    tensors = dict(tensors)
    embed = tensors.pop("model.embed_tokens.weight", None)  # only the LM head's (tied) source
    if model.lm_head is None:
        tensors.pop("lm_head.weight", None)  # use_target_lm_head: the assistant's own table is unused
    elif getattr(model.config, "tie_word_embeddings", True) and embed is not None:
        tensors.setdefault("lm_head.weight", embed)
    for name, t in tensors.items():
        if any(s in name for s in _IGNORED) or (name.startswith("masked_embedding.") and name not in slots):
            continue
        if name not in slots:
            raise ValueError(f"assistant: checkpoint tensor {name!r} matches no parameter")
        if name == _ORDER:  # applied last, to the rows loaded in token order (it moves them)
            continue
        t = parallel.shard_of(modules.get(name.rsplit(".", 1)[0]), name, t)
        _copy_checked(slots[name], t, name, "assistant: ")
    missing = [n for n in slots if n not in tensors]
    if missing:
        hint = ""
        if "lm_head.weight" in missing:
            hint = ' (a checkpoint without an LM head must set "use_target_lm_head": true in config.json)'
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ValueError(f"assistant: checkpoint is missing tensor {missing[0]!r}{hint}{more}")
    if model.masked_embedding is not None:
        model.masked_embedding.token_ordering.copy_(torch.arange(model.vocab_size))  # rows are in token order
        set_token_ordering(model, tensors[_ORDER])


def read_assistant_config(path):
    """The HF ``Gemma4AssistantConfig`` of a checkpoint dir, reading no tensor (for ``check_assistant_config``
    before any weights load). Raises ValueError naming the problem: not a dir with a config.json, wrong
    model_type, no *.safetensors."""
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
    """``cls.from_pretrained``: ``read_assistant_config``, construct ``cls(config, tp)`` (``tp``: this rank's
    ``parallel.TensorParallel``) on the meta device, materialise on ``device``, load the dir's tensors, cast
    floating tensors to ``dtype``. Raises ValueError naming the problem (those of ``read_assistant_config``,
    unsupported config, missing / mis-shaped / unexpected tensor)."""
    config = read_assistant_config(path)
    with torch.device("meta"):
        model = cls(config, tp)
    model.to_empty(device=device)
    load_checkpoint(model, iter_safetensors(pathlib.Path(path).expanduser()))
    return model.to(dtype).eval()
