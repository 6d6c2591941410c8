"""Teacher-forced agreement of an assistant with the target on prompts from the train and the eval split (eval
prompts as ``eval_acceptance`` picks them: none that also occurs in train): the
target answers each prompt greedily, then for every committed length past the prompt the trainer's own unroll
(``nanospec.train_assistant``) gives per-step KL and top-1 agreement. A large train/eval gap means memorisation.

    OMP_NUM_THREADS=1 python scripts/agreement.py [--assistant DIR|default] [--num-prompts 16] [--max-tokens 96]
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from nanospec import LLM, SamplingParams  # noqa: E402
from nanospec.datasets import chat_prompts, load_sharegpt  # noqa: E402
from nanospec.eval_acceptance import build_prompts  # noqa: E402
from nanospec.loader import load_config, resolve_model_dir  # noqa: E402
from nanospec.model_runner import build_target  # noqa: E402
from nanospec.models.gemma4_assistant import Gemma4Assistant  # noqa: E402
from nanospec.mtp.worker import resolve_assistant  # noqa: E402
from nanospec.train_assistant import capture_target, distill_loss, sample_positions  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--assistant", default="default")
ap.add_argument("--num-prompts", type=int, default=16)
ap.add_argument("--max-tokens", type=int, default=96)
a = ap.parse_args()
md = resolve_model_dir(None)
llm = LLM(str(md), dtype="float32", device="cpu", max_model_len=512)
target = build_target(load_config(md), "cpu", torch.float32, 512, md)
assistant = Gemma4Assistant.from_pretrained(resolve_assistant(a.assistant, target_is_default=True))
assistant.bind_target(target, kv=False)
splits = {"train": chat_prompts(llm.tokenizer, [c[0]["content"] for c in load_sharegpt("train")[:a.num_prompts]], 192),
          "eval": build_prompts(llm.tokenizer, ["sharegpt"], a.num_prompts, 192)["sharegpt-eval"]}  # held-out only
for split, prompts in splits.items():
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=a.max_tokens), use_tqdm=False)
    tokens, lens, hidden, kv = capture_target(target, [p + o["token_ids"] for p, o in zip(prompts, outs)],
                                              assistant.layer_map(target.kv_layer_types))
    Ls, valid = sample_positions(lens, 512, torch.Generator().manual_seed(0), torch.tensor(list(map(len, prompts))))
    with torch.no_grad():
        loss, kls, agree = distill_loss(assistant, target, tokens, lens, hidden, kv, Ls, valid, 5)
    print(f"{split}: {int(valid.sum())} positions, loss {float(loss):.3f}, per-step KL {[round(x, 3) for x in kls]}, "
          f"top-1 agreement {[round(x, 3) for x in agree]}")
