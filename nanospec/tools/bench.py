"""Benchmark nanospec: the nano-vllm workload, ShareGPT prompts, batch-1 latency, speculation and HF
transformers.

    python bench.py                                      # nano-vllm workload (256 seqs), default SmolLM2 +
                                                         # its shipped assistant (--assistant none: without)
    python bench.py --shape qwen3-0.6b --compare-hf --hf-num-seqs 16  # random weights; HF in the same run
    python bench.py --workload sharegpt --batch-1                     # latency with the shipped assistant
    python bench.py --shape smollm2-135m --num-seqs 4 --max-input-len 64 --max-output-len 16 --device cpu

Prints the nano-vllm line `Total: Ntok, Time: ts, Throughput: xtok/s` (N = generated tokens), the HF line with
the ratio under --compare-hf, then one JSON line with every figure (batch-1: ms/token = wall time / generated
tokens, prefill included). `--assistant random` writes a random-weight gemma4_assistant for the target
(telemetry, speed). Absolute times count only on a GPU; on CPU compare ratios measured in one run."""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from .. import LLM, SamplingParams, loader
from ..mtp.worker import DEFAULT_ASSISTANT
from .cli import HelpFormatter, number

QWEN3_0_6B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8)
QWEN3_0_6B.update(head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True)
QWEN3_0_6B.update(rms_norm_eps=1e-6)
QWEN3_0_6B.update(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, max_position_embeddings=40960)
QWEN3_0_6B.update(bos_token_id=151643, eos_token_id=151645)


def nanovllm_workload(num_seqs=256, max_input_len=1024, max_output_len=1024, seed=0):
    """nano-vllm's bench.py draws, in its order: every prompt (length, then ids in [0, 10000]), then every
    max_tokens. Lengths are randint(100, max) as there; a max below 100 lowers the 100 to it (small CPU runs).
    Returns ``(prompts: list of token-id lists, max_tokens: list[int])``."""
    random.seed(seed)
    rand, lo_in, lo_out = random.randint, min(100, max_input_len), min(100, max_output_len)
    prompts = [[rand(0, 10000) for _ in range(rand(lo_in, max_input_len))] for _ in range(num_seqs)]
    return prompts, [rand(lo_out, max_output_len) for _ in range(num_seqs)]


def sharegpt_workload(tokenizer, num_seqs=None, max_input_len=1024, max_output_len=1024, seed=0, min_len=4):
    """Requests from the held-out ShareGPT "eval" split (``datasets.load_sharegpt``): the first user turn
    (chat template applied when the tokenizer has one) of conversations whose next turn is an answer, in a
    fixed shuffled order (``seed``); the prompt must have min_len..max_input_len tokens and the answer >=
    min_len; its max_tokens is the answer's token count capped at max_output_len. Returns ``(prompts,
    max_tokens)`` as nanovllm_workload."""
    from .datasets import load_sharegpt

    convs, prompts, max_tokens = load_sharegpt("eval"), [], []
    chat, plain = dict(tokenize=False, add_generation_prompt=True), dict(add_special_tokens=False)
    order = list(range(len(convs)))
    random.Random(seed).shuffle(order)
    for i in order:
        if len(prompts) == num_seqs:
            break
        if len(convs[i]) < 2 or convs[i][1]["role"] != "assistant":
            continue
        text, answer = convs[i][0]["content"], convs[i][1]["content"]
        if tokenizer.chat_template:
            text = tokenizer.apply_chat_template([dict(role="user", content=text)], **chat)
        ids, ref_len = tokenizer.encode(text, **plain), len(tokenizer.encode(answer, **plain))
        if min_len <= len(ids) <= max_input_len and ref_len >= min_len:
            prompts.append(ids)
            max_tokens.append(min(ref_len, max_output_len))
    return prompts, max_tokens


def acceptance_stats(accept_lengths, num_steps):
    """accept_lengths: per-request lists (accepted drafts + 1 per verify step). Returns (mean accept length,
    [fraction of verify steps accepting >= i drafts for i = 1..num_steps], number of verify steps); None where
    there is no verify step."""
    flat = [a for req in accept_lengths for a in req]
    n = len(flat)
    rates = [sum(a >= i + 1 for a in flat) / n if n else None for i in range(1, num_steps + 1)]
    return (sum(flat) / n if n else None), rates, n


