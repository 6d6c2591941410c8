"""Every Triton kernel specialization nanospec launches, compiled ahead of time for real NVIDIA GPUs on a CPU.

Two halves:

- ``record()`` runs representative engine workloads (``WORKLOADS``: SmolLM2-, Qwen3-, Gemma 4 E2B-, 31B- and
  26B-A4B-like (MoE) geometry; chain and tree speculation; greedy and sampled; dense and centroid assistant
  heads; page sizes 16 and 256; fp32, bf16, fp16; the CUDA default configuration as its CUDA graphs launch it)
  with every kernel forced through Triton's CPU interpreter, and records
  each launch: the kernel, every argument's Triton type and integer specialization (divisible by 16, == 1),
  the constexprs, ``num_warps`` / ``num_stages``, and the engine phase it ran in (``AttnMetadata.mode``:
  prefill / decode / verify / draft; "other" outside a forward, e.g. sampling). It wraps the interpreter's
  launch entry (``InterpretedFunction.run``), so a kernel added later is recorded without editing any list,
  and it computes the specialization with Triton's own binder for the CUDA backend, as ``JITFunction.run``
  does on a GPU.
- ``check()`` compiles each unique specialization with
  ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` in a process pool (no interpreter
  there) and reads the dynamic shared memory (``metadata.shared``) and ptxas's register / spill report.

``LIMITS`` are the per-block opt-in shared-memory maxima of the CUDA C++ Programming Guide (compute
capabilities table): sm_80 (A100) 163 KB, sm_86 (RTX 30xx, A10, A40) 99 KB, sm_89 (L4, L40, RTX 40xx) 99 KB,
sm_90 (H100, H200) 227 KB. The rules: every specialization compiles, fits its arch's limit, and no kernel
launched in a decode, draft or verify forward spills registers (others are reported).

The specializations are Triton's own (its binder, its default options), so they hold for the Triton version
that recorded them (the JSON's "triton"): ``version_note()`` says when the installed one differs.

    python scripts/kernel_specs.py record             # re-record scripts/kernel_specs.json (CPU, ~1 min)
    python scripts/kernel_specs.py check              # compile it for sm_80/86/89/90, print the table
    python scripts/kernel_specs.py check --archs native --workers 16   # on a GPU: warm up its own arch
"""

import argparse
import concurrent.futures as cf
import contextlib
import importlib
import io
import json
import multiprocessing as mp
import os
import pathlib
import re
import shutil
import sys
import tempfile
import time

SPECS_JSON = pathlib.Path(__file__).with_name("kernel_specs.json")
LIMITS = {80: 166912, 86: 101376, 89: 101376, 90: 232448}  # bytes of shared memory per block (opt-in)
# attention tiles follow the shared memory per block (attention_common.attention_tiles): one recording
# per class
TILE_CLASSES = {101376: (86, 89), 166912: (80, 90)}
NO_SPILL_PHASES = ("decode", "draft", "verify")

