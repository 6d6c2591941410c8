"""The Frozen-KV MTP assistant trainer (nanospec.tools.train): train/infer consistency against nanospec's own
draft loop, a tiny training run that improves real acceptance, token-id shards (--data), and the shipped
checkpoint (CPU, fp32)."""

import json
import random
import re

import pytest
import torch
from conftest import make_tiny_model, randomize
from helpers import TRAIN_ENGINE, chat_texts, record_step_reqs, tiny_target

from nanospec import LLM, SamplingParams
from nanospec.default_model import DEFAULT_ASSISTANT
from nanospec.models.gemma4_assistant import Gemma4Assistant
from nanospec.tools.checkpoints import hf_tensors, save_assistant
from nanospec.tools.datasets import (
    chat_prompts,
    config_hash,
    load_shards,
    load_sharegpt,
    regenerate_sequences,
    regeneration_prompts,
    save_shard,
)
from nanospec.tools.train import (
    capture_target,
    distill_loss,
    main,
    new_assistant,
    sample_positions,
    train,
    unroll,
)

ENGINE = TRAIN_ENGINE


def record_drafts(llm):
    """Wrap the worker's (eager, CPU) draft: per call, (request ids, seq_lens, drafted chain [B, S+1],
    per-step (logits, h_next)); the ids are the step's (``record_step_reqs``)."""
    worker, records = llm.worker, []
    orig = worker.draft
    record_step_reqs(worker)

    def draft(inp, bt, L, *args, **kwargs):
        steps = []
        hook = worker.assistant.register_forward_hook(
            lambda m, a, out: steps.append((out[0].clone(), out[1].clone()))
        )
        try:
            tree = orig(inp, bt, L, *args, **kwargs)
        finally:
            hook.remove()
        records.append(([r.request_id for r in worker.step_reqs], L.tolist(), tree.tokens.clone(), steps))
        return tree

    worker.draft = draft
    return records


def test_train_infer_consistency(tiny_llama_dir, tmp_path):
    """For every draft nanospec ran (several committed lengths L, two requests batched), the trainer's
    unrolled forward at committed length L gives the same logits and h_next at every step."""
    S = 3
    target = tiny_target(tiny_llama_dir)
    assistant = new_assistant(target, layers=2, seed=0)
    randomize(assistant, 5, std=0.15)  # far from the near-identity init so that every weight matters
    save_assistant(assistant, tmp_path / "a")
    llm = LLM(str(tiny_llama_dir), assistant=str(tmp_path / "a"), num_steps=S, **ENGINE)
    records = record_drafts(llm)
    prompts = [[5, 17, 300, 42, 9, 1000, 7], [123, 8, 4000]]
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True), use_tqdm=False
    )
    full = {i: p + o["token_ids"] for i, (p, o) in enumerate(zip(prompts, outs))}
    loaded = Gemma4Assistant.from_pretrained(tmp_path / "a")  # also checks the save -> HF names -> load path
    loaded.bind_target(target, kv=False)
    layer_map = loaded.layer_map(target.kv_layer_types)
    seen_L = set()
    for req_ids, lens, tree, steps in records:
        for row, (rid, L) in enumerate(zip(req_ids, lens)):
            chain = tree[row].tolist()  # [bonus, d1..dS]
            assert full[rid][L] == chain[0]
            seq = full[rid][:L] + chain[:S]  # step s feeds d_{s-1}: the drafts play the teacher tokens
            tokens, tl, hidden, kv = capture_target(target, [seq], layer_map)
            with torch.no_grad():
                got = unroll(loaded, tokens, hidden, kv, torch.tensor([[L]]), S)
            for s in range(S):
                torch.testing.assert_close(got[s][0][0], steps[s][0][row], rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(got[s][1][0], steps[s][1][row], rtol=1e-4, atol=1e-4)
            seen_L.add(L)
    assert len(seen_L) >= 4, seen_L


def mean_accept(model_dir, assistant_dir, prompts, max_tokens, S):
    llm = LLM(str(model_dir), assistant=str(assistant_dir), num_steps=S, **ENGINE)
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False
    )
    acc = [a for o in outs for a in o["accept_lengths"]]
    return sum(acc) / len(acc)


