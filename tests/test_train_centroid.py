"""The trainer's centroid LM head (nanospec.tools.train): equal-size clusters of the LM-head rows, a head
added to an assistant without changing what it computes densely, train/infer consistency of the greedy draft
against nanospec's own drafting, and a trained checkpoint that the engine serves losslessly (CPU, fp32)."""

import json

import pytest
import torch
from conftest import make_tiny_model, randomize
from helpers import TRAIN_ENGINE, record_step_reqs, tiny_target

from nanospec import LLM, SamplingParams
from nanospec.models.gemma4_assistant import Gemma4Assistant
from nanospec.tools.checkpoints import save_assistant
from nanospec.tools.train import (
    add_centroid_head,
    balanced_clusters,
    capture_target,
    distill_loss,
    greedy_drafts,
    main,
    new_assistant,
    sample_positions,
    token_clusters,
    train,
    unroll,
)

ENGINE = TRAIN_ENGINE


@pytest.mark.parametrize("means", [[[0, 0], [10, 0], [30, 0]], [[0, 0], [10, 0], [0, 20], [10, 20]]])
def test_balanced_clusters_recover_planted_groups(means):
    """Rows drawn around 3 (split 1 : 2 first) or 4 well separated points, shuffled: each cluster is exactly
    one group, and the result is a permutation."""
    g = torch.Generator().manual_seed(0)
    C, S = len(means), 6
    group = torch.arange(C).repeat_interleave(S)
    rows = torch.tensor(means, dtype=torch.float32)[group]
    rows = torch.cat([rows, torch.zeros(C * S, 3)], 1) + 0.1 * torch.randn(C * S, 5, generator=g)
    perm = torch.randperm(C * S, generator=g)
    order = balanced_clusters(rows[perm], C)
    assert torch.equal(order.sort().values, torch.arange(C * S))
    clusters = group[perm][order].view(C, S)
    assert all(len(set(c.tolist())) == 1 for c in clusters), clusters
    assert len({int(c[0]) for c in clusters}) == C


def test_balanced_clusters_on_real_lm_head_rows(tiny_llama_dir):
    """The tiny target's 49152 LM-head rows in 96 clusters: a permutation, and a row scores its own cluster's
    mean higher than the average cluster's mean (the clusters group rows that score alike)."""
    head = tiny_target(tiny_llama_dir).lm_head_weight.detach()
    order = balanced_clusters(head, 96)
    assert torch.equal(order.sort().values, torch.arange(head.shape[0]))
    means = head[order].view(96, -1, head.shape[1]).mean(1)  # [C, H]
    rows = head[order].view(96, -1, head.shape[1])[:, :4].reshape(-1, head.shape[1])  # 4 rows per cluster
    own = (rows * means.repeat_interleave(4, 0)).sum(-1)
    assert float(own.mean()) > 2 * float((rows @ means.T).mean())


def test_add_centroid_head_keeps_the_dense_model(tiny_llama_dir):
    """The copy keeps every weight and the dense logits / h_next; centroids are the cluster means of the
    target's LM-head rows; a centroid count that does not divide the vocabulary is a ValueError naming it."""
    target = tiny_target(tiny_llama_dir)
    dense = new_assistant(target, layers=1, seed=0)
    randomize(dense, 3)
    head = add_centroid_head(dense, target, 256, top_k=8)
    for k, v in dense.state_dict().items():
        torch.testing.assert_close(head.state_dict()[k], v, rtol=0, atol=0)
    order = head.masked_embedding.token_ordering
    torch.testing.assert_close(order, balanced_clusters(target.lm_head_weight, 256), rtol=0, atol=0)
    want = target.lm_head_weight[order].view(256, 192, -1).mean(1)
    torch.testing.assert_close(head.masked_embedding.centroids.weight, want)
    seqs = [[5, 17, 300, 42, 9, 1000, 7, 8, 9, 10]]
    tokens, lens, hidden, kv = capture_target(target, seqs, dense.layer_map(target.kv_layer_types))
    with torch.no_grad():
        a = unroll(dense, tokens, hidden, kv, torch.tensor([[4, 7]]), 2)
        b = unroll(head, tokens, hidden, kv, torch.tensor([[4, 7]]), 2)
    for (la, ha, _), (lb, hb, _) in zip(a, b):
        torch.testing.assert_close(lb, la)
        torch.testing.assert_close(hb, ha)
    with pytest.raises(ValueError, match="num_centroids"):
        add_centroid_head(dense, target, 7)
    with pytest.raises(ValueError, match="centroid_intermediate_top_k"):
        add_centroid_head(dense, target, 256, top_k=257)
    with pytest.raises(ValueError, match="use_ordered_embeddings: this assistant has a centroid head"):
        add_centroid_head(head, target, 256)  # would drop its trained centroids
    with pytest.raises(ValueError, match="use_ordered_embeddings"):
        train(target, [[5, 17, 300, 42, 9, 1000, 7, 8]], assistant=head, num_centroids=128, progress=False)