S = "sliding_attention"
F = "full_attention"
# the attention of Gemma 4's large targets (31B, 26B-A4B): 16 / 8 heads of 256 on sliding layers (window
# 1024), 2 k_eq_v KV heads of 512 on full layers; no per-layer input
GEMMA4_LARGE_ATTENTION = dict(
    num_attention_heads=16,
    num_key_value_heads=8,
    num_global_key_value_heads=2,
    attention_k_eq_v=True,
    head_dim=256,
    global_head_dim=512,
    vocab_size=8192,
    sliding_window=1024,
    hidden_size_per_layer_input=0,
    final_logit_softcapping=30.0,
)
_G4_ROPE = {
    S: {"rope_type": "default", "rope_theta": 10000.0},
    F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
}
# Target geometry: the real head_dim, query/KV heads (so GQA groups and the rope kernel's head blocks),
# windows, KV sharing and vocabulary classes; hidden, MLP and vocabulary sizes shrunk where a kernel's tiles
# do not depend on them beyond the class noted (sampling: V > 4096; MLP: I >= 1024; rms_norm: hidden
# <= / > 4096).
TARGETS = {
    # SmolLM2-135M-Instruct (the shipped assistant reads it), 2 of its 30 layers
    "smollm2": (
        "llama",
        dict(
            hidden_size=576,
            intermediate_size=1536,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            vocab_size=49152,
            tie_word_embeddings=True,
            num_hidden_layers=2,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        ),
    ),
    # Qwen3-0.6B: q/k norms, head_dim 128, 16 / 8 heads
    "qwen3": (
        "qwen3",
        dict(
            hidden_size=1024,
            intermediate_size=1024,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=8192,
            tie_word_embeddings=True,
            num_hidden_layers=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
    ),
    # a micro Llama for interpreted runs (tests)
    "micro": (
        "llama",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=512,
            num_hidden_layers=1,
        ),
    ),
    # a hidden size past rms_norm's 4096 (Qwen3-32B: hidden 5120, 64 / 8 heads of 128), one layer
    "wide": (
        "qwen3",
        dict(
            hidden_size=5120,
            intermediate_size=1024,
            num_attention_heads=8,
            num_key_value_heads=1,
            head_dim=128,
            vocab_size=4096,
            tie_word_embeddings=True,
            num_hidden_layers=1,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
    ),
    # Gemma 4 E2B: 8 heads over 1 KV head, head_dim 256 / 512, window 512, PLE, KV-shared layers of both types
    "e2b": (
        "gemma4",
        dict(
            hidden_size=1536,
            intermediate_size=1024,
            num_attention_heads=8,
            num_key_value_heads=1,
            head_dim=256,
            global_head_dim=512,
            vocab_size=8192,
            num_hidden_layers=7,
            layer_types=[S, S, S, S, F, S, F],
            num_kv_shared_layers=2,
            sliding_window=512,
            hidden_size_per_layer_input=256,
            vocab_size_per_layer_input=8192,
            use_double_wide_mlp=True,
            final_logit_softcapping=30.0,
        ),
    ),
    # Gemma 4 31B: 32 / 16 heads of 256 (here 16 / 8: the same GQA group and rope head block), full layers
    # with 4 k_eq_v KV heads of 512 (here 2), window 1024
    "31b": (
        "gemma4",
        dict(
            **GEMMA4_LARGE_ATTENTION,
            hidden_size=1024,
            intermediate_size=1024,
            num_hidden_layers=3,
            layer_types=[S, S, F],
        ),
    ),
    # Gemma 4 26B-A4B: 16 / 8 heads of 256, 2 k_eq_v KV heads of 512, window 1024, hidden 2816, dense MLP
    # 2112, and in every layer 128 experts, top-8; the experts' intermediate size (704) shrunk to 64: the MoE
    # tiles depend on the token count and the dtype, and both sizes are multiples of 16
    "26b-a4b": (
        "gemma4",
        dict(
            **GEMMA4_LARGE_ATTENTION,
            hidden_size=2816,
            intermediate_size=2112,
            num_hidden_layers=2,
            layer_types=[S, F],
            enable_moe_block=True,
            num_experts=128,
            top_k_experts=8,
            moe_intermediate_size=64,
        ),
    ),
}
MOE_CHUNK = dict(max_num_batched_tokens=256)
CUDA_DEFAULT = dict(
    num_steps=5, adaptive_speculation=True, max_model_len=4096, num_kv_blocks=300, graphs=True
)
# (name, target, dtype, page_size, assistant: None | "shipped" | "dense" | "centroid", further LLM options;
# graphs=True: the phases run on the padded buffers of CUDA graph buckets, as on a GPU)
WORKLOADS = [
    ("smollm2-fp32-p16-chain-centroid", "smollm2", "float32", 16, "shipped", dict(num_steps=3)),
    (
        "smollm2-bf16-p256-tree-dense",
        "smollm2",
        "bfloat16",
        256,
        "dense",
        dict(num_steps=2, topk=2, num_draft_tokens=5),
    ),
    ("smollm2-fp16-p16-plain", "smollm2", "float16", 16, None, {}),
    ("qwen3-fp32-p256-chain-dense", "qwen3", "float32", 256, "dense", dict(num_steps=2)),
    (
        "qwen3-bf16-p16-tree-centroid",
        "qwen3",
        "bfloat16",
        16,
        "centroid",
        dict(num_steps=2, topk=2, num_draft_tokens=4),
    ),
    ("qwen3-fp16-p16-chain-dense", "qwen3", "float16", 16, "dense", dict(num_steps=1)),
    ("wide-bf16-p16-plain", "wide", "bfloat16", 16, None, {}),
    ("e2b-bf16-p16-chain-centroid", "e2b", "bfloat16", 16, "centroid", dict(num_steps=3)),
    (
        "e2b-fp32-p256-tree-dense",
        "e2b",
        "float32",
        256,
        "dense",
        dict(num_steps=2, topk=2, num_draft_tokens=4),
    ),
    ("e2b-fp16-p16-plain", "e2b", "float16", 16, None, {}),
    (
        "31b-bf16-p16-tree-centroid",
        "31b",
        "bfloat16",
        16,
        "centroid",
        dict(num_steps=2, topk=2, num_draft_tokens=5),
    ),
    ("31b-fp32-p256-chain-dense", "31b", "float32", 256, "dense", dict(num_steps=1)),
    ("31b-fp16-p16-plain", "31b", "float16", 16, None, {}),
    # deterministic mode: the batch-invariant GEMM and the fixed-size KV splits (every row a decode row)
    (
        "smollm2-bf16-p16-chain-det",
        "smollm2",
        "bfloat16",
        16,
        "shipped",
        dict(num_steps=2, deterministic=True),
    ),
    ("e2b-fp32-p16-plain-det", "e2b", "float32", 16, None, dict(deterministic=True)),
    # MoE: prefill chunks of 256 tokens (more tokens than experts: the prefill tiles) and of fewer
    ("26b-a4b-bf16-p16-chain-dense", "26b-a4b", "bfloat16", 16, "dense", dict(num_steps=3, **MOE_CHUNK)),
    (
        "26b-a4b-fp32-p16-tree-dense",
        "26b-a4b",
        "float32",
        16,
        "dense",
        dict(num_steps=2, topk=2, num_draft_tokens=4, **MOE_CHUNK),
    ),
    ("26b-a4b-fp16-p16-plain", "26b-a4b", "float16", 16, None, MOE_CHUNK),
    # the CUDA default: SmolLM2 in bf16 with the shipped assistant, 5 steps, the adaptive draft length (every
    # s in 0..5 while a batch size warms up: verify rows of 1..6 tokens), max_model_len 4096 and the batch
    # padded to CUDA graph buckets, whose decode attention takes num_kv_splits(max_model_len) splits
    ("smollm2-bf16-p16-chain-cuda-default", "smollm2", "bfloat16", 16, "shipped", CUDA_DEFAULT),
]
# prompt lengths: a short one, one past a 16-token page and a chunk, one past 256 keys (two decode splits)
PROMPT_LENS = (5, 70, 260)


# ---- recording -------------------------------------------------------------------------------------------


def _cuda_backend():
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    return CUDABackend(GPUTarget("cuda", 90, 32))


class Recorder:
    """``with Recorder() as rec:`` records every interpreted Triton launch in the block into ``rec.specs``
    (key -> spec dict: kernel "module:name", args [[name, type, "D" | "" | None]], constexprs {name: value},
    options {num_warps, num_stages}, phases, workloads). Needs ``TRITON_INTERPRET=1`` before the kernels load.

    ``execute=False`` (dry launches, the default): every op of ``nanospec.kernels`` that follows the package's
    convention (a ``NAME_triton`` path beside its ``NAME_ref``) runs its Triton path with each launch recorded
    but not interpreted, then returns its torch reference's result (outputs and in-place cache writes), so
    the engine runs at torch speed on exactly the arguments the Triton path would launch with. Launches from
    anywhere else are interpreted as usual. ``execute=True`` interprets every launch (slow). A kernel
    module's ``INTERPRETER_ONLY`` {constexpr: GPU value} replaces CPU-only workaround values (the attention
    kernels' bf16 upcast), so the specs are what a GPU launches."""

    def __init__(self, execute=False):
        self.specs = {}
        self.workload = None
        self.execute = execute
        self._binders = {}
        self._dry = False
        self._patched = []

    def __enter__(self):
        import pkgutil

        from triton.runtime.interpreter import InterpretedFunction

        import nanospec.kernels as kernels

        self._cls = InterpretedFunction
        self._orig = InterpretedFunction.run
        rec = self
        self._backend = _cuda_backend()

        def run(fn, *args, grid, warmup, **kwargs):
            rec.add(fn.fn, args, kwargs)
            if not rec._dry:
                return rec._orig(fn, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = run
        if not self.execute:
            for info in pkgutil.iter_modules(kernels.__path__):
                mod = importlib.import_module(f"{kernels.__name__}.{info.name}")
                for name, fn in list(vars(mod).items()):
                    ref = getattr(mod, name[: -len("_triton")] + "_ref", None)
                    if name.endswith("_triton") and callable(fn) and callable(ref):
                        self._patched.append((mod, name, fn))
                        setattr(mod, name, self._dry_op(fn, ref))
        return self

    def _dry_op(self, fn, ref):
        def op(*args, **kwargs):
            self._dry = True
            try:
                fn(*args, **kwargs)
            finally:
                self._dry = False
            return ref(*args, **kwargs)

        return op

    def __exit__(self, *exc):
        self._cls.run = self._orig
        for mod, name, fn in self._patched:
            setattr(mod, name, fn)
        self._patched = []

    def add(self, fn, args, kwargs):
        from triton.runtime.jit import JITFunction, create_function_from_signature

        from nanospec import context

        if fn not in self._binders:
            jf = JITFunction(fn)  # only for its parameters: the binder JITFunction.run uses on a GPU
            self._binders[fn] = (jf, create_function_from_signature(jf.signature, jf.params, self._backend))
        jf, binder = self._binders[fn]
        bound, spec, _ = binder(*args, **kwargs)
        names = list(bound)
        constexprs = {n: v for n, (t, v) in zip(names, spec) if t == "constexpr"}
        # a CPU-only workaround constexpr (e.g. the interpreter's bf16 upcast) takes its GPU value
        gpu = getattr(sys.modules[fn.__module__], "INTERPRETER_ONLY", {})
        constexprs.update({n: v for n, v in gpu.items() if n in constexprs})
        arg_types = [[n, t, v] for n, (t, v) in zip(names, spec) if t != "constexpr"]
        opts = self._backend.parse_options(kwargs)
        entry = dict(
            kernel=f"{fn.__module__}:{fn.__qualname__}",
            args=arg_types,
            constexprs=constexprs,
            options={"num_warps": opts.num_warps, "num_stages": opts.num_stages},
        )
        key = json.dumps(entry, sort_keys=True)
        rec = self.specs.setdefault(key, dict(entry, phases=set(), workloads=set()))
        md = context._current
        rec["phases"].add(md.mode if md is not None else "other")
        if self.workload:
            rec["workloads"].add(self.workload)


def _tokenizer_files(dst):
    from nanospec.loader import resolve_model_dir

    src = resolve_model_dir(None)
    for p in src.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors") and p.name != "config.json":
            shutil.copy(p, dst / p.name)


def _target_config(name):
    from transformers import Gemma4TextConfig, LlamaConfig, Qwen3Config

    arch, kw = TARGETS[name]
    common = dict(
        max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=2
    )
    if arch == "gemma4":
        return Gemma4TextConfig(**common, **kw, rope_parameters=_G4_ROPE, tie_word_embeddings=True)
    return {"llama": LlamaConfig, "qwen3": Qwen3Config}[arch](**common, **kw)


def _assistant(target, cfg, kind, path):
    """A random 1-2 layer assistant for target ``cfg`` (hidden 256, the target's query heads) in ``path``."""
    import torch
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

    from nanospec.tools.checkpoints import assistant_config_for

    centroid = dict(use_ordered_embeddings=kind == "centroid", num_centroids=64, centroid_top_k=8)
    if cfg.model_type != "gemma4_text":
        acfg = assistant_config_for(cfg, num_layers=1, hidden_size=256, **centroid)
    else:
        keep = (
            "num_key_value_heads",
            "num_global_key_value_heads",
            "attention_k_eq_v",
            "head_dim",
            "global_head_dim",
            "sliding_window",
            "vocab_size",
            "num_attention_heads",
        )
        text = Gemma4TextConfig(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            layer_types=[S, F],
            hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=0,
            num_kv_shared_layers=0,
            rope_parameters=_G4_ROPE,
            max_position_embeddings=4096,
            **{k: v for k, v in TARGETS[target][1].items() if k in keep},
        )
        acfg = Gemma4AssistantConfig(
            text_config=text,
            backbone_hidden_size=cfg.hidden_size,
            use_ordered_embeddings=kind == "centroid",
            num_centroids=64,
            centroid_intermediate_top_k=8,
        )
    torch.manual_seed(0)
    model = Gemma4AssistantForCausalLM(acfg).eval()
    if kind == "centroid":  # HF leaves the cluster order uninitialised
        model.masked_embedding.token_ordering.copy_(torch.randperm(cfg.vocab_size))
    model.save_pretrained(path)
    return path


def _graph_buckets(llm):
    """Give ``llm``'s graph runners the buckets a GPU captures (``graph_batch_sizes(max_num_seqs)``): on a CPU
    each phase then runs eagerly on the padded static buffers, with the split count fixed from
    ``max_model_len``, exactly what the captured graph replays."""
    from nanospec.model_runner import GraphRunner, graph_batch_sizes

    sizes = graph_batch_sizes(llm.config.max_num_seqs)
    for owner in (llm.runner, llm.worker):
        if owner is not None and owner.graphs is not None:
            g = owner.graphs
            owner.graphs = GraphRunner(g.phases, g.buffer_specs, sizes, g.num_splits, llm.runner.device)


def run_workloads(workloads=WORKLOADS, recorder=None, tmp=None, prompt_lens=PROMPT_LENS):
    """Run each workload once through the engine (Triton backend, the interpreter): 3 prompts of
    ``PROMPT_LENS`` tokens, one greedy and two sampled, 4 new tokens each, prefill chunked at 64 tokens
    (unless the workload's options say otherwise)."""
    import torch

    from nanospec import LLM, SamplingParams
    from nanospec.kernels.backend import using_backend

    tmp = pathlib.Path(tmp or tempfile.mkdtemp(prefix="kernel_specs_"))
    dirs = {}
    for name, target, dtype, page, asst, spec in workloads:
        if target not in dirs:
            d = tmp / target
            d.mkdir(exist_ok=True)
            cfg = _target_config(target)
            cfg.save_pretrained(d)
            _tokenizer_files(d)
            dirs[target] = (d, cfg)
        d, cfg = dirs[target]
        kw = {}
        if asst == "shipped":
            from nanospec.default_model import DEFAULT_ASSISTANT

            kw = dict(assistant=str(DEFAULT_ASSISTANT))
        elif asst:
            a = tmp / f"{target}-{asst}"
            if not a.exists():
                _assistant(target, cfg, asst, a)
            kw = dict(assistant=str(a))
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in prompt_lens]
        # top-k / top-p bisect over the vocabulary: only where it is small (their tiles do not depend on V)
        cut = dict(top_k=20, top_p=0.9) if cfg.vocab_size <= 8192 else {}
        params = [
            SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
            SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True, seed=1, **cut),
            SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True, seed=2),
        ]
        if recorder is not None:
            recorder.workload = name
        opts = dict(max_model_len=512, max_num_batched_tokens=64, num_kv_blocks=64 if page == 16 else 8)
        opts.update(adaptive_speculation=False, graphs=False)  # fixed num_steps: the same launches each run
        opts.update(kw, **spec)
        graphs = opts.pop("graphs")
        with using_backend("triton"):
            llm = LLM(str(d), device="cpu", dtype=dtype, page_size=page, load_format="dummy", **opts)
            if graphs:
                _graph_buckets(llm)
            llm.generate(prompts, params[: len(prompts)], use_tqdm=False)
        # the speculative steps ran the sampled requests together with the greedy one: run greedy alone too
        if asst:
            with using_backend("triton"):
                llm.generate(prompts[:1], params[:1], use_tqdm=False)
        del llm


