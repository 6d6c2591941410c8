"""Plain helpers shared by the speculative-engine tests (their fixtures live in conftest.py)."""

from nanospec import LLM, SamplingParams

HB = 64  # hidden size of conftest's tiny Llama target
REF_LEN = 48
P_DISTINCT = [100, 200, 300, 400, 500, 600, 700]  # its greedy continuation has no repeated token early on
PROMPTS = [[11, 22, 33], P_DISTINCT, list(range(1000, 1017)), list(range(5000, 5030))]  # 3, 7, 17, 30 tokens


def make_llm(model_dir, assistant=None, **kw):
    base = dict(device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=128, page_size=16)
    if assistant is not None:
        base["assistant"] = str(assistant)
    return LLM(str(model_dir), **{**base, **kw})


def greedy(max_tokens=REF_LEN, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)
