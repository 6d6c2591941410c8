"""CPU engine tuning (nanospec.cpu): the column-major GEMM weight layout and the default thread count."""

import os

import pytest
import torch
import torch.nn.functional as F

from nanospec import LLM, loader
from nanospec.cpu import default_cpu_threads, gemm_layout, use_cpu_gemm_layout


@pytest.mark.parametrize("shape", [(576, 576), (960, 576), (576, 1536), (49152, 576)])
@pytest.mark.parametrize("m", [1, 2, 6, 8, 48])
def test_column_major_linear_equals_f_linear(shape, m):
    g = torch.Generator().manual_seed(m)
    w = torch.randn(shape, generator=g) * 0.05
    x, b = torch.randn(m, shape[1], generator=g), torch.randn(shape[0], generator=g)
    wc = gemm_layout(w)
    assert wc.shape == w.shape and wc.stride() == (1, shape[0]) and torch.equal(wc, w)
    for bias in (None, b):
        want, got = F.linear(x, w, bias), F.linear(x, wc, bias)
        assert float((got - want).abs().max() / want.abs().max()) <= 1e-5


def test_gemm_layout_leaves_other_tensors_alone():
    for t in (torch.randn(8, 4, dtype=torch.bfloat16), torch.randn(8), torch.randn(2, 8, 4)):
        assert gemm_layout(t) is t
    wc = gemm_layout(torch.randn(8, 4))
    assert gemm_layout(wc) is wc


def test_engine_lays_out_target_weights_tied_head_included(tiny_llama_tied_dir):
    llm = LLM(str(tiny_llama_tied_dir), dtype="float32", device="cpu", max_model_len=64)
    model = llm.runner.model
    qkv = model.layers[0].self_attn.qkv_proj.weight
    assert qkv.stride() == (1, qkv.shape[0])
    head = model.lm_head_weight
    assert head is model.embed_tokens.weight and head.stride() == (1, head.shape[0])
    ids = torch.tensor([3, 17, 250])
    assert torch.equal(model.embed(ids), head.contiguous()[ids])  # the embedding reads the same values
    assert use_cpu_gemm_layout(model) == 0  # already laid out: nothing changes twice


def test_default_cpu_threads_only_overrides_the_default(monkeypatch):
    old = torch.get_num_threads()
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(loader, "THREADS_CHOSEN", False)  # as in a process where no script probed
    try:
        torch.set_num_threads(2)
        assert default_cpu_threads() == 1
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert default_cpu_threads() == 2  # the user's choice stands
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setattr(os, "cpu_count", lambda: 8)
        assert default_cpu_threads() == 2  # more cores: untouched
        monkeypatch.setattr(os, "cpu_count", lambda: 2)
        monkeypatch.setattr(loader, "THREADS_CHOSEN", True)
        assert default_cpu_threads() == 2  # a script's start-up probe already chose: it stands
    finally:
        torch.set_num_threads(old)


def test_num_steps_default_per_device():
    """On CPU the default chain is 1 draft step (longer chains measured slower than plain decoding there); a
    given num_steps always wins."""
    from nanospec.config import EngineConfig

    cpu = EngineConfig(assistant="default", device="cpu")
    assert (cpu.num_steps, cpu.topk, cpu.num_draft_tokens) == (1, 1, 2)
    assert EngineConfig(assistant="default", device="cpu", num_steps=5).num_draft_tokens == 6
