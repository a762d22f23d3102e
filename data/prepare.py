"""`prepare_data`: from flags to a tokenizer and packed train/validation blocks, built once and cached.

The packed cache entry is keyed by the corpus fingerprint, the tokenizer's fingerprint and the block
size, and holds one raw token file per split plus `meta.json` with the counts. A second run with the
same key memory-maps the files instead of tokenizing again. For local files (and the default corpus) the
corpus fingerprint reads only file stats, so such a run neither loads the corpus nor imports datasets.
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
from .sources import Corpus, load_corpus, local_corpus_key
from .tokenizer import cached_tokenizer, load_tokenizer, tokenizer_fingerprint

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
    # A complete cache of local files is found from their stats alone: reuse it without loading the corpus.
    key = None if args.streaming or args.overwrite_cache else local_corpus_key(args)
    tokenizer, tokenizer_error = None, None
    if key is not None:
        corpus_fingerprint, source = key
        try:
            tokenizer = cached_tokenizer(args, corpus_fingerprint, root, verbose)
        except Exception as error:  # raised below, after the corpus's own errors, as without this shortcut
            tokenizer_error = error
        if tokenizer is not None:
            entry = _packed_entry(root, corpus_fingerprint, tokenizer, args)
            if is_complete(entry):
                return _read_packed(entry, source, tokenizer, args, hit=True, verbose=verbose)
    corpus = load_corpus(args)
    if tokenizer_error is not None:
        raise tokenizer_error
    if key is None or tokenizer is None or corpus.fingerprint != key[0]:  # (!=: files rewritten meanwhile)
        tokenizer = load_tokenizer(args, corpus, root, verbose)
    dtype = _storage_dtype(tokenizer, args)
    if args.streaming:
        stats = _stats(corpus.source, tokenizer, dtype, args)
        train, validation = (PackedStream(corpus.splits[name], tokenizer, args.block_size, dtype) for name in SPLITS)
        if verbose:
            print(f"Streaming {corpus.source}: blocks of {args.block_size + 1} tokens are packed on the fly")
        return PackedData(tokenizer, train, validation, stats)

    entry = _packed_entry(root, corpus.fingerprint, tokenizer, args)
    hit = is_complete(entry) and not args.overwrite_cache
    if not hit:
        _build(corpus, tokenizer, args, dtype, entry)
    return _read_packed(entry, corpus.source, tokenizer, args, hit, verbose)


def _storage_dtype(tokenizer: PreTrainedTokenizerFast, args: DataArguments) -> np.dtype:
    vocab_flag = "--tokenizer_name" if args.tokenizer_name else "--tokenizer_vocab_size"
    return storage_dtype(len(tokenizer), vocab_flag)


def _stats(source: str, tokenizer: PreTrainedTokenizerFast, dtype: np.dtype, args: DataArguments) -> dict[str, Any]:
    """The stats of a run, before the packed counts."""
    return {
        "source": source,
        "tokenizer": tokenizer.name_or_path,
        "vocab_size": len(tokenizer),
        "block_size": args.block_size,
        "dtype": dtype.name,
        "streaming": args.streaming,
    }


def _packed_entry(root: Path, corpus_fingerprint: str, tokenizer: PreTrainedTokenizerFast, args: DataArguments) -> Path:
    key = fingerprint(FORMAT_VERSION, corpus_fingerprint, tokenizer_fingerprint(tokenizer), args.block_size)
    return root / "packed" / key


def _read_packed(
    entry: Path, source: str, tokenizer: PreTrainedTokenizerFast, args: DataArguments, hit: bool, verbose: bool
) -> PackedData:
    """The blocks of a complete packed entry, memory-mapped, with their counts (`hit`: it was there already)."""
    dtype = _storage_dtype(tokenizer, args)
    stats = _stats(source, tokenizer, dtype, args)
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
