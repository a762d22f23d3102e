"""Shared by the whole suite: the repository and tests/ on the import path, a fixed seed per test, DeepSpeed's ops
built once before any launch, and the small corpus the launched tests train on."""

import os
import random
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the suite also runs from a clone that was not pip-installed
    sys.path.insert(0, str(ROOT))
if str(ROOT / "tests") not in sys.path:  # the helpers every test folder shares (launching.py)
    sys.path.insert(0, str(ROOT / "tests"))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _seed():
    import torch

    torch.manual_seed(0)


def pytest_collection_finish(session):
    """Compile DeepSpeed's C++ ops once, before any launch, when launched tests were selected.

    DeepSpeed compiles them the first time a rank needs them: minutes on 2 cores, then cached in
    ~/.cache/torch_extensions. Inside a launch that time counts against the launch's timeout, and a build killed
    midway leaves a lock file on which every later load waits forever; the suite removes such a lock."""
    if session.config.option.collectonly or not any(i.get_closest_marker("multiproc") for i in session.items):
        return
    from training.doctor.machine import build_ops
    from training.doctor.report import Report

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    reporter.write_line("DeepSpeed ops: compiling or loading (minutes the first time, cached after)")
    report = Report()
    build_ops(report, remove_stale_locks=True)
    for check in report.checks:
        reporter.write_line(f"  {check.name}: {check.status} {check.detail}")


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
