"""The centroid ("ordered embeddings") LM head: gather-GEMV kernel, checkpoints, bad inputs, the engine."""

import json

import pytest
import torch
from conftest import randomize
from safetensors.torch import load_file, save_file
from test_assistant import gemma_assistant_config, gemma_text, target_config
from transformers import Gemma4AssistantForCausalLM

from nanospec import LLM, SamplingParams, loader
from nanospec.kernels.centroid import centroid_logits_ref, centroid_logits_triton
from nanospec.loader import load_config
from nanospec.models.assistant_config import check_assistant_config
from nanospec.models.gemma4_assistant import Gemma4Assistant
from nanospec.tools.checkpoints import assistant_config_for, save_assistant


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_interpreter_matches_reference(dtype):
    """Triton (interpreter) == torch reference == the definition; odd S and H (H over two BLOCK_H chunks),
    rows with a padded row stride, repeated clusters, an empty batch."""
    g = torch.Generator().manual_seed(0)
    R, C, S, H, K = 3, 5, 6, 200, 2
    hidden = torch.randn(R, H, generator=g).to(dtype)
    rows = torch.randn(C, S, H + 8, generator=g).to(dtype)[..., :H]  # stride(1) = H + 8
    clusters = torch.tensor([[4, 0], [2, 2], [1, 3]])
    want = torch.stack(
        [torch.cat([rows[c].float() @ hidden[r].float() for c in clusters[r]]) for r in range(R)]
    )
    ref = centroid_logits_ref(hidden, rows, clusters)
    assert ref.dtype == torch.float32 and ref.shape == (R, K * S)
    torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        centroid_logits_triton(hidden, rows, clusters.int()), ref, rtol=1e-5, atol=1e-5
    )
    for fn in (centroid_logits_ref, centroid_logits_triton):
        assert fn(hidden[:0], rows, clusters[:0]).shape == (0, K * S)


def test_kernel_bad_inputs():
    h, rows, cl = torch.randn(2, 8), torch.randn(3, 4, 8), torch.zeros(2, 1, dtype=torch.long)
    for fn in (centroid_logits_ref, centroid_logits_triton):
        with pytest.raises(ValueError, match="hidden size"):
            fn(h, torch.randn(3, 4, 6), cl)
        with pytest.raises(ValueError, match="clusters"):
            fn(h, rows, cl[:1])
        with pytest.raises(TypeError, match="clusters"):
            fn(h, rows, cl.float())


def save_hf(path, config, seed=0, order=None):
    """A random HF assistant with a random token_ordering (or ``order``), saved as a gemma4_assistant dir."""
    hf = Gemma4AssistantForCausalLM(config).eval()
    randomize(hf, seed, 0.3)
    V = config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(seed)
    hf.masked_embedding.token_ordering.copy_(torch.randperm(V, generator=g) if order is None else order)
    hf.save_pretrained(path)
    return hf


@torch.no_grad()
def test_checkpoint_reorders_rows_once_and_saves_them_back(tmp_path):
    hf = save_hf(tmp_path / "hf", gemma_assistant_config(centroids=True))
    a = Gemma4Assistant.from_pretrained(tmp_path / "hf")
    order = hf.masked_embedding.token_ordering
    assert torch.equal(a.masked_embedding.token_ordering, order)
    assert torch.equal(a.lm_head.weight, hf.lm_head.weight[order])  # cluster c = rows [c*S, (c+1)*S)
    save_assistant(a, tmp_path / "out")
    back = Gemma4AssistantForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    for name, t in hf.state_dict().items():
        assert torch.equal(back[name], t), name


