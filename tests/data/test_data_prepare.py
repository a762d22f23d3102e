"""prepare_data end to end on small local corpora: every source kind, the cache, dtypes, bad input.

Expected blocks are computed here from the tokenizer and the documents, independently of data.packing:
each document's ids followed by EOS, concatenated, cut into rows of block_size + 1.
"""

import itertools
import json
import random
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import data.prepare
from data import DataArguments, PackedStream, ShardedLoader, prepare_data
from data.cache import is_complete
from data.packing import storage_dtype
from data.sources import load_corpus, stdlib_files
from data.tokenizer import tokenizer_fingerprint
from model import ShardGPTConfig, ShardGPTForCausalLM

# Prose and code words, so the trained BPE has merges of both kinds to learn.
WORDS = ["the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be", "by"]
WORDS += ["def", "return", "class", "import", "self", "None", "(", ")", ":", "=", "+", "1", "42"]
BLOCK = 16


def documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(5, 60))) + "." for _ in range(n)]


def data_args(tmp_path: Path, **overrides) -> DataArguments:
    settings = dict(cache_dir=str(tmp_path / "cache"), tokenizer_vocab_size=300, block_size=BLOCK)
    return DataArguments(**{**settings, **overrides})


def write_jsonl(path: Path, texts: list[str], column: str = "text") -> Path:
    path.write_text("".join(json.dumps({"id": i, column: t}) + "\n" for i, t in enumerate(texts)))
    return path


def assert_packed(blocks: np.ndarray, tokenizer, texts: list[str]) -> None:
    ids = []
    for text in texts:
        ids += tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    n = len(ids) // (BLOCK + 1)
    assert blocks.shape == (n, BLOCK + 1)
    np.testing.assert_array_equal(np.asarray(blocks, dtype=np.int64).ravel(), ids[: n * (BLOCK + 1)])


def test_txt_globs_paragraph_documents_and_trained_tokenizer(tmp_path, capsys):
    first, second, held = documents(30, seed=1), documents(20, seed=2), documents(10, seed=3)
    (tmp_path / "train_b.txt").write_text("\n\n".join(second))
    (tmp_path / "train_a.txt").write_text("\n\n".join(first))
    (tmp_path / "valid.txt").write_text("\n\n".join(held))
    args = data_args(tmp_path, train_file=str(tmp_path / "train_*.txt"), validation_file=str(tmp_path / "valid.txt"))
    packed = prepare_data(args)

    assert_packed(packed.train, packed.tokenizer, first + second)  # files in sorted order
    assert_packed(packed.validation, packed.tokenizer, held)
    assert isinstance(packed.train, np.memmap) and packed.train.dtype == np.uint16
    assert packed.stats["train"]["documents"] == 50 and packed.stats["validation"]["documents"] == 10
    out = capsys.readouterr().out
    assert "train: 50 documents" in out and f"{packed.stats['train']['blocks']:,} blocks of 17 tokens" in out

    # The trained BPE is a regular saved tokenizer: AutoTokenizer loads it, specials included.
    reloaded = AutoTokenizer.from_pretrained(packed.tokenizer.name_or_path)
    assert len(reloaded) == 300
    assert reloaded.eos_token == reloaded.bos_token == reloaded.pad_token == "<|endoftext|>"
    assert reloaded.decode(reloaded.encode(first[0], add_special_tokens=False)) == first[0]


LOAD_TOKENIZER_WITHOUT_PROJECT = """
import json, sys
sys.path = [p for p in sys.path if p not in ("", {root!r})]
for name in ("model", "data", "recipes"):  # make the project unimportable, even if pip-installed
    sys.modules[name] = None
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained({folder!r}, trust_remote_code={remote})
batch = tok(["the of and to in", "the"], padding=True)
print(json.dumps([type(tok).__name__, tok.model_max_length, tok.padding_side, batch["attention_mask"][1]]))
"""


