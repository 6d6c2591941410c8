"""Frozen-KV MTP on Gemma 4 targets through the engine: spec on == spec off == HF greedy (chain and tree,
dense and centroid heads), and == HF's own assisted generation (``generate(assistant_model=...)``), for the
E2B-like (KV sharing, PLE), 31B-like (k_eq_v) and MoE tiny configs of test_gemma4."""

import pytest
import torch
from conftest import randomize
from test_gemma4 import COMMON, CONFIGS, _text_config
from transformers import (
    Gemma4AssistantConfig,
    Gemma4AssistantForCausalLM,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
)

from nanospec import LLM, SamplingParams

S, F = "sliding_attention", "full_attention"


def assistant_config(name, centroids=False):
    """A 3-layer (sliding, sliding, full) assistant whose q geometry, RoPE and window fit target ``name``."""
    t = {**COMMON, **CONFIGS[name]}
    heads = 4  # a multiple of every target's KV heads
    text = Gemma4TextConfig(
        **{
            **COMMON,
            "hidden_size": 32,
            "num_hidden_layers": 3,
            "layer_types": [S, S, F],
            "num_attention_heads": heads,
            "num_key_value_heads": t["num_key_value_heads"],
            "intermediate_size": 64,
            "sliding_window": t["sliding_window"],
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0,
            "num_kv_shared_layers": 0,
            **{k: t[k] for k in ("num_global_key_value_heads", "attention_k_eq_v") if k in t},
        }
    )
    extra = (
        dict(use_ordered_embeddings=True, num_centroids=16, centroid_intermediate_top_k=4)
        if centroids
        else {}
    )
    return Gemma4AssistantConfig(text_config=text, backbone_hidden_size=t["hidden_size"], **extra)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def world(request, tmp_path_factory, smollm2_tokenizer):
    name = request.param
    torch.manual_seed(0)
    hf = Gemma4ForCausalLM(_text_config(name)).float().eval()
    randomize(hf, seed=len(name))
    tdir = tmp_path_factory.mktemp(f"g4spec_{name}")
    hf.save_pretrained(tdir, safe_serialization=True)
    smollm2_tokenizer.save_pretrained(tdir)
    assistants = {}
    for centroids in (False, True):
        a = Gemma4AssistantForCausalLM(assistant_config(name, centroids)).float().eval()
        randomize(a, seed=7, std=0.3)
        if centroids:  # a real permutation, so the cluster reordering matters
            perm = torch.randperm(a.config.text_config.vocab_size, generator=torch.Generator().manual_seed(3))
            a.masked_embedding.token_ordering.copy_(perm)
        adir = tmp_path_factory.mktemp(f"g4asst_{name}_{centroids}")
        a.save_pretrained(adir)
        assistants[centroids] = (a, adir)
    return name, hf, tdir, assistants


def prompts():
    g = torch.Generator().manual_seed(9)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (4, 12, 19)]


@pytest.mark.parametrize("centroids", [False, True])
@pytest.mark.parametrize("tree", [False, True])
def test_spec_on_equals_off_equals_hf(world, centroids, tree):
    name, hf, tdir, assistants = world
    spec = {"num_steps": 3, "topk": 2, "num_draft_tokens": 5} if tree else {"num_steps": 3}
    kw = dict(device="cpu", dtype="float32", page_size=4, max_model_len=64)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    off = LLM(str(tdir), **kw).generate(prompts(), sp, use_tqdm=False)
    llm = LLM(str(tdir), assistant=str(assistants[centroids][1]), **spec, **kw)
    on = llm.generate(prompts(), sp, use_tqdm=False)
    assert [o["token_ids"] for o in on] == [o["token_ids"] for o in off]
    for p, o in zip(prompts(), off):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p) :].tolist()
        assert o["token_ids"] == want
    assert all(len(o["accept_lengths"]) >= 1 for o in on)
    assert llm.runner.allocator.num_free == llm.runner.allocator.num_usable


def test_equals_hf_assisted_generation(world):
    name, hf, tdir, assistants = world
    hf_a, adir = assistants[False]
    hf_a.generation_config.num_assistant_tokens = 3
    hf_a.generation_config.num_assistant_tokens_schedule = "constant"
    llm = LLM(
        str(tdir),
        assistant=str(adir),
        num_steps=3,
        device="cpu",
        dtype="float32",
        page_size=4,
        max_model_len=64,
    )
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for p, o in zip(prompts(), llm.generate(prompts(), sp, use_tqdm=False)):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), assistant_model=hf_a, max_new_tokens=10, do_sample=False)
        assert o["token_ids"] == want[0, len(p) :].tolist()
