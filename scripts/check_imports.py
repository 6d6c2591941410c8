"""The import graph of nanospec/ and kernels/: no circles, and the layers import only downwards.

Every ``import`` and ``from ... import`` in every .py file counts, at module level or inside a function,
with relative imports resolved (kernels/ is the package ``nanospec.kernels``). An import is an edge to the
module whose code it reads and to every package Python runs on the way there: ``from .models.llama import
x`` in ``nanospec/parallel.py`` reaches ``nanospec.models.llama`` and ``nanospec.models`` (its
``__init__.py``), but not ``nanospec``, which any module of the package is already inside.

Rules:

- no circle: every group of files that import each other in a circle is reported with one circle through it;
- ``kernels/`` imports nothing from the rest of nanospec (ops and their references only);
- the engine (``nanospec/`` without ``tools/``, ``serve/`` and a ``ray`` front end) imports no front end.

    python scripts/check_imports.py      # prints what breaks a rule; exit 1 if anything does
"""

import ast
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
FRONT_ENDS = ("nanospec.tools", "nanospec.serve", "nanospec.ray")


def module_name(path: pathlib.Path) -> str:
    """``nanospec/models/llama.py`` -> ``nanospec.models.llama``; ``kernels/x.py`` ->
    ``nanospec.kernels.x``."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[0] == "kernels":
        parts = ["nanospec", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def source_files() -> dict:
    """{module name: path} of every .py file under nanospec/ and kernels/."""
    files = sorted((REPO / "nanospec").rglob("*.py")) + sorted((REPO / "kernels").rglob("*.py"))
    return {module_name(p): p for p in files}


def nearest_module(name: str, files: dict) -> str | None:
    """``name`` if it is one of ``files``, else its nearest package among them (None: outside nanospec)."""
    while name and name not in files:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(path: pathlib.Path, module: str, files: dict) -> set:
    """The modules of ``files`` that ``path`` (module ``module``) imports, function-local imports included."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(nearest_module(alias.name, files) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up level - 1 packages from this module's own package
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:  # a submodule, or a name defined in the module ``base``
                targets.add(nearest_module(f"{base}.{alias.name}", files))
    targets.discard(None)
    for target in list(targets):  # the packages on the way, except the ones this module is inside
        parts = target.split(".")
        for i in range(1, len(parts)):
            above = ".".join(parts[:i])
            if above in files and not module.startswith(above + "."):
                targets.add(above)
    targets.discard(module)
    return targets


def import_graph() -> dict:
    """{module: set of the modules under nanospec/ and kernels/ it imports}."""
    files = source_files()
    return {module: imports_of(path, module, files) for module, path in files.items()}


def strongly_connected(graph: dict) -> list:
    """The groups of modules that reach each other (Tarjan's algorithm), each of more than one module."""
    index = {}
    low = {}
    stack = []
    on_stack = set()
    groups = []

    def visit(v):
        index[v] = len(index)
        low[v] = index[v]
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def shortest_circle(graph: dict, group: list) -> list:
    """One shortest circle inside ``group``, starting and ending at its first module (breadth-first)."""
    start = group[0]
    came_from = {start: None}
    queue = [start]
    for v in queue:
        for w in sorted(graph[v]):
            if w == start:
                path = [v]
                while came_from[path[-1]] is not None:
                    path.append(came_from[path[-1]])
                return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
            if w in group and w not in came_from:
                came_from[w] = v
                queue.append(w)
    return []


def is_front_end(module: str) -> bool:
    return module.startswith(FRONT_ENDS)


def layer_violations(graph: dict) -> list:
    """Imports that go the wrong way: kernels -> the rest of nanospec, the engine -> a front end."""
    bad = []
    for module, edges in sorted(graph.items()):
        for target in sorted(edges):
            kernels_out = module.startswith("nanospec.kernels") and not target.startswith("nanospec.kernels")
            if kernels_out:
                bad.append(f"{module} imports {target}: kernels/ imports nothing from nanospec")
            if not is_front_end(module) and is_front_end(target):
                bad.append(f"{module} imports {target}: the engine imports no front end")
    return bad


def main() -> int:
    graph = import_graph()
    files = source_files()
    groups = strongly_connected(graph)
    for group in groups:
        print(f"import circle among {len(group)} files:")
        for module in group:
            print(f"  {files[module].relative_to(REPO)}")
        print("  e.g. " + " -> ".join(shortest_circle(graph, group)))
    bad = layer_violations(graph)
    for line in bad:
        print(line)
    edges = sum(len(e) for e in graph.values())
    print(f"{len(graph)} files, {edges} imports: {len(groups)} circle(s), {len(bad)} layer violation(s)")
    return 1 if groups or bad else 0


if __name__ == "__main__":
    sys.exit(main())