def test_tokenizer_exported_beside_the_model_knows_the_context_and_pads_left(tmp_path):
    # The run's tokenizer is the one the training scripts save beside the model.
    write_jsonl(tmp_path / "corpus.jsonl", documents(40))
    packed = prepare_data(data_args(tmp_path, train_file=str(tmp_path / "corpus.jsonl")))
    tok = packed.tokenizer
    assert (tok.model_max_length, tok.padding_side) == (BLOCK, "left")
    # Settings only: the cache key (the backend's serialisation) is that of the tokenizer as loaded.
    fresh = AutoTokenizer.from_pretrained(tok.name_or_path)
    assert tokenizer_fingerprint(tok) == tokenizer_fingerprint(fresh) and fresh.model_max_length > 1e20

    folder = tmp_path / "export"
    ShardGPTForCausalLM(ShardGPTConfig.from_preset("debug")).save_pretrained(folder)
    tok.save_pretrained(folder)
    assert "auto_map" not in json.loads((folder / "tokenizer_config.json").read_text())  # no tokenizer code
    root = str(Path(__file__).resolve().parents[2])
    # The model's config is remote code, which AutoTokenizer reads first: with either answer given up front,
    # nothing is asked (stdin is closed, so a prompt would fail the load) and the plain tokenizer loads.
    for remote in (True, False):
        code = LOAD_TOKENIZER_WITHOUT_PROJECT.format(root=root, folder=str(folder), remote=remote)
        run = subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path, stdin=subprocess.DEVNULL, capture_output=True, text=True
        )
        assert run.returncode == 0 and "Do you wish" not in run.stdout + run.stderr, run.stdout + run.stderr
        name, max_length, side, short_row_mask = json.loads(run.stdout.strip().splitlines()[-1])
        assert (name, max_length, side) == ("TokenizersBackend", BLOCK, "left")
        assert short_row_mask[0] == 0 and short_row_mask[-1] == 1  # the padding is on the left


def test_jsonl_with_a_named_text_column_and_held_out_documents(tmp_path):
    texts = documents(80)
    write_jsonl(tmp_path / "corpus.jsonl", texts, column="content")
    args = data_args(tmp_path, train_file=str(tmp_path / "corpus.jsonl"), text_column_name="content")
    packed = prepare_data(args)
    splits = load_corpus(args).splits
    assert_packed(packed.train, packed.tokenizer, splits["train"]["text"])
    assert_packed(packed.validation, packed.tokenizer, splits["validation"]["text"])
    two_workers = prepare_data(
        data_args(tmp_path, **{**vars(args), "preprocessing_num_workers": 2, "overwrite_cache": True})
    )
    np.testing.assert_array_equal(two_workers.train, packed.train)


def test_hold_out_is_a_deterministic_partition(tmp_path):
    texts = documents(400)
    write_jsonl(tmp_path / "corpus.jsonl", texts)
    args = data_args(tmp_path, train_file=str(tmp_path / "corpus.jsonl"), validation_split_percentage=10)
    train, validation = (load_corpus(args).splits[name]["text"] for name in ("train", "validation"))
    assert len(train) + len(validation) == 400
    assert 36 <= len(validation) <= 44
    held = set(validation)
    assert train == [t for t in texts if t not in held] and validation == [t for t in texts if t in held]
    # Spread over the corpus, not a contiguous slice: each quarter loses about its share.
    assert all(6 <= sum(t in held for t in texts[q * 100 : (q + 1) * 100]) <= 14 for q in range(4))
    again = load_corpus(args).splits["validation"]["text"]
    assert again == validation
    streamed = load_corpus(data_args(tmp_path, **{**vars(args), "streaming": True})).splits
    assert [row["text"] for row in streamed["validation"]] == validation
    assert [row["text"] for row in streamed["train"]] == train


