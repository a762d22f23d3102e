"""What each data-parallel strategy sends, measured by the training script on 4 CPU ranks (gloo) and recorded in
strategy.json: each kind of collective's bytes equal the closed form for the settings in force (training/loop/comms.py),
and, where the ZeRO paper's assumptions hold, the paper's volume. The 2-rank launches of tests/recipes/
test_strategies.py assert the same for every shipped config; these launches add the 4-rank cells and the two
DeepSpeed settings that change the traffic, each beside the shipped JSON's value:

- `use_multi_rank_bucket_allreduce` (ZeRO-1/2, DeepSpeed's default true): all-reduces the gradient buckets, 2 Psi,
  where the paper reduces them, Psi: 3 Psi a step instead of 2.
- `stage3_max_live_parameters` / `stage3_max_reuse_distance` (ZeRO-3; 1e9 in ds_configs/zero3.json): at least Psi,
  nothing gathered is released before the step ends and the backward re-gathers nothing: 2 Psi where the paper has
  3 Psi; at 0 every module is gathered again in the backward, the tied embedding once more in each direction.
"""

from __future__ import annotations

import pytest
from communication import assert_closed_form, launched
from launching import ROOT, launch, launcher_command

from recipes.measure.comm_scaling import NO_LIVE, NO_MULTI_RANK, accelerate_config_with

ARGS = [
    "--preset=debug", "--max_steps=3", "--warmup_steps=1", "--per_device_train_batch_size=2", "--logging_steps=1",
    "--eval_steps=0", "--max_eval_batches=1", "--save_steps=0", "--sample_max_new_tokens=0",
]  # fmt: skip
MATRIX = pytest.mark.matrix  # the shipped configs that the 2-rank launches already hold to their closed forms
CELLS = [
    pytest.param("ddp", {}, (2, 2), marks=MATRIX, id="ddp"),
    pytest.param("fsdp", {}, (3, None), id="fsdp"),  # 3 Psi less the root group's once (kept after the forward)
    pytest.param("fsdp_shard_grad_op", {}, (2, 2), marks=MATRIX, id="fsdp_shard_grad_op"),
    pytest.param("zero1", {}, (2, 3), marks=MATRIX, id="zero1"),
    pytest.param("zero2", {}, (2, 3), id="zero2"),
    pytest.param("zero2", NO_MULTI_RANK, (2, 2), id="zero2-multi-rank-all-reduce-off"),
    pytest.param("zero3", {}, (3, 2), id="zero3"),
    # 3 Psi and twice the tied embedding, less the persistent norms'
    pytest.param("zero3", NO_LIVE, (3, None), id="zero3-live-parameters-0"),
]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(("config", "zero", "volumes"), CELLS)
def test_four_ranks_send_the_closed_form(config, zero, volumes, corpus, tmp_path):
    cmd = launcher_command("accelerate", config)
    cmd[cmd.index("--config_file") + 1] = str(accelerate_config_with(config, zero, tmp_path))
    cmd[-1:-1] = ["--num_processes", "4"]  # before the script: an accelerate flag
    run = launch(cmd, [*corpus["flags"], *ARGS], tmp_path / "out")
    assert run.strategy["world_size"] == 4
    want = assert_closed_form(run)  # each kind to the byte, on every rank
    _, shape = launched(run)
    paper, measured = volumes
    for record in run.strategy["communication"]["per_rank"]:
        # The loss's and the norm's all-reduces left out: the volume of the parameters and gradients, in Psi.
        scalars = 2 * (record["kinds"]["all_reduce"]["payload_bytes"] - want.get("all_reduce", 0))
        psi = (record["volume_bytes"] - scalars) / (4 * shape.parameters)
        if measured is not None:
            assert psi == measured, (psi, record)
        assert (psi == paper) == (measured == paper), f"{psi} Psi against the paper's {paper}"


@pytest.mark.slow
@pytest.mark.multiproc
def test_sequence_parallel_sends_the_closed_form(corpus, tmp_path):
    """Ulysses over 2 ranks under ZeRO-3, twice (2 data-parallel x 2 sequence-parallel ranks): the all-to-alls of each
    layer's q, k, v and output (DeepSpeed runs them inside a custom operator, counted by name), the position ids'
    all-gathers, and ZeRO-3's own traffic over the 4 ranks, each to the byte."""
    yaml = (ROOT / "accelerate_configs" / "zero3_sp.yaml").read_text()
    yaml = yaml.replace("parallelism_config_dp_shard_size: 1", "parallelism_config_dp_shard_size: 2")
    yaml = yaml.replace("ds_configs/zero3.json", str(ROOT / "ds_configs" / "zero3.json"))
    (tmp_path / "sp.yaml").write_text(yaml)
    cmd = launcher_command("accelerate", "zero3_sp")
    cmd[cmd.index("--config_file") + 1] = str(tmp_path / "sp.yaml")
    cmd[-1:-1] = ["--num_processes", "4"]
    run = launch(cmd, [*corpus["flags"], *ARGS], tmp_path / "out")
    assert (run.strategy["strategy"], run.strategy["world_size"]) == ("zero3-sp2", 4)
    want = assert_closed_form(run)
    assert want["all_to_all"] > 0 and run.strategy["sequence_parallel"]["data_parallel_size"] == 2
