"""training/core/build.py builds the model sharded on 2 CPU ranks (under ZeRO-3 inside zero.Init, under FSDP2 on the
meta device; each rank holds half of it right after construction) with the same weights and the same RNG state
afterwards as a plain build."""

from __future__ import annotations

import json

import pytest
from launching import ROOT, launch, launcher_command


def worker_ranks(tmp_path, config: str, worker: str) -> list[dict]:
    """Launch tests/training/<worker>_worker.py on 2 ranks with accelerate's `config`; each rank's record."""
    cmd = launcher_command("accelerate", config)
    cmd[-1] = str(ROOT / "tests" / "training" / f"{worker}_worker.py")
    launch(cmd, ["--preset=debug"], tmp_path / "out")
    ranks = json.loads((tmp_path / "out" / f"{worker}.json").read_text())
    assert len(ranks) == 2
    return ranks


@pytest.mark.slow
@pytest.mark.multiproc
def test_zero3_builds_partitioned_with_a_plain_builds_weights(tmp_path):
    ranks = worker_ranks(tmp_path, "zero3", "zero_init")
    for rank in ranks:
        assert rank["same_weights"] == 1 and rank["same_rng_after"] == 1, rank
        # Half of every parameter, up to DeepSpeed's padding of odd-sized partitions (the debug model's 64-wide
        # norms and 176-row MLP split evenly; nothing larger than a few elements is padded).
        assert rank["held_fraction"] == pytest.approx(0.5, abs=0.01), rank


@pytest.mark.slow
@pytest.mark.multiproc
def test_fsdp2_builds_on_meta_with_a_plain_builds_weights(tmp_path):
    ranks = worker_ranks(tmp_path, "fsdp", "fsdp_init")
    for rank in ranks:
        assert rank["built_on_meta"] == 1 and rank["optimizer_on_shards"] == 1, rank
        assert rank["same_weights"] == 1 and rank["same_rng_after"] == 1, rank
        assert rank["same_read"] == 1, rank  # the checkpoint read back shard by shard
        # FSDP2 chunks every parameter's first dimension in two; the debug model's are all even.
        assert rank["held_fraction"] == 0.5, rank
