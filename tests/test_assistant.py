"""Frozen-KV MTP drafter (nanospec.models.gemma4_assistant) vs HF Gemma4AssistantForCausalLM, CPU, fp32."""

import json
import shutil
from types import SimpleNamespace

import conftest
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    Gemma4AssistantConfig,
    Gemma4AssistantForCausalLM,
    Gemma4TextConfig,
    LlamaConfig,
)
from transformers import LlamaForCausalLM as HFLlama

from nanospec import loader
from nanospec.context import AttnMetadata, attn_metadata
from nanospec.kernels.rope import rope_cos_sin
from nanospec.loader import build_target
from nanospec.models.assistant_config import check_assistant_config
from nanospec.models.gemma4_assistant import Gemma4Assistant

V, HB, HKV, D, THETA, PAGE = 96, 64, 2, 16, 10000.0, 4


def target_config(**kw):
    base = dict(
        vocab_size=V,
        hidden_size=HB,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=HKV,
        head_dim=D,
        rope_parameters={"rope_type": "default", "rope_theta": THETA},
        tie_word_embeddings=False,
        max_position_embeddings=256,
    )
    return LlamaConfig(**{**base, **kw})


def assistant_config(
    hidden=32,
    heads=4,
    head_dim=D,
    layer_types=("full_attention",) * 2,
    theta=THETA,
    full_rope=None,
    vocab=V,
    backbone=HB,
    **kw,
):
    rope = {"rope_type": "default", "rope_theta": theta}
    tc = Gemma4TextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=48,
        num_hidden_layers=len(layer_types),
        num_attention_heads=heads,
        num_key_value_heads=HKV,
        head_dim=head_dim,
        global_head_dim=head_dim,
        layer_types=list(layer_types),
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        rope_parameters={"full_attention": full_rope or rope, "sliding_attention": rope},
    )
    return Gemma4AssistantConfig(text_config=tc, backbone_hidden_size=backbone, **kw)


def randomize(model, seed, std=0.2):
    """Non-trivial random weights: matrices N(0, std), norms / layer scalars near 1 (so each one matters)."""
    conftest.randomize(model, seed, std)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """HF Llama target + its nanospec twin, HF assistant saved as a gemma4_assistant dir, K/V per prompt."""
    torch.manual_seed(0)
    tmp = tmp_path_factory.mktemp("assist")
    hf_t = HFLlama(target_config()).eval()
    randomize(hf_t, 1)
    hf_t.save_pretrained(tmp / "target")
    target = build_target(hf_t.config, "cpu", torch.float32, 256, tmp / "target")
    hf_a = Gemma4AssistantForCausalLM(assistant_config()).eval()
    randomize(hf_a, 2, std=0.3)
    hf_a.save_pretrained(tmp / "assistant")
    prompts = [torch.randint(0, V, (n,)) for n in (11, 6, 3)]
    seqs = []
    with torch.no_grad():
        for p in prompts:
            out = hf_t.model(p[None], use_cache=True)
            layer = out.past_key_values.layers[-1]
            seqs.append((out.last_hidden_state[0], layer.keys, layer.values))  # K/V [1, Hkv, T, D] after RoPE
    return dict(tmp=tmp, hf_t=hf_t, target=target, hf_a=hf_a, seqs=seqs)