def test_parquet_files(tmp_path):
    train, held = documents(40, seed=4), documents(8, seed=5)
    pq.write_table(pa.table({"text": train, "n": list(range(40))}), tmp_path / "train.parquet")
    pq.write_table(pa.table({"text": held, "n": list(range(8))}), tmp_path / "valid.parquet")
    args = data_args(
        tmp_path, train_file=str(tmp_path / "train.parquet"), validation_file=str(tmp_path / "valid.parquet")
    )
    packed = prepare_data(args)
    assert_packed(packed.train, packed.tokenizer, train)
    assert_packed(packed.validation, packed.tokenizer, held)


def test_dataset_name_loads_through_load_dataset(tmp_path):
    # A local dataset directory goes through the same `load_dataset(name)` call as a hub dataset.
    repo = tmp_path / "my_dataset"
    repo.mkdir()
    train, held = documents(40, seed=6), documents(10, seed=7)
    write_jsonl(repo / "train.jsonl", train)
    write_jsonl(repo / "validation.jsonl", held)
    packed = prepare_data(data_args(tmp_path, dataset_name=str(repo)))
    assert_packed(packed.train, packed.tokenizer, train)
    assert_packed(packed.validation, packed.tokenizer, held)
    assert packed.stats["source"] == f"--dataset_name {str(repo)!r}"


def test_default_corpus_is_the_standard_library_sources(tmp_path, monkeypatch):
    stdlib = tmp_path / "stdlib"
    for name, body in {
        "b.py": b"import os\n\nprint(os.sep)\n" * 20,
        "pkg/a.py": b"def f(x):\n    return x + 1\n" * 20,
        "latin.py": "# -*- coding: latin-1 -*-\nname = 'caf\xe9'\n".encode("latin-1") * 20,
        "empty.py": b"",
        "site-packages/third.py": b"raise SystemExit\n",
        "dist-packages/other.py": b"raise SystemExit\n",
        "notes.txt": b"not python\n",
    }.items():
        (stdlib / name).parent.mkdir(parents=True, exist_ok=True)
        (stdlib / name).write_bytes(body)
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"stdlib": str(stdlib)})
    assert stdlib_files() == [str(stdlib / name) for name in ("b.py", "latin.py", "pkg/a.py")]

    packed = prepare_data(data_args(tmp_path, validation_split_percentage=0))
    texts = [
        (stdlib / name).read_bytes().decode("utf-8", errors="replace") for name in ("b.py", "latin.py", "pkg/a.py")
    ]
    assert_packed(packed.train, packed.tokenizer, texts)  # one document per file
    assert packed.validation.shape == (0, BLOCK + 1)
    assert "standard library" in packed.stats["source"]


def test_real_standard_library_listing():
    files = stdlib_files()
    assert len(files) > 500 and files == sorted(files)
    assert str(Path(sysconfig.get_paths()["stdlib"]) / "os.py") in files
    assert not any("site-packages" in Path(f).parts or "dist-packages" in Path(f).parts for f in files)


def test_streaming_packs_the_same_blocks_and_resumes(tmp_path):
    write_jsonl(tmp_path / "corpus.jsonl", documents(120))
    args = data_args(tmp_path, train_file=str(tmp_path / "corpus.jsonl"), streaming=True)
    streamed = prepare_data(args)
    assert isinstance(streamed.train, PackedStream) and "train" not in streamed.stats
    # The same documents and tokenizer, tokenized up front.
    packed = prepare_data(
        data_args(tmp_path, **{**vars(args), "streaming": False, "tokenizer_name": streamed.tokenizer.name_or_path})
    )
    for name in ("train", "validation"):
        chunks = list(getattr(streamed, name).iter_chunks(rows=5))
        assert all(len(chunk) == 5 for chunk in chunks[:-1]) and 1 <= len(chunks[-1]) <= 5
        np.testing.assert_array_equal(np.concatenate(chunks), getattr(packed, name))

    # Resume a streamed run mid-epoch and across the epoch boundary.
    steps_per_epoch = len(packed.train) // 16
    total = steps_per_epoch + 3
    reference = list(itertools.islice(ShardedLoader(streamed.train, 8, 2, seed=1), total))
    first = ShardedLoader(streamed.train, 4, 2, world_size=2, rank=0, seed=1)
    head = list(itertools.islice(first, 2))
    second = ShardedLoader(streamed.train, 8, 2, seed=1)
    second.load_state_dict(first.state_dict())
    tail = list(itertools.islice(second, total - 2))
    assert second.epoch == 1
    for step, micro_batches in enumerate(reference):
        inputs = stacked_inputs(micro_batches)  # global order: 8 blocks of micro-step 0, then 8 of micro-step 1
        if step < 2:  # rank 0 of 2 took the first 4 blocks of each micro-step
            np.testing.assert_array_equal(inputs[:4], stacked_inputs(head[step][:1]))
            np.testing.assert_array_equal(inputs[8:12], stacked_inputs(head[step][1:]))
        else:
            np.testing.assert_array_equal(inputs, stacked_inputs(tail[step - 2]))


