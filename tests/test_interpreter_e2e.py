"""The whole engine with every kernel through Triton (the CPU interpreter) equals the torch-reference run."""

import pytest

from nanospec import LLM, SamplingParams
from nanospec.kernels import activation, attention, norm, rope, sampling

# ids < 512 (micro vocab)
PROMPTS = [[1, 17, 400, 23, 99, 5, 311], [2, 250, 8, 41, 73, 120, 9, 64, 300, 12, 7]]
PARAMS = [
    SamplingParams(max_tokens=4, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.9, max_tokens=4, ignore_eos=True, seed=3),
]


def _run(model_dir):
    # the 11-token prompt is chunked: extend attention over a paged prefix
    llm = LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        page_size=4,
        max_model_len=24,
        max_num_seqs=2,
        max_num_batched_tokens=8,
    )
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    a = llm.runner.allocator
    assert a.num_free == a.num_usable
    return [o["token_ids"] for o in outs]


@pytest.fixture(scope="module")
def torch_tokens(micro_llama_dir):
    return _run(micro_llama_dir)


def test_interpreter_end_to_end_equals_torch(micro_llama_dir, torch_tokens, triton_backend, monkeypatch):
    calls = {}
    for mod, name in (
        (norm, "rms_norm_triton"),
        (rope, "rope_store_kv_triton"),
        (activation, "silu_and_mul_triton"),
        (attention, "extend_attention_triton"),
        (attention, "decode_attention_triton"),
        (sampling, "sample_triton"),
    ):
        fn = getattr(mod, name)
        monkeypatch.setattr(
            mod,
            name,
            lambda *a, _fn=fn, _n=name, **k: (calls.__setitem__(_n, calls.get(_n, 0) + 1), _fn(*a, **k))[1],
        )
    for mod, name in (
        (norm, "rms_norm_ref"),
        (rope, "rope_store_kv_ref"),
        (activation, "silu_and_mul_ref"),
        (attention, "extend_attention_ref"),
        (attention, "decode_attention_ref"),
        (sampling, "sample_ref"),
    ):
        monkeypatch.setattr(
            mod, name, lambda *a, _n=name, **k: pytest.fail(f"{_n} ran under the triton backend")
        )
    got = _run(micro_llama_dir)
    assert got == torch_tokens
    assert all(len(t) == 4 for t in got)
    assert set(calls) == {
        "rms_norm_triton",
        "rope_store_kv_triton",
        "silu_and_mul_triton",
        "extend_attention_triton",
        "decode_attention_triton",
        "sample_triton",
    }, calls
