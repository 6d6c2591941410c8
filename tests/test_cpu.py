"""CPU engine tuning: the fp32 GEMM of a few rows (kernels.matmul.linear) and the default thread count
(nanospec.cpu)."""

import os

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig

from nanospec import parallel
from nanospec.cpu import default_cpu_threads
from nanospec.kernels import matmul
from nanospec.tools.cli import configure_cpu_threads


@pytest.mark.parametrize("shape", [(576, 576), (960, 576), (576, 1536), (49152, 576)])
@pytest.mark.parametrize("m", [1, 2, 3, 6, 7, 48])
def test_cpu_linear_equals_f_linear(shape, m):
    g = torch.Generator().manual_seed(m)
    w = torch.randn(shape, generator=g) * 0.05
    x, b = torch.randn(m, shape[1], generator=g), torch.randn(shape[0], generator=g)
    for bias in (None, b):
        want, got = F.linear(x, w, bias), matmul.linear(x, w, bias)
        assert got.shape == want.shape and got.is_contiguous()
        assert float((got - want).abs().max() / want.abs().max()) <= 1e-5


def test_cpu_linear_takes_the_transposed_product_for_a_few_fp32_rows():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    x = torch.randn(2, 3, 24, generator=g)  # 6 rows in a [B, N, K] batch: the most that take it
    rows = x.reshape(6, 24)
    assert torch.equal(matmul.linear(x, w, b), ((w @ rows.t()).t() + b).view(2, 3, 40))
    one = rows[:1]  # odd counts repeat the last row: the product of an even count
    assert torch.equal(matmul.linear(one, w), (w @ torch.cat([one, one]).t()).t()[:1])
    assert torch.equal(
        parallel.linear(rows[:3], w), matmul.linear(rows[:3], w)
    )  # the engine's GEMM goes here
    more = torch.randn(7, 24, generator=g)
    assert torch.equal(matmul.linear(more, w, b), F.linear(more, w, b))  # 7 rows and more: F.linear itself
    for t in (rows.bfloat16(), rows.double()):  # other dtypes: F.linear itself
        assert torch.equal(matmul.linear(t, w.to(t.dtype)), F.linear(t, w.to(t.dtype)))
    empty = torch.zeros(0, 24)
    assert matmul.linear(empty, w).shape == (0, 40)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN (torch.backends.mkldnn)")
def test_cpu_linear_takes_the_onednn_weight_from_3_rows():
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    other = torch.randn(40, 24, generator=g)
    onednn = matmul.to_onednn(other)  # another weight's copy: the result shows which path ran
    for m in (1, 2, 3, 8, 48):
        x = torch.randn(m, 24, generator=g)
        got = matmul.linear(x, w, b, onednn_weight=onednn)
        want = F.linear(x, other if m > 2 else w, b)
        assert got.shape == (m, 40)
        assert float((got - want).abs().max() / want.abs().max()) <= 1e-5
    batched = torch.randn(2, 4, 24, generator=g)  # [B, N, K] rows keep their shape
    assert torch.allclose(
        matmul.linear(batched, w, b, matmul.to_onednn(w)), F.linear(batched, w, b), atol=1e-5
    )
    assert matmul.to_onednn(w.bfloat16()) is None  # fp32 only
    assert matmul.to_onednn(w.double()) is None


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN (torch.backends.mkldnn)")
def test_model_runner_uses_onednn_weights_on_a_cpu_in_fp32_outside_deterministic_mode(tiny_llama_dir):
    from nanospec.config import EngineConfig
    from nanospec.model_runner import ModelRunner
    from nanospec.parallel import Linear

    for deterministic in (False, True):
        config = EngineConfig(str(tiny_llama_dir), device="cpu", deterministic=deterministic)
        runner = ModelRunner(config, AutoConfig.from_pretrained(tiny_llama_dir), tiny_llama_dir)
        head = runner.model.lm_head  # untied: its product is the model's own gemm over lm_head_weight
        linears = [m for m in runner.model.modules() if isinstance(m, Linear) and m is not head]
        assert linears
        for module in linears + [runner.model]:
            onednn = getattr(module.gemm, "keywords", {}).get("onednn_weight")
            assert (onednn is not None) == (not deterministic)
        ids = torch.tensor([1, 2, 3, 4])
        x = runner.model.embed(ids)
        for module in linears:  # the oneDNN product equals the plain one
            if module.in_features == x.shape[-1]:
                assert torch.allclose(module(x), F.linear(x, module.weight, module.bias), atol=1e-5)


def test_default_cpu_threads_only_overrides_the_default(monkeypatch):
    old = torch.get_num_threads()
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
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
        torch.set_num_threads(2)
        assert configure_cpu_threads(lambda threads, limit_s: 1.0 / threads) == 2  # the probe keeps 2
        assert default_cpu_threads() == 2  # a tool's start-up probe already chose: it stands
    finally:
        torch.set_num_threads(old)


def test_num_steps_default_per_device():
    """On CPU the default chain is at most 3 draft steps (chosen when a verify of over 4 rows cost twice a
    decode row there); a given num_steps always wins."""
    from nanospec.config import EngineConfig

    cpu = EngineConfig(assistant="default", device="cpu")
    assert (cpu.num_steps, cpu.topk, cpu.num_draft_tokens) == (3, 1, 4)
    assert EngineConfig(assistant="default", device="cpu", num_steps=5).num_draft_tokens == 6
