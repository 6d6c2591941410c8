"""The Gemma 4 target (nanospec.models.gemma4) against HF ``Gemma4ForCausalLM`` (fp32, CPU, tiny random
configs).

The model is driven directly with a hand-built per-layer pool and ``AttnMetadata`` (as the model runner builds
them): mixed-length prefill, a chunked extend over a cached prefix longer than the window, and paged decode,
with page_size 4 so every request crosses page boundaries and sliding windows shorter than the prompts. The HF
logits reference is a plain full-sequence forward (eager attention); greedy tokens are checked against HF
``generate`` (its own KV cache).
"""

import json
import logging

import pytest
import torch
from conftest import randomize
from transformers import (
    Gemma4Config,
    Gemma4ForCausalLM,
    Gemma4ForConditionalGeneration,
    Gemma4TextConfig,
    Gemma4VisionConfig,
)

from nanospec.context import AttnMetadata, attn_metadata
from nanospec.kernels.attention import num_kv_splits
from nanospec.loader import iter_safetensors, load_config, load_weights
from nanospec.models import gemma4 as g4
from nanospec.models import target_class
from nanospec.models.llama import LlamaForCausalLM

S, F = "sliding_attention", "full_attention"
PAGE, MAX_POS = 4, 96
# HF's own fp32 logits are 7e-5 off its fp64 ones on the E2B-like model; the CPU's BLAS kernels move both
# sides (3.5e-4 apart on an AMD EPYC, where 3e-4 had held on the machines before)
ATOL = 6e-4
ROPE = {
    S: {"rope_type": "default", "rope_theta": 10000.0},
    F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
}
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    num_attention_heads=4,
    head_dim=16,
    global_head_dim=32,
    max_position_embeddings=128,
    rope_parameters=ROPE,
    rms_norm_eps=1e-6,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=None,
    tie_word_embeddings=True,
)
CONFIGS = {
    # E2B-like: PLE, 4:1 sliding, the last 4 layers KV-shared (both types), double-wide MLPs, two head dims
    "e2b": dict(
        num_hidden_layers=10,
        layer_types=([S] * 4 + [F]) * 2,
        num_key_value_heads=1,
        intermediate_size=48,
        sliding_window=6,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=256,
        num_kv_shared_layers=4,
        use_double_wide_mlp=True,
        final_logit_softcapping=5.0,
    ),
    # 31B-like: 5:1 sliding, k_eq_v full layers with fewer KV heads (2 sliding / 1 full), no PLE, no sharing
    "31b": dict(
        num_hidden_layers=8,
        layer_types=[S] * 5 + [F] + [S, F],
        num_key_value_heads=2,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        intermediate_size=96,
        sliding_window=5,
        hidden_size_per_layer_input=0,
        final_logit_softcapping=30.0,
    ),
}
# 26B-A4B-like: the 31B-like attention (k_eq_v full layers, window 5), and in every layer routed experts
# beside the dense MLP: 8 experts top-2, and 16 experts top-4 over another sliding/full pattern
MOE = dict(CONFIGS["31b"], enable_moe_block=True, intermediate_size=48)
CONFIGS["moe8x2"] = dict(
    MOE, num_hidden_layers=7, layer_types=[S] * 5 + [F, F], num_experts=8, top_k_experts=2
)
CONFIGS["moe8x2"].update(moe_intermediate_size=16)
CONFIGS["moe16x4"] = dict(
    MOE, num_hidden_layers=6, layer_types=[S, S, F] * 2, num_experts=16, top_k_experts=4
)
CONFIGS["moe16x4"].update(moe_intermediate_size=24)


def _text_config(name, **kw):
    return Gemma4TextConfig(**{**COMMON, **CONFIGS[name], **kw}, attn_implementation="eager")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request):
    """(HF Gemma4ForCausalLM with random weights, nanospec Gemma4ForCausalLM loaded from its state dict)."""
    cfg = _text_config(request.param)
    torch.manual_seed(0)
    hf = Gemma4ForCausalLM(cfg).float().eval()
    randomize(hf, seed=len(request.param))
    model = g4.Gemma4ForCausalLM(cfg, MAX_POS)
    load_weights(model, hf.state_dict().items(), skip=("lm_head.",))
    model.eval().requires_grad_(False).init_buffers("cpu")
    return hf, model


