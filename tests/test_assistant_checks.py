"""An assistant that does not fit the target is refused from the two configs, before any weights load (DESIGN
§4 rule 2: check, then construct, allocate, bind): a mismatch used to surface only after the target had
loaded."""

import copy

import pytest
import torch
from transformers import AutoConfig, Gemma4AssistantForCausalLM

import nanospec.loader as loader
from nanospec import LLM
from nanospec.tools.checkpoints import assistant_config_for


def save(path, cfg):
    torch.manual_seed(0)
    Gemma4AssistantForCausalLM(cfg).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize(
    "field,change",
    [
        ("vocab_size", dict(vocab_size=1000)),
        ("head_dim", dict(head_dim=8)),
        ("num_key_value_heads", dict(num_key_value_heads=3)),
        ("rope_theta", dict(rope_parameters={"rope_type": "default", "rope_theta": 5.0})),
    ],
)
def test_mismatch_refused_before_any_weights_load(tiny_llama_dir, tmp_path, monkeypatch, field, change):
    target = AutoConfig.from_pretrained(tiny_llama_dir)
    wrong = copy.deepcopy(target)
    for k, v in change.items():
        setattr(wrong, k, v)
    path = save(tmp_path / field, assistant_config_for(wrong, num_layers=1, hidden_size=32, num_heads=4))
    loads = []
    monkeypatch.setattr(loader, "load_weights", lambda *a, **k: loads.append("target"))
    monkeypatch.setattr(loader, "load_checkpoint", lambda *a, **k: loads.append("assistant"))
    with pytest.raises(ValueError, match=field.split("_")[0]):
        LLM(str(tiny_llama_dir), assistant=path, device="cpu", dtype="float32")
    assert loads == []  # neither the target's nor the assistant's tensors were read
