"""bench.py (nanospec.tools.bench) on CPU: output format and figures of tiny random-weight runs, nano-vllm's
workload, acceptance stats."""

import json
import random
import re

import pytest

from nanospec.tools import bench, checkpoints

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

    def write(shape, out, num_layers=None):
        orig(shape, out, num_layers)
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
        TINY
        + ["--batch-1", "--assistant", "random", "--num-steps", "2", "--temperature", "0"]
        + ["--no-adaptive-speculation"],
    )
    assert len(outputs) == 2  # one generate() per request
    acc = [a for o in outputs for a in o["accept_lengths"]]
    assert res["draft_len_counts"] == {"2": len(acc)}  # a fixed draft length: every step drafts 2
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
    assert res["assistant"] == "default" and res["num_steps"] >= 1 and res["adaptive_speculation"]
    steps = sum(res["draft_len_counts"].values())  # the policy may draft 0 tokens in some steps
    assert steps >= 1 and res["num_verify_steps"] == steps - res["draft_len_counts"].get("0", 0)
    res, _, outputs = run_bench(capsys, monkeypatch, argv + ["--assistant", "none"])
    assert res["assistant"] is None and res["mean_accept_length"] is None
    assert all("accept_lengths" not in o for o in outputs)


def tiny(*extra):
    """TINY with some options replaced (``--name value`` pairs) or added (flags)."""
    argv, extra = list(TINY), list(extra)
    while extra:
        name = extra.pop(0)
        value = [extra.pop(0)] if extra and not extra[0].startswith("--") else []
        if name in argv and value:
            argv[argv.index(name) + 1] = value[0]
        else:
            argv += [name, *value]
    return argv


def run_compare(capsys, monkeypatch, argv):
    """bench.main with --compare: returns (JSON figures, stdout lines, the timed outputs of each round)."""
    calls, generate = [], bench.LLM.generate

    def record(self, *a, **k):
        calls.append((self, generate(self, *a, **k)))
        return calls[-1][1]

    monkeypatch.setattr(bench.LLM, "generate", record)
    res = bench.main(argv)
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads(lines[-1]) == res
    engines = list(dict.fromkeys(llm for llm, _ in calls))
    assert len(engines) == 4  # a fresh engine per round
    cmp = res["compare"]
    totals = [line for line in lines if "Total: " in line]
    assert len(totals) == 4 and [line.split("] ")[0] + "]" for line in totals] == [
        f"[{cmp['option']} {s}]" for s in ("on", "off", "on", "off")
    ]
    tok_s = [float(TOTAL_LINE.match(line.split("] ", 1)[1])[3]) for line in totals]
    assert tok_s == pytest.approx(cmp["rounds_tok_s"], abs=0.006)
    assert cmp["on"]["throughput_tok_s"] == max(cmp["rounds_tok_s"][0::2])  # the best round of each side
    assert cmp["off"]["throughput_tok_s"] == max(cmp["rounds_tok_s"][1::2])
    assert cmp["ratio"] == pytest.approx(cmp["on"]["throughput_tok_s"] / cmp["off"]["throughput_tok_s"])
    line = next(line for line in lines if " on/off throughput = " in line)
    assert line == f"{cmp['option']} on/off throughput = {cmp['ratio']:.2f}x"
    assert res["throughput_tok_s"] == cmp["on"]["throughput_tok_s"]  # top-level figures: the best "on" round
    return res, lines, [[o for llm2, out in calls if llm2 is llm for o in out][1:] for llm in engines]


