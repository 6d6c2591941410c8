"""The Frozen-KV MTP drafter: HF ``Gemma4AssistantForCausalLM`` (a Gemma4 text stack whose every layer is
KV-shared).

It owns no KV cache. Per query row (one per request, or B·k rows for a top-k tree):

    x  = pre_projection(cat(target.embed(tok), h_prev))  # 2·Hb -> H; the target's (Gemma-scaled) embedding
    per layer:  x = x + post_attn_norm(o_proj(Attn(rope(q_norm(q_proj(input_norm(x)))))))
                x = (x + post_ff_norm(down(act(gate(h)) * up(h)))) * layer_scalar,  h = pre_ff_norm(x)
    hn = norm(x);  logits = lm_head(hn) (fp32);  h_next = post_projection(hn)          # H -> Hb

``Attn`` is Q-only attention with scale 1.0 (HF ``Gemma4TextAttention.scaling``) over the stored, already
normed and roped K/V of the mapped target layer (the last KV-owning target layer of the same layer type, with
that layer's RoPE and, for sliding layers, its window); nothing is written.
HF semantics worth knowing: the text model does not rescale ``inputs_embeds``; every norm is ``x * w`` with
the weight applied in fp32 (no ``1 + w``); full-attention layers use ``global_head_dim`` (HF
``per_layer_config``), and their RoPE may be "proportional" (partial rotary with zero frequencies), which must
match the target's RoPE; HF's assistant forward applies no ``final_logit_softcapping`` and Gemma4 attention
has no logit softcap.

Centroid head (``use_ordered_embeddings``, E2B/E4B assistants; HF ``Gemma4AssistantMaskedEmbedder``): the
vocabulary is split into C clusters of S = V / C tokens (``token_ordering`` [V], viewed [C, S]); a row scores
the C centroids (``masked_embedding.centroids(hn)``), keeps the top ``centroid_intermediate_top_k`` clusters
and computes logits only for their tokens (``kernels.centroid``, over LM-head rows stored in cluster order).
HF fills every other token with ``min(candidates) - 1``; ``propose`` gives that tensor's top-k
log-probabilities in closed form, without building it. Training one (``nanospec.tools.train``): the token
KL on the full-vocabulary ``dense_logits(hn)``, and for the centroids a KL between the target's probability
mass per cluster and the softmax of ``masked_embedding.centroids(hn)``; the candidate selection itself (top-k)
passes no gradient.
"""

import torch
from torch import nn

from .. import loader
from ..context import get_attn_metadata
from ..kernels.attention import draft_attention
from ..kernels.centroid import centroid_logits
from ..kernels.rope import apply_rope
from ..kernels.sampling import mask_logits, sample
from ..parallel import SINGLE, ColumnLinear, Linear, RowLinear, linear
from .assistant_config import ACTIVATIONS, bad, check_assistant_alone, check_assistant_config, target_layers
from .llama import MLP, gemma_rms_norm


class QOnlyAttention(nn.Module):
    """q_proj -> per-head q_norm -> RoPE on q -> attention over the target's K/V (via ``attn``) -> o_proj."""

    def __init__(self, tc, layer_idx: int, tp):
        super().__init__()
        H = tc.num_attention_heads
        d = tc.per_layer_config[layer_idx].head_dim
        # this rank's span of the heads: the query heads of the KV heads it holds of the target layer read
        self.num_heads = tp.span(H)[1]
        self.head_dim = d
        bias = bool(getattr(tc, "attention_bias", False))
        self.q_proj = ColumnLinear(tp, tc.hidden_size, [(H, d)], bias)
        self.q_norm = gemma_rms_norm(self.head_dim, tc.rms_norm_eps)
        self.o_proj = RowLinear(tp, H, d, tc.hidden_size, bias)

    def forward(self, x, positions, cos_sin, attn):
        R = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(R, self.num_heads, self.head_dim))
        q, _ = apply_rope(q, None, positions, cos_sin)
        return self.o_proj(attn(q).reshape(R, -1))


class DecoderLayer(nn.Module):
    def __init__(self, tc, layer_idx: int, tp):
        super().__init__()
        H = tc.hidden_size
        eps = tc.rms_norm_eps
        self.self_attn = QOnlyAttention(tc, layer_idx, tp)
        # replicated (SINGLE): every rank runs the whole MLP of its rows
        self.mlp = MLP(H, tc.intermediate_size, SINGLE, linear, ACTIVATIONS[tc.hidden_activation])
        self.input_layernorm = gemma_rms_norm(H, eps)
        self.post_attention_layernorm = gemma_rms_norm(H, eps)
        self.pre_feedforward_layernorm = gemma_rms_norm(H, eps)
        self.post_feedforward_layernorm = gemma_rms_norm(H, eps)
        # A buffer in HF; a frozen parameter here so that loading checks it like every other tensor.
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, x, positions, cos_sin, attn):
        h = self.self_attn(self.input_layernorm(x), positions, cos_sin, attn)
        # pre_ff_norm(x + post_attn_norm(h)), with the residual add fused into the norm
        h, x = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), x)
        x = x + self.post_feedforward_layernorm(self.mlp(h))
        return x * self.layer_scalar


