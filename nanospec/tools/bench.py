"""Benchmark nanospec: the nano-vllm workload, ShareGPT prompts (also behind one shared system prompt),
batch-1 latency, a long prompt stalling decoders, engine options on vs off, speculation and HF transformers.

    python bench.py                                      # nano-vllm workload (256 seqs), default SmolLM2 +
                                                         # its shipped assistant (--assistant none: without)
    python bench.py --shape qwen3-0.6b --compare-hf --hf-num-seqs 16  # random weights; HF in the same run
    python bench.py --workload sharegpt --batch-1 --compare-spec      # batch 1: spec vs plain, phase costs
    python bench.py --workload shared-prefix --compare enable_prefix_caching
    python bench.py --workload stall --compare overlap_schedule       # decoders' max inter-token gap
    python bench.py --workload structured --num-seqs 8 --compare-spec # JSON-schema requests, spec on/off
    python bench.py --shape gemma4-e2b --assistant random --batch-1   # Gemma 4 shapes (for a GPU)
    python bench.py --shape gemma4-26b-a4b --num-layers 2 --assistant random --batch-1  # first 2 layers
    python bench.py --shape smollm2-135m --num-seqs 4 --max-input-len 64 --max-output-len 16 --device cpu
    python bench.py --serve --compare-spec --max-concurrency 4       # over HTTP: nanospec-serve, spec on/off
    python bench.py --base-url http://127.0.0.1:8000 --request-rate 2 # any running OpenAI-compatible server

Prints the nano-vllm line `Total: Ntok, Time: ts, Throughput: xtok/s` (N = generated tokens), the HF line with
the ratio under --compare-hf, then one JSON line with every figure (batch-1: ms/token = wall time / generated
tokens, prefill included; cached_tokens: prompt tokens whose KV came from the prefix cache). `--assistant
random` writes a random-weight gemma4_assistant for the target (telemetry, speed; for a Gemma 4 shape the real
assistant shape, with the centroid head for E2B/E4B). Absolute times count only on a GPU; on CPU compare
ratios measured in one run.

--compare OPTION (enable_prefix_caching, overlap_schedule, assistant, deterministic; --compare-spec =
--compare assistant) builds a fresh engine per round and runs the workload with OPTION on, off, on, off
(assistant: the configured one vs none), printing each round's Total line, then `OPTION on/off throughput =
X.XXx` from the best (highest-throughput) round of each side; the JSON `compare` key holds both best rounds
and every round's throughput. With `assistant` a separate untimed pass over the first 4 requests (one at a
time) also times each phase call, the GPU synced around it: draft_ms (one draft call: num_steps assistant
forwards), verify_ms, step_ms (a whole speculative step) and decode_ms (a plain decode step), with their call
counts (*_calls); under CUDA graphs draft and verify run inside the step's graph and are not split
(--enforce-eager splits them). The line after the ratio shows them with the mean acceptance length.

Workloads: nanovllm (random ids, nano-vllm's bench.py), sharegpt (held-out ShareGPT questions), chat (the 16
chat prompts written for the benchmark, nanospec/assets/chat_prompts.json, each to --max-output-len),
shared-prefix (--prefix-len tokens of one system prompt, this text repeated, in front of every ShareGPT
question; for --shape runs random ids in front of the nano-vllm prompts), stall (7 requests of 16 random
tokens decode --max-output-len tokens; once each has its first token, one --stall-len-token prompt arrives,
prefilled in --max-num-batched-tokens chunks; prints and reports max_gap_s, the decoders' largest wall time
between two steps that gave one of them tokens, and the total time), structured (five chat prompts asking
for JSON, nanospec/assets/structured_prompts.json, each constrained by its JSON schema; reports
valid_outputs (ended and valid under the schema), forced_tokens and mask_ms_per_step, the host's grammar-mask
time per step). Every engine is warmed up on one short request; for chat and structured it then runs the
workload once at other seeds, so the draft-length policy has measured the batch sizes the timed run meets, as
in a running server (the prompts are then prefix-cached on both sides of a comparison).

--serve starts nanospec-serve with these engine options (--base-url URL uses a running server) and sends the
workload (default sharegpt) over HTTP with Poisson arrivals: vLLM's serving figures (tools/serve_bench.py).
"""

