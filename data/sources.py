"""Where the text comes from: the Python standard library (the default), a hub dataset, or local files.

Every source goes through `datasets.load_dataset`, so hub and local data share one code path. It comes
out as a `Corpus`: a "train" and a "validation" split with one "text" column each, and a fingerprint
that changes when the documents do (the caches are keyed by it). The fingerprint of local files reads
only their stats, so `local_corpus_key` gives it without loading them (or importing datasets).
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .cache import fingerprint
from .files import builder_for, nonempty_files, resolve_files
from .packing import TEXT

if TYPE_CHECKING:
    from datasets import Dataset, IterableDataset

    from .arguments import DataArguments

# Where installed third-party packages live inside the standard library's folder.
INSTALLED_PACKAGES = {"site-packages", "dist-packages"}
# Fractional part of the golden ratio in 64-bit fixed point (see `validation_mask`).
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@dataclass
class Corpus:
    splits: dict[str, Dataset | IterableDataset]
    """"train" and "validation", each with a single "text" column (validation may be empty)."""
    fingerprint: str
    source: str
    """The flag that chose the data, for error messages (e.g. "--train_file 'a/*.txt'")."""


def stdlib_files() -> list[str]:
    """The non-empty *.py files of the running Python's standard library, sorted, without installed packages."""
    files = []
    for folder, subfolders, names in os.walk(sysconfig.get_paths()["stdlib"]):
        subfolders[:] = [name for name in subfolders if name not in INSTALLED_PACKAGES]  # don't descend
        files += [os.path.join(folder, name) for name in names if name.endswith(".py")]
    return nonempty_files(files)


@contextmanager
def local_files_without_bars() -> Iterator[None]:
    """datasets' progress bars off while it reads files of this disk: its `Downloading data` bar counts files it
    does not download (1,762 of them for the default corpus), and the tokenizing bar that follows shows the work."""
    import datasets  # here, not at the top: a complete cache is reused without importing datasets

    was_off = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_off:
            datasets.enable_progress_bars()


def unreachable(flag: str, name: str, error: Exception, instead: str, offline_variable: str) -> str:
    """The one-line message for a hub name that could not be fetched and is not cached: `instead` is the way
    around the hub, then the cached copy and the offline variables."""
    reason = str(error).splitlines()[0]
    return (
        f"{flag} {name!r} could not be fetched from the Hugging Face Hub and has no cached copy ({reason}): "
        f"without network, {instead}; or download it once where there is network (the same --cache_dir) and run "
        f"with {offline_variable}=1 and HF_HUB_OFFLINE=1 to use that cached copy"
    )