def test_compare_prefix_caching_on_shared_prefix(capsys, monkeypatch, two_layers):
    argv = tiny("--workload", "shared-prefix", "--prefix-len", "40", "--batch-1", "--num-seqs", "3")
    res, _, rounds = run_compare(capsys, monkeypatch, argv + ["--compare", "enable_prefix_caching"])
    assert res["compare"]["option"] == "enable_prefix_caching" and res["workload"] == "shared-prefix"
    on, off = res["compare"]["on"], res["compare"]["off"]
    assert on["enable_prefix_caching"] is True and off["enable_prefix_caching"] is False
    prompts, _ = bench.nanovllm_workload(3, 16, 4)
    for outputs in rounds:  # one shared random 40-token prefix in front of nano-vllm's prompts
        ids = [o["prompt_token_ids"] for o in outputs]
        assert [p[40:] for p in ids] == prompts and ids[0][:40] == ids[1][:40] == ids[2][:40]
    # the warm-up ran request 1 itself (its 56 tokens: 3 full pages of 16 cached); one request at a time,
    # requests 2 and 3 then find the shared prefix's 2 full pages cached
    assert [[o["num_cached_tokens"] for o in out] for out in rounds] == [[48, 32, 32], [0, 0, 0]] * 2
    assert on["cached_tokens"] == 112 and off["cached_tokens"] == 0
    assert on["total_tokens"] == off["total_tokens"] == sum(bench.nanovllm_workload(3, 16, 4)[1])


def test_shared_prefix_text(monkeypatch):
    """Without --shape the prefix is this module's docstring, tokenized, cut to --prefix-len tokens, in front
    of the ShareGPT prompts."""
    from nanospec.loader import load_tokenizer, resolve_model_dir

    tok = load_tokenizer(resolve_model_dir(None))
    monkeypatch.setattr(bench, "sharegpt_workload", lambda t, *a: ([[5, 6], [7]], [3, 2]))
    args = bench.parse_args(["--workload", "shared-prefix", "--prefix-len", "300"])
    prompts, params = bench.workload(args, tok)
    prefix = tok.encode(bench.__doc__ * 6, add_special_tokens=False)[:300]
    assert len(prefix) == 300 and prompts == [prefix + [5, 6], prefix + [7]]
    assert [p.max_tokens for p in params] == [3, 2] and [p.seed for p in params] == [0, 1]
    assert params[0].temperature == 0.0 and not params[0].ignore_eos


def test_compare_spec_batch_1_phases(capsys, monkeypatch, two_layers):
    argv = tiny(
        "--batch-1",
        "--assistant",
        "random",
        "--num-steps",
        "2",
        "--temperature",
        "0",
        "--compare-spec",
        "--no-adaptive-speculation",
    )
    res, lines, rounds = run_compare(capsys, monkeypatch, argv)
    on, off = res["compare"]["on"], res["compare"]["off"]
    assert res["compare"]["option"] == "assistant"
    assert (on["assistant"], off["assistant"]) == ("random", None)
    assert off["mean_accept_length"] is None and 1 <= on["mean_accept_length"] <= 3
    for i, outputs in enumerate(rounds):  # spec is lossless: the same tokens with and without the assistant
        assert [o["token_ids"] for o in outputs] == [o["token_ids"] for o in rounds[0]]
        assert len(outputs) == 2 + 2 and all(("accept_lengths" in o) == (i % 2 == 0) for o in outputs)
    # the phase pass (the last 2 outputs of a round): one draft and one verify per speculative step, one plain
    # decode per token after the first
    steps = sum(len(o["accept_lengths"]) for o in rounds[0][2:])
    assert (on["draft_calls"], on["verify_calls"], on["step_calls"], on["decode_calls"]) == (
        steps,
        steps,
        steps,
        0,
    )
    decodes = sum(len(o["token_ids"]) - 1 for o in rounds[1][2:])
    assert (off["draft_calls"], off["verify_calls"], off["step_calls"], off["decode_calls"]) == (
        0,
        0,
        0,
        decodes,
    )
    assert all(on[k] > 0 for k in ("draft_ms", "verify_ms", "step_ms")) and on["decode_ms"] is None
    assert off["decode_ms"] > 0 and off["draft_ms"] is off["verify_ms"] is off["step_ms"] is None
    figs = dict(
        mean_accept_length=on["mean_accept_length"], draft_ms=on["draft_ms"], verify_ms=on["verify_ms"]
    )
    figs.update(step_ms=on["step_ms"], plain_decode_ms=off["decode_ms"])
    assert lines[-3] == ", ".join(f"{k} {v:.3f}" for k, v in figs.items())
    assert on["draft_len_counts"] == {"2": sum(len(o["accept_lengths"]) for o in rounds[0][:2])}
    assert lines[-2] == f"steps per draft length s: {on['draft_len_counts']}"