def test_greedy_drafts_match_nanospec_drafting(tiny_llama_dir, tmp_path):
    """Every chain nanospec drafted with a centroid-head assistant (few clusters scored, so the dense argmax
    is mostly outside them) is what the trainer's unroll + ``greedy_drafts`` picks at that committed length,
    and the dense argmax differs somewhere (the candidate restriction matters)."""
    S = 3
    target = tiny_target(tiny_llama_dir)
    assistant = add_centroid_head(new_assistant(target, layers=1, seed=0), target, 512, top_k=4)
    randomize(assistant, 5)
    save_assistant(assistant, tmp_path / "a")
    llm = LLM(str(tiny_llama_dir), assistant=str(tmp_path / "a"), num_steps=S, **ENGINE)
    worker, drafts = llm.worker, []
    orig = worker.draft
    record_step_reqs(worker)  # whose rows each draft holds

    def draft(inp, bt, L, *args, **kwargs):
        tree = orig(inp, bt, L, *args, **kwargs)
        drafts.append(([r.request_id for r in worker.step_reqs], L.tolist(), tree.tokens.clone()))
        return tree

    worker.draft = draft
    prompts = [[5, 17, 300, 42, 9, 1000, 7], [123, 8, 4000]]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full = {
        i: p + o["token_ids"]
        for i, (p, o) in enumerate(zip(prompts, llm.generate(prompts, sp, use_tqdm=False)))
    }
    loaded = Gemma4Assistant.from_pretrained(tmp_path / "a")
    loaded.bind_target(target, kv=False)
    checked, dense_differs, clusters = 0, False, token_clusters(loaded)
    for req_ids, lens, tree in drafts:
        for row, (rid, L) in enumerate(zip(req_ids, lens)):
            chain = tree[row].tolist()  # [bonus, d1..dS]
            seq = full[rid][:L] + chain[:S]
            tokens, _, hidden, kv = capture_target(target, [seq], loaded.layer_map(target.kv_layer_types))
            with torch.no_grad():
                steps = unroll(loaded, tokens, hidden, kv, torch.tensor([[L]]), S)
                scores = [loaded.masked_embedding.centroids(hn) for _, _, hn in steps]
                picks = [
                    int(greedy_drafts(loaded, lg, sc, clusters)[0]) for (lg, _, _), sc in zip(steps, scores)
                ]
            assert picks == chain[1:], (L, picks, chain)
            dense_differs |= any(int(lg[0].argmax()) != p for (lg, _, _), p in zip(steps, picks))
            checked += 1
    assert checked >= 8 and dense_differs


