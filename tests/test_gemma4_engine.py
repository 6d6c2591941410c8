"""Gemma 4 targets through the whole engine (``LLM(dir)``): greedy tokens equal HF ``generate`` for the
E2B-like, 31B-like and MoE tiny configs of test_gemma4 (sliding windows shorter than the prompts, page_size 4,
chunked prefill, a batch of mixed lengths), and KV pools only for the KV-owning layers."""

import pytest
import torch
from conftest import randomize
from test_gemma4 import CONFIGS, _text_config
from transformers import Gemma4ForCausalLM

from nanospec import LLM, SamplingParams


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def gemma_dir(request, tmp_path_factory, smollm2_tokenizer):
    cfg = _text_config(request.param)
    torch.manual_seed(0)
    hf = Gemma4ForCausalLM(cfg).float().eval()
    randomize(hf, seed=len(request.param))
    path = tmp_path_factory.mktemp(f"gemma4_{request.param}")
    hf.save_pretrained(path, safe_serialization=True)
    smollm2_tokenizer.save_pretrained(path)
    return path, hf


def test_engine_greedy_matches_hf_generate(gemma_dir):
    path, hf = gemma_dir
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (4, 13, 21)]
    llm = LLM(
        str(path), device="cpu", dtype="float32", page_size=4, max_model_len=64, max_num_batched_tokens=16
    )
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False)[0, len(p) :].tolist()
        assert o["token_ids"] == want
    model = llm.runner.model
    owners = sum(g is not None for g in model.kv_geometry)
    assert sum(pool.shape[0] for pool in llm.runner.kv_pools) == owners == len(set(model.kv_owner))
    assert owners == len(model.layers) - model.config.num_kv_shared_layers  # shared layers own no cache
    shapes = {tuple(p.shape[-2:]) for p in llm.runner.kv_pools}
    assert shapes == {g for g in model.kv_geometry if g is not None}  # one pool per KV geometry
    a = llm.runner.allocator
    assert a.num_free == a.num_usable
