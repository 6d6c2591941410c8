"""The GPU memory plan, without a GPU: the arithmetic the engine runs on CUDA before it sizes the KV cache
(``memory.memory_plan``) and ``scripts/memory_plan.py``, which prints it for a model and a GPU size."""

import pathlib
import sys
from types import SimpleNamespace

import pytest
from conftest import save_assistant
from helpers import make_llm
from transformers import AutoConfig

from nanospec import memory
from nanospec.memory import memory_plan

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
import memory_plan as script  # noqa: E402

GIB = 2**30


def test_kv_budget_leaves_room_for_the_largest_verify():
    """A simulated 80 GiB GPU, Gemma 4's vocabulary (262,144), 256 sequences, 6 tree nodes, bf16: the KV cache
    gets what is left after the weights, the eager activations (at least the max-batch verify's logits, the
    LM head's bf16 output and its fp32 copy) and, with graphs, their pool; without graphs, no pool."""
    logits = 256 * 6 * 262144 * (2 + 4)
    config = SimpleNamespace(gpu_memory_utilization=0.9, enforce_eager=False)
    plan = memory_plan(80 * GIB, 10 * GIB, GIB // 4, logits, config)
    assert plan["activations"] == plan["graph_pool"] == logits
    assert plan["kv_cache"] + 10 * GIB + 2 * logits == int(80 * GIB * 0.9)
    eager = SimpleNamespace(gpu_memory_utilization=0.9, enforce_eager=True)
    eager = memory_plan(80 * GIB, 10 * GIB, 3 * GIB, logits, eager)
    assert eager["graph_pool"] == 0 and eager["activations"] == 3 * GIB  # a larger prefill peak wins
    assert eager["kv_cache"] == int(80 * GIB * 0.9) - 13 * GIB


def test_gemma4_e2b_at_the_defaults_keeps_graphs_small(capsys):
    """``python scripts/memory_plan.py --shape gemma4-e2b --max-num-seqs 256 --num-steps 5
    --gpu-memory-gib 80``: the graphs' pool and static buffers take at most 2.5 GiB, the plan fits and says
    how many tokens the KV cache holds."""
    argv = "--shape gemma4-e2b --max-num-seqs 256 --num-steps 5 --gpu-memory-gib 80".split()
    assert script.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("memory plan: gemma4-e2b (bfloat16), 256 sequences") and out.rstrip().endswith(
        "fits"
    )
    plan = script.plan(script.parse_args(argv))
    assert plan["graph_pool"] + plan["static_buffers"] <= 2.5 * GIB
    assert plan["step_logits"] == 256 * 6 * 262144 * 6 and plan["kv_tokens"] >= plan["kv_tokens_needed"]


def test_smollm2_plan_and_one_that_does_not_fit(smollm2_dir, capsys):
    """The default model with its shipped assistant fits an 80 GiB GPU; on 1 GiB a 4,096-token request does
    not (exit 1, saying what one request needs, in whole pages); options the engine refuses are refused."""
    assert script.main([]) == 0
    assert script.main(["--gpu-memory-gib", "1"]) == 1
    assert "does not fit: one request of max_model_len needs 4112 tokens" in capsys.readouterr().out
    for bad in (
        ["--max-num-seqs", "0"],
        ["--topk", "2"],
        ["--num-draft-tokens", "-5"],
        ["--runtime-gib", "-1"],
    ):
        with pytest.raises(SystemExit):  # the engine's own checks (EngineConfig), as argparse errors
            script.main(bad)


@pytest.mark.parametrize("assistant", [False, True])
def test_profile_runs_the_largest_steps(tiny_llama_dir, tmp_path, assistant):
    """Before sizing the KV cache on CUDA the runner runs the largest steps over a scratch pool (run here on
    the CPU, where nothing reads the peak): a prefill of the largest chunk (logits of its last row), then
    ``max_num_seqs`` requests of ``num_draft_tokens`` tokens (1 without an assistant) through the target, all
    their logits, and a token sampled at every row."""
    kw = dict(max_num_seqs=7, max_num_batched_tokens=40)
    if assistant:
        kw |= dict(
            assistant=save_assistant(tmp_path, AutoConfig.from_pretrained(tiny_llama_dir)), num_steps=3
        )
    runner = make_llm(tiny_llama_dir, **kw).runner
    N = 4 if assistant else 1
    forwards = []
    logits_rows = []
    sampled = []
    model = runner.model
    forward = model.forward
    compute_logits = model.compute_logits
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model, "forward", lambda ids, pos: forwards.append(len(ids)) or forward(ids, pos))
        mp.setattr(model, "compute_logits", lambda h: logits_rows.append(len(h)) or compute_logits(h))
        sample = memory.sample
        mp.setattr(memory, "sample", lambda logits, *a: sampled.append(len(logits)) or sample(logits, *a))
        memory.profile_peak(runner)
    assert forwards == [40, 7 * N] and logits_rows == [1, 7 * N] and sampled == [7 * N]
    assert sum(pool.numel() for pool in runner.kv_pools) == 0  # the scratch pool is gone
