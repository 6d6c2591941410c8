"""Acceptance of a Frozen-KV MTP assistant, measured by running nanospec itself.

    python -m nanospec.eval_acceptance [--assistant DIR|default] [--num-prompts 16] [--max-tokens 64]
        [--steps 1,3,5] [--topks 1,3] [--temperatures 0,0.7] [--datasets sharegpt,humaneval]

Prompts: the first user turn of the held-out ShareGPT "eval" split (``nanospec.datasets``; never used in training),
less any text that also occurs as a user turn in the train split (ShareGPT repeats some), through the target's
chat template, and HumanEval code prompts (raw, as a completion). Each configuration
(dataset x temperature x num_steps x topk) generates ``--max-tokens`` tokens per prompt (``ignore_eos``) and
reports the mean acceptance length (tokens emitted per verify step = 1 + accepted drafts) and per-position
acceptance: the fraction of verify steps with accept_length >= i + 1, i = 1..S.
topk > 1 verifies ``num_draft_tokens = 1 + 2 * num_steps`` tree tokens (``--tree-tokens`` overrides; clipped to
[2, 1 + S * k]); e.g. S=5, k=3 -> N=11, close to SGLang's N=12 for that shape.
"""
from __future__ import annotations

import argparse
import time


def build_prompts(tokenizer, datasets: list[str], num_prompts: int, max_prompt_tokens: int) -> dict[str, list]:
    from .datasets import chat_prompts, load_humaneval, load_sharegpt

    out = {}
    if "sharegpt" in datasets:
        seen = {m["content"] for conv in load_sharegpt("train") for m in conv if m["role"] == "user"}
        texts = [conv[0]["content"] for conv in load_sharegpt("eval") if conv[0]["content"] not in seen]
        out["sharegpt-eval"] = chat_prompts(tokenizer, texts, max_prompt_tokens)[:num_prompts]
    if "humaneval" in datasets:
        out["humaneval"] = [tokenizer.encode(p, add_special_tokens=False)[-max_prompt_tokens:]
                            for p in load_humaneval(num_prompts)]
    return out


def measure(model, assistant, prompts, S, k, temperature, max_tokens, tree_tokens=None, batch=16, **engine):
    """Run nanospec with speculation; returns (mean accept length, per-position acceptance list, tok/s)."""
    from . import LLM, SamplingParams

    n = None if k == 1 else max(2, min(1 + S * k, tree_tokens or 1 + 2 * S))
    llm = LLM(model, assistant=assistant, num_steps=S, topk=k, num_draft_tokens=n, **engine)
    sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=0)
    acc, t0, ntok = [], time.perf_counter(), 0
    for i in range(0, len(prompts), batch):
        for o in llm.generate(prompts[i:i + batch], sp, use_tqdm=False):
            acc += o["accept_lengths"]
            ntok += len(o["token_ids"])
    per_pos = [sum(a >= i + 1 for a in acc) / len(acc) for i in range(1, S + 1)]
    return sum(acc) / len(acc), per_pos, ntok / (time.perf_counter() - t0), n or S + 1


def main(argv=None):
    from .cli import HelpFormatter, check_ranges, load_assistant, number_list

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--model", default=None, help="target dir (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--assistant", default="default", help="gemma4_assistant dir or 'default'")
    ap.add_argument("--num-prompts", type=int, default=16, help="prompts per dataset")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (>= 2: the first is prefill's)")
    ap.add_argument("--max-prompt-tokens", type=int, default=256, help="prompts clipped to N tokens")
    ap.add_argument("--steps", default="1,3,5", help="num_steps values")
    ap.add_argument("--topks", default="1,3", help="topk values")
    ap.add_argument("--temperatures", default="0,0.7", help="sampling temperatures")
    ap.add_argument("--datasets", default="sharegpt,humaneval", help="sharegpt and/or humaneval")
    ap.add_argument("--tree-tokens", type=int, default=None, help="num_draft_tokens for topk > 1")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    a = ap.parse_args(argv)
    check_ranges(ap, a, dict(num_prompts=(1, False), max_tokens=(2, False), max_prompt_tokens=(1, False),
                             tree_tokens=(2, False), threads=(1, False)))
    steps, topks = number_list(ap, "--steps", a.steps, int, 1), number_list(ap, "--topks", a.topks, int, 1)
    temps = number_list(ap, "--temperatures", a.temperatures)
    datasets = a.datasets.split(",")
    if not set(datasets) <= {"sharegpt", "humaneval"}:
        ap.error(f"--datasets must name sharegpt and/or humaneval, got {a.datasets!r}")
    load_assistant(ap, "--assistant", a.assistant)  # a few MB on CPU: a bad one fails before the target loads
    import torch

    from .loader import is_default_target, load_config, load_tokenizer, resolve_model_dir
    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        model_dir = resolve_model_dir(a.model)
        tok = load_tokenizer(model_dir)
    except (ValueError, OSError) as e:
        ap.error(f"--model: {e}")
    if a.assistant == "default" and not is_default_target(load_config(model_dir), tok):
        ap.error("--assistant default is SmolLM2-135M-Instruct's assistant; pass --assistant DIR for this --model")
    sets = build_prompts(tok, datasets, a.num_prompts, a.max_prompt_tokens)
    max_len = max(len(p) for ps in sets.values() for p in ps) + a.max_tokens + 16
    engine = dict(dtype=a.dtype, max_model_len=max_len)
    S_max = max(steps)
    print(f"assistant={a.assistant} prompts={ {k: len(v) for k, v in sets.items()} } max_tokens={a.max_tokens} "
          f"dtype={a.dtype}")
    head = ["dataset", "temp", "S", "k", "N", "mean acc len"] + [f"p{i}" for i in range(1, S_max + 1)] + ["tok/s"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head), flush=True)
    for name, prompts in sets.items():
        for t in temps:
            for S in steps:
                for k in topks:
                    m, pp, tps, N = measure(a.model, a.assistant, prompts, S, k, t, a.max_tokens, a.tree_tokens,
                                            **engine)
                    cells = [name, f"{t:g}", str(S), str(k), str(N), f"{m:.2f}"]
                    cells += [f"{x:.2f}" for x in pp] + [""] * (S_max - S) + [f"{tps:.1f}"]
                    print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
