"""Tokenize documents, append EOS after each, and cut the token stream into blocks of `block_size + 1`.

The extra token of a block is the target of its last position: a block gives `input_ids = block[:-1]`
and `shift_labels = block[1:]`. Tokens left over after the last whole block are dropped.

Map-style corpora are tokenized once (`datasets.map`, `num_proc` workers) and the blocks are written
to one flat binary file per split, in the narrowest unsigned dtype that holds the vocabulary, which is
read back as a numpy memmap. Streamed corpora are packed on the fly by `PackedStream`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

# datasets and pyarrow (with pandas) are imported where they are used: reading a complete cache needs neither.
if TYPE_CHECKING:
    from datasets import Dataset, IterableDataset
    from transformers import PreTrainedTokenizerFast

TEXT = "text"
IDS = "input_ids"
STREAM_BATCH = 64  # documents tokenized at a time when streaming


def storage_dtype(vocab_size: int, flag: str) -> np.dtype:
    """uint16 for vocabularies up to 65536 ids, else uint32; larger ones cannot be stored."""
    for dtype in (np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    raise ValueError(
        f"{flag}: vocabulary size {vocab_size} does not fit the largest token storage dtype uint32 "
        f"(at most {2**32} ids): use a smaller vocabulary"
    )


def tokenize_batch(batch: dict[str, list[str]], tokenizer: PreTrainedTokenizerFast) -> dict[str, list]:
    """Token ids of each document followed by EOS, so packed documents stay separated."""
    # The tokenizer's own special tokens (e.g. a BOS) are left out: EOS alone marks document boundaries.
    # verbose=False: long documents are expected here, the model never sees them whole.
    ids = tokenizer(batch[TEXT], add_special_tokens=False, verbose=False)[IDS]
    return {IDS: [doc + [tokenizer.eos_token_id] for doc in ids]}


def tokenize(
    split: Dataset,
    tokenizer: PreTrainedTokenizerFast,
    dtype: np.dtype,
    num_proc: int | None,
    cache_file: Path,
    desc: str,
) -> Dataset:
    """Tokenize a map-style split into an Arrow file of our own choosing (kept out of the HF cache)."""
    from datasets import Features, List, Value

    return split.map(
        tokenize_batch,
        fn_kwargs={"tokenizer": tokenizer},
        batched=True,
        # One worker means this process: datasets would still fork one, where the tokenizers library,
        # already used here, falls back to a single thread (about 2x slower on 2 cores).
        num_proc=num_proc if num_proc and num_proc > 1 else None,
        remove_columns=[TEXT],
        # Declaring the type skips datasets' type inference over every id, and stores ids narrow.
        features=Features({IDS: List(Value(dtype.name))}),
        cache_file_name=str(cache_file),
        load_from_cache_file=False,
        desc=desc,
    )


def write_blocks(tokens: Dataset, block_size: int, dtype: np.dtype, path: Path) -> dict[str, int]:
    """Pack a tokenized split into `path` (raw `dtype`, row-major blocks); return its counts.

    Streams Arrow batches straight to the file, so memory stays flat whatever the corpus size.
    """
    import pyarrow.compute as pc

    # An empty split (e.g. no document held out) has no columns at all.
    n_tokens = pc.sum(pc.list_value_length(tokens.data[IDS])).as_py() if len(tokens) else 0
    n_blocks = n_tokens // (block_size + 1)
    remaining = n_blocks * (block_size + 1)
    with open(path, "wb") as f:
        for batch in tokens.with_format("arrow").iter(batch_size=10_000):
            if remaining == 0:
                break
            flat = pc.list_flatten(batch[IDS]).to_numpy()[:remaining]
            f.write(flat.astype(dtype).tobytes())
            remaining -= len(flat)
    return {"documents": len(tokens), "tokens": n_tokens, "blocks": n_blocks}


def read_blocks(path: Path, dtype: np.dtype, n_blocks: int, block_size: int) -> np.ndarray:
    """The blocks written by `write_blocks`, memory-mapped read-only."""
    if n_blocks == 0:  # mmap cannot map an empty file
        return np.empty((0, block_size + 1), dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(n_blocks, block_size + 1))


class PackedStream:
    """Blocks of a streamed corpus, tokenized and packed while iterating.

    Iterating again replays the same blocks (for the same `seed` and `epoch`), which is what makes a
    streamed run resumable: `ShardedLoader` skips the blocks already consumed, re-reading and
    re-tokenizing them, so a resume costs time proportional to the position in the epoch.
    """

    def __init__(
        self,
        documents: IterableDataset,
        tokenizer: PreTrainedTokenizerFast,
        block_size: int,
        dtype: np.dtype,
        shuffle_buffer: int = 10_000,
    ):
        self.documents = documents
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.dtype = dtype
        self.shuffle_buffer = shuffle_buffer

    def iter_chunks(self, rows: int, epoch: int = 0, seed: int | None = None) -> Iterator[np.ndarray]:
        """Arrays of `rows` consecutive blocks, then one shorter array with the remaining whole blocks.

        With a `seed`, documents are shuffled through a buffer of `shuffle_buffer` documents, seeded with
        `seed + epoch` (datasets' `IterableDataset.shuffle`); without one they come in stream order.
        """
        documents = self.documents
        if seed is not None:
            documents = documents.shuffle(seed=seed + epoch, buffer_size=self.shuffle_buffer)
        # Small batches: the first blocks come after tokenizing a few documents, not a thousand.
        tokens = documents.map(
            tokenize_batch,
            fn_kwargs={"tokenizer": self.tokenizer},
            batched=True,
            batch_size=STREAM_BATCH,
            remove_columns=[TEXT],
        )
        span = rows * (self.block_size + 1)
        pending = np.empty(0, dtype=self.dtype)
        for batch in tokens.iter(batch_size=STREAM_BATCH):
            pending = np.concatenate([pending, *(np.asarray(ids, dtype=self.dtype) for ids in batch[IDS])])
            while len(pending) >= span:
                yield pending[:span].reshape(rows, -1)
                pending = pending[span:]
        whole = len(pending) // (self.block_size + 1) * (self.block_size + 1)
        if whole:
            yield pending[:whole].reshape(-1, self.block_size + 1)