import argparse
import gc
import json
import random
import tempfile
import time
from contextlib import suppress
from dataclasses import replace
from pathlib import Path
from unittest import mock

import torch

from .. import LLM, SamplingParams, loader
from ..structured import StepMasks
from . import cli
from .checkpoints import GEMMA4, QWEN3_0_6B, assistant_config_for, gemma4_configs, save_assistant
from .cli import ENGINE, SPEC, add_tensor_parallel_size, configure_cpu_threads, number

ASSETS = Path(__file__).resolve().parent.parent / "assets"
# the default: nanovllm; over HTTP: sharegpt
WORKLOADS = ["nanovllm", "sharegpt", "chat", "shared-prefix", "stall", "structured"]
COMPARE = ["enable_prefix_caching", "overlap_schedule", "assistant", "deterministic"]  # --compare OPTION
# bench.py's int options >= 1 and their defaults (none: the engine's)
INT_OPTIONS = """max-model-len=4096 max-num-seqs=256 max-num-batched-tokens=8192 max-input-len=1024
    max-output-len=1024 prefix-len=512 stall-len=2000 num-steps= topk= num-draft-tokens="""


def nanovllm_workload(num_seqs=256, max_input_len=1024, max_output_len=1024, seed=0):
    """nano-vllm's bench.py draws, in its order: every prompt (length, then ids in [0, 10000]), then every
    max_tokens. Lengths are randint(100, max) as there; a max below 100 lowers the 100 to it (small CPU runs).
    Returns ``(prompts: list of token-id lists, max_tokens: list[int])``."""
    random.seed(seed)
    rand = random.randint
    lo_in = min(100, max_input_len)
    prompts = [[rand(0, 10000) for _ in range(rand(lo_in, max_input_len))] for _ in range(num_seqs)]
    return prompts, [rand(min(100, max_output_len), max_output_len) for _ in range(num_seqs)]


def sharegpt_workload(tokenizer, num_seqs=None, max_input_len=1024, max_output_len=1024, seed=0, min_len=4):
    """Requests from the held-out ShareGPT "eval" split (``datasets.load_sharegpt``): the first user turn
    (chat template applied when the tokenizer has one) of conversations whose next turn is an answer, in a
    fixed shuffled order (``seed``); the prompt must have min_len..max_input_len tokens and the answer >=
    min_len; its max_tokens is the answer's token count capped at max_output_len. Returns ``(prompts,
    max_tokens)`` as nanovllm_workload."""
    from .datasets import load_sharegpt

    convs = load_sharegpt("eval")
    random.Random(seed).shuffle(convs)  # the same order as shuffling indices
    requests = []  # (prompt, max_tokens)
    for conv in (c for c in convs if len(c) >= 2 and c[1]["role"] == "assistant"):
        if len(requests) == num_seqs:
            break
        ids = chat_ids(tokenizer, conv[0]["content"])
        ref_len = len(chat_ids(tokenizer, conv[1]["content"], False))
        if min_len <= len(ids) <= max_input_len and ref_len >= min_len:
            requests.append((ids, min(ref_len, max_output_len)))
    return [p for p, _ in requests], [m for _, m in requests]


