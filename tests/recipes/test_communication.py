"""What each data-parallel strategy sends, measured by the training script on 4 CPU ranks (gloo) and recorded in
strategy.json: each kind of collective's bytes equal the closed form for the settings in force (training/comms.py),
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

import json

import pytest
from communication import assert_closed_form, launched
from launching import ROOT, launch, launcher_command

ARGS = [
    "--preset=debug", "--max_steps=3", "--warmup_steps=1", "--per_device_train_batch_size=2", "--logging_steps=1",
    "--eval_steps=0", "--max_eval_batches=1", "--save_steps=0", "--sample_max_new_tokens=0",
]  # fmt: skip
NO_MULTI_RANK = {"use_multi_rank_bucket_allreduce": False}
NO_LIVE = {"stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0}

# (accelerate config, changes to its DeepSpeed JSON's zero_optimization, the volume in Psi: the paper's, measured)
CELLS = [
    pytest.param("ddp", {}, (2, 2), marks=pytest.mark.matrix),
    ("fsdp", {}, (3, None)),  # 3 Psi less the root group's once (kept after the forward): the closed form's
    pytest.param("fsdp_shard_grad_op", {}, (2, 2), marks=pytest.mark.matrix),
    pytest.param("zero1", {}, (2, 3), marks=pytest.mark.matrix),
    ("zero2", {}, (2, 3)),
    ("zero2", NO_MULTI_RANK, (2, 2)),
    ("zero3", {}, (3, 2)),
    ("zero3", NO_LIVE, (3, None)),  # 3 Psi and twice the tied embedding, less the persistent norms'
]


def config_with(config: str, zero: dict, tmp_path) -> str:
    """accelerate_configs/<config>.yaml, or a copy of it pointing at its JSON with `zero` applied."""
    yaml = ROOT / "accelerate_configs" / f"{config}.yaml"
    if not zero:
        return str(yaml)
    ds = json.loads((ROOT / "ds_configs" / f"{config}.json").read_text())
    ds["zero_optimization"].update(zero)
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    text = yaml.read_text().replace(f"ds_configs/{config}.json", str(tmp_path / "ds.json"))
    (tmp_path / "launch.yaml").write_text(text)
    return str(tmp_path / "launch.yaml")


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(("config", "zero", "volumes"), CELLS, ids=lambda v: str(v))
def test_four_ranks_send_the_closed_form(config, zero, volumes, corpus, tmp_path):
    cmd = launcher_command("accelerate", config)
    cmd[cmd.index("--config_file") + 1] = config_with(config, zero, tmp_path)
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