def test_bad_centroid_inputs(tmp_path):
    """ValueError naming the field: from the config alone when it suffices (no weights read), else on load."""
    for kw, field in (
        (dict(num_centroids=12), "num_centroids"),
        (dict(centroid_intermediate_top_k=17), "centroid_intermediate_top_k"),
    ):
        cfg = gemma_assistant_config(centroids=True)
        for k, v in kw.items():
            setattr(cfg, k, v)
        with pytest.raises(ValueError, match=field):
            check_assistant_config(cfg, gemma_text())
        d = tmp_path / field
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg.to_dict()))
        (d / "model.safetensors").write_bytes(b"not read")  # the config fails before any tensor is opened
        with pytest.raises(ValueError, match=field):
            Gemma4Assistant.from_pretrained(d)
    with pytest.raises(ValueError, match="num_centroids"):
        assistant_config_for(target_config(), use_ordered_embeddings=True, num_centroids=100)  # V 96
    save_hf(tmp_path / "dup", gemma_assistant_config(centroids=True))
    sd = load_file(str(tmp_path / "dup" / "model.safetensors"))
    sd["masked_embedding.token_ordering"][1] = sd["masked_embedding.token_ordering"][0]
    save_file(sd, str(tmp_path / "dup" / "model.safetensors"))
    with pytest.raises(ValueError, match="token_ordering.*permutation"):
        Gemma4Assistant.from_pretrained(tmp_path / "dup")
    dense = Gemma4Assistant(gemma_assistant_config())
    with pytest.raises(ValueError, match="use_ordered_embeddings"):
        loader.set_token_ordering(dense, torch.arange(128))


@pytest.mark.parametrize("use_target_lm_head", [False, True])
@torch.no_grad()
def test_dense_logits_are_the_full_head_in_token_order(tmp_path, use_target_lm_head):
    """forward(dense=True) (what a trainer scores) is the plain LM head over all tokens, whatever the
    ordering; loader.set_token_ordering moves the own rows (or re-gathers the target's) without changing
    it."""
    from test_assistant import GemmaTarget

    target = GemmaTarget({})
    cfg = gemma_assistant_config(centroids=True, hidden_size=48)
    if use_target_lm_head:
        cfg.use_target_lm_head = True
    a = Gemma4Assistant(cfg)
    randomize(a, 3, 0.3)
    a.bind_target(target, kv=False)
    head = target.lm_head_weight if use_target_lm_head else a.lm_head.weight.clone()

    def attn(i, q):  # any attention will do: both heads see the same hidden
        return q

    args = (torch.tensor([1, 2]), torch.randn(2, 48), torch.tensor([0, 0]))
    hooks = []
    a.model.norm.register_forward_hook(lambda m, i, out: hooks.append(out))
    before = a(*args, attn_fn=attn, dense=True)[0]
    torch.testing.assert_close(before, hooks[-1] @ head.T)
    loader.set_token_ordering(a, torch.randperm(128, generator=torch.Generator().manual_seed(1)))
    torch.testing.assert_close(a(*args, attn_fn=attn, dense=True)[0], before)
    masked = a(*args, attn_fn=attn)[0]  # HF's tensor: the candidates keep the dense logits
    keep = masked > masked.amin(-1, keepdim=True)
    assert keep.sum(-1).tolist() == [24, 24]
    torch.testing.assert_close(masked[keep], before[keep])


@pytest.mark.parametrize("topk,n", [(1, 4), (3, 8)])
def test_engine_greedy_lossless_with_centroid_head(tiny_llama_dir, tmp_path, topk, n):
    """nanospec's own centroid assistant (assistant_config_for) drafts chains and trees; greedy output is the
    target's own."""
    cfg = assistant_config_for(
        load_config(tiny_llama_dir),
        num_layers=1,
        hidden_size=32,
        num_heads=4,
        use_ordered_embeddings=True,
        num_centroids=2048,
        centroid_top_k=4,
    )
    save_hf(tmp_path / "a", cfg, seed=1)
    prompts, sp = [[1, 5, 9, 200, 31], list(range(40, 60))], SamplingParams(max_tokens=16, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", max_model_len=128, max_num_seqs=4)
    ref = [o["token_ids"] for o in LLM(str(tiny_llama_dir), **kw).generate(prompts, sp, use_tqdm=False)]
    llm = LLM(
        str(tiny_llama_dir), assistant=str(tmp_path / "a"), num_steps=3, topk=topk, num_draft_tokens=n, **kw
    )
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == ref
    assert llm.worker.assistant.masked_embedding is not None
