"""Gemma 4 target text model over the paged KV cache: HF ``Gemma4ForCausalLM`` (``gemma4_text``), also the
text model of ``Gemma4ForConditionalGeneration`` (``gemma4``, weights under ``model.language_model.``).

What differs from llama.py, each as HF ``modeling_gemma4.py`` computes it:
- ``layer_types``: sliding-window layers (``head_dim``, ``num_key_value_heads``, default RoPE) and full
  layers (HF ``per_layer_config``: ``global_head_dim``, and ``num_global_key_value_heads`` when
  ``attention_k_eq_v``; "proportional" RoPE, whose zero frequencies leave all but dims [0:r/2] and
  [D/2 : D/2 + r/2] unrotated).
- attention scale 1.0 with per-head ``q_norm``/``k_norm`` and the weightless ``v_norm``; ``attention_k_eq_v``
  full layers take V from the k_proj output before ``k_norm``.
- KV sharing: the last ``num_kv_shared_layers`` layers compute no K/V and read the cache of the last earlier
  non-shared layer of their type (``kv_owner``); they own no cache; ``use_double_wide_mlp`` doubles their MLP.
- embeddings scaled by sqrt(hidden) rounded to the weight dtype; GeGLU (tanh GELU); four sandwich norms
  ``x * w`` (weight applied in fp32, no ``1 + w``); ``layer_scalar``; per-layer input embeddings (PLE);
  final logit softcapping.
- ``enable_moe_block`` (26B-A4B): the dense MLP always runs and routed experts are added to it, each with its
  own norms (``Gemma4DecoderLayer.moe``; the kernels in ``kernels/moe.py``).
"""

import torch
from torch import nn

from ..config import layer_rope_parameters
from ..context import get_attn_metadata, paged_attention
from ..kernels.activation import gelu_and_mul
from ..kernels.moe import fused_moe, moe_route
from ..kernels.norm import rms_norm
from ..kernels.rope import apply_rope, rope_cos_sin, rope_store_kv
from ..parallel import SINGLE, ColumnLinear, Experts, Linear, RowLinear, VocabEmbedding, linear
from .llama import MLP, gemma_rms_norm

LAYER_TYPES = ("sliding_attention", "full_attention")
_ROPE_TYPES = ("default", "proportional")


def _in_dtype(x: float, dtype: torch.dtype) -> float:
    """``x`` rounded to ``dtype`` (HF casts Gemma's embedding scales to the weight dtype: √1536 -> 39.25)."""
    return torch.tensor(x, dtype=dtype).item()


def kv_owners(tc) -> list[int]:
    """Per layer, the layer whose KV it reads: itself, or for the last ``num_kv_shared_layers`` layers the
    last earlier non-shared layer of the same type (HF ``kv_sharing_modes`` "reuse" -> "store"). ValueError
    names ``num_kv_shared_layers`` when it is out of [0, num_hidden_layers) or a shared type has no owner."""
    L = tc.num_hidden_layers
    n = tc.num_kv_shared_layers
    types = tc.layer_types
    if not 0 <= n < L:
        raise ValueError(f"gemma4: num_kv_shared_layers must be in [0, num_hidden_layers={L}), got {n}")
    first = L - n
    owners = list(range(first))
    for i in range(first, L):
        earlier = [j for j in range(first) if types[j] == types[i]]
        if not earlier:
            raise ValueError(
                f"gemma4: num_kv_shared_layers = {n} leaves KV-shared layer {i} ({types[i]}) no "
                f"earlier non-shared {types[i]} layer to read"
            )
        owners.append(earlier[-1])
    return owners


