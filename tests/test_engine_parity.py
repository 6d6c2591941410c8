"""nanospec's target model and engine against HF transformers (fp32, CPU).

Logits parity drives the model runner directly (prepare_prefill / helpers.prepare_decode + attention
metadata), so the paged cache, page boundaries, chunked extend over a cached prefix and decode are all checked
against HF's own incremental (KV-cached) forward. Greedy parity goes through the public ``LLM.generate``.
"""

import inspect

import pytest
import torch
from helpers import chat_texts, prepare_decode
from transformers import AutoModelForCausalLM

from nanospec import LLM, SamplingParams
from nanospec.context import attn_metadata
from nanospec.scheduler import Batch

PAGE = 4
LENS = (5, 17, 33)  # mixed lengths; with page 4 every prompt crosses page boundaries, 17 and 33 land mid-page
ATOL = 1e-4


def _close(got, want, what):
    assert got.shape == want.shape, what
    err = float((got - want).abs().max())
    assert err <= ATOL, f"{what}: max |nanospec - HF| = {err:.3g} > {ATOL}"


def _engine(model_dir, **kw):
    return LLM(
        str(model_dir), dtype="float32", device="cpu", page_size=PAGE, max_model_len=64, max_num_seqs=8, **kw
    )


def _prefill(llm, reqs, num_new):
    """One prefill step over ``num_new[i]`` new tokens of each request; returns logits for every new token."""
    for r, n in zip(reqs, num_new):
        llm.runner.allocator.allocate(r, r.num_computed_tokens + n)
    bt = llm.persistent_batch.block_tables(reqs)
    ids, pos, md, _ = llm.runner.prepare_prefill(Batch("prefill", reqs, list(num_new)), bt)
    with torch.inference_mode(), attn_metadata(md):
        logits = llm.runner.model.compute_logits(llm.runner.model(ids, pos))
    for r, n in zip(reqs, num_new):
        r.num_computed_tokens += n
    return logits.split(list(num_new))


def _decode(llm, reqs, tokens):
    """Append ``tokens[i]`` to request i and run one decode step through the paged cache; returns [B, V]."""
    for r, t in zip(reqs, tokens):
        r.output_token_ids.append(t)
        llm.runner.allocator.allocate(r, r.num_computed_tokens + 1)
    ids, pos, md = prepare_decode(llm, reqs)
    assert ids.tolist() == list(tokens)
    with torch.inference_mode(), attn_metadata(md):
        logits = llm.runner.model.compute_logits(llm.runner.model(ids, pos))
    for r in reqs:
        r.num_computed_tokens += 1
    return logits


