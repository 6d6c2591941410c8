"""Quick generation with nanospec: chat prompts through SmolLM2-135M-Instruct (default model, no hub access).

    python example.py                       # default model; the shipped assistant when present
    python example.py --model DIR --assistant none --temperature 0.7

Every option is checked before a model is loaded (most before torch is even imported).
"""

import argparse
import math
import os
import time

PROMPTS = [
    "Introduce yourself in two sentences.",
    "List all prime numbers below 30.",
    "What is the capital of France, and what is it famous for?",
    "Write a haiku about the sea.",
]


def bounded(typ, lo, hi=math.inf):
    """argparse type: a finite ``typ`` in [lo, hi]."""

    def parse(text):
        try:
            v = typ(text)
        except ValueError:
            v = math.nan
        if not (math.isfinite(v) and lo <= v <= hi):
            kind = "an int" if typ is int else "a number"
            raise argparse.ArgumentTypeError(f"must be {kind} in [{lo}, {hi}], got {text!r}")
        return v

    return parse


def parse_args(argv=None):
    """Every option checked here, before torch or a model is loaded (``--help`` needs neither)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF-format Llama/Qwen3/Gemma 4 dir (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--assistant", default="auto", help="gemma4_assistant dir | default | none | auto")
    ap.add_argument("--num-steps", type=bounded(int, 1), help="most draft steps (3 on CPU, 5 on CUDA)")
    adaptive = dict(action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--adaptive-speculation", **adaptive, help="draft 0..num-steps tokens per step, as pays")
    ap.add_argument("--max-tokens", type=bounded(int, 1, 4096), default=128, help="new tokens per prompt")
    ap.add_argument("--temperature", type=bounded(float, 0), default=0.0, help="0 is greedy")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--tensor-parallel-size", type=bounded(int, 1), default=1, help="GPUs to split it across")
    ap.add_argument("--trace", action="store_true", help="print the Frozen-KV MTP lifecycle events per step")
    ap.add_argument(
        "--deterministic",
        action="store_true",
        help="LLM(deterministic=True): each request's tokens bitwise independent of its batch",
    )
    args = ap.parse_args(argv)
    if args.model is not None and not os.path.isdir(args.model):
        ap.error(f"--model must be an HF-format model dir, got {args.model!r} (no such dir)")
    if args.assistant not in ("auto", "default", "none") and not os.path.isdir(args.assistant):
        ap.error(f"--assistant must be auto, default, none or a gemma4_assistant dir, got {args.assistant!r}")
    return ap, args


def main(argv=None):
    ap, args = parse_args(argv)
    import torch

    from nanospec import LLM, SamplingParams
    from nanospec.cpu import configure_cpu_threads
    from nanospec.mtp.worker import DEFAULT_ASSISTANT

    try:
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    except (TypeError, ValueError) as e:
        ap.error(str(e))
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device (use cpu or auto)")
    assistant = args.assistant
    if assistant == "auto":  # the shipped assistant on the default model
        shipped = args.model is None and (DEFAULT_ASSISTANT / "config.json").exists()
        assistant = "default" if shipped else "none"
    for flag, given in (("--num-steps", args.num_steps is not None), ("--trace", args.trace)):
        if assistant == "none" and given:
            ap.error(f"{flag} needs an assistant (--assistant is none, or auto on another --model)")
    spec = dict(assistant=assistant, num_steps=args.num_steps, adaptive_speculation=args.adaptive_speculation)
    assistant_kwargs = {} if assistant == "none" else spec
    if args.trace:
        assistant_kwargs["trace"] = True
    configure_cpu_threads()
    try:  # what the engine rejects (an assistant that does not fit the model, ...) is a usage error too
        llm = LLM(
            args.model,
            device=args.device,
            max_model_len=args.max_tokens + 256,
            tensor_parallel_size=args.tensor_parallel_size,
            deterministic=args.deterministic,
            **assistant_kwargs,
        )
    except ValueError as e:
        ap.error(str(e))
    chat = dict(tokenize=False, add_generation_prompt=True)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], **chat) for p in PROMPTS]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.trace)
    dt = time.perf_counter() - t0
    for prompt, out in zip(PROMPTS, outputs):
        print(f"\nPrompt: {prompt!r}\nCompletion: {out['text']!r}")
    ntok = sum(len(o["token_ids"]) for o in outputs)
    what = "no assistant" if assistant == "none" else f"assistant {assistant}"
    print(f"\n{ntok} tokens in {dt:.2f}s: {ntok / dt:.1f} tok/s ({llm.runner.device}, {what})")
    if assistant != "none":
        acc = [a for o in outputs for a in o["accept_lengths"]]
        print(f"mean acceptance length: {sum(acc) / max(len(acc), 1):.2f} tokens per verify step")
    llm.close()


if __name__ == "__main__":
    main()