def check_config(tc) -> None:
    """Raise ValueError naming the field if nanospec cannot run this ``Gemma4TextConfig`` (call it before any
    weight loads): with ``enable_moe_block``, ``num_experts`` or ``moe_intermediate_size`` < 1 or
    ``top_k_experts`` outside [1, num_experts]; a ``layer_types`` entry other than sliding/full,
    ``sliding_window`` < 1, an activation other than gelu_pytorch_tanh, a RoPE type other than
    default/proportional, bidirectional text attention, or ``num_kv_shared_layers`` out of range."""
    if tc.enable_moe_block:
        for name in ("num_experts", "moe_intermediate_size"):
            v = getattr(tc, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"gemma4: {name} must be an int >= 1 (enable_moe_block), got {v!r}")
        k = tc.top_k_experts
        if not isinstance(k, int) or not 1 <= k <= tc.num_experts:
            raise ValueError(f"gemma4: top_k_experts must be in [1, num_experts={tc.num_experts}], got {k!r}")
    if len(tc.layer_types) != tc.num_hidden_layers:
        raise ValueError(
            f"gemma4: layer_types has {len(tc.layer_types)} entries, num_hidden_layers is "
            f"{tc.num_hidden_layers}"
        )
    for i, lt in enumerate(tc.layer_types):
        if lt not in LAYER_TYPES:
            raise ValueError(
                f"gemma4: layer_types[{i}] = {lt!r} is not supported (allowed: {', '.join(LAYER_TYPES)})"
            )
    sw = tc.sliding_window
    if not isinstance(sw, int) or isinstance(sw, bool) or sw < 1:
        raise ValueError(f"gemma4: sliding_window must be an int >= 1, got {sw!r}")
    if tc.hidden_activation != "gelu_pytorch_tanh":
        raise ValueError(
            f"gemma4: hidden_activation {tc.hidden_activation!r} is not supported "
            "(allowed: gelu_pytorch_tanh)"
        )
    for lt in set(tc.layer_types):
        rt = (tc.rope_parameters.get(lt) or {}).get("rope_type")
        if rt not in _ROPE_TYPES:
            raise ValueError(
                f"gemma4: rope_parameters[{lt!r}].rope_type {rt!r} is not supported "
                f"(allowed: {', '.join(_ROPE_TYPES)})"
            )
    if tc.use_bidirectional_attention == "all":
        raise ValueError("gemma4: use_bidirectional_attention 'all' is not supported (attention is causal)")
    kv_owners(tc)


class Gemma4Attention(nn.Module):
    """HF ``Gemma4TextAttention`` over the paged cache: qkv GEMM (q only on KV-shared layers; q|k with
    ``attention_k_eq_v``), q_norm / k_norm / weightless v_norm per head, RoPE fused with the KV store (owning
    layers only), then extend or decode attention, scale 1.0, ``sliding_window`` (None on full layers)."""

    def __init__(self, tc, layer_idx: int, owner: int, tp, gemm):
        super().__init__()
        lc = tc.per_layer_config[layer_idx]
        self.layer_type = tc.layer_types[layer_idx]
        self.sliding_window = tc.sliding_window if self.layer_type == "sliding_attention" else None
        self.head_dim = d = lc.head_dim
        self.is_kv_shared = owner != layer_idx
        self.eps = tc.rms_norm_eps
        q = (tc.num_attention_heads, d)
        kv = (lc.num_key_value_heads, d)
        k_eq_v = tc.attention_k_eq_v and self.layer_type == "full_attention"
        parts = [q] if self.is_kv_shared else [q, kv] if k_eq_v else [q, kv, kv]
        self.qkv_proj = ColumnLinear(tp, tc.hidden_size, parts, tc.attention_bias, gemm)
        # (num_kv_heads on this rank, head_dim) of the KV it stores; None on KV-shared layers
        self.kv_geometry = None if self.is_kv_shared else (tp.span(lc.num_key_value_heads)[1], d)
        self.q_norm = gemma_rms_norm(self.head_dim, self.eps)
        if not self.is_kv_shared:
            self.k_norm = gemma_rms_norm(self.head_dim, self.eps)
        self.o_proj = RowLinear(tp, *q, tc.hidden_size, tc.attention_bias, gemm)
        self.k_cache = self.v_cache = None  # pool views (the owner's on KV-shared layers): bind_kv_cache

    def forward(self, positions, x, cos_sin):
        T = x.shape[0]
        d = self.head_dim
        qkv = self.qkv_proj(x).split(self.qkv_proj.shard_sizes, -1)
        q = self.q_norm(qkv[0].reshape(T, -1, d))
        md = get_attn_metadata()
        if self.is_kv_shared:
            q = apply_rope(q, None, positions, cos_sin)[0]
        else:
            k = qkv[1].reshape(T, -1, d)
            v = rms_norm(qkv[-1].reshape(T, -1, d), None, self.eps, fp32_weight=True)  # k_eq_v: qkv[-1] is k
            q = rope_store_kv(
                q, self.k_norm(k), v, positions, cos_sin, self.k_cache, self.v_cache, md.slot_mapping
            )
        o = paged_attention(q, self.k_cache, self.v_cache, 1.0, self.sliding_window)
        return self.o_proj(o.reshape(T, -1))