def test_tiny_training_improves_acceptance(smollm2_tokenizer, tmp_path):
    """A few hundred steps on the target's own greedy continuations lower the loss and beat a random
    assistant's acceptance length on those prompts (measured by nanospec's spec decoding, greedy)."""
    torch.manual_seed(0)
    S, T = 3, 40
    tiny_llama_dir = make_tiny_model(tmp_path / "target", smollm2_tokenizer, seed=3, vocab_size=512)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (6,), generator=g).tolist() for _ in range(6)]
    base = LLM(str(tiny_llama_dir), **ENGINE)
    outs = base.generate(
        prompts, SamplingParams(temperature=0, max_tokens=T, ignore_eos=True), use_tqdm=False
    )
    seqs = [p + o["token_ids"] for p, o in zip(prompts, outs)]
    target = tiny_target(tiny_llama_dir)
    rand = new_assistant(target, layers=1, seed=0)
    save_assistant(rand, tmp_path / "random")
    tokens, lens, hidden, kv = capture_target(target, seqs, rand.layer_map(target.kv_layer_types))
    Ls, valid = sample_positions(lens, 64, torch.Generator().manual_seed(1))
    with torch.no_grad():
        loss0 = float(distill_loss(rand, target, tokens, lens, hidden, kv, Ls, valid, S)[0])
    trained, summary = train(
        target,
        seqs,
        tmp_path / "trained",
        layers=1,
        num_steps=S,
        batch_size=6,
        positions_per_seq=64,
        lr=3e-3,
        warmup=10,
        epochs=250,
        seed=0,
        progress=False,
    )
    with torch.no_grad():
        loss1 = float(distill_loss(trained, target, tokens, lens, hidden, kv, Ls, valid, S)[0])
    assert summary["steps"] == 250 and loss1 < 0.3 * loss0, (loss0, loss1)
    acc_rand = mean_accept(tiny_llama_dir, tmp_path / "random", prompts, T, S)
    acc_trained = mean_accept(tiny_llama_dir, tmp_path / "trained", prompts, T, S)
    print(
        f"loss {loss0:.3f} -> {loss1:.3f}; mean acceptance random {acc_rand:.2f} -> trained {acc_trained:.2f}"
    )
    assert acc_rand < 1.5 and acc_trained > acc_rand + 0.8, (acc_rand, acc_trained)


