"""The data flags, named as in transformers' `run_clm.py`, and their validation."""

from __future__ import annotations

from dataclasses import dataclass, field

from .files import builder_for, resolve_files
from .packing import storage_dtype

# A byte-level BPE starts from the 256 byte tokens plus its special token; merges come on top.
MIN_BPE_VOCAB = 256 + 1


def flag(default, help: str):
    # The help text documents the field and is what `HfArgumentParser` shows for `--help`.
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class DataArguments:
    """Which text to train on, how to tokenize it, and where to cache the result.

    With no source flag the corpus is the Python standard library's own source files, and with no
    `tokenizer_name` a byte-level BPE is trained on it: the default needs no download.
    """

    dataset_name: str | None = flag(None, "A dataset on the Hugging Face hub (or a local dataset folder), by name.")
    dataset_config_name: str | None = flag(None, "The configuration of --dataset_name, if it has several.")
    train_file: str | None = flag(None, "Local training data: a path or glob of .txt, .json, .jsonl or .parquet files.")
    validation_file: str | None = flag(
        None, "Local validation data, like --train_file. Without it, documents are held out of the training data."
    )
    text_column_name: str = flag("text", "The column that holds the text (.json, .jsonl, .parquet and hub data).")
    streaming: bool = flag(False, "Read the corpus as a stream and pack it on the fly instead of tokenizing it first.")
    tokenizer_name: str | None = flag(
        None, "A fast tokenizer by hub name or local path. Default: a byte-level BPE trained on the corpus."
    )
    tokenizer_vocab_size: int = flag(8192, "Vocabulary size of the default BPE (ignored with --tokenizer_name).")
    block_size: int = flag(256, "Tokens per training sequence: documents are packed into blocks of this size.")
    validation_split_percentage: int = flag(
        5, "Percentage of documents held out for validation when the source has no validation split."
    )
    preprocessing_num_workers: int | None = flag(None, "Processes that tokenize (default: this process alone).")
    cache_dir: str | None = flag(None, "Where caches go. Default: $SHARDGPT_CACHE, else ~/.cache/shardgpt.")
    overwrite_cache: bool = flag(False, "Tokenize and pack again even if the packed data is cached.")

    def validate(self, max_position_embeddings: int | None = None) -> None:
        """Fail on bad flags before any data is read: each message names the flag, its value and a fix."""
        if self.dataset_name and self.train_file:
            raise ValueError(
                f"--dataset_name {self.dataset_name!r} and --train_file {self.train_file!r} are both set: pass one"
            )
        if self.validation_file and not self.train_file:
            raise ValueError(
                f"--validation_file {self.validation_file!r} needs --train_file: pass the training files too"
            )
        for flag, pattern in (("--train_file", self.train_file), ("--validation_file", self.validation_file)):
            if pattern:
                builder_for(resolve_files(pattern, flag), flag)
        if not self.text_column_name:
            raise ValueError("--text_column_name is empty: pass the name of the column that holds the text")
        if self.block_size < 1:
            raise ValueError(f"--block_size {self.block_size} must be at least 1")
        if max_position_embeddings is not None and self.block_size > max_position_embeddings:
            raise ValueError(
                f"--block_size {self.block_size} exceeds the model's max_position_embeddings "
                f"{max_position_embeddings}: pass --block_size {max_position_embeddings} or less"
            )
        if not 0 <= self.validation_split_percentage < 100:
            raise ValueError(f"--validation_split_percentage {self.validation_split_percentage} must be in [0, 100)")
        if self.preprocessing_num_workers is not None and self.preprocessing_num_workers < 1:
            raise ValueError(
                f"--preprocessing_num_workers {self.preprocessing_num_workers} must be at least 1 (or unset)"
            )
        if self.tokenizer_name is None:
            if self.tokenizer_vocab_size < MIN_BPE_VOCAB:
                raise ValueError(
                    f"--tokenizer_vocab_size {self.tokenizer_vocab_size} is below {MIN_BPE_VOCAB} "
                    "(256 bytes + <|endoftext|>): pass a larger one"
                )
            storage_dtype(self.tokenizer_vocab_size, "--tokenizer_vocab_size")
