"""bf16 weights on a CPU against fp32: speed and how many held-out prompts keep their greedy tokens.

    OMP_NUM_THREADS=1 python scripts/dtype_check.py --num-prompts 16 --max-tokens 32

``LLM(dtype="bfloat16")`` stores the weights (and the KV cache) in bf16 and runs the GEMMs in bf16, which a
CPU with native bf16 dot products (AVX512-BF16, AMX) runs from half the bytes; the sampler still reads fp32
logits. Plain decoding (no assistant), greedy, the held-out ShareGPT prompts of ``bench.py --workload
sharegpt``: one request at a time, then ``--batch`` at a time, fp32 and bf16 alternating ``--repeats`` times
on engines built once; the best time of each. Prints per dtype and batch size the best wall time and tok/s,
the bf16 / fp32 speed ratio, and the prompts whose bf16 tokens equal fp32's (with the first divergences).
"""

import argparse
import time

from nanospec import LLM, SamplingParams
from nanospec.loader import load_tokenizer, resolve_model_dir
from nanospec.tools.bench import sharegpt_workload


def run(llm, prompts, max_tokens, batch):
    """(seconds, the greedy token ids per prompt), ``batch`` requests at a time."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    out = []
    for i in range(0, len(prompts), batch):
        out += [o["token_ids"] for o in llm.generate(prompts[i : i + batch], params, use_tqdm=False)]
    return time.perf_counter() - start, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    tokenizer = load_tokenizer(resolve_model_dir(None))
    prompts, _ = sharegpt_workload(tokenizer, args.num_prompts, 256, args.max_tokens)
    engines = {
        dtype: LLM(device="cpu", dtype=dtype, max_model_len=512, enable_prefix_caching=False)
        for dtype in ("float32", "bfloat16")
    }
    for llm in engines.values():
        run(llm, prompts[:1], 4, 1)  # warm-up
    for batch in (1, args.batch):
        best = {}
        tokens = {}
        for _ in range(args.repeats):
            for dtype, llm in engines.items():
                seconds, tokens[dtype] = run(llm, prompts, args.max_tokens, batch)
                best[dtype] = min(best.get(dtype, seconds), seconds)
        generated = sum(map(len, tokens["float32"]))
        for dtype, seconds in best.items():
            print(f"batch {batch}, {dtype}: {seconds:.2f} s, {generated / seconds:.1f} tok/s")
        same = [a == b for a, b in zip(tokens["float32"], tokens["bfloat16"])]
        first = [
            next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            for a, b in zip(tokens["float32"], tokens["bfloat16"])
            if a != b
        ]
        ratio = best["float32"] / best["bfloat16"]
        identical = f"{sum(same)}/{len(same)}"
        print(f"batch {batch}: bf16 / fp32 speed {ratio:.2f}x; identical greedy outputs {identical}")
        print(f"  first divergences (token index): {first}")


if __name__ == "__main__":
    main()
