"""scripts/gpu_run.sh end to end on CPU (DRY_RUN=1: tiny sizes, no CUDA steps): a regenerated shard with its
provenance, a warm-started checkpoint, the paired eval tables, nothing written into the repo's data/."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from nanospec.default_model import DEFAULT_ASSISTANT

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(
    not (DEFAULT_ASSISTANT / "config.json").exists(), reason="no shipped assistant to warm-start"
)
def test_gpu_run_dry_run(tmp_path):
    before = sorted(p.relative_to(REPO) for p in (REPO / "data").rglob("*"))
    env = dict(
        os.environ,
        DRY_RUN="1",
        OMP_NUM_THREADS="1",
        PATH=f"{pathlib.Path(sys.executable).parent}:" + os.environ["PATH"],
    )
    for k in ("STEPS", "DATA", "TARGET", "INIT", "REGEN_MIN", "TRAIN_MIN"):  # the script's own defaults
        env.pop(k, None)
    r = subprocess.run(
        ["bash", "scripts/gpu_run.sh", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    steps = (tmp_path / "steps.txt").read_text().split("\n")
    assert [line.split()[:2] for line in steps if line] == [
        ["train", "rc=0"],
        ["eval", "rc=0"],
        ["eval_shipped", "rc=0"],
    ]
    (shard,) = (tmp_path / "data").glob("*.pt.gz")  # the new shard, copied out
    prov = json.loads(shard.with_name(shard.name.replace(".pt.gz", ".json")).read_text())
    assert prov["split"] == "train" and prov["target"] == "SmolLM2-135M-Instruct" and prov["sequences"] == 2
    assert prov["tokens"] > prov["prompt_tokens"] > 0 and prov["regeneration"]["temperatures"] == [0.0]
    info = json.loads((tmp_path / "assistant" / "training_info.json").read_text())
    assert info["regeneration"]["shard"] == shard.name and info["init"]["dir"] == str(DEFAULT_ASSISTANT)
    assert (tmp_path / "assistant" / "model.safetensors").is_file() and info["steps"] >= 1
    for name in ("eval", "eval_shipped"):
        assert "| sharegpt-eval | 0 | 1 | 1 | 2 |" in (tmp_path / f"{name}.txt").read_text()
    assert sorted(p.relative_to(REPO) for p in (REPO / "data").rglob("*")) == before
