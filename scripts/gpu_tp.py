"""Tensor parallelism on 2+ GPUs (`scripts/gpu_check.sh` step `tp`): tokens at tensor_parallel_size=2 equal
those at 1 (fp32, greedy, tiny random Gemma 4 31B-like target and assistant: spec off, chain, tree), then the
decode throughput ratio TP2 / TP1 on the real Gemma 4 31B shape with random weights (bench.py, bf16). Exit
status 1 if the tokens differ."""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4ForCausalLM
from transformers import Gemma4TextConfig as Text

from nanospec import LLM, SamplingParams
from nanospec.loader import load_tokenizer, resolve_model_dir

S = "sliding_attention"
F = "full_attention"
ROPE = {S: {"rope_type": "default", "rope_theta": 1e4}}
ROPE[F] = {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}
COMMON = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, head_dim=16, global_head_dim=32)
COMMON.update(max_position_embeddings=256, rope_parameters=ROPE, rms_norm_eps=1e-6, pad_token_id=0)
COMMON.update(bos_token_id=2, eos_token_id=None, tie_word_embeddings=True, num_key_value_heads=2)
COMMON.update(
    num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=5, hidden_size_per_layer_input=0
)


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g) * 0.15 + (1.0 if t.dim() == 1 else 0.0))


def tiny_dirs(tmp: Path):
    """A 31B-like tiny target (k_eq_v, 5:1 sliding, softcap) and a 3-layer assistant, random, saved in tmp."""
    types = [S] * 5 + [F, S, F]
    hf = Gemma4ForCausalLM(
        Text(**COMMON, num_hidden_layers=8, layer_types=types, intermediate_size=96)
    ).float()
    randomize(hf, 1)
    hf.save_pretrained(tmp / "target")
    load_tokenizer(resolve_model_dir(None)).save_pretrained(tmp / "target")
    text = Text(
        **{**COMMON, "hidden_size": 32},
        num_hidden_layers=3,
        layer_types=[S, S, F],
        intermediate_size=64,
        vocab_size_per_layer_input=0,
    )
    a = Gemma4AssistantForCausalLM(Gemma4AssistantConfig(text_config=text, backbone_hidden_size=64)).float()
    randomize(a, 7)
    a.save_pretrained(tmp / "assistant")
    return tmp / "target", tmp / "assistant"


def tokens(target, assistant, n, spec):
    kw = dict(device="cuda", dtype="float32", max_model_len=128, page_size=4, tensor_parallel_size=n)
    kw |= {} if spec is None else dict(assistant=str(assistant), **spec)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 256, (k,), generator=g).tolist() for k in (4, 12, 19, 33)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(str(target), **kw) as llm:
        return [o["token_ids"] for o in llm.generate(prompts, sp, use_tqdm=False)]


def bench(n):
    cmd = [sys.executable, "bench.py", "--shape", "gemma4-31b", "--assistant", "none", "--num-seqs", "16"]
    cmd += [
        "--max-input-len",
        "256",
        "--max-output-len",
        "128",
        "--max-model-len",
        "1024",
        "--temperature",
        "0",
    ]
    out = subprocess.run(cmd + ["--tensor-parallel-size", str(n)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["throughput_tok_s"]


def main():
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        target, assistant = tiny_dirs(Path(tmp))
        for name, spec in (
            ("off", None),
            ("chain", dict(num_steps=3)),
            ("tree", dict(num_steps=3, topk=2, num_draft_tokens=5)),
        ):
            same = tokens(target, assistant, 1, spec) == tokens(target, assistant, 2, spec)
            ok &= same
            print(f"tokens TP2 == TP1, spec {name}: {same}", flush=True)
    t1 = bench(1)
    t2 = bench(2)
    print(f"gemma4-31b decode throughput: TP1 {t1:.1f} tok/s, TP2 {t2:.1f} tok/s, TP2/TP1 = {t2 / t1:.2f}x")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