def stacked_inputs(micro_batches) -> np.ndarray:
    return np.concatenate([m["input_ids"].numpy() for m in micro_batches])


def test_cache_is_reused_and_overwritten(tmp_path, monkeypatch, capsys):
    write_jsonl(tmp_path / "corpus.jsonl", documents(60))
    args = data_args(tmp_path, train_file=str(tmp_path / "corpus.jsonl"))
    first = prepare_data(args)
    assert not first.stats["cache_hit"]
    capsys.readouterr()

    def no_tokenizing(*_, **__):
        raise AssertionError("tokenized although the cache was complete")

    with monkeypatch.context() as patch:
        patch.setattr(data.prepare, "tokenize", no_tokenizing)
        second = prepare_data(args)
    assert second.stats["cache_hit"] and second.stats["cache"] == first.stats["cache"]
    out = capsys.readouterr().out
    assert f"Reusing packed data cached at {first.stats['cache']}" in out and "Reusing the tokenizer" in out
    np.testing.assert_array_equal(second.train, first.train)

    rebuilt = prepare_data(data_args(tmp_path, **{**vars(args), "overwrite_cache": True}))
    assert not rebuilt.stats["cache_hit"]
    np.testing.assert_array_equal(rebuilt.train, first.train)
    # A different block size is a different entry.
    assert prepare_data(data_args(tmp_path, **{**vars(args), "block_size": 8})).stats["cache"] != first.stats["cache"]


HIT_IN_A_FRESH_PROCESS = """
import json, sys
sys.path.insert(0, {root!r})
from data import DataArguments, prepare_data
packed = prepare_data(DataArguments(**{settings!r}))
print(json.dumps([packed.stats, packed.train.tolist(), "datasets" in sys.modules]))
"""


def test_a_complete_cache_of_local_files_is_reused_without_loading_them(tmp_path, monkeypatch):
    # Every rank of every launch prepares the data: with the cache complete, it needs neither the corpus nor the
    # `datasets` library (seconds of imports), only the files' stats.
    write_jsonl(tmp_path / "corpus.jsonl", documents(60))
    args = data_args(tmp_path, train_file=str(tmp_path / "corpus.jsonl"))
    first = prepare_data(args)
    root = str(Path(__file__).resolve().parents[2])
    code = HIT_IN_A_FRESH_PROCESS.format(root=root, settings=vars(args))
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    stats, train, imported_datasets = json.loads(run.stdout.strip().splitlines()[-1])
    assert stats["cache_hit"] and stats["cache"] == first.stats["cache"] and not imported_datasets
    assert stats == json.loads(json.dumps(first.stats | {"cache_hit": True}))
    assert f"Reusing packed data cached at {first.stats['cache']}" in run.stdout
    assert f"Reusing the tokenizer cached at {first.tokenizer.name_or_path}" in run.stdout
    np.testing.assert_array_equal(train, first.train)

    # The same with a named tokenizer (the trained one: the same ids, so the same entry); a rewritten file (new
    # stats) is loaded again.
    named = data_args(tmp_path, **{**vars(args), "tokenizer_name": first.tokenizer.name_or_path})

    def no_loading(*_, **__):
        raise AssertionError("loaded the corpus although the cache was complete")

    with monkeypatch.context() as patch:
        patch.setattr(data.prepare, "load_corpus", no_loading)
        assert prepare_data(named).stats["cache"] == first.stats["cache"]
        write_jsonl(tmp_path / "corpus.jsonl", documents(61))
        with pytest.raises(AssertionError, match="loaded the corpus"):
            prepare_data(named)


