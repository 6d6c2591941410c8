"""GPU check: CUDA graphs on vs off give identical tokens (plain decode and the speculative step), and the
bf16 greedy token-match rate of spec-on vs spec-off. Prints one JSON line."""
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import load_sharegpt, write_random_assistant  # noqa: E402
from nanospec import LLM, SamplingParams  # noqa: E402
from nanospec.loader import resolve_model_dir  # noqa: E402

model = resolve_model_dir(None)
res = {}
with tempfile.TemporaryDirectory() as tmp:
    asst = str(write_random_assistant(model, Path(tmp) / "a"))
    tok = LLM(str(model), device="cuda", max_model_len=1024, enforce_eager=True).tokenizer
    prompts = [r["prompt_token_ids"] for r in load_sharegpt("eval", tok, 50, 512, 128)]
    sp = SamplingParams(max_tokens=96)
    for dtype in ("float32", "bfloat16"):
        for name, kw in (("plain", {}), ("spec", {"assistant": asst, "num_steps": 3}),
                         ("tree", {"assistant": asst, "num_steps": 3, "topk": 3, "num_draft_tokens": 8})):
            outs = [[o["token_ids"] for o in LLM(str(model), device="cuda", dtype=dtype, max_model_len=1024,
                                                  max_num_seqs=64, enforce_eager=eager, **kw).generate(
                        prompts, sp, use_tqdm=False)] for eager in (True, False)]
            res[f"{dtype}_{name}_graphs_equal_eager"] = outs[0] == outs[1]
            res[f"{dtype}_{name}_tokens"] = outs[1]
        for name in ("spec", "tree"):
            a, b = res[f"{dtype}_plain_tokens"], res[f"{dtype}_{name}_tokens"]
            res[f"{dtype}_{name}_match_rate"] = sum(x == y for x, y in zip(a, b)) / len(a)
res = {k: v for k, v in res.items() if not k.endswith("_tokens")}
print(json.dumps(res))
