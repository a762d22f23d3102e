"""The docs stay true to the code: the reading path (docs/reading.md) names files that exist, at the sizes it gives,
at most 10 library files for a family; every file and `module.name` the docs, the README and the code's own
docstrings point at exists."""

from __future__ import annotations

import ast
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
READING = ROOT / "docs" / "reading.md"
ENTRY = re.compile(r"^\d+\. `([\w/]+\.py)` \((\d+) lines\)")
ANY_SIZE = re.compile(r"`([\w/]+\.py)` \((\d+) lines\)")
# `training/core/fsdp.py`, `training/core/fsdp.py:fsdp_precision`, `training/loop/engine.Engine`, data/loader.py
REFERENCE = re.compile(r"(?<![\w/.-])((?:training|recipes|data|model)(?:/\w+)+)(\.py)?(?:[.:]([A-Za-z_]\w*))?")


def sections() -> dict[str, list[tuple[str, int]]]:
    """docs/reading.md's numbered files (path, lines given) under each heading."""
    found, heading = {}, None
    for line in READING.read_text().splitlines():
        if line.startswith("## "):
            heading = line[3:]
            found[heading] = []
        elif heading and (m := ENTRY.match(line)):
            found[heading].append((m.group(1), int(m.group(2))))
    return found


def test_the_reading_path_covers_every_family_and_axis():
    headings = " ".join(sections())
    for what in ("DDP", "FSDP2", "ZeRO", "Pipeline", "Tensor", "Ulysses", "context"):
        assert what in headings, f"docs/reading.md has no path for {what}"
    assert all(sections().values()), sections()


def test_the_reading_path_names_files_at_their_sizes():
    stated = ANY_SIZE.findall(READING.read_text())
    assert stated
    wrong = []
    for path, lines in stated:
        file = ROOT / path
        if not file.is_file():
            wrong.append(f"{path}: no such file")
            continue
        actual = len(file.read_text().splitlines())
        if abs(actual - int(lines)) > max(5, 0.15 * actual):
            wrong.append(f"{path}: {lines} lines given, {actual} now")
    assert not wrong, wrong


@pytest.mark.parametrize("family", ["FSDP2", "ZeRO"])
def test_a_family_reads_in_at_most_ten_library_files(family):
    (files,) = [entries for heading, entries in sections().items() if family in heading.split(":")[0]]
    library = [path for path, _ in files if not path.startswith(("data/", "model/", "recipes/"))]
    assert len(library) <= 10 and len(set(library)) == len(library), library


@cache
def defined(path: Path) -> set[str]:
    """The names a module defines at any depth: functions, classes, assignments."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def broken_references(text: str) -> list[str]:
    """The project files, and names in them, that `text` points at and that do not exist."""
    wrong = []
    for m in REFERENCE.finditer(text):
        base, py, name = m.groups()
        module = ROOT / f"{base}.py"
        if module.is_file():
            if name and name != "py" and name not in defined(module):
                wrong.append(f"{m.group(0)}: {base}.py defines no {name}")
        elif not ((ROOT / base).exists() or list(ROOT.glob(f"{base}*"))):
            wrong.append(f"{m.group(0)}: no such file")
    return wrong


def tracked(*patterns: str) -> list[Path]:
    names = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True).stdout.split()
    return [ROOT / n for n in names if (ROOT / n).is_file()]


def test_what_the_docs_and_docstrings_point_at_exists():
    wrong = []
    for path in [ROOT / "README.md", *tracked("docs/*.md", "*.py", "ds_configs/*.json", "accelerate_configs/*.yaml")]:
        if path == Path(__file__):  # its own examples of broken references
            continue
        wrong += [f"{path.relative_to(ROOT)}: {w}" for w in broken_references(path.read_text())]
    assert not wrong, wrong


def test_the_reference_check_finds_what_it_looks_for():
    assert broken_references("see training/parallel/tensor.py and training/core/fsdp.no_such_function")
    assert not broken_references("`training/core/fsdp.py:fsdp_precision`, training/loop/engine.Engine, data/")


def test_the_readme_fits_its_limit():
    """The README gets a newcomer to a first run and a map in about a screenful or two: 150 lines at most."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


TRANSCRIBED = {"training/plan/published.py"}  # published runs' tables, transcribed as data


def test_no_library_module_outgrows_a_reading():
    """No module of training/ past 400 lines, but transcribed data: one concern a file, readable top to bottom."""
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in (ROOT / "training").rglob("*.py")}
    long = {name: n for name, n in sizes.items() if n > 400 and name not in TRANSCRIBED}
    assert not long, long
