"""On-disk caches: where they live, how they are keyed, and how they are written without ever being half-read.

A cache entry is a directory. It is built in a temporary sibling directory, its files are fsynced, a
completion marker is written last, and only then is the directory renamed to its final name. A reader
trusts an entry only if the marker is there, so a build killed at any point leaves either nothing or a
leftover temporary directory that no reader looks at.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .arguments import DataArguments

COMPLETE_MARKER = "COMPLETE"


def cache_root(args: DataArguments) -> Path:
    """`--cache_dir`, else `$SHARDGPT_CACHE`, else `~/.cache/shardgpt`."""
    root = args.cache_dir or os.environ.get("SHARDGPT_CACHE") or Path.home() / ".cache" / "shardgpt"
    return Path(root).expanduser()


def fingerprint(*parts: object) -> str:
    """A short stable hash of JSON-serialisable parts (the key of a cache entry)."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:20]


def is_complete(entry: Path) -> bool:
    return (entry / COMPLETE_MARKER).is_file()


def _fsync(path: Path) -> None:
    # Directories are fsynced too: that is what makes the names of the files in them durable.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_directory(entry: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory; on a clean exit, publish it as `entry` atomically.

    An incomplete `entry` (a crashed build) is replaced. A complete one is replaced only with
    `overwrite`; otherwise a concurrent writer published it meanwhile, from the same key and so with the
    same data, and ours is dropped rather than pulling files from under its readers.
    """
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.tmp-", dir=entry.parent))
    try:
        yield tmp
        if is_complete(entry) and not overwrite:
            return
        for path in tmp.rglob("*"):
            if path.is_file():
                _fsync(path)
        (tmp / COMPLETE_MARKER).touch()
        _fsync(tmp / COMPLETE_MARKER)
        _fsync(tmp)
        # rename() cannot replace a non-empty directory: move the old entry aside, swap, then delete it.
        stale = entry.with_name(f".{entry.name}.old-{uuid.uuid4().hex}")
        if entry.exists():
            os.replace(entry, stale)
        try:
            os.replace(tmp, entry)
        except OSError:
            if not is_complete(entry):  # lost a race to another writer, which is fine; anything else is not
                raise
        _fsync(entry.parent)
        shutil.rmtree(stale, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
