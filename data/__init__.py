"""shardgpt's data: text sources, tokenizer, tokenize-once packing with an on-disk cache, and a
deterministic rank-sharded resumable loader.

    from data import DataArguments, prepare_data, ShardedLoader, iter_eval_batches

    packed = prepare_data(DataArguments(block_size=256), max_position_embeddings=config.max_position_embeddings)
    loader = ShardedLoader(packed.train, micro_batch_size=8, gradient_accumulation_steps=2, world_size=W, rank=r)
    for step, micro_batches in zip(range(max_steps), loader):
        ...  # one optimizer step over len(micro_batches) micro-batches

See docs/data.md.
"""

from .arguments import DataArguments
from .loader import BlockDataset, EpochSampler, ShardedLoader, epoch_order, iter_eval_batches, rank_micro_batches
from .packing import PackedStream
from .prepare import PackedData, prepare_data

__all__ = [
    "BlockDataset",
    "DataArguments",
    "EpochSampler",
    "PackedData",
    "PackedStream",
    "ShardedLoader",
    "epoch_order",
    "iter_eval_batches",
    "prepare_data",
    "rank_micro_batches",
]
