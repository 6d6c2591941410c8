"""Losslessness of Frozen-KV MTP speculation (DESIGN §3): greedy spec-on output is token-identical to spec-off
in fp32 for any assistant, and speculative sampling reproduces the target's distribution."""

import math

import pytest
import torch
from conftest import randomize, vocab8_target
from helpers import chat_texts, install_drafter

from nanospec import LLM, SamplingParams
from nanospec.loader import load_config
from nanospec.mtp.draft import DraftTree, chain_tree
from nanospec.tools.checkpoints import assistant_config_for


def make_assistant(path, target_dir, seed=0, std=0.15, **kw):
    """A random HF gemma4_assistant checkpoint that fits the target in ``target_dir``."""
    from transformers import Gemma4AssistantForCausalLM

    torch.manual_seed(seed)
    model = Gemma4AssistantForCausalLM(assistant_config_for(load_config(target_dir), **kw)).float()
    randomize(model, seed, std)
    if kw.get("use_ordered_embeddings"):  # a real permutation (HF's init is none), so the reordering matters
        perm = torch.randperm(
            model.config.text_config.vocab_size, generator=torch.Generator().manual_seed(seed)
        )
        model.masked_embedding.token_ordering.copy_(perm)
    model.save_pretrained(path)
    return str(path)


def engine(model_dir, adaptive_speculation=False, **kw):
    return LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        max_model_len=256,
        max_num_seqs=8,
        adaptive_speculation=adaptive_speculation,
        **kw,
    )


PROMPTS = [[1, 5, 9, 200, 31], [7] * 3, list(range(40, 73)), [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]


@pytest.fixture(scope="module")
def tiny_assistant(tmp_path_factory, tiny_llama_dir):
    return make_assistant(tmp_path_factory.mktemp("asst"), tiny_llama_dir, hidden_size=32, num_heads=4)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """Spec-off greedy outputs of the tiny target (ignore_eos, so lengths are fixed)."""
    llm = engine(tiny_llama_dir)
    return [
        o["token_ids"]
        for o in llm.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)
    ]


@pytest.mark.parametrize(
    "num_steps,topk,n,page_size", [(1, 1, 2, 16), (2, 1, 3, 4), (5, 1, 6, 4), (2, 3, 5, 16), (5, 3, 12, 4)]
)
def test_greedy_lossless_random_assistant(
    tiny_llama_dir, tiny_assistant, reference, num_steps, topk, n, page_size
):
    llm = engine(
        tiny_llama_dir,
        assistant=tiny_assistant,
        num_steps=num_steps,
        topk=topk,
        num_draft_tokens=n,
        page_size=page_size,
    )
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [o["token_ids"] for o in outs] == reference
    for o in outs:
        assert 1 + sum(o["accept_lengths"]) >= len(o["token_ids"])
        assert all(1 <= a <= num_steps + 1 for a in o["accept_lengths"])
    al = llm.runner.allocator
    assert al.num_free == al.num_usable and len(llm.persistent_batch) == 0


def oracle_draft(reference, prompts, topk, wrong_every, rng_seed=0):
    """A drafter that proposes the spec-off greedy continuation, wrong at some depths; for topk > 1 the right
    token sits at a random sibling slot, with k-1 decoys per depth hanging off the right path (so verify must
    walk siblings and compact the accepted path's KV)."""
    g = torch.Generator().manual_seed(rng_seed)
    by_prompt = {tuple(p): r for p, r in zip(prompts, reference)}

    def draft(
        self, reqs, block_table, num_computed_tokens, num_splits=None, draft_length=None, sampling=None
    ):
        S, k, B = self.num_steps if draft_length is None else draft_length, self.topk, len(reqs)
        truth = []
        for r in reqs:
            ref, n = by_prompt[tuple(r.prompt_token_ids)], len(r.output_token_ids)
            t = (ref[n : n + S] + [0] * S)[:S]
            truth.append(
                [x if torch.randint(wrong_every, (1,), generator=g).item() else (x + 1) % 500 for x in t]
            )
        truth = torch.tensor(truth, dtype=torch.long)
        bonus = torch.tensor([r.all_token_ids[-1] for r in reqs])
        if k == 1 or S == 0:
            return chain_tree(bonus, truth.view(B, S))
        N = 1 + S * k
        tokens, parents = torch.zeros(B, N, dtype=torch.long), torch.full((B, N), -1)
        depth = torch.zeros(B, N, dtype=torch.long)
        tokens[:, 0] = bonus
        right = torch.zeros(B, dtype=torch.long)  # tree index of the right node at the previous depth
        for d in range(S):
            slot = torch.randint(k, (B,), generator=g)
            for j in range(k):
                i = 1 + d * k + j
                is_right = slot == j
                tokens[:, i] = torch.where(is_right, truth[:, d], 1000 + 7 * i + j)
                parents[:, i], depth[:, i] = right, d + 1
            right = 1 + d * k + slot
        mask = torch.zeros(B, N, N, dtype=torch.bool)
        for i in range(N):
            mask[:, i, i] = True
            if i:
                mask[:, i] |= mask[torch.arange(B), parents[:, i]]
        return DraftTree(tokens, parents, depth, mask)

    return draft


