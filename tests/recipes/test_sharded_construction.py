"""training/build.py under ZeRO-3: the model is built inside zero.Init on 2 CPU ranks (each holds half of it
right after construction) with the same weights and the same RNG state afterwards as a plain build."""

from __future__ import annotations

import json

import pytest
from launching import ROOT, launch, launcher_command


@pytest.mark.slow
@pytest.mark.multiproc
def test_zero3_builds_partitioned_with_a_plain_builds_weights(tmp_path):
    cmd = launcher_command("accelerate", "zero3")
    cmd[-1] = str(ROOT / "tests" / "recipes" / "zero_init_worker.py")
    launch(cmd, ["--preset=debug"], tmp_path / "out")
    ranks = json.loads((tmp_path / "out" / "zero_init.json").read_text())
    assert len(ranks) == 2
    for rank in ranks:
        assert rank["same_weights"] == 1 and rank["same_rng_after"] == 1, rank
        # Half of every parameter, up to DeepSpeed's padding of odd-sized partitions (the debug model's 64-wide
        # norms and 176-row MLP split evenly; nothing larger than a few elements is padded).
        assert rank["held_fraction"] == pytest.approx(0.5, abs=0.01), rank


@pytest.mark.slow
@pytest.mark.multiproc
def test_fsdp2_builds_on_meta_with_a_plain_builds_weights(tmp_path):
    cmd = launcher_command("accelerate", "fsdp")
    cmd[-1] = str(ROOT / "tests" / "recipes" / "fsdp_init_worker.py")
    launch(cmd, ["--preset=debug"], tmp_path / "out")
    ranks = json.loads((tmp_path / "out" / "fsdp_init.json").read_text())
    assert len(ranks) == 2
    for rank in ranks:
        assert rank["built_on_meta"] == 1 and rank["optimizer_on_shards"] == 1, rank
        assert rank["same_weights"] == 1 and rank["same_rng_after"] == 1, rank
        assert rank["same_read"] == 1, rank  # the checkpoint read back shard by shard
        # FSDP2 chunks every parameter's first dimension in two; the debug model's are all even.
        assert rank["held_fraction"] == 0.5, rank
