"""Every way README and docs/ start nanospec, started as a new user starts it: from the repo root (the cwd,
and sys.path[0] for ``python example.py`` / ``python -c`` / ``python -m``), with the newest transformers and
PyPI's ``kernels`` installed (transformers imports ``kernels`` whenever its model code loads), the test
settings (``TRITON_INTERPRET``) out of the environment. The repo's top-level ``kernels/`` folder must never
be imported as ``kernels`` there (DESIGN §1). The model runs use the default model or a tiny one and a few
tokens; every process is bounded in time and stopped, even when a test fails. ``.ci/run`` runs README's
quick-start commands themselves (CONTRIBUTING.md lists which test runs which documented command)."""

import ast
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from nanospec.tools import serve_bench

REPO = pathlib.Path(__file__).resolve().parents[1]
BIN = pathlib.Path(sys.executable).parent
TOK_S_LINE = re.compile(r"^(\d+) tokens in [\d.]+s: [\d.]+ tok/s \((cpu|cuda), assistant default\)$", re.M)
ACCEPTANCE_LINE = re.compile(r"^mean acceptance length: ([\d.]+) tokens per verify step$", re.M)
TOTAL_LINE = re.compile(r"^Total: (\d+)tok, Time: [\d.]+s, Throughput: [\d.]+tok/s$", re.M)


def user_env() -> dict:
    """The environment of a user's shell: without the test settings, one thread (these runs check that the
    commands start and answer, not their speed)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONSAFEPATH")}
    return env | {"OMP_NUM_THREADS": "1"}


def run_from_root(*argv, timeout=600):
    """``argv`` run with the repo root as cwd; the finished process (stdout, stderr as text)."""
    return subprocess.run(argv, cwd=REPO, env=user_env(), capture_output=True, text=True, timeout=timeout)


def readme_section(title: str) -> str:
    """The text of README's section ``## title`` (up to the next ``## ``)."""
    text = (REPO / "README.md").read_text()
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_ci_runs_readme_quick_start_first_command_verbatim():
    """README's first quick-start command is a line of .ci/run as it stands; the second one's parts (venv,
    install, pytest) are there too (split so that no tests collected is a failure)."""
    first, second = re.findall(r"^python3 -m venv .*$", readme_section("Quick start"), re.M)
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert first in [line.strip() for line in ci]
    parts = second.split(" && ")
    assert parts == [
        "python3 -m venv .venv",
        ". .venv/bin/activate",
        "pip install -e '.[cpu,test]'",
        "pytest -q",
    ]
    assert {"python3 -m venv .venv", ". .venv/bin/activate", "pytest -q"} <= set(ci)
    assert "pip install -q -e '.[cpu,test]'" in ci
    assert "export NANOSPEC_CACHE=$empty_cache" in [line.strip() for line in ci]


def test_transformers_model_code_imports_next_to_nanospec():
    """``python -c "import transformers.activations, nanospec"`` (and ``kernels`` after them, one process):
    transformers' model code imports PyPI's ``kernels``, which must be the installed distribution, not the
    repo's folder."""
    code = "import transformers.activations, nanospec, kernels; print(kernels.__file__)"
    r = run_from_root(sys.executable, "-c", code, timeout=300)
    assert r.returncode == 0, r.stderr
    installed = importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py")
    assert pathlib.Path(r.stdout.strip()).resolve() == pathlib.Path(installed).resolve()


def test_example_py():
    """``python example.py --max-tokens 4``: the default model with the shipped assistant. On a CPU (fp32,
    greedy) each completion starts as README's output shows it."""
    r = run_from_root(sys.executable, "example.py", "--max-tokens", "4")
    assert r.returncode == 0, r.stderr[-3000:]
    completions = dict(re.findall(r"^Prompt: (.*)\nCompletion: (.*)$", r.stdout, re.M))
    assert len(completions) == 4
    ((ntok, device),) = TOK_S_LINE.findall(r.stdout)  # exactly one such line
    (acceptance,) = ACCEPTANCE_LINE.findall(r.stdout)
    assert int(ntok) == 16  # 4 prompts x 4 tokens, none ends within 4
    most_drafts = 3 if device == "cpu" else 5  # the default num_steps
    assert 1.0 <= float(acceptance) <= most_drafts + 1  # accepted drafts + the bonus token
    if device == "cpu":
        shown = readme_section("What `python example.py` prints")
        readme = dict(re.findall(r'^Prompt: (.*)\nCompletion: "(.*)$', shown, re.M))
        assert len(readme) == 2
        for prompt, text in readme.items():
            assert text.startswith(ast.literal_eval(completions[prompt])), (prompt, completions[prompt])