def record(workloads=WORKLOADS, tmp=None, classes=TILE_CLASSES, execute=False, prompt_lens=PROMPT_LENS):
    """The unique specializations launched by ``workloads``, sorted and JSON-ready, each with ``archs``: the
    GPUs whose tile class (``classes``: shared memory per block -> archs) launches it. Runs every workload
    once per class, the interpreter's tiles set for that class (``attention_common.set_tile_target``)."""
    from nanospec.kernels import attention_common

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("record() needs TRITON_INTERPRET=1 set before nanospec.kernels is imported")
    specs = {}
    old = attention_common.tile_target()
    try:
        for smem, archs in classes.items():
            attention_common.set_tile_target(smem)
            with Recorder(execute) as rec:
                run_workloads(workloads, rec, tmp, prompt_lens)
            for key, s in rec.specs.items():
                out = specs.setdefault(key, dict(s, phases=set(), workloads=set(), archs=set()))
                out["phases"] |= s["phases"]
                out["workloads"] |= s["workloads"]
                out["archs"] |= set(archs)
    finally:
        attention_common.set_tile_target(old)
    out = [dict(s, **{k: sorted(s[k]) for k in ("phases", "workloads", "archs")}) for s in specs.values()]
    return sorted(out, key=spec_key)


def spec_key(spec) -> str:
    """What identifies a compiled specialization (kernel, argument types and attributes, constexprs,
    options)."""
    return json.dumps({k: spec[k] for k in ("kernel", "args", "constexprs", "options")}, sort_keys=True)


