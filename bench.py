"""Benchmark nanospec: the nano-vllm workload, ShareGPT prompts, batch-1 latency, speculation and HF transformers.

    python bench.py                                          # nano-vllm workload (256 seqs), default SmolLM2 +
                                                             # its shipped assistant (--assistant none: without)
    python bench.py --shape qwen3-0.6b --compare-hf --hf-num-seqs 16      # random weights, HF ratio in the same run
    python bench.py --workload sharegpt --batch-1                         # latency with the shipped assistant
    python bench.py --shape smollm2-135m --num-seqs 4 --max-input-len 64 --max-output-len 16 --device cpu

Prints the nano-vllm line `Total: Ntok, Time: ts, Throughput: xtok/s` (N = generated tokens), the HF line with the
ratio under --compare-hf, then one JSON line with every figure (batch-1: ms/token = wall time / generated tokens,
prefill included). `--assistant random` writes a random-weight gemma4_assistant for the target (telemetry, speed).
Absolute times count only on a GPU; on CPU compare ratios measured in one run.
"""
import argparse
import gc
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

from nanospec import LLM, SamplingParams, loader
from nanospec.mtp.worker import DEFAULT_ASSISTANT

QWEN3_0_6B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=1e-6,
                  max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645)


def nanovllm_workload(num_seqs=256, max_input_len=1024, max_output_len=1024, seed=0):
    """nano-vllm's bench.py draws, in its order: every prompt (length, then ids in [0, 10000]), then every max_tokens.
    Lengths are randint(100, max) as there; a max below 100 lowers the 100 to it (small CPU runs)."""
    random.seed(seed)
    lo_in, lo_out = min(100, max_input_len), min(100, max_output_len)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(lo_in, max_input_len))] for _ in range(num_seqs)]
    return prompts, [random.randint(lo_out, max_output_len) for _ in range(num_seqs)]


def load_sharegpt(split="eval", tokenizer=None, num_seqs=None, max_input_len=1024, max_output_len=1024, seed=0,
                  chat_template=True, min_len=4) -> list[dict]:
    """Benchmark requests from the fixed ShareGPT `split` of nanospec.datasets (the split training uses): the first
    user turn and its reference answer, of conversations with >= 2 turns, in a fixed shuffled order (`seed`). The
    prompt (chat template applied when the tokenizer has one) must have min_len..max_input_len tokens and the answer
    >= min_len; output_len = answer tokens capped at max_output_len. Returns dicts: prompt (text),
    prompt_token_ids, output_len, reference (the answer text), index (in the split)."""
    from nanospec.datasets import load_sharegpt as sharegpt_conversations
    tokenizer = tokenizer or loader.load_tokenizer(loader.resolve_model_dir(None))
    convs = sharegpt_conversations(split)
    order = list(range(len(convs)))
    random.Random(seed).shuffle(order)
    out = []
    for i in order:
        msgs = convs[i]  # starts with a user turn
        if len(msgs) < 2 or msgs[1]["role"] != "assistant":
            continue
        prompt, ref = msgs[0]["content"], msgs[1]["content"]
        if chat_template and tokenizer.chat_template:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                   add_generation_prompt=True)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        ref_len = len(tokenizer.encode(ref, add_special_tokens=False))
        if min_len <= len(ids) <= max_input_len and ref_len >= min_len:
            out.append(dict(prompt=prompt, prompt_token_ids=ids, output_len=min(ref_len, max_output_len),
                            reference=ref, index=i))
            if num_seqs is not None and len(out) >= num_seqs:
                break
    return out


def acceptance_stats(accept_lengths, num_steps):
    """accept_lengths: per-request lists (accepted drafts + 1 per verify step). Returns (mean accept length,
    [fraction of verify steps accepting >= i drafts for i = 1..num_steps], number of verify steps)."""
    flat = [a for req in accept_lengths for a in req]
    n = len(flat)
    return (sum(flat) / n if n else None), [sum(a >= i + 1 for a in flat) / n if n else None
                                            for i in range(1, num_steps + 1)], n


def write_shape_dir(shape, out):
    """A random-weight model dir: the shape's config.json plus the default SmolLM2 tokenizer files."""
    src = loader.resolve_model_dir(None)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "generation_config.json":
            shutil.copy(f, out / f.name)
    if shape == "qwen3-0.6b":
        from transformers import Qwen3Config
        Qwen3Config(**QWEN3_0_6B).save_pretrained(out)  # vocab > tokenizer's: fine for random token ids
    return out


