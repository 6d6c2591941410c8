"""The GPU memory nanospec takes, planned without a GPU: weights, the KV cache (and how many tokens it holds),
the activations of the largest step, the CUDA graphs' memory pool and static buffers, and whether it fits.

    python scripts/memory_plan.py                                  # the default model and its assistant
    python scripts/memory_plan.py --shape gemma4-e2b --max-num-seqs 256 --num-steps 5 --gpu-memory-gib 80

The arithmetic is the engine's (``memory.memory_plan``): on CUDA the engine prints the same figures at
start, with what it measured ("nanospec: memory plan (GiB): ..."). Here two of them are estimates: the CUDA
context and allocator slack (``--runtime-gib``), and a max-chunk prefill's activations (per token: the hidden
state several times over, the MLP's intermediate, the attention's query, key and value rows), which the
engine profiles. The weights are counted from the models built on the meta device; the KV cache from the
target's KV-owning layers (Gemma 4's shared-KV layers own none).
"""

import argparse
import sys

import torch

GIB = 2**30
SHAPES = ("smollm2-135m", "qwen3-0.6b", "gemma4-e2b", "gemma4-e4b", "gemma4-26b-a4b", "gemma4-31b")


def configs(shape: str):
    """(target config, assistant config or None: the shipped one's dir is read instead) of ``shape``."""
    from transformers import Qwen3Config

    from nanospec import loader
    from nanospec.tools.checkpoints import GEMMA4, QWEN3_0_6B, gemma4_configs

    if shape in GEMMA4:
        return gemma4_configs(shape)
    if shape == "qwen3-0.6b":
        return Qwen3Config(**QWEN3_0_6B), None
    return loader.load_config(loader.resolve_model_dir(None)), None


