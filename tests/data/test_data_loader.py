"""ShardedLoader, iter_eval_batches and EpochSampler on small crafted block arrays."""

import itertools

import numpy as np
import pytest
import torch
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader

from data import BlockDataset, EpochSampler, ShardedLoader, iter_eval_batches

BLOCK = 4  # tokens per sequence; blocks hold BLOCK + 1


def numbered_blocks(n: int) -> np.ndarray:
    """Block i holds i*(BLOCK+1) ... so every token tells which block it came from."""
    return np.arange(n * (BLOCK + 1), dtype=np.uint16).reshape(n, BLOCK + 1)


def global_batches(blocks, micro: int, accumulation: int, world: int, steps: int, seed: int = 0, state=None):
    """Run one loader per rank for `steps` optimizer steps and reassemble each step's global batch in the
    global order the spec defines (micro-step a, then rank r). Returns per step (input_ids, labels, num_items)."""
    loaders = [ShardedLoader(blocks, micro, accumulation, world, rank, seed) for rank in range(world)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    per_rank = [list(itertools.islice(loader, steps)) for loader in loaders]
    out = []
    for step in range(steps):
        counts = {int(per_rank[r][step][a]["num_items_in_batch"]) for r in range(world) for a in range(accumulation)}
        assert len(counts) == 1, "every rank and micro-step must report the same global count"
        order = [per_rank[r][step][a] for a in range(accumulation) for r in range(world)]
        out.append(
            (
                torch.cat([m["input_ids"] for m in order]),
                torch.cat([m["shift_labels"] for m in order]),
                counts.pop(),
            )
        )
    return out, loaders[0].state_dict()


def assert_same(run_a, run_b):
    assert len(run_a) == len(run_b)
    for (ia, la, na), (ib, lb, nb) in zip(run_a, run_b, strict=True):
        assert torch.equal(ia, ib) and torch.equal(la, lb) and na == nb


CONFIGS = [  # (micro, accumulation, world): all with a global batch of 8
    (8, 1, 1),
    (4, 1, 2),
    (1, 2, 4),
    (2, 2, 2),
    (1, 8, 1),
    (2, 1, 4),
]


@pytest.mark.parametrize(("micro", "accumulation", "world"), CONFIGS)
def test_global_order_is_the_seeded_permutation_for_any_split(micro, accumulation, world):
    n, seed = 27, 5  # 3 global batches of 8 per epoch, 3 blocks dropped
    blocks = numbered_blocks(n)
    run, _ = global_batches(blocks, micro, accumulation, world, steps=7, seed=seed)
    expected = []
    for epoch in range(3):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        expected += [perm[s * 8 : (s + 1) * 8] for s in range(3)]
    for (inputs, labels, num_items), rows in zip(run, expected[:7], strict=True):
        full = torch.from_numpy(blocks[rows.numpy()].astype(np.int64))
        assert torch.equal(inputs, full[:, :-1])
        assert torch.equal(labels, full[:, 1:])
        assert num_items == 8 * BLOCK


def test_world_and_micro_splits_see_identical_samples():
    blocks = numbered_blocks(40)
    reference, _ = global_batches(blocks, *CONFIGS[0], steps=10)
    for config in CONFIGS[1:]:
        assert_same(global_batches(blocks, *config, steps=10)[0], reference)


def test_epochs_are_permutations_and_differ():
    blocks = numbered_blocks(20)
    loader = ShardedLoader(blocks, micro_batch_size=3, gradient_accumulation_steps=2)
    assert loader.steps_per_epoch == 3  # 18 of 20 blocks per epoch
    seen = {0: [], 1: []}
    for micro_batches in itertools.islice(loader, 6):
        epoch = loader.epoch if loader.step else loader.epoch - 1
        for m in micro_batches:
            seen[epoch] += (m["input_ids"][:, 0] // (BLOCK + 1)).tolist()
    assert loader.epoch == 1 and loader.step == 3
    for ids in seen.values():
        assert len(ids) == 18 and len(set(ids)) == 18
    assert seen[0] != seen[1]
    next(iter(loader))
    assert loader.state_dict()["epoch"] == 2 and loader.state_dict()["step"] == 1


def test_micro_batch_layout_and_dtypes():
    loader = ShardedLoader(numbered_blocks(16), micro_batch_size=2, gradient_accumulation_steps=3, world_size=2, rank=1)
    micro_batches = next(iter(loader))
    assert len(micro_batches) == 3
    for m in micro_batches:
        assert m["input_ids"].shape == m["shift_labels"].shape == (2, BLOCK)
        assert m["input_ids"].dtype == m["shift_labels"].dtype == m["num_items_in_batch"].dtype == torch.long
        assert m["num_items_in_batch"].dim() == 0
        # Labels are the inputs shifted by one: position t predicts token t + 1 of the same block.
        assert torch.equal(m["shift_labels"][:, :-1], m["input_ids"][:, 1:])
        assert torch.equal(m["shift_labels"][:, -1], m["input_ids"][:, -1] + 1)


@pytest.mark.parametrize(("micro", "accumulation", "world"), [(2, 2, 2), (1, 1, 4), (4, 1, 1)])
def test_num_items_counts_unignored_targets_of_all_ranks(micro, accumulation, world):
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 1000, size=(24, BLOCK + 1))
    blocks[rng.random(blocks.shape) < 0.3] = -100
    run, _ = global_batches(torch.from_numpy(blocks), micro, accumulation, world, steps=6)
    counts = [num_items for _, _, num_items in run]
    for _, labels, num_items in run:
        assert num_items == int((labels != -100).sum())
    assert len(set(counts)) > 1, "the crafted -100s should make the counts differ"
    assert all(0 < c < micro * accumulation * world * BLOCK for c in counts)  # some targets of each batch ignored


@pytest.mark.parametrize(
    ("stops", "resume_config"),
    [
        ([2], (4, 1, 2)),  # within the first epoch, onto another split of the same global batch
        ([2, 5], (2, 2, 2)),  # twice, the second across the epoch boundary
        ([3, 4, 7], (8, 1, 1)),  # exactly at epoch boundaries
    ],
)
def test_resume_is_exact(stops, resume_config):
    blocks = numbered_blocks(26)  # 3 steps of 8 per epoch
    total = 10
    reference, _ = global_batches(blocks, 1, 2, 4, steps=total, seed=3)
    resumed, state, done = [], None, 0
    for stop, config in zip([*stops, total], [(1, 2, 4), *[resume_config] * len(stops)], strict=True):
        part, state = global_batches(blocks, *config, steps=stop - done, seed=3, state=state)
        resumed += part
        done = stop
    assert_same(resumed, reference)
    assert state["epoch"] == total // 3 and state["step"] == total % 3


def test_load_state_dict_takes_the_checkpoint_seed():
    blocks = numbered_blocks(16)
    source = ShardedLoader(blocks, 4, seed=7)
    next(iter(source))
    target = ShardedLoader(blocks, 4, seed=0)
    target.load_state_dict(source.state_dict())
    assert all(
        torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(next(iter(target)), next(iter(source)), strict=True)
    )


def test_load_state_dict_rejects_another_global_batch_or_data():
    state = ShardedLoader(numbered_blocks(16), 4).state_dict()
    with pytest.raises(ValueError, match="global batch of 4 blocks, this loader's is 8"):
        ShardedLoader(numbered_blocks(16), 4, world_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="had 16 blocks, this has 20"):
        ShardedLoader(numbered_blocks(20), 4).load_state_dict(state)


def test_corpus_shorter_than_one_global_batch():
    with pytest.raises(ValueError) as error:
        ShardedLoader(numbered_blocks(7), micro_batch_size=2, gradient_accumulation_steps=2, world_size=2)
    message = str(error.value)
    for part in ("7 blocks", "global batch of 8", "--per_device_train_batch_size 2", "--gradient_accumulation_steps 2"):
        assert part in message


@pytest.mark.parametrize(("n", "micro", "world"), [(13, 2, 3), (12, 2, 3), (5, 4, 1), (1, 1, 2)])
def test_eval_batches_cover_every_block_once(n, micro, world):
    blocks = numbered_blocks(n)
    per_rank = [list(iter_eval_batches(blocks, micro, world, rank)) for rank in range(world)]
    steps = -(-n // (micro * world))
    assert all(len(batches) == steps for batches in per_rank), "ranks must run the same number of batches"
    seen = []
    for step in range(steps):
        batch = [per_rank[rank][step] for rank in range(world)]
        real_targets = sum(int((b["shift_labels"] != -100).sum()) for b in batch)
        for b in batch:
            assert b["input_ids"].shape == b["shift_labels"].shape == (micro, BLOCK)
            assert int(b["num_items_in_batch"]) == real_targets
            real = (b["shift_labels"] != -100).all(dim=1)
            assert ((b["shift_labels"] == -100).all(dim=1) | real).all(), "rows are wholly real or wholly padding"
            assert (b["input_ids"][~real] == 0).all()
            seen += (b["input_ids"][real, 0] // (BLOCK + 1)).tolist()
    assert seen == list(range(n))


def test_epoch_sampler_through_accelerate_matches_the_loader():
    blocks = numbered_blocks(30)
    micro, world = 2, 2
    sampler = EpochSampler(len(blocks), global_batch_size=micro * 2 * world, seed=1)  # 2 accumulation steps
    plain = DataLoader(BlockDataset(blocks), batch_size=micro, sampler=sampler)
    for rank in range(world):
        sharded = prepare_data_loader(plain, num_processes=world, process_index=rank, put_on_device=False)
        loader = ShardedLoader(blocks, micro, 2, world, rank, seed=1)
        for epoch in range(2):
            sharded.set_epoch(epoch)
            ours = [m for step in itertools.islice(loader, loader.steps_per_epoch) for m in step]
            theirs = list(sharded)
            assert len(theirs) == len(ours) == 3 * 2
            for mine, batch in zip(ours, theirs, strict=True):
                assert torch.equal(mine["input_ids"], batch["input_ids"])
                assert torch.equal(mine["shift_labels"], batch["shift_labels"])


@pytest.mark.parametrize("sp", [2, 4])
def test_sequence_parallel_ranks_hold_slices_of_the_same_sequences(sp):
    """Under sequence parallelism the ranks of a group read the same micro batches and keep consecutive slices of
    each sequence with their positions: put side by side they are the whole sequences, shifted labels included (a
    slice's last target is the next slice's first input), and the global count of targets is unchanged. The order
    and the loader's position do not depend on sp, so a checkpoint resumes under any degree."""
    blocks, steps = numbered_blocks(24), 4
    reference = ShardedLoader(blocks, 2, 2, 2, 1, seed=3)  # 3 steps an epoch: the 4th starts the next one
    whole = list(itertools.islice(reference, steps))
    loaders = [ShardedLoader(blocks, 2, 2, 2, 1, 3, sp, r) for r in range(sp)]
    slices = [list(itertools.islice(loader, steps)) for loader in loaders]
    for step in range(steps):
        for a, micro in enumerate(whole[step]):
            parts = [slices[r][step][a] for r in range(sp)]
            for key in ("input_ids", "shift_labels"):
                assert torch.equal(torch.cat([p[key] for p in parts], dim=1), micro[key])
            positions = torch.cat([p["position_ids"] for p in parts], dim=1)
            assert torch.equal(positions, torch.arange(BLOCK).expand(2, BLOCK))
            assert {int(p["num_items_in_batch"]) for p in parts} == {int(micro["num_items_in_batch"])}
    assert all(loader.state_dict() == reference.state_dict() for loader in loaders)
    assert "position_ids" not in whole[0][0]  # without sequence parallelism the batches are as they were
