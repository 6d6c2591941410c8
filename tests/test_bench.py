"""bench.py (nanospec.tools.bench) on CPU: output format and figures of tiny random-weight runs, nano-vllm's
workload, acceptance stats."""

import json
import random
import re

import pytest

from nanospec.tools import bench

TOTAL_LINE = re.compile(r"^Total: (\d+)tok, Time: (\d+\.\d\d)s, Throughput: (\d+\.\d\d)tok/s$")
TINY = [
    "--shape",
    "smollm2-135m",
    "--num-seqs",
    "2",
    "--max-input-len",
    "16",
    "--max-output-len",
    "4",
    "--device",
    "cpu",
    "--max-model-len",
    "64",
    "--max-num-seqs",
    "4",
]


@pytest.fixture
def two_layers(monkeypatch):
    """The smollm2-135m shape cut to 2 layers: the same code path, ~10x less CPU time."""
    orig = bench.write_shape_dir

    def write(shape, out):
        orig(shape, out)
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 2}))
        return out

    monkeypatch.setattr(bench, "write_shape_dir", write)


def run_bench(capsys, monkeypatch, argv):
    """Run bench.main in-process; returns its JSON figures, stdout lines and the timed generate() outputs."""
    calls, generate = [], bench.LLM.generate
    monkeypatch.setattr(
        bench.LLM, "generate", lambda self, *a, **k: calls.append(generate(self, *a, **k)) or calls[-1]
    )
    res = bench.main(argv)
    lines = capsys.readouterr().out.strip().splitlines()
    m = TOTAL_LINE.match(lines[0])
    assert m, lines[0]
    assert json.loads(lines[-1]) == res and not any(
        line.startswith("{") for line in lines[:-1]
    )  # one JSON line
    assert (m[1], m[2], m[3]) == (
        str(res["total_tokens"]),
        f"{res['time_s']:.2f}",
        f"{res['throughput_tok_s']:.2f}",
    )
    outputs = [o for c in calls[1:] for o in c]  # calls[0] is the warmup
    assert res["total_tokens"] == sum(len(o["token_ids"]) for o in outputs)
    assert res["throughput_tok_s"] == pytest.approx(res["total_tokens"] / res["time_s"])
    return res, lines, outputs


def test_nanovllm_workload_reproduces_nano_vllm():
    random.seed(0)  # nano-vllm's bench.py: all prompts (length, then its ids), then all max_tokens
    expected = []
    for _ in range(256):
        n = random.randint(100, 1024)
        expected.append([random.randint(0, 10000) for _ in range(n)])
    outs = [random.randint(100, 1024) for _ in range(256)]
    prompts, max_tokens = bench.nanovllm_workload()
    assert prompts == expected and max_tokens == outs
    assert [len(p) for p in prompts[:3]] == [964, 724, 484] and outs[:3] == [845, 312, 607]  # pinned
    assert all(0 <= t <= 10000 for p in prompts for t in p)
    small, small_out = bench.nanovllm_workload(3, 16, 4)  # maxima below 100 lower the minimum to the maximum
    assert [len(p) for p in small] == [16] * 3 and small_out == [4] * 3


def test_acceptance_stats():
    mean, rates, n = bench.acceptance_stats([[1, 3, 2], [4], []], num_steps=3)
    assert n == 4 and mean == pytest.approx(10 / 4)
    assert rates == pytest.approx([3 / 4, 2 / 4, 1 / 4])  # >= 1, 2, 3 drafts accepted: length >= 2, 3, 4
    assert bench.acceptance_stats([[], []], 2) == (None, [None, None], 0)


