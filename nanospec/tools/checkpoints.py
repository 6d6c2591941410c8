"""Checkpoints and configs for the tools: the real model shapes that speed runs use with random weights
(``bench.py --shape``, ``scripts/memory_plan.py``): Qwen3-0.6B, and Gemma 4 E2B / E4B / 26B-A4B / 31B with
their assistants at the sizes of HF's ``convert_gemma4_weights.py``; the config of a new assistant for a
Llama/Qwen3 target (``assistant_config_for``); writing an assistant as an HF ``gemma4_assistant`` dir
(``save_assistant``)."""

import json
import os
import pathlib

import torch

from ..config import layer_geometry, layer_rope_parameters
from ..loader import assistant_slots
from ..models.assistant_config import check_assistant_alone

S = "sliding_attention"
F = "full_attention"

# Qwen3-0.6B's config
QWEN3_0_6B = {
    "hidden_size": 1024,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 3072,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "max_position_embeddings": 40960,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
}

# Gemma 4 E2B / E4B / 26B-A4B / 31B (the sizes of HF's convert_gemma4_weights.py): a ``GEMMA4`` tuple holds
# these Gemma4TextConfig fields of the target, in this order ...
G4_FIELDS = """num_key_value_heads num_global_key_value_heads attention_k_eq_v sliding_window hidden_size
    num_hidden_layers num_attention_heads intermediate_size use_double_wide_mlp hidden_size_per_layer_input
    num_kv_shared_layers max_position_embeddings""".split()
# ... then every how-many-th layer is full attention; then its assistant's (4 layers S,S,S,F reading the
# target's KV heads, head dims and window) hidden size, Q heads, MLP and centroids (0: a dense LM head;
# top-k 32).
GEMMA4 = {
    "gemma4-e2b": (1, 1, False, 512, 1536, 35, 8, 6144, True, 256, 20, 131072, 5, 256, 4, 2048, 2048),
    "gemma4-e4b": (2, 2, False, 512, 2560, 42, 8, 10240, False, 256, 18, 131072, 6, 256, 4, 2048, 2048),
    "gemma4-26b-a4b": (8, 2, True, 1024, 2816, 30, 16, 2112, False, 0, 0, 262144, 6, 1024, 16, 8192, 0),
    "gemma4-31b": (16, 4, True, 1024, 5376, 60, 32, 21504, False, 0, 0, 262144, 6, 1024, 32, 8192, 0),
}
# 26B-A4B's routed experts, beside its dense MLP in every layer
G4_MOE = {
    "gemma4-26b-a4b": dict(enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704)
}
# the fields every Gemma 4 shape shares, target and assistant
G4_COMMON = dict(head_dim=256, global_head_dim=512, vocab_size=262144, vocab_size_per_layer_input=262144)


def gemma4_configs(shape, num_layers=None):
    """(Gemma4TextConfig, Gemma4AssistantConfig) of a ``GEMMA4`` shape at its real sizes (the target's first
    ``num_layers`` layers when given, the last one full attention); the assistant has its own tied LM head
    and no final softcap, the target final_logit_softcapping 30. Raises KeyError for a shape not in
    ``GEMMA4``."""
    from transformers import Gemma4AssistantConfig, Gemma4TextConfig

    *values, period, hidden, heads, mlp, centroids = GEMMA4[shape]
    fields = dict(zip(G4_FIELDS, values))
    target = G4_COMMON | fields | {"final_logit_softcapping": 30.0} | G4_MOE.get(shape, {})
    n = num_layers or target["num_hidden_layers"]
    target["num_hidden_layers"] = n
    target["layer_types"] = [S if (i + 1) % period and i < n - 1 else F for i in range(n)]
    assistant_text = G4_COMMON | {k: fields[k] for k in G4_FIELDS[:4]}  # the target's KV heads and window
    assistant_text |= dict(hidden_size=hidden, num_attention_heads=heads, intermediate_size=mlp)
    assistant_text |= dict(num_hidden_layers=4, layer_types=[S, S, S, F], hidden_size_per_layer_input=0)
    assistant_text["vocab_size_per_layer_input"] = 0
    assistant = Gemma4AssistantConfig(
        backbone_hidden_size=target["hidden_size"],
        use_ordered_embeddings=centroids > 0,
        num_centroids=centroids or 2048,
        text_config=Gemma4TextConfig(**assistant_text),
    )
    return Gemma4TextConfig(**target), assistant