def representatives(specs) -> list:
    """One spec per tile configuration, the fast subset of the check: specs that differ only in integer
    specializations (divisibility by 16, a stride or split count == 1) share a group; each group keeps its
    most aligned member (the most vectorised loads)."""
    import inspect

    groups = {}
    for s in specs:
        mod, name = s["kernel"].split(":")
        fn = getattr(importlib.import_module(mod), name)
        params = inspect.signature(getattr(fn, "fn", fn)).parameters.values()
        declared = {p.name for p in params if "constexpr" in str(p.annotation)}
        ptrs = [t for _, t, _ in s["args"] if t.startswith("*")]
        cx = {k: v for k, v in s["constexprs"].items() if k in declared}
        key = json.dumps([s["kernel"], ptrs, cx, s["options"], s["archs"]], sort_keys=True)
        aligned = sum(a == "D" for _, _, a in s["args"])
        if key not in groups or aligned > groups[key][0]:
            groups[key] = (aligned, s)
    return [s for _, s in groups.values()]


def write_specs(specs, path=SPECS_JSON) -> None:
    import triton

    lines = ",\n".join(json.dumps(s, sort_keys=True) for s in specs)  # one spec per line: readable diffs
    path.write_text(f'{{"triton": "{triton.__version__}", "specs": [\n{lines}\n]}}\n')