def validation_mask(indices: np.ndarray, percentage: int) -> np.ndarray:
    """Whether each document index is held out for validation.

    Document i is held out iff frac((i + 1) * golden_ratio) < percentage / 100. That sequence is spread as
    evenly as any over [0, 1), so every stretch of the corpus loses close to `percentage`% of its
    documents, the split is the same on every run, and a stream can apply it without knowing its length.
    """
    threshold = np.uint64(percentage * 2**64 // 100)
    return (np.asarray(indices, dtype=np.uint64) + np.uint64(1)) * _GOLDEN < threshold


def _file_stats(files: list[str]) -> list[tuple[str, int, int]]:
    # Cheap and content-sensitive enough: a rewritten file gets a new size or mtime.
    return [(path, os.stat(path).st_size, os.stat(path).st_mtime_ns) for path in files]


def _local_source(args: DataArguments) -> tuple[dict[str, list[str]], str, dict, str]:
    """Local files (--train_file, else the default corpus) without reading them: their files per split, the
    `load_dataset` builder and options that read them, and the source flag for messages."""
    if args.train_file:
        data_files = {"train": resolve_files(args.train_file, "--train_file")}
        if args.validation_file:
            data_files["validation"] = resolve_files(args.validation_file, "--validation_file")
        builder = builder_for(data_files["train"], "--train_file")
        # Plain text files hold many documents separated by blank lines.
        options = {"sample_by": "paragraph"} if builder == "text" else {}
        source = f"--train_file {args.train_file!r}"
    else:
        data_files = {"train": stdlib_files()}
        builder, source = (
            "text",
            f"the default corpus (the standard library at {sysconfig.get_paths()['stdlib']})",
        )
        # One document per source file; a few test files are deliberately not UTF-8.
        options = {"sample_by": "document", "encoding_errors": "replace"}
    if not data_files["train"]:
        raise ValueError(f"{source} has no file: pass --train_file or --dataset_name")
    return data_files, builder, options, source


def _local_parts(data_files: dict[str, list[str]], builder: str, options: dict) -> list:
    """The parts of a local corpus's fingerprint: how it is read and the stats of its files."""
    return [builder, options, {split: _file_stats(files) for split, files in data_files.items()}]


def _corpus_fingerprint(parts: list, args: DataArguments) -> str:
    # The held-out documents and the text column change the splits, so they are part of the key.
    return fingerprint(parts, args.text_column_name, args.validation_split_percentage)


def local_corpus_key(args: DataArguments) -> tuple[str, str] | None:
    """(fingerprint, source) of a local corpus, as `load_corpus` gives them, without loading it (so without
    importing datasets); None for --dataset_name, whose fingerprint needs the dataset loaded."""
    if args.dataset_name:
        return None
    data_files, builder, options, source = _local_source(args)
    parts = _local_parts(data_files, builder, options)
    return _corpus_fingerprint(parts, args), source


def _load_raw(args: DataArguments) -> tuple[dict, list, str]:
    """The raw splits, the parts of their fingerprint, and the source flag for messages."""
    from datasets import load_dataset
    from datasets.exceptions import DatasetGenerationError

    common = {"cache_dir": args.cache_dir, "streaming": args.streaming}
    if args.dataset_name:
        try:
            raw = load_dataset(args.dataset_name, args.dataset_config_name, **common)
        except ConnectionError as error:  # the hub unreachable (offline mode, no network) and no cached copy
            local = "pass --train_file with local text files instead"
            raise ValueError(
                unreachable("--dataset_name", args.dataset_name, error, local, "HF_DATASETS_OFFLINE")
            ) from error
        # A hub dataset is identified by name; its splits' own fingerprints (map-style only) add its version.
        parts = [args.dataset_name, args.dataset_config_name]
        parts += [getattr(split, "_fingerprint", None) for split in raw.values()]
        return dict(raw), parts, f"--dataset_name {args.dataset_name!r}"
    data_files, builder, options, source = _local_source(args)
    try:
        with local_files_without_bars():
            raw = load_dataset(builder, data_files=data_files, **options, **common)
    except (DatasetGenerationError, ValueError) as error:
        # Such as a file with no rows, which `load_dataset` reports without naming the flag.
        raise ValueError(
            f"{source} could not be read as {builder} data ({error.__cause__ or error}): check that its "
            "files are valid and hold at least one document"
        ) from error
    return dict(raw), _local_parts(data_files, builder, options), source


def _first_columns(split: Dataset | IterableDataset) -> list[str]:
    if split.column_names is not None:
        return split.column_names
    # Streamed JSON has no schema until read: peek at the first example.
    return list(next(iter(split), {}))


def load_corpus(args: DataArguments) -> Corpus:
    """Load the source, keep its text column as "text", and hold out validation documents if needed."""
    from datasets import Dataset

    raw, parts, source = _load_raw(args)
    if "train" not in raw:
        raise ValueError(f"{source} has no 'train' split (it has {sorted(raw)}): pick another dataset or config")
    splits = {}
    for name in ("train", "validation"):
        if name not in raw:
            continue
        columns = _first_columns(raw[name])
        if args.text_column_name not in columns:
            raise ValueError(
                f"--text_column_name {args.text_column_name!r} is not a column of {source} ({name} split has "
                f"{columns}): pass one of them"
            )
        keep = raw[name].select_columns([args.text_column_name])
        splits[name] = keep if args.text_column_name == TEXT else keep.rename_column(args.text_column_name, TEXT)
    train = splits["train"]
    empty = len(train) == 0 if isinstance(train, Dataset) else next(iter(train), None) is None
    if empty:
        raise ValueError(f"{source} has no documents: pass a non-empty corpus")
    if "validation" not in splits:
        splits["train"], splits["validation"] = _hold_out(train, args.validation_split_percentage)
    return Corpus(splits, _corpus_fingerprint(parts, args), source)


def _hold_out(train: Dataset | IterableDataset, percentage: int) -> tuple:
    """Split documents into (train, validation) with `validation_mask`."""
    from datasets import IterableDataset

    if isinstance(train, IterableDataset):

        def keep(_, indices, held_out):
            return list(validation_mask(np.asarray(indices), percentage) == held_out)

        return (
            train.filter(keep, with_indices=True, batched=True, fn_kwargs={"held_out": False}),
            train.filter(keep, with_indices=True, batched=True, fn_kwargs={"held_out": True}),
        )
    held_out = validation_mask(np.arange(len(train)), percentage)
    return train.select(np.flatnonzero(~held_out)), train.select(np.flatnonzero(held_out))