def paged_pool(target, seqs, lens, seed=3):
    """A garbage-filled pool with each request's [0, L) K/V of the last target layer in scattered blocks."""
    g = torch.Generator().manual_seed(seed)
    W = max(-(-n // PAGE) for n in lens)
    nb = len(lens) * W + 3
    kv = torch.randn(len(target.layers), 2, nb, PAGE, HKV, D, generator=g)
    perm = torch.randperm(nb - 1, generator=g)[: len(lens) * W] + 1
    bt = perm.view(len(lens), W).to(torch.int32)
    for r, ((_, k, v), n) in enumerate(zip(seqs, lens)):
        for t in range(n):
            blk, off = bt[r, t // PAGE], t % PAGE
            kv[-1, 0, blk, off], kv[-1, 1, blk, off] = k[0, :, t], v[0, :, t]
    target.bind_kv_cache(kv)
    return kv, bt


def hf_step(hf_t, hf_a, tok, h, k, v, L, pos):
    e = hf_t.get_input_embeddings()(tok.view(1, 1))
    kv = (k[:, :, :L], v[:, :, :L])
    out = hf_a(
        inputs_embeds=torch.cat([e, h.view(1, 1, -1)], -1),
        position_ids=torch.tensor([[pos]]),
        shared_kv_states={"full_attention": kv, "sliding_attention": kv},
    )
    return out.logits[0, 0], out.last_hidden_state[0, 0]


def dense_attn(k, v, L):
    """An ``attn_fn`` over contiguous K/V [1, Hkv, T, D] rows [0, L): GQA, scale 1.0 (a trainer's plug-in)."""

    def attn(layer_idx, q):
        g = q.shape[1] // HKV
        kk, vv = k[0, :, :L].repeat_interleave(g, 0), v[0, :, :L].repeat_interleave(g, 0)
        return torch.einsum("rhs,hsd->rhd", torch.softmax(torch.einsum("rhd,hsd->rhs", q, kk), -1), vv)

    return attn


@torch.no_grad()
def test_hf_parity_paged_mixed_lengths_two_steps(world):
    target, hf_t, hf_a, seqs = world["target"], world["hf_t"], world["hf_a"], world["seqs"]
    lens = [11, 5, 3]  # committed L per request (request 1 uses a prefix of its prompt)
    kv, bt = paged_pool(target, seqs, lens)
    checksum = kv.clone()
    a = Gemma4Assistant.from_pretrained(world["tmp"] / "assistant", "cpu", torch.float32)
    a.bind_target(target)
    assert a.layer_map(target.kv_layer_types) == [2, 2]
    row_to_req = torch.tensor([0, 1, 1, 2], dtype=torch.int32)  # request 1 has two rows (a top-k frontier)
    rows = row_to_req.long()
    tok = torch.randint(0, V, (4,))
    h_hf = torch.stack([seqs[r][0][lens[r] - 1] for r in rows.tolist()])  # post-norm hidden of token L-1
    h_ns = h_hf.clone()
    pos = torch.tensor([lens[r] - 1 for r in rows.tolist()])
    md = AttnMetadata(
        mode="draft", block_table=bt, seq_lens=torch.tensor(lens, dtype=torch.int32), row_to_req=row_to_req
    )
    for _ in range(2):
        with attn_metadata(md):
            logits, h_next = a(tok, h_ns, pos)
        assert logits.dtype == torch.float32 and logits.shape == (4, V) and h_next.shape == (4, HB)
        for i, r in enumerate(rows.tolist()):
            _, k, v = seqs[r]
            ref_logits, ref_h = hf_step(hf_t, hf_a, tok[i], h_hf[i], k, v, lens[r], int(pos[i]))
            torch.testing.assert_close(logits[i], ref_logits, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(h_next[i], ref_h, atol=1e-4, rtol=1e-4)
            h_hf[i] = ref_h
        h_ns, tok = h_next, logits.argmax(-1)
    assert torch.equal(kv, checksum)  # the draft never writes KV


@torch.no_grad()
def test_attn_fn_hook_and_empty_batch(world):
    target, seqs = world["target"], world["seqs"]
    a = Gemma4Assistant.from_pretrained(world["tmp"] / "assistant", "cpu", torch.float32)
    a.bind_target(target, kv=False)  # no pool needed with a custom attention
    logits, h = a(torch.empty(0, dtype=torch.long), torch.empty(0, HB), torch.empty(0, dtype=torch.long))
    assert logits.shape == (0, V) and logits.dtype == torch.float32 and h.shape == (0, HB)
    _, k, v = seqs[0]
    L = 7

    dense = dense_attn(k, v, L)
    tok, hp = torch.tensor([5]), seqs[0][0][L - 1][None]
    out = a(tok, hp, torch.tensor([L - 1]), attn_fn=dense)
    ref = hf_step(world["hf_t"], world["hf_a"], tok[0], hp[0], k, v, L, L - 1)
    torch.testing.assert_close(out[0][0], ref[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1][0], ref[1], atol=1e-4, rtol=1e-4)


def test_layer_map_last_of_each_type(world):
    a = Gemma4Assistant(
        assistant_config(layer_types=("full_attention", "sliding_attention", "full_attention"))
    )
    types = [
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "full_attention",
        "sliding_attention",
    ]
    assert a.layer_map(types) == [3, 4, 3]
    assert Gemma4Assistant(assistant_config()).layer_map(["full_attention"] * 30) == [29, 29]
    with pytest.raises(ValueError, match="layer_types"):
        a.layer_map(["full_attention"] * 4)


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(head_dim=8), "head_dim"),
        (dict(vocab=V + 1), "vocab_size"),
        (dict(backbone=HB + 8), "backbone_hidden_size"),
        (dict(heads=3), "num_attention_heads"),
        (dict(theta=1e6), "rope_theta"),
        (
            dict(full_rope={"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": THETA}),
            "rope_parameters",
        ),
        (dict(layer_types=("sliding_attention", "full_attention")), "layer_types"),
    ],
)
def test_check_target_mismatch(world, kw, field):
    t = world["target"]
    a = Gemma4Assistant(assistant_config(**kw))
    with pytest.raises(ValueError, match=field):
        check_assistant_config(a.config, t.config)


def test_check_target_accepts_equivalent_rope(world):
    t = world["target"]
    full = {"rope_type": "proportional", "partial_rotary_factor": 1.0, "rope_theta": THETA}
    check_assistant_config(Gemma4Assistant(assistant_config(full_rope=full)).config, t.config)


def test_bind_before_pool_is_an_error(world):
    fresh = build_target(world["hf_t"].config, "cpu", torch.float32, 64, world["tmp"] / "target")
    a = Gemma4Assistant.from_pretrained(world["tmp"] / "assistant")
    with pytest.raises(RuntimeError, match="KV cache"):
        a.bind_target(fresh)


def test_unsupported_configs():
    with pytest.raises(ValueError, match="num_centroids"):  # HF's default 2048 centroids do not divide V = 96
        Gemma4Assistant(assistant_config(use_ordered_embeddings=True))
    with pytest.raises(ValueError, match="centroid_intermediate_top_k"):
        Gemma4Assistant(
            assistant_config(use_ordered_embeddings=True, num_centroids=8, centroid_intermediate_top_k=9)
        )
    with pytest.raises(ValueError, match="use_target_lm_head"):
        Gemma4Assistant(assistant_config(use_target_lm_head=True))  # H 32 != Hb 64


def _copy_dir(src, dst, drop=(), reshape=(), config=None):
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    for n in drop:
        sd.pop(n)
    for n in reshape:
        sd[n] = sd[n][..., :-1].contiguous()
    save_file(sd, str(dst / "model.safetensors"))
    if config:
        c = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**c, **config}))
    return dst


