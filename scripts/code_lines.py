"""Code lines per budget (CONTRIBUTING.md): lines holding code; not blank, not only a comment, not docstring.

python scripts/code_lines.py          # every budget, a request's path and every file over 400 code lines;
                                      # exit 1 if one is over
python scripts/code_lines.py --files  # also every file, largest first

"""

import argparse
import io
import pathlib
import sys
import tokenize

REPO = pathlib.Path(__file__).resolve().parents[1]
FILE_LIMIT = 400
SKIPPED = (
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
)
STATEMENT_START = (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)


def code_lines(path: pathlib.Path) -> int:
    """The lines of ``path`` holding a token of code; a string standing alone as a statement is a docstring
    and does not count."""
    lines = set()
    previous = None  # the last token that was not a comment or a blank line
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type in SKIPPED:
            if tok.type not in (tokenize.NL, tokenize.COMMENT):
                previous = tok
            continue
        standalone = previous is None or previous.type in STATEMENT_START
        if not (tok.type == tokenize.STRING and standalone):
            lines.update(range(tok.start[0], tok.end[0] + 1))
        previous = tok
    return len(lines)


def is_front_end(path: pathlib.Path) -> bool:
    """``nanospec/tools/``, ``nanospec/serve/`` or ``nanospec/ray*`` (``ray.py`` or a ``ray`` folder)."""
    top = path.relative_to(REPO / "nanospec").parts[0]
    return top in ("tools", "serve") or top.startswith("ray")


# The layers beside the core (DESIGN §1): each one concern in its own file, off the core's path when unused.
LAYERS = {
    "nanospec/parallel.py": "tensor parallelism",
    "nanospec/structured.py": "structured output",
    "nanospec/models/gemma4.py": "the Gemma 4 target, MoE included",
    "nanospec/default_model.py": "the default model's download and conversion",
    "nanospec/cpu.py": "the CPU thread policy",
    "nanospec/logprobs.py": "logprobs and prompt logprobs",
    "nanospec/trace.py": "the lifecycle trace",
    "nanospec/loader.py": "loading: HF dirs, the target's weights, the drafter's checkpoints",
}
LAYER_LIMIT = 300
PATH_FILES = 12  # a request's path: at most this many files
PATH_LIMIT = 1800  # and code lines


def budgets() -> dict:
    """{name: (files, most code lines)}."""
    nanospec = sorted(
        p for p in (REPO / "nanospec").rglob("*.py") if p.relative_to(REPO).parts[1] != "assets"
    )
    engine = [p for p in nanospec if not is_front_end(p)]
    layers = [REPO / name for name in LAYERS]
    lifecycle = [REPO / "nanospec" / n for n in ("llm.py", "scheduler.py", "kv_cache.py")]
    lifecycle += sorted((REPO / "nanospec" / "mtp").rglob("*.py"))
    return {
        "core (the engine without its layers)": ([p for p in engine if p not in layers], 2500),
        "layers (each <= 300, in its own file)": (layers, 1300),
        "engine (nanospec/ without tools/, serve/, ray*)": (engine, 3300),
        "kernels/": (sorted((REPO / "kernels").rglob("*.py")), 1800),
        "front ends (tools/, serve/, ray*)": ([p for p in nanospec if is_front_end(p)], 2200),
        "lifecycle (llm.py, scheduler.py, kv_cache.py, mtp/)": (lifecycle, 1000),
    }


def request_path() -> list[pathlib.Path]:
    """The engine files one request passes through, in README's reading order ("Read the code in this
    order": its rows naming a ``nanospec/`` file)."""
    text = (REPO / "README.md").read_text().split("## Read the code in this order")[1].split("\n\n## ")[0]
    rows = [line.split("|")[1].strip(" `") for line in text.splitlines() if line.startswith("| `nanospec/")]
    return [REPO / row for row in rows]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", action="store_true", help="list every file's code lines too")
    args = ap.parse_args(argv)
    over = False
    counted = {}
    for name, (files, limit) in budgets().items():
        total = 0
        for path in files:
            counted[path] = code_lines(path)
            total += counted[path]
        over |= total > limit
        print(f"{total:6d} / {limit:5d}  {name}{'  OVER' if total > limit else ''}")
    for name, concern in LAYERS.items():
        n = counted[REPO / name]
        over |= n > LAYER_LIMIT
        print(f"{n:6d} / {LAYER_LIMIT:5d}    {name}: {concern}{'  OVER' if n > LAYER_LIMIT else ''}")
    path = request_path()
    path_lines = sum(counted[p] for p in path)
    path_over = len(path) > PATH_FILES or path_lines > PATH_LIMIT
    over |= path_over
    where = f"README's reading order; at most {PATH_FILES} files / {PATH_LIMIT}"
    print(f"{path_lines:6d}  a request's path: {len(path)} files ({where}){'  OVER' if path_over else ''}")
    files = sorted(counted.items(), key=lambda item: -item[1])
    for path, n in files:
        if args.files or n > FILE_LIMIT:
            print(f"{n:6d}{'  OVER ' + str(FILE_LIMIT) if n > FILE_LIMIT else ''}  {path.relative_to(REPO)}")
    over |= files[0][1] > FILE_LIMIT
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
