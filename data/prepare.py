"""`prepare_data`: from flags to a tokenizer and packed train/validation blocks, built once and cached.

The packed cache entry is keyed by the corpus fingerprint, the tokenizer's fingerprint and the block
size, and holds one raw token file per split plus `meta.json` with the counts. A second run with the
same key memory-maps the files instead of tokenizing again.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerFast

from .arguments import DataArguments
from .cache import atomic_directory, cache_root, fingerprint, is_complete
from .packing import PackedStream, read_blocks, storage_dtype, tokenize, write_blocks
from .sources import Corpus, load_corpus
from .tokenizer import load_tokenizer, tokenizer_fingerprint

# Bump when the layout of a packed cache entry changes, so old entries are not misread.
FORMAT_VERSION = 1
SPLITS = ("train", "validation")


@dataclass
class PackedData:
    tokenizer: PreTrainedTokenizerFast
    train: np.ndarray | PackedStream
    """(n, block_size + 1) token ids (a read-only memmap), or a `PackedStream` with --streaming."""
    validation: np.ndarray | PackedStream
    stats: dict[str, Any]
    """Source, tokenizer, dtype, cache entry and hit, and per split documents/tokens/blocks."""


def prepare_data(
    args: DataArguments,
    max_position_embeddings: int | None = None,
    is_main_process: bool = True,
    wait_for_everyone: Callable[[], None] | None = None,
) -> PackedData:
    """Validate the flags, load the corpus and tokenizer, and tokenize and pack it (or reuse the cache).

    Under several ranks pass `wait_for_everyone` (e.g. `accelerator.wait_for_everyone`): the main
    process builds the caches while the others wait, then they read them. Caches are published
    atomically, so a rank that does not find them (a cache dir not shared between nodes) can safely
    build its own copy.
    """
    # DataArguments' own checks: a subclass's `validate` (the run config's) takes other arguments.
    DataArguments.validate(args, max_position_embeddings)
    if wait_for_everyone is not None and not is_main_process:
        wait_for_everyone()
    data = _prepare(args, verbose=is_main_process)
    if wait_for_everyone is not None and is_main_process:
        wait_for_everyone()
    return data


def _prepare(args: DataArguments, verbose: bool) -> PackedData:
    root = cache_root(args)
    corpus = load_corpus(args)
    tokenizer = load_tokenizer(args, corpus, root, verbose)
    vocab_flag = "--tokenizer_name" if args.tokenizer_name else "--tokenizer_vocab_size"
    dtype = storage_dtype(len(tokenizer), vocab_flag)
    stats: dict[str, Any] = {
        "source": corpus.source,
        "tokenizer": tokenizer.name_or_path,
        "vocab_size": len(tokenizer),
        "block_size": args.block_size,
        "dtype": dtype.name,
        "streaming": args.streaming,
    }
    if args.streaming:
        train, validation = (PackedStream(corpus.splits[name], tokenizer, args.block_size, dtype) for name in SPLITS)
        if verbose:
            print(f"Streaming {corpus.source}: blocks of {args.block_size + 1} tokens are packed on the fly")
        return PackedData(tokenizer, train, validation, stats)

    entry = (
        root
        / "packed"
        / fingerprint(FORMAT_VERSION, corpus.fingerprint, tokenizer_fingerprint(tokenizer), args.block_size)
    )
    hit = is_complete(entry) and not args.overwrite_cache
    if not hit:
        _build(corpus, tokenizer, args, dtype, entry)
    counts = json.loads((entry / "meta.json").read_text())["splits"]
    train, validation = (
        read_blocks(entry / f"{name}.bin", dtype, counts[name]["blocks"], args.block_size) for name in SPLITS
    )
    stats.update(cache=str(entry), cache_hit=hit, **counts)
    if verbose:
        if hit:
            print(f"Reusing packed data cached at {entry}")
        for name in SPLITS:
            c = counts[name]
            print(
                f"{name}: {c['documents']:,} documents, {c['tokens']:,} tokens -> {c['blocks']:,} blocks "
                f"of {args.block_size + 1} tokens ({dtype.name})"
            )
    return PackedData(tokenizer, train, validation, stats)


def _build(
    corpus: Corpus, tokenizer: PreTrainedTokenizerFast, args: DataArguments, dtype: np.dtype, entry: Path
) -> None:
    """Tokenize and pack every split into a fresh cache entry."""
    with atomic_directory(entry, overwrite=args.overwrite_cache) as tmp:
        counts = {}
        for name in SPLITS:
            tokens = tokenize(
                corpus.splits[name],
                tokenizer,
                dtype,
                args.preprocessing_num_workers,
                tmp / f"{name}.arrow",
                f"Tokenizing {name}",
            )
            counts[name] = write_blocks(tokens, args.block_size, dtype, tmp / f"{name}.bin")
        if counts["train"]["blocks"] == 0:
            raise ValueError(
                f"{corpus.source} has {counts['train']['tokens']} training tokens, fewer than one block of "
                f"--block_size {args.block_size} + 1: add data or pass a smaller --block_size"
            )
        # The intermediate Arrow files are only needed to pack; keep the entry to the blocks.
        for arrow in tmp.glob("*.arrow"):
            arrow.unlink()
        (tmp / "meta.json").write_text(json.dumps({"format": FORMAT_VERSION, "splits": counts}, indent=2))
