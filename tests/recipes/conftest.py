"""Fixtures shared by the training-script tests: a small corpus with its tokenizer and packed cache."""

from __future__ import annotations

import random
import shutil

import pytest


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> dict:
    """A small text corpus, its trained tokenizer and packed cache, built once for every launch."""
    from data import DataArguments, prepare_data

    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    words = ["def", "class", "return", "import", "for", "while", "if", "else", "print", "self", "value"]
    words += ["index", "list", "dict", "None", "True"]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 40))) for _ in range(3000)]
    (root / "train.txt").write_text("\n".join(lines[:2800]) + "\n")
    (root / "valid.txt").write_text("\n".join(lines[2800:]) + "\n")
    args = dict(
        train_file=str(root / "train.txt"), validation_file=str(root / "valid.txt"),
        tokenizer_vocab_size=300, block_size=64, cache_dir=str(root / "cache"),
    )  # fmt: skip
    prepare_data(DataArguments(**args))
    flags = [f"--{k}={v}" for k, v in args.items()]
    return {"root": root, "flags": flags}


@pytest.fixture
def fresh_dir(tmp_path):
    path = tmp_path / "out"
    yield path
    shutil.rmtree(path, ignore_errors=True)
