"""Llama-family target model (Llama 2/3, SmolLM2, Qwen3) over the paged KV cache.

Matches HF ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` (Qwen3 adds per-head q/k RMSNorm before RoPE).
Parameter names follow HF except the packed ``qkv_proj`` and ``gate_up_proj`` (see
``packed_modules_mapping``).
"""

import torch
from torch import nn

from ..config import layer_rope_parameters
from ..context import get_attn_metadata, paged_attention
from ..kernels.activation import silu_and_mul
from ..kernels.norm import rms_norm
from ..kernels.rope import rope_cos_sin, rope_store_kv
from ..parallel import SINGLE, ColumnLinear, RowLinear, VocabEmbedding, linear


class RMSNorm(nn.Module):
    """Weight-only RMSNorm (HF LlamaRMSNorm; ``fp32_weight`` applies the weight before the cast, as HF
    Gemma4RMSNorm); with ``residual`` it fuses the add and returns (out, residual)."""

    def __init__(self, dim: int, eps: float, fp32_weight: bool = False):
        super().__init__()
        self.eps = eps
        self.fp32_weight = fp32_weight
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, residual=None):
        return rms_norm(x, self.weight, self.eps, residual, self.fp32_weight)


def gemma_rms_norm(dim: int, eps: float) -> RMSNorm:
    """HF ``Gemma4RMSNorm`` (Gemma 4 and its drafter): ``x * rsqrt(mean(x²) + eps) * w`` with the weight
    applied in fp32, then cast (no ``1 + w``)."""
    return RMSNorm(dim, eps, fp32_weight=True)


class Attention(nn.Module):
    """GQA self-attention: fused qkv GEMM, optional q/k norm, RoPE fused with the paged KV store, then
    prefill/verify (extend) or decode attention from the current ``AttnMetadata``."""

    def __init__(self, cfg, tp, gemm):
        super().__init__()
        Hq = cfg.num_attention_heads
        Hkv = cfg.num_key_value_heads
        self.head_dim = d = getattr(cfg, "head_dim", None) or cfg.hidden_size // Hq
        bias = getattr(cfg, "attention_bias", False)
        self.qkv_proj = ColumnLinear(tp, cfg.hidden_size, [(Hq, d), (Hkv, d), (Hkv, d)], bias, gemm)
        self.o_proj = RowLinear(tp, Hq, d, cfg.hidden_size, bias, gemm)
        self.num_heads, self.num_kv_heads = (s // d for s in self.qkv_proj.shard_sizes[:2])  # this rank's
        self.qk_norm = cfg.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        self.k_cache = self.v_cache = None  # bound to pool views after allocation (DESIGN §4 rule 2)
        self.sliding_window = None  # every layer is full attention

    def forward(self, positions, x, cos_sin):
        T = x.shape[0]
        d = self.head_dim
        heads = [self.num_heads, self.num_kv_heads, self.num_kv_heads]
        q, k, v = self.qkv_proj(x).reshape(T, -1, d).split(heads, 1)
        if self.qk_norm:
            q = self.q_norm(q.reshape(-1, d)).view(T, -1, d)
            k = self.k_norm(k.reshape(-1, d)).view(T, -1, d)
        md = get_attn_metadata()
        q = rope_store_kv(q, k, v, positions, cos_sin, self.k_cache, self.v_cache, md.slot_mapping)
        o = paged_attention(q, self.k_cache, self.v_cache, self.scale)
        return self.o_proj(o.reshape(T, -1))


class MLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate | up packed, column- then row-parallel over ``tp`` (one
    all-reduce). ``act_and_mul``: SiLU (Llama, Qwen3) or tanh GELU (Gemma 4 and its drafter, HF
    ``Gemma4TextMLP``)."""

    def __init__(self, hidden: int, intermediate: int, tp, gemm, act_and_mul=silu_and_mul, bias=False):
        super().__init__()
        self.gate_up_proj = ColumnLinear(tp, hidden, [(intermediate, 1), (intermediate, 1)], bias, gemm)
        self.down_proj = RowLinear(tp, intermediate, 1, hidden, bias, gemm)
        self.act_and_mul = act_and_mul

    def forward(self, x):
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, tp, gemm):
        super().__init__()
        self.self_attn = Attention(cfg, tp, gemm)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, tp, gemm, bias=getattr(cfg, "mlp_bias", False))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual, cos_sin):
        x, residual = (
            self.input_layernorm(x, residual) if residual is not None else (self.input_layernorm(x), x)
        )
        x = self.self_attn(positions, x, cos_sin)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """The target model. ``forward(input_ids [T], positions [T]) -> hidden [T, H]`` (post final norm, the
    Frozen-KV MTP seed hidden); ``compute_logits(hidden) -> [T, V]`` fp32. Every layer owns its KV
    (``kv_layer_types`` lists each layer's attention type for the drafter's layer map; ``kv_geometry`` its
    (num_kv_heads, head_dim); ``kv_owner`` is the identity), and the embedding is unscaled
    (``embed_scale`` 1). Built as rank ``tp.rank`` of ``tp.size`` (``parallel.TensorParallel``;
    ``SINGLE``: unsplit), every GEMM through ``gemm``."""

    strip_prefix = ("model.",)  # HF nests everything but lm_head under "model."
    unused_weights = ()
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg, max_position: int, tp=SINGLE, gemm=linear):
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.gemm = gemm  # every GEMM's, the LM head's too (deterministic mode: the batch-invariant one)
        self.embed_tokens = VocabEmbedding(tp, cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp, gemm) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = ColumnLinear(tp, cfg.hidden_size, [(cfg.vocab_size, 1)], gemm=gemm)
        attn = self.layers[0].self_attn
        self.num_kv_heads = attn.num_kv_heads
        self.head_dim = attn.head_dim
        self.kv_layer_types = ["full_attention"] * cfg.num_hidden_layers
        self.kv_geometry = [(self.num_kv_heads, self.head_dim)] * cfg.num_hidden_layers
        self.kv_owner = list(range(cfg.num_hidden_layers))
        self.embed_scale = 1.0
        rope = layer_rope_parameters(cfg, "full_attention")
        self.rope_theta = rope.get("rope_theta", 10000.0)
        self.rope_scaling = rope if rope.get("rope_type", "default") != "default" else None
        self.max_position = max_position
        self.cos_sin = None  # made by init_buffers, once the device is known

    def init_buffers(self, device):
        self.cos_sin = rope_cos_sin(
            self.head_dim, self.max_position, self.rope_theta, self.rope_scaling, device
        )

    def rope_for(self, layer_type: str) -> torch.Tensor:
        """The cos/sin table (one for all layers)."""
        return self.cos_sin

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.tied else self.lm_head.weight

    def bind_kv_cache(self, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Point every layer at its (k_cache, v_cache) pool views ``[blocks, page_size, Hkv, D]``."""
        for layer, (k, v) in zip(self.layers, caches, strict=True):
            layer.self_attn.k_cache = k
            layer.self_attn.v_cache = v

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, self.cos_sin)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.gather(self.gemm(hidden, self.lm_head_weight), -1).float()
