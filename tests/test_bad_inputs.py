"""Bad input raises ValueError / TypeError naming the field, before any work; the engine keeps serving."""

import json
import shutil

import pytest

from nanospec import LLM, SamplingParams

GOOD = SamplingParams(max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(
        str(tiny_llama_dir), dtype="float32", device="cpu", page_size=4, max_model_len=32, max_num_seqs=4
    )


def _untouched(llm):
    """Nothing queued, nothing running, every block free, no request id consumed by a failed call."""
    s, a = llm.scheduler, llm.runner.allocator
    return not s.waiting and not s.running and a.num_free == a.num_usable


# -------------------------------------------------------------------------------------- SamplingParams fields
@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature="hot"), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=1e-38), "temperature"),
        (dict(temperature=3.5e38), "temperature"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(ignore_eos="no"), "ignore_eos"),
        (dict(seed=-1), "seed"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=-1), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_k=2**31), "top_k"),  # an int32 on the device: it stopped the engine at its first step
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(seed=1.5), "seed"),
        (dict(seed=2**63), "seed"),  # used to give the same samples as a smaller seed
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(stop=5), "stop"),
        (dict(stop=0), "stop"),
        (dict(stop={"a": 1}), "stop"),
        (dict(stop_token_ids=0), "stop_token_ids"),
        (dict(stop_token_ids="ab"), "stop_token_ids"),
    ],
)
def test_sampling_params_rejects(kw, field):
    with pytest.raises((ValueError, TypeError), match=field):
        SamplingParams(**kw)


def test_sampling_params_boundaries_accepted():
    for kw in (
        dict(temperature=0),
        dict(top_p=1.0),
        dict(top_p=1e-6),
        dict(top_k=-1),
        dict(top_k=1),
        dict(top_k=2**31 - 1),
        dict(max_tokens=1),
        dict(stop="x"),
        dict(seed=0),
        dict(seed=2**63 - 1),
    ):
        SamplingParams(**kw)
    assert SamplingParams(stop="x").stop == ["x"]


# --------------------------------------------------------------------------------------- prompts
@pytest.mark.parametrize(
    "prompt, params, exc, field",
    [
        ("", GOOD, ValueError, "prompt"),
        ([], GOOD, ValueError, "prompt"),
        ([1, 2, -1], GOOD, ValueError, "prompt token ids"),
        ([1, 49152], GOOD, ValueError, "prompt token ids"),
        ([1, 10**9], GOOD, ValueError, "prompt token ids"),
        ([1, 2.0], GOOD, TypeError, "prompt"),
        ([1, True], GOOD, TypeError, "prompt"),
        (None, GOOD, TypeError, "prompt"),
        ([1] * 30, SamplingParams(max_tokens=3), ValueError, "max_model_len"),  # 30 + 3 > 32
        ([1] * 32, SamplingParams(max_tokens=1), ValueError, "max_tokens"),
        ([1, 2], dict(max_tokens=3), TypeError, "sampling_params"),
        ([1, 2], SamplingParams(max_tokens=3, stop_token_ids=[49152]), ValueError, "stop_token_ids"),
    ],
)
def test_bad_prompt_raises_before_any_work(llm, prompt, params, exc, field):
    before = llm._next_id
    with pytest.raises(exc, match=field):
        llm.add_request(prompt, params)
    with pytest.raises(exc, match=field):
        llm.generate([prompt], params if isinstance(params, SamplingParams) else [params], use_tqdm=False)
    assert _untouched(llm) and llm._next_id == before


def test_largest_top_k_keeps_every_token(llm):
    """top_k 2**31 - 1 (the largest an int32 holds) is past the vocabulary: the same samples as top_k off."""
    sp = [
        SamplingParams(temperature=1.0, top_k=k, max_tokens=6, ignore_eos=True, seed=9)
        for k in (-1, 2**31 - 1)
    ]
    off, largest = llm.generate([[5, 6, 7]] * 2, sp, use_tqdm=False)
    assert off["token_ids"] == largest["token_ids"] and _untouched(llm)


