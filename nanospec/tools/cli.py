"""Argument checks of nanospec's command-line tools (train, eval, bench): every bad value stops argparse with
a message naming the option and its allowed range, before any model or data is loaded; and the CPU thread
count they, example.py and the server pick at start-up (:func:`configure_cpu_threads`)."""

import argparse
import math
import os
import pathlib
import sys
import time

LOAD_ERRORS = (ValueError, OSError)  # what a bad model or checkpoint dir raises while loading
# the LLM options bench.py passes on (to LLM, or as flags to nanospec-serve); SPEC only with an assistant
ENGINE = "dtype device max_model_len max_num_seqs max_num_batched_tokens enforce_eager seed deterministic"
ENGINE = ENGINE.split() + ["tensor_parallel_size"]
SPEC = ["num_steps", "topk", "num_draft_tokens", "adaptive_speculation"]


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Module docstring kept as written; options with help text show their default (unless unset: None)."""

    def _get_help_string(self, action):
        unset = action.default is None or action.default is False
        return action.help if unset else super()._get_help_string(action)


def number(typ=float, lo: float = 0, gt: float | None = None, hi: float = math.inf):
    """argparse ``type``: a finite ``typ`` that is >= ``lo`` (or > ``gt`` when given) and <= ``hi``; else an
    argparse error naming the option, e.g. ``argument --lr: must be a float > 0, got 'nan'``."""
    bound = f"{'an int' if typ is int else 'a float'} " + (f">= {lo:g}" if gt is None else f"> {gt:g}")
    bound += "" if hi == math.inf else f" and <= {hi:g}"

    def parse(text: str):
        try:
            v = typ(text)
        except ValueError:
            v = math.nan
        if not math.isfinite(v) or v > hi or (v < lo if gt is None else v <= gt):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text!r}")
        return v

    return parse


def parser(prog: str, doc: str) -> tuple[argparse.ArgumentParser, object]:
    """``(parser, its add_argument)``: ``prog``'s parser, ``doc`` its description (``HelpFormatter``)."""
    ap = argparse.ArgumentParser(prog, description=doc, formatter_class=HelpFormatter)
    return ap, ap.add_argument


def or_error(ap: argparse.ArgumentParser, message: str, fn, *args, errors=(ValueError, TypeError), **kwargs):
    """``fn(*args, **kwargs)``; ``ap.error(message + the error's text)`` if it raises one of ``errors``."""
    try:
        return fn(*args, **kwargs)
    except errors as e:
        ap.error(f"{message}{e}")


def add_tensor_parallel_size(ap: argparse.ArgumentParser) -> None:
    """``--tensor-parallel-size N`` (``LLM(tensor_parallel_size=N)``): the engine checks N against the model
    (heads, visible GPUs) before it starts any process."""
    hlp = "ranks (GPUs) the target and its assistant are split across"
    ap.add_argument("--tensor-parallel-size", type=number(int, 1), default=1, help=hlp)


def number_list(typ=float, lo: float = 0):
    """argparse ``type``: ``"0,0.7"`` -> ``[0.0, 0.7]``, every item a ``number(typ, lo)``."""

    return lambda text: list(map(number(typ, lo), text.split(",")))


def auto_assistant(model) -> str:
    """``--assistant auto``: 'default' (the shipped assistant) on the default model (``model`` None) when one
    is shipped, else 'none'."""
    from ..default_model import DEFAULT_ASSISTANT

    return "default" if model is None and (DEFAULT_ASSISTANT / "config.json").exists() else "none"


def add_deterministic(ap: argparse.ArgumentParser, what: str = "") -> None:
    """``--deterministic``: run the engine with ``LLM(deterministic=True)`` (``what`` says where)."""
    hlp = "LLM(deterministic=True): a request's tokens bitwise independent of its batch, spec-on == spec-off"
    ap.add_argument("--deterministic", action="store_true", help=what + hlp)


def check_deterministic(ap: argparse.ArgumentParser, args, topks) -> None:
    """``ap.error`` when ``--deterministic`` meets a tree (a topk > 1), which the mode refuses."""
    if args.deterministic and max(topks, default=1) > 1:
        ap.error(f"--deterministic covers chain speculation only (topk 1), got topk {max(topks)}")