class Pool:
    """A per-layer paged pool (only KV-owning layers get caches) with shuffled block ids per request."""

    def __init__(self, model, num_blocks=80, seed=0):
        self.caches = [
            None if g is None else (torch.zeros(num_blocks, PAGE, *g), torch.zeros(num_blocks, PAGE, *g))
            for g in model.kv_geometry
        ]
        model.bind_kv_cache(self.caches)
        perm = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed))
        self.free = (perm + 1).tolist()  # block 0 stays the padding block
        self.tables: list[list[int]] = []

    def slots(self, r, start, end):
        while len(self.tables) <= r:
            self.tables.append([])
        while len(self.tables[r]) * PAGE < end:
            self.tables[r].append(self.free.pop())
        return [self.tables[r][j // PAGE] * PAGE + j % PAGE for j in range(start, end)]

    def block_table(self, reqs):
        w = max(len(self.tables[r]) for r in reqs)
        rows = [self.tables[r] + [0] * (w - len(self.tables[r])) for r in reqs]
        return torch.tensor(rows, dtype=torch.int32)


def _prefill(model, pool, seqs, spans):
    """One prefill/extend step over ``seqs[r][s:e]`` for each (r, s, e) in spans; returns per-span logits."""
    ids, pos, slots, cu, lens = [], [], [], [0], []
    for r, s, e in spans:
        ids += seqs[r][s:e]
        pos += range(s, e)
        slots += pool.slots(r, s, e)
        cu.append(cu[-1] + e - s)
        lens.append(e)
    md = AttnMetadata(
        "prefill",
        pool.block_table([r for r, _, _ in spans]),
        torch.tensor(lens, dtype=torch.int32),
        torch.tensor(slots),
        torch.tensor(cu, dtype=torch.int32),
        max(e - s for _, s, e in spans),
    )
    with torch.no_grad(), attn_metadata(md):
        logits = model.compute_logits(model(torch.tensor(ids), torch.tensor(pos)))
    return logits.split([e - s for _, s, e in spans])


def _decode(model, pool, seqs, reqs):
    """One decode step: the last token of each request's sequence at position len - 1; returns [B, V]."""
    pos = [len(seqs[r]) - 1 for r in reqs]
    slots = [pool.slots(r, p, p + 1)[0] for r, p in zip(reqs, pos)]
    md = AttnMetadata(
        "decode",
        pool.block_table(reqs),
        torch.tensor([p + 1 for p in pos], dtype=torch.int32),
        torch.tensor(slots),
        num_splits=num_kv_splits(max(pos) + 1),
    )
    with torch.no_grad(), attn_metadata(md):
        return model.compute_logits(model(torch.tensor([seqs[r][-1] for r in reqs]), torch.tensor(pos)))


def _close(got, want, what):
    assert got.shape == want.shape, what
    err = float((got - want).abs().max())
    assert err <= ATOL, f"{what}: max |nanospec - HF| = {err:.3g} > {ATOL}"


def _hf_logits(hf, seq):
    with torch.no_grad():
        return hf(torch.tensor([seq])).logits[0]


def test_rope_tables_match_hf(pair):
    """Both RoPE tables equal HF's cos/sin; on full layers only dims [0:r/2] and [D/2 : D/2 + r/2] rotate."""
    hf, model = pair
    pos = torch.arange(MAX_POS)[None]
    for lt in (S, F):
        cos, sin = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32), pos, lt)
        table = model.rope_for(lt)
        half = table.shape[1] // 2
        assert table.shape == (MAX_POS, model.config.per_layer_config[lt].head_dim)
        _close(torch.cat([table[:, :half], table[:, :half]], -1), cos[0], f"{lt} cos")
        _close(torch.cat([table[:, half:], table[:, half:]], -1), sin[0], f"{lt} sin")
    D = COMMON["global_head_dim"]
    rotated = (model.rope_for(F)[:, D // 2 :] != 0).any(0)  # the sin half: non-zero frequencies
    r = int(0.25 * D)
    assert rotated.nonzero().flatten().tolist() == list(range(r // 2))  # pairs (i, i + D/2), i < r/2


def test_kv_interface(pair):
    hf, model = pair
    cfg = model.config
    name = next(n for n, c in CONFIGS.items() if c["num_hidden_layers"] == cfg.num_hidden_layers)
    spec = {**COMMON, **CONFIGS[name]}
    shared = [i for i in range(cfg.num_hidden_layers) if hf.model.layers[i].self_attn.is_kv_shared_layer]
    assert [g is None for g in model.kv_geometry] == [i in shared for i in range(cfg.num_hidden_layers)]
    assert model.kv_layer_types == cfg.layer_types
    for i, layer in enumerate(model.layers):
        a, lt = layer.self_attn, cfg.layer_types[i]
        assert a.sliding_window == (cfg.sliding_window if lt == S else None)
        o = model.kv_owner[i]
        assert cfg.layer_types[o] == lt and (o == i) == (i not in shared)
        if i not in shared:
            hd = spec["global_head_dim"] if lt == F else spec["head_dim"]
            k_eq_v = lt == F and cfg.attention_k_eq_v
            kvh = spec["num_global_key_value_heads" if k_eq_v else "num_key_value_heads"]
            assert model.kv_geometry[i] == (kvh, hd)
    if shared:  # E2B-like: sliding shared layers read layer 5, the full one layer 4 (HF "store" layers)
        assert [model.kv_owner[i] for i in shared] == [5, 5, 5, 4]
        assert [i for i, m in enumerate(cfg.kv_sharing_modes) if m == "store"] == [4, 5]
    pool = Pool(model)
    for i, layer in enumerate(model.layers):
        assert layer.self_attn.k_cache is pool.caches[model.kv_owner[i]][0]
        assert layer.self_attn.v_cache is pool.caches[model.kv_owner[i]][1]
    bad = list(pool.caches)
    bad[0] = None
    with pytest.raises(ValueError, match="layer 0 needs a cache"):
        model.bind_kv_cache(bad)
    with pytest.raises(ValueError, match="entries"):
        model.bind_kv_cache(pool.caches[:-1])
    if shared:
        bad = list(pool.caches)
        bad[shared[0]] = pool.caches[0]
        with pytest.raises(ValueError, match=f"layer {shared[0]} needs no cache"):
            model.bind_kv_cache(bad)


def test_logits_parity_prefill_extend_decode(pair):
    """Mixed-length prefill, a second prefill chunk over a cached prefix, then paged decode of them all."""
    hf, model = pair
    g = torch.Generator().manual_seed(1)
    lens, steps = (5, 13, 22), 7
    seqs = [torch.randint(3, 256, (n + steps,), generator=g).tolist() for n in lens]
    prompts = [s[:n] for s, n in zip(seqs, lens)]
    pool = Pool(model)
    # batch 1: request 0 and 1 whole, the first 9 tokens of request 2; batch 2: the rest of request 2
    out = _prefill(model, pool, prompts, [(0, 0, 5), (1, 0, 13), (2, 0, 9)])
    out = list(out[:2]) + [torch.cat([out[2], _prefill(model, pool, prompts, [(2, 9, 22)])[0]])]
    ref = [_hf_logits(hf, s) for s in seqs]
    for r in range(3):
        _close(out[r], ref[r][: lens[r]], f"prefill request {r}")
    for step in range(steps):
        cur = [s[: n + step + 1] for s, n in zip(seqs, lens)]
        logits = _decode(model, pool, cur, [0, 1, 2])
        for r in range(3):
            _close(logits[r], ref[r][lens[r] + step], f"decode step {step} request {r}")


def _greedy(model, prompts, max_new):
    pool, seqs = Pool(model, seed=3), [list(p) for p in prompts]
    logits = _prefill(model, pool, seqs, [(r, 0, len(p)) for r, p in enumerate(prompts)])
    for r, lg in enumerate(logits):
        seqs[r].append(int(lg[-1].argmax()))
    for _ in range(max_new - 1):
        for r, t in enumerate(_decode(model, pool, seqs, list(range(len(seqs)))).argmax(-1).tolist()):
            seqs[r].append(t)
    return [s[len(p) :] for s, p in zip(seqs, prompts)]


def test_greedy_matches_hf_generate(pair):
    hf, model = pair
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 11, 18)]
    got = _greedy(model, prompts, 12)
    for p, toks in zip(prompts, got):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p) :].tolist()
        assert toks == want