def test_checkpoint_errors(world, tmp_path):
    src = world["tmp"] / "assistant"
    with pytest.raises(ValueError, match=r"assistant.*'llama'"):
        Gemma4Assistant.from_pretrained(world["tmp"] / "target")
    with pytest.raises(ValueError, match="assistant"):
        Gemma4Assistant.from_pretrained(tmp_path / "nope")
    name = "model.layers.1.mlp.up_proj.weight"
    with pytest.raises(
        ValueError, match=name.replace(".", r"\.") + ".*missing|missing.*" + name.replace(".", r"\.")
    ):
        Gemma4Assistant.from_pretrained(_copy_dir(src, tmp_path / "a", drop=[name]))
    name = "model.layers.0.self_attn.q_norm.weight"
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + ".*shape"):
        Gemma4Assistant.from_pretrained(_copy_dir(src, tmp_path / "b", reshape=[name]))
    with pytest.raises(ValueError, match="lm_head"):
        Gemma4Assistant.from_pretrained(_copy_dir(src, tmp_path / "c", drop=["model.embed_tokens.weight"]))


@torch.no_grad()
def test_use_target_lm_head(world, tmp_path):
    target, seqs = world["target"], world["seqs"]
    hf_a = Gemma4AssistantForCausalLM(assistant_config(hidden=HB)).eval()
    randomize(hf_a, 4, std=0.3)
    hf_a.lm_head.weight.copy_(world["hf_t"].lm_head.weight)  # own head == the target's head
    hf_a.save_pretrained(tmp_path / "own")
    own = Gemma4Assistant.from_pretrained(tmp_path / "own")
    src = tmp_path / "own"
    with pytest.raises(ValueError, match="use_target_lm_head"):
        Gemma4Assistant.from_pretrained(_copy_dir(src, tmp_path / "bad", drop=["model.embed_tokens.weight"]))
    shared = Gemma4Assistant.from_pretrained(
        _copy_dir(
            src, tmp_path / "tgt", drop=["model.embed_tokens.weight"], config={"use_target_lm_head": True}
        )
    )
    assert shared.lm_head is None
    _, k, v = seqs[0]
    L = 9
    dense = dense_attn(k, v, L)
    args = (torch.tensor([1, 2]), seqs[0][0][[L - 1, L - 2]], torch.tensor([L - 1, L - 1]))
    outs = []
    for m in (own, shared):
        m.bind_target(target, kv=False)
        outs.append(m(*args, attn_fn=dense))
    torch.testing.assert_close(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[0][1], outs[1][1])