def test_half_written_cache_is_never_trusted(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "corpus.jsonl", documents(60))
    reference = prepare_data(data_args(tmp_path / "ref", train_file=str(tmp_path / "corpus.jsonl")))
    key = Path(reference.stats["cache"]).name
    args = data_args(tmp_path, train_file=str(tmp_path / "corpus.jsonl"))
    packed_dir = Path(args.cache_dir) / "packed"

    # A build that dies half-way (here by an exception) publishes nothing.
    def crash(tokens, block_size, dtype, path):
        path.write_bytes(b"\x00" * 10)
        raise RuntimeError("killed")

    with monkeypatch.context() as patch:
        patch.setattr(data.prepare, "write_blocks", crash)
        with pytest.raises(RuntimeError, match="killed"):
            prepare_data(args)
    assert list(packed_dir.iterdir()) == []

    # What a killed process leaves: a temp dir, and an entry without its completion marker.
    (packed_dir / f".{key}.tmp-dead").mkdir()
    (packed_dir / f".{key}.tmp-dead" / "train.bin").write_bytes(b"\x01" * 100)
    (packed_dir / key).mkdir()
    (packed_dir / key / "train.bin").write_bytes(b"\x02" * 100)
    (packed_dir / key / "meta.json").write_text(json.dumps({"splits": {"train": {"blocks": 1}}}))
    packed = prepare_data(args)
    assert not packed.stats["cache_hit"] and Path(packed.stats["cache"]).name == key
    assert (packed_dir / key / "COMPLETE").is_file()
    np.testing.assert_array_equal(packed.train, reference.train)
    np.testing.assert_array_equal(packed.validation, reference.validation)


def test_storage_dtype_is_the_narrowest_that_holds_the_vocab():
    assert storage_dtype(300, "--x") == np.uint16
    assert storage_dtype(65536, "--x") == np.uint16  # ids 0..65535
    assert storage_dtype(65537, "--x") == np.uint32
    assert storage_dtype(2**32, "--x") == np.uint32
    with pytest.raises(ValueError, match="--x: vocabulary size 4294967297"):
        storage_dtype(2**32 + 1, "--x")


def test_large_vocab_named_tokenizer_is_stored_as_uint32(tmp_path):
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, 70_000)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", unk_token="[UNK]")
    tokenizer.save_pretrained(tmp_path / "wordlevel")
    rng = random.Random(0)
    texts = [" ".join(f"w{rng.randrange(2, 70_000)}" for _ in range(rng.randint(3, 30))) for _ in range(40)]
    write_jsonl(tmp_path / "corpus.jsonl", texts)
    packed = prepare_data(
        data_args(tmp_path, train_file=str(tmp_path / "corpus.jsonl"), tokenizer_name=str(tmp_path / "wordlevel"))
    )
    assert packed.train.dtype == np.uint32 and packed.stats["dtype"] == "uint32"
    assert packed.train.max() > 65535
    assert_packed(
        packed.train,
        packed.tokenizer,
        load_corpus(data_args(tmp_path, train_file=str(tmp_path / "corpus.jsonl"))).splits["train"]["text"],
    )