def parameter_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def plan(args) -> dict:
    """Every figure of the plan, in bytes (and the KV cache's tokens)."""
    from nanospec.default_model import DEFAULT_ASSISTANT
    from nanospec.kernels.matmul import linear
    from nanospec.kv_cache import cdiv
    from nanospec.memory import memory_plan
    from nanospec.models import target_class
    from nanospec.models.gemma4_assistant import Gemma4Assistant
    from nanospec.parallel import SINGLE

    dtype = getattr(torch, args.dtype)
    elem = torch.finfo(dtype).bits // 8
    target_config, assistant_config = configs(args.shape)
    # the lookahead: tree nodes N, or 1 without an assistant
    num_draft_tokens = args.config.num_draft_tokens or 1
    cls, text_config = target_class(target_config)
    with torch.device("meta"):
        target = cls(text_config, args.max_model_len + num_draft_tokens, SINGLE, linear).to(dtype)
        assistant = None if assistant_config is None else Gemma4Assistant(assistant_config).to(dtype)
    weights = parameter_bytes(target)
    if args.num_steps and assistant is not None:
        weights += parameter_bytes(assistant)
    elif args.num_steps:  # the shipped assistant of the default model (bf16 safetensors)
        weights += sum(f.stat().st_size for f in DEFAULT_ASSISTANT.glob("*.safetensors")) * elem // 2
    kv_per_token = sum(2 * h * d for h, d in filter(None, target.kv_geometry)) * elem
    hidden = text_config.hidden_size
    vocab = text_config.vocab_size
    kv_heads, head_dim = max(filter(None, target.kv_geometry), key=lambda g: g[0] * g[1])
    qkv = (text_config.num_attention_heads + 2 * kv_heads) * head_dim
    per_token = (6 * hidden + 3 * text_config.intermediate_size + qkv) * elem
    # the two steps the engine profiles on CUDA (memory.profile_peak): the largest prefill chunk, then
    # max_num_seqs requests of num_draft_tokens tokens with every row's logits
    prefill_peak = min(args.max_num_batched_tokens, args.max_model_len) * per_token + vocab * (elem + 4)
    step_logits = args.max_num_seqs * num_draft_tokens * vocab * (elem + 4)
    step_peak = args.max_num_seqs * num_draft_tokens * per_token + step_logits
    width = cdiv(args.max_model_len + num_draft_tokens, args.page_size)
    # static inputs (block table, bonus, committed length, sampling parameters, seed hidden) and outputs
    # (tree tokens, emitted tokens, accept length, bonus, hidden, path) of the largest bucket
    static = args.max_num_seqs * (4 * width + 8 * 7 + 2 * hidden * elem + 8 * (3 * num_draft_tokens + 2))
    total = int(args.gpu_memory_gib * GIB)
    used = weights + int(args.runtime_gib * GIB)
    figures = memory_plan(total, used, max(prefill_peak, step_peak), step_logits, args.config)
    # the engine allocates the budget's blocks, at most max_num_seqs requests at full length (and block 0)
    per_request = cdiv(args.max_model_len + num_draft_tokens, args.page_size)
    budget_blocks = max(figures["kv_cache"], 0) // (kv_per_token * args.page_size)
    kv_blocks = min(budget_blocks, args.max_num_seqs * per_request + 1)
    return dict(
        figures,
        weights=weights,
        step_logits=step_logits,
        prefill_peak=prefill_peak,
        step_peak=step_peak,
        static_buffers=0 if args.enforce_eager else static,
        kv_per_token=kv_per_token,
        kv_allocated=kv_blocks * args.page_size * kv_per_token,
        kv_tokens=max(kv_blocks - 1, 0) * args.page_size,  # block 0 is reserved
        kv_tokens_needed=args.max_num_seqs * per_request * args.page_size,
        one_request=per_request * args.page_size,
    )


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=SHAPES, default="smollm2-135m")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--num-steps", type=int, default=5, help="draft steps S (0: no assistant)")
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--num-draft-tokens", type=int, default=None, help="tree nodes N, root included")
    ap.add_argument("--gpu-memory-gib", type=float, default=80.0)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--runtime-gib", type=float, default=1.0, help="CUDA context and allocator slack")
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args(argv)
    if args.num_steps < 0 or args.gpu_memory_gib <= 0 or args.runtime_gib < 0:
        ap.error("--num-steps must be >= 0, --gpu-memory-gib > 0, --runtime-gib >= 0")
    from nanospec.config import EngineConfig

    engine = dict(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, page_size=args.page_size)
    engine |= dict(max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager)
    engine |= dict(gpu_memory_utilization=args.gpu_memory_utilization)
    if args.num_steps:  # the engine's own checks of the draft options (EngineConfig)
        engine |= dict(assistant="default", num_steps=args.num_steps, topk=args.topk)
        engine |= dict(num_draft_tokens=args.num_draft_tokens)
    try:
        args.config = EngineConfig(device="cpu", **engine)
    except (TypeError, ValueError) as e:
        ap.error(str(e))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    p = plan(args)
    print(f"memory plan: {args.shape} ({args.dtype}), {args.max_num_seqs} sequences of up to", end=" ")
    print(f"{args.max_model_len} tokens, {args.num_steps} draft steps", end=", ")
    print(f"{args.gpu_memory_gib:g} GiB at {args.gpu_memory_utilization:g}")
    for name in ("weights", "activations", "graph_pool", "static_buffers", "kv_cache", "kv_allocated"):
        print(f"  {name:<15} {p[name] / GIB:8.2f} GiB")
    print(f"  (estimated: the largest decode or verify step {p['step_peak'] / GIB:.2f} GiB,", end=" ")
    print(f"its logits {p['step_logits'] / GIB:.2f} GiB;", end=" ")
    print(f"a max-chunk prefill {p['prefill_peak'] / GIB:.2f} GiB;", end=" ")
    print(f"the CUDA context: {args.runtime_gib:g} GiB)")
    print(
        f"  KV cache: a budget of {p['kv_cache'] / GIB:.2f} GiB; the engine allocates at most what every",
        end=" ",
    )
    print(
        f"sequence at full length needs ({p['kv_tokens_needed']:,} tokens): {p['kv_tokens']:,} tokens",
        end=" ",
    )
    print(f"at {p['kv_per_token']:,} bytes each")
    fits = p["kv_tokens"] >= p["one_request"]
    print("fits" if fits else f"does not fit: one request of max_model_len needs {p['one_request']} tokens")
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