def test_prompt_at_exactly_max_model_len_is_accepted(llm):
    out = llm.generate([[7] * 29], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out["token_ids"]) == 3 and out["finish_reason"] == "length"
    assert _untouched(llm)


def test_one_bad_prompt_queues_nothing_and_queued_work_survives(llm):
    queued = llm.add_request([5, 6, 7, 8], GOOD)  # already waiting when the bad call comes
    assert len(llm.scheduler.waiting) == 1
    for bad in (["hello", ""], [[1, 2], [3, -4]], [[1, 2], "x" * 0]):
        with pytest.raises(ValueError, match="prompt"):
            llm.generate(bad, GOOD, use_tqdm=False)
        assert [r.request_id for r in llm.scheduler.waiting] == [queued]
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1, 2], [3, 4]], [GOOD, SamplingParams(max_tokens=31)], use_tqdm=False)
    with pytest.raises(TypeError, match="sampling_params"):
        llm.generate([[1, 2], [3, 4]], [GOOD, None], use_tqdm=False)
    assert [r.request_id for r in llm.scheduler.waiting] == [queued]
    # the queued request still runs to completion, and a fresh generate works afterwards
    finished = []
    while llm.has_unfinished():
        finished += llm.step()
    assert [r.request_id for r in finished] == [queued] and len(finished[0].output_token_ids) == 3
    outs = llm.generate([[1, 2], [3, 4, 5]], GOOD, use_tqdm=False)
    assert [len(o["token_ids"]) for o in outs] == [3, 3] and _untouched(llm)


