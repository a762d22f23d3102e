"""Local data files: a path or glob resolved to the non-empty files it matches, and the `datasets` builder
that reads them. Shared by the flags' early checks (`arguments.py`) and the corpus loader (`sources.py`)."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable
from pathlib import Path

# File suffix -> `load_dataset` builder.
BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def nonempty_files(paths: Iterable[str | Path]) -> list[str]:
    # An empty file holds no document, and `load_dataset` fails on some kinds of them.
    return sorted(str(path) for path in paths if os.path.isfile(path) and os.path.getsize(path) > 0)


def resolve_files(pattern: str, flag: str) -> list[str]:
    """Expand a path or glob (`**` allowed) into a sorted list of the non-empty files it matches."""
    matches = glob.glob(os.path.expanduser(pattern), recursive=True)
    if not any(os.path.isfile(path) for path in matches):
        raise FileNotFoundError(f"{flag} {pattern!r} matches no file: pass an existing path or glob")
    files = nonempty_files(matches)
    if not files:
        raise ValueError(f"{flag} {pattern!r} matches only empty files: pass files that hold text")
    return files


def builder_for(files: list[str], flag: str) -> str:
    """The `load_dataset` builder for a list of files, which must all be of one supported kind."""
    builders = {BUILDERS.get(Path(path).suffix.lower()) for path in files}
    if None in builders:
        odd = next(path for path in files if Path(path).suffix.lower() not in BUILDERS)
        raise ValueError(f"{flag} {odd!r} is not one of {sorted(BUILDERS)}: convert it or pick other files")
    if len(builders) > 1:
        raise ValueError(f"{flag} mixes file kinds {sorted(builders)}: pass files of one kind")
    return builders.pop()
