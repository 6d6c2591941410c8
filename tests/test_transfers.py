"""The step path sends data to the device only through ``nanospec.transfer.to_device`` and reads nothing back
but the one host copy a step is committed from (DESIGN §5, "Overlap scheduling").

On a CPU a blocking copy cannot be seen, so the CPU test watches the calls instead: during steady-state steps
(every request decoding, its block table growing; plain, chain and tree; overlap on) no engine module outside
``transfer.py`` creates a tensor from host data (``torch.tensor`` / ``torch.as_tensor``), moves one to a
device (``Tensor.to(device)``) or indexes with a Python list (an implicit host-to-device copy), and none
outside ``transfer.py`` (the step's ``HostCopy``) reads device values (``tolist`` / ``item``). On CUDA the
same steps run under ``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronizing call,
except the commit's read.
"""

import pathlib
import sys

import pytest
import torch
from helpers import greedy, make_llm

import nanospec
from nanospec import transfer

ENGINE = pathlib.Path(nanospec.__file__).resolve().parent
ALLOWED_WRITERS = {ENGINE / "transfer.py"}
ALLOWED_READERS = {ENGINE / "transfer.py"}
MODES = {"plain": {}, "chain": dict(num_steps=3), "tree": dict(num_steps=2, topk=2, num_draft_tokens=4)}


def _engine_caller() -> pathlib.Path | None:
    """The nanospec module (not kernels/, not tests) that made the call being watched, if any."""
    frame = sys._getframe(2)
    path = pathlib.Path(frame.f_code.co_filename).resolve()
    return path if path.is_relative_to(ENGINE) else None


class Watch:
    """Records watched calls made from engine modules while active."""

    def __init__(self, monkeypatch):
        self.calls = []
        self.active = False
        for name in ("tensor", "as_tensor"):
            self._wrap(monkeypatch, torch, name, ALLOWED_WRITERS, lambda *a, **k: True)
        self._wrap(monkeypatch, torch.Tensor, "to", ALLOWED_WRITERS, _moves_device)
        self._wrap(monkeypatch, torch.Tensor, "__getitem__", ALLOWED_WRITERS, _list_index)
        self._wrap(monkeypatch, torch.Tensor, "__setitem__", ALLOWED_WRITERS, _list_index)
        for name in ("tolist", "item"):
            self._wrap(monkeypatch, torch.Tensor, name, ALLOWED_READERS, lambda *a, **k: True)

    def _wrap(self, monkeypatch, owner, name, allowed, flagged):
        orig = getattr(owner, name)

        def watched(*args, **kwargs):
            if self.active and flagged(*args, **kwargs):
                caller = _engine_caller()
                if caller is not None and caller not in allowed:
                    self.calls.append(f"{name} from {caller.name}:{sys._getframe(1).f_lineno}")
            return orig(*args, **kwargs)

        monkeypatch.setattr(owner, name, watched)


def _moves_device(tensor, *args, **kwargs) -> bool:
    targets = [*args, kwargs.get("device")]
    return any(isinstance(t, (str, torch.device, torch.Tensor)) for t in targets)


def _list_index(tensor, index, *rest) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, list) for p in parts)


def _steady_engine(tiny_llama_dir, asst_dir, mode, device="cpu"):
    assistant = asst_dir if mode != "plain" else None
    llm = make_llm(tiny_llama_dir, assistant, overlap_schedule=True, device=device, **MODES[mode])
    for p in ([1, 2, 3, 4, 5], [9] * 11, [40, 41, 42]):
        llm.add_request(p, greedy(40))
    while llm.scheduler.waiting or llm.scheduler.last_kind != "decode":
        llm.step()
    return llm


@pytest.mark.parametrize("mode", list(MODES))
def test_steady_steps_send_through_the_transfer_owner_only(tiny_llama_dir, asst_dir, mode, monkeypatch):
    llm = _steady_engine(tiny_llama_dir, asst_dir, mode)
    blocks = sum(len(r.block_table) for r in llm.scheduler.running)
    watch = Watch(monkeypatch)
    watch.active = True
    for _ in range(8):
        llm.step()
    watch.active = False
    assert all(len(r.output_token_ids) < 40 for r in llm.scheduler.running)  # all 8 steps were decode steps
    assert watch.calls == []
    # the steps wrote the blocks they added into their rows (PersistentBatch.block_tables)
    assert sum(len(r.block_table) for r in llm.scheduler.running) > blocks


def test_the_watch_sees_a_blocking_copy(tiny_llama_dir, monkeypatch):
    """The watch itself can fail: an engine module's ``torch.tensor(...).to(device)`` is reported."""
    from nanospec import model_runner

    watch = Watch(monkeypatch)
    watch.active = True
    exec(compile("torch.tensor([1]).to('cpu')", model_runner.__file__, "exec"), {"torch": torch})
    assert len(watch.calls) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", list(MODES))
def test_cuda_steady_steps_never_sync_but_at_commit(tiny_llama_dir, asst_dir, mode, monkeypatch):
    """50 steady-state steps under sync debug mode "error"; the one sync (``HostCopy.tolist``, reading the
    step being committed) is allowed."""
    llm = _steady_engine(tiny_llama_dir, asst_dir, mode, device="cuda")
    orig = transfer.HostCopy.tolist

    def commit_read(self):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return orig(self)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(transfer.HostCopy, "tolist", commit_read)
    for p in ([7] * 30, [8] * 20):
        llm.add_request(p, greedy(80))
    while llm.scheduler.waiting:
        llm.step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(50):
            llm.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
