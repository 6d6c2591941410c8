"""Offline bundle: the default model and the datasets, for a machine without network access.

    python scripts/offline_bundle.py --out DIR [--part-mb 60]

Fills the nanospec cache first where needed (the default model converted, ShareGPT and HumanEval fetched),
then writes ``DIR/nanospec-cache.tar.000``, ``.001``, ... (one uncompressed tar of the cache's
``SmolLM2-135M-Instruct/`` and ``data/``, about 650 MB, cut into parts of at most ``--part-mb`` MiB) and
``DIR/REASSEMBLE.txt`` with the command that rebuilds the cache on the other machine (nanospec then needs
neither pip nor gguf there):

    C=${NANOSPEC_CACHE:-~/.cache/nanospec}; mkdir -p "$C" && cat DIR/*.tar.* | tar -xC "$C"
"""

from __future__ import annotations

import argparse
import pathlib
import tarfile

from nanospec.loader import resolve_model_dir
from nanospec.tools import cli
from nanospec.tools.datasets import HUMANEVAL, SHAREGPT, data_file


def bundle(out: pathlib.Path, part_mb: int) -> list[pathlib.Path]:
    """Write the bundle (module docstring) into the existing dir ``out``; returns the part files, in order."""
    tar_path = out / "nanospec-cache.tar"
    model = resolve_model_dir(None)
    with tarfile.open(tar_path, "w") as tar:
        tar.add(model, arcname=model.name)
        for f in (data_file(SHAREGPT), data_file(HUMANEVAL)):
            tar.add(f, arcname=f"data/{f.name}")
    parts = []
    with open(tar_path, "rb") as src:
        while chunk := src.read(part_mb * 2**20):
            parts.append(out / f"{tar_path.name}.{len(parts):03d}")
            parts[-1].write_bytes(chunk)
    tar_path.unlink()
    cmd = f'C=${{NANOSPEC_CACHE:-~/.cache/nanospec}}; mkdir -p "$C" && cat {out.name}/*.tar.* | tar -xC "$C"'
    (out / "REASSEMBLE.txt").write_text(f"# run from the folder that holds {out.name}/\n{cmd}\n")
    return parts


def main(argv=None):
    """The bundle CLI (module docstring)."""
    ap = argparse.ArgumentParser("nanospec-bundle", description=__doc__, formatter_class=cli.HelpFormatter)
    ap.add_argument("--out", required=True, help="folder for the parts (created)")
    ap.add_argument("--part-mb", type=cli.number(int, 1), default=60, help="largest part, in MiB")
    a = ap.parse_args(argv)
    cli.make_out_dir(ap, "--out", a.out)
    parts = bundle(pathlib.Path(a.out), a.part_mb)
    how = (parts[0].parent / "REASSEMBLE.txt").read_text()
    print(f"{len(parts)} parts in {a.out}; on the other machine:\n{how}")


if __name__ == "__main__":
    main()