def load_specs(path=SPECS_JSON) -> list:
    return json.loads(pathlib.Path(path).read_text())["specs"]


def version_note(path=SPECS_JSON) -> str | None:
    """None when the installed Triton is the one that recorded ``path``; else a sentence saying so and what
    to do (a specialization is its Triton's: its binder, its default options)."""
    import triton

    recorded = json.loads(pathlib.Path(path).read_text())["triton"]
    if recorded == triton.__version__:
        return None
    return (
        f"{pathlib.Path(path).name} was recorded with Triton {recorded} but Triton {triton.__version__} is "
        "installed: specializations are a Triton version's own, so this one may launch others; re-record "
        f"with `python scripts/kernel_specs.py record` under it, or install triton=={recorded}"
    )


# ---- compiling -------------------------------------------------------------------------------------------

_PTXAS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads.*?Used (\d+) registers", re.S)


def _init_worker(cache_dir):
    os.environ.pop("TRITON_INTERPRET", None)  # before any kernel module loads in this process
    if cache_dir:  # cross-compiles go to a throw-away cache; a native check warms the real one
        os.environ["TRITON_CACHE_DIR"] = cache_dir
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def compile_spec(spec, cc) -> dict:
    """Compile one recorded specialization for ``sm_<cc>`` (``cc`` int or "native": the current GPU).

    Returns {"shared": bytes, "regs", "spill_stores", "spill_loads", "seconds"} or {"error": text}.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    mod, name = spec["kernel"].split(":")
    fn = getattr(importlib.import_module(mod), name)
    target = (
        triton.runtime.driver.active.get_current_target() if cc == "native" else GPUTarget("cuda", cc, 32)
    )
    backend = triton.compiler.make_backend(target)
    signature = {n: t for n, t, _ in spec["args"]}
    signature.update({n: "constexpr" for n in spec["constexprs"]})
    signature = {n: signature[n] for n in fn.arg_names}
    attrs = {
        (fn.arg_names.index(n),): backend.parse_attr(a) for n, _, a in spec["args"] if isinstance(a, str)
    }
    # the options JITFunction.run passes, so a GPU's own launch finds this compile in its cache
    knobs = triton.knobs
    opts = backend.parse_options(
        dict(
            spec["options"],
            debug=knobs.runtime.debug,
            instrumentation_mode=knobs.compilation.instrumentation_mode,
            fpsan_homomorphic_casts=knobs.compilation.fpsan_homomorphic_casts,
        )
    )
    knobs.nvidia.dump_ptxas_log = True
    knobs.compilation.always_compile = True  # ptxas reports registers and spills only when it runs
    log = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):
            k = triton.compile(
                ASTSource(fn, signature, spec["constexprs"], attrs), target=target, options=opts.__dict__
            )
    except Exception as e:  # a failed compile is a finding, reported with the spec
        return {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
    m = _PTXAS.search(log.getvalue())
    stores, loads, regs = (int(x) for x in m.groups()) if m else (None, None, None)
    return dict(
        arch=target.arch,
        shared=k.metadata.shared,
        regs=regs,
        spill_stores=stores,
        spill_loads=loads,
        seconds=round(time.perf_counter() - t0, 2),
    )


def _for_arch(spec, cc) -> bool:
    """Whether ``spec`` is launched on ``sm_<cc>`` ("native": the current GPU, by its shared memory)."""
    if cc == "native":
        import torch

        big = torch.cuda.get_device_properties(0).shared_memory_per_block_optin >= 160 * 1024
        cc = 90 if big else 89
    return cc in spec.get("archs", (cc,))


def _compile_job(job):
    i, spec, cc = job
    return i, cc, compile_spec(spec, cc)


def check(specs, archs=(80, 86, 89, 90), workers=None) -> list:
    """Compile every spec for every arch in a spawned process pool; returns one row per (spec, arch):
    dict(kernel, arch, phases, constexprs, shared, regs, spill_stores, spill_loads, seconds | error). A spec
    compiles only for the archs of its tile class (``archs``)."""
    workers = workers or os.cpu_count() or 1
    if "native" in archs:  # an arch outside the table: its own limit
        import torch

        major, minor = torch.cuda.get_device_capability(0)
        LIMITS.setdefault(
            10 * major + minor, torch.cuda.get_device_properties(0).shared_memory_per_block_optin
        )
    jobs = [(i, s, cc) for cc in archs for i, s in enumerate(specs) if _for_arch(s, cc)]
    # slowest first (attention), so the pool's tail is short
    jobs.sort(key=lambda j: "attention" not in j[1]["kernel"])
    rows = []
    with tempfile.TemporaryDirectory(prefix="triton_aot_") as tmp:
        cache = None if "native" in archs else tmp
        ctx = mp.get_context("spawn")
        with cf.ProcessPoolExecutor(
            workers, mp_context=ctx, initializer=_init_worker, initargs=(cache,)
        ) as ex:
            for i, cc, res in ex.map(_compile_job, jobs, chunksize=1):
                s = specs[i]
                rows.append(
                    dict(
                        dict(
                            kernel=s["kernel"].split(":")[1],
                            arch=cc,
                            phases=s["phases"],
                            constexprs=s["constexprs"],
                            spec=i,
                        ),
                        **res,
                    )
                )
    return rows


def violations(rows) -> list:
    """Human-readable broken rules: a compile error, shared memory over the arch's limit, or spills in a
    kernel launched in a decode, draft or verify forward."""
    bad = []
    for r in rows:
        where = f"{r['kernel']} sm_{r['arch']} {r['constexprs']}"
        if "error" in r:
            bad.append(f"{where}: does not compile: {r['error'][:300]}")
            continue
        limit = LIMITS.get(r["arch"])
        if limit is not None and r["shared"] > limit:
            bad.append(f"{where}: {r['shared']} B of shared memory > {limit} B")
        if r["spill_stores"] is None:
            bad.append(f"{where}: no ptxas register report")
        elif (r["spill_stores"] or r["spill_loads"]) and set(r["phases"]) & set(NO_SPILL_PHASES):
            bad.append(
                f"{where}: spills {r['spill_stores']} B stores / {r['spill_loads']} B loads in "
                f"{'/'.join(r['phases'])}"
            )
    return bad


def summary(rows) -> str:
    """Per kernel and arch: the worst shared memory, registers and spill stores (a markdown table)."""
    worst = {}
    for r in rows:
        if "error" in r:
            continue
        w = worst.setdefault((r["kernel"], r["arch"]), dict(n=0, shared=0, regs=0, spills=0))
        w["n"] += 1
        w["shared"] = max(w["shared"], r["shared"])
        w["regs"] = max(w["regs"], r["regs"] or 0)
        w["spills"] = max(w["spills"], r["spill_stores"] or 0)
    lines = [
        "| kernel | arch | specs | worst shared (B) | limit (B) | worst regs | worst spill stores (B) |",
        "|---|---|---|---|---|---|---|",
    ]
    for (k, a), w in sorted(worst.items(), key=lambda x: (x[0][0], str(x[0][1]))):
        lines.append(
            f"| {k} | sm_{a} | {w['n']} | {w['shared']} | {LIMITS.get(a, '-')} | {w['regs']} | "
            f"{w['spills']} |"
        )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="run the workloads in the interpreter and rewrite the specs JSON")
    r.add_argument("--out", type=pathlib.Path, default=SPECS_JSON)
    c = sub.add_parser("check", help="compile the specs JSON for each arch; exit 1 on a broken rule")
    c.add_argument("--specs", type=pathlib.Path, default=SPECS_JSON)
    c.add_argument("--archs", default="80,86,89,90", help="comma-separated compute capabilities, or native")
    c.add_argument("--workers", type=int, default=None, help="compile processes (default: all cores)")
    c.add_argument("--json", type=pathlib.Path, default=None, help="write every row here")
    c.add_argument("--fast", action="store_true", help="one spec per tile configuration (a quick look)")
    a = ap.parse_args(argv)
    if a.cmd == "record":
        os.environ["TRITON_INTERPRET"] = "1"
        t0 = time.perf_counter()
        specs = record()
        write_specs(specs, a.out)
        print(
            f"{len(specs)} specializations from {len(WORKLOADS)} workloads x {len(TILE_CLASSES)} tile "
            f"classes in {time.perf_counter() - t0:.0f} s -> {a.out}"
        )
        return 0
    archs = ["native"] if a.archs == "native" else [int(x) for x in a.archs.split(",")]
    t0 = time.perf_counter()
    specs = load_specs(a.specs)
    note = version_note(a.specs)
    if note:
        print(f"note: {note}")
    rows = check(representatives(specs) if a.fast else specs, archs, a.workers)
    print(summary(rows))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")
    bad = violations(rows)
    spilled = sum(1 for r in rows if r.get("spill_stores"))
    print(
        f"{len(rows)} compiles (specs x the archs of their tile class: {a.archs}) in "
        f"{time.perf_counter() - t0:.0f} s; {spilled} spill (allowed outside decode/draft/verify only)"
    )
    print("\n".join(bad) if bad else "all rules hold")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
