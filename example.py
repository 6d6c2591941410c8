"""Quick generation with nanospec: chat prompts through SmolLM2-135M-Instruct (default model, no hub access).

    python example.py                       # default model; the shipped assistant when present
    python example.py --model DIR --assistant none --temperature 0.7
"""
import argparse
import time

from nanospec import LLM, SamplingParams
from nanospec.mtp.worker import DEFAULT_ASSISTANT

PROMPTS = [
    "Introduce yourself in two sentences.",
    "List all prime numbers below 30.",
    "What is the capital of France, and what is it famous for?",
    "Write a haiku about the sea.",
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF-format Llama/Qwen3 dir (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--assistant", default="auto",
                    help="gemma4_assistant dir, 'default', 'none', or 'auto' (the shipped one when present)")
    ap.add_argument("--num-steps", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()

    assistant = args.assistant
    if assistant == "auto":
        assistant = "default" if args.model is None and (DEFAULT_ASSISTANT / "config.json").exists() else None
    assistant = None if assistant == "none" else assistant
    spec = {} if assistant is None else {"assistant": assistant, "num_steps": args.num_steps}
    llm = LLM(args.model, device=args.device, max_model_len=2048, max_num_seqs=16, **spec)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                 add_generation_prompt=True) for p in PROMPTS]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    for prompt, out in zip(PROMPTS, outputs):
        print(f"\nPrompt: {prompt!r}\nCompletion: {out['text']!r}")
    ntok = sum(len(o["token_ids"]) for o in outputs)
    print(f"\n{ntok} tokens in {dt:.2f}s: {ntok / dt:.1f} tok/s ({llm.runner.device}, "
          f"{'assistant ' + str(assistant) if assistant else 'no assistant'})")
    if assistant:
        acc = [a for o in outputs for a in o["accept_lengths"]]
        print(f"mean acceptance length: {sum(acc) / max(len(acc), 1):.2f} tokens per verify step")


if __name__ == "__main__":
    main()