def test_mismatched_sampling_params_count(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([[1, 2], [3]], [GOOD], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([[1, 2]], [GOOD, GOOD], use_tqdm=False)
    assert _untouched(llm)


def test_prompts_must_be_a_list(llm):
    with pytest.raises(TypeError, match="prompts"):
        llm.generate("a single string", GOOD, use_tqdm=False)
    with pytest.raises(TypeError, match="prompts"):
        llm.generate([1, 2, 3], GOOD, use_tqdm=False)
    for prompts in (None, 5, (p for p in ["a"])):  # used to fail inside generate, not naming prompts
        with pytest.raises(TypeError, match="prompts"):
            llm.generate(prompts, GOOD, use_tqdm=False)
    assert _untouched(llm)


# --------------------------------------------------------------------------------------- engine options
@pytest.mark.parametrize(
    "kw, exc, field",
    [
        (dict(dtype="float8"), ValueError, "dtype"),
        (dict(dtype="fp32"), ValueError, "dtype"),
        (dict(device="tpu"), ValueError, "device"),
        (dict(device="cuda:0"), ValueError, "device"),
        (dict(max_model_len=1), ValueError, "max_model_len"),
        (dict(max_model_len=16.0), TypeError, "max_model_len"),
        (dict(max_num_seqs=0), ValueError, "max_num_seqs"),
        (dict(max_num_batched_tokens=0), ValueError, "max_num_batched_tokens"),
        (dict(page_size=0), ValueError, "page_size"),
        (dict(num_kv_blocks=1), ValueError, "num_kv_blocks"),
        (dict(gpu_memory_utilization=0.0), ValueError, "gpu_memory_utilization"),
        (dict(gpu_memory_utilization=1.5), ValueError, "gpu_memory_utilization"),
        (dict(cpu_kv_cache_gb=0), ValueError, "cpu_kv_cache_gb"),
        (dict(cpu_kv_cache_gb=float("inf")), ValueError, "cpu_kv_cache_gb"),
        (dict(cpu_kv_cache_gb=None), TypeError, "cpu_kv_cache_gb"),
        (dict(cpu_kv_cache_gb=True), TypeError, "cpu_kv_cache_gb"),
        (dict(gpu_memory_utilization="0.5"), TypeError, "gpu_memory_utilization"),
        (dict(assistant=5), TypeError, "assistant"),
        (dict(seed=-1), ValueError, "seed"),
        (dict(seed=2**70), ValueError, "seed"),  # used to fail late inside torch, not naming seed
        (dict(load_format="pt"), ValueError, "load_format"),
        (dict(max_num_seq=4), TypeError, "max_num_seq"),
        (dict(temperature=0.5), TypeError, "temperature"),
        (dict(num_steps=3), ValueError, "num_steps"),
        (dict(topk=2), ValueError, "topk"),
        (dict(num_draft_tokens=4), ValueError, "num_draft_tokens"),
        (dict(deterministic=1), TypeError, "deterministic"),
        (dict(assistant="x", topk=2, num_draft_tokens=3, deterministic=True), ValueError, "deterministic"),
    ],
)
def test_bad_engine_options(tiny_llama_dir, monkeypatch, kw, exc, field):
    import nanospec.llm as llm_mod

    monkeypatch.setattr(llm_mod, "ModelRunner", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(exc, match=field):
        LLM(str(tiny_llama_dir), **{"device": "cpu", **kw})


def test_model_must_be_a_path():
    with pytest.raises(TypeError, match="model must be a path"):
        LLM(5)


def test_pool_too_small_for_one_request(tiny_llama_dir):
    with pytest.raises(ValueError, match="num_kv_blocks"):
        LLM(str(tiny_llama_dir), device="cpu", page_size=4, max_model_len=32, num_kv_blocks=5)


def test_bad_model_dirs(tmp_path, tiny_llama_dir):
    with pytest.raises(ValueError, match="model"):
        LLM(str(tmp_path / "missing"), device="cpu")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(empty), device="cpu")
    no_weights = tmp_path / "no_weights"
    shutil.copytree(tiny_llama_dir, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(no_weights), device="cpu")
    # random weights need no checkpoint
    LLM(str(no_weights), device="cpu", load_format="dummy", max_model_len=32, page_size=4)
    other = tmp_path / "gpt2"
    shutil.copytree(no_weights, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type"):
        LLM(str(other), device="cpu", load_format="dummy")


def test_checkpoint_with_wrong_shapes(tmp_path, tiny_llama_dir):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "intermediate_size": cfg["intermediate_size"] + 8}))
    with pytest.raises(ValueError, match="mlp"):
        LLM(str(bad), device="cpu", max_model_len=32, page_size=4)


