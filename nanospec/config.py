"""Engine options and their validation: every user option is checked here, before any work starts; and what
the engine reads of a model's HF config in one place: a layer's attention geometry (``layer_geometry``) and
RoPE parameters (``layer_rope_parameters``)."""

import math
import os
from dataclasses import dataclass, fields

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    """All options of ``LLM(...)``; each field's default and meaning: docs/usage.md, "``LLM`` options".

    ``__post_init__`` checks each field's value (ValueError / TypeError naming the field and its allowed
    range) and, with an assistant, fills the speculation defaults: ``num_steps`` 3 on CPU and 5 on CUDA,
    ``topk`` 1, ``num_draft_tokens`` ``num_steps + 1`` when ``topk`` is 1. Without one the three stay None.
    Checks that need the model's config run in ``LLM`` before any weights load (``parallel.check_sizes``,
    the assistant's and deterministic mode's checks).
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    page_size: int = 16
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gb: float = 2.0
    num_kv_blocks: int | None = None
    seed: int = 0
    enforce_eager: bool = False
    deterministic: bool = False
    enable_prefix_caching: bool = True
    overlap_schedule: bool | None = None
    load_format: str = "auto"
    assistant: str | None = None
    num_steps: int | None = None
    topk: int | None = None
    num_draft_tokens: int | None = None
    draft_position_offset: int = -1
    adaptive_speculation: bool = True
    tensor_parallel_size: int = 1
    trace: object = None

    def __post_init__(self):
        for name in ("model", "assistant"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, (str, os.PathLike)):
                raise TypeError(f"{name} must be a path (str or os.PathLike) or None, got {v!r}")
        for f in fields(self):  # the options typed bool or float; the int options below
            v = getattr(self, f.name)
            if f.type is bool and not isinstance(v, bool):
                raise TypeError(f"{f.name} must be a bool, got {v!r}")
            if f.type is float and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise TypeError(f"{f.name} must be a number, got {v!r}")
        if self.overlap_schedule is not None and not isinstance(self.overlap_schedule, bool):
            raise TypeError(f"overlap_schedule must be a bool or None, got {self.overlap_schedule!r}")
        for name, lo in (
            ("max_model_len", 2),
            ("max_num_seqs", 1),
            ("max_num_batched_tokens", 1),
            ("page_size", 1),
            ("seed", 0),
            ("num_kv_blocks", 2),
            ("num_steps", 1),
            ("topk", 1),
            ("num_draft_tokens", 2),
            ("draft_position_offset", -1),
            ("tensor_parallel_size", 1),
        ):
            v = getattr(self, name)
            if v is None and name in ("num_kv_blocks", "num_steps", "topk", "num_draft_tokens"):
                continue
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {v!r}")
            if v < lo:
                raise ValueError(f"{name} must be >= {lo}, got {v}")
        if self.seed >= 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if not (self.trace is None or isinstance(self.trace, bool) or callable(self.trace)):
            raise TypeError(
                f"trace must be None, a bool or a callable (step, event, fields), got {self.trace!r}"
            )
        if self.trace and self.assistant is None:
            raise ValueError("trace shows the Frozen-KV MTP lifecycle: it needs an assistant")
        if self.draft_position_offset > 0:
            raise ValueError(f"draft_position_offset must be -1 or 0, got {self.draft_position_offset}")
        if self.dtype not in ("auto", *DTYPES):
            allowed = ", ".join(map(repr, DTYPES))
            raise ValueError(f"dtype must be one of 'auto', {allowed}; got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                "device='cuda' was asked for but torch sees no CUDA device; use device='cpu' or 'auto'"
            )
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not 0 < self.cpu_kv_cache_gb < math.inf:
            raise ValueError(f"cpu_kv_cache_gb must be a finite number > 0, got {self.cpu_kv_cache_gb}")
        if self.deterministic and self.tensor_parallel_size > 2:  # 2 partial sums commute, 3+ need an order
            raise ValueError(
                f"deterministic=True needs tensor_parallel_size <= 2, got {self.tensor_parallel_size}"
            )
        if self.assistant is None:
            given = [n for n in ("num_steps", "topk", "num_draft_tokens") if getattr(self, n) is not None]
            if given:
                raise ValueError(
                    f"options {', '.join(given)} only apply to speculative decoding: "
                    "pass assistant=DIR or 'default', or drop them"
                )
            return
        if self.num_steps is None:  # per device, measured (docs/benchmarks.md)
            self.num_steps = 3 if self.torch_device().type == "cpu" else 5
        self.topk = 1 if self.topk is None else self.topk
        hi = 1 + self.num_steps * self.topk  # the most draft tokens: the root and num_steps levels of topk
        if self.num_draft_tokens is None:
            if self.topk > 1:
                raise ValueError(f"num_draft_tokens must be given when topk > 1 (allowed: 2..{hi})")
            self.num_draft_tokens = self.num_steps + 1
        if self.deterministic and self.topk > 1:
            raise ValueError(
                "deterministic=True covers chain speculation only (topk=1: a tree verify row "
                f"attends non-contiguous keys, unlike a decode row), got topk={self.topk}"
            )
        if not 2 <= self.num_draft_tokens <= hi:
            raise ValueError(
                f"num_draft_tokens must be in [2, {hi}] (1 + num_steps * topk), got {self.num_draft_tokens}"
            )
        if self.topk == 1 and self.num_draft_tokens != self.num_steps + 1:
            raise ValueError(
                f"with topk=1, num_draft_tokens must be num_steps + 1 = {self.num_steps + 1}, "
                f"got {self.num_draft_tokens}"
            )

    @classmethod
    def from_kwargs(cls, model, kwargs: dict) -> "EngineConfig":
        """Build from ``LLM(model, **kwargs)``; an unknown option is a TypeError naming it."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown LLM option(s) {unknown}; known options: {sorted(names - {'model'})}")
        return cls(model=model, **kwargs)

    @property
    def speculative(self) -> bool:
        return self.assistant is not None

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return DTYPES[self.dtype]


def layer_geometry(hf_config, i: int) -> tuple[int, int]:
    """(head_dim, num_key_value_heads) of layer ``i`` of an HF text config (Gemma 4: its
    ``per_layer_config``; Llama / Qwen3: the config's own, head_dim defaulting to hidden / heads)."""
    layer = hf_config.per_layer_config[i] if hasattr(hf_config, "per_layer_config") else hf_config
    head_dim = getattr(layer, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return head_dim, getattr(layer, "num_key_value_heads", None) or hf_config.num_attention_heads


def layer_rope_parameters(c, layer_type: str) -> dict:
    """The RoPE parameters (a new dict: rope_type, rope_theta, ...) of ``layer_type`` ("sliding_attention"
    or "full_attention") in HF config ``c``: Gemma 4 holds one dict per layer type, Llama/Qwen3 one for all
    (or only ``rope_theta``, default 10000). Raises nothing."""
    rp = dict(getattr(c, "rope_parameters", None) or {})
    if isinstance(rp.get(layer_type), dict):
        rp = dict(rp[layer_type])
    return rp or {"rope_type": "default", "rope_theta": getattr(c, "rope_theta", 10000.0)}
