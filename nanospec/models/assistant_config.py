"""The drafter's HF config (``Gemma4AssistantConfig``) checked alone and against a target's, before any
weights load (DESIGN §4 rule 2): what ``LLM`` runs first, what ``Gemma4Assistant`` checks when built, and the
map from each assistant layer to the target layer whose KV it reads.
"""

import torch

from ..config import layer_geometry, layer_rope_parameters
from ..kernels.activation import gelu_and_mul, silu_and_mul
from ..kernels.rope import rope_cos_sin

# The MLP activations the drafter supports (HF ``hidden_activation``) and the kernel each one runs.
ACTIVATIONS = {"gelu_pytorch_tanh": gelu_and_mul, "silu": silu_and_mul}


def bad(field: str, msg: str):
    """Raise ValueError("assistant: {field} {msg}")."""
    raise ValueError(f"assistant: {field} {msg}")


def check_assistant_alone(config) -> None:
    """Checks of an HF ``Gemma4AssistantConfig`` alone, no target needed (``check_assistant_config`` adds
    the target's): every layer a plain KV-shared layer (no per-layer input, MoE or double-wide MLP), no
    attention logit softcap, a supported activation, ``use_target_lm_head`` only with hidden_size ==
    backbone_hidden_size, a centroid head's count dividing the vocabulary and top-k in [1, num_centroids].
    Returns None; raises ValueError naming the field."""
    tc = config.get_text_config()
    for field, ok in (
        ("hidden_size_per_layer_input", not tc.hidden_size_per_layer_input),
        ("enable_moe_block", not tc.enable_moe_block),
        ("use_double_wide_mlp", not tc.use_double_wide_mlp),
        ("num_kv_shared_layers", tc.num_kv_shared_layers == tc.num_hidden_layers),
    ):
        if not ok:
            bad(field, f"= {getattr(tc, field)!r} is not supported (every layer must be plain KV-shared)")
    if getattr(tc, "attn_logit_softcapping", None):
        bad("attn_logit_softcapping", "is set; attention logit softcapping is not supported")
    if tc.hidden_activation not in ACTIVATIONS:
        bad("hidden_activation", f"{tc.hidden_activation!r} is not one of {sorted(ACTIVATIONS)}")
    if getattr(config, "use_target_lm_head", False) and tc.hidden_size != config.backbone_hidden_size:
        bad(
            "use_target_lm_head",
            f"needs hidden_size == backbone_hidden_size (the target LM head is "
            f"[V, {config.backbone_hidden_size}]), got hidden_size {tc.hidden_size}",
        )
    if getattr(config, "use_ordered_embeddings", False):
        C = config.num_centroids
        K = config.centroid_intermediate_top_k
        if not (isinstance(C, int) and C >= 1 and tc.vocab_size % C == 0):
            bad("num_centroids", f"= {C!r} must be a positive divisor of vocab_size {tc.vocab_size}")
        if not (isinstance(K, int) and 1 <= K <= C):
            bad("centroid_intermediate_top_k", f"= {K!r} must be in [1, num_centroids = {C}]")


def target_layers(layer_types, target_kv_types) -> list[int]:
    """Per assistant layer type, the last target KV-owning layer of that type; ValueError if there is none."""
    for i, lt in enumerate(layer_types):
        if lt not in target_kv_types:
            bad(
                f"layer_types[{i}]",
                f"= {lt!r} has no KV-owning target layer of that type (target KV layer "
                f"types: {sorted(set(target_kv_types))})",
            )
    return [len(target_kv_types) - 1 - list(target_kv_types)[::-1].index(lt) for lt in layer_types]


def check_assistant_config(assistant_config, target_text_config) -> list[int]:
    """Check that an assistant fits a target from their HF configs alone (run it before any weights load).

    ``target_text_config``: a Llama/Qwen3 config (every layer full attention and KV-owning) or a Gemma 4 text
    config (``layer_types``, ``sliding_window``, ``per_layer_config`` head_dim / num_key_value_heads,
    ``num_kv_shared_layers``, ``rope_parameters`` per layer type); a multimodal config is reduced to its text
    config. Each assistant layer reads the last KV-owning target layer of its type (Gemma 4 with KV sharing:
    the last non-shared one, as HF ``kv_sharing_modes`` "store"). Checked: vocab_size, backbone_hidden_size,
    the layer map, that layer's head_dim (global_head_dim for full layers) and KV heads, query heads divisible
    by them, RoPE per layer type equal to the target's, the sliding window, the centroid head and the
    activation.

    Returns the layer map (target layer index per assistant layer). Raises ValueError naming the field.
    """
    check_assistant_alone(assistant_config)
    ac = assistant_config.get_text_config()
    t = target_text_config.get_text_config()
    if ac.vocab_size != t.vocab_size:
        bad("vocab_size", f"{ac.vocab_size} != target vocab_size {t.vocab_size}")
    Hb = assistant_config.backbone_hidden_size
    if Hb != t.hidden_size:
        bad("backbone_hidden_size", f"{Hb} != target hidden_size {t.hidden_size}")
    types = list(getattr(t, "layer_types", None) or ["full_attention"] * t.num_hidden_layers)
    kv_types = types[: len(types) - (getattr(t, "num_kv_shared_layers", 0) or 0)]
    layer_map = target_layers(ac.layer_types, kv_types)
    for i, (lt, j) in enumerate(zip(ac.layer_types, layer_map)):
        hd, kv = layer_geometry(ac, i)
        t_hd, t_kv = layer_geometry(t, j)
        full = lt == "full_attention"
        if hd != t_hd:
            bad(
                "global_head_dim" if full else "head_dim",
                f"{hd} of layer {i} != head_dim {t_hd} of target layer {j}",
            )
        if kv != t_kv:
            bad(
                "num_global_key_value_heads" if full and ac.attention_k_eq_v else "num_key_value_heads",
                f"{kv} of layer {i} != {t_kv} KV heads of target layer {j}",
            )
        if ac.num_attention_heads % t_kv:
            bad(
                "num_attention_heads",
                f"{ac.num_attention_heads} is not a multiple of the {t_kv} KV heads of target layer {j}",
            )
        mine = layer_rope_parameters(ac, lt)
        theirs = layer_rope_parameters(t, lt)
        if mine.get("rope_theta") != theirs.get("rope_theta"):
            bad(
                f"rope_parameters[{lt!r}].rope_theta",
                f"{mine.get('rope_theta')} != target rope_theta {theirs.get('rope_theta')}",
            )
        try:  # one position past 0 compares every frequency (cos/sin of f)
            ours = rope_cos_sin(hd, 2, mine["rope_theta"], mine)
            target_rope = rope_cos_sin(hd, 2, theirs["rope_theta"], theirs)
        except (ValueError, KeyError) as e:
            bad(f"rope_parameters[{lt!r}]", f"unsupported: {e}")
        if not torch.allclose(ours, target_rope, rtol=1e-5, atol=1e-12):  # rtol only: f may be tiny
            bad(f"rope_parameters[{lt!r}]", f"{mine} do not match the target's RoPE {theirs}")
        if lt == "sliding_attention" and ac.sliding_window != t.sliding_window:
            bad("sliding_window", f"{ac.sliding_window} != target sliding_window {t.sliding_window}")
    return layer_map
