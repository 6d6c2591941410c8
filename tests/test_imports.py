"""The import graph (scripts/check_imports.py): no circles, function-local imports included; kernels/ imports
nothing from nanospec; the engine imports no front end."""

import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import check_imports as ci  # noqa: E402


def test_no_import_circles():
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "check_imports.py")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 circle(s), 0 layer violation(s)" in result.stdout


def test_graph_sees_every_kind_of_import():
    graph = ci.import_graph()
    assert len(graph) >= 40
    # module level, relative and absolute
    assert "nanospec.kernels.attention_common" in graph["nanospec.kernels.attention"]
    assert "nanospec.scheduler" in graph["nanospec.llm"]
    # function-local imports count, and so do the packages run on the way (nanospec/models/__init__.py)
    assert {"nanospec.models.gemma4", "nanospec.models.llama"} <= graph["nanospec.models"]
    assert "nanospec.models" in graph["nanospec.loader"]


def test_circle_finder_reports_every_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}}
    assert ci.strongly_connected(graph) == [["a", "b", "c"], ["e", "f"]]
    assert ci.shortest_circle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert ci.strongly_connected({"a": {"b"}, "b": set()}) == []


def test_kernels_import_nothing_from_nanospec():
    graph = ci.import_graph()
    kernels = [m for m in graph if m.startswith("nanospec.kernels")]
    assert len(kernels) >= 10
    outside = {(m, t) for m in kernels for t in graph[m] if not t.startswith("nanospec.kernels")}
    assert outside == set()


def test_engine_imports_no_front_end():
    graph = ci.import_graph()
    engine = [m for m in graph if not ci.is_front_end(m)]
    assert "nanospec.llm" in engine and "nanospec.tools.bench" not in engine
    assert {(m, t) for m in engine for t in graph[m] if ci.is_front_end(t)} == set()
    assert ci.layer_violations({"nanospec.llm": {"nanospec.serve.server"}}) != []
    assert ci.layer_violations({"nanospec.kernels.norm": {"nanospec.cpu"}}) != []


def test_readme_reading_order_follows_the_imports():
    """README's "Read the code in this order" lists each engine file after every file of the list it
    imports (the packages ``nanospec`` and ``nanospec.mtp`` aside)."""
    text = (REPO / "README.md").read_text().split("## Read the code in this order")[1].split("\n\n## ")[0]
    order = []
    for line in text.splitlines():
        cells = line.split("|")
        if len(cells) < 3 or not cells[1].strip().startswith("`nanospec/"):
            continue
        first, *others = [name.strip(" `") for name in cells[1].split(",")]
        folder = first.rpartition("/")[0]
        for name in [first, *[f"{folder}/{other}" for other in others]]:
            order.append(ci.module_name(REPO / name))
    assert len(order) >= 12 and "nanospec.llm" in order
    graph = ci.import_graph()
    for i, module in enumerate(order):
        later = set(order[i + 1 :]) & graph[module]
        assert not later, f"README lists {module} before {sorted(later)}, which it imports"