def write_shape_dir(shape, out: Path) -> Path:
    """A random-weight model dir in ``out``: the shape's config.json ("smollm2-135m": the default model's,
    "qwen3-0.6b": Qwen3-0.6B's) plus the default SmolLM2 tokenizer files."""
    for f in loader.resolve_model_dir(None).iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "generation_config.json":
            shutil.copy(f, out / f.name)
    if shape == "qwen3-0.6b":
        from transformers import Qwen3Config

        Qwen3Config(**QWEN3_0_6B).save_pretrained(out)  # vocab > tokenizer's: fine for random token ids
    return out


def write_random_assistant(model_dir, out, seed=0) -> Path:
    """A 2-layer gemma4_assistant with random weights (``train.init_assistant``) that fits the target in
    ``model_dir`` (its hidden size and q geometry, sharing its LM head), saved in ``out``."""
    from ..models.gemma4_assistant import Gemma4Assistant, assistant_config_for
    from .train import init_assistant

    config = assistant_config_for(loader.load_config(model_dir), 2, use_target_lm_head=True)
    assistant = Gemma4Assistant(config)
    init_assistant(assistant, seed)
    return assistant.save_pretrained(out)


def sync(device) -> None:
    """Wait for the GPU (timing); nothing on CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run_hf(model_dir, random_init, prompts, params, device, dtype, batch_size, eos_ids):
    """HF transformers ``generate`` over ``prompts`` (token-id lists) with the ``params`` (SamplingParams)
    nanospec ran, in left-padded batches of ``batch_size`` (1: per request). Counts per request the tokens
    nanospec would emit (<= its max_tokens, cut after the first id in ``eos_ids`` unless ignore_eos). Returns
    (tokens, seconds)."""
    from transformers import AutoConfig, AutoModelForCausalLM, logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    if random_init:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.to(device, dtype).eval()
    temp = params[0].temperature  # one temperature for the whole workload
    sampling = dict(do_sample=temp > 0) | (dict(temperature=temp, top_k=0, top_p=1.0) if temp > 0 else {})

    def gen(ps, sps):  # tokens nanospec would count for this batch
        n, mx, ignore_eos = max(map(len, ps)), max(sp.max_tokens for sp in sps), sps[0].ignore_eos
        ids = torch.tensor([[0] * (n - len(p)) + p for p in ps], device=device)
        mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in ps], device=device)
        kw = dict(max_new_tokens=mx, min_new_tokens=mx if ignore_eos else None, pad_token_id=0, **sampling)
        with torch.inference_mode():
            rows = model.generate(input_ids=ids, attention_mask=mask, **kw)[:, n:].tolist()
        rows = [row[: sp.max_tokens] for row, sp in zip(rows, sps)]
        eos = set() if ignore_eos else eos_ids
        return sum(next((i + 1 for i, t in enumerate(r) if t in eos), len(r)) for r in rows)

    gen([prompts[0][:16]], [SamplingParams(max_tokens=min(8, params[0].max_tokens))])  # warmup
    torch.manual_seed(0)
    sync(device)
    t0, total = time.perf_counter(), 0
    for i in range(0, len(prompts), batch_size):
        total += gen(prompts[i : i + batch_size], params[i : i + batch_size])
    sync(device)
    return total, time.perf_counter() - t0


def kernel_bench(dtype=torch.bfloat16, contexts=(8192, 16384, 32768)) -> list[dict]:
    """HBM bandwidth of decode, frozen-KV draft (topk 3) and tree-verify (12 nodes) attention for 8 requests
    of each context length, 32 query / 8 KV heads of 128, page size 16 (CUDA only, triton.testing.do_bench).

    Bytes counted = the K/V rows each kernel must read once (batch x context x 2 x Hkv x D x elt); the copy
    baseline is a device-to-device copy of the same size (read + write counted)."""
    from triton.testing import do_bench

    from ..kernels.attention import decode_attention, draft_attention, extend_attention

    B, Hq, Hkv, D, page, k, N, rows = 8, 32, 8, 128, 16, 3, 12, []
    dev, i32 = torch.device("cuda"), dict(device="cuda", dtype=torch.int32)
    for ctx in contexts:
        kc, vc = (torch.randn(B * ctx // page + 1, page, Hkv, D, device=dev, dtype=dtype) for _ in range(2))
        bt, lens = (1 + torch.arange(B * ctx // page, **i32)).view(B, -1), torch.full((B,), ctx, **i32)
        kv_bytes = 2 * B * ctx * Hkv * D * kc.element_size()
        src = torch.empty(kv_bytes // 2, dtype=torch.int16, device=dev)
        copy_bw = 2 * kv_bytes / (do_bench(src.clone) * 1e-3)
        q, qd, qt = (torch.randn(b, Hq, D, device=dev, dtype=dtype) for b in (B, B * k, B * N))
        r2r, cu = torch.arange(B, **i32).repeat_interleave(k), torch.arange(0, (B + 1) * N, N, **i32)
        mask = torch.tril(torch.ones(N, N, dtype=torch.bool, device=dev)).expand(B, N, N).contiguous()
        splits = max(1, min(32, ctx // 256))
        runs = [("decode", partial(decode_attention, q, kc, vc, bt, lens, D**-0.5, num_splits=splits))]
        runs.append(("draft", partial(draft_attention, qd, kc, vc, bt, lens, r2r, 1.0, splits)))
        runs.append(("tree_verify", partial(extend_attention, qt, kc, vc, bt, cu, lens, D**-0.5, N, mask)))
        for name, fn in runs:
            ms = do_bench(fn)
            bw = kv_bytes / (ms * 1e-3)
            rows.append(dict(kernel=name, context=ctx, batch=B, ms=ms, bandwidth_tb_s=bw / 1e12))
            rows[-1].update(copy_tb_s=copy_bw / 1e12, fraction_of_copy=bw / copy_bw)
            print(f"{name:12s} ctx {ctx:6d}: {ms:.3f} ms, {bw / 1e12:.2f} TB/s = {bw / copy_bw:.0%} of copy")
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    """bench.py's options (``--help``); bad values are argparse errors. Fills the workload's defaults in."""
    ap = argparse.ArgumentParser("bench.py", description=__doc__, formatter_class=HelpFormatter)
    a = ap.add_argument
    a("--workload", choices=["nanovllm", "sharegpt"], default="nanovllm")
    a("--batch-1", action="store_true", help="latency mode: one request at a time (ms/token, tok/s)")
    a("--model", help="HF-format model dir (default: SmolLM2-135M-Instruct)")
    a("--shape", choices=["qwen3-0.6b", "smollm2-135m"], help="random weights of this shape")
    a("--device", choices=["auto", "cpu", "cuda"], default="auto")
    a("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    for name, default in (("max-model-len", 4096), ("max-num-seqs", 256), ("max-num-batched-tokens", 8192)):
        a(f"--{name}", type=number(int, 1), default=default)
    a("--max-input-len", type=number(int, 1), default=1024)
    a("--max-output-len", type=number(int, 1), default=1024)
    a("--seed", type=number(int, 0), default=0)
    a("--enforce-eager", action="store_true")
    a("--num-seqs", type=number(int, 1), help="requests (default 256; 16 with --batch-1)")
    a("--temperature", type=number(), help="default 0.6 (nanovllm), 0.0 (sharegpt)")
    a("--ignore-eos", action="store_true", help="sharegpt: always generate output_len tokens")
    a("--assistant", default="auto", help="DIR | default | random | none | auto (the default one if it fits)")
    for name in ("--num-steps", "--topk", "--num-draft-tokens"):
        a(name, type=number(int, 1))
    a("--compare-hf", action="store_true", help="also run HF transformers on the same workload")
    a("--kernels", action="store_true", help="attention kernel micro-benchmark (HBM bandwidth; CUDA only)")
    a("--hf-num-seqs", type=number(int, 1), help="HF runs only the first N requests (it is slow)")
    a("--hf-batch-size", type=number(int, 1), default=1, help="HF generate batch (left-padded)")
    args = ap.parse_args(argv)
    if args.model and args.shape:
        ap.error("give --model or --shape, not both")
    if args.assistant not in ("auto", "default", "random", "none") and not Path(args.assistant).is_dir():
        ap.error(f"--assistant must be auto, default, random, none or a dir, got {args.assistant!r}")
    if args.assistant == "auto":  # as example.py: speculation is what nanospec is for
        shipped = not (args.model or args.shape) and (DEFAULT_ASSISTANT / "config.json").exists()
        args.assistant = "default" if shipped else "none"
    if args.temperature is None:
        args.temperature = 0.6 if args.workload == "nanovllm" else 0.0
    args.num_seqs = args.num_seqs or (16 if args.batch_1 else 256)
    args.ignore_eos = args.ignore_eos or args.workload == "nanovllm"
    return args


def run(args: argparse.Namespace, tmp: Path) -> dict:
    """One benchmark run of ``parse_args``'s options (random-weight dirs go in ``tmp``): prints the Total line
    (and HF's); returns the figures, with every option."""
    model_dir = write_shape_dir(args.shape, tmp) if args.shape else loader.resolve_model_dir(args.model)
    assistant = None if args.assistant == "none" else args.assistant
    if assistant == "random":
        assistant = str(write_random_assistant(model_dir, tmp / "assistant", args.seed))
    names = "dtype device max_model_len max_num_seqs max_num_batched_tokens enforce_eager seed".split()
    engine = {k: getattr(args, k) for k in names} | dict(load_format="dummy" if args.shape else "auto")
    if assistant is not None:
        engine.update(assistant=assistant, num_steps=args.num_steps, topk=args.topk)
        engine.update(num_draft_tokens=args.num_draft_tokens)
    llm = LLM(str(model_dir), **engine)
    sizes = (args.num_seqs, args.max_input_len, args.max_output_len, args.seed)
    if args.workload == "nanovllm":
        prompts, max_tokens = nanovllm_workload(*sizes)
    else:
        prompts, max_tokens = sharegpt_workload(llm.tokenizer, *sizes)
    sp = dict(temperature=args.temperature, ignore_eos=args.ignore_eos)
    params = [SamplingParams(max_tokens=m, seed=args.seed + i, **sp) for i, m in enumerate(max_tokens)]
    warmup = dict(sp, ignore_eos=True, max_tokens=min(64, args.max_output_len))
    llm.generate(["Benchmark: "], SamplingParams(**warmup), use_tqdm=False)
    device, dtype, cfg = llm.runner.device, llm.config.torch_dtype(), llm.config
    sync(device)
    t0 = time.perf_counter()
    if args.batch_1:
        outputs = [o for p, sp in zip(prompts, params) for o in llm.generate([p], [sp], use_tqdm=False)]
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    sync(device)
    elapsed = time.perf_counter() - t0
    total = sum(len(o["token_ids"]) for o in outputs)
    acc = acceptance_stats([o.get("accept_lengths", []) for o in outputs], cfg.num_steps or 0)
    res = vars(args) | dict(model=None if args.shape else str(model_dir), device=str(device))
    res.update(dtype=str(dtype).replace("torch.", ""), num_seqs=len(prompts), total_tokens=total)
    res.update(input_tokens=sum(map(len, prompts)), time_s=elapsed, throughput_tok_s=total / elapsed)
    res.update(ms_per_token=1000 * elapsed / total if args.batch_1 else None)
    res.update(assistant=None if assistant is None else args.assistant)
    res.update(num_steps=cfg.num_steps, topk=cfg.topk, num_draft_tokens=cfg.num_draft_tokens)
    res.update(mean_accept_length=acc[0], per_position_acceptance=acc[1], num_verify_steps=acc[2])
    eos_ids = set(llm.eos_token_ids)
    del llm, outputs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the engine's KV pool is gone before HF loads
    print(f"Total: {total}tok, Time: {elapsed:.2f}s, Throughput: {total / elapsed:.2f}tok/s")
    if args.compare_hf:
        n, bs = min(args.hf_num_seqs or len(prompts), len(prompts)), 1 if args.batch_1 else args.hf_batch_size
        hf = (bool(args.shape), prompts[:n], params[:n], device, dtype, bs, eos_ids)
        hf_tok, hf_t = run_hf(model_dir, *hf)
        res.update(hf_num_seqs=n, hf_batch_size=bs, hf_total_tokens=hf_tok, hf_time_s=hf_t)
        res.update(hf_throughput_tok_s=hf_tok / hf_t, hf_ratio=total / elapsed / (hf_tok / hf_t))
        note = f" (reduced workload: first {n} of {len(prompts)} requests)" if n < len(prompts) else ""
        hf_line = f"Total: {hf_tok}tok, Time: {hf_t:.2f}s, Throughput: {hf_tok / hf_t:.2f}tok/s{note}"
        print(f"HF transformers: {hf_line}, batch {bs}; nanospec / HF throughput = {res['hf_ratio']:.2f}x")
        print(f"{hf_line}{note}, batch {bs}; nanospec / HF throughput = {res['hf_ratio']:.2f}x")
    return res


def main(argv=None) -> dict:
    """``bench.py`` / ``nanospec-bench``: ``parse_args``, then ``run`` (or ``kernel_bench``); prints the
    figures as one JSON line last and returns them."""
    args = parse_args(argv)
    loader.configure_cpu_threads()
    if args.kernels and not torch.cuda.is_available():
        raise SystemExit("--kernels needs a CUDA GPU (triton.testing.do_bench)")
    with tempfile.TemporaryDirectory(prefix="nanospec-bench-") as tmp:
        res = {"kernels": kernel_bench()} if args.kernels else run(args, Path(tmp))
    print(json.dumps(res))
    return res
