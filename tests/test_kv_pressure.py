"""The real engine under KV pressure (DESIGN §4 rule 10): the default model with the shipped assistant, pools
at and just above the smallest the engine accepts. Every ``generate`` returns, greedy outputs equal the same
prompts run alone with a roomy pool, the pool is empty afterwards, and preemption and accepted drafts really
happen (spec off, chain and tree; overlap on and off)."""

import pathlib
import random
import subprocess
import sys

import pytest

from nanospec import LLM, SamplingParams
from nanospec.config import EngineConfig
from nanospec.kv_cache import cdiv

MAX_MODEL_LEN = 16
MODES = {
    "off": {},
    "chain": dict(assistant="default", num_steps=3, adaptive_speculation=False),
    "tree": dict(assistant="default", num_steps=2, topk=2, num_draft_tokens=4, adaptive_speculation=False),
}


def _prompts() -> list[list[int]]:
    """Token-id prompts of 1-12 tokens, several sharing prefixes (prefix caching has blocks to share)."""
    rng = random.Random(0)
    shared = [rng.randrange(100, 20000) for _ in range(8)]
    out = []
    for i in range(12):
        n = rng.randint(1, 12)
        head = shared[: rng.randint(0, 8)] if i % 2 else []
        out.append((head + [rng.randrange(100, 20000) for _ in range(n)])[:n])
    return out


PROMPTS = _prompts()


class Alone(dict):
    """Prompt index -> that prompt alone with a roomy pool, to its longest length: the greedy reference (run
    on first use, so only the prompts some pool picks are run)."""

    def __init__(self):
        super().__init__()
        self.llm = LLM(max_model_len=19)  # test_issue_configuration_finishes' longest request too

    def __missing__(self, i):
        params = SamplingParams(temperature=0.0, max_tokens=MAX_MODEL_LEN - len(PROMPTS[i]), ignore_eos=True)
        self[i] = self.llm.generate([PROMPTS[i]], params, use_tqdm=False)[0]["token_ids"]
        return self[i]


@pytest.fixture(scope="module")
def alone():
    return Alone()


def _smallest_pool(options: dict) -> int:
    """The fewest blocks the engine accepts: one request of max_model_len plus one lookahead, and block 0."""
    config = EngineConfig.from_kwargs(None, dict(options))
    lookahead = config.num_draft_tokens if config.speculative else 1
    return cdiv(config.max_model_len + lookahead, config.page_size) + 1


def _run(options: dict, picks: list[tuple[int, int]], alone: Alone) -> tuple[LLM, list[dict]]:
    llm = LLM(**options)
    prompts = [PROMPTS[i] for i, _ in picks]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in picks]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for (i, m), out in zip(picks, outs):
        assert out["token_ids"] == alone[i][:m], (options, picks)
    stats = llm.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0
    assert stats["num_draft_inputs"] == 0 and not llm.has_unfinished()
    return llm, outs


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("mode", list(MODES))
def test_tiny_pools_finish_with_the_outputs_of_a_roomy_pool(alone, mode, overlap):
    """3 random tiny pools per mode and overlap setting (18 in all): page sizes 1-16, 1-4 running requests,
    prefill budgets of 1-8 tokens (chunked prompts), prefix caching on and off; the last one 4 requests on the
    smallest pool. The scheduler alone on thousands of random pools: tests/test_scheduler_progress.py."""
    rng = random.Random(f"{mode}-{overlap}")
    preemptions = 0
    accepted = 0
    for k in range(3):
        options = dict(MODES[mode], overlap_schedule=overlap, max_model_len=MAX_MODEL_LEN)
        options |= dict(page_size=rng.choice([1, 2, 4, 8, 16]), max_num_seqs=rng.randint(1, 4))
        options |= dict(max_num_batched_tokens=rng.randint(1, 8), enable_prefix_caching=rng.random() < 0.5)
        options["num_kv_blocks"] = _smallest_pool(options) + rng.choice([0, 0, 1, 2])
        if k == 2:  # the last pool the tightest: 4 running requests on the smallest pool
            options |= dict(max_num_seqs=4, num_kv_blocks=_smallest_pool(options))
        picks = []
        for i in rng.sample(range(len(PROMPTS)), rng.randint(3, 5)):
            picks.append((i, rng.randint(1, MAX_MODEL_LEN - len(PROMPTS[i]))))
        llm, outs = _run(options, picks, alone)
        preemptions += llm.scheduler.num_preemptions
        accepted += sum(a - 1 for out in outs for a in out.get("accept_lengths", []))
    assert preemptions > 0, "no pool was under pressure"
    assert accepted > 0 or mode == "off", "no draft was accepted"


def test_issue_configuration_finishes(alone):
    """Five requests that once preempted each other forever on this pool (7 blocks of 4 tokens)."""
    prompts = [[21, 40, 27, 45, 26, 43, 6, 12, 19], [7] * 6 + [26, 43, 1], [7] * 6 + [16], [7, 7, 18, 41]]
    prompts.append([7, 27, 15, 10, 17])
    max_tokens = [10, 1, 6, 12, 10]
    options = dict(page_size=4, num_kv_blocks=7, max_num_seqs=4, max_num_batched_tokens=5, max_model_len=19)
    options |= dict(enable_prefix_caching=True, assistant="default", num_steps=3, adaptive_speculation=False)
    llm = LLM(**options)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0
    for p, m, out in zip(prompts, max_tokens, outs):
        ref = alone.llm.generate(
            [p], SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True), use_tqdm=False
        )
        assert out["token_ids"] == ref[0]["token_ids"]
    assert llm.stats()["kv_cache_usage"] == 0


def test_kv_pressure_script_finishes():
    """docs/benchmarks.md's figure: scripts/kv_pressure.py (no assistant, the quick one) finishes every
    request with the outputs of a roomy pool."""
    script = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "kv_pressure.py"
    out = subprocess.run(
        [sys.executable, str(script), "--num-steps", "0"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert "finished 8 / 8" in out.stdout and "roomy pool: True" in out.stdout