def check_out_dir(ap: argparse.ArgumentParser, option: str, path: str) -> None:
    """``ap.error`` unless ``path`` is a directory or could be created as one (its nearest existing ancestor
    is a writable directory); creates nothing, so a command rejected later leaves no trace."""
    full = pathlib.Path(path).expanduser().absolute()
    p = next(q for q in (full, *full.parents) if q.exists() or q == q.parent)  # nearest existing ancestor
    if not p.is_dir() or not os.access(p, os.W_OK | os.X_OK):
        ap.error(f"{option} must be a directory that can be created, got {path!r} ({p} is not writable)")


def make_out_dir(ap: argparse.ArgumentParser, option: str, path: str) -> None:
    """Create ``path`` (and parents) once every other check passed; ``ap.error`` if that fails."""
    try:
        pathlib.Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        ap.error(f"{option} must be a directory that can be created, got {path!r}: {e.strerror}")


def load_assistant(ap: argparse.ArgumentParser, option: str, value: str, layers: int | None = None):
    """``--init`` / ``--assistant``: load that assistant checkpoint (CPU, a few MB) while checking arguments,
    so a bad one costs no model or data work; ``ap.error`` if it does not load or (``layers`` given) has
    another layer count. Returns (assistant, dir). 'default' is resolved whatever the target; ``load_target``
    checks that the target is the default one."""
    from ..default_model import resolve_assistant
    from ..models.gemma4_assistant import Gemma4Assistant

    message = f"{option} must be 'default' or an HF gemma4_assistant checkpoint dir, got {value!r}: "
    d = or_error(ap, message, resolve_assistant, value, target_is_default=True)
    assistant = or_error(ap, message, Gemma4Assistant.from_pretrained, d, errors=(*LOAD_ERRORS, KeyError))
    n = assistant.text_config.num_hidden_layers
    if layers not in (None, n):
        ap.error(f"--layers {layers} contradicts {option} {value!r}, which has {n} layer(s)")
    return assistant, d


def load_target(ap, option: str, model: str | None, assistant_option: str, assistant):
    """Resolve ``--target`` / ``--model`` (None: the default model) and load its config and tokenizer;
    ``ap.error`` if that fails or if ``assistant`` is 'default' (the shipped assistant) for a target other
    than the default. Returns ``(model_dir, config, tokenizer)``."""
    from ..default_model import is_default_target
    from ..loader import load_config, load_tokenizer, resolve_model_dir

    def load():
        model_dir = resolve_model_dir(model)
        return model_dir, load_config(model_dir), load_tokenizer(model_dir)

    model_dir, cfg, tok = or_error(ap, f"{option}: ", load, errors=LOAD_ERRORS)
    if assistant == "default" and not is_default_target(cfg, tok):
        ap.error(f"{assistant_option} default is SmolLM2-135M-Instruct's; give a DIR for this {option}")
    return model_dir, cfg, tok


