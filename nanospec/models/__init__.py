"""Model definitions (the Llama-family target, the Frozen-KV MTP drafter) and their weight loading."""
from collections.abc import Iterable

import torch
from torch import nn


def load_weights(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], skip: tuple[str, ...] = ()) -> None:
    """Copy checkpoint tensors into ``model`` by HF name, packing q/k/v and gate/up through the model's
    ``packed_modules_mapping`` (a linear with ``shard_sizes`` takes shard i at its offset).

    A model's ``strip_prefix`` (e.g. "model.") is removed from checkpoint names. Names in ``skip`` (substrings)
    and rotary caches are ignored. Raises ValueError naming the tensor when a checkpoint tensor has no parameter
    or the wrong shape, or when a parameter (or one shard of a packed one) gets no tensor.
    """
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", {})
    modules = dict(model.named_modules())
    loaded = set()
    for name, t in tensors:
        if "rotary_emb" in name or any(s in name for s in skip):
            continue
        name = name.removeprefix(getattr(model, "strip_prefix", ""))
        target, shard = name, None
        for src, (dst, idx) in packed.items():
            if f".{src}." in name:
                target, shard = name.replace(f".{src}.", f".{dst}."), idx
                break
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}")
        p = params[target]
        if shard is not None:
            sizes = modules[target.rsplit(".", 1)[0]].shard_sizes
            p = p.data.narrow(0, sum(sizes[:shard]), sizes[shard])
        if p.shape != t.shape:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(t)
        loaded.add((target, shard))
    missing = [n for n in params if (n, None) not in loaded and not all(
        (n, i) in loaded for i in range(len(getattr(modules[n.rsplit(".", 1)[0]], "shard_sizes", [0]))))]
    if missing:
        raise ValueError(f"checkpoint is missing weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}")


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