# ---- Gemma 4 targets: sliding + full layers (per-type geometry, RoPE, window), KV sharing, the centroid head
GV, GHB, GW, GPAGE = 128, 48, 5, 4  # vocab, backbone hidden, sliding window, page size
SL, FU = "sliding_attention", "full_attention"
G_TYPES = [SL, FU, SL, SL, SL, FU]  # with 2 KV-shared layers: sliding KV lives in layer 3, full KV in layer 1


def gemma_text(**kw):
    """A Gemma 4 text config: sliding head_dim 16 / 2 KV heads, full global_head_dim 32 / 1 KV head (k_eq_v),
    window 5, HF's default RoPE per type (full: proportional, partial 0.25, theta 1e6)."""
    base = dict(
        vocab_size=GV,
        hidden_size=GHB,
        intermediate_size=64,
        num_hidden_layers=len(G_TYPES),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        layer_types=list(G_TYPES),
        sliding_window=GW,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
    )
    return Gemma4TextConfig(**{**base, **kw})


def gemma_assistant_config(centroids=False, backbone=GHB, **kw):
    """A 3-layer (sliding, sliding, full) assistant for ``gemma_text()``; ``centroids``: 16 clusters of 8,
    top 3."""
    tc = gemma_text(
        **{
            "hidden_size": 32,
            "num_hidden_layers": 3,
            "layer_types": [SL, SL, FU],
            "num_kv_shared_layers": 0,
            **kw,
        }
    )
    extra = (
        dict(use_ordered_embeddings=True, num_centroids=16, centroid_intermediate_top_k=3)
        if centroids
        else {}
    )
    return Gemma4AssistantConfig(text_config=tc, backbone_hidden_size=backbone, **extra)


class GemmaTarget:
    """What the drafter binds to on a Gemma 4 target: its config, embedding (scaled by sqrt(Hb)), tied LM
    head, per-type RoPE tables, and per layer the paged K/V views (KV-owning layers only) and the sliding
    window."""

    def __init__(self, pools):
        self.config = gemma_text()
        g = torch.Generator().manual_seed(5)
        self.table = torch.nn.Embedding(GV, GHB)
        self.table.weight.data.copy_(torch.randn(GV, GHB, generator=g))
        self.embed_scale, self.lm_head_weight = GHB**0.5, self.table.weight
        self.layers = [
            SimpleNamespace(
                self_attn=SimpleNamespace(
                    k_cache=pools[i][0] if i in pools else None,
                    v_cache=pools[i][1] if i in pools else None,
                    sliding_window=GW if lt == SL else None,
                )
            )
            for i, lt in enumerate(G_TYPES)
        ]

    def embed(self, ids):
        """The scaled input embedding, as nanospec's Gemma 4 target returns it."""
        return self.table(ids) * torch.tensor(self.embed_scale)

    def rope_for(self, layer_type):
        p = self.config.rope_parameters[layer_type]
        return rope_cos_sin(16 if layer_type == SL else 32, 64, p["rope_theta"], p)