def test_timed_wraps_the_instance_only():
    class Worker:
        def draft(self, x, y=1):
            return x + y

    w, other, log = Worker(), Worker(), []
    w.draft = bench.timed(w.draft, "cpu", log)  # set on the instance, as run() does
    assert w.draft(2, y=3) == 5 and w.draft(1) == 2 and len(log) == 2 and all(t >= 0 for t in log)
    assert other.draft(1) == 2 and len(log) == 2 and "draft" not in vars(other)


def test_stall_gap(monkeypatch):
    """stall() adds the last prompt once every decoder has a token and reports the largest gap between two
    steps that gave one decoder tokens (a scripted engine and clock)."""
    from types import SimpleNamespace

    class Engine:
        def __init__(self, script):
            self.reqs, self.script, self.log = [], script, []

        def add_request(self, prompt, params):
            r = SimpleNamespace(request_id=len(self.reqs), output_token_ids=[], prompt=prompt)
            self.reqs.append(r)
            self.log.append((len(prompt), [len(q.output_token_ids) for q in self.reqs]))
            return r.request_id

        def get_request(self, request_id):
            return self.reqs[request_id]

        def has_unfinished(self):
            return bool(self.script)

        def step(self):
            for i in self.script.pop(0):  # request ids given a token by this step
                self.reqs[i].output_token_ids.append(7)
            return [] if self.script else self.reqs[::-1]

        def output_dict(self, r):
            return {"token_ids": r.output_token_ids, "prompt_token_ids": r.prompt}

    # t=1, 2: the decoders' prefills; t=3: decoder 0; t=4.5, 8: the long prompt's chunks (first token at 8)
    script = [[0], [1], [0], [], [2], [0, 2], [1], [1, 2]]
    times = iter([1, 2, 3, 4.5, 8, 9, 9.5, 10])
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(times))
    llm = Engine(script)
    outputs, gap = bench.stall(llm, [[1] * 3, [2] * 3, [3] * 50], [None] * 3)
    assert llm.log == [
        (3, [0]),
        (3, [0, 0]),
        (50, [1, 1, 0]),
    ]  # the long one after both decoders' first token
    assert gap == 9.5 - 2  # decoder 1: tokens at t=2, 9.5, 10; decoder 0: at 1, 3, 9
    assert [len(o["prompt_token_ids"]) for o in outputs] == [3, 3, 50]
    assert [len(o["token_ids"]) for o in outputs] == [3, 3, 3]


def test_stall_workload_compare_overlap(capsys, monkeypatch, two_layers):
    argv = tiny("--workload", "stall", "--stall-len", "100", "--max-output-len", "8", "--max-num-seqs", "8")
    added, add = [], bench.LLM.add_request

    def record(self, prompt, params):  # prompt length, and the output lengths of the requests running
        added.append((len(prompt), sorted(len(r.output_token_ids) for r in self.scheduler.running)))
        return add(self, prompt, params)

    monkeypatch.setattr(bench.LLM, "add_request", record)
    argv += ["--max-num-batched-tokens", "48", "--max-model-len", "128", "--compare", "overlap_schedule"]
    res, lines, _ = run_compare(capsys, monkeypatch, argv)
    on, off = res["compare"]["on"], res["compare"]["off"]
    assert (on["overlap_schedule"], off["overlap_schedule"], res["workload"]) == (True, False, "stall")
    # each round: 7 decoders of 16 tokens, then the 100-token prompt (3 chunks) once all 7 have a token
    assert [a[0] for a in added] == ([16] * 7 + [100]) * 4 and all(
        not a[1] for i, a in enumerate(added) if i % 8 < 7
    )
    assert all(len(a[1]) == 7 and min(a[1]) >= 1 for a in added[7::8])
    assert on["total_tokens"] == off["total_tokens"] == 8 * 8 and res["ignore_eos"]
    assert on["max_gap_s"] > 0 and off["max_gap_s"] > 0
    gaps = [line for line in lines if "Max inter-token gap of the decoders: " in line]
    assert len(gaps) == 4 and all(re.search(r": \d+\.\d{3}s$", g) for g in gaps)