# case: (flags, file paths relative to the test's folder; the error; what its message says, "|"-separated)
BAD_INPUTS = {
    "missing file": ({"train_file": "nope/*.txt"}, FileNotFoundError, "--train_file|nope/*.txt|matches no file"),
    "missing validation file": (
        {"train_file": "ok.jsonl", "validation_file": "gone.jsonl"},
        FileNotFoundError,
        "--validation_file|gone.jsonl",
    ),
    "empty corpus": ({"train_file": "empty.txt"}, ValueError, "--train_file|empty.txt|only empty files"),
    "parquet without rows": ({"train_file": "norows.parquet"}, ValueError, "--train_file|norows.parquet|one document"),
    "json without rows": ({"train_file": "norows.json"}, ValueError, "--train_file|norows.json|at least one document"),
    "unsupported file kind": ({"train_file": "table.csv"}, ValueError, "--train_file|table.csv|.jsonl"),
    "unknown text column": (
        {"train_file": "ok.jsonl", "text_column_name": "body"},
        ValueError,
        "--text_column_name 'body'|'id'|'text'",
    ),
    "unknown text column, and no tokenizer in the folder named": (  # the corpus's error first, as it is loaded first
        {"train_file": "ok.jsonl", "text_column_name": "body", "tokenizer_name": "."},
        ValueError,
        "--text_column_name 'body'|'id'|'text'",
    ),
    "two sources": (
        {"train_file": "ok.jsonl", "dataset_name": "wikitext"},
        ValueError,
        "--dataset_name 'wikitext'|pass one",
    ),
    "vocab too large to store": (
        {"tokenizer_vocab_size": 2**32 + 1},
        ValueError,
        "--tokenizer_vocab_size|4294967297|uint32",
    ),
    "vocab too small for bytes": ({"tokenizer_vocab_size": 200}, ValueError, "--tokenizer_vocab_size 200|larger"),
    "block beyond the positions": (
        {"block_size": 64},
        ValueError,
        "--block_size 64|max_position_embeddings 32|32 or less",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_fails_before_tokenizing_and_names_the_flag(case, tmp_path, monkeypatch):
    flags, error, message = BAD_INPUTS[case]
    write_jsonl(tmp_path / "ok.jsonl", documents(20))
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "norows.json").write_text("[]")
    (tmp_path / "table.csv").write_text("text\nhello\n")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "norows.parquet")
    for key in ("train_file", "validation_file", "tokenizer_name"):
        if key in flags:
            flags = {**flags, key: str(tmp_path / flags[key])}

    def no_tokenizing(*_, **__):
        raise AssertionError("tokenized before rejecting the input")

    monkeypatch.setattr(data.prepare, "tokenize", no_tokenizing)
    with pytest.raises(error) as raised:
        prepare_data(data_args(tmp_path, **flags), max_position_embeddings=32)
    for part in message.split("|"):
        assert part in str(raised.value)


def test_corpus_shorter_than_one_block(tmp_path):
    write_jsonl(tmp_path / "tiny.jsonl", ["a b c"])
    with pytest.raises(ValueError) as raised:
        prepare_data(data_args(tmp_path, train_file=str(tmp_path / "tiny.jsonl"), block_size=64))
    assert "--block_size 64" in str(raised.value) and "fewer than one block" in str(raised.value)
    assert not any((Path(tmp_path) / "cache" / "packed").iterdir())


def test_main_process_builds_before_the_others_read(tmp_path, capsys):
    write_jsonl(tmp_path / "corpus.jsonl", documents(40))
    args = data_args(tmp_path, train_file=str(tmp_path / "corpus.jsonl"))
    packed_dir = Path(args.cache_dir) / "packed"
    seen_at_barrier = []

    def barrier():
        seen_at_barrier.append(packed_dir.is_dir() and any(is_complete(entry) for entry in packed_dir.iterdir()))

    main = prepare_data(args, is_main_process=True, wait_for_everyone=barrier)
    assert seen_at_barrier == [True], "the main process reaches the barrier once, with the cache complete"
    capsys.readouterr()
    other = prepare_data(args, is_main_process=False, wait_for_everyone=barrier)
    assert seen_at_barrier == [True, True] and other.stats["cache_hit"]
    assert capsys.readouterr().out == "", "only the main process reports"
    np.testing.assert_array_equal(other.train, main.train)
