"""The Frozen-KV MTP drafter: HF ``Gemma4AssistantForCausalLM`` (a Gemma4 text stack whose every layer is KV-shared).

It owns no KV cache. Per query row (one per request, or B·k rows for a top-k tree):

    x  = pre_projection(cat(target.embed(tok) * target.embed_scale, h_prev))          # 2·Hb -> H
    per layer:  x = x + post_attn_norm(o_proj(Attn(rope(q_norm(q_proj(input_norm(x)))))))
                x = (x + post_ff_norm(down(act(gate(h)) * up(h)))) * layer_scalar,  h = pre_ff_norm(x)
    hn = norm(x);  logits = lm_head(hn) (fp32);  h_next = post_projection(hn)          # H -> Hb

``Attn`` is Q-only attention with scale 1.0 (HF ``Gemma4TextAttention.scaling``) over the stored, already normed
and roped K/V of the mapped target layer (the last target layer of the same layer type); nothing is written.
HF semantics worth knowing: the text model does not rescale ``inputs_embeds``; every norm is ``x * w`` with the
weight applied in fp32 (no ``1 + w``); full-attention layers use ``global_head_dim`` (HF ``per_layer_config``),
and their RoPE may be "proportional" (partial rotary with zero frequencies), which must match the target's RoPE;
HF's assistant forward applies no ``final_logit_softcapping`` and Gemma4 attention has no logit softcap.
"""
import json
import os
import pathlib

import torch
import torch.nn.functional as F
from torch import nn

from ..context import get_attn_metadata
from ..kernels.activation import gelu_and_mul, silu_and_mul
from ..kernels.attention import draft_attention
from ..kernels.rope import apply_rope, rope_cos_sin
from .llama import RMSNorm

_ACTS = {"gelu_pytorch_tanh": gelu_and_mul, "silu": silu_and_mul}
# Checkpoint tensors HF itself ignores for KV-shared layers (K/V come from the target).
_IGNORED = ("self_attn.k_proj.", "self_attn.v_proj.", "self_attn.k_norm.", "self_attn.v_norm.", "rotary_emb.")


def Gemma4RMSNorm(dim: int, eps: float) -> RMSNorm:
    """HF ``Gemma4RMSNorm``: weight-only, weight applied in fp32 before the cast."""
    return RMSNorm(dim, eps, fp32_weight=True)


class QOnlyAttention(nn.Module):
    """q_proj -> per-head q_norm -> RoPE on q -> attention over the target's K/V (via ``attn``) -> o_proj."""

    def __init__(self, tc, layer_idx: int):
        super().__init__()
        self.num_heads, self.head_dim = tc.num_attention_heads, tc.per_layer_config[layer_idx].head_dim
        self.layer_type = tc.layer_types[layer_idx]
        bias = bool(getattr(tc, "attention_bias", False))
        self.q_proj = nn.Linear(tc.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.q_norm = Gemma4RMSNorm(self.head_dim, tc.rms_norm_eps)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, tc.hidden_size, bias=bias)

    def forward(self, x, positions, cos_sin, attn):
        R = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(R, self.num_heads, self.head_dim))
        q, _ = apply_rope(q, None, positions, cos_sin)
        return self.o_proj(attn(q).reshape(R, -1))


class MLP(nn.Module):
    def __init__(self, tc):
        super().__init__()
        i = tc.intermediate_size
        self.gate_up_proj = nn.Linear(tc.hidden_size, 2 * i, bias=False)  # packed gate_proj | up_proj
        self.gate_up_proj.shard_sizes = [i, i]
        self.down_proj = nn.Linear(i, tc.hidden_size, bias=False)
        self.act_and_mul = _ACTS[tc.hidden_activation]

    def forward(self, x):
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, tc, layer_idx: int):
        super().__init__()
        H, eps = tc.hidden_size, tc.rms_norm_eps
        self.self_attn = QOnlyAttention(tc, layer_idx)
        self.mlp = MLP(tc)
        self.input_layernorm = Gemma4RMSNorm(H, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(H, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(H, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(H, eps)
        # A buffer in HF; a frozen parameter here so that loading checks it like every other tensor.
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, x, positions, cos_sin, attn):
        h = self.self_attn(self.input_layernorm(x), positions, cos_sin, attn)
        # pre_ff_norm(x + post_attn_norm(h)), with the residual add fused into the norm
        h, x = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), x)
        x = x + self.post_feedforward_layernorm(self.mlp(h))
        return x * self.layer_scalar