def write_random_assistant(model_dir, out, seed=0):
    """A random-weight gemma4_assistant (2 layers, hidden = target hidden / 2) that fits the target's geometry."""
    from transformers import AutoConfig, Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig
    t = AutoConfig.from_pretrained(model_dir)
    rope = dict(getattr(t, "rope_parameters", None) or {"rope_type": "default", "rope_theta": t.rope_theta})
    hd = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    tc = Gemma4TextConfig(vocab_size=t.vocab_size, hidden_size=t.hidden_size // 2, intermediate_size=t.hidden_size,
                          num_hidden_layers=2, num_attention_heads=t.num_attention_heads, head_dim=hd,
                          num_key_value_heads=t.num_key_value_heads, global_head_dim=hd, vocab_size_per_layer_input=0,
                          layer_types=["full_attention"] * 2, hidden_size_per_layer_input=0,
                          rope_parameters=dict(full_attention=rope, sliding_attention=rope))
    torch.manual_seed(seed)
    Gemma4AssistantForCausalLM(Gemma4AssistantConfig(text_config=tc, backbone_hidden_size=t.hidden_size)
                               ).save_pretrained(out)
    return out


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run_hf(model_dir, random_init, prompts, max_tokens, temperature, ignore_eos, device, dtype, batch_size, eos_ids):
    """HF transformers `generate` in left-padded batches of `batch_size` (1: per request). Counts per request the
    tokens nanospec would emit (<= its max_tokens, cut after the first EOS unless ignore_eos). Returns (tokens, s)."""
    from transformers import AutoConfig, AutoModelForCausalLM as Auto, logging
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    model = (Auto.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype) if random_init
             else Auto.from_pretrained(model_dir, dtype=dtype)).to(device).eval()
    pad, kw = 0, dict(do_sample=temperature > 0, **(dict(temperature=temperature, top_k=0, top_p=1.0)
                                                     if temperature > 0 else {}))

    def gen(ps, mts):
        n, mx = max(map(len, ps)), max(mts)
        ids = torch.tensor([[pad] * (n - len(p)) + p for p in ps], device=device)
        mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in ps], device=device)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=mx, pad_token_id=pad,
                                 min_new_tokens=mx if ignore_eos else None, **kw)[:, n:].tolist()
        cut = [next((i + 1 for i, t in enumerate(row[:m]) if t in eos_ids), len(row[:m])) for row, m in zip(out, mts)]
        return sum(m if ignore_eos else c for m, c in zip(mts, cut))

    gen([prompts[0][:16]], [min(8, max_tokens[0])])  # warmup
    torch.manual_seed(0)
    _sync(device)
    t0 = time.perf_counter()
    total = sum(gen(prompts[i:i + batch_size], max_tokens[i:i + batch_size])
                for i in range(0, len(prompts), batch_size))
    _sync(device)
    return total, time.perf_counter() - t0


