"""Does speculation pay on this machine? The adaptive draft length against plain decoding and every fixed s.

    OMP_NUM_THREADS=1 python scripts/spec_goal.py --device cpu                  # the CPU goal (README)
    python scripts/spec_goal.py --device cuda --num-seqs 16 --max-output-len 256  # on a GPU

For each prompt set (held-out ShareGPT first turns and the chat prompts written for the benchmark, each with
and without ignore_eos) it runs, one request at a time (bench.py's --batch-1), the default model: plain (no
assistant), the shipped assistant with the adaptive draft length (the default), and the shipped assistant at
every fixed s = 1..num_steps (adaptive_speculation=False). The configurations alternate inside each round,
``--rounds`` rounds, a fresh engine per run (bench.py's ``measure``: warm-up, then the timed workload), and
each configuration's best round counts, as in ``bench.py --compare``. Prints per prompt set the tokens/s of
each configuration, adaptive / plain, adaptive / best fixed s and the steps per draft length of the adaptive
run; ``--out FILE`` writes every figure as JSON. The goal: adaptive / plain >= 1.0 on every set and adaptive
>= 0.95 x the best fixed s.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanospec import loader  # noqa: E402
from nanospec.config import EngineConfig  # noqa: E402
from nanospec.tools import bench  # noqa: E402

SETS = [("sharegpt", False), ("sharegpt", True), ("chat", False), ("chat", True)]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--num-seqs", type=int, default=4, help="prompts per set")
    ap.add_argument("--max-output-len", type=int, default=64)
    ap.add_argument("--num-steps", type=int, help="most draft steps (default: the engine's for the device)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    loader.configure_cpu_threads()
    S = args.num_steps or EngineConfig(assistant="default", device=args.device).num_steps
    configs = [("plain", None, {}), ("adaptive", "default", dict(num_steps=S))]
    configs += [(f"s={s}", "default", dict(num_steps=s, adaptive_speculation=False)) for s in range(1, S + 1)]
    model_dir, report = loader.resolve_model_dir(None), {}
    for workload, ignore_eos in SETS:
        name = f"{workload}{' ignore_eos' if ignore_eos else ''}"
        opts = [
            "--workload",
            workload,
            "--batch-1",
            "--device",
            args.device,
            "--temperature",
            "0",
            "--num-seqs",
            str(args.num_seqs),
            "--max-output-len",
            str(args.max_output_len),
        ]
        b = bench.parse_args(opts + (["--ignore-eos"] if ignore_eos else []))
        prompts, params = bench.workload(b, loader.load_tokenizer(model_dir))
        runs = {label: [] for label, _, _ in configs}
        for r in range(args.rounds):
            for label, assistant, option in configs:
                res = bench.measure(
                    b, model_dir, assistant, prompts, params, f"[{name} {label} r{r}] ", **option
                )
                runs[label].append(res)
        best = {k: max(v, key=lambda x: x["throughput_tok_s"]) for k, v in runs.items()}
        tok_s = {k: v["throughput_tok_s"] for k, v in best.items()}
        fixed = max((k for k in tok_s if k.startswith("s=")), key=tok_s.get)
        rep = dict(
            tok_s=tok_s,
            rounds_tok_s={k: [x["throughput_tok_s"] for x in v] for k, v in runs.items()},
            adaptive_over_plain=tok_s["adaptive"] / tok_s["plain"],
            best_fixed=fixed,
            adaptive_over_best_fixed=tok_s["adaptive"] / tok_s[fixed],
            draft_len_counts=best["adaptive"]["draft_len_counts"],
            mean_accept_length={k: v["mean_accept_length"] for k, v in best.items()},
            total_tokens={k: v["total_tokens"] for k, v in best.items()},
        )
        report[name] = rep
        print(
            f"== {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in tok_s.items()) + " tok/s; adaptive/plain "
            f"{rep['adaptive_over_plain']:.3f}x, adaptive/{fixed} {rep['adaptive_over_best_fixed']:.3f}x; "
            f"steps per s {rep['draft_len_counts']}",
            flush=True,
        )
    print(
        "| prompt set | plain tok/s | adaptive tok/s | adaptive / plain | best fixed s | adaptive / best "
        "fixed | steps per s (adaptive) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, rep in report.items():
        t = rep["tok_s"]
        print(
            f"| {name} | {t['plain']:.2f} | {t['adaptive']:.2f} | {rep['adaptive_over_plain']:.2f}x | "
            f"{rep['best_fixed']} ({t[rep['best_fixed']]:.2f}) | {rep['adaptive_over_best_fixed']:.2f}x | "
            f"{rep['draft_len_counts']} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(dict(args=vars(args), num_steps=S, sets=report), indent=1))
    return report


if __name__ == "__main__":
    main()
