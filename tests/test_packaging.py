"""kernels/ is only ever the subpackage ``nanospec.kernels`` (DESIGN §1): never a top-level ``kernels``
package, which would shadow (or be shadowed by) PyPI's ``kernels`` distribution that transformers imports.
In a source checkout ``nanospec/kernels`` is a committed link to the folder, so editors, type checkers and
anything that ships the ``nanospec`` folder find the kernels where the imports say they are."""

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest
import tomllib

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_nanospec_kernels_is_the_repo_folder():
    import nanospec.kernels
    from nanospec.kernels import attention

    assert [pathlib.Path(p).resolve() for p in nanospec.kernels.__path__] == [REPO / "kernels"]
    assert pathlib.Path(attention.__file__).resolve().parent == REPO / "kernels"
    # the engine imports the same module objects (one backend switch for everyone)
    from nanospec import model_runner
    from nanospec.kernels import sampling

    assert model_runner.sample is sampling.sample


def test_kernels_folder_is_no_regular_package():
    """A kernels/__init__.py would make the folder the package ``kernels`` for anything started from the repo
    root (its directory is sys.path[0]), ahead of PyPI's. ``nanospec/kernels`` is a link to it, tracked by git
    (mode 120000), not a copy."""
    assert not (REPO / "kernels" / "__init__.py").exists()
    link = REPO / "nanospec" / "kernels"
    assert link.is_symlink() and os.readlink(link) == "../kernels"
    if (REPO / ".git").exists():
        staged = subprocess.run(
            ["git", "ls-files", "-s", "nanospec/kernels"], cwd=REPO, capture_output=True, text=True
        )
        assert staged.stdout.startswith("120000 "), staged.stdout


def test_editor_goes_to_the_kernel():
    """jedi (the engine of many editors' go-to-definition) follows a kernel call in ``nanospec/context.py``
    to its definition in ``kernels/attention.py``."""
    jedi = pytest.importorskip("jedi")
    path = REPO / "nanospec" / "context.py"
    source = path.read_text()
    lines = source.splitlines()
    line = next(i for i, text in enumerate(lines, 1) if "return decode_attention(" in text)
    column = lines[line - 1].index("decode_attention") + 2
    script = jedi.Script(source, path=str(path), project=jedi.Project(str(REPO)))
    found = script.goto(line, column, follow_imports=True)
    assert [(pathlib.Path(d.module_path).resolve(), d.name) for d in found] == [
        (REPO / "kernels" / "attention.py", "decode_attention")
    ]