def test_shape_dirs(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    from nanospec.loader import resolve_model_dir

    q = AutoConfig.from_pretrained(bench.write_shape_dir("qwen3-0.6b", tmp_path))
    assert (
        q.model_type,
        q.hidden_size,
        q.num_hidden_layers,
        q.num_attention_heads,
        q.num_key_value_heads,
        q.head_dim,
        q.intermediate_size,
        q.vocab_size,
        q.tie_word_embeddings,
        q.rope_parameters["rope_theta"],
        q.rms_norm_eps,
        q.max_position_embeddings,
    ) == ("qwen3", 1024, 28, 16, 8, 128, 3072, 151936, True, 1e6, 1e-6, 40960)
    assert len(AutoTokenizer.from_pretrained(tmp_path)) == 49152
    (tmp_path / "s").mkdir()
    s = json.loads((bench.write_shape_dir("smollm2-135m", tmp_path / "s") / "config.json").read_text())
    assert s == json.loads((resolve_model_dir(None) / "config.json").read_text())


def test_tiny_run_with_hf(capsys, monkeypatch, two_layers):
    res, lines, outputs = run_bench(capsys, monkeypatch, TINY + ["--compare-hf"])
    assert len(outputs) == 2 and all("accept_lengths" not in o for o in outputs)
    _, max_tokens = bench.nanovllm_workload(2, 16, 4)
    assert res["total_tokens"] == sum(max_tokens) and res["num_seqs"] == 2 and res["input_tokens"] == 32
    assert (res["workload"], res["shape"], res["device"], res["dtype"]) == (
        "nanovllm",
        "smollm2-135m",
        "cpu",
        "float32",
    )
    assert res["temperature"] == 0.6 and res["ignore_eos"] and res["mean_accept_length"] is None
    assert res["assistant"] is None  # --assistant auto: no shipped assistant for a random-weight shape
    assert res["hf_num_seqs"] == 2 and res["hf_total_tokens"] == sum(max_tokens)
    assert res["hf_throughput_tok_s"] == pytest.approx(res["hf_total_tokens"] / res["hf_time_s"])
    assert res["hf_ratio"] == pytest.approx(res["throughput_tok_s"] / res["hf_throughput_tok_s"])
    assert any(line.startswith("HF transformers: ") for line in lines)


def test_batch_1_with_random_assistant(capsys, monkeypatch, two_layers):
    res, _, outputs = run_bench(
        capsys,
        monkeypatch,
        TINY + ["--batch-1", "--assistant", "random", "--num-steps", "2", "--temperature", "0"],
    )
    assert len(outputs) == 2  # one generate() per request
    acc = [a for o in outputs for a in o["accept_lengths"]]
    assert res["num_verify_steps"] == len(acc) and res["mean_accept_length"] == pytest.approx(
        sum(acc) / len(acc)
    )
    assert res["per_position_acceptance"] == pytest.approx(
        [sum(a >= i + 1 for a in acc) / len(acc) for i in (1, 2)]
    )
    total = res["total_tokens"]
    assert total == sum(bench.nanovllm_workload(2, 16, 4)[1])
    assert res["ms_per_token"] == pytest.approx(1000 * res["time_s"] / total)
    assert (res["assistant"], res["num_steps"], res["topk"], res["num_draft_tokens"]) == ("random", 2, 1, 3)
    # each request: first token from prefill, then verify steps of 1..3 tokens each
    assert (total - 2) / 3 <= res["num_verify_steps"] <= total - 2
    assert 1 <= res["mean_accept_length"] <= 3 and len(res["per_position_acceptance"]) == 2
    assert 1 >= res["per_position_acceptance"][0] >= res["per_position_acceptance"][1] >= 0


def test_default_model_speculates_with_the_shipped_assistant(capsys, monkeypatch):
    """`--assistant auto` (the default) on the default model is the shipped assistant, as in example.py;
    `--assistant none` turns speculation off."""
    argv = [
        "--num-seqs",
        "1",
        "--max-input-len",
        "16",
        "--max-output-len",
        "6",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--max-model-len",
        "64",
        "--max-num-seqs",
        "2",
        "--temperature",
        "0",
    ]
    res, _, outputs = run_bench(capsys, monkeypatch, argv)
    assert res["assistant"] == "default" and res["num_steps"] >= 1 and res["num_verify_steps"] >= 1
    assert [a for o in outputs for a in o["accept_lengths"]] and res["mean_accept_length"] >= 1
    res, _, outputs = run_bench(capsys, monkeypatch, argv + ["--assistant", "none"])
    assert res["assistant"] is None and res["mean_accept_length"] is None
    assert all("accept_lengths" not in o for o in outputs)
