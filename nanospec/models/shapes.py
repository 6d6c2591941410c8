"""Real model shapes for speed runs with random weights (``bench.py --shape``): Qwen3-0.6B, and Gemma 4 E2B /
E4B / 26B-A4B / 31B with their assistants at the sizes of HF's ``convert_gemma4_weights.py``."""

S = "sliding_attention"
F = "full_attention"
QWEN3_0_6B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8)
QWEN3_0_6B.update(head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True)
QWEN3_0_6B.update(rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645, max_position_embeddings=40960)
QWEN3_0_6B.update(rope_parameters={"rope_type": "default", "rope_theta": 1e6})
# Gemma 4 E2B / E4B / 26B-A4B / 31B (the sizes of HF's convert_gemma4_weights.py): these Gemma4TextConfig
# fields, then every how-many-th layer is full attention; their assistants (4 layers S,S,S,F reading the
# target's KV heads, head dims and window): hidden, Q heads, MLP, centroids (0: a dense LM head; top-k 32).
G4_FIELDS = "num_key_value_heads num_global_key_value_heads attention_k_eq_v sliding_window hidden_size "
G4_FIELDS += "num_hidden_layers num_attention_heads intermediate_size use_double_wide_mlp "
G4_FIELDS += "hidden_size_per_layer_input num_kv_shared_layers max_position_embeddings"
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
G4_COMMON = dict(head_dim=256, global_head_dim=512, vocab_size=262144, vocab_size_per_layer_input=262144)


def gemma4_configs(shape, num_layers=None):
    """(Gemma4TextConfig, Gemma4AssistantConfig) of a ``GEMMA4`` shape at its real sizes (the target's first
    ``num_layers`` layers when given, the last one full attention); the assistant has its own tied LM head
    and no final softcap, the target final_logit_softcapping 30."""
    from transformers import Gemma4AssistantConfig, Gemma4TextConfig

    *values, period, hidden, heads, mlp, centroids = GEMMA4[shape]
    t = G4_COMMON | dict(zip(G4_FIELDS.split(), values), final_logit_softcapping=30.0) | G4_MOE.get(shape, {})
    t["num_hidden_layers"] = num_layers or t["num_hidden_layers"]
    n = t["num_hidden_layers"]
    t["layer_types"] = [S if (i + 1) % period and i < n - 1 else F for i in range(n)]
    a = G4_COMMON | dict(zip(G4_FIELDS.split()[:4], values), hidden_size=hidden, num_attention_heads=heads)
    a |= dict(
        intermediate_size=mlp, num_hidden_layers=4, layer_types=[S, S, S, F], vocab_size_per_layer_input=0
    )
    a = Gemma4TextConfig(**a, hidden_size_per_layer_input=0)
    ordered = dict(use_ordered_embeddings=centroids > 0, num_centroids=centroids or 2048, text_config=a)
    return Gemma4TextConfig(**t), Gemma4AssistantConfig(backbone_hidden_size=t["hidden_size"], **ordered)
