"""Acceptance of a Frozen-KV MTP assistant, measured by running nanospec itself.

    python -m nanospec.tools.eval [--assistant DIR|default] [--num-prompts 16] [--max-tokens 64]
        [--steps 1,3,5] [--topks 1,3] [--temperatures 0,0.7] [--datasets sharegpt,humaneval]

Prompts: the first user turn of the held-out ShareGPT "eval" split (``nanospec.tools.datasets``; never used in
training), less any text that also occurs as a user turn in the train split (ShareGPT repeats some), through
the target's chat template, and HumanEval code prompts (raw, as a completion). Each configuration (dataset x
temperature x num_steps x topk) generates ``--max-tokens`` tokens per prompt (``ignore_eos``) and reports the
mean acceptance length (tokens emitted per verify step = 1 + accepted drafts) and per-position acceptance: the
fraction of verify steps with accept_length >= i + 1, i = 1..S. topk > 1 verifies ``num_draft_tokens = 1 + 2 *
num_steps`` tree tokens (``--tree-tokens`` overrides; clipped to [2, 1 + S * k]); e.g. S=5, k=3 -> N=11, close
to SGLang's N=12 for that shape.

``--datasets sharegpt-train`` adds the first user turns of the train split (what the trainer saw): an
acceptance there far above the held-out one means the assistant memorised its training data.
"""

import itertools
import time

from . import cli


def build_prompts(tokenizer, datasets, num_prompts: int, max_prompt_tokens: int) -> dict[str, list]:
    """``{"sharegpt-eval": [...], "sharegpt-train": [...], "humaneval": [...]}`` (those named in
    ``datasets``): up to ``num_prompts`` token-id prompts each, clipped to ``max_prompt_tokens`` (HumanEval:
    its last tokens)."""
    from .datasets import chat_prompts, load_humaneval, load_sharegpt

    out = {}
    if "sharegpt" in datasets:
        seen = {m["content"] for conv in load_sharegpt("train") for m in conv if m["role"] == "user"}
        texts = [conv[0]["content"] for conv in load_sharegpt("eval") if conv[0]["content"] not in seen]
        out["sharegpt-eval"] = chat_prompts(tokenizer, texts, max_prompt_tokens)[:num_prompts]
    if "sharegpt-train" in datasets:
        texts = [conv[0]["content"] for conv in load_sharegpt("train", num_prompts)]
        out["sharegpt-train"] = chat_prompts(tokenizer, texts, max_prompt_tokens)
    if "humaneval" in datasets:
        enc = [tokenizer.encode(p, add_special_tokens=False) for p in load_humaneval(num_prompts)]
        out["humaneval"] = [ids[-max_prompt_tokens:] for ids in enc]
    return out


def measure(model, assistant, prompts, S, k, temperature, max_tokens, tree_tokens=None, batch=16, **engine):
    """Generate ``max_tokens`` tokens (``ignore_eos``, seed 0) per prompt with speculation (``num_steps=S``,
    ``topk=k``), ``batch`` prompts per ``generate`` call; ``engine``: further ``LLM`` options.

    Returns ``(mean accept length, per-position acceptance [S] floats, generated tok/s, N)``, N = tokens
    verified per request and step (S + 1 for k = 1, else ``tree_tokens`` or 1 + 2S, clipped to [2, 1 + S *
    k])."""
    from .. import LLM, SamplingParams

    n = None if k == 1 else max(2, min(1 + S * k, tree_tokens or 1 + 2 * S))
    spec = dict(num_steps=S, topk=k, num_draft_tokens=n, adaptive_speculation=False)
    with LLM(model, assistant=assistant, **spec, **engine) as llm:
        sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=0)
        outs = []
        t0 = time.perf_counter()
        for i in range(0, len(prompts), batch):
            outs += llm.generate(prompts[i : i + batch], sp, use_tqdm=False)
    acc = [a for o in outs for a in o["accept_lengths"]]
    ntok = sum(len(o["token_ids"]) for o in outs)
    per_pos = [sum(a >= i + 1 for a in acc) / len(acc) for i in range(1, S + 1)]
    return sum(acc) / len(acc), per_pos, ntok / (time.perf_counter() - t0), n or S + 1


def main(argv=None):
    """The evaluation CLI (module docstring); every value is checked before any model or data work."""
    ap, add = cli.parser("nanospec-eval", __doc__)
    add("--model", help="target dir (default: SmolLM2-135M-Instruct)")
    add("--assistant", default="default", help="gemma4_assistant dir or 'default'")
    add("--num-prompts", type=cli.number(int, 1), default=16, help="prompts per dataset")
    add("--max-tokens", type=cli.number(int, 2), default=64, help="new tokens per prompt (one is prefill's)")
    add("--max-prompt-tokens", type=cli.number(int, 1), default=256, help="prompts clipped to N tokens")
    add("--steps", type=cli.number_list(int, 1), default=[1, 3, 5], help="num_steps values")
    add("--topks", type=cli.number_list(int, 1), default=[1, 3], help="topk values")
    add("--temperatures", type=cli.number_list(), default=[0.0, 0.7], help="sampling temperatures")
    add("--datasets", default="sharegpt,humaneval", help="of sharegpt (held out), sharegpt-train, humaneval")
    add("--tree-tokens", type=cli.number(int, 2), help="num_draft_tokens for topk > 1")
    add("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    cli.add_tensor_parallel_size(ap)
    cli.add_deterministic(ap)
    a = ap.parse_args(argv)
    cli.check_deterministic(ap, a, a.topks)
    datasets = a.datasets.split(",")
    if not set(datasets) <= {"sharegpt", "sharegpt-train", "humaneval"}:
        ap.error(f"--datasets must name sharegpt, sharegpt-train and/or humaneval, got {a.datasets!r}")
    cli.load_assistant(ap, "--assistant", a.assistant)  # a few MB: fails before the target
    model_dir, _, tok = cli.load_target(ap, "--model", a.model, "--assistant", a.assistant)
    cli.configure_cpu_threads()
    sets = build_prompts(tok, datasets, a.num_prompts, a.max_prompt_tokens)
    engine = {k: getattr(a, k) for k in ("dtype", "tensor_parallel_size", "deterministic")}
    engine["max_model_len"] = max(map(len, sum(sets.values(), []))) + a.max_tokens + 16
    print(f"assistant={a.assistant} max_tokens={a.max_tokens} prompts:", {k: len(v) for k, v in sets.items()})
    head = ["dataset", "temp", "S", "k", "N", "mean acc len"] + [f"p{i}" for i in range(1, max(a.steps) + 1)]
    print("| " + " | ".join(head + ["tok/s"]) + " |\n|" + "---|" * (len(head) + 1), flush=True)
    for (name, prompts), t, S, k in itertools.product(sets.items(), a.temperatures, a.steps, a.topks):
        m, pp, tps, N = measure(a.model, a.assistant, prompts, S, k, t, a.max_tokens, a.tree_tokens, **engine)
        cells = [name, f"{t:g}", str(S), str(k), str(N), f"{m:.2f}"] + [f"{x:.2f}" for x in pp]
        print("| " + " | ".join(cells + [""] * (max(a.steps) - S) + [f"{tps:.1f}"]) + " |", flush=True)


if __name__ == "__main__":
    main()