@pytest.mark.parametrize(
    "module,argv,option",
    [
        ("tools.train", ["--regenerate", ""], "--regenerate"),
        ("tools.train", ["--regenerate", "0,-1"], "--regenerate"),
        ("tools.train", ["--layers", "0"], "--layers"),
        ("tools.train", ["--lr", "nan"], "--lr"),
        ("tools.train", ["--epochs", "0"], "--epochs"),
        ("tools.train", ["--time-budget-min", "-1"], "--time-budget"),
        ("tools.train", ["--seq-len", "4"], "--seq-len"),
        ("tools.train", ["--init", "/nonexistent"], "--init"),
        ("tools.train", ["--init", "default", "--layers", "2"], "--layers"),
        ("tools.train", ["--init", ""], "--init"),
        ("tools.train", ["--init", "{tmp}"], "--init"),
        ("tools.train", ["--out", "/dev/null/x"], "--out"),
        ("tools.train", ["--all-turns"], "--all-turns"),
        ("tools.train", ["--max-new-tokens", "64"], "--max-new-tokens"),
        ("tools.train", ["--regen-budget-min", "1"], "--regen-budget-min"),
        ("tools.eval", ["--dtype", "int8"], "--dtype"),
        ("tools.eval", ["--assistant", "/nonexistent"], "--assistant"),
        ("tools.eval", ["--assistant", "{tmp}"], "--assistant"),
        ("tools.eval", ["--temperatures", "0,-1"], "--temper"),
        ("tools.eval", ["--steps", "0"], "--steps"),
        ("tools.eval", ["--datasets", "sharegtp"], "--datasets"),
        ("tools.eval", ["--num-prompts", "0"], "--num-prompts"),
        ("tools.eval", ["--deterministic"], "--deterministic"),  # the default --topks 1,3 has a tree
        ("tools.train", ["--deterministic"], "--deterministic"),  # only with --regenerate
        ("tools.bench", ["--deterministic", "--topk", "2"], "--deterministic"),
    ],
)
def test_cli_rejects_bad_values_before_loading(monkeypatch, capsys, tmp_path, module, argv, option):
    """Both CLIs stop in argparse, naming the option, before any model, tokenizer or data is touched."""
    import importlib

    from nanospec import loader

    monkeypatch.chdir(tmp_path)  # nothing may be left behind (the trainer's --out is made after the checks)
    monkeypatch.setattr(loader, "resolve_model_dir", lambda *a, **k: pytest.fail("loaded a model first"))
    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"nanospec.{module}").main([x.format(tmp=tmp_path) for x in argv])
    assert e.value.code == 2 and option in capsys.readouterr().err and not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "module,argv",
    [
        ("tools.train", []),
        ("tools.train", ["--regenerate", "0", "--step-decay", "1", "--seed", "0"]),
        (
            "tools.train",
            [
                "--time-budget-min",
                "0.5",
                "--seq-len",
                "16",
                "--all-positions",
                "--out",
                "{tmp}/a/b",
                "--init",
                "default",
            ],
        ),
        (
            "tools.train",
            ["--regenerate", "0", "--all-turns", "--regen-budget-min", "1", "--max-new-tokens", "8"],
        ),
        ("tools.eval", []),
        ("tools.eval", ["--max-tokens", "2", "--tree-tokens", "2", "--steps", "1"]),
        ("tools.eval", ["--deterministic", "--topks", "1"]),
        ("tools.train", ["--regenerate", "0", "--deterministic"]),
    ],
)
def test_cli_accepts_valid_values(monkeypatch, tmp_path, module, argv):
    """Defaults and edge-valid values get past the checks (to the model load, stubbed here)."""
    import importlib

    from nanospec import loader

    class Reached(Exception):
        pass

    monkeypatch.chdir(tmp_path)  # the trainer creates its --out dir (default ./assistant_out) up front
    monkeypatch.setattr(loader, "resolve_model_dir", lambda *a, **k: (_ for _ in ()).throw(Reached()))
    with pytest.raises(Reached):
        importlib.import_module(f"nanospec.{module}").main([x.format(tmp=tmp_path) for x in argv])


def test_cli_checks_that_need_the_tokenizer(monkeypatch, capsys, tmp_path, smollm2_dir):
    """Checks made once the target's tokenizer is loaded, still before any data or model work: a --seq-len
    that ends inside every chat prompt (nothing left to train), a --model that does not resolve."""
    from nanospec.loader import load_tokenizer
    from nanospec.tools import datasets, train
    from nanospec.tools import eval as eval_tool

    class Reached(Exception):
        pass

    monkeypatch.setattr(datasets, "load_sharegpt", lambda *a, **k: (_ for _ in ()).throw(Reached()))
    shortest = len(datasets.chat_prompts(load_tokenizer(smollm2_dir), ["x"], 1)[0])
    out = ["--out", str(tmp_path / "out")]
    for module, argv, option in [
        (train, ["--seq-len", str(shortest)] + out, "--seq-len"),
        (eval_tool, ["--model", str(tmp_path / "none")], "--model"),
    ]:
        with pytest.raises(SystemExit) as e:
            module.main(argv)
        assert e.value.code == 2 and option in capsys.readouterr().err and not any(tmp_path.iterdir())
    with pytest.raises(Reached):  # one token more passes the check (on to the data load, stubbed here)
        train.main(["--seq-len", str(shortest + 1)] + out)
