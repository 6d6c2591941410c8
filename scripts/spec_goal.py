"""Does speculation pay on this machine? The adaptive draft length against plain decoding and every fixed s.

    OMP_NUM_THREADS=1 python scripts/spec_goal.py --device cpu    # the CPU goal (docs/benchmarks.md)
    python scripts/spec_goal.py --device cuda --num-seqs 16 --max-output-len 256  # on a GPU

For each prompt set (held-out ShareGPT first turns and the chat prompts written for the benchmark, each with
and without ignore_eos; bench.py's ``workload``), greedy (or ``--temperature T``, each prompt seeded), one
request at a time (bench.py's --batch-1), the
default model runs as: plain (no assistant), the shipped assistant with the adaptive draft length (the
default), and the shipped assistant at every fixed s = 1..num_steps (adaptive_speculation=False). Every engine
is built and warmed up first (64 tokens, as bench.py), then each prompt runs on every engine, ``--rounds``
times over the set. On a CPU (``--turn 8``) every engine holds the prompt at once and they take 8 engine steps
each in turn, each engine timed over its own steps, so a machine that gets faster or slower (other processes,
clocks; step times 32 steps apart still correlate by 0.5) weighs on every engine alike, while each engine
still runs warm (one step per turn would make every step start with another engine's data in the caches: step
times up by 5 % at s = 1 and 18 % at s = 2, medians on the chat prompts); on a GPU (``--turn 0``, as an
engine's step returns before its device work ends) one engine generates the prompt, then the next, the order
rotating from prompt to prompt. Tokens/s of an engine = its tokens / its seconds over all rounds. The engines
keep their state between requests, as a running server does (the adaptive policy's acceptance and step costs
too). Prints per prompt set each engine's tokens/s, adaptive / plain, adaptive / best fixed s and the steps
per draft length of the adaptive engine, then a Markdown table; ``--out FILE`` writes every figure as JSON.
The goal: adaptive / plain >= 1.0 on every set, adaptive >= 0.95 x the best fixed s.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanospec import LLM, SamplingParams, loader  # noqa: E402
from nanospec.config import EngineConfig  # noqa: E402
from nanospec.tools import bench  # noqa: E402
from nanospec.tools.cli import configure_cpu_threads, number  # noqa: E402

SETS = [("sharegpt", False), ("sharegpt", True), ("chat", False), ("chat", True)]


def run_set(engines, prompts, params, rounds: int, turn: int) -> dict:
    """Every prompt on every engine (rotating order), ``rounds`` times; ``turn`` > 0: the engines hold the
    prompt at once and take up to ``turn`` engine steps each in turn, each engine timed over its own steps
    (on a CPU, where a step runs inside its call); 0: one engine generates the prompt, then the next.
    Returns per engine label: tokens, seconds, accept lengths, and the adaptive policy's steps per s
    during the set."""
    labels = list(engines)
    before = {k: dict(llm.worker.policy.counts) for k, llm in engines.items() if llm.worker}
    stats = {k: dict(tokens=0, seconds=0.0, accept=[]) for k in labels}
    for _ in range(rounds):
        for i, (p, sp) in enumerate(zip(prompts, params)):
            order = labels[i % len(labels) :] + labels[: i % len(labels)]
            outs = {}
            if not turn:
                for k in order:
                    t0 = time.perf_counter()
                    outs[k] = engines[k].generate([p], [sp], use_tqdm=False)[0]
                    stats[k]["seconds"] += time.perf_counter() - t0
            else:
                for k in order:
                    engines[k].add_request(p, sp)
                while len(outs) < len(order):
                    for k in [k for k in order if k not in outs]:
                        for _ in range(turn):
                            t0 = time.perf_counter()
                            done = engines[k].step()
                            stats[k]["seconds"] += time.perf_counter() - t0
                            if done:
                                outs[k] = engines[k].output_dict(done[0])
                                break
            for k, out in outs.items():
                stats[k]["tokens"] += len(out["token_ids"])
                stats[k]["accept"] += out.get("accept_lengths", [])
    for k, counts in before.items():
        now = engines[k].worker.policy.counts
        stats[k]["draft_len_counts"] = {str(s): n - counts.get(s, 0) for s, n in sorted(now.items())}
    return stats


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--num-seqs", type=number(int, 1), default=4, help="prompts per set")
    ap.add_argument("--max-output-len", type=number(int, 1), default=64)
    ap.add_argument("--num-steps", type=number(int, 1), help="most draft steps (default: the device's)")
    ap.add_argument("--rounds", type=number(int, 1), default=2, help="passes over each prompt set")
    ap.add_argument("--temperature", type=number(float, 0.0), default=0.0, help="0: greedy (default)")
    ap.add_argument("--out", help="write the figures as JSON here")
    turn_help = "engine steps per turn, 0: whole requests (default: 8 on cpu, 0 on cuda)"
    ap.add_argument("--turn", type=number(int, 0), help=turn_help)
    args = ap.parse_args(argv)
    configure_cpu_threads()
    S = args.num_steps or EngineConfig(assistant="default", device=args.device).num_steps
    configs = {"plain": dict(assistant=None), "adaptive": dict(assistant="default", num_steps=S)}
    for s in range(1, S + 1):
        configs[f"s={s}"] = dict(assistant="default", num_steps=s, adaptive_speculation=False)
    # one request at a time: 320 blocks of 16 tokens hold max_model_len 4096 and the verify rows (258 needed),
    # so every engine fits beside the others
    engines = {k: LLM(device=args.device, num_kv_blocks=320, **kw) for k, kw in configs.items()}
    warm = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=64)
    for llm in engines.values():
        llm.generate(["Benchmark: "], warm, use_tqdm=False)
    if args.turn is None:
        args.turn = 8 if args.device == "cpu" else 0
    tokenizer = loader.load_tokenizer(loader.resolve_model_dir(None))
    report = {}
    for workload, ignore_eos in SETS:
        name = workload + (" ignore_eos" if ignore_eos else "")
        opts = ["--workload", workload, "--batch-1", "--num-seqs", str(args.num_seqs)]
        opts += ["--temperature", str(args.temperature)]
        b = bench.parse_args(
            opts + ["--max-output-len", str(args.max_output_len)] + ["--ignore-eos"] * ignore_eos
        )
        prompts, params = bench.workload(b, tokenizer)
        stats = run_set(engines, prompts, params, args.rounds, args.turn)
        tok_s = {k: v["tokens"] / v["seconds"] for k, v in stats.items()}
        fixed = max((k for k in tok_s if k.startswith("s=")), key=tok_s.get)
        acc = {k: sum(v["accept"]) / len(v["accept"]) if v["accept"] else None for k, v in stats.items()}
        rep = dict(tok_s=tok_s, tokens={k: v["tokens"] for k, v in stats.items()}, mean_accept_length=acc)
        rep.update(adaptive_over_plain=tok_s["adaptive"] / tok_s["plain"], best_fixed=fixed)
        rep.update(adaptive_over_best_fixed=tok_s["adaptive"] / tok_s[fixed])
        rep.update(draft_len_counts=stats["adaptive"]["draft_len_counts"])
        report[name] = rep
        figs = ", ".join(f"{k} {v:.2f}" for k, v in tok_s.items())
        print(
            f"== {name}: {figs} tok/s; adaptive/plain {rep['adaptive_over_plain']:.3f}x, adaptive/{fixed} "
            f"{rep['adaptive_over_best_fixed']:.3f}x; steps per s {rep['draft_len_counts']}",
            flush=True,
        )
    print(
        "| prompt set | plain tok/s | adaptive tok/s | adaptive / plain | best fixed s (tok/s) | "
        "adaptive / best fixed | steps per s (adaptive) | mean acceptance (adaptive) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, rep in report.items():
        t = rep["tok_s"]
        fixed = rep["best_fixed"]
        print(
            f"| {name} | {t['plain']:.2f} | {t['adaptive']:.2f} | {rep['adaptive_over_plain']:.2f}x | "
            f"{fixed} ({t[fixed]:.2f}) | {rep['adaptive_over_best_fixed']:.2f}x | "
            f"{rep['draft_len_counts']} | {rep['mean_accept_length']['adaptive'] or 1:.2f} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(dict(args=vars(args), num_steps=S, sets=report), indent=1))
    return report


if __name__ == "__main__":
    main()