def test_bench_py_compare_hf(tiny_llama_dir):
    """``python bench.py`` on a tiny Llama with ``--compare-hf``: nanospec's and HF's generate both run (HF's
    model code is what imports PyPI's ``kernels``), 2 requests x 4 tokens each."""
    tiny = (
        "--num-seqs 2 --max-input-len 16 --max-output-len 4 --device cpu --max-model-len 64 --max-num-seqs 4"
    )
    r = run_from_root(
        sys.executable, "bench.py", "--model", str(tiny_llama_dir), *tiny.split(), "--compare-hf"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (total,) = TOTAL_LINE.findall(r.stdout)
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert int(total) == res["total_tokens"] == res["hf_total_tokens"] == 8
    assert res["hf_num_seqs"] == 2 and "HF transformers: Total: 8tok" in r.stdout


def test_serve_answers_health_and_readme_request():
    """``python -m nanospec.serve`` (the default model and its shipped assistant, as README's
    ``nanospec-serve``) on a free loopback port until /health answers; then README's curl request (its
    path and body, read from README) gets a chat completion."""
    (curl,) = re.findall(
        r"^curl -s http://127.0.0.1:8000(\S+) .*\n.* -d '(.*)'$", readme_section("Serving"), re.M
    )
    path, body = curl[0], json.loads(curl[1])
    proc, url = serve_bench.launch(["--max-model-len", "512"], 300, cwd=REPO, env=user_env())
    try:
        assert httpx.get(url + "/health", timeout=60).status_code == 200
        answer = httpx.post(url + path, json=body, timeout=300)
        assert answer.status_code == 200, answer.text
        out = answer.json()
        assert out["model"] == body["model"] == "SmolLM2-135M-Instruct"
        assert out["choices"][0]["message"]["content"] and out["usage"]["completion_tokens"] >= 1
    finally:
        serve_bench.stop(proc)


# documented commands no test runs whole from the repo root (a measurement, or run in process elsewhere)
HELP = {
    "nanospec-serve --help": "usage: nanospec-serve",
    "nanospec-train --help": "usage: nanospec-train",
    "nanospec-eval --help": "usage: nanospec-eval",
    "nanospec-bench --help": "usage: bench.py",
    "python -m nanospec.tools.train --help": "usage: nanospec-train",
    "python -m nanospec.tools.eval --help": "usage: nanospec-eval",
    "python scripts/spec_goal.py --help": "usage: spec_goal.py",
    "python scripts/deterministic_check.py --help": "usage: deterministic_check.py",
    "python scripts/ray_scaling.py --help": "usage: ray_scaling.py",
    "python scripts/offline_bundle.py --help": "usage: nanospec-bundle",
    "python scripts/kernel_specs.py --help": "usage: kernel_specs.py",
    "python scripts/code_lines.py --help": "usage: code_lines.py",
    "python scripts/memory_plan.py --help": "usage: memory_plan.py",
    "python scripts/cpu_gemm.py --help": "usage: cpu_gemm.py",
}


@pytest.fixture(scope="module")
def help_runs():
    """command -> its finished process; the commands run side by side, one per core (each is an import-bound
    process of its own, started from the repo root as the tests below say)."""

    def start(command):
        program, *args = command.split()
        program = sys.executable if program == "python" else str(BIN / program)
        return run_from_root(program, *args, timeout=300)

    with ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
        return dict(zip(HELP, pool.map(start, HELP)))


@pytest.mark.parametrize("command", HELP)
def test_command_starts_from_the_repo_root(command, help_runs):
    """The command starts from the repo root: its imports (nanospec, transformers, ray) load and its options
    parse. ``python`` is this venv's, a console script this venv's."""
    r = help_runs[command]
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith(HELP[command]), r.stdout[:300]
