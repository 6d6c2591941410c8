"""docs/usage.md is the one reference of every option: each ``EngineConfig`` and ``SamplingParams`` field is
in its table with its default, and no row or documented call names an option the code does not have."""

import ast
import dataclasses
import pathlib
import re

import pytest

from nanospec.config import EngineConfig
from nanospec.sampling_params import SamplingParams

REPO = pathlib.Path(__file__).resolve().parents[1]
USAGE = REPO / "docs" / "usage.md"
TABLES = {"## `LLM` options": EngineConfig, "## `SamplingParams`": SamplingParams}


def reference_table(heading: str) -> dict:
    """{name: default cell} of the first markdown table under ``heading`` in docs/usage.md."""
    lines = USAGE.read_text().splitlines()
    assert heading in lines, f"docs/usage.md has no section {heading!r}"
    rows = {}
    for line in lines[lines.index(heading) + 1 :]:
        if line.startswith("## "):
            break
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if not cells[0].startswith("`"):  # the header row and the |---| row
            continue
        rows[cells[0].strip("`")] = cells[1]
    return rows


@pytest.mark.parametrize("heading", TABLES)
def test_every_field_is_in_the_reference_with_its_default(heading):
    fields = {f.name: f.default for f in dataclasses.fields(TABLES[heading])}
    rows = reference_table(heading)
    assert sorted(set(fields) - set(rows)) == [], "fields missing from docs/usage.md"
    assert sorted(set(rows) - set(fields)) == [], "rows of docs/usage.md that are not fields"
    for name, default in fields.items():
        assert rows[name].startswith("`") and rows[name].endswith("`"), (name, rows[name])
        shown = ast.literal_eval(rows[name].strip("`"))
        assert (type(shown), shown) == (type(default), default), (
            f"{name}: docs show {shown!r}, code {default!r}"
        )


def test_documented_calls_name_real_options():
    """Every ``LLM(name=...)`` / ``SamplingParams(name=...)`` in README.md and docs/ names a field."""
    known = {
        "LLM": {f.name for f in dataclasses.fields(EngineConfig)},
        "SamplingParams": {f.name for f in dataclasses.fields(SamplingParams)},
    }
    wrong = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for call in re.finditer(r"\b(LLM|SamplingParams)\(([^()]*)\)", path.read_text()):
            for name in re.findall(r"(\w+)\s*=", call.group(2)):
                if name not in known[call.group(1)]:
                    wrong.append(f"{path.name}: {call.group(1)}({name}=...)")
    assert wrong == []