def assistant_config_for(
    target_config,
    num_layers: int = 1,
    hidden_size: int | None = None,
    intermediate_size: int | None = None,
    num_heads: int | None = None,
    use_target_lm_head: bool = False,
    use_ordered_embeddings: bool = False,
    num_centroids: int = 2048,
    centroid_top_k: int = 32,
):
    """A ``Gemma4AssistantConfig`` whose q geometry and RoPE read a Llama/Qwen3 target's K (all layers full
    attention, the target's head_dim and RoPE; heads default to the target's query heads).

    ``use_target_lm_head`` (needs hidden_size == target hidden) makes the checkpoint carry no LM head.
    ``use_ordered_embeddings`` adds a centroid head: ``num_centroids`` equal-size clusters of the LM-head rows
    (the target's with ``use_target_lm_head``), ``centroid_top_k`` of them scored per draft row; the clusters
    start as contiguous token-id ranges (``loader.set_token_ordering`` sets others). Raises
    ValueError naming the field for a centroid count that does not divide the vocabulary or a top-k outside
    [1, num_centroids].
    """
    from transformers import Gemma4AssistantConfig, Gemma4TextConfig

    tc = target_config
    hd = layer_geometry(tc, 0)[0]
    rope = layer_rope_parameters(tc, "full_attention")
    hidden = hidden_size or tc.hidden_size
    text = Gemma4TextConfig(
        vocab_size=tc.vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate_size or 2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads or tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        head_dim=hd,
        global_head_dim=hd,
        layer_types=["full_attention"] * num_layers,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
        max_position_embeddings=tc.max_position_embeddings,
        rope_parameters={"full_attention": rope, "sliding_attention": rope},
    )
    cfg = Gemma4AssistantConfig(
        text_config=text,
        backbone_hidden_size=tc.hidden_size,
        tie_word_embeddings=not use_target_lm_head,
        use_ordered_embeddings=use_ordered_embeddings,
        num_centroids=num_centroids,
        centroid_intermediate_top_k=centroid_top_k,
    )
    if use_target_lm_head:
        cfg.use_target_lm_head = True
    check_assistant_alone(cfg)
    return cfg


def hf_tensors(model) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint of ``model`` holds, under HF names, LM-head rows in token order. Views of the
    model's storage, except the LM head of a centroid-head drafter (a copy put back in token order)."""
    out = assistant_slots(model)
    if model.masked_embedding is not None and model.lm_head is not None:
        rows = out["lm_head.weight"]
        order = model.masked_embedding.token_ordering
        out["lm_head.weight"] = torch.empty_like(rows).index_copy_(0, order, rows)
    return out


def save_assistant(model, out_dir, info: dict | None = None, max_mb: float = 16.0) -> pathlib.Path:
    """Write config.json + model.safetensors (``hf_tensors``) + training_info.json (``info``) into
    ``out_dir``, each file replaced atomically (a kill between two files can pair new weights with the old
    config; the trainer keeps one architecture per dir). Floating tensors in fp32 if they fit ``max_mb`` MiB,
    else bf16. Returns the dir."""
    from safetensors.torch import save_file

    d = pathlib.Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().cpu().contiguous().clone() for k, v in hf_tensors(model).items()}
    floats = [k for k, v in sd.items() if v.is_floating_point()]
    if sum(sd[k].numel() * 4 for k in floats) > max_mb * 2**20:
        sd.update({k: sd[k].to(torch.bfloat16) for k in floats})

    def replace(name, write):
        tmp = d / f".{name}.tmp"
        write(tmp)
        os.chmod(tmp, 0o644)  # package data: readable by everyone
        os.replace(tmp, d / name)

    replace("model.safetensors", lambda p: save_file(sd, str(p), metadata={"format": "pt"}))
    cfg = model.config.to_dict()
    cfg.pop("_name_or_path", None)  # where it was loaded from: machine-specific
    cfg["dtype"] = str(sd[floats[0]].dtype).removeprefix("torch.")
    replace("config.json", lambda p: p.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n"))
    if info is not None:
        replace("training_info.json", lambda p: p.write_text(json.dumps(info, indent=2) + "\n"))
    return d