@pytest.mark.parametrize("topk", [1, 3])
def test_greedy_lossless_oracle_drafter(monkeypatch, tiny_llama_dir, tiny_assistant, reference, topk):
    """Multi-token acceptance (and, for trees, sibling walks + accepted-path KV compaction) stays lossless."""
    S = 4
    install_drafter(monkeypatch, oracle_draft(reference, PROMPTS, topk, 5))
    llm = engine(
        tiny_llama_dir,
        assistant=tiny_assistant,
        num_steps=S,
        topk=topk,
        num_draft_tokens=1 + S * topk,
        page_size=4,
    )
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [o["token_ids"] for o in outs] == reference
    acc = [a for o in outs for a in o["accept_lengths"]]
    assert max(acc) == S + 1 and min(acc) < S + 1  # full and partial acceptance both happened
    assert sum(acc) / len(acc) > 2.0


def test_greedy_lossless_smollm2(smollm2_dir, tmp_path):
    """Real weights: SmolLM2-135M, random assistant, chains and trees, chat prompts, batched, page size 4."""
    asst = make_assistant(tmp_path / "a", smollm2_dir, std=0.05, hidden_size=64, num_heads=3)
    tok = LLM(str(smollm2_dir), dtype="float32", device="cpu", max_model_len=256, max_num_seqs=4).tokenizer
    questions = (
        "What is the capital of France?",
        "Name three colors.",
        "Count to five.",
        "What is 12 times 7?",
    )
    prompts = chat_texts(tok, questions)
    sp = SamplingParams(max_tokens=24)
    ref = [o["token_ids"] for o in engine(smollm2_dir).generate(prompts, sp, use_tqdm=False)]
    for kw in (
        {"num_steps": 1},
        {"num_steps": 5},
        {"num_steps": 2, "topk": 3, "num_draft_tokens": 5},
        {"num_steps": 5, "topk": 3, "num_draft_tokens": 12},
    ):
        outs = engine(smollm2_dir, assistant=asst, page_size=4, **kw).generate(prompts, sp, use_tqdm=False)
        assert [o["token_ids"] for o in outs] == ref, kw


def _chi2_two_sample(a: list, b: list) -> tuple[float, int]:
    """Two-sample chi-square statistic and degrees of freedom over the categories seen."""
    cats = sorted(set(a) | set(b))
    ca = {c: 0 for c in cats}
    cb = dict(ca)
    for x in a:
        ca[x] += 1
    for x in b:
        cb[x] += 1
    na, nb = len(a), len(b)
    stat = sum((math.sqrt(nb / na) * ca[c] - math.sqrt(na / nb) * cb[c]) ** 2 / (ca[c] + cb[c]) for c in cats)
    return stat, len(cats) - 1


def _chi2_sf(x: float, k: int) -> float:
    """Survival function of chi-square with k dof (Wilson-Hilferty; accurate to ~1e-3 for k >= 3)."""
    z = ((x / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize(
    "temperature,top_p,overlap,adaptive,topk",
    [
        (1.0, 1.0, False, False, 1),
        (1.0, 0.9, False, True, 1),
        (1.0, 1.0, True, True, 1),
        (1.0, 0.9, False, True, 2),
    ],
)
def test_sampling_lossless_chi_square(
    tmp_path_factory, smollm2_tokenizer, temperature, top_p, overlap, adaptive, topk
):
    """On a vocab-8 target, the joint distribution of the 2nd and 3rd tokens (drawn by verify steps) matches
    spec-off sampling without overlap (p > 0.01). The two runs use other seeds (engine seeds 3 and 4, or
    request seeds 0.. and n..), so their samples are independent: equal seeds give equal tokens, which
    tests/test_seeded_sampling.py checks. ``adaptive``: the draft length varies per step; ``topk`` 2: a tree
    of 4 nodes."""
    d = vocab8_target(tmp_path_factory.mktemp("v8"), smollm2_tokenizer)
    asst = make_assistant(tmp_path_factory.mktemp("a8"), d, seed=8, std=0.5, hidden_size=32)
    n = 4000
    runs = []
    for run, kw in enumerate(
        (
            {},
            {
                "assistant": asst,
                "num_steps": 2,
                "topk": topk,
                "num_draft_tokens": 4 if topk > 1 else None,
                "overlap_schedule": overlap,
                "adaptive_speculation": adaptive,
            },
        )
    ):
        sp = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=3, ignore_eos=True)
        if overlap:
            sp = [
                SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True, seed=run * n + s)
                for s in range(n)
            ]
        llm = LLM(
            str(d), dtype="float32", device="cpu", max_model_len=16, max_num_seqs=256, seed=3 + run, **kw
        )
        outs = llm.generate([[3, 1, 4]] * n, sp, use_tqdm=False)
        runs.append([tuple(o["token_ids"][1:]) for o in outs])
        if kw:
            acc = [a for o in outs for a in o["accept_lengths"]]
            assert sum(a > 1 for a in acc) > 0.05 * len(acc)  # drafts really were accepted (and rejected)
    stat, dof = _chi2_two_sample(*runs)
    assert _chi2_sf(stat, dof) > 0.01, (stat, dof)


def test_draft_verify_through_interpreter(triton_backend, micro_llama_dir, tmp_path):
    """The whole draft -> verify loop once with every kernel in Triton's interpreter (tree, topk 2)."""
    asst = make_assistant(tmp_path / "a", micro_llama_dir, hidden_size=32, num_heads=2)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [300, 301]]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", max_model_len=32, max_num_seqs=2, page_size=4)
    got = LLM(str(micro_llama_dir), assistant=asst, num_steps=2, topk=2, num_draft_tokens=4, **kw).generate(
        prompts, sp, use_tqdm=False
    )
    from nanospec.kernels.backend import set_backend

    set_backend("torch")
    ref = LLM(str(micro_llama_dir), **kw).generate(prompts, sp, use_tqdm=False)
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in ref]