def example_options(argv=None, doc: str = "") -> argparse.Namespace:
    """example.py's options, each checked before a model loads (``--help`` imports no torch), then torch's
    CPU threads picked (``configure_cpu_threads``). Adds ``engine`` (the ``LLM`` keyword arguments they
    give; ``--assistant auto`` is the shipped assistant on the default model, else none) and ``error``
    (``ArgumentParser.error``: what ``LLM`` rejects, before any weights load, is a usage error too)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=HelpFormatter)
    ap.add_argument("--model", help="HF-format Llama/Qwen3/Gemma 4 dir (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--assistant", default="auto", help="gemma4_assistant dir | default | none | auto")
    ap.add_argument("--num-steps", type=number(int, 1), help="most draft steps (3 on CPU, 5 on CUDA)")
    ap.add_argument("--adaptive-speculation", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--max-tokens", type=number(int, 1, hi=4096), default=128, help="new tokens per prompt")
    ap.add_argument("--temperature", type=number(float, 0), default=0.0, help="0 is greedy")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    add_tensor_parallel_size(ap)
    ap.add_argument("--trace", action="store_true", help="show each verify step's drafts as text, marked")
    ap.add_argument("--verbose", action="store_true", help="print where the start-up time goes")
    add_deterministic(ap)
    args = ap.parse_args(argv)
    if args.model is not None and not os.path.isdir(args.model):
        ap.error(f"--model must be an HF-format model dir, got {args.model!r} (no such dir)")
    if args.assistant not in ("auto", "default", "none") and not os.path.isdir(args.assistant):
        ap.error(f"--assistant must be auto, default, none or a gemma4_assistant dir, got {args.assistant!r}")
    if args.assistant == "auto":  # the shipped assistant on the default model
        args.assistant = auto_assistant(args.model)
    args.engine = dict(  # the engine names what does not fit (--num-steps without an assistant, ...)
        device=args.device,
        max_model_len=args.max_tokens + 256,
        tensor_parallel_size=args.tensor_parallel_size,
        deterministic=args.deterministic,
        assistant=None if args.assistant == "none" else args.assistant,
        num_steps=args.num_steps,
        adaptive_speculation=args.adaptive_speculation,
        trace=args.trace or None,
    )
    args.error = ap.error
    configure_cpu_threads()
    return args


def _time_small_gemms(threads: int, limit_s: float, reps: int = 10) -> float:
    """Seconds for ``reps`` MLP blocks of SmolLM2's width on 16 rows (a decode step's op sizes) with
    ``threads`` threads; stops early (returning what it took so far) once past ``limit_s``."""
    import torch  # here: the tools' --help imports no torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    x = torch.full((16, 576), 0.1)
    w_up = torch.full((1536, 576), 0.01)
    w_down = torch.full((576, 1536), 0.01)
    F.linear(x, w_up)
    t0 = time.perf_counter()
    for _ in range(reps):
        F.linear(F.silu(F.linear(x, w_up)), w_down)
        if time.perf_counter() - t0 > limit_s:
            break
    return time.perf_counter() - t0


def configure_cpu_threads(probe=_time_small_gemms) -> int:
    """Pick torch's intra-op CPU thread count for this process at start-up and return it.

    With torch's default (one OpenMP thread per core), every op of a small model ends on a barrier that waits
    for the slowest thread; when other processes keep a core busy, that thread waits for a time slice and
    decoding slows down 5-20x (measured on a loaded 2-core machine: `python example.py` 0.9-3 tok/s with 2
    threads, 10-16 with one; idle, 31 vs 21). So 1, 2, 4 ... up to the current count n threads are timed on
    decode-sized GEMMs (``probe(threads, limit_s) -> seconds``, giving up past ``limit_s``; tens of ms, ~1 s
    on a loaded machine) and the most threads that are not 25% slower than fewer are kept; fewer than n is
    printed on stderr. The choice is recorded as ``OMP_NUM_THREADS``, the user's way to choose, so ``LLM``'s
    own default (``nanospec.cpu``) and the processes started later (tensor-parallel ranks) keep it. Nothing
    changes when n is 1, when OMP_NUM_THREADS / MKL_NUM_THREADS set it, or when CUDA is available (GPU runs
    barely use the CPU).
    """
    import torch

    n = torch.get_num_threads()
    if n == 1 or torch.cuda.is_available() or {"OMP_NUM_THREADS", "MKL_NUM_THREADS"} & os.environ.keys():
        return n
    best = 1
    best_seconds = probe(1, float("inf"))
    threads = 1
    while threads < n:  # more threads unless clearly slower (idle, 2 threads decode ~1.5x faster than one)
        threads = min(2 * threads, n)
        seconds = probe(threads, 1.25 * best_seconds)
        if seconds < 1.25 * best_seconds:
            best = threads
            best_seconds = seconds
    torch.set_num_threads(best)
    os.environ["OMP_NUM_THREADS"] = str(best)
    if best < n:
        print(
            f"nanospec: {best} torch thread(s), not {n}: more were slower just now (other processes keep "
            "the CPU busy); set OMP_NUM_THREADS to choose",
            file=sys.stderr,
            flush=True,
        )
    return best
