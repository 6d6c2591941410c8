"""Quick generation with nanospec: chat prompts through SmolLM2-135M-Instruct (the default model, no hub
access), drafted by its shipped Frozen-KV MTP assistant.

    python example.py                       # default model; the shipped assistant when present
    python example.py --model DIR --assistant none --temperature 0.7
    python example.py --trace --verbose     # each verify step as text; where the start-up time goes

Every option is checked before a model is loaded (nanospec/tools/cli.py, example_options).
"""

import logging
import sys
import time

from nanospec.tools.cli import example_options

PROMPTS = [
    "Introduce yourself in two sentences.",
    "List all prime numbers below 30.",
    "What is the capital of France, and what is it famous for?",
    "Write a haiku about the sea.",
]


def main(argv=None):
    started = time.perf_counter()
    options = example_options(argv, __doc__)
    from nanospec import LLM, SamplingParams

    if options.verbose:  # where the start-up time goes: options and imports, then LLM() phase by phase
        took = time.perf_counter() - started
        print(f"nanospec: options, CPU threads and imports took {took:.2f} s", file=sys.stderr)
        logging.getLogger("nanospec").setLevel(logging.INFO)
        logging.getLogger("nanospec").addHandler(logging.StreamHandler())

    try:  # what the engine rejects (an assistant that does not fit the model, ...) is a usage error too
        params = SamplingParams(temperature=options.temperature, max_tokens=options.max_tokens)
        llm = LLM(options.model, max_num_seqs=len(PROMPTS), **options.engine)  # a KV pool for 4 requests
    except (TypeError, ValueError) as e:
        options.error(str(e))
    chat = dict(tokenize=False, add_generation_prompt=True)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], **chat) for p in PROMPTS]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not options.trace)
    seconds = time.perf_counter() - start
    for prompt, out in zip(PROMPTS, outputs):
        print(f"\nPrompt: {prompt!r}\nCompletion: {out['text']!r}")
    num_tokens = sum(len(o["token_ids"]) for o in outputs)
    what = "no assistant" if options.assistant == "none" else f"assistant {options.assistant}"
    speed = f"{num_tokens} tokens in {seconds:.2f}s: {num_tokens / seconds:.1f} tok/s"
    print(f"\n{speed} ({llm.runner.device}, {what})")
    if options.assistant != "none":
        accepted = [a for o in outputs for a in o["accept_lengths"]]
        print(f"mean acceptance length: {sum(accepted) / max(len(accepted), 1):.2f} tokens per verify step")
    if options.trace:
        print(llm.tracer.histogram())
    llm.close()


if __name__ == "__main__":
    main()
