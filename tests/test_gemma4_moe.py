"""Gemma 4 MoE targets (26B-A4B-like, the tiny ``moe8x2`` config of test_gemma4) through the engine: a sharded
HF checkpoint loads and decodes as HF ``generate``; speculation with drafts that are really accepted (an
oracle drafter, chain and tree) is token-identical to spec off; ``load_format="dummy"``; decode on a padded
CUDA graph bucket through the Triton kernels; and bad input (missing expert tensors, a tensor_parallel_size
that does not split ``moe_intermediate_size``, ``deterministic=True``, ``top_k_experts`` > ``num_experts``)
refused before any weight loads. HF logit parity, the Triton path and spec on/off with random assistants run
in test_gemma4 / test_gemma4_spec (their ``moe8x2`` and ``moe16x4`` configs), tensor parallelism in
test_tp."""

import json
import multiprocessing

import pytest
import torch
import torch.distributed as dist
from conftest import randomize
from helpers import install_drafter
from safetensors.torch import load_file, save_file
from test_gemma4 import _text_config
from test_gemma4_spec import assistant_config
from test_spec_lossless import oracle_draft
from transformers import Gemma4AssistantForCausalLM, Gemma4ForCausalLM

from nanospec import LLM, SamplingParams, model_runner

S, F = "sliding_attention", "full_attention"

KW = dict(device="cpu", dtype="float32", page_size=4, max_model_len=64, adaptive_speculation=False)
SP = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def moe(tmp_path_factory, smollm2_tokenizer):
    """(HF model, its checkpoint dir in several safetensors shards, a random assistant dir, 3 prompts)."""
    torch.manual_seed(0)
    hf = Gemma4ForCausalLM(_text_config("moe8x2")).float().eval()
    randomize(hf, seed=6)
    tdir = tmp_path_factory.mktemp("moe")
    hf.save_pretrained(tdir, safe_serialization=True, max_shard_size="200KB")
    smollm2_tokenizer.save_pretrained(tdir)
    a = Gemma4AssistantForCausalLM(assistant_config("moe8x2")).float().eval()
    randomize(a, seed=7, std=0.3)
    adir = tmp_path_factory.mktemp("moe_assistant")
    a.save_pretrained(adir)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (4, 12, 19)]
    return hf, tdir, adir, prompts


def test_sharded_checkpoint_greedy_matches_hf(moe):
    hf, tdir, _, prompts = moe
    assert len(list(tdir.glob("*.safetensors"))) >= 3  # the expert tensors spread over several shards
    outs = LLM(str(tdir), **KW).generate(prompts, SP, use_tqdm=False)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p) :].tolist()
        assert o["token_ids"] == want


@pytest.mark.parametrize("steps,topk", [(3, 1), (2, 2)])  # a tree of N = 5 <= the window
def test_oracle_drafts_accepted_and_lossless(monkeypatch, moe, steps, topk):
    """Drafts that are mostly right (the spec-off continuation, wrong 1 time in 4): multi-token verify rows
    through the MoE layers, accepted and rejected, give exactly the spec-off tokens."""
    _, tdir, adir, prompts = moe
    reference = [o["token_ids"] for o in LLM(str(tdir), **KW).generate(prompts, SP, use_tqdm=False)]
    install_drafter(monkeypatch, oracle_draft(reference, prompts, topk, 4))
    spec = dict(num_steps=steps, topk=topk, num_draft_tokens=1 + steps * topk)
    outs = LLM(str(tdir), assistant=str(adir), **spec, **KW).generate(prompts, SP, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == reference
    acc = [a for o in outs for a in o["accept_lengths"]]
    assert max(acc) == steps + 1 and min(acc) < steps + 1 and sum(acc) / len(acc) > 1.8


def test_dummy_weights(moe):
    _, tdir, _, prompts = moe
    llm = LLM(str(tdir), load_format="dummy", **KW)
    layer = llm.runner.model.layers[0]
    assert layer.experts.gate_up_proj.shape == (8, 32, 64) and layer.experts.down_proj.shape == (8, 64, 16)
    assert layer.experts.gate_up_proj.std() > 0.01 and (layer.router.per_expert_scale == 1).all()
    outs = llm.generate(prompts, SP, use_tqdm=False)
    assert [len(o["token_ids"]) for o in outs] == [16] * 3


def _loads(monkeypatch):
    """Count the tensors the target's loader reads."""
    read, iterate = [], model_runner.loader.iter_safetensors

    def counted(d):
        for item in iterate(d):
            read.append(item[0])
            yield item

    monkeypatch.setattr(model_runner.loader, "iter_safetensors", counted)
    return read


def test_missing_expert_tensors_rejected_before_any_load(moe, tmp_path, monkeypatch):
    _, tdir, _, _ = moe
    for f in tdir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    name = "model.layers.3.experts.down_proj"
    shard = tmp_path / index["weight_map"][name]
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    read = _loads(monkeypatch)
    with pytest.raises(
        ValueError, match=r"checkpoint is missing weights for \['layers.3.experts.down_proj'\]"
    ):
        LLM(str(tmp_path), **KW)
    assert read == []


@pytest.mark.parametrize(
    "field,value,kw,match",
    [
        ("top_k_experts", 9, {}, r"top_k_experts must be in \[1, num_experts=8\], got 9"),
        (
            "moe_intermediate_size",
            10,
            dict(tensor_parallel_size=4),
            r"moe_intermediate_size = 10 \(allowed: \[1, 2\]",
        ),
        (
            None,
            None,
            dict(deterministic=True),
            r"deterministic=True does not cover MoE targets \(enable_moe_block",
        ),
    ],
)
def test_bad_moe_input_before_weights(moe, tmp_path, monkeypatch, field, value, kw, match):
    _, tdir, _, _ = moe
    for f in tdir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    if field is not None:
        cfg = json.loads((tdir / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps(cfg | {field: value}))
    read = _loads(monkeypatch)
    with pytest.raises(ValueError, match=match):
        LLM(str(tmp_path), **KW, **kw)
    assert read == [] and not dist.is_initialized() and not multiprocessing.active_children()


def test_graph_buckets_through_the_kernels(tmp_path, smollm2_tokenizer, triton_backend):
    """Decode on the padded static batch of a CUDA graph bucket (4 rows for 2 requests: padding tokens are
    routed too), through the Triton kernels (the interpreter, 2 layers of moe8x2): the torch path's tokens."""
    from test_cuda_graph import with_buckets

    from nanospec.kernels.backend import using_backend

    hf = Gemma4ForCausalLM(_text_config("moe8x2", num_hidden_layers=2, layer_types=[S, F])).float()
    randomize(hf, seed=8)
    hf.save_pretrained(tmp_path)
    smollm2_tokenizer.save_pretrained(tmp_path)
    prompts = [[5, 6, 7], [8, 9]]
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with using_backend("torch"):
        want = [o["token_ids"] for o in LLM(str(tmp_path), **KW).generate(prompts, sp, use_tqdm=False)]
    llm = LLM(str(tmp_path), **KW)
    with_buckets(llm, [4])
    assert [o["token_ids"] for o in llm.generate(prompts, sp, use_tqdm=False)] == want