def test_cli_init_continues_from_checkpoint(tiny_llama_dir, tmp_path):
    """``--init DIR`` trains that checkpoint (its layer count, its weights) rather than a fresh assistant:
    with a vanishing learning rate the saved weights are the initial ones, and training_info records the
    init."""
    target = tiny_target(tiny_llama_dir)
    start = new_assistant(target, layers=2, seed=0)
    randomize(start, 7, std=0.15)  # unlike any fresh init
    save_assistant(start, tmp_path / "init")
    main(
        [
            "--target",
            str(tiny_llama_dir),
            "--init",
            str(tmp_path / "init"),
            "--num-conversations",
            "3",
            "--max-tokens",
            "60",
            "--seq-len",
            "24",
            "--all-positions",
            "--batch-size",
            "1",
            "--lr",
            "1e-12",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    got = hf_tensors(Gemma4Assistant.from_pretrained(tmp_path / "out"))
    want = hf_tensors(start)
    assert got.keys() == want.keys() and any(".layers.1." in k for k in got)
    for k in want:
        torch.testing.assert_close(got[k], want[k].detach(), rtol=0, atol=1e-6)
    info = json.loads((tmp_path / "out" / "training_info.json").read_text())
    assert (
        info["args"]["layers"] == 2 and info["args"]["init"] == str(tmp_path / "init") and info["steps"] >= 1
    )
    assert info["init"] == {"dir": str(tmp_path / "init"), "training_info": None}
    assert info["per_step_kl"][0] > 0  # it trained on real positions
    assert "_name_or_path" not in json.loads((tmp_path / "out" / "config.json").read_text())


def test_steps_past_the_sequence_report_nan(tiny_llama_dir):
    """A draft step that no sampled position reaches has no KL to report: nan, not a perfect 0.0."""
    target = tiny_target(tiny_llama_dir)
    a = new_assistant(target, layers=1, seed=0)
    tokens, lens, hidden, kv = capture_target(target, [[5, 6, 7]], a.layer_map(target.kv_layer_types))
    Ls, valid = torch.tensor([[2]]), torch.tensor([[True]])  # step 1 predicts row 2; step 2 would need row 3
    with torch.no_grad():
        loss, kls, accs = distill_loss(a, target, tokens, lens, hidden, kv, Ls, valid, 2)
    assert kls[0] > 0 and 0 <= accs[0] <= 1 and torch.isfinite(loss)
    assert kls[1] != kls[1] and accs[1] != accs[1]
    with pytest.raises(ValueError, match="past its prompt"):  # every sequence cut inside its prompt
        train(target, [[5, 6, 7], [8, 9]], layers=1, num_steps=2, starts=[3, 2], progress=False)


def test_sample_positions_skip_the_prompt():
    """With prompt starts, committed lengths cover exactly [start, len-1]; a sequence with no response has
    none."""
    lens, starts = torch.tensor([10, 6, 5]), torch.tensor([4, 6, 0])
    Ls, valid = sample_positions(lens, 16, torch.Generator().manual_seed(0), starts)
    got = [sorted(Ls[b][valid[b]].tolist()) for b in range(3)]
    assert got == [list(range(4, 10)), [], list(range(1, 5))]


def test_regenerate_sequences(tiny_llama_dir, smollm2_tokenizer):
    """Self-distillation data: per temperature round, each first user turn's chat prompt + the target's own
    response as nanospec generates it (greedy rounds equal a plain generate), with the prompt lengths."""
    texts = ["Hello there", "Write a poem about the sea", "2+2?"]
    convs = [[{"role": "user", "content": t}, {"role": "assistant", "content": "x"}] for t in texts]
    engine = {k: v for k, v in ENGINE.items() if k != "max_model_len"}  # sized by regenerate_sequences
    got = regeneration_prompts(smollm2_tokenizer, convs, max_prompt_tokens=4)
    random.Random(0).shuffle(texts)  # seed 0's prompt order, the same in every round
    prompts = chat_prompts(smollm2_tokenizer, texts, 4)
    assert got == prompts
    seqs, starts, stats = regenerate_sequences(
        str(tiny_llama_dir), prompts, [0.0, 0.7], 6, progress=False, **engine
    )
    assert [q[:s] for q, s in zip(seqs, starts)] == prompts * 2
    params = SamplingParams(temperature=0, max_tokens=6)
    greedy = LLM(str(tiny_llama_dir), **ENGINE).generate(prompts, params, use_tqdm=False)
    assert starts == [len(p) for p in prompts] * 2 and stats["rounds"] == 2 and stats["sequences"] == 6
    assert stats["temperatures"] == [0.0, 0.7] and stats["dtype"] == "float32"
    assert seqs[:3] == [p + o["token_ids"] for p, o in zip(prompts, greedy)]
    assert all(q[: len(p)] == p and len(p) < len(q) <= len(p) + 6 for q, p in zip(seqs[3:], prompts))
    assert (
        stats["generated_tokens"] == sum(len(q) - s for q, s in zip(seqs, starts)) and stats["prompts"] == 3
    )
    # a new text, then a repeat of another first turn
    convs[0] += [{"role": "user", "content": "More"}, {"role": "assistant", "content": "y"}]
    convs[0] += [{"role": "user", "content": "2+2?"}]
    convs[1] += [{"role": "user", "content": "More"}]
    orders = []
    for seed in (0, 1):  # distinct texts, first turns first, then shuffled by the seed
        orders.append([c[0]["content"] for c in convs] + ["More"])
        random.Random(seed).shuffle(orders[-1])
        want = chat_prompts(smollm2_tokenizer, orders[-1], 4)
        assert regeneration_prompts(smollm2_tokenizer, convs, 4, all_turns=True, seed=seed) == want
    assert orders[0] != orders[1]
    with pytest.raises(ValueError, match="temperatures"):
        regenerate_sequences(str(tiny_llama_dir), prompts, [], **engine)
    with pytest.raises(ValueError, match="no prompts"):
        regeneration_prompts(smollm2_tokenizer, [[{"role": "user", "content": " "}]], 4)


def test_shards_round_trip_and_refuse_the_eval_split(tmp_path):
    """save_shard / load_shards: token ids, response starts and provenance come back as written (in shard-name
    order, the counts added; the same content is the same shard); a shard whose JSON is missing, says split
    "eval" or names another target's config hash is refused with a ValueError naming it."""
    d, a, b = tmp_path / "d", ([[1, 2, 3, 4], [5, 6, 70000]], [2, 1]), ([[9, 8, 7, 6, 5]], [3])
    pa = save_shard(d, *a, dict(split="train", config_sha256="x", seed=1))
    pb = save_shard(d, *b, dict(split="train", config_sha256="x", seed=2))
    assert save_shard(d, *a, dict(split="train", config_sha256="x", seed=1)) == pa != pb
    names = [pa.name, pb.name, pa.name[:16] + ".json", pb.name[:16] + ".json"]
    assert sorted(f.name for f in d.iterdir()) == sorted(names)
    (p1, (s1, t1), seed1), (p2, (s2, t2), seed2) = sorted([(pa, a, 1), (pb, b, 2)], key=lambda x: x[0].name)
    seqs, starts, provs = load_shards(d, "x")
    assert seqs == s1 + s2 and starts == t1 + t2
    counts = dict(sequences=len(s1), tokens=sum(map(len, s1)), prompt_tokens=sum(t1))
    assert provs[0] == dict(split="train", config_sha256="x", seed=seed1, shard=p1.name, **counts)
    assert [p["shard"] for p in provs] == [p1.name, p2.name]
    assert load_shards(tmp_path / "none") == ([], [], [])
    with pytest.raises(ValueError, match=re.escape(p1.name)):
        load_shards(d, "another target")
    meta = pb.with_name(pb.name.replace(".pt.gz", ".json"))
    meta.write_text(json.dumps(dict(json.loads(meta.read_text()), split="eval")))
    with pytest.raises(ValueError, match=re.escape(pb.name)):
        load_shards(d)
    meta.unlink()
    with pytest.raises(ValueError, match=re.escape(pb.name)):
        load_shards(d)


def test_cli_data_checked_before_any_model_load(monkeypatch, capsys, tmp_path, tiny_llama_dir):
    """--data without --regenerate: a missing dir or one without shards is an argparse error, a shard of the
    eval split a ValueError naming it; neither the target's weights nor ShareGPT are loaded, no --out is
    made."""
    from nanospec import loader
    from nanospec.tools import datasets

    monkeypatch.setattr(loader, "build_target", lambda *a, **k: pytest.fail("loaded the target"))
    monkeypatch.setattr(datasets, "load_sharegpt", lambda *a, **k: pytest.fail("loaded ShareGPT"))
    base = ["--target", str(tiny_llama_dir), "--out", str(tmp_path / "out")]
    (tmp_path / "empty").mkdir()
    for d in ("missing", "empty"):
        with pytest.raises(SystemExit) as e:
            main(base + ["--data", str(tmp_path / d)])
        assert e.value.code == 2 and "--data" in capsys.readouterr().err
    prov = dict(split="eval", config_sha256=config_hash(tiny_llama_dir))
    shard = save_shard(tmp_path / "bad", [[1, 2, 3]], [1], prov)
    with pytest.raises(ValueError, match=re.escape(shard.name)):
        main(base + ["--data", str(tmp_path / "bad")])
    assert not (tmp_path / "out").exists()


def test_cli_regenerates_into_data_then_trains_on_it(tiny_llama_dir, smollm2_tokenizer, tmp_path):
    """--regenerate with --data saves the target's answers as a shard (train split, this target) before
    training; a later run answers only the prompts no shard answers yet; --data alone trains on every
    shard."""
    d = tmp_path / "d"
    base = ["--target", str(tiny_llama_dir), "--data", str(d), "--batch-size", "2", "--epochs", "1"]
    regen = ["--regenerate", "0", "--max-prompt-tokens", "8", "--max-new-tokens", "6"]
    main(base + regen + ["--num-conversations", "1", "--out", str(tmp_path / "a")])
    seqs1, starts1, provs1 = load_shards(d)
    (p1,) = provs1
    assert (
        p1["split"] == "train" and p1["config_sha256"] == config_hash(tiny_llama_dir) and not p1["all_turns"]
    )
    assert p1["regeneration"]["temperatures"] == [0.0] and p1["sequences"] == len(seqs1) == 1
    info = json.loads((tmp_path / "a" / "training_info.json").read_text())
    assert info["regeneration"]["shard"] == p1["shard"] and info["shards"] == [] and info["steps"] == 1
    main(base + regen + ["--num-conversations", "3", "--out", str(tmp_path / "b")])
    seqs, starts, provs = load_shards(d)
    (p2,) = [p for p in provs if p["shard"] != p1["shard"]]
    every = {tuple(q) for q in regeneration_prompts(smollm2_tokenizer, load_sharegpt("train", 3), 8)}
    answered = {tuple(q[:s]) for q, s in zip(seqs, starts)}
    assert answered == every and len(every) > 1 and len(seqs) == len(every)  # each prompt answered once
    assert p2["regeneration"]["prompts"] == len(every) - 1
    main(base + ["--out", str(tmp_path / "c")])
    info = json.loads((tmp_path / "c" / "training_info.json").read_text())
    assert [p["shard"] for p in info["shards"]] == [p["shard"] for p in provs] and info[
        "regeneration"
    ] is None
    assert info["sequences"] == info["num_sequences_available"] == len(seqs) and info["conversations"] == 0


@pytest.mark.skipif(
    not (DEFAULT_ASSISTANT / "config.json").exists(),
    reason=f"no shipped assistant at {DEFAULT_ASSISTANT} (train one: python -m nanospec.tools.train)",
)
def test_shipped_checkpoint(smollm2_dir, smollm2_tokenizer):
    cfg = json.loads((DEFAULT_ASSISTANT / "config.json").read_text())
    assert cfg["model_type"] == "gemma4_assistant" and cfg["use_target_lm_head"] is True
    assert cfg["backbone_hidden_size"] == 576 and cfg["text_config"]["hidden_size"] == 576
    assert cfg["text_config"]["num_hidden_layers"] >= 1
    assert sum(p.stat().st_size for p in DEFAULT_ASSISTANT.iterdir()) <= 16 * 2**20
    a = Gemma4Assistant.from_pretrained(DEFAULT_ASSISTANT)
    assert a.lm_head is None and len(a.model.layers) == cfg["text_config"]["num_hidden_layers"]
    if cfg.get("use_ordered_embeddings"):  # centroid head: equal clusters of a real permutation of the vocab
        order = a.masked_embedding.token_ordering
        assert 49152 % cfg["num_centroids"] == 0 and torch.equal(order.sort().values, torch.arange(49152))
    chat = chat_texts(smollm2_tokenizer, ["What is the capital of France?", "Write a haiku about the sea."])
    params = SamplingParams(temperature=0, max_tokens=24)
    kw = dict(dtype="float32", device="cpu", max_model_len=512)
    off = LLM(None, **kw).generate(chat, params, use_tqdm=False)
    on = LLM(None, assistant="default", num_steps=5, **kw).generate(chat, params, use_tqdm=False)
    assert [o["token_ids"] for o in on] == [o["token_ids"] for o in off]