def test_conditional_generation_checkpoint_loads(tmp_path, caplog):
    """A ``Gemma4ForConditionalGeneration`` dir (text weights under model.language_model., a tiny vision
    tower) loads through load_config + target_class; the tower is skipped with one info line; logits match."""
    vision = Gemma4VisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        patch_size=4,
        position_embedding_size=16,
    )
    cfg = Gemma4Config(text_config=_text_config("e2b").to_dict(), vision_config=vision.to_dict())
    torch.manual_seed(0)
    hf = Gemma4ForConditionalGeneration(cfg).float().eval()
    randomize(hf, seed=7)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    names = [n for n, _ in iter_safetensors(tmp_path)]
    assert any(n.startswith("model.language_model.layers.") for n in names)
    assert any(n.startswith("model.vision_tower.") for n in names)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gemma4"
    cls, tc = target_class(load_config(tmp_path))
    assert cls is g4.Gemma4ForCausalLM and tc.model_type == "gemma4_text"
    with torch.device("meta"):
        model = cls(tc, MAX_POS)
    model.to_empty(device="cpu")
    with caplog.at_level(logging.INFO, logger="nanospec.loader"):
        load_weights(model, iter_safetensors(tmp_path), skip=("lm_head.",) if model.tied else ())
    tower = [n for n in names if n.startswith(("model.vision_tower.", "model.embed_vision."))]
    assert [r.getMessage() for r in caplog.records] == [
        f"Gemma4ForCausalLM: skipped {len(tower)} checkpoint tensors it does not use, e.g. {tower[0]!r}"
    ]
    model.eval().requires_grad_(False).init_buffers("cpu")
    seq = torch.randint(3, 256, (15,), generator=torch.Generator().manual_seed(4)).tolist()
    pool = Pool(model)
    got = _prefill(model, pool, [seq], [(0, 0, 15)])[0]
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([seq])).logits[0]
    _close(got, want, "Gemma4ForConditionalGeneration text logits")