def test_gemma4_shapes_are_the_real_ones():
    """The Gemma 4 shapes against the published E2B / E4B / 26B-A4B / 31B sizes (HF
    convert_gemma4_weights.py): configs, the assistant's layer map onto the target's KV owners (last
    non-shared layer of each type), KV-owning layers and the assistants' parameter counts (meta device: no
    memory); 26B-A4B's MoE: 128 experts of 704, top-8, 25.2 B parameters of which 3.8 B active per token."""
    import torch

    from nanospec.models import target_class
    from nanospec.models.assistant_config import check_assistant_config
    from nanospec.models.gemma4_assistant import Gemma4Assistant

    S, F = "sliding_attention", "full_attention"
    want = {  # hidden, layers, Q heads, KV heads sliding / full, MLP, window, PLE, KV-shared, k_eq_v, max pos
        "gemma4-e2b": (1536, 35, 8, 1, 1, 6144, 512, 256, 20, False, 131072),
        "gemma4-e4b": (2560, 42, 8, 2, 2, 10240, 512, 256, 18, False, 131072),
        "gemma4-26b-a4b": (2816, 30, 16, 8, 2, 2112, 1024, 0, 0, True, 262144),
        "gemma4-31b": (5376, 60, 32, 16, 4, 21504, 1024, 0, 0, True, 262144),
    }
    types = {
        "gemma4-e2b": ([S] * 4 + [F]) * 7,
        "gemma4-e4b": ([S] * 5 + [F]) * 7,
        "gemma4-26b-a4b": ([S] * 5 + [F]) * 5,
        "gemma4-31b": ([S] * 5 + [F]) * 10,
    }
    asst = {  # hidden, Q heads, MLP, centroid head; layer map; parameters (M); the target's KV-owning layers
        "gemma4-e2b": ((256, 4, 2048, True), [13, 13, 13, 14], 77.7, 15),
        "gemma4-e4b": ((256, 4, 2048, True), [22, 22, 22, 23], 78.518, 24),
        "gemma4-26b-a4b": ((1024, 16, 8192, False), [28, 28, 28, 29], 419.7, 30),
        "gemma4-31b": ((1024, 32, 8192, False), [58, 58, 58, 59], 469.5, 60),
    }
    assert sorted(bench.GEMMA4) == sorted(want)
    for shape, (H, n, _, kv, kv_full, _, window, *_) in want.items():
        t, a = bench.gemma4_configs(shape)
        sliding, full = t.per_layer_config[0], t.per_layer_config[n - 1]  # per layer type: KV heads, head dim
        got = (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, sliding.num_key_value_heads)
        got += (
            full.num_key_value_heads,
            t.intermediate_size,
            t.sliding_window,
            t.hidden_size_per_layer_input,
        )
        got += (t.num_kv_shared_layers, t.attention_k_eq_v, t.max_position_embeddings)
        assert (
            got == want[shape]
            and t.layer_types == types[shape]
            and (sliding.head_dim, full.head_dim) == (256, 512)
        )
        assert (t.final_logit_softcapping, t.vocab_size, t.vocab_size_per_layer_input) == (
            30.0,
            262144,
            262144,
        )
        assert t.use_double_wide_mlp == (shape == "gemma4-e2b") and t.tie_word_embeddings
        dims, layer_map, params_m, owners = asst[shape]
        tc = a.text_config
        assert (
            tc.hidden_size,
            tc.num_attention_heads,
            tc.intermediate_size,
            a.use_ordered_embeddings,
        ) == dims
        assert (a.num_centroids, a.centroid_intermediate_top_k, a.backbone_hidden_size) == (2048, 32, H)
        assert tc.layer_types == [S, S, S, F] and tc.num_kv_shared_layers == 4
        assert (tc.sliding_window, tc.final_logit_softcapping, tc.vocab_size) == (window, None, 262144)
        geometry = [
            (c.num_key_value_heads, c.head_dim) for c in (tc.per_layer_config[0], tc.per_layer_config[3])
        ]
        assert geometry == [(kv, 256), (kv_full, 512)]  # the target's
        assert check_assistant_config(a, t) == layer_map
        with torch.device("meta"):
            model, target = Gemma4Assistant(a), target_class(t)[0](t, 128)
        assert sum(p.numel() for p in model.parameters()) / 1e6 == pytest.approx(params_m, rel=1e-3)
        geometry = [g for g in target.kv_geometry if g is not None]
        assert len(geometry) == owners and set(geometry) == {(kv, 256), (kv_full, 512)}
        moe = (t.enable_moe_block, t.num_experts, t.top_k_experts, t.moe_intermediate_size)
        assert moe == ((True, 128, 8, 704) if shape == "gemma4-26b-a4b" else (False, None, None, None))
        if t.enable_moe_block:
            experts = sum(p.numel() for n, p in target.named_parameters() if ".experts." in n)
            total = sum(p.numel() for p in target.parameters())
            assert total / 1e9 == pytest.approx(25.23, abs=0.01)
            assert (total - experts * (1 - 8 / 128)) / 1e9 == pytest.approx(3.82, abs=0.01)
    t = bench.gemma4_configs("gemma4-26b-a4b", num_layers=4)[0]  # --num-layers: the first layers
    assert t.num_hidden_layers == 4 and t.layer_types == [S, S, S, F] and t.num_experts == 128