def _hf_reference(model_dir, prompts, decode_tokens):
    """Per prompt: HF prefill logits [T, V] and the logits of each KV-cached incremental decode step."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # transformers 5.24 renamed the forward kwarg past_key_values -> cache (the old name warns until 5.40)
    cache_kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    pre, dec = [], []
    with torch.no_grad():
        for i, p in enumerate(prompts):
            out = hf(torch.tensor([p]), use_cache=True)
            pre.append(out.logits[0])
            past, steps = out.past_key_values, []
            for toks in decode_tokens:
                out = hf(torch.tensor([[toks[i]]]), use_cache=True, **{cache_kw: past})
                past = out.past_key_values
                steps.append(out.logits[0, -1])
            dec.append(steps)
    return pre, dec


def _check_logits_parity(model_dir, chunks=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    llm = _engine(model_dir)
    V = llm.runner.vocab_size
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in LENS]
    decode_tokens = [torch.randint(0, V, (len(LENS),), generator=g).tolist() for _ in range(3)]
    hf_pre, hf_dec = _hf_reference(model_dir, prompts, decode_tokens)

    reqs = [llm._make_request(p, SamplingParams(max_tokens=8)) for p in prompts]
    chunks = chunks or [list(LENS)]
    got = [[] for _ in reqs]
    for step in chunks:  # each entry: tokens of each prompt computed in that prefill step (0 = skip)
        active = [i for i, n in enumerate(step) if n]
        for i, lg in zip(active, _prefill(llm, [reqs[i] for i in active], [step[i] for i in active])):
            got[i].append(lg)
    for i, r in enumerate(reqs):
        assert r.num_computed_tokens == LENS[i]
        assert len(r.block_table) == -(-LENS[i] // PAGE)
        _close(torch.cat(got[i]), hf_pre[i], f"prefill logits of prompt {i}")
    # the prefill logits must be informative (not all ~0), or parity would prove little
    assert min(float(x.std()) for x in hf_pre) > 0.1

    for s, toks in enumerate(decode_tokens):
        logits = _decode(llm, reqs, toks)
        for i in range(len(reqs)):
            _close(logits[i], hf_dec[i][s], f"decode step {s} logits of prompt {i}")
    assert [r.num_computed_tokens for r in reqs] == [n + 3 for n in LENS]
    # the incremental argmax is a real function of the cache: HF's top token matches nanospec's
    assert logits.argmax(-1).tolist() == [int(hf_dec[i][-1].argmax()) for i in range(len(reqs))]
    for r in reqs:
        llm.runner.allocator.free(r)
    assert llm.runner.allocator.num_free == llm.runner.allocator.num_usable


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama_tied_dir", "tiny_qwen3_dir"])
def test_logits_parity_prefill_and_paged_decode(fixture, request):
    _check_logits_parity(request.getfixturevalue(fixture))


def test_logits_parity_llama3_rope_scaling(tiny_llama3_rope_dir):
    _check_logits_parity(tiny_llama3_rope_dir, seed=1)


def test_llama3_rope_scaling_is_applied(tiny_llama3_rope_dir, tiny_llama_dir):
    """The llama3 table differs from the plain one past the original context (else parity is vacuous)."""
    scaled = _engine(tiny_llama3_rope_dir).runner.model
    plain = _engine(tiny_llama_dir).runner.model
    assert scaled.rope_scaling["rope_type"] == "llama3" and plain.rope_scaling is None
    assert not torch.allclose(scaled.cos_sin[40], plain.cos_sin[40], atol=1e-3)


def test_logits_parity_chunked_extend_over_paged_prefix(tiny_qwen3_dir):
    """Prefill in uneven chunks (a chunk starting mid-page, a request joining in a later step): every chunk
    attends to the cached prefix and the logits still equal HF's."""
    _check_logits_parity(tiny_qwen3_dir, chunks=[[3, 6, 0], [2, 7, 13], [0, 4, 20]], seed=2)


def test_smollm2_greedy_matches_hf_generate(smollm2_dir):
    """Real SmolLM2-135M-Instruct weights, fp32: one batched nanospec generate == HF greedy generate, per
    prompt."""
    llm = LLM(str(smollm2_dir), dtype="float32", device="cpu", max_model_len=256, page_size=16)
    tok = llm.tokenizer
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain in one sentence why the sky is blue.",
    ]
    prompts = chat_texts(tok, questions)
    n = 24
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n), use_tqdm=False)

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    compared = 0
    for prompt, out in zip(prompts, outs):
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        assert out["prompt_token_ids"] == ids[0].tolist()
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=n, do_sample=False)[0, ids.shape[1] :].tolist()
        # HF stops at EOS (keeping it); so does nanospec (finish_reason "stop", the id kept in token_ids)
        assert out["token_ids"] == ref, (tok.decode(out["token_ids"]), tok.decode(ref))
        assert out["finish_reason"] == ("stop" if ref[-1] == tok.eos_token_id else "length")
        assert out["text"] == tok.decode(ref, skip_special_tokens=True)
        compared += len(ref)
    assert compared >= 2 * n  # chat answers run past 24 tokens: the comparison covers real decoding
    assert "Paris" in outs[0]["text"]
    assert llm.runner.allocator.num_free == llm.runner.allocator.num_usable