class Gemma4Router(nn.Module):
    """HF ``Gemma4TextRouter``, replicated on every rank: ``x`` (the residual stream) RMS-normed without a
    weight, ``* scale * hidden**-0.5``, projected to E expert scores, then ``moe_route`` (fp32 softmax, top-k,
    renormalised, ``* per_expert_scale``). Returns (weights [T, k] fp32, expert ids [T, k] int32)."""

    def __init__(self, tc, gemm):
        super().__init__()
        self.eps = tc.rms_norm_eps
        self.top_k = tc.top_k_experts
        self.proj = Linear(tc.hidden_size, tc.num_experts, False, gemm=gemm)
        self.scale = nn.Parameter(torch.ones(tc.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(tc.num_experts))

    def forward(self, x):
        h = rms_norm(x, None, self.eps, fp32_weight=True) * self.scale * x.shape[-1] ** -0.5
        return moe_route(self.proj(h), self.per_expert_scale, self.top_k)


class Gemma4DecoderLayer(nn.Module):
    """HF ``Gemma4TextDecoderLayer``: sandwich-normed attention and MLP residuals (with ``enable_moe_block``
    routed experts beside the MLP: :meth:`moe`), the PLE residual, then the whole stream times
    ``layer_scalar``."""

    def __init__(self, tc, layer_idx: int, owner: int, tp, gemm):
        super().__init__()
        H = tc.hidden_size
        eps = tc.rms_norm_eps
        self.self_attn = Gemma4Attention(tc, layer_idx, owner, tp, gemm)
        wide = tc.use_double_wide_mlp and owner != layer_idx
        self.mlp = MLP(H, tc.intermediate_size * (2 if wide else 1), tp, gemm, gelu_and_mul)
        self.input_layernorm = gemma_rms_norm(H, eps)
        self.post_attention_layernorm = gemma_rms_norm(H, eps)
        self.pre_feedforward_layernorm = gemma_rms_norm(H, eps)
        self.post_feedforward_layernorm = gemma_rms_norm(H, eps)
        # A buffer in HF; a frozen parameter here so that loading checks it like every other tensor.
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        self.ple_dim = tc.hidden_size_per_layer_input
        if self.ple_dim:
            self.per_layer_input_gate = Linear(H, self.ple_dim, False, gemm=gemm)
            self.per_layer_projection = Linear(self.ple_dim, H, False, gemm=gemm)
            self.post_per_layer_input_norm = gemma_rms_norm(H, eps)
        self.enable_moe = tc.enable_moe_block
        if self.enable_moe:
            self.router = Gemma4Router(tc, gemm)
            self.experts = Experts(tp, tc.num_experts, H, tc.moe_intermediate_size)
            self.pre_feedforward_layernorm_2 = gemma_rms_norm(H, eps)
            self.post_feedforward_layernorm_1 = gemma_rms_norm(H, eps)
            self.post_feedforward_layernorm_2 = gemma_rms_norm(H, eps)

    def moe(self, h, residual):
        """The MoE layer's feed-forward before ``post_feedforward_layernorm``, as HF: ``post_feedforward_
        layernorm_1(mlp(h)) + post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(residual)))``,
        the experts chosen by the router from ``residual`` (the stream before the MLP). Under tensor
        parallelism the two partial sums share one all-reduce."""
        dense = self.mlp.down_proj.gemm(gelu_and_mul(self.mlp.gate_up_proj(h)), self.mlp.down_proj.weight)
        weights, ids = self.router(residual)
        x2 = self.pre_feedforward_layernorm_2(residual)
        routed = fused_moe(x2, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        both = self.experts.tp.all_reduce(torch.stack([dense, routed]))
        return self.post_feedforward_layernorm_1(both[0]) + self.post_feedforward_layernorm_2(both[1])

    def forward(self, positions, x, cos_sin, per_layer_input=None):
        h = self.self_attn(positions, self.input_layernorm(x), cos_sin)
        h, x = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), x)  # residual add fused
        x = x + self.post_feedforward_layernorm(self.moe(h, x) if self.enable_moe else self.mlp(h))
        if self.ple_dim:
            g = gelu_and_mul(torch.cat([self.per_layer_input_gate(x), per_layer_input], -1))
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return x * self.layer_scalar