def test_trained_centroid_head_is_served_losslessly(smollm2_tokenizer, tmp_path):
    """``train(num_centroids=...)`` on the target's own continuations: the loss (token KL + cluster KL) and
    the token KL fall, the greedy top-1 agreement (candidates only) rises, and the saved checkpoint (target LM
    head + token_ordering + centroids) serves spec on == spec off greedily, chain and tree, beating the
    untrained head's acceptance."""
    S, T = 3, 40
    model_dir = make_tiny_model(tmp_path / "target", smollm2_tokenizer, seed=3, vocab_size=512)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (6,), generator=g).tolist() for _ in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=T, ignore_eos=True)
    base = LLM(str(model_dir), **ENGINE).generate(prompts, greedy, use_tqdm=False)
    seqs = [p + o["token_ids"] for p, o in zip(prompts, base)]
    target = tiny_target(model_dir)
    start = add_centroid_head(new_assistant(target, layers=1, seed=0), target, 32, top_k=4)
    save_assistant(start, tmp_path / "start")
    tokens, lens, hidden, kv = capture_target(target, seqs, start.layer_map(target.kv_layer_types))
    Ls, valid = sample_positions(lens, 64, torch.Generator().manual_seed(1))
    opts = dict(num_steps=S, batch_size=6, positions_per_seq=64, lr=3e-3, warmup=10, epochs=150, seed=0)
    trained, summary = train(
        target, seqs, tmp_path / "trained", num_centroids=32, centroid_top_k=4, progress=False, **opts
    )
    assert trained.masked_embedding is not None and summary["steps"] == 150
    with torch.no_grad():
        loss0, kl0, agree0 = distill_loss(start, target, tokens, lens, hidden, kv, Ls, valid, S)
        loss1, kl1, agree1 = distill_loss(trained, target, tokens, lens, hidden, kv, Ls, valid, S)
    print(f"loss {float(loss0):.3f} -> {float(loss1):.3f}, kl {kl0} -> {kl1}, agree {agree0} -> {agree1}")
    assert loss1 < 0.5 * loss0 and kl1[0] < 0.5 * kl0[0] and agree1[0] > agree0[0] + 0.3
    config = json.loads((tmp_path / "trained" / "config.json").read_text())
    assert config["use_ordered_embeddings"] and config["num_centroids"] == 32
    assert config["centroid_intermediate_top_k"] == 4
    acc = {}
    for name in ("start", "trained"):
        for k in (1, 2):
            tree = dict(topk=k, num_draft_tokens=1 + 2 * S) if k > 1 else {}
            spec = LLM(str(model_dir), assistant=str(tmp_path / name), num_steps=S, **tree, **ENGINE)
            outs = spec.generate(prompts, greedy, use_tqdm=False)
            assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in base], (name, k)
            flat = [a for o in outs for a in o["accept_lengths"]]
            acc[name, k] = sum(flat) / len(flat)
    print(acc)
    assert acc["trained", 1] > acc["start", 1] + 0.5, acc


def test_cli_num_centroids_checked_before_any_work(monkeypatch, capsys, tiny_llama_dir, tmp_path):
    """A centroid count that does not divide the vocabulary, is below --centroid-top-k, or comes with an
    --init that has a centroid head already: an argparse error naming the option, before the target's weights
    or any data load."""
    import nanospec.loader as runner

    monkeypatch.setattr(runner, "build_target", lambda *a, **k: pytest.fail("weights loaded"))
    for args, bad in (
        (["--num-centroids", "7"], "7"),
        (["--num-centroids", "16", "--centroid-top-k", "32"], "16"),
    ):
        with pytest.raises(SystemExit) as e:
            main(["--target", str(tiny_llama_dir), "--out", str(tmp_path / "o"), *args])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "--num-centroids must divide the vocabulary (49152)" in err and f"got {bad}" in err, err
    head = add_centroid_head(new_assistant(tiny_target(tiny_llama_dir)), tiny_target(tiny_llama_dir), 96)
    save_assistant(head, tmp_path / "head")
    with pytest.raises(SystemExit):
        main(["--target", str(tiny_llama_dir), "--init", str(tmp_path / "head"), "--num-centroids", "48"])
    err = capsys.readouterr().err
    assert "--num-centroids adds a centroid head to a dense-head assistant" in err, err