class Gemma4Model(nn.Module):
    """Holds ``layers`` and ``norm`` under the HF prefix ``model.`` (no embedding: the target's is used)."""

    def __init__(self, tc):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(tc, i) for i in range(tc.num_hidden_layers))
        self.norm = Gemma4RMSNorm(tc.hidden_size, tc.rms_norm_eps)


def _rope_table(params: dict, head_dim: int, positions: int) -> torch.Tensor:
    """cos/sin table ``[positions, head_dim]`` of the assistant's RoPE for one layer type, as HF computes it."""
    if params.get("rope_type", "default") != "proportional":
        return rope_cos_sin(head_dim, positions, params["rope_theta"], params)
    n_rot = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
    inv = params["rope_theta"] ** -(torch.arange(0, 2 * n_rot, 2).float() / head_dim)
    inv = torch.cat([inv, torch.zeros(head_dim // 2 - n_rot)]) / params.get("factor", 1.0)
    f = torch.arange(positions, dtype=torch.float32)[:, None] * inv[None]
    return torch.cat([f.cos(), f.sin()], -1)


class Gemma4Assistant(nn.Module):
    """The drafter. Lifecycle (DESIGN §4 rule 2): construct (``from_pretrained``) -> ``check_target`` (no pool
    needed) -> the engine allocates the target pool -> ``bind_target`` -> ``forward`` per draft step."""

    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config):
        super().__init__()
        tc = config.get_text_config()
        self.config, self.text_config = config, tc
        self.vocab_size, self.hidden_size = tc.vocab_size, tc.hidden_size
        self.backbone_hidden_size = config.backbone_hidden_size
        self.use_target_lm_head = bool(getattr(config, "use_target_lm_head", False))
        self._validate_config(config, tc)
        self.pre_projection = nn.Linear(2 * self.backbone_hidden_size, self.hidden_size, bias=False)
        self.post_projection = nn.Linear(self.hidden_size, self.backbone_hidden_size, bias=False)
        self.model = Gemma4Model(tc)
        self.lm_head = None if self.use_target_lm_head else nn.Linear(self.hidden_size, self.vocab_size, bias=False)
        # Set by bind_target (plain attributes, not submodules/buffers: they belong to the target).
        self._embed = self._cos_sin = self._target_lm_head = None
        self._embed_scale = 1.0
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def _validate_config(self, config, tc):
        def bad(field, msg):
            raise ValueError(f"assistant: {field} {msg}")
        if getattr(config, "use_ordered_embeddings", False):
            bad("use_ordered_embeddings", "is true: the centroid (ordered-embedding) LM head of E2B/E4B "
                "assistants is not supported by nanospec; use a dense-head assistant")
        for field, ok in (("hidden_size_per_layer_input", not tc.hidden_size_per_layer_input),
                          ("enable_moe_block", not tc.enable_moe_block),
                          ("use_double_wide_mlp", not tc.use_double_wide_mlp),
                          ("num_kv_shared_layers", tc.num_kv_shared_layers == tc.num_hidden_layers)):
            if not ok:
                bad(field, f"= {getattr(tc, field)!r} is not supported (every layer must be a plain KV-shared layer)")
        if getattr(tc, "attn_logit_softcapping", None):
            bad("attn_logit_softcapping", "is set; attention logit softcapping is not supported")
        if tc.hidden_activation not in _ACTS:
            bad("hidden_activation", f"{tc.hidden_activation!r} is not one of {sorted(_ACTS)}")
        if self.use_target_lm_head and self.hidden_size != self.backbone_hidden_size:
            bad("use_target_lm_head", f"needs hidden_size == backbone_hidden_size (the target LM head is "
                f"[V, {self.backbone_hidden_size}]), got hidden_size {self.hidden_size}")

    # ---- construction / loading ----------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path, device="cpu", dtype=torch.float32) -> "Gemma4Assistant":
        """Load an HF ``gemma4_assistant`` dir (config.json + *.safetensors). Raises ValueError naming the
        problem (not a dir, wrong model_type, missing / mis-shaped / unexpected tensor, unsupported config)."""
        from transformers import AutoConfig

        from ..loader import iter_safetensors
        d = pathlib.Path(path).expanduser()
        if not (d / "config.json").is_file():
            raise ValueError(f"assistant: {str(path)!r} is not a directory with a config.json")
        model_type = json.loads((d / "config.json").read_text()).get("model_type")
        if model_type != "gemma4_assistant":
            raise ValueError(f"assistant: {str(path)!r} has model_type {model_type!r}, expected 'gemma4_assistant'")
        if not any(d.glob("*.safetensors")):
            raise ValueError(f"assistant: {str(path)!r} has no *.safetensors weights")
        config = AutoConfig.from_pretrained(str(d))
        with torch.device("meta"):
            model = cls(config)
        model.to_empty(device=device)
        model.load_checkpoint(iter_safetensors(d))
        return model.to(dtype).eval()

    def hf_tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter as views under HF ``Gemma4AssistantForCausalLM`` names (the packed gate_up_proj split
        back into gate_proj / up_proj): what a checkpoint holds, for loading into and for saving."""
        slots = {}
        for name, p in self.named_parameters():
            if name.endswith("gate_up_proj.weight"):
                i = p.shape[0] // 2
                slots[name.replace("gate_up_proj", "gate_proj")] = p.data[:i]
                slots[name.replace("gate_up_proj", "up_proj")] = p.data[i:]
            else:
                slots[name] = p.data
        return slots

    def save_pretrained(self, out_dir, info: dict | None = None, max_mb: float = 16.0) -> pathlib.Path:
        """Write config.json + model.safetensors (HF names, ``hf_tensors``) + training_info.json (``info``) into
        ``out_dir``, each file replaced atomically (a kill between two files can pair new weights with the old
        config; the trainer keeps one architecture per dir). fp32 if the weights fit ``max_mb`` MiB, else bf16.
        Returns the dir."""
        from safetensors.torch import save_file

        d = pathlib.Path(out_dir)
        d.mkdir(parents=True, exist_ok=True)
        sd = {k: v.detach().cpu().contiguous().clone() for k, v in self.hf_tensors().items()}
        if sum(t.numel() * 4 for t in sd.values()) > max_mb * 2**20:
            sd = {k: v.to(torch.bfloat16) for k, v in sd.items()}

        def replace(name, write):
            tmp = d / f".{name}.tmp"
            write(tmp)
            os.chmod(tmp, 0o644)  # package data: readable by everyone
            os.replace(tmp, d / name)
        replace("model.safetensors", lambda p: save_file(sd, str(p), metadata={"format": "pt"}))
        cfg = self.config.to_dict()
        cfg.pop("_name_or_path", None)  # where it was loaded from: machine-specific
        cfg["dtype"] = str(next(iter(sd.values())).dtype).removeprefix("torch.")
        replace("config.json", lambda p: p.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n"))
        if info is not None:
            replace("training_info.json", lambda p: p.write_text(json.dumps(info, indent=2) + "\n"))
        return d

    def load_checkpoint(self, tensors) -> None:
        """Strict load of HF-named tensors: packs gate/up, takes ``lm_head`` from ``lm_head.weight`` or (tied)
        ``model.embed_tokens.weight``; every parameter must get exactly its tensor with the right shape."""
        slots = self.hf_tensors()  # checkpoint name -> destination view
        tied = bool(getattr(self.config, "tie_word_embeddings", True))
        got, embed = set(), None
        for name, t in tensors:
            if any(s in name for s in _IGNORED) or name.startswith("masked_embedding."):
                continue
            if name in ("lm_head.weight", "model.embed_tokens.weight") and self.lm_head is None:
                continue  # use_target_lm_head: the assistant's own table is unused
            if name == "model.embed_tokens.weight":
                embed = t  # only the LM head's (tied) source; HF never embeds with it here
                continue
            if name not in slots:
                raise ValueError(f"assistant: checkpoint tensor {name!r} matches no parameter")
            self._copy(name, slots[name], t)
            got.add(name)
        if self.lm_head is not None and "lm_head.weight" not in got and tied and embed is not None:
            self._copy("model.embed_tokens.weight", slots["lm_head.weight"], embed)
            got.add("lm_head.weight")
        missing = [n for n in slots if n not in got]
        if missing:
            hint = (" (a checkpoint without an LM head must set \"use_target_lm_head\": true in config.json)"
                    if "lm_head.weight" in missing else "")
            raise ValueError(f"assistant: checkpoint is missing tensor {missing[0]!r}{hint}"
                             + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))

    @staticmethod
    def _copy(name, dst, t):
        if tuple(dst.shape) != tuple(t.shape):
            raise ValueError(f"assistant: checkpoint tensor {name!r} has shape {tuple(t.shape)}, "
                             f"expected {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(t)

    # ---- target compatibility ------------------------------------------------------------------------
    def layer_map(self, target_kv_layer_types) -> list[int]:
        """Target layer read by each assistant layer: the last target layer of the same layer type."""
        types = list(target_kv_layer_types)
        out = []
        for i, lt in enumerate(self.text_config.layer_types):
            if lt not in types:
                raise ValueError(f"assistant: layer_types[{i}] = {lt!r} has no KV-owning target layer of that type "
                                 f"(target layer types: {sorted(set(types))})")
            out.append(len(types) - 1 - types[::-1].index(lt))
        return out

    def check_target(self, target_config, target_kv_layer_types, num_kv_heads, head_dim, rope_theta,
                     rope_scaling=None) -> None:
        """Check the assistant fits a target (before any KV pool exists). ValueError names the field."""
        if self.vocab_size != target_config.vocab_size:
            raise ValueError(f"assistant: vocab_size {self.vocab_size} != target vocab_size "
                             f"{target_config.vocab_size}")
        if self.backbone_hidden_size != target_config.hidden_size:
            raise ValueError(f"assistant: backbone_hidden_size {self.backbone_hidden_size} != target hidden_size "
                             f"{target_config.hidden_size}")
        self.layer_map(target_kv_layer_types)
        target_rope = rope_cos_sin(head_dim, 2, rope_theta, rope_scaling)
        for i, layer in enumerate(self.model.layers):
            a, lt = layer.self_attn, layer.self_attn.layer_type
            if lt == "sliding_attention":
                raise ValueError(f"assistant: layer_types[{i}] = 'sliding_attention' is not supported (the draft "
                                 "attention has no sliding window)")
            if a.head_dim != head_dim:
                raise ValueError(f"assistant: layer {i} head_dim {a.head_dim} != target head_dim {head_dim}")
            if a.num_heads % num_kv_heads:
                raise ValueError(f"assistant: num_attention_heads {a.num_heads} is not a multiple of the target's "
                                 f"num_key_value_heads {num_kv_heads}")
            params = dict((self.text_config.rope_parameters or {}).get(lt) or {})
            if params.get("rope_theta") != rope_theta:
                raise ValueError(f"assistant: rope_parameters[{lt!r}].rope_theta {params.get('rope_theta')} != "
                                 f"target rope_theta {rope_theta}")
            try:
                same = torch.allclose(_rope_table(params, head_dim, 2), target_rope, rtol=1e-5, atol=1e-6)
            except (ValueError, KeyError) as e:
                raise ValueError(f"assistant: rope_parameters[{lt!r}] unsupported: {e}") from None
            if not same:
                raise ValueError(f"assistant: rope_parameters[{lt!r}] (rope_type {params.get('rope_type')!r}, "
                                 f"partial_rotary_factor {params.get('partial_rotary_factor')}) do not match the "
                                 f"target's RoPE (rope_scaling {rope_scaling})")

    def bind_target(self, target, kv: bool = True) -> None:
        """Attach the target's embedding, RoPE table and (if configured) LM head; with ``kv`` also its pool views.

        Call with ``kv=True`` only after the target pool is allocated and bound (DESIGN §4 rule 2); raises
        RuntimeError otherwise. ``kv=False`` serves the trainer, which passes its own ``attn_fn``.
        """
        self.check_target(target.config, target.kv_layer_types, target.num_kv_heads, target.head_dim,
                          target.rope_theta, target.rope_scaling)
        if target.cos_sin is None:
            raise RuntimeError("assistant: the target's RoPE table is not initialised (call init_buffers first)")
        self._embed, self._embed_scale = target.embed, float(getattr(target, "embed_scale", 1.0))
        self._cos_sin = target.cos_sin
        # detached: a Parameter assigned here would register as the assistant's own (trained, saved) weight
        self._target_lm_head = target.lm_head_weight.detach() if self.lm_head is None else None
        if not kv:
            return
        kvs = []
        for i in self.layer_map(target.kv_layer_types):
            attn = target.layers[i].self_attn
            if attn.k_cache is None or attn.v_cache is None:
                raise RuntimeError(f"assistant: target layer {i} has no KV cache bound yet: allocate the pool "
                                   "before bind_target (construct -> allocate -> bind)")
            kvs.append((attn.k_cache, attn.v_cache))
        self._kv = kvs

    # ---- forward -------------------------------------------------------------------------------------
    def _paged_attention(self):
        md = get_attn_metadata()
        if md.mode != "draft" or md.slot_mapping is not None:
            raise RuntimeError(f"assistant: draft forwards need mode 'draft' metadata with no slot_mapping (the "
                               f"draft never writes KV); got mode {md.mode!r}, slot_mapping "
                               f"{'set' if md.slot_mapping is not None else 'None'}")
        if self._kv is None:
            raise RuntimeError("assistant: bind_target(target) after the KV pool is allocated")

        def attn(layer_idx, q):
            k, v = self._kv[layer_idx]
            return draft_attention(q, k, v, md.block_table, md.seq_lens, md.row_to_req, 1.0, md.num_splits)
        return attn

    def forward(self, tokens, h_prev, positions, attn_fn=None):
        """One draft step for R query rows: ``tokens [R]``, ``h_prev [R, Hb]``, ``positions [R]`` ->
        ``(logits [R, V] fp32, h_next [R, Hb])``. ``attn_fn(layer_idx, q [R, Hq, D]) -> o [R, Hq, D]`` replaces
        the paged draft attention (default: current ``AttnMetadata`` in mode "draft")."""
        if self._embed is None:
            raise RuntimeError("assistant: bind_target(target) before forward")
        dtype, R = self.pre_projection.weight.dtype, tokens.shape[0]
        if R == 0:  # DESIGN §4 rule 4: no attention metadata, no reductions
            return (torch.empty(0, self.vocab_size, dtype=torch.float32, device=tokens.device),
                    torch.empty(0, self.backbone_hidden_size, dtype=dtype, device=tokens.device))
        attn_fn = attn_fn or self._paged_attention()
        e = self._embed(tokens)
        if self._embed_scale != 1.0:
            e = e * torch.tensor(self._embed_scale, dtype=e.dtype)  # rounded to the embedding dtype, as HF Gemma
        x = self.pre_projection(torch.cat([e.to(dtype), h_prev.to(dtype)], dim=-1))
        for i, layer in enumerate(self.model.layers):
            x = layer(x, positions, self._cos_sin, lambda q, i=i: attn_fn(i, q))
        hn = self.model.norm(x)
        head = self.lm_head.weight if self.lm_head is not None else self._target_lm_head
        return F.linear(hn, head.to(dtype)).float(), self.post_projection(hn)


def assistant_config_for(target_config, num_layers: int = 1, hidden_size: int | None = None,
                         intermediate_size: int | None = None, num_heads: int | None = None,
                         use_target_lm_head: bool = False):
    """A ``Gemma4AssistantConfig`` whose q geometry and RoPE read a Llama/Qwen3 target's K (all layers full
    attention, the target's head_dim and RoPE; heads default to the target's query heads).

    ``use_target_lm_head`` (needs hidden_size == target hidden) makes the checkpoint carry no LM head.
    """
    from transformers import Gemma4AssistantConfig, Gemma4TextConfig

    tc = target_config
    hd = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    rope = dict(getattr(tc, "rope_parameters", None) or {"rope_type": "default",
                                                        "rope_theta": getattr(tc, "rope_theta", 10000.0)})
    hidden = hidden_size or tc.hidden_size
    text = Gemma4TextConfig(
        vocab_size=tc.vocab_size, hidden_size=hidden, intermediate_size=intermediate_size or 2 * hidden,
        num_hidden_layers=num_layers, num_attention_heads=num_heads or tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads, head_dim=hd, global_head_dim=hd,
        layer_types=["full_attention"] * num_layers, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
        rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6), max_position_embeddings=tc.max_position_embeddings,
        rope_parameters={"full_attention": rope, "sliding_attention": rope})
    cfg = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=tc.hidden_size,
                                tie_word_embeddings=not use_target_lm_head)
    if use_target_lm_head:
        cfg.use_target_lm_head = True
    return cfg
