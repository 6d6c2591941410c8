"""Benchmark nanospec (the nano-vllm workload, ShareGPT, batch-1 latency, HF comparison): `python bench.py
--help`.

The same as the `nanospec-bench` command; the code is in nanospec/tools/bench.py.
"""

from nanospec.tools.bench import main

if __name__ == "__main__":
    main()
