"""The tokenizer: any fast tokenizer by name or path, or a byte-level BPE trained on the corpus and cached.

The trained BPE learns its merges from a sample of about `BPE_SAMPLE_BYTES` of training documents
rather than the whole corpus: on the default corpus that takes seconds instead of minutes and the
merges of a few MB of code are close to those of all of it. It is saved as a `PreTrainedTokenizerFast`
whose BOS, EOS and pad token are all "<|endoftext|>" (as in GPT-2), so `AutoTokenizer.from_pretrained`
loads the cached directory like any other tokenizer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from .cache import atomic_directory, fingerprint, is_complete
from .packing import TEXT
from .sources import unreachable

if TYPE_CHECKING:
    from datasets import Dataset, IterableDataset

    from .arguments import DataArguments
    from .sources import Corpus

EOT = "<|endoftext|>"
BPE_SAMPLE_BYTES = 4 * 2**20


def sample_documents(train: Dataset | IterableDataset, budget_bytes: int) -> Iterator[str]:
    """Training documents up to `budget_bytes` of UTF-8 text.

    From a map-style split, a fixed random subset, so the sample spans the whole corpus; from a stream,
    its first documents (the only ones that are cheap to reach).
    """
    from datasets import Dataset

    if isinstance(train, Dataset):
        order = np.random.default_rng(0).permutation(len(train))
        documents = (train[int(i)][TEXT] for i in order)
    else:
        documents = (example[TEXT] for example in train)
    used = 0
    for text in documents:
        if used >= budget_bytes:
            return
        used += len(text.encode())
        yield text


def train_bpe(documents: Iterator[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A GPT-2 style byte-level BPE: every byte is a token, so no text is ever unknown."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(documents, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=EOT, eos_token=EOT, pad_token=EOT)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerFast) -> str:
    """Changes whenever the ids of any text would: the backend's full serialisation plus EOS."""
    blob = tokenizer.backend_tokenizer.to_str() + str(tokenizer.eos_token_id)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def load_tokenizer(args: DataArguments, corpus: Corpus, root: Path, verbose: bool) -> PreTrainedTokenizerFast:
    """`--tokenizer_name` if given, else the cached BPE for this corpus and vocab size (trained if absent).

    Loaded with the settings that users of the trained model need, which `save_pretrained` then writes beside
    the model: the context the model is trained on as `model_max_length` (not the library's "no limit" 1e30),
    and padding on the left, where batched generation needs it. Neither changes how the corpus is tokenized:
    packing neither pads nor truncates, and the cache key reads only the backend.
    """
    tokenizer = cached_tokenizer(args, corpus.fingerprint, root, verbose)
    if tokenizer is not None:
        return tokenizer
    entry = tokenizer_entry(args, corpus.fingerprint, root)
    if verbose:
        print(f"Training a byte-level BPE (vocab {args.tokenizer_vocab_size}) on {corpus.source}")
    documents = sample_documents(corpus.splits["train"], BPE_SAMPLE_BYTES)
    with atomic_directory(entry) as tmp:
        train_bpe(documents, args.tokenizer_vocab_size).save_pretrained(tmp)
    return AutoTokenizer.from_pretrained(entry, **_for_the_model(args))


def cached_tokenizer(
    args: DataArguments, corpus_fingerprint: str, root: Path, verbose: bool
) -> PreTrainedTokenizerFast | None:
    """What `load_tokenizer` returns without training, so without the corpus itself: `--tokenizer_name` if
    given, else the cached BPE for the corpus with this fingerprint, or None if it is not cached yet."""
    if args.tokenizer_name:
        return _named_tokenizer(args)
    entry = tokenizer_entry(args, corpus_fingerprint, root)
    # Not rebuilt by --overwrite_cache: training is deterministic, it would only redo the same merges.
    if not is_complete(entry):
        return None
    if verbose:
        print(f"Reusing the tokenizer cached at {entry}")
    return AutoTokenizer.from_pretrained(entry, **_for_the_model(args))


def tokenizer_entry(args: DataArguments, corpus_fingerprint: str, root: Path) -> Path:
    """The cache entry of the BPE trained on the corpus with this fingerprint."""
    # The two modes sample differently (see `sample_documents`), so each gets its own entry: a cache
    # entry's tokenizer must not depend on which mode happened to run first.
    key = fingerprint(corpus_fingerprint, args.tokenizer_vocab_size, BPE_SAMPLE_BYTES, args.streaming)
    return root / "tokenizers" / key


def _for_the_model(args: DataArguments) -> dict:
    # See `load_tokenizer`.
    return dict(model_max_length=args.block_size, padding_side="left")


def _named_tokenizer(args: DataArguments) -> PreTrainedTokenizerFast:
    """`--tokenizer_name`, which must be a fast tokenizer with an EOS token."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name, cache_dir=args.cache_dir, **_for_the_model(args))
    except OSError as error:  # not on the hub, not a folder, or the hub unreachable and nothing cached
        if Path(args.tokenizer_name).is_dir():
            raise
        instead = "pass a local tokenizer folder, or leave --tokenizer_name out (a BPE is trained on the corpus)"
        raise ValueError(
            unreachable("--tokenizer_name", args.tokenizer_name, error, instead, "HF_HUB_OFFLINE")
        ) from error
    if not tokenizer.is_fast:
        raise ValueError(f"--tokenizer_name {args.tokenizer_name!r} has no fast (Rust) version: pick one that does")
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"--tokenizer_name {args.tokenizer_name!r} has no EOS token, which separates packed "
            "documents: pick a tokenizer that has one"
        )
    return tokenizer
