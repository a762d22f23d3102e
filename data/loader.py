"""Deterministic, rank-sharded, resumable batches of packed blocks.

The order depends only on the seed and the global batch size G = micro_batch_size *
gradient_accumulation_steps * world_size, never on how G is split:

- epoch e visits the blocks in the permutation `torch.randperm(n, generator=manual_seed(seed + e))`
  (a `PackedStream` is instead read in its stream order, documents shuffled with the same seed);
- optimizer step s of an epoch consumes the global batch `perm[s*G:(s+1)*G]`, and the incomplete
  final global batch of an epoch is dropped;
- within it, micro-step a on rank r takes positions `[a*micro*W + r*micro, a*micro*W + (r+1)*micro)`.
  That is how accelerate's `prepare` shards a DataLoader of batch size `micro` (batch k goes to rank
  k % W), so `EpochSampler` gives a plain DataLoader the same batches.

Hence 2 ranks x micro 4 train on exactly the 8 blocks that 1 rank x micro 8 does, in the same order,
and a checkpoint's position, counted in global batches, is valid for any split of the same G.

Every rank reads its whole global batch, not only its share: that lets it count the target tokens of
all ranks (`num_items_in_batch`, for a loss normalised over the global batch) with no collective.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from .packing import PackedStream

IGNORE_INDEX = -100
Blocks = np.ndarray | torch.Tensor | PackedStream
MicroBatch = dict[str, torch.Tensor]


def epoch_order(num_blocks: int, seed: int, epoch: int) -> torch.Tensor:
    """The permutation of block indices that epoch `epoch` visits."""
    return torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed + epoch))


def _as_array(blocks: np.ndarray | torch.Tensor) -> np.ndarray:
    return blocks.cpu().numpy() if isinstance(blocks, torch.Tensor) else blocks


def _as_long(rows: np.ndarray) -> torch.Tensor:
    # Stored ids are unsigned (uint16/uint32), which torch indexes poorly; the model wants int64 anyway.
    return torch.from_numpy(np.asarray(rows, dtype=np.int64))


def rank_micro_batches(
    inputs: torch.Tensor,
    labels: torch.Tensor,
    micro: int,
    accumulation: int,
    world: int,
    rank: int,
    sequence: tuple[int, int] = (1, 0),
) -> list[MicroBatch]:
    """This rank's micro-batches of one global batch (rows of `inputs`/`labels` in global order). With `sequence`
    = (sp, sp_rank), sp > 1: only positions [sp_rank T / sp, (sp_rank + 1) T / sp) of each row, with their
    `position_ids` (the labels were shifted over the whole row first, so a slice's last target is the next
    slice's first input)."""
    num_items = (labels != IGNORE_INDEX).sum()
    inputs, labels = (t.reshape(accumulation, world, micro, -1)[:, rank] for t in (inputs, labels))
    sp, sp_rank = sequence
    extra = {}
    if sp > 1:
        length = inputs.shape[-1] // sp
        positions = slice(sp_rank * length, (sp_rank + 1) * length)
        inputs, labels = inputs[..., positions], labels[..., positions]
        extra["position_ids"] = torch.arange(positions.start, positions.stop).expand(micro, length)
    return [
        {"input_ids": i.contiguous(), "shift_labels": l.contiguous(), "num_items_in_batch": num_items, **extra}
        for i, l in zip(inputs, labels, strict=True)
    ]


class _ArrayEpochs:
    """Global batches of an in-memory (or memory-mapped) array, by random access."""

    def __init__(self, blocks: np.ndarray, global_batch_size: int):
        self.blocks = blocks
        self.global_batch_size = global_batch_size
        self.steps_per_epoch = len(blocks) // global_batch_size
        self._order: tuple[tuple[int, int], torch.Tensor] | None = None

    def global_batch(self, epoch: int, step: int, seed: int) -> torch.Tensor | None:
        if step >= self.steps_per_epoch:
            return None
        if self._order is None or self._order[0] != (seed, epoch):
            self._order = ((seed, epoch), epoch_order(len(self.blocks), seed, epoch))
        size = self.global_batch_size
        return _as_long(self.blocks[self._order[1][step * size : (step + 1) * size].numpy()])


class _StreamEpochs:
    """Global batches of a `PackedStream`, read sequentially.

    Asked for any other position than the next one (after `load_state_dict`), it restarts the epoch's
    stream and skips the global batches before it: exact, at the cost of re-tokenizing what it skips.
    """

    steps_per_epoch = None

    def __init__(self, stream: PackedStream, global_batch_size: int):
        self.stream = stream
        self.global_batch_size = global_batch_size
        self._next: tuple[int, int, int] | None = None
        self._chunks: Iterator[np.ndarray] = iter(())

    def global_batch(self, epoch: int, step: int, seed: int) -> torch.Tensor | None:
        if self._next != (seed, epoch, step):
            chunks = self.stream.iter_chunks(self.global_batch_size, epoch, seed)
            self._chunks = itertools.islice(chunks, step, None)
        self._next = (seed, epoch, step + 1)
        chunk = next(self._chunks, None)
        return None if chunk is None or len(chunk) < self.global_batch_size else _as_long(chunk)


class ShardedLoader:
    """Endless training batches for one rank; see the module docstring for the order.

    Each item is one optimizer step: a list of `gradient_accumulation_steps` micro-batches, each a dict
    with `input_ids` and `shift_labels` (LongTensor (micro_batch_size, block_size), labels already
    shifted: the model must not shift again) and `num_items_in_batch` (scalar LongTensor: the targets
    that are not -100 in the whole global batch, all ranks and micro-steps). Iteration continues
    across epochs, `epoch` counting up; stop it by step count.

    `blocks` is a (n, block_size + 1) integer array or tensor (-100 marks a target to ignore) or a
    `PackedStream`. `world_size` and `rank` count data-parallel ranks. Under sequence parallelism the
    `sequence_parallel_size` ranks of a group read the same micro batches and keep their slice of each sequence
    (rank r: positions [r T / sp, (r + 1) T / sp), with `position_ids`); `num_items_in_batch` still counts the
    whole global batch, so the slices' losses add up to its mean. The order and a checkpoint's position do not
    depend on it.
    """

    def __init__(
        self,
        blocks: Blocks,
        micro_batch_size: int,
        gradient_accumulation_steps: int = 1,
        world_size: int = 1,
        rank: int = 0,
        seed: int = 0,
        sequence_parallel_size: int = 1,
        sequence_parallel_rank: int = 0,
    ):
        if min(micro_batch_size, gradient_accumulation_steps, world_size) < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need micro_batch_size, gradient_accumulation_steps, world_size >= 1 and 0 <= rank < world_size; "
                f"got {micro_batch_size}, {gradient_accumulation_steps}, {world_size}, rank {rank}"
            )
        if not 0 <= sequence_parallel_rank < sequence_parallel_size:
            raise ValueError(
                f"need 0 <= sequence_parallel_rank < sequence_parallel_size; got {sequence_parallel_rank}, "
                f"{sequence_parallel_size}"
            )
        self.micro_batch_size = micro_batch_size
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.sequence = (sequence_parallel_size, sequence_parallel_rank)
        self.epoch = 0
        self.step = 0
        self.global_batch_size = micro_batch_size * gradient_accumulation_steps * world_size
        if isinstance(blocks, PackedStream):
            self.num_blocks = None
            self._epochs = _StreamEpochs(blocks, self.global_batch_size)
        else:
            self.num_blocks = len(blocks)
            self._epochs = _ArrayEpochs(_as_array(blocks), self.global_batch_size)
            if self.num_blocks < self.global_batch_size:
                raise self._too_short(f"{self.num_blocks} blocks")

    @property
    def steps_per_epoch(self) -> int | None:
        """Optimizer steps in one epoch (None for a stream, whose length is unknown)."""
        return self._epochs.steps_per_epoch

    def _too_short(self, size: str) -> ValueError:
        return ValueError(
            f"the training split has {size}, fewer than one global batch of {self.global_batch_size} "
            f"(--per_device_train_batch_size {self.micro_batch_size} x --gradient_accumulation_steps "
            f"{self.gradient_accumulation_steps} x {self.world_size} processes): add data or lower one of them"
        )

    def __iter__(self) -> Iterator[list[MicroBatch]]:
        while True:
            batch = self._epochs.global_batch(self.epoch, self.step, self.seed)
            if batch is None:
                if self.step == 0:  # only a stream gets here: arrays are checked up front
                    raise self._too_short("less than one global batch of blocks")
                self.epoch, self.step = self.epoch + 1, 0
                continue
            # Count the step before handing it out: a checkpoint taken after training on it resumes after it.
            self.step += 1
            yield rank_micro_batches(
                batch[:, :-1],
                batch[:, 1:],
                self.micro_batch_size,
                self.gradient_accumulation_steps,
                self.world_size,
                self.rank,
                self.sequence,
            )

    def state_dict(self) -> dict[str, Any]:
        """The position: epoch and optimizer steps into it (global batches, so independent of world size)."""
        return {
            "epoch": self.epoch,
            "step": self.step,
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "num_blocks": self.num_blocks,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`, possibly saved with another world size or micro batch of the same G."""
        if state["global_batch_size"] != self.global_batch_size:
            raise ValueError(
                f"the checkpoint was taken with a global batch of {state['global_batch_size']} blocks, this "
                f"loader's is {self.global_batch_size}: keep micro batch x accumulation x processes equal to resume"
            )
        if state["num_blocks"] != self.num_blocks:
            raise ValueError(
                f"the checkpoint's training data had {state['num_blocks']} blocks, this has {self.num_blocks}: "
                "resume with the same data flags and --block_size"
            )
        self.epoch, self.step, self.seed = state["epoch"], state["step"], state["seed"]


def _row_chunks(blocks: Blocks, rows: int) -> Iterator[torch.Tensor]:
    """Consecutive chunks of `rows` blocks, in order, the last one possibly shorter."""
    if isinstance(blocks, PackedStream):
        yield from map(_as_long, blocks.iter_chunks(rows))
        return
    blocks = _as_array(blocks)
    for start in range(0, len(blocks), rows):
        yield _as_long(blocks[start : start + rows])


def iter_eval_batches(
    blocks: Blocks, micro_batch_size: int, world_size: int = 1, rank: int = 0
) -> Iterator[MicroBatch]:
    """Every block once, in order, sharded like one training micro-step: batch k is blocks
    `[k*micro*W, (k+1)*micro*W)` and rank r takes its r-th `micro` of them.

    All ranks get the same number of batches of the same shape (collectives in the model need that):
    the last global batch is padded with rows whose `shift_labels` are all -100 (and `input_ids` 0).
    So sum the loss over targets (it is 0 on padding) and divide by the summed `num_items_in_batch`,
    which counts the real targets of the whole batch on every rank. For a `PackedStream`, cap the number
    of batches the same way on every rank (e.g. `itertools.islice`).
    """
    span = micro_batch_size * world_size
    for chunk in _row_chunks(blocks, span):
        n, length = len(chunk), chunk.shape[1] - 1
        inputs = torch.zeros(span, length, dtype=torch.long)
        labels = torch.full((span, length), IGNORE_INDEX, dtype=torch.long)
        inputs[:n], labels[:n] = chunk[:, :-1], chunk[:, 1:]
        yield rank_micro_batches(inputs, labels, micro_batch_size, 1, world_size, rank)[0]


class BlockDataset(Dataset):
    """Blocks as a map-style dataset for a plain DataLoader: item i is block i's input_ids/shift_labels."""

    def __init__(self, blocks: np.ndarray | torch.Tensor):
        self.blocks = _as_array(blocks)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> MicroBatch:
        block = _as_long(self.blocks[index])
        return {"input_ids": block[:-1], "shift_labels": block[1:]}


class EpochSampler(Sampler[int]):
    """`ShardedLoader`'s epoch order as a sampler (call `set_epoch` each epoch).

    A DataLoader over `BlockDataset` with this sampler and `batch_size=micro_batch_size`, sharded by
    accelerate's `prepare`, gives each rank the same micro-batches as `ShardedLoader` (without
    `num_items_in_batch`). Its length drops the incomplete final global batch likewise.
    """

    def __init__(self, num_blocks: int, global_batch_size: int, seed: int = 0):
        self.num_blocks = num_blocks
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_blocks // self.global_batch_size * self.global_batch_size

    def __iter__(self) -> Iterator[int]:
        yield from epoch_order(self.num_blocks, self.seed, self.epoch)[: len(self)].tolist()
