"""Deterministic mode, measured on the default model: greedy tokens of held-out ShareGPT prompts with
speculation off and on, one request at a time and in batches, with ``deterministic`` off and on.

    python scripts/deterministic_check.py --device cpu --dtype bfloat16 --num-prompts 32 --batch 16
    python scripts/deterministic_check.py --device cuda --num-prompts 50 --batch 32        # (gpu_run.sh)

Per mode, four runs of the same prompts (``--max-tokens`` new tokens each, ignore_eos): plain decoding one
request at a time (the reference), plain decoding ``--batch`` requests at a time, and the same two with the
shipped assistant (chain, ``--num-steps``). Runs alternate between the modes, config by config, on engines
built once per mode and speculation setting, prefix caching off (every run prefills every prompt). Prints
per mode and run: prompts whose tokens equal the reference's, the token-match rate (tokens before each
prompt's first divergence / tokens compared), the first divergences (token index), the wall time; then each
run's time with the mode on / off and the total. One JSON line last; exits 1 if a run with the mode on
differs from its reference.
"""

import argparse
import json
import sys
import time

import torch

from nanospec import LLM, SamplingParams
from nanospec.loader import load_tokenizer, resolve_model_dir
from nanospec.tools.bench import sharegpt_workload
from nanospec.tools.cli import configure_cpu_threads, number


def compare(ref, out):
    """(identical prompts, tokens before each first divergence / tokens compared, first divergences)."""
    first = [
        next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), min(len(r), len(o)))
        for r, o in zip(ref, out)
    ]
    diverged = [f for f, r, o in zip(first, ref, out) if r != o]
    return sum(r == o for r, o in zip(ref, out)), sum(first) / sum(map(len, ref)), diverged


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--num-prompts", type=number(int, 1), default=32)
    ap.add_argument("--max-tokens", type=number(int, 1), default=128)
    ap.add_argument("--max-input-len", type=number(int, 4), default=512, help="longest prompt (tokens)")
    ap.add_argument("--batch", type=number(int, 1), default=16, help="requests per generate call")
    ap.add_argument("--num-steps", type=number(int, 1), help="draft steps (the engine's default when unset)")
    args = ap.parse_args(argv)
    configure_cpu_threads()
    model = str(resolve_model_dir(None))
    prompts = sharegpt_workload(load_tokenizer(model), args.num_prompts, args.max_input_len, 8)[0]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    engine = dict(device=args.device, dtype=args.dtype, enable_prefix_caching=False)
    engine["max_model_len"] = max(map(len, prompts)) + args.max_tokens + 8
    runs = {"plain_batch1": ({}, 1), f"plain_batch{args.batch}": ({}, args.batch)}
    spec = dict(assistant="default", num_steps=args.num_steps)
    runs.update({"spec_batch1": (spec, 1), f"spec_batch{args.batch}": (spec, args.batch)})
    llms = {
        (det, s): LLM(model, deterministic=det, **engine, **(spec if s else {}))
        for det in (False, True)
        for s in (False, True)
    }
    for llm in llms.values():  # warm-up: compile and capture outside the timed runs
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    tokens = {}
    seconds = {}
    for name, (kw, batch) in runs.items():
        for det in (False, True):
            llm = llms[det, bool(kw)]
            if args.device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = [
                o["token_ids"]
                for i in range(0, len(prompts), batch)
                for o in llm.generate(prompts[i : i + batch], params, use_tqdm=False)
            ]
            if args.device == "cuda":
                torch.cuda.synchronize()
            seconds[det, name] = time.perf_counter() - t0
            tokens[det, name] = out
    res = dict(vars(args), prompts=len(prompts), torch=torch.__version__, threads=torch.get_num_threads())
    ok = True
    for det in (False, True):
        mode = "deterministic" if det else "default"
        for name in runs:
            same, rate, first = compare(tokens[det, "plain_batch1"], tokens[det, name])
            res[f"{mode}_{name}"] = dict(
                identical=same, match_rate=rate, first_divergence=first, time_s=seconds[det, name]
            )
            ok &= not det or same == len(prompts)
            print(
                f"{mode:13} {name:15} identical {same}/{len(prompts)}  match rate {rate:.3f}  "
                f"first divergence {sorted(first)}  {seconds[det, name]:.1f} s",
                flush=True,
            )
    slow = {name: seconds[True, name] / seconds[False, name] for name in runs}
    res["slowdown"] = slow | dict(
        total=sum(seconds[True, n] for n in runs) / sum(seconds[False, n] for n in runs)
    )
    print("deterministic / default time: " + ", ".join(f"{k} {v:.2f}x" for k, v in res["slowdown"].items()))
    print(json.dumps(res))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