def test_shared_layer_kv_weights_in_checkpoint_are_skipped(pair):
    """K/V weights of a KV-shared layer in a checkpoint (HF ignores them) are skipped; a v_proj for a k_eq_v
    layer, which has none, is an error."""
    hf, model = pair
    last = len(model.layers) - 1
    extra = [(f"model.layers.{last}.self_attn.{n}.weight", torch.zeros(8, 64)) for n in ("k_proj", "v_proj")]
    tensors = list(hf.state_dict().items()) + extra
    if model.kv_geometry[last] is None:
        load_weights(model, tensors, skip=("lm_head.",))
    else:
        with pytest.raises(ValueError, match=f"layers.{last}.self_attn.k_proj.weight' has shape"):
            load_weights(model, tensors, skip=("lm_head.",))
        with pytest.raises(ValueError, match=f"layers.{last}.self_attn.v_proj.weight' matches no param"):
            load_weights(model, tensors[:-2] + extra[1:], skip=("lm_head.",))


def _write_config(tmp_path, model_type="gemma4_text", **kw):
    cfg = {**COMMON, **CONFIGS["31b"], "model_type": model_type, **kw}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("layer_types", [S] * 5 + ["chunked_attention", S, F], r"layer_types\[5\] = 'chunked_attention'"),
        ("sliding_window", 0, "sliding_window must be an int >= 1, got 0"),
        ("top_k_experts", 9, r"top_k_experts must be in \[1, num_experts=8\], got 9"),
        ("top_k_experts", 0, r"top_k_experts must be in \[1, num_experts=8\], got 0"),
        ("num_experts", None, r"num_experts must be an int >= 1 \(enable_moe_block\), got None"),
        ("moe_intermediate_size", 0, r"moe_intermediate_size must be an int >= 1 \(enable_moe_block\)"),
        ("num_kv_shared_layers", 8, r"num_kv_shared_layers must be in \[0, num_hidden_layers=8\)"),
        ("hidden_activation", "silu", "hidden_activation 'silu'"),
    ],
)
def test_bad_config_rejected_before_weights(tmp_path, field, value, match):
    """ValueError naming the field from target_class (config only: the dir holds no weights) and the model."""
    moe = dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=16)
    extra = moe if field in moe else {}
    cfg = load_config(_write_config(tmp_path, **{**extra, field: value}))
    with pytest.raises(ValueError, match=match):
        target_class(cfg)
    with pytest.raises(ValueError, match=match), torch.device("meta"):
        g4.Gemma4ForCausalLM(cfg, MAX_POS)


def test_kv_sharing_without_owner_rejected(tmp_path):
    types = [S, S, F, F]  # the last 2 layers shared: no non-shared full layer before them
    cfg = load_config(_write_config(tmp_path, num_hidden_layers=4, layer_types=types, num_kv_shared_layers=2))
    with pytest.raises(ValueError, match=r"num_kv_shared_layers = 2 leaves KV-shared layer 2 \(full_"):
        target_class(cfg)


def test_target_class_routing(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            dict(
                model_type="llama",
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                intermediate_size=64,
                vocab_size=128,
            )
        )
    )
    cls, cfg = target_class(load_config(tmp_path))
    assert cls is LlamaForCausalLM and cfg.model_type == "llama"
    with torch.device("meta"):
        m = cls(cfg, 16)
    assert (m.kv_geometry, m.kv_owner, m.embed_scale) == ([(1, 16)] * 2, [0, 1], 1.0)
    with pytest.raises(ValueError, match="model_type: 'gpt2' is not supported"):
        target_class(type("Cfg", (), {"model_type": "gpt2"})())


def test_triton_kernels_parity(pair, triton_backend):
    """The same model through the Triton kernels (the interpreter on CPU): prefill of two requests, one of
    them longer than the window, then two decode steps."""
    hf, model = pair
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, 256, (n + 2,), generator=g).tolist() for n in (3, 9)]
    pool = Pool(model, seed=6)
    out = _prefill(model, pool, [s[:-2] for s in seqs], [(0, 0, 3), (1, 0, 9)])
    ref = [_hf_logits(hf, s) for s in seqs]
    for r, n in enumerate((3, 9)):
        _close(out[r], ref[r][:n], f"triton prefill request {r}")
    for step in range(2):
        logits = _decode(model, pool, [s[: len(s) - 1 + step] for s in seqs], [0, 1])
        for r, n in enumerate((3, 9)):
            _close(logits[r], ref[r][n + step], f"triton decode step {step} request {r}")
