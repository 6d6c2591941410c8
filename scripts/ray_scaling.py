"""Ray Data throughput of nanospec with 1 and 2 replicas on the same prompts, in one run (docs/scaling.md).

    python scripts/ray_scaling.py --num-prompts 32 --max-tokens 64 --repeats 3

A local Ray cluster of ``--num-cpus`` CPUs (loopback only) runs ``LLMPredictor`` over held-out ShareGPT
prompts (the default model, greedy, ignore_eos: every run generates the same tokens), with 1 replica, then 2,
``--repeats`` times alternating. Each replica is one actor with one CPU and one torch thread (Ray sets
OMP_NUM_THREADS to the actor's CPUs) and takes one batch of ``--batch-size`` prompts at a time. Throughput =
generated tokens / the span from the first batch's start to the last batch's end (each batch times itself in
its actor; the batches go out once every replica has built its engine, so start-up and model load are left
out); the best run of each size is kept, since the machine may be shared. Prints one line per run, then one
JSON line with the best throughputs and their ratio.
"""

import argparse
import json
import os
import secrets
import tempfile
import time

from nanospec.loader import load_tokenizer, resolve_model_dir
from nanospec.ray import LLMPredictor
from nanospec.tools.bench import sharegpt_workload
from nanospec.tools.cli import number


class TimedPredictor(LLMPredictor):
    """``LLMPredictor`` that also records when each batch started and ended (wall clock, seconds)."""

    def __call__(self, batch):
        start = time.time()
        out = super().__call__(batch)
        n = len(out["finish_reason"])
        return out | {"batch_start": [start] * n, "batch_end": [time.time()] * n}


def run(ray, prompts, args, replicas: int) -> dict:
    sampling = dict(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    options = dict(sampling_params=sampling, max_model_len=1024, cpu_kv_cache_gb=0.25)
    ds = ray.data.from_items([{"prompt_token_ids": p} for p in prompts])
    pool = ray.data.ActorPoolStrategy(size=replicas, max_tasks_in_flight_per_actor=1)
    ds = ds.map_batches(
        TimedPredictor, fn_constructor_kwargs=options, compute=pool, batch_size=args.batch_size
    )
    t0 = time.perf_counter()
    rows = ds.take_all()
    wall = time.perf_counter() - t0
    tokens = sum(r["num_generated_tokens"] for r in rows)
    span = max(r["batch_end"] for r in rows) - min(r["batch_start"] for r in rows)
    return dict(
        replicas=replicas, tokens=tokens, span_s=round(span, 2), wall_s=round(wall, 2), tok_s=tokens / span
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=number(int, 1), default=32)
    ap.add_argument("--max-tokens", type=number(int, 1), default=64)
    ap.add_argument("--batch-size", type=number(int, 1), default=8)
    ap.add_argument("--repeats", type=number(int, 1), default=3)
    ap.add_argument("--num-cpus", type=number(int, 2), default=2)
    args = ap.parse_args()
    prompts = sharegpt_workload(load_tokenizer(resolve_model_dir(None)), args.num_prompts, max_input_len=256)[
        0
    ]
    # Ray's single-machine mode (servers on 127.0.0.1); an auth token in the environment, none in ~/.ray
    os.environ.update(
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(16),
        RAY_USAGE_STATS_ENABLED="0",
    )
    import ray

    session_dir = tempfile.TemporaryDirectory(prefix="ray-")  # Ray's logs and sockets, removed at the end
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False, _temp_dir=session_dir.name)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.wait_for_min_actors_s = 600  # every replica has its engine before the first batch goes out
    try:
        best = {}
        for _ in range(args.repeats):
            for replicas in (1, 2):
                r = run(ray, prompts, args, replicas)
                print(json.dumps(r | dict(tok_s=round(r["tok_s"], 1))), flush=True)
                best[replicas] = max(best.get(replicas, 0), r["tok_s"])
    finally:
        ray.shutdown()
        session_dir.cleanup()
    summary = dict(prompts=len(prompts), max_tokens=args.max_tokens, batch_size=args.batch_size)
    summary |= {f"best_tok_s_{k}": round(v, 1) for k, v in best.items()} | {
        "ratio": round(best[2] / best[1], 2)
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
