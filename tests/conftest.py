import os

# Triton's interpreter must be chosen before any kernel is first launched; CPU tensors only run through it.
# NANOSPEC_TEST_DEVICE=cuda (GPU machines) instead compiles the kernels for real on CUDA default tensors.
ON_GPU = os.environ.get("NANOSPEC_TEST_DEVICE") == "cuda"
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if ON_GPU:
    torch.set_default_device("cuda")

# One intra-op thread: the tests' ops are small, and with two threads every op pays an OpenMP barrier that
# costs milliseconds whenever the other core is busy (8 s vs 230 s for one test on a loaded 2-core box).
torch.set_num_threads(int(os.environ.get("NANOSPEC_TEST_THREADS", "1")))


# pyproject's addopts run the suite in two pytest-xdist workers (`-n 2 --dist loadfile`; `-n 0` runs it in
# one process). A test file is one unit of work, so its module fixtures (engines, servers) are built once,
# and the tests that start a Ray cluster live in one file (test_ray.py), so two clusters never run at once.
# The slowest files start first, so that the two workers finish together.
SLOW_FIRST = ["test_kernel_specs", "test_fresh_machine", "test_tp", "test_deterministic", "test_ray"]


def pytest_collection_modifyitems(config, items):
    rank = {name: k for k, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__, len(rank)))


@pytest.fixture
def triton_backend():
    """Force every kernel through Triton (the interpreter on CPU) for one test."""
    from nanospec.kernels.backend import using_backend

    with using_backend("triton"):
        yield


# --------------------------------------------------------------------------------------------- tiny HF models
def randomize(model, seed: int, std: float = 0.15) -> None:
    """Non-trivial random weights: matrices N(0, std), norm weights around 1 (so every tensor matters and the
    logits are spread out, which keeps greedy argmax far from ties)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, t in model.state_dict().items():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g) * std + (1.0 if t.dim() == 1 else 0.0))


def make_tiny_model(path, tokenizer, arch: str = "llama", seed: int = 0, **overrides):
    """Save a tiny random HF Llama / Qwen3 (fp32 safetensors + ``tokenizer``) in ``path``; returns ``path``.

    Defaults: hidden 64, 2 layers, 4 heads / 2 KV heads, head_dim 16, the tokenizer's vocab (SmolLM2: 49152).
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    base = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    base.update(overrides)
    cfg_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[
        arch
    ]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**base)).float().eval()
    randomize(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def vocab8_target(path, tokenizer):
    """A tiny Llama over an 8-token vocabulary (sampling statistics see every token often)."""
    kw = dict(vocab_size=8, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    return make_tiny_model(path, tokenizer, seed=7, **kw)


@pytest.fixture(scope="session")
def smollm2_dir():
    """The default SmolLM2-135M-Instruct HF dir (converted into the nanospec cache on first use)."""
    from nanospec.loader import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from nanospec.loader import load_tokenizer

    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_tokenizer):
    """Tiny random Llama (untied lm_head), SmolLM2 tokenizer and vocab (49152)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), smollm2_tokenizer, "llama", seed=1)


@pytest.fixture(scope="session")
def tiny_llama_tied_dir(tmp_path_factory, smollm2_tokenizer):
    """Tiny random Llama with tied embeddings (as SmolLM2), 3 layers."""
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny_llama_tied"),
        smollm2_tokenizer,
        "llama",
        seed=2,
        tie_word_embeddings=True,
        num_hidden_layers=3,
    )


@pytest.fixture(scope="session")
def tiny_llama3_rope_dir(tmp_path_factory, smollm2_tokenizer):
    """Tiny random Llama 3 with llama3 rope scaling (a short original context, so the scaling bites)."""
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny_llama3"), smollm2_tokenizer, "llama", seed=3, rope_parameters=rope
    )


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory, smollm2_tokenizer):
    """Tiny random Qwen3 (per-head q/k norm, head_dim 16, untied)."""
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny_qwen3"),
        smollm2_tokenizer,
        "qwen3",
        seed=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )


@pytest.fixture(scope="session")
def micro_llama_dir(tmp_path_factory, smollm2_tokenizer):
    """A very small Llama (hidden 32, vocab 512: the SmolLM2 tokenizer's first 512 ids) for interpreter runs;
    feed it token-id prompts below 512."""
    return make_tiny_model(
        tmp_path_factory.mktemp("micro_llama"),
        smollm2_tokenizer,
        "llama",
        seed=5,
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )


# ----------------------------------------------------------------- speculative engine: tiny Llama + assistant
def save_assistant(path, target_cfg, seed=7, **kw):
    """Save a random ``gemma4_assistant`` for ``target_cfg`` in ``path``; returns ``path``.

    2 layers, H 32, 4 heads, own LM head; ``kw`` overrides those ``assistant_config_for`` arguments.
    """
    from transformers import Gemma4AssistantForCausalLM

    from nanospec.tools.checkpoints import assistant_config_for

    cfg = assistant_config_for(target_cfg, **{"num_layers": 2, "hidden_size": 32, "num_heads": 4, **kw})
    torch.manual_seed(seed)
    model = Gemma4AssistantForCausalLM(cfg).eval()
    randomize(model, seed, 0.3)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target_cfg(tiny_llama_dir):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def asst_dir(tmp_path_factory, target_cfg):
    """A random 2-layer gemma4_assistant for the tiny Llama (H 32, 4 heads of head_dim 16, own LM head)."""
    return save_assistant(tmp_path_factory.mktemp("assistant"), target_cfg)


@pytest.fixture(scope="module")
def ref_llm(tiny_llama_dir):
    from helpers import make_llm

    return make_llm(tiny_llama_dir)


@pytest.fixture(scope="module")
def reference(ref_llm):
    """prompt -> the target's spec-off greedy continuation (REF_LEN tokens, batch of one), cached."""
    from helpers import greedy

    cache = {}

    def ref(prompt):
        key = tuple(prompt)
        if key not in cache:
            cache[key] = ref_llm.generate([list(prompt)], greedy(), use_tqdm=False)[0]["token_ids"]
        return cache[key]

    return ref


@pytest.fixture
def device_oracle(monkeypatch, reference):
    """An oracle drafter (``helpers.install_drafter``) for the tiny Llama: chain drafts = the reference
    continuation after each row's device L; drafts at an L divisible by 3 go wrong at depth 2 (a function of
    the row's state only), so commits of 3 and of 4 tokens both occur."""
    import torch
    from helpers import install_drafter

    from nanospec.mtp.draft import chain_tree

    def draft(
        self, reqs, block_table, num_computed_tokens, num_splits=None, draft_length=None, sampling=None
    ):
        inp = self.persistent_batch.take(reqs)
        S = self.num_steps if draft_length is None else draft_length
        rows = []
        for r, L in zip(reqs, num_computed_tokens.tolist()):
            ref, n_out = reference(r.prompt_token_ids), L - len(r.prompt_token_ids) + 1
            d = (ref[n_out : n_out + S] + [0] * S)[:S]
            rows.append(d if L % 3 else d[:2] + [(t + 1) % 49152 for t in d[2:]])
        return chain_tree(inp.bonus_tokens, torch.tensor(rows, dtype=torch.long).view(len(reqs), S))

    install_drafter(monkeypatch, draft)