def kernel_bench(dtype=torch.bfloat16, contexts=(8192, 16384, 32768), batch=8, heads=(32, 8, 128), page_size=16,
                 topk=3, num_draft_tokens=12) -> list[dict]:
    """HBM bandwidth of decode, frozen-KV draft and tree-verify attention (CUDA only, triton.testing.do_bench).

    Bytes counted = the K/V rows each kernel must read once (batch x context x 2 x Hkv x D x elt); the copy
    baseline is a device-to-device copy of the same size (read + write counted)."""
    from triton.testing import do_bench

    from nanospec.kernels.attention import decode_attention, draft_attention, extend_attention

    Hq, Hkv, D = heads
    dev, rows = torch.device("cuda"), []
    for ctx in contexts:
        nb = batch * ctx // page_size
        kc, vc = (torch.randn(nb + 1, page_size, Hkv, D, device=dev, dtype=dtype) for _ in range(2))
        bt = (1 + torch.arange(nb, device=dev, dtype=torch.int32)).view(batch, -1)
        lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
        kv_bytes = 2 * batch * ctx * Hkv * D * kc.element_size()
        src = torch.empty(kv_bytes // 2, dtype=torch.int16, device=dev)
        copy_bw = 2 * kv_bytes / (do_bench(lambda: src.clone()) * 1e-3)
        q = torch.randn(batch, Hq, D, device=dev, dtype=dtype)
        qd = torch.randn(batch * topk, Hq, D, device=dev, dtype=dtype)
        r2r = torch.arange(batch, device=dev, dtype=torch.int32).repeat_interleave(topk)
        N = num_draft_tokens
        qt = torch.randn(batch * N, Hq, D, device=dev, dtype=dtype)
        cu = torch.arange(0, (batch + 1) * N, N, device=dev, dtype=torch.int32)
        mask = torch.tril(torch.ones(N, N, dtype=torch.bool, device=dev)).expand(batch, N, N).contiguous()
        splits = max(1, min(32, ctx // 256))
        for name, fn in (("decode", lambda: decode_attention(q, kc, vc, bt, lens, D ** -0.5, num_splits=splits)),
                         ("draft", lambda: draft_attention(qd, kc, vc, bt, lens, r2r, 1.0, splits)),
                         ("tree_verify", lambda: extend_attention(qt, kc, vc, bt, cu, lens, D ** -0.5, N, mask))):
            ms = do_bench(fn)
            bw = kv_bytes / (ms * 1e-3)
            rows.append(dict(kernel=name, context=ctx, batch=batch, ms=ms, bandwidth_tb_s=bw / 1e12,
                             copy_tb_s=copy_bw / 1e12, fraction_of_copy=bw / copy_bw))
            print(f"{name:12s} ctx {ctx:6d}: {ms:.3f} ms, {bw / 1e12:.2f} TB/s = {bw / copy_bw:.0%} of copy")
    return rows


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = ap.add_argument
    a("--workload", choices=["nanovllm", "sharegpt"], default="nanovllm")
    a("--batch-1", action="store_true", help="latency mode: one request at a time (ms/token, tok/s)")
    a("--model", default=None, help="HF-format model dir (default: SmolLM2-135M-Instruct)")
    a("--shape", choices=["qwen3-0.6b", "smollm2-135m"], default=None, help="random weights of this shape")
    a("--device", default="auto", help="auto | cpu | cuda")
    a("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    for name, default in (("--max-model-len", 4096), ("--max-num-seqs", 256), ("--max-num-batched-tokens", 8192),
                          ("--max-input-len", 1024), ("--max-output-len", 1024), ("--seed", 0)):
        a(name, type=int, default=default)
    a("--enforce-eager", action="store_true")
    a("--num-seqs", type=int, default=None, help="requests (default 256; 16 with --batch-1)")
    a("--temperature", type=float, default=None, help="default 0.6 (nanovllm), 0.0 (sharegpt)")
    a("--ignore-eos", action="store_true", help="sharegpt: always generate output_len tokens (nanovllm always does)")
    a("--assistant", default="auto",
      help="gemma4_assistant DIR | default | random | none | auto (the shipped one on the default model, else none)")
    for name in ("--num-steps", "--topk", "--num-draft-tokens"):
        a(name, type=int, default=None)
    a("--compare-hf", action="store_true", help="also run HF transformers on the same workload")
    a("--kernels", action="store_true", help="attention kernel micro-benchmark (HBM bandwidth; CUDA only)")
    a("--hf-num-seqs", type=int, default=None, help="HF runs only the first N requests (it is slow)")
    a("--hf-batch-size", type=int, default=1, help="HF generate batch (left-padded); 1 = per request")
    args = ap.parse_args(argv)
    if args.model and args.shape:
        ap.error("give --model or --shape, not both")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.kernels:
        if not torch.cuda.is_available():
            raise SystemExit("--kernels needs a CUDA GPU (triton.testing.do_bench)")
        res = {"kernels": kernel_bench()}
        print(json.dumps(res))
        return res
    num_seqs = args.num_seqs or (16 if args.batch_1 else 256)
    temperature = args.temperature if args.temperature is not None else 0.6 if args.workload == "nanovllm" else 0.0
    with tempfile.TemporaryDirectory(prefix="nanospec-bench-") as tmp:
        model_dir = write_shape_dir(args.shape, Path(tmp)) if args.shape else loader.resolve_model_dir(args.model)
        if args.assistant == "auto":  # as example.py: speculation is what nanospec is for
            shipped = args.model is None and args.shape is None and (DEFAULT_ASSISTANT / "config.json").exists()
            args.assistant = "default" if shipped else "none"
        assistant = None if args.assistant in ("none", "random") else args.assistant
        if args.assistant == "random":
            assistant = str(write_random_assistant(model_dir, Path(tmp) / "assistant", args.seed))
        spec = {} if assistant is None else dict(assistant=assistant, num_steps=args.num_steps, topk=args.topk,
                                                 num_draft_tokens=args.num_draft_tokens)
        llm = LLM(str(model_dir), dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  enforce_eager=args.enforce_eager, seed=args.seed, load_format="dummy" if args.shape else "auto",
                  **spec)
        if args.workload == "nanovllm":
            prompts, max_tokens = nanovllm_workload(num_seqs, args.max_input_len, args.max_output_len, args.seed)
        else:
            reqs = load_sharegpt("eval", llm.tokenizer, num_seqs, args.max_input_len, args.max_output_len, args.seed)
            prompts, max_tokens = [r["prompt_token_ids"] for r in reqs], [r["output_len"] for r in reqs]
        ignore_eos = args.workload == "nanovllm" or args.ignore_eos
        params = [SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=ignore_eos, seed=args.seed + i)
                  for i, m in enumerate(max_tokens)]
        llm.generate(["Benchmark: "], SamplingParams(temperature=temperature, max_tokens=min(64, args.max_output_len),
                                                      ignore_eos=True), use_tqdm=False)  # warmup
        device, dtype, cfg, eos_ids = llm.runner.device, llm.config.torch_dtype(), llm.config, set(llm.eos_token_ids)
        _sync(device)
        t0 = time.perf_counter()
        if args.batch_1:
            outputs = [o for p, sp in zip(prompts, params) for o in llm.generate([p], [sp], use_tqdm=False)]
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        _sync(device)
        elapsed = time.perf_counter() - t0
        total = sum(len(o["token_ids"]) for o in outputs)
        mean_acc, per_pos, n_verify = acceptance_stats([o.get("accept_lengths", []) for o in outputs],
                                                       cfg.num_steps or 0)
        res = dict(workload=args.workload, batch_1=args.batch_1, model=None if args.shape else str(model_dir),
                   shape=args.shape, device=str(device), dtype=str(dtype).replace("torch.", ""), num_seqs=len(prompts),
                   input_tokens=sum(map(len, prompts)), total_tokens=total, time_s=elapsed,
                   throughput_tok_s=total / elapsed, ms_per_token=1000 * elapsed / total if args.batch_1 else None,
                   temperature=temperature, ignore_eos=ignore_eos, max_model_len=cfg.max_model_len,
                   max_num_seqs=cfg.max_num_seqs, **{k: getattr(args, k) for k in (
                       "max_input_len", "max_output_len", "enforce_eager", "seed")},
                   assistant=args.assistant if spec else None, num_steps=cfg.num_steps, topk=cfg.topk,
                   num_draft_tokens=cfg.num_draft_tokens, mean_accept_length=mean_acc,
                   per_position_acceptance=per_pos, num_verify_steps=n_verify)
        del llm, outputs
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the engine's KV pool is gone before HF loads
        print(f"Total: {total}tok, Time: {elapsed:.2f}s, Throughput: {total / elapsed:.2f}tok/s")
        if args.compare_hf:
            n, bs = min(args.hf_num_seqs or len(prompts), len(prompts)), 1 if args.batch_1 else args.hf_batch_size
            hf_tok, hf_t = run_hf(model_dir, bool(args.shape), prompts[:n], max_tokens[:n], temperature, ignore_eos,
                                  device, dtype, bs, eos_ids)
            res.update(hf_num_seqs=n, hf_batch_size=bs, hf_total_tokens=hf_tok, hf_time_s=hf_t,
                       hf_throughput_tok_s=hf_tok / hf_t, hf_ratio=total / elapsed / (hf_tok / hf_t))
            note = f" (reduced workload: first {n} of {len(prompts)} requests)" if n < len(prompts) else ""
            print(f"HF transformers: Total: {hf_tok}tok, Time: {hf_t:.2f}s, Throughput: {hf_tok / hf_t:.2f}tok/s"
                  f"{note}, batch {bs}; nanospec / HF throughput = {res['hf_ratio']:.2f}x")
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