SMALL_GEMMA4 = {  # scaled-down, same structure (fields as bench.GEMMA4)
    "gemma4-e2b": (1, 1, False, 6, 64, 10, 4, 48, True, 8, 4, 128, 5, 32, 4, 64, 64),
    "gemma4-26b-a4b": (2, 1, True, 5, 64, 6, 4, 48, False, 0, 0, 128, 6, 32, 4, 64, 0),
    "gemma4-31b": (2, 1, True, 5, 64, 6, 4, 96, False, 0, 0, 128, 6, 32, 4, 64, 0),
}


@pytest.mark.parametrize("shape", sorted(SMALL_GEMMA4))
def test_gemma4_shape_runs_scaled_down(capsys, monkeypatch, shape):
    """--shape gemma4-* --assistant random through the engine, the shape's numbers scaled down (CPU)."""
    monkeypatch.setitem(bench.GEMMA4, shape, SMALL_GEMMA4[shape])
    moe = dict(enable_moe_block=True, num_experts=16, top_k_experts=4, moe_intermediate_size=16)
    monkeypatch.setattr(checkpoints, "G4_MOE", {"gemma4-26b-a4b": moe})
    small = dict(head_dim=16, global_head_dim=32, vocab_size=49152, vocab_size_per_layer_input=49152)
    monkeypatch.setattr(checkpoints, "G4_COMMON", small)
    engines, init = [], bench.LLM.__init__
    monkeypatch.setattr(
        bench.LLM, "__init__", lambda self, *a, **k: engines.append(self) or init(self, *a, **k)
    )
    argv = tiny(
        "--shape",
        shape,
        "--assistant",
        "random",
        "--batch-1",
        "--num-seqs",
        "1",
        "--temperature",
        "0",
        "--no-adaptive-speculation",
    )
    layers = SMALL_GEMMA4[shape][5]
    if shape == "gemma4-26b-a4b":  # its first 2 layers (sliding, full)
        argv += ["--num-layers", "2"]
        layers = 2
    res, _, outputs = run_bench(capsys, monkeypatch, argv)
    llm = engines[0]
    target, assistant = llm.runner.model, llm.worker.assistant
    assert type(target).__name__ == "Gemma4ForCausalLM" and target.config.num_hidden_layers == layers
    assert (assistant.masked_embedding is not None) == (shape == "gemma4-e2b")
    assert target.config.attention_k_eq_v == (shape != "gemma4-e2b")
    assert target.config.enable_moe_block == (shape == "gemma4-26b-a4b")
    if shape == "gemma4-26b-a4b":
        assert target.config.layer_types == ["sliding_attention", "full_attention"]
        with pytest.raises(SystemExit):
            bench.parse_args(["--shape", "qwen3-0.6b", "--num-layers", "2"])
        assert "--num-layers needs a Gemma 4 --shape" in capsys.readouterr().err
    assert res["shape"] == shape and res["assistant"] == "random" and res["num_verify_steps"] >= 1
    assert res["total_tokens"] == len(outputs[0]["token_ids"]) == bench.nanovllm_workload(1, 16, 4)[1][0]
