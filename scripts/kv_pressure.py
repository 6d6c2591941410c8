"""Preemptions and engine steps for a fixed workload on a tiny KV pool (docs/benchmarks.md, "Under KV
pressure").

    python scripts/kv_pressure.py                    # the default model with the shipped assistant
    python scripts/kv_pressure.py --num-steps 0      # no assistant

Eight greedy requests (token-id prompts of 5-12 tokens, 12 new tokens each, ignore_eos) on a pool of 8 blocks
of 4 tokens (the engine's minimum for max_model_len 24 with 4 rows verified per step is 8), at most 4 running,
prefill budgets of 8 tokens, prefix caching on. Prints the steps the engine ran, the preemptions, how many
requests finished within ``--max-steps``, and whether every output equals the same prompt run alone on a
roomy pool.
"""

import argparse
import random
import time

from nanospec import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-steps", type=int, default=3, help="draft steps (0: no assistant)")
    parser.add_argument("--max-steps", type=int, default=2000, help="stop after this many engine steps")
    parser.add_argument("--overlap", action="store_true", help="overlap scheduling on")
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 20000) for _ in range(rng.randint(5, 12))] for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    options = dict(max_model_len=24, enable_prefix_caching=True, overlap_schedule=args.overlap)
    if args.num_steps:
        options |= dict(assistant="default", num_steps=args.num_steps, adaptive_speculation=False)
    llm = LLM(page_size=4, num_kv_blocks=8, max_num_seqs=4, max_num_batched_tokens=8, **options)
    ids = [llm.add_request(p, params) for p in prompts]
    finished = {}
    start = time.perf_counter()
    while llm.has_unfinished() and llm.num_steps_run < args.max_steps:
        for req in llm.step():
            finished[req.request_id] = req.output_token_ids
    seconds = time.perf_counter() - start
    roomy = LLM(max_model_len=24)
    same = all(
        finished.get(i) == roomy.generate([p], params, use_tqdm=False)[0]["token_ids"]
        for i, p in zip(ids, prompts)
    )
    print(
        f"steps {llm.num_steps_run}, preemptions {llm.scheduler.num_preemptions}, finished {len(finished)} / "
        f"{len(prompts)} in {seconds:.2f}s, outputs equal to a roomy pool: {same}"
    )


if __name__ == "__main__":
    main()