@pytest.fixture(scope="module")
def gemma_world():
    """Random paged K/V for the sliding owner (layer 3: 2 heads x 16) and the full owner (layer 1: 1 head x
    32), garbage everywhere else; three requests of committed lengths 11 (> window + 1), 4 and 8 in
    scattered blocks."""
    g = torch.Generator().manual_seed(4)
    lens = [11, 4, 8]
    W = -(-max(lens) // GPAGE)
    nb = len(lens) * W + 2
    pools = {
        3: torch.randn(2, nb, GPAGE, 2, 16, generator=g),
        1: torch.randn(2, nb, GPAGE, 1, 32, generator=g),
    }
    bt = (torch.randperm(nb - 1, generator=g)[: len(lens) * W] + 1).view(len(lens), W).to(torch.int32)
    return dict(target=GemmaTarget(pools), pools=pools, bt=bt, lens=lens)


def shared_kv(world, r):
    """HF ``shared_kv_states`` of request r: its committed rows [0, L) of both owners, as [1, Hkv, L, D]."""
    t = torch.arange(world["lens"][r])
    blocks = world["bt"][r][t // GPAGE].long()
    rows = {
        lt: world["pools"][i][:, blocks, t % GPAGE].permute(0, 2, 1, 3)[:, None]
        for lt, i in ((SL, 3), (FU, 1))
    }
    return {lt: (kv[0], kv[1]) for lt, kv in rows.items()}


def hf_gemma_step(hf_a, target, tok, h, kv, pos):
    e = target.embed(tok.view(1, 1))
    out = hf_a(
        inputs_embeds=torch.cat([e, h.view(1, 1, -1)], -1),
        position_ids=torch.tensor([[pos]]),
        shared_kv_states=kv,
    )
    return out.logits[0, 0], out.last_hidden_state[0, 0]


def gemma_assistant(tmp_path, centroids, seed=11):
    """A random HF assistant (random token_ordering with ``centroids``), saved and loaded back by nanospec."""
    hf_a = Gemma4AssistantForCausalLM(gemma_assistant_config(centroids)).eval()
    randomize(hf_a, seed, std=0.3)
    if centroids:
        hf_a.masked_embedding.token_ordering.copy_(
            torch.randperm(GV, generator=torch.Generator().manual_seed(seed))
        )
    hf_a.save_pretrained(tmp_path)
    return hf_a, Gemma4Assistant.from_pretrained(tmp_path)


@pytest.mark.parametrize("centroids", [False, True])
@torch.no_grad()
def test_gemma4_parity_sliding_full_two_steps(gemma_world, tmp_path, centroids):
    """Logits, propose() (k = 1 and k = 4) and h_next equal HF given the same K/V as shared_kv_states, over
    two recurrent steps, for rows of three requests (one with two rows, as a top-k frontier)."""
    target, lens = gemma_world["target"], gemma_world["lens"]
    hf_a, a = gemma_assistant(tmp_path, centroids)
    a.bind_target(target)
    assert check_assistant_config(a.config, target.config) == [3, 3, 1]
    rows = [0, 1, 1, 2]
    md = AttnMetadata(
        "draft",
        gemma_world["bt"],
        torch.tensor(lens, dtype=torch.int32),
        row_to_req=torch.tensor(rows, dtype=torch.int32),
    )
    g = torch.Generator().manual_seed(6)
    tok, h = torch.randint(0, GV, (4,), generator=g), torch.randn(4, GHB, generator=g)
    pos = torch.tensor([lens[r] - 1 for r in rows])
    h_hf = h.clone()
    for _ in range(2):
        with attn_metadata(md):
            logits, h_next = a(tok, h, pos)
            lp1, tok1, h1 = a.propose(tok, h, pos, 1)
            lp4, tok4, h4 = a.propose(tok, h, pos, 4)
        assert lp4.dtype == torch.float32 and tok4.dtype == torch.int64 and tok4.shape == (4, 4)
        assert torch.equal(h1, h_next) and torch.equal(h4, h_next)
        for i, r in enumerate(rows):
            ref_logits, ref_h = hf_gemma_step(
                hf_a, target, tok[i], h_hf[i], shared_kv(gemma_world, r), int(pos[i])
            )
            torch.testing.assert_close(logits[i], ref_logits, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(h_next[i], ref_h, atol=1e-4, rtol=1e-4)
            ref_lp = torch.log_softmax(ref_logits, -1)
            assert tok1[i, 0] == ref_logits.argmax() and torch.equal(tok4[i], ref_lp.topk(4).indices)
            torch.testing.assert_close(lp4[i], ref_lp[tok4[i]], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(lp1[i], lp4[i, :1])
            h_hf[i] = ref_h
        tok, h = tok1[:, 0], h_next


@torch.no_grad()
def test_gemma4_propose_triton_matches_torch(gemma_world, tmp_path, triton_backend):
    """The whole centroid-head draft step through the Triton kernels (interpreter) equals the torch path."""
    from nanospec.kernels.backend import using_backend

    target = gemma_world["target"]
    _, a = gemma_assistant(tmp_path, centroids=True, seed=12)
    a.bind_target(target)
    md = AttnMetadata("draft", gemma_world["bt"], torch.tensor(gemma_world["lens"], dtype=torch.int32))
    args = (
        torch.tensor([3, 70, 9]),
        torch.randn(3, GHB, generator=torch.Generator().manual_seed(7)),
        torch.tensor([10, 3, 7]),
    )
    with attn_metadata(md):
        got = a.propose(*args, 3)
        with using_backend("torch"):
            want = a.propose(*args, 3)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[2], want[2], atol=1e-5, rtol=1e-5)


def test_check_assistant_config_layer_maps(world):
    # last non-shared per type
    assert check_assistant_config(gemma_assistant_config(), gemma_text()) == [3, 3, 1]
    assert check_assistant_config(gemma_assistant_config(), gemma_text(num_kv_shared_layers=0)) == [4, 4, 5]
    assert check_assistant_config(assistant_config(), target_config()) == [2, 2]  # Llama: every layer owns KV
    # configs alone, as read before any weights load
    cfg = loader.read_assistant_config(world["tmp"] / "assistant")
    assert check_assistant_config(cfg, AutoConfig.from_pretrained(world["tmp"] / "target")) == [2, 2]
    with pytest.raises(ValueError, match="model_type"):
        loader.read_assistant_config(world["tmp"] / "target")
    with pytest.raises(ValueError, match=r"layer_types\[0\]"):  # every sliding target layer is KV-shared
        check_assistant_config(
            gemma_assistant_config(), gemma_text(layer_types=[FU, FU, SL, SL, SL, FU], num_kv_shared_layers=4)
        )


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(global_head_dim=16), "global_head_dim"),
        (dict(head_dim=8), "head_dim"),
        (dict(num_global_key_value_heads=2), "num_global_key_value_heads"),
        (dict(num_key_value_heads=1), "num_key_value_heads"),
        (dict(num_attention_heads=3, num_key_value_heads=2), "num_attention_heads"),
        (dict(sliding_window=4), "sliding_window"),
        (dict(vocab_size=2 * GV), "vocab_size"),
        (dict(backbone=64), "backbone_hidden_size"),
        (
            dict(
                rope_parameters={
                    SL: {"rope_type": "default", "rope_theta": 1e4},
                    FU: {"rope_type": "default", "rope_theta": 1e6},
                }
            ),
            r"rope_parameters\['full_attention'\]",
        ),
        (
            dict(
                rope_parameters={
                    SL: {"rope_type": "default", "rope_theta": 1e5},
                    FU: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
                }
            ),
            r"rope_parameters\['sliding_attention'\]\.rope_theta",
        ),
        (dict(hidden_activation="relu"), "hidden_activation"),
    ],
)
def test_check_assistant_config_mismatch(kw, field):
    """Config-only: an assistant for another backbone or head geometry is a ValueError naming the field."""
    with pytest.raises(ValueError, match=field):
        check_assistant_config(gemma_assistant_config(**kw), gemma_text())