class MaskedEmbedding(nn.Module):
    """HF ``Gemma4AssistantMaskedEmbedder``'s tensors: ``centroids`` (H -> C scores) and ``token_ordering``
    [V] (the token ids of cluster c are ``token_ordering.view(C, S)[c]``; identity until a checkpoint sets
    it)."""

    def __init__(self, config):
        super().__init__()
        tc = config.get_text_config()
        self.centroids = Linear(tc.hidden_size, config.num_centroids, bias=False)
        self.register_buffer("token_ordering", torch.arange(tc.vocab_size))


class Gemma4Model(nn.Module):
    """Holds ``layers`` and ``norm`` under the HF prefix ``model.`` (no embedding: the target's is used)."""

    def __init__(self, tc, tp):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(tc, i, tp) for i in range(tc.num_hidden_layers))
        self.norm = gemma_rms_norm(tc.hidden_size, tc.rms_norm_eps)


class Gemma4Assistant(nn.Module):
    """The drafter. Lifecycle (DESIGN §4 rule 2): ``LLM`` checks its config against the target's
    (``check_assistant_config``, before any weights load) -> construct (``from_pretrained``) -> the engine
    allocates the target pool -> ``bind_target`` (its layer map from ``check_assistant_config``) -> per
    draft step ``draft_token`` (a chain) or ``propose`` (a tree); ``forward`` for training. Built with
    ``tp`` (a ``parallel.TensorParallel``: the target's), whose span of the query heads its attention
    layers keep."""

    def __init__(self, config, tp=SINGLE):
        super().__init__()
        check_assistant_alone(config)
        tc = config.get_text_config()
        self.config = config
        self.tp = tp
        self.text_config = tc
        self.vocab_size = tc.vocab_size
        self.hidden_size = tc.hidden_size
        self.backbone_hidden_size = config.backbone_hidden_size
        self.pre_projection = Linear(2 * self.backbone_hidden_size, self.hidden_size, bias=False)
        self.post_projection = Linear(self.hidden_size, self.backbone_hidden_size, bias=False)
        self.model = Gemma4Model(tc, tp)
        own_head = not getattr(config, "use_target_lm_head", False)
        self.lm_head = Linear(self.hidden_size, self.vocab_size, bias=False) if own_head else None
        ordered = getattr(config, "use_ordered_embeddings", False)
        self.masked_embedding = MaskedEmbedding(config) if ordered else None
        # Set by bind_target (plain attributes, not submodules/buffers: they belong to the target).
        self._embed = self._target_lm_head = self._target_rows = self._rope = None
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._windows: list[int | None] = []

    # ---- checkpoints (nanospec.loader) ----------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path, device="cpu", dtype=torch.float32, tp=SINGLE) -> "Gemma4Assistant":
        """Load an HF ``gemma4_assistant`` dir (``loader.load_assistant``; ValueError naming the
        problem)."""
        return loader.load_assistant(cls, path, device, dtype, tp)

    def gather_target_rows(self) -> None:
        """With the target's LM head and a centroid head: keep the head's rows in cluster order
        (``token_ordering``), gathered once (``bind_target``, ``loader.set_token_ordering``)."""
        me = self.masked_embedding
        head = self._target_lm_head
        if me is not None and head is not None:
            identity = torch.equal(me.token_ordering, torch.arange(self.vocab_size, device=head.device))
            self._target_rows = head if identity else head[me.token_ordering]

    # ---- target compatibility ------------------------------------------------------------------------
    def layer_map(self, target_kv_layer_types) -> list[int]:
        """Target layer read by each assistant layer: the last target layer of the same layer type."""
        return target_layers(self.text_config.layer_types, list(target_kv_layer_types))

    def bind_target(self, target, kv: bool = True) -> None:
        """Attach the target's embedding, per-layer RoPE tables (``target.rope_for(layer_type)``) and (if
        configured) LM head; with ``kv`` also, per assistant layer,
        the (k_cache, v_cache, sliding_window) of its mapped target layer.

        Call with ``kv=True`` only after the target pool is allocated and bound (DESIGN §4 rule 2); raises
        RuntimeError otherwise. ``kv=False`` serves the trainer, which passes its own ``attn_fn``.
        """
        layer_map = check_assistant_config(self.config, target.config)
        self._embed = target.embed
        self._rope = [target.rope_for(layer_type) for layer_type in self.text_config.layer_types]
        # detached: a Parameter assigned here would register as the assistant's own (trained, saved) weight;
        # a vocabulary-parallel target head is gathered whole once (the drafter's head is replicated)
        head = None if self.lm_head is not None else self.tp.gather(target.lm_head_weight.detach())
        self._target_lm_head = head
        self.gather_target_rows()
        if not kv:
            return
        attns = [target.layers[i].self_attn for i in layer_map]
        for i, attn in zip(layer_map, attns):
            if attn.k_cache is None or attn.v_cache is None:
                raise RuntimeError(
                    f"assistant: target layer {i} has no KV cache bound yet: allocate the "
                    "pool before bind_target (construct -> allocate -> bind)"
                )
        self._kv = [(attn.k_cache, attn.v_cache) for attn in attns]
        self._windows = [attn.sliding_window for attn in attns]

    # ---- forward -------------------------------------------------------------------------------------
    def _paged_attention(self):
        md = get_attn_metadata()
        if md.mode != "draft" or md.slot_mapping is not None:
            raise RuntimeError(
                f"assistant: draft forwards need mode 'draft' metadata with no slot_mapping "
                f"(the draft never writes KV); got mode {md.mode!r}, slot_mapping "
                f"{'set' if md.slot_mapping is not None else 'None'}"
            )
        if self._kv is None:
            raise RuntimeError("assistant: bind_target(target) after the KV pool is allocated")

        def attn(layer_idx, q):
            k, v = self._kv[layer_idx]
            window = self._windows[layer_idx]
            return draft_attention(
                q, k, v, md.block_table, md.seq_lens, md.row_to_req, 1.0, md.num_splits, sliding_window=window
            )

        return attn

    def body(self, tokens, h_prev, positions, attn_fn=None):
        """Embed + layers + final norm of one draft step (``forward``'s arguments): ``(hn [R, H], h_next [R,
        Hb])`` in the assistant's dtype, before any LM head (the trainer scores ``hn`` itself). RuntimeError
        before ``bind_target``."""
        if self._embed is None:
            raise RuntimeError("assistant: bind_target(target) before forward")
        dtype = self.pre_projection.weight.dtype
        if tokens.shape[0] == 0:  # DESIGN §4 rule 4: no attention metadata, no reductions
            hn = torch.empty(0, self.hidden_size, dtype=dtype, device=tokens.device)
            return hn, hn.new_empty(0, self.backbone_hidden_size)
        attn_fn = attn_fn or self._paged_attention()
        # the target's input embedding (Gemma targets scale it by sqrt(Hb) themselves)
        x = self.pre_projection(torch.cat([self._embed(tokens).to(dtype), h_prev.to(dtype)], dim=-1))
        for i, layer in enumerate(self.model.layers):
            x = layer(x, positions, self._rope[i], lambda q, i=i: attn_fn(i, q))
        hn = self.model.norm(x)
        return hn, self.post_projection(hn)

    def _candidates(self, hn):
        """Centroid head: candidate logits [R, M] fp32 (M = top_k * S) and their token ids [R, M] int64."""
        me = self.masked_embedding
        C = self.config.num_centroids
        head = self.lm_head.weight if self.lm_head is not None else self._target_rows
        rows = head.view(C, self.vocab_size // C, head.shape[-1])
        sel = me.centroids(hn).topk(self.config.centroid_intermediate_top_k, dim=-1).indices  # [R, K]
        ids = me.token_ordering.view(C, -1)[sel].flatten(1)
        return centroid_logits(hn, rows, sel), ids

    def dense_logits(self, hn, vocab=None):
        """Full-vocabulary logits ``[R, V]`` fp32 (token-id order) of final-normed ``hn [R, H]``: the LM head
        applied whole, as HF's dense head (the centroid head's own rows are stored in cluster order).
        ``vocab`` (LongTensor [V'], the trainer's subset; the target's LM head only): logits ``[R, V']`` of
        those tokens."""
        me = self.masked_embedding
        head = self.lm_head.weight if self.lm_head is not None else self._target_lm_head
        head = head if vocab is None else head[vocab]
        logits = linear(hn, head.to(self.pre_projection.weight.dtype)).float()
        if me is not None and self.lm_head is not None:
            logits = torch.zeros_like(logits).index_copy(1, me.token_ordering, logits)
        return logits

    def forward(self, tokens, h_prev, positions, attn_fn=None, dense: bool = False):
        """One draft step for R query rows: ``tokens [R]``, ``h_prev [R, Hb]``, ``positions [R]`` ->
        ``(logits [R, V] fp32, h_next [R, Hb])``. ``attn_fn(layer_idx, q [R, Hq, D]) -> o [R, Hq, D]``
        replaces the paged draft attention (default: current ``AttnMetadata`` in mode "draft").

        Centroid head: logits are HF's masked tensor (candidates scattered to their token ids, every other
        token ``min(candidates of the row) - 1``; HF takes that min over the whole batch, the same for one
        row), or the full LM head with ``dense`` (for training). Drafting uses ``propose``, which never builds
        [R, V]."""
        hn, h_next = self.body(tokens, h_prev, positions, attn_fn)
        if self.masked_embedding is None or dense:
            return self.dense_logits(hn), h_next
        cand, ids = self._candidates(hn)
        fill = (cand.amin(-1, keepdim=True) - 1.0).expand(-1, self.vocab_size)
        return fill.contiguous().scatter_(1, ids, cand), h_next

    def _draft_logits(self, tokens, h_prev, positions):
        """One draft step's ``(logits [R, M] fp32, their token ids [R, M] int64, h_next [R, Hb])``: the dense
        head's over the whole vocabulary in token-id order (ids None, M = V; through ``forward``, so its hooks
        see the step), the centroid head's over its M candidates only."""
        if self.masked_embedding is None:
            logits, h_next = self(tokens, h_prev, positions)
            return logits, None, h_next
        hn, h_next = self.body(tokens, h_prev, positions)
        logits, ids = self._candidates(hn)
        return logits, ids, h_next

    def draft_token(self, tokens, h_prev, positions, sampling, token_positions, bitmask=None):
        """One chain draft step: ``tokens [R]``, ``h_prev [R, Hb]``, ``positions [R]`` -> ``(token [R] int64,
        h_next [R, Hb])``, the token ``kernels.sampling.sample`` draws from the assistant's logits with the
        rows' ``sampling`` = (temperature, top_k, top_p, seeds [R]) at ``token_positions [R]`` int64 (the
        target's noise there); ``sampling`` None: the argmax. The centroid head samples among its candidates
        only (nothing of size V is built). ``bitmask`` [R, W] int32 (structured output): the tokens each row
        may draft (a row the grammar leaves no candidate, possible with the centroid head, drafts unmasked:
        the verify, which samples inside the grammar, rejects that draft)."""
        logits, ids, h_next = self._draft_logits(tokens, h_prev, positions)
        if bitmask is not None:
            masked = mask_logits(logits, bitmask, ids)
            no_candidate = masked.amax(-1, keepdim=True) == float("-inf")
            logits = torch.where(no_candidate, logits, masked)
        if sampling is not None:
            return sample(logits, *sampling, token_positions, ids), h_next
        best = logits.argmax(-1)
        if ids is not None:
            best = ids.gather(1, best[:, None]).squeeze(1)
        return best, h_next

    def propose(self, tokens, h_prev, positions, k: int, bitmask=None):
        """One draft step returning the top ``k`` tokens per row: ``tokens [R]``, ``h_prev [R, Hb]``,
        ``positions [R]`` -> ``(top_logprobs [R, k] fp32, top_tokens [R, k] int64, h_next [R, Hb])``, best
        first.

        Dense head: ``log_softmax(logits).topk(k)``. Centroid head: the top k candidates (k = 1: their
        argmax), log-probabilities equal to HF's ``log_softmax`` of its masked [V] tensor, whose logsumexp is
        that of the candidates plus ``(V - M) * exp(min - 1)`` for the M candidates; nothing of size V is
        built and nothing syncs with the host. ``bitmask``: as ``draft_token``'s. Raises ValueError unless
        1 <= k <= V (M for the centroid head).
        """
        logits, ids, h_next = self._draft_logits(tokens, h_prev, positions)
        if not 1 <= k <= logits.shape[-1]:
            bad("propose k", f"must be in [1, {logits.shape[-1]}], got {k}")
        logits = mask_logits(logits, bitmask, ids)
        if ids is None:
            top_lp, top_tok = torch.log_softmax(logits, -1).topk(k, dim=-1)
            return top_lp, top_tok, h_next
        top, j = logits.topk(k, dim=-1)
        hi = logits.amax(-1, keepdim=True)
        lo = logits.amin(-1, keepdim=True)
        rest = self.vocab_size - logits.shape[-1]  # tokens HF fills with lo - 1
        lse = hi + ((logits - hi).exp().sum(-1, keepdim=True) + rest * (lo - 1.0 - hi).exp()).log()
        return top - lse, ids.gather(1, j), h_next