class Gemma4ForCausalLM(nn.Module):
    """The Gemma 4 target. ``forward(input_ids [T] int64, positions [T] int64) -> hidden [T, H]`` (post final
    norm, the Frozen-KV MTP seed hidden) under the current ``AttnMetadata`` (prefill / decode / verify);
    ``compute_logits(hidden) -> [T, V]`` fp32, softcapped by ``final_logit_softcapping``.

    KV interface for the engine: ``kv_layer_types`` (type per layer), ``kv_geometry`` ((num_kv_heads,
    head_dim) per layer, None for KV-shared layers), ``kv_owner`` (the layer whose KV each layer reads) and
    ``bind_kv_cache``. ``embed`` returns the scaled input embedding (``embed_scale`` = sqrt(hidden));
    ``rope_for(type)`` the cos/sin table of a layer type. Built as rank ``tp.rank`` of ``tp.size``
    (``parallel.TensorParallel``; ``SINGLE``: unsplit), every GEMM through ``gemm``. Raises ValueError
    (:func:`check_config`) for unsupported configs.
    """

    strip_prefix = ("model.language_model.", "model.")  # Gemma4ForConditionalGeneration, Gemma4ForCausalLM
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg, max_position: int, tp=SINGLE, gemm=linear):
        super().__init__()
        check_config(cfg)
        self.config = cfg
        self.tp = tp
        self.gemm = gemm  # every GEMM's, the LM head's too (deterministic mode: the batch-invariant one)
        self.max_position = max_position
        L = cfg.num_hidden_layers
        H = cfg.hidden_size
        V = cfg.vocab_size
        self.kv_owner = kv_owners(cfg)
        self.embed_tokens = VocabEmbedding(tp, V, H)
        self.embed_scale = H**0.5
        self.ple_dim = cfg.hidden_size_per_layer_input
        if self.ple_dim:
            self.embed_tokens_per_layer = VocabEmbedding(tp, cfg.vocab_size_per_layer_input, L * self.ple_dim)
            self.per_layer_model_projection = Linear(H, L * self.ple_dim, False, gemm=gemm)
            self.per_layer_projection_norm = gemma_rms_norm(self.ple_dim, cfg.rms_norm_eps)
        layers = [Gemma4DecoderLayer(cfg, i, o, tp, gemm) for i, o in enumerate(self.kv_owner)]
        self.layers = nn.ModuleList(layers)
        self.norm = gemma_rms_norm(H, cfg.rms_norm_eps)
        self.tied = bool(cfg.tie_word_embeddings)
        if not self.tied:
            self.lm_head = ColumnLinear(tp, H, [(V, 1)], gemm=gemm)
        self.kv_layer_types = list(cfg.layer_types)
        self.kv_geometry = [layer.self_attn.kv_geometry for layer in self.layers]
        # checkpoint tensors HF also ignores: the multimodal towers and the K/V weights of KV-shared layers
        self.unused_weights = ("vision_tower.", "embed_vision.", "audio_tower.", "embed_audio.") + tuple(
            f"layers.{i}.self_attn.{n}."
            for i, g in enumerate(self.kv_geometry)
            if g is None
            for n in ("k_proj", "v_proj", "k_norm", "v_norm")
        )
        self.rope_tables: dict[str, torch.Tensor] = {}  # made by init_buffers, once the device is known

    def init_buffers(self, device) -> None:
        """Build the fp32 cos/sin table ``[max_position, head_dim]`` of each layer type on ``device``."""
        for lt in sorted(set(self.kv_layer_types)):
            params = layer_rope_parameters(self.config, lt)
            D = self.config.per_layer_config[lt].head_dim
            self.rope_tables[lt] = rope_cos_sin(D, self.max_position, params["rope_theta"], params, device)

    def rope_for(self, layer_type: str) -> torch.Tensor:
        """The cos/sin table ``[max_position, head_dim]`` fp32 that layers of ``layer_type`` use."""
        return self.rope_tables[layer_type]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.tied else self.lm_head.weight

    def bind_kv_cache(self, caches) -> None:
        """Bind per-layer pool views: ``caches[i]`` is (k_cache, v_cache) ``[num_blocks, page_size, Hkv_i,
        D_i]`` for owning layers (shaped by ``kv_geometry``, which the caller builds them from), None for
        KV-shared ones, which then point at their owner's views. ValueError on a missing or unexpected
        entry."""
        if len(caches) != len(self.layers):
            raise ValueError(f"bind_kv_cache: got {len(caches)} entries for {len(self.layers)} layers")
        for i, geo in enumerate(self.kv_geometry):
            if (caches[i] is None) != (geo is None):
                raise ValueError(
                    f"bind_kv_cache: layer {i} needs {'no cache' if geo is None else 'a cache'} (kv_geometry)"
                )
        for layer, owner in zip(self.layers, self.kv_owner):
            k, v = caches[owner]
            layer.self_attn.k_cache = k
            layer.self_attn.v_cache = v

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Scaled input embedding ``[T, H]``: ``embed_tokens(ids) * sqrt(H)``, the scale in the weight
        dtype (HF ``Gemma4TextScaledWordEmbedding``)."""
        e = self.embed_tokens(input_ids)
        return e * _in_dtype(self.embed_scale, e.dtype)

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """PLE inputs ``[T, L, P]``: ``(norm(proj(embeds) / sqrt(H)) + table(ids) * sqrt(P)) / sqrt(2)``
        (HF ``get_per_layer_inputs`` + ``project_per_layer_inputs``)."""
        T = input_ids.shape[0]
        P = self.ple_dim
        tok = self.embed_tokens_per_layer(input_ids)
        tok = (tok * _in_dtype(P**0.5, tok.dtype)).view(T, -1, P)
        proj = self.per_layer_model_projection(embeds) * self.config.hidden_size**-0.5
        return (self.per_layer_projection_norm(proj.view(T, -1, P)) + tok) * 2.0**-0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        ple = self.per_layer_inputs(input_ids, x) if self.ple_dim else None
        for i, layer in enumerate(self.layers):
            pli = None if ple is None else ple[:, i]
            x = layer(positions, x, self.rope_tables[self.kv_layer_types[i]], pli)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[T, V]``; ``tanh(z / c) * c`` with c = ``final_logit_softcapping`` when set (HF
        ``Gemma4ForCausalLM.forward``)."""
        logits = self.tp.gather(self.gemm(hidden, self.lm_head_weight), -1).float()
        c = self.config.final_logit_softcapping
        return logits if c is None else torch.tanh(logits / c) * c
