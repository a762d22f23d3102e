"""Throughput of shardgpt's data pipeline on the default corpus (the standard library's *.py sources).

- tokenize and pack: tokens/s of `prepare_data` building the packed cache with 1 and 2 worker processes
  (in a fresh temporary cache; the BPE is trained once beforehand, outside the timings);
- loader: optimizer steps/s and tokens/s of `ShardedLoader` over the packed blocks (one rank, no
  accumulation), which is what a training step has to stay above.

    python recipes/measure/benchmark_data.py
    python recipes/measure/benchmark_data.py --micro_batch_size 8 --block_size 256 --num_proc 1 2 --steps 2000
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time

import numpy as np

from data import DataArguments, ShardedLoader, prepare_data


def pack_tokens_per_sec(args: DataArguments) -> float:
    """Tokens/s of one `prepare_data` that tokenizes and packs (train and validation) from scratch."""
    start = time.perf_counter()
    packed = prepare_data(args)
    seconds = time.perf_counter() - start
    return (packed.stats["train"]["tokens"] + packed.stats["validation"]["tokens"]) / seconds


def loader_tokens_per_sec(blocks: np.ndarray, micro_batch_size: int = 8, steps: int = 1000) -> float:
    """Input tokens/s that `ShardedLoader` delivers on one rank (batches/s = this / (micro * block))."""
    loader = ShardedLoader(blocks, micro_batch_size)
    next(iter(loader))  # the first step also draws the epoch's permutation
    start = time.perf_counter()
    for _ in itertools.islice(loader, steps):
        pass
    seconds = time.perf_counter() - start
    return steps * micro_batch_size * (blocks.shape[1] - 1) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block_size", type=int, default=256)
    parser.add_argument("--micro_batch_size", type=int, default=8)
    parser.add_argument("--num_proc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=2000)
    options = parser.parse_args()

    with tempfile.TemporaryDirectory() as cache_dir:
        args = DataArguments(block_size=options.block_size, cache_dir=cache_dir)
        packed = prepare_data(args)  # trains the BPE and warms the OS file cache; not timed
        results = []
        for num_proc in options.num_proc:
            rerun = DataArguments(**{**vars(args), "preprocessing_num_workers": num_proc, "overwrite_cache": True})
            results.append((num_proc, pack_tokens_per_sec(rerun)))
        tokens_per_sec = loader_tokens_per_sec(packed.train, options.micro_batch_size, options.steps)

    print(f"\ncorpus: {packed.stats['source']}, vocab {packed.stats['vocab_size']}, block {options.block_size}")
    for num_proc, rate in results:
        print(f"tokenize+pack  num_proc={num_proc}: {rate:,.0f} tokens/s")
    batches_per_sec = tokens_per_sec / (options.micro_batch_size * options.block_size)
    print(
        f"loader  micro_batch_size={options.micro_batch_size} block_size={options.block_size}: "
        f"{batches_per_sec:,.0f} batches/s, {tokens_per_sec:,.0f} tokens/s"
    )


if __name__ == "__main__":
    main()