def chat_ids(tokenizer, text: str, template: bool = True) -> list[int]:
    """Token ids of one user turn ``text``: the tokenizer's chat template applied when it has one (and
    ``template``), no special tokens added twice."""
    if template and tokenizer.chat_template:
        turn = [dict(role="user", content=text)]
        text = tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def workload(args, tokenizer) -> tuple[list[list[int]], list[SamplingParams]]:
    """The prompts (token-id lists) and SamplingParams (seed ``args.seed`` + i) of ``args.workload``."""
    rand = random.Random(args.seed).randint
    sizes = (args.num_seqs, args.max_input_len, args.max_output_len)
    max_tokens = None  # stall, chat, structured: --max-output-len each
    if args.workload == "stall":  # 7 decoders, then the long prompt
        prompts = [[rand(0, 10000) for _ in range(n)] for n in [16] * 7 + [args.stall_len]]
    elif args.workload == "nanovllm" or args.shape and args.workload == "shared-prefix":
        prompts, max_tokens = nanovllm_workload(*sizes, args.seed)
    elif args.workload == "chat":
        texts = json.loads((ASSETS / "chat_prompts.json").read_text())[: args.num_seqs]
        prompts = [chat_ids(tokenizer, t) for t in texts]
    elif args.workload == "structured":  # the 5 tasks in turn, each with its JSON schema
        tasks = json.loads((ASSETS / "structured_prompts.json").read_text())
        tasks = [tasks[i % len(tasks)] for i in range(args.num_seqs)]
        prompts = [chat_ids(tokenizer, t["prompt"]) for t in tasks]
        schemas = [dict(json=t["schema"]) for t in tasks]
    else:
        prompts, max_tokens = sharegpt_workload(tokenizer, *sizes, args.seed)
    if args.workload == "shared-prefix":
        text = tokenizer.encode(__doc__ * (1 + args.prefix_len // 64), add_special_tokens=False)
        prefix = [rand(0, 10000) for _ in range(args.prefix_len)] if args.shape else text[: args.prefix_len]
        prompts = [prefix + p for p in prompts]
    sp = dict(temperature=args.temperature, ignore_eos=args.ignore_eos)
    max_tokens = max_tokens or [args.max_output_len] * len(prompts)
    schemas = schemas if args.workload == "structured" else [None] * len(prompts)
    return prompts, [
        SamplingParams(max_tokens=m, seed=args.seed + i, structured_outputs=so, **sp)
        for i, (m, so) in enumerate(zip(max_tokens, schemas))
    ]


def structured_figures(llm, outputs, params, mask_ms: list, num_steps: int) -> dict:
    """--workload structured: outputs that end and validate against their schema (``valid_outputs``),
    tokens the grammar forced (one allowed token at that position), the host's mask time per step."""
    import jsonschema

    valid = forced = 0
    for out, sp in zip(outputs, params):
        matcher = llm.grammars.matcher(sp.structured_outputs)
        for token in out["token_ids"]:
            forced += bool(matcher.compute_ff_tokens())
            matcher.consume_token(token)
        with suppress(ValueError, jsonschema.ValidationError):
            jsonschema.validate(json.loads(out["text"]), sp.structured_outputs.json)
            valid += out["finish_reason"] == "stop"
    return dict(valid_outputs=valid, forced_tokens=forced, mask_ms_per_step=sum(mask_ms) / max(num_steps, 1))


def acceptance_stats(accept_lengths, num_steps):
    """accept_lengths: per-request lists (accepted drafts + 1 per verify step). Returns (mean accept length,
    [fraction of verify steps accepting >= i drafts for i = 1..num_steps], number of verify steps); None where
    there is no verify step."""
    flat = [a for req in accept_lengths for a in req]
    rates = [sum(a >= i + 1 for a in flat) / len(flat) if flat else None for i in range(1, num_steps + 1)]
    return (sum(flat) / len(flat) if flat else None), rates, len(flat)


def write_shape_dir(shape, out: Path, num_layers=None) -> Path:
    """A random-weight model dir in ``out``: the shape's config.json ("smollm2-135m": the default model's,
    "qwen3-0.6b": Qwen3-0.6B's, a ``GEMMA4`` key: ``gemma4_configs``, its first ``num_layers`` layers when
    given) plus the default SmolLM2 tokenizer files (a vocab larger than the tokenizer's is fine for random
    token ids)."""
    from transformers import Qwen3Config

    for f in loader.resolve_model_dir(None).iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "generation_config.json":
            (out / f.name).write_bytes(f.read_bytes())
    if shape in GEMMA4:
        gemma4_configs(shape, num_layers)[0].save_pretrained(out)
    elif shape != "smollm2-135m":
        Qwen3Config(**QWEN3_0_6B).save_pretrained(out)
    return out


def write_random_assistant(model_dir, out, seed=0, shape=None) -> Path:
    """A gemma4_assistant with random weights (``train.init_assistant``) saved in ``out``: for a ``GEMMA4``
    ``shape`` the real assistant (``gemma4_configs``), else 2 layers fitting the target in ``model_dir``
    (its hidden size and q geometry, sharing its LM head)."""
    from ..models.gemma4_assistant import Gemma4Assistant
    from .train import init_assistant

    if shape in GEMMA4:
        config = gemma4_configs(shape)[1]
    else:
        config = assistant_config_for(loader.load_config(model_dir), 2, use_target_lm_head=True)
    return save_assistant(init_assistant(Gemma4Assistant(config), seed), out)


def sync(device) -> None:
    """Wait for the GPU (timing); nothing on CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, log: list):
    """``fn`` wrapped: each call appends its wall time in ms, the GPU synced before and after, to ``log``."""

    def call(*args, **kwargs):
        sync(device)
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        sync(device)
        log.append(1000 * (time.perf_counter() - t0))
        return out

    return call


def stall(llm, prompts, params) -> tuple[list[dict], float]:
    """Drive ``llm.add_request`` / ``step``: every request but the last at once, the last once each of them
    has a token. Returns (outputs in request order, the largest wall time in s between two steps that gave one
    of the first requests tokens)."""
    reqs = []  # in request order: the decoders, then the last request once added
    for p, sp in zip(prompts[:-1], params[:-1]):
        reqs.append(llm.get_request(llm.add_request(p, sp)))
    # per decoder: its tokens so far, and when the step that gave the last ones ended
    seen = [(0, None)] * len(reqs)
    gap = 0.0
    while llm.has_unfinished():
        llm.step()
        now = time.perf_counter()
        for i, r in enumerate(reqs[: len(seen)]):
            if len(r.output_token_ids) > seen[i][0]:
                gap = max(gap, now - (seen[i][1] or now))
                seen[i] = (len(r.output_token_ids), now)
        if len(reqs) < len(prompts) and all(r.output_token_ids for r in reqs):
            reqs.append(llm.get_request(llm.add_request(prompts[-1], params[-1])))
    return [llm.output_dict(r) for r in reqs], gap


def measure(args, model_dir, assistant, prompts, params, label="", phases=False, **option) -> dict:
    """Build an engine (``args``' options, ``assistant`` dir or None, more LLM ``option``s), warm it up, run
    the workload timed, print the Total line after ``label``; with ``phases`` time each phase (module
    docstring). Returns the figures; the engine is freed."""
    engine = {k: getattr(args, k) for k in ENGINE + (SPEC if assistant else [])} | option
    llm = LLM(str(model_dir), **engine, assistant=assistant, load_format="dummy" if args.shape else "auto")
    warmup = dict(temperature=args.temperature, ignore_eos=True, max_tokens=min(64, args.max_output_len))
    # shared-prefix: warm up on its first request, so the system prompt is cached as in a running server
    warm = prompts[:1] if args.workload == "shared-prefix" else ["Benchmark: "]
    llm.generate(warm, SamplingParams(**warmup), use_tqdm=False)
    if args.workload in ("chat", "structured"):  # a pass at other seeds: the batch sizes it will meet
        llm.generate(prompts, [replace(sp, seed=sp.seed + 10**6) for sp in params], use_tqdm=False)
    device = llm.runner.device
    cfg = llm.config
    gap = None
    counts = dict(llm.worker.policy.counts) if llm.worker else {}
    mask_ms = []
    steps_before = llm.num_steps_run
    # the host's mask time (structured output); every StepMasks' rows until the block ends
    with mock.patch.object(StepMasks, "rows", timed(StepMasks.rows, device, mask_ms)):
        sync(device)
        t0 = time.perf_counter()
        if args.workload == "stall":
            outputs, gap = stall(llm, prompts, params)
        elif args.batch_1:
            outputs = [o for p, sp in zip(prompts, params) for o in llm.generate([p], [sp], use_tqdm=False)]
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        sync(device)
        elapsed = time.perf_counter() - t0
    total = sum(len(o["token_ids"]) for o in outputs)
    acc = acceptance_stats([o.get("accept_lengths", []) for o in outputs], cfg.num_steps or 0)
    res = dict(device=str(device), dtype=str(cfg.torch_dtype()).replace("torch.", ""), total_tokens=total)
    res.update(time_s=elapsed, throughput_tok_s=total / elapsed, **{k: getattr(cfg, k) for k in SPEC})
    res.update(ms_per_token=1000 * elapsed / total if args.batch_1 else None, max_gap_s=gap, **option)
    res.update(mean_accept_length=acc[0], per_position_acceptance=acc[1], num_verify_steps=acc[2])
    res.update(assistant=assistant and args.assistant, eos_token_ids=sorted(llm.eos_token_ids))
    res.update(cached_tokens=sum(o["num_cached_tokens"] for o in outputs))
    if args.workload == "structured":
        res.update(structured_figures(llm, outputs, params, mask_ms, llm.num_steps_run - steps_before))
        print(f"{label}valid {res['valid_outputs']}/{len(outputs)}, forced tokens {res['forced_tokens']}")
    if llm.worker:  # steps that drafted s tokens, per s (0: plain decode steps)
        now = sorted(llm.worker.policy.counts.items())
        res["draft_len_counts"] = {str(s): n - counts.get(s, 0) for s, n in now}
    if phases:
        logs = {name: [] for name in ("draft", "verify", "step", "decode")}
        for name, obj in zip(logs, [llm.worker] * 3 + [llm.runner]):  # the worker's phases, the runner's
            if obj is not None:
                setattr(obj, name, timed(getattr(obj, name), device, logs[name]))  # on the instance
        for i in range(min(4, len(prompts))):
            llm.generate(prompts[i : i + 1], params[i : i + 1], use_tqdm=False)
        res.update({f"{k}_ms": sum(v) / len(v) if v else None for k, v in logs.items()})
        res.update({f"{k}_calls": len(v) for k, v in logs.items()})
    llm.close()  # tensor parallelism: its ranks go with it
    del llm, outputs
    gc.collect()
    torch.cuda.empty_cache()  # no-op without CUDA: this engine's KV pool goes before the next engine (or HF)
    print(f"{label}Total: {total}tok, Time: {elapsed:.2f}s, Throughput: {total / elapsed:.2f}tok/s")
    if gap is not None:
        print(f"{label}Max inter-token gap of the decoders: {gap:.3f}s")
    return res


def run_hf(model_dir, random_init, prompts, params, batch_size, figures):
    """HF transformers ``generate`` over ``prompts`` (token-id lists) with the ``params`` (SamplingParams)
    nanospec ran, in left-padded batches of ``batch_size`` (1: per request), on the device and dtype of
    nanospec's ``figures`` (``measure``'s). Counts per request the tokens nanospec would emit (<= its
    max_tokens, cut after the first of the figures' ``eos_token_ids`` unless ignore_eos). Returns (tokens,
    seconds)."""
    from transformers import AutoConfig, AutoModelForCausalLM, logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    device = figures["device"]
    dtype = getattr(torch, figures["dtype"])
    load = AutoModelForCausalLM.from_config if random_init else AutoModelForCausalLM.from_pretrained
    model = load(AutoConfig.from_pretrained(model_dir) if random_init else model_dir).to(device, dtype).eval()
    temp = params[0].temperature  # one temperature for the whole workload
    sampling = dict(do_sample=temp > 0) | (dict(temperature=temp, top_k=0, top_p=1.0) if temp > 0 else {})

    def gen(ps, sps):  # tokens nanospec would count for this batch
        n = max(map(len, ps))
        mx = max(sp.max_tokens for sp in sps)
        ignore_eos = sps[0].ignore_eos
        ids = torch.tensor([[0] * (n - len(p)) + p for p in ps], device=device)
        mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in ps], device=device)
        kw = dict(max_new_tokens=mx, min_new_tokens=mx if ignore_eos else None, pad_token_id=0, **sampling)
        with torch.inference_mode():
            rows = model.generate(input_ids=ids, attention_mask=mask, **kw)[:, n:].tolist()
        rows = [row[: sp.max_tokens] for row, sp in zip(rows, sps)]
        eos = set() if ignore_eos else set(figures["eos_token_ids"])
        return sum(next((i + 1 for i, t in enumerate(r) if t in eos), len(r)) for r in rows)

    gen([prompts[0][:16]], [SamplingParams(max_tokens=min(8, params[0].max_tokens))])  # warmup
    batches = range(0, len(prompts), batch_size)  # the first request of each
    torch.manual_seed(0)
    sync(device)
    t0 = time.perf_counter()
    total = sum(gen(prompts[i : i + batch_size], params[i : i + batch_size]) for i in batches)
    sync(device)
    return total, time.perf_counter() - t0


def parse_args(argv=None) -> argparse.Namespace:
    """bench.py's options (``--help``); bad values are argparse errors. Fills the workload's defaults in."""
    ap, a = cli.parser("bench.py", __doc__)
    a("--workload", choices=WORKLOADS, help="HTTP: sharegpt")
    a("--batch-1", action="store_true", help="latency mode: one request at a time (ms/token, tok/s)")
    model = ap.add_mutually_exclusive_group().add_argument  # --model or --shape
    model("--model", help="HF-format model dir (default: SmolLM2-135M-Instruct)")
    model("--shape", choices=["qwen3-0.6b", "smollm2-135m", *GEMMA4], help="random weights of this shape")
    a("--num-layers", type=number(int, 1), help="Gemma 4 --shape: its first N layers (the last full)")
    a("--device", choices=["auto", "cpu", "cuda"], default="auto")
    a("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    for name, default in (s.split("=") for s in INT_OPTIONS.split()):
        a(f"--{name}", type=number(int, 1), default=int(default) if default else None)
    a("--seed", type=number(int, 0), default=0)
    a("--enforce-eager", action="store_true")
    add_tensor_parallel_size(ap)
    a("--num-seqs", type=number(int, 1), help="requests (default 256; 16 with --batch-1)")
    a("--temperature", type=number(), help="default 0.6 (nanovllm), 0.0 (the others)")
    a("--ignore-eos", action="store_true", help="sharegpt: always generate output_len tokens")
    a("--assistant", default="auto", help="DIR | default | random | none | auto (default if one is shipped)")
    a("--adaptive-speculation", action=argparse.BooleanOptionalAction, default=True, help="s per step")
    cli.add_deterministic(ap)
    a("--compare", choices=COMPARE, help="on vs off")
    a("--compare-spec", dest="compare", action="store_const", const="assistant", help="--compare assistant")
    a("--compare-hf", action="store_true", help="also run HF transformers on the same workload")
    a("--hf-num-seqs", type=number(int, 1), help="HF runs only the first N requests (it is slow)")
    a("--hf-batch-size", type=number(int, 1), default=1, help="HF generate batch (left-padded)")
    http = ap.add_mutually_exclusive_group().add_argument
    http("--serve", action="store_true", help="benchmark nanospec-serve over HTTP (started here)")
    http("--base-url", help="benchmark the OpenAI-compatible server at this URL")
    a("--request-rate", type=number(gt=0), help="HTTP: Poisson arrivals per second (default: all at once)")
    a("--max-concurrency", type=number(int, 1), help="HTTP: most requests in flight (default: all)")
    args = ap.parse_args(argv)
    if (args.serve or args.base_url) and (args.batch_1 or args.compare_hf or args.base_url and args.compare):
        ap.error("--serve / --base-url: no --batch-1 or --compare-hf (nor --compare with --base-url)")
    args.workload = args.workload or ("sharegpt" if args.serve or args.base_url else "nanovllm")
    if args.num_layers and args.shape not in GEMMA4:
        ap.error(f"--num-layers needs a Gemma 4 --shape ({', '.join(GEMMA4)})")
    cli.check_deterministic(ap, args, [args.topk or 1])
    if args.assistant not in ("auto", "default", "random", "none") and not Path(args.assistant).is_dir():
        ap.error(f"--assistant must be auto, default, random, none or a dir, got {args.assistant!r}")
    if args.assistant == "auto":  # as example.py: speculation is what nanospec is for
        args.assistant = cli.auto_assistant(args.model or args.shape)
    if args.compare == "assistant" and args.assistant == "none":
        ap.error("--compare assistant needs an assistant: --assistant DIR, default or random")
    if args.temperature is None:
        args.temperature = 0.6 if args.workload == "nanovllm" else 0.0
    args.num_seqs = args.num_seqs or (16 if args.batch_1 else 256)
    args.ignore_eos = args.ignore_eos or args.workload in ("nanovllm", "stall")
    return args


def run(args: argparse.Namespace, tmp: Path) -> dict:
    """One benchmark run of ``parse_args``'s options (random-weight dirs go in ``tmp``): prints the Total
    line(s) (and HF's, the comparison's); returns the figures, with every option."""
    model_dir = loader.resolve_model_dir(args.model)
    if args.shape:
        model_dir = write_shape_dir(args.shape, tmp, args.num_layers)
    assistant = None if args.assistant == "none" else args.assistant
    if assistant == "random":
        assistant = str(write_random_assistant(model_dir, tmp / "assistant", args.seed, args.shape))
    prompts, params = workload(args, loader.load_tokenizer(model_dir))
    res = vars(args) | dict(model=None if args.shape else str(model_dir), num_seqs=len(prompts))
    res.update(input_tokens=sum(map(len, prompts)))
    meas = measure
    if args.serve or args.base_url:  # the same runs over HTTP: vLLM's serving figures
        from .serve_bench import measure as meas
    if args.compare:
        opt = args.compare
        spec = opt == "assistant"
        rounds = []
        for on in (True, False) * 2:
            kw = dict(label=f"[{opt} {'on' if on else 'off'}] ", phases=spec) | ({} if spec else {opt: on})
            asst = None if spec and not on else assistant
            rounds.append(meas(args, model_dir, asst, prompts, params, **kw))
        on, off = (max(rounds[i::2], key=lambda r: r["throughput_tok_s"]) for i in (0, 1))
        ratio = on["throughput_tok_s"] / off["throughput_tok_s"]
        res.update(on, compare=dict(option=opt, best_of=2, on=on, off=off, ratio=ratio))
        res["compare"]["rounds_tok_s"] = [r["throughput_tok_s"] for r in rounds]
        print(f"{opt} on/off throughput = {ratio:.2f}x")
        if "mean_tpot_ms" in on:  # over HTTP
            print(", ".join(f"{k} on/off {on[k] / off[k]:.2f}x" for k in ("mean_ttft_ms", "mean_tpot_ms")))
        elif spec:
            figs = {k: on[k] for k in ("mean_accept_length", "draft_ms", "verify_ms", "step_ms")}
            figs["plain_decode_ms"] = off["decode_ms"]
            print(", ".join(f"{k} {v:.3f}" for k, v in figs.items() if v is not None))
            if "draft_len_counts" in on:
                print(f"steps per draft length s: {on['draft_len_counts']}")
    else:
        res.update(meas(args, model_dir, assistant, prompts, params))
    if args.compare_hf:
        n = min(args.hf_num_seqs or len(prompts), len(prompts))
        bs = 1 if args.batch_1 else args.hf_batch_size
        hf_tok, hf_t = run_hf(model_dir, bool(args.shape), prompts[:n], params[:n], bs, res)
        res.update(hf_num_seqs=n, hf_batch_size=bs, hf_total_tokens=hf_tok, hf_time_s=hf_t)
        res.update(hf_throughput_tok_s=hf_tok / hf_t, hf_ratio=res["throughput_tok_s"] / (hf_tok / hf_t))
        note = f" (reduced workload: first {n} of {len(prompts)} requests)" if n < len(prompts) else ""
        hf_line = f"Total: {hf_tok}tok, Time: {hf_t:.2f}s, Throughput: {hf_tok / hf_t:.2f}tok/s{note}"
        print(f"HF transformers: {hf_line}, batch {bs}; nanospec / HF throughput = {res['hf_ratio']:.2f}x")
    return res


def main(argv=None) -> dict:
    """``bench.py`` / ``nanospec-bench``: ``parse_args``, then ``run``; prints the
    figures as one JSON line last and returns them."""
    args = parse_args(argv)
    configure_cpu_threads()
    with tempfile.TemporaryDirectory(prefix="nanospec-bench-") as tmp:
        res = run(args, Path(tmp))
    print(json.dumps(res))
    return res
