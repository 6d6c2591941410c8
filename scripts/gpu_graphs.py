"""CUDA graphs vs eager on one GPU: the same greedy tokens for plain decode, chain speculation (S = 3) and
tree speculation (S = 3, k = 3, N = 8) with a random-weight assistant, in fp32 and bf16, over 50 held-out
ShareGPT prompts (96 new tokens each); also the token-match rate of speculation on vs off. Then the MoE path:
Gemma 4 26B-A4B's first 2 layers with random weights (bf16, its assistant's shape), plain and chain, over 16
of the prompts. Prints one JSON line; exits 1 unless graphs and eager agree everywhere.

    python scripts/gpu_graphs.py
"""

import json
import sys
import tempfile
from pathlib import Path

from nanospec import LLM, SamplingParams
from nanospec.loader import resolve_model_dir
from nanospec.tools.bench import sharegpt_workload, write_random_assistant, write_shape_dir


def main() -> int:
    model = str(resolve_model_dir(None))
    res = {}
    tokens = {}
    with tempfile.TemporaryDirectory() as tmp:
        assistant = str(write_random_assistant(model, Path(tmp) / "assistant"))
        tok = LLM(model, device="cuda", max_model_len=1024, enforce_eager=True).tokenizer
        prompts = sharegpt_workload(tok, 50, 512, 128)[0]
        runs = {"plain": {}, "chain": dict(assistant=assistant, num_steps=3)}
        runs["tree"] = dict(assistant=assistant, num_steps=3, topk=3, num_draft_tokens=8)
        sp = SamplingParams(max_tokens=96)
        engine = dict(device="cuda", max_model_len=1024, max_num_seqs=64)
        for dtype in ("float32", "bfloat16"):
            for name, kw in runs.items():
                outs = []
                for eager in (True, False):
                    llm = LLM(model, dtype=dtype, enforce_eager=eager, **engine, **kw)
                    outs.append([o["token_ids"] for o in llm.generate(prompts, sp, use_tqdm=False)])
                res[f"{dtype}_{name}_graphs_equal_eager"] = outs[0] == outs[1]
                tokens[dtype, name] = outs[1]
        (Path(tmp) / "moe").mkdir()
        moe = write_shape_dir("gemma4-26b-a4b", Path(tmp) / "moe", num_layers=2)
        moe_assistant = str(write_random_assistant(moe, Path(tmp) / "moe_assistant", shape="gemma4-26b-a4b"))
        engine |= dict(dtype="bfloat16", load_format="dummy")
        for name, kw in {"plain": {}, "chain": dict(assistant=moe_assistant, num_steps=3)}.items():
            outs = []
            for eager in (True, False):
                llm = LLM(str(moe), enforce_eager=eager, **engine, **kw)
                outs.append([o["token_ids"] for o in llm.generate(prompts[:16], sp, use_tqdm=False)])
                del llm
            res[f"moe_26b_a4b_2_layers_{name}_graphs_equal_eager"] = outs[0] == outs[1]
    for (dtype, name), outs in tokens.items():  # greedy spec-on vs spec-off (fp32: lossless up to rounding)
        if name != "plain":
            pairs = zip(tokens[dtype, "plain"], outs)
            res[f"{dtype}_{name}_match_rate"] = sum(x == y for x, y in pairs) / len(prompts)
    print(json.dumps(res))
    return 0 if all(v for k, v in res.items() if k.endswith("_eager")) else 1


if __name__ == "__main__":
    sys.exit(main())
