"""Frozen-KV MTP drafter (nanospec.models.gemma4_assistant) against HF Gemma4AssistantForCausalLM, on CPU in fp32."""
import json
import shutil

import conftest
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig, LlamaConfig,
                          LlamaForCausalLM as HFLlama)

from nanospec.context import AttnMetadata, attn_metadata
from nanospec.model_runner import build_target
from nanospec.models.gemma4_assistant import Gemma4Assistant

V, HB, HKV, D, THETA, PAGE = 96, 64, 2, 16, 10000.0, 4


def target_config(**kw):
    base = dict(vocab_size=V, hidden_size=HB, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=HKV, head_dim=D, rope_parameters={"rope_type": "default", "rope_theta": THETA},
                tie_word_embeddings=False, max_position_embeddings=256)
    return LlamaConfig(**{**base, **kw})


def assistant_config(hidden=32, heads=4, head_dim=D, layer_types=("full_attention",) * 2, theta=THETA,
                     full_rope=None, vocab=V, backbone=HB, **kw):
    rope = {"rope_type": "default", "rope_theta": theta}
    tc = Gemma4TextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=48,
                          num_hidden_layers=len(layer_types), num_attention_heads=heads, num_key_value_heads=HKV,
                          head_dim=head_dim, global_head_dim=head_dim, layer_types=list(layer_types),
                          hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                          rope_parameters={"full_attention": full_rope or rope, "sliding_attention": rope})
    return Gemma4AssistantConfig(text_config=tc, backbone_hidden_size=backbone, **kw)


def randomize(model, seed, std=0.2):
    """Non-trivial random weights: matrices N(0, std), norms / layer scalars around 1 (so every one matters)."""
    conftest.randomize(model, seed, std)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """HF Llama target + its nanospec twin, HF assistant saved as a gemma4_assistant dir, target K/V per prompt."""
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
    """A garbage-filled pool; writes each request's [0, L) K/V of the last target layer into scattered blocks."""
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
    out = hf_a(inputs_embeds=torch.cat([e, h.view(1, 1, -1)], -1), position_ids=torch.tensor([[pos]]),
               shared_kv_states={"full_attention": kv, "sliding_attention": kv})
    return out.logits[0, 0], out.last_hidden_state[0, 0]


def dense_attn(k, v, L):
    """An ``attn_fn`` over contiguous K/V [1, Hkv, T, D] rows [0, L): GQA, scale 1.0 (what a trainer plugs in)."""
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
    md = AttnMetadata(mode="draft", block_table=bt, seq_lens=torch.tensor(lens, dtype=torch.int32),
                      row_to_req=row_to_req)
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
    a = Gemma4Assistant(assistant_config(layer_types=("full_attention", "sliding_attention", "full_attention")))
    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention"]
    assert a.layer_map(types) == [3, 4, 3]
    assert Gemma4Assistant(assistant_config()).layer_map(["full_attention"] * 30) == [29, 29]
    with pytest.raises(ValueError, match="layer_types"):
        a.layer_map(["full_attention"] * 4)


@pytest.mark.parametrize("kw,field", [
    (dict(head_dim=8), "head_dim"),
    (dict(vocab=V + 1), "vocab_size"),
    (dict(backbone=HB + 8), "backbone_hidden_size"),
    (dict(heads=3), "num_attention_heads"),
    (dict(theta=1e6), "rope_theta"),
    (dict(full_rope={"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": THETA}),
     "rope_parameters"),
    (dict(layer_types=("sliding_attention", "full_attention")), "layer_types"),
])
def test_check_target_mismatch(world, kw, field):
    t = world["target"]
    a = Gemma4Assistant(assistant_config(**kw))
    with pytest.raises(ValueError, match=field):
        a.check_target(t.config, t.kv_layer_types, t.num_kv_heads, t.head_dim, t.rope_theta, t.rope_scaling)


def test_check_target_accepts_equivalent_rope(world):
    t = world["target"]
    full = {"rope_type": "proportional", "partial_rotary_factor": 1.0, "rope_theta": THETA}
    Gemma4Assistant(assistant_config(full_rope=full)).check_target(
        t.config, t.kv_layer_types, t.num_kv_heads, t.head_dim, t.rope_theta, t.rope_scaling)


def test_bind_before_pool_is_an_error(world):
    fresh = build_target(world["hf_t"].config, "cpu", torch.float32, 64, world["tmp"] / "target")
    a = Gemma4Assistant.from_pretrained(world["tmp"] / "assistant")
    with pytest.raises(RuntimeError, match="KV cache"):
        a.bind_target(fresh)


def test_unsupported_configs():
    with pytest.raises(ValueError, match="use_ordered_embeddings"):
        Gemma4Assistant(assistant_config(use_ordered_embeddings=True))
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
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + ".*missing|missing.*" + name.replace(".", r"\.")):
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
    shared = Gemma4Assistant.from_pretrained(_copy_dir(src, tmp_path / "tgt", drop=["model.embed_tokens.weight"],
                                                       config={"use_target_lm_head": True}))
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