def test_type_checker_finds_the_kernels(tmp_path):
    """mypy resolves ``nanospec.kernels.attention`` from ``nanospec/context.py`` (without the link it reports
    "Cannot find implementation or library stub")."""
    pytest.importorskip("mypy")
    cmd = [sys.executable, "-m", "mypy", "--follow-imports=silent", "--cache-dir", str(tmp_path / "cache")]
    out = subprocess.run([*cmd, "nanospec/context.py"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "nanospec.kernels" not in out.stdout


def test_a_kernel_imports_without_the_engine():
    """``import nanospec.kernels.sampling`` loads torch and triton, not the engine or transformers (the
    package loads ``LLM`` on first use, PEP 562)."""
    code = (
        "import sys, nanospec.kernels.sampling; "
        "print(sorted(m for m in sys.modules if m.startswith(('transformers', 'nanospec.'))))"
    )
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    imported = [line.split("|")[-1].strip() for line in out.stderr.splitlines() if "|" in line]
    assert not [m for m in imported if m.split(".")[0] == "transformers"]
    assert eval(out.stdout) == ["nanospec.kernels", "nanospec.kernels.backend", "nanospec.kernels.sampling"]
    code = "import nanospec; print(nanospec.SamplingParams(max_tokens=3).max_tokens, nanospec.LLM.__name__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["3", "LLM"], out.stderr
    import nanospec

    with pytest.raises(AttributeError, match="no attribute 'Llm'"):
        nanospec.Llm  # noqa: B018


def test_pyproject_maps_kernels_under_nanospec():
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())
    st = cfg["tool"]["setuptools"]
    packages = st["packages"]
    assert isinstance(packages, list), "explicit package list (a find: could pick up a top-level kernels/)"
    assert "nanospec.kernels" in packages and "kernels" not in packages
    assert not any(p == "kernels" or p.startswith("kernels.") for p in packages)
    pkg_dir = st["package-dir"]
    assert pkg_dir["nanospec.kernels"] == "kernels"
    assert "" not in pkg_dir and "kernels" not in pkg_dir
    # every package the build lists exists on disk where package-dir says
    for p in packages:
        d = REPO / pkg_dir.get(p, p.replace(".", "/"))
        assert (d / "__init__.py").is_file() or p == "nanospec.kernels", p


@pytest.mark.parametrize("where", ["repo", "elsewhere"])
def test_top_level_kernels_is_never_ours(tmp_path, where):
    """From the repo root (sys.path[0]) and from elsewhere, ``import kernels`` is PyPI's package (or absent),
    and transformers' model code imports next to nanospec."""
    code = (
        "import importlib.util, transformers.activations, nanospec.kernels as k; "
        "s = importlib.util.find_spec('kernels'); print(k.__path__[0]); "
        "print(s.origin if s and s.origin else None)"
    )
    cwd = REPO if where == "repo" else tmp_path
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, check=True, timeout=300
    )
    ours, top = out.stdout.split()
    assert pathlib.Path(ours).resolve() == REPO / "kernels"
    assert top == "None" or not pathlib.Path(top).resolve().is_relative_to(REPO / "kernels")


@pytest.mark.skipif(
    importlib.util.find_spec("setuptools") is None, reason="needs setuptools to build a wheel"
)
def test_wheel_contents(tmp_path):
    """Build the wheel (offline, from a copy of the sources) and look inside."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, src / name)
    if not (src / "README.md").exists():
        (src / "README.md").write_text("nanospec\n")
    for d in ("nanospec", "kernels"):
        shutil.copytree(REPO / d, src / d, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(src),
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(tmp_path / "dist"),
        ],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    names = zipfile.ZipFile(next((tmp_path / "dist").glob("nanospec-*.whl"))).namelist()
    tops = {n.split("/")[0] for n in names}
    assert "kernels" not in tops and {"nanospec"} <= tops
    ours = {p.name for p in (REPO / "kernels").glob("*.py")}
    assert {n.split("/")[-1] for n in names if n.startswith("nanospec/kernels/")} >= ours
    assert "nanospec/models/llama.py" in names and "nanospec/mtp/__init__.py" in names
    assert {
        f"nanospec/tools/{m}.py" for m in ("__init__", "train", "eval", "bench", "datasets", "cli")
    } <= set(names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert (
        "nanospec-train = nanospec.tools.train:main"
        in zipfile.ZipFile(next((tmp_path / "dist").glob("nanospec-*.whl"))).read(entry_points).decode()
    )
    # installed from the wheel, nanospec.kernels is the folder inside the installed nanospec
    target = tmp_path / "site"
    wheel = next((tmp_path / "dist").glob("nanospec-*.whl"))
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target)]
    subprocess.run([*pip, str(wheel)], check=True, capture_output=True)
    code = "import nanospec.kernels as k, nanospec.kernels.attention; print(k.__path__[0])"
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert pathlib.Path(out.stdout.strip()).resolve() == (target / "nanospec" / "kernels").resolve()


def test_console_scripts_point_at_mains():
    """pyproject's console scripts (nanospec-train, -eval, -bench) name functions that exist."""
    import importlib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"nanospec-train", "nanospec-eval", "nanospec-bench"} <= scripts.keys()
    for target in scripts.values():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func)), target
